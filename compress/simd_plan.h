// Planning four tiles at once on 128-bit vectors, for the SIMD paths (both include this after
// <immintrin.h>). Private to compress/; anonymous namespace for the reason scalar_math.h gives.
//
// Each tile's range pass leaves one accumulator per tile; a transposing max tree then puts the
// four tiles' results side by side, and each tile's power-of-two scale comes from its amax
// bits by ComputeTileQuant (scalar_math.h), exactly and without a division. That replaces four
// scalar reductions per group with a handful of vector ops, which matters because scalar work
// competes for the ports the value loops need.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "compress/scalar_math.h"

namespace sparsekv::compress {
namespace {

// Four accumulators of 8 unsigned words -> the max word of each, as (max << 16) in 32-bit lanes
// (a bf16 tile's max |x| as fp32 bits).
inline __m128i MaxWords4(__m128i a, __m128i b, __m128i c, __m128i d) {
  const __m128i ab =
      _mm_max_epu16(_mm_unpacklo_epi16(a, b), _mm_unpackhi_epi16(a, b));  // a b a b ...
  const __m128i cd = _mm_max_epu16(_mm_unpacklo_epi16(c, d), _mm_unpackhi_epi16(c, d));
  const __m128i abcd =
      _mm_max_epu16(_mm_unpacklo_epi32(ab, cd), _mm_unpackhi_epi32(ab, cd));  // a b c d a b c d
  const __m128i r = _mm_max_epu16(abcd, _mm_srli_si128(abcd, 8));
  return _mm_unpacklo_epi16(_mm_setzero_si128(), r);
}

// Four accumulators of 4 unsigned dwords -> the max dword of each.
inline __m128i MaxDwords4(__m128i a, __m128i b, __m128i c, __m128i d) {
  const __m128i ab = _mm_max_epu32(_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b));  // a b a b
  const __m128i cd = _mm_max_epu32(_mm_unpacklo_epi32(c, d), _mm_unpackhi_epi32(c, d));
  return _mm_max_epu32(_mm_unpacklo_epi64(ab, cd), _mm_unpackhi_epi64(ab, cd));
}

// Plans up to four e4m3 tiles from their max and min |x| bits (finite or not). Tiles with NaN
// or inf go through `plan_ref(i)`, the reference planner of tile i; the others' power-of-two
// scales are computed lane by lane.
template <class PlanRefFn>
[[gnu::always_inline]] inline void PlanFour(__m128i amax_bits, __m128i amin_bits, uint32_t count,
                                            ScaleRule rule, TilePlan* plans, PlanRefFn plan_ref) {
  // Bits at or above kInfBits: NaN or inf. (They are below 2^31, so a signed compare works.)
  const int nonfinite = _mm_movemask_ps(
      _mm_castsi128_ps(_mm_cmpgt_epi32(amax_bits, _mm_set1_epi32(static_cast<int>(kInfBits - 1)))));
  // Every e4m3 rule is a power of two: division-free, lane by lane.
  alignas(16) uint32_t amax[4], amin[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(amax), amax_bits);
  _mm_store_si128(reinterpret_cast<__m128i*>(amin), amin_bits);
  for (uint32_t i = 0; i < count; ++i) {
    if (nonfinite >> i & 1) continue;
    const TileQuant q = ComputeTileQuant(rule, amax[i]);
    // Rounding is monotonic, so the smallest |x| decides for the whole tile.
    plans[i].Set(q, q.prescale != 1.0f                        ? TileMode::kScalar
                    : BitsToFloat(amin[i]) * q.inv >= 0x1p-6f ? TileMode::kVector
                                                              : TileMode::kVectorAny);
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (nonfinite >> i & 1) plans[i] = plan_ref(i);
  }
}

}  // namespace
}  // namespace sparsekv::compress
