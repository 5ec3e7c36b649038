#include "allocator/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define SPARSEKV_STREAMING_STORES 1
#endif

namespace sparsekv {

void StreamingCopy(void* dst, const void* src, size_t n) {
#if SPARSEKV_STREAMING_STORES
  if (n >= 4096) {
    auto* d = static_cast<std::byte*>(dst);
    const auto* s = static_cast<const std::byte*>(src);
    // Up to the destination's next 64-byte line with memcpy, then whole lines streamed, then the
    // tail with memcpy.
    const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (size_t lines = n / 64; lines > 0; --lines) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
      d += 64;
      s += 64;
    }
    std::memcpy(d, s, n % 64);
    _mm_sfence();  // streaming stores are weakly ordered: visible before whatever follows
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

bool StreamingCopyStreams() {
#if SPARSEKV_STREAMING_STORES
  return true;
#else
  return false;
#endif
}

}  // namespace sparsekv
