#pragma once

// A copy into memory the copier will not read again soon: a write lease's room in the daemon's
// host arena, which the daemon then hashes and the client never reads back.

#include <cstddef>

namespace sparsekv {

// Copies `n` bytes from `src` to `dst` (which must not overlap), as memcpy, but writes the
// destination with non-temporal (streaming) stores where the CPU has them (x86-64: SSE2, on
// every such CPU): the destination's lines are neither read for ownership nor kept in the
// cache. Copies under 4 KiB, and copies on other CPUs, are plain memcpy. The stores are fenced
// before it returns: another thread that is told of the copy afterwards sees all of it.
void StreamingCopy(void* dst, const void* src, size_t n);

// Whether StreamingCopy uses streaming stores on this build (false: it is memcpy).
bool StreamingCopyStreams();

}  // namespace sparsekv
