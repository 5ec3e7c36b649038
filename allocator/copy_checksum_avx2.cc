// CopyWithRecordChecksum's AVX2 (compiled with -mavx2): two 256-bit registers of four lanes.
#if defined(__x86_64__)
// GCC 12 reports the intrinsics' own placeholder operands (_mm*_undefined_*) as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "allocator/copy_checksum_impl.h"

namespace sparsekv::copy_checksum {
namespace {

struct Avx2Kernel {
  __m256i a[2];
  Avx2Kernel() {
    a[0] = _mm256_setr_epi64x(kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3);
    a[1] = _mm256_setr_epi64x(kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1);
  }
  void Half(int h, __m256i d, const unsigned char* sec) {
    const __m256i key = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sec + 32 * h)));
    const __m256i product = _mm256_mul_epu32(key, _mm256_srli_epi64(key, 32));
    const __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
    a[h] = _mm256_add_epi64(product, _mm256_add_epi64(a[h], swapped));
  }
  void Acc(const unsigned char* in, const unsigned char* sec) {
    for (int h = 0; h < 2; ++h) Half(h, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 * h)), sec);
  }
  void AccCopy(const unsigned char* in, unsigned char* out, const unsigned char* sec) {
    for (int h = 0; h < 2; ++h) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 * h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * h), d);
      Half(h, d, sec);
    }
  }
  void Scramble(const unsigned char* sec) {
    const __m256i prime = _mm256_set1_epi64x(kPrime32_1);
    for (int h = 0; h < 2; ++h) {
      __m256i x = _mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47));
      x = _mm256_xor_si256(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sec + 32 * h)));
      const __m256i lo = _mm256_mul_epu32(x, prime);
      const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
      a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
  }
  void Store(uint64_t out[8]) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4), a[1]);
  }
};

}  // namespace

uint64_t DriveAvx2(unsigned char* d, const unsigned char* s, size_t n, const unsigned char* p) {
  return Drive<Avx2Kernel>(d, s, n, p);
}

}  // namespace sparsekv::copy_checksum
#endif  // __x86_64__
