// `sparsekv stress suspend`: SIGKILL an engine that decodes, logs, suspends and resumes many
// requests, and check that nothing acknowledged is lost and every resumed request goes on as if
// never stopped (issue 35).
//
// The child (the same binary, re-executed with a hidden subcommand) runs a toy engine
// (toy_decoder.h) over an OffloadedCache (a V4-shaped model: window, CSA, HCA and compressor
// state; host and SSD tiers, fdatasync; the cache write-back in odd incarnations, write-through
// in even ones, so that suspends write history records and resumes read both kinds of block)
// and a RequestLog: several threads each
// decode a few requests token by token, appending every token to the log (acknowledged once
// durable), now and then suspending a request (OffloadedCache::Suspend, then
// RequestLog::Suspended with the tail key) and resuming it, finishing requests and starting new
// ones. It reports each acknowledgement to the parent through a pipe. At start it recovers the
// log and resumes every unfinished request from its last suspension, computing again only the
// tokens after the restored state, and checks each of those steps produces the logged token.
// The parent kills it at random moments `kill_cycles` times; after every other kill it appends
// random bytes to the newest log segment (a torn write the next open must cut), and in the
// other cycles the child stalls right after its first durable finish record and is killed as
// soon as the parent hears of the stall (not of the finish). Then the parent opens the log itself and checks every acknowledged token is there and, decoding each request's prompt afresh without
// interruption, that every logged token is the one an uninterrupted run produces.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct SuspendStressOptions {
  // Working directory; the run creates and removes a subdirectory. Must be set.
  std::string dir;
  // Seconds of child run time in all, split across the kill cycles. Default: 10.
  double seconds = 10;
  // SIGKILLs (and restarts) of the child. Default: 5.
  int kill_cycles = 5;
  // Requests decoded at once, and threads decoding them. Default: 8 and 2.
  uint32_t requests = 8;
  uint32_t threads = 2;
  // A request is finished once it holds this many tokens (a new one starts). Default: 400.
  uint32_t max_request_tokens = 400;
  // Seed for prompts, choices and kill times; 0 draws one. Default: 0.
  uint64_t seed = 0;
  bool keep = false;
  // How to start the child. Default: {"/proc/self/exe", "stress", "suspend-child"}.
  std::vector<std::string> child_command = {"/proc/self/exe", "stress", "suspend-child"};
};

// Keys: kill_cycles, requests_started, requests_finished, acknowledged_tokens, lost_tokens,
// resurrected (finished requests found unfinished), finished_unacknowledged (finished in the log
// by a child killed before it said so; right, not lost), finish_stalls (cycles whose child
// stalled there on purpose), resumes, resumed_exact, recomputed_tokens,
// history_blocks_written (blocks suspends wrote as history records, write-back incarnations),
// child_mismatches (recomputed steps whose token differed from the log), differing_requests
// (the final check against uninterrupted runs), checked_requests, checked_tokens, suspends,
// torn_tails_injected, torn_tails_cut (opens that cut a tail), torn_bytes_cut, seconds, seed,
// ok.
Result<nlohmann::json> RunSuspendStress(const SuspendStressOptions& options);

struct SuspendStressChildOptions {
  std::string dir;
  int ack_fd = -1;
  uint32_t incarnation = 0;
  uint64_t seed = 1;
  uint32_t requests = 8;
  uint32_t threads = 2;
  uint32_t max_request_tokens = 400;
  // The first thread to finish a request stops right after the finish record is durable,
  // before telling the parent, so the kill lands between the two.
  bool stall_after_finish = false;
};

// Runs until killed; returns only on an error.
Status RunSuspendStressChild(const SuspendStressChildOptions& options);

}  // namespace sparsekv::bench
