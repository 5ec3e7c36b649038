#pragma once

// A copy into memory the copier will not read again soon: a write lease's room in the daemon's
// host arena, which the client never reads back, or the destinations of a read larger than the
// cache.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace sparsekv {

// Copies `n` bytes from `src` to `dst` (which must not overlap), as memcpy, but writes the
// destination with non-temporal (streaming) stores where the CPU has them (x86-64: SSE2, on
// every such CPU): the destination's lines are neither read for ownership nor kept in the
// cache. Copies under 4 KiB, and copies on other CPUs, are plain memcpy. The stores are fenced
// before it returns: another thread that is told of the copy afterwards sees all of it.
void StreamingCopy(void* dst, const void* src, size_t n);

// Whether StreamingCopy uses streaming stores on this build (false: it is memcpy).
bool StreamingCopyStreams();

// StreamingCopy with `stream`, memcpy without.
inline void CopyBytes(void* dst, const void* src, size_t n, bool stream) {
  if (stream) {
    StreamingCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

// A read (a GetInto, a load into an engine's pieces) of at least this many bytes in all is
// written with streaming stores: more than the last-level cache holds (32 MiB on the EPYC VM
// measured), so its destinations would not stay there, and plain stores would first read every
// destination line. Measured with bench/python/vllm_backend_bench.py (128 V3.2 blocks, 394 MB)
// on a 2-vCPU EPYC (Zen 4) VM: load 43-45 ms plain, 32 ms streamed, against 28-30 ms for
// torch's copy_.
inline constexpr uint64_t kStreamReadBytes = 32u << 20;

}  // namespace sparsekv
