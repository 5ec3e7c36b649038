// CopyWithRecordChecksum's AVX-512 (compiled with -mavx512f): one 512-bit register of eight lanes.
#if defined(__x86_64__)
// GCC 12 reports the intrinsics' own placeholder operands (_mm*_undefined_*) as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "allocator/copy_checksum_impl.h"

namespace sparsekv::copy_checksum {
namespace {

struct Avx512Kernel {
  __m512i a;
  Avx512Kernel() {
    a = _mm512_setr_epi64(kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3, kPrime64_4, kPrime32_2, kPrime64_5,
                          kPrime32_1);
  }
  void Mix(__m512i d, const unsigned char* sec) {
    const __m512i key = _mm512_xor_si512(d, _mm512_loadu_si512(sec));
    const __m512i product = _mm512_mul_epu32(key, _mm512_srli_epi64(key, 32));
    const __m512i swapped = _mm512_shuffle_epi32(d, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
    a = _mm512_add_epi64(product, _mm512_add_epi64(a, swapped));
  }
  void Acc(const unsigned char* in, const unsigned char* sec) {
    Mix(_mm512_loadu_si512(in), sec);
  }
  void AccCopy(const unsigned char* in, unsigned char* out, const unsigned char* sec) {
    const __m512i d = _mm512_loadu_si512(in);
    _mm512_storeu_si512(out, d);
    Mix(d, sec);
  }
  void Scramble(const unsigned char* sec) {
    const __m512i prime = _mm512_set1_epi64(kPrime32_1);
    __m512i x = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
    x = _mm512_xor_si512(x, _mm512_loadu_si512(sec));
    const __m512i lo = _mm512_mul_epu32(x, prime);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
    a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
  void Store(uint64_t out[8]) const { _mm512_storeu_si512(out, a); }
};

}  // namespace

uint64_t DriveAvx512(unsigned char* d, const unsigned char* s, size_t n, const unsigned char* p) {
  return Drive<Avx512Kernel>(d, s, n, p);
}

}  // namespace sparsekv::copy_checksum
#endif  // __x86_64__
