// e4m3 by moving bits, 16 values to a 256-bit vector: the encoder of kVector tiles of bf16 rows
// and the decoder to bf16 of normal-code tiles under a power-of-two scale. Both SIMD paths include this
// (the AVX-512 one too: 16-bit lanes at 256 bits beat its fp32 lanes at 512, measured with
// `sparsekv bench codec`); anonymous namespace for the reason scalar_math.h gives.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "compress/scalar_math.h"

namespace sparsekv::compress {
namespace {

// E4m3NormalLanes for a kVector tile of bf16 values, 16 lanes at a time in their own 16-bit
// lanes (where widening to fp32 first handles 8). In a kVector tile x * inv is exact and normal
// (inv = 2^-k, every |x * inv| in [2^-6, 448]), so the product only moves x's exponent, and its
// bf16 bits are x's less k << 7. Rounding 7 mantissa bits to 3 is then E4m3NormalLanes on the
// top half of the fp32 bits (whose low half is zero): add 7 plus the lowest kept bit, less the
// exponent rebias (120 << 7), all folded into one constant; the magnitude stays below 0x800, so
// the sign bit rides along untouched. The code's magnitude is then bits 10..4, the sign bit 15.
inline __m256i E4m3FromBf16Lanes(__m256i x, __m256i bias) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi16(1));
  const __m256i t = _mm256_add_epi16(_mm256_add_epi16(x, bias), odd);
  // Magnitude to bits 14..8 (bit 11 of t, always 0, lands on 15), the sign over it, then down.
  const __m256i hi = _mm256_or_si256(_mm256_slli_epi16(t, 4),
                                     _mm256_and_si256(x, _mm256_set1_epi16(static_cast<short>(0x8000))));
  return _mm256_srli_epi16(hi, 8);
}

// A kVector tile of n (a multiple of 16) bf16 values to e4m3 codes, whose inv is 2^-k; bias16 is
// 7 - ((120 + k) << 7), which the SIMD planners put in TilePlan::e4m3_bf16_bias.
inline void StoreE4m3FromBf16(const uint8_t* src, uint32_t n, uint16_t bias16, uint8_t* dst) {
  const __m256i bias = _mm256_set1_epi16(static_cast<short>(bias16));
  uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = E4m3FromBf16Lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i)), bias);
    const __m256i b =
        E4m3FromBf16Lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i + 32)), bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8));
  }
  if (i < n) {
    const __m256i a = E4m3FromBf16Lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i)), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi16(a, a), 0xD8)));
  }
}

// Whether n (a multiple of 16) e4m3 codes are all normal numbers: no zero, subnormal or NaN
// code. With m = code & 0x7f, those are m < 8 and m == 0x7f, which m - 8 (wrapping) puts at
// 0x77 and above, so one unsigned max per 32 codes finds them.
inline bool AllNormalCodes(const uint8_t* codes, uint32_t n) {
  const __m256i m7f = _mm256_set1_epi8(0x7f), eight = _mm256_set1_epi8(8);
  __m256i worst = _mm256_setzero_si256();
  uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i c = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)), m7f);
    worst = _mm256_max_epu8(worst, _mm256_sub_epi8(c, eight));
  }
  __m128i w = _mm_max_epu8(_mm256_castsi256_si128(worst), _mm256_extracti128_si256(worst, 1));
  if (i < n) {
    const __m128i c = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)), _mm_set1_epi8(0x7f));
    w = _mm_max_epu8(w, _mm_sub_epi8(c, _mm_set1_epi8(8)));
  }
  const __m128i limit = _mm_set1_epi8(0x76);
  return _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(w, limit), w)) == 0xffff;  // every byte <= 0x76
}

// Normal e4m3 codes times 2^k (-120 <= k <= 119) are exact normal numbers with at most four
// significant bits, so their bf16 bits are the code's bits moved into place: the sign,
// then eeee mmm under the top of the mantissa, plus the exponent rebias (120 + k). Sign-extended
// codes shifted up put the sign on the top bit and the magnitude under it; one mask, one add.
inline void DecodeNormalE4m3ToBf16(const uint8_t* codes, int k, uint32_t n, uint8_t* dst) {
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(0x87f0));
  const __m256i bias = _mm256_set1_epi16(static_cast<short>((120 + k) << 7));
  for (uint32_t i = 0; i < n; i += 16) {
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256i b = _mm256_add_epi16(_mm256_and_si256(_mm256_slli_epi16(c, 4), mask), bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), b);
  }
}

// A tile to bf16 by bits when it can be (returns true, n values written): a power-of-two scale
// 2^k, -120 <= k <= 119 (every fp8 format's, in practice), and normal codes only. Else false,
// nothing written. Decoding to fp32 keeps the fp16 conversion: by bits it measured slower on
// both paths (`bench codec`, Intel Xeon: idx_fp8 0.38 of memcpy against 0.48 on AVX-512),
// its four bytes a value being bound by stores rather than by the conversion.
[[gnu::always_inline]] inline bool DecodeE4m3ToBf16ByBits(const uint8_t* codes, float scale, uint32_t n,
                                                          uint8_t* dst) {
  const uint32_t sb = FloatBits(scale);
  const uint32_t m = n & ~15u;
  if ((sb & 0x807fffffu) != 0 || sb < (7u << 23) || sb > (246u << 23) || m == 0 || !AllNormalCodes(codes, m)) {
    return false;
  }
  DecodeNormalE4m3ToBf16(codes, static_cast<int>(sb >> 23) - 127, m, dst);
  DecodeE4m3Ref<true>(codes + m, scale, n - m, dst + 2 * m);
  return true;
}

}  // namespace
}  // namespace sparsekv::compress
