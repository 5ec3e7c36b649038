// Progress of a long command (bench, stress, replay) on stderr, only while stderr is a
// terminal: one line, redrawn five times a second, with the command, what it is doing now (a
// note its code sets) and the seconds since it started; cleared when it ends. When stderr is a
// file or a pipe nothing is printed, so logs and JSON output stay clean.
// Thread safety: every function is thread-safe.
#pragma once

#include <string>

namespace sparsekv::bench {

// Starts the line for `command` when stderr is a terminal; a second start replaces the first.
void ProgressStart(std::string command);
// What the command is doing now ("kill cycle 3 of 12"); shown from the next redraw.
void ProgressNote(std::string note);
// Clears the line and stops redrawing.
void ProgressStop();
// Whether a line is being drawn.
bool ProgressActive();

}  // namespace sparsekv::bench
