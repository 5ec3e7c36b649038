#pragma once

// Include this instead of <xxhash.h>. On x86-64 it routes the XXH3 calls through the run-time
// dispatch that Debian's libxxhash carries (AVX-512, AVX2 or SSE2, chosen on the first call).
// The plain entry points of that library are built for SSE2 only; measured on this project's
// Sapphire Rapids VM with 64 KiB inputs, a one-shot XXH3_64bits ran at 13 GB/s against 59 GB/s
// dispatched, and the streaming XXH3_64bits_update at 3.8 GB/s against 54 GB/s. Every record
// checksum and frame checksum goes through these calls.

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#if defined(__x86_64__)
// Replaces XXH3_64bits, XXH3_64bits_update, XXH3_128bits... with their _dispatch versions.
#include <xxh_x86dispatch.h>
#endif
