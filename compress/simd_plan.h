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

#include <cstddef>
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

// Writes four plans at once: each lane's scale, prescale 1, inv and (ue8m0 | mode << 8 |
// e4m3_bf16_bias << 16) in the TilePlan layout (a 4 x 4 transpose, four 16-byte stores), where a
// field-by-field loop cost about a dozen scalar instructions a tile. `plans` has room for four even when fewer are asked.
[[gnu::always_inline]] inline void StorePlans4(TilePlan* plans, __m128 scale, __m128 inv, __m128i misc) {
  static_assert(sizeof(TilePlan) == 16 && offsetof(TilePlan, prescale) == 4 && offsetof(TilePlan, inv) == 8 &&
                    offsetof(TilePlan, ue8m0) == 12 && offsetof(TilePlan, mode) == 13 &&
                    offsetof(TilePlan, e4m3_bf16_bias) == 14,
                "StorePlans4 writes the TilePlan layout");
  const __m128 t0 = _mm_unpacklo_ps(scale, _mm_set1_ps(1.0f));  // s0 1 s1 1
  const __m128 t1 = _mm_unpackhi_ps(scale, _mm_set1_ps(1.0f));  // s2 1 s3 1
  const __m128 t2 = _mm_unpacklo_ps(inv, _mm_castsi128_ps(misc));  // i0 m0 i1 m1
  const __m128 t3 = _mm_unpackhi_ps(inv, _mm_castsi128_ps(misc));  // i2 m2 i3 m3
  float* out = reinterpret_cast<float*>(plans);
  _mm_store_ps(out, _mm_movelh_ps(t0, t2));
  _mm_store_ps(out + 4, _mm_movehl_ps(t2, t0));
  _mm_store_ps(out + 8, _mm_movelh_ps(t1, t3));
  _mm_store_ps(out + 12, _mm_movehl_ps(t3, t1));
}

// Plans up to four e4m3 tiles from their max and min |x| bits (finite or not). Tiles with NaN
// or inf go through `plan_ref(i)`, the reference planner of tile i; the others are planned four
// at once, as ComputeTileQuant (scalar_math.h) does it one at a time:
//  - k = floor(log2(amax)) - 8, plus one where the mantissa lies above 1.75 (448 * 2^(k-1)
//    would fall short), then raised to the rule's floor. The floor (2^-13 or 2^-22) lies above
//    every k a denormal or zero amax could give, so those need no case of their own: reading
//    their exponent field as 0 gives some k below the floor, which the floor replaces, as
//    ComputeTileQuant's denormal branch would.
//  - scale = 2^k, inv = 2^-k (normal for every k from the floor to 120: prescale stays 1).
//  - kVector where the smallest |x| times inv is at least 2^-6 (rounding is monotonic, so the
//    smallest decides for the whole tile), else kVectorAny.
// Scalar code per tile was most of an fp8 tile's encode time on AVX2 (perf, 64-value tiles).
// The four plans are written at once (StorePlans4), then any non-finite tile's replaced.
template <class PlanRefFn>
[[gnu::always_inline]] inline void PlanFour(__m128i amax_bits, __m128i amin_bits, uint32_t count,
                                            ScaleRule rule, TilePlan* plans, PlanRefFn plan_ref) {
  if (Pow2RuleMinExponent(rule) < -126) [[unlikely]] {  // no such rule today; this needs one above
    for (uint32_t i = 0; i < count; ++i) plans[i] = plan_ref(i);
    return;
  }
  // Bits at or above kInfBits: NaN or inf. (They are below 2^31, so a signed compare works.)
  const int nonfinite = _mm_movemask_ps(
      _mm_castsi128_ps(_mm_cmpgt_epi32(amax_bits, _mm_set1_epi32(static_cast<int>(kInfBits - 1)))));
  const __m128i above = _mm_cmpgt_epi32(_mm_and_si128(amax_bits, _mm_set1_epi32(0x7fffff)),
                                        _mm_set1_epi32(0x600000));  // -1 where above
  __m128i k = _mm_sub_epi32(_mm_sub_epi32(_mm_srli_epi32(amax_bits, 23), _mm_set1_epi32(127 + 8)), above);
  k = _mm_max_epi32(k, _mm_set1_epi32(Pow2RuleMinExponent(rule)));
  const __m128i scale = _mm_slli_epi32(_mm_add_epi32(k, _mm_set1_epi32(127)), 23);
  const __m128i inv = _mm_slli_epi32(_mm_sub_epi32(_mm_set1_epi32(127), k), 23);
  const __m128 vector = _mm_cmpge_ps(_mm_mul_ps(_mm_castsi128_ps(amin_bits), _mm_castsi128_ps(inv)),
                                     _mm_set1_ps(0x1p-6f));  // all ones: kVector
  static_assert(static_cast<int>(TileMode::kVector) == 0 && static_cast<int>(TileMode::kVectorAny) == 1);
  const __m128i mode = _mm_andnot_si128(_mm_castps_si128(vector), _mm_set1_epi32(1 << 8));
  // E4m3FromBf16Lanes' constant: 7 less the rebias (120 + k) << 7, in the top 16 bits.
  const __m128i bias = _mm_slli_epi32(_mm_sub_epi32(_mm_set1_epi32(7), _mm_slli_epi32(_mm_add_epi32(k, _mm_set1_epi32(120)), 7)), 16);
  StorePlans4(plans, _mm_castsi128_ps(scale), _mm_castsi128_ps(inv),
              _mm_or_si128(_mm_or_si128(_mm_add_epi32(k, _mm_set1_epi32(127)), mode), bias));
  if (nonfinite & ((1 << count) - 1)) [[unlikely]] {
    for (uint32_t i = 0; i < count; ++i) {
      if (nonfinite >> i & 1) plans[i] = plan_ref(i);
    }
  }
}

// Plans up to four int8 tiles from their max |x| bits, as ComputeTileQuant's linear rule does
// one at a time: scale = max(amax, 1e-8) / 127 and inv = 1 / scale, correctly rounded divisions
// four lanes at once (the same results as one at a time). Two scalar divisions per tile were a
// fifth of an indexer key's AVX2 encode time (perf). Tiles with NaN or inf go to `plan_ref(i)`.
template <class PlanRefFn>
[[gnu::always_inline]] inline void PlanInt8Four(__m128i amax_bits, uint32_t count, TilePlan* plans,
                                                PlanRefFn plan_ref) {
  const int nonfinite = _mm_movemask_ps(
      _mm_castsi128_ps(_mm_cmpgt_epi32(amax_bits, _mm_set1_epi32(static_cast<int>(kInfBits - 1)))));
  const __m128 amax = _mm_castsi128_ps(amax_bits);
  const __m128 floor = _mm_set1_ps(kInt8AmaxFloor);
  // amax > floor ? amax : floor, as ComputeTileQuant writes it (finite lanes; the rest go to plan_ref).
  const __m128 kept = _mm_blendv_ps(floor, amax, _mm_cmpgt_ps(amax, floor));
  const __m128 scale = _mm_div_ps(kept, _mm_set1_ps(127.0f));
  const __m128 inv = _mm_div_ps(_mm_set1_ps(1.0f), scale);
  static_assert(static_cast<int>(TileMode::kVector) == 0);
  StorePlans4(plans, scale, inv, _mm_set1_epi32(127));  // ue8m0 127 (unused), kVector
  if (nonfinite & ((1 << count) - 1)) [[unlikely]] {
    for (uint32_t i = 0; i < count; ++i) {
      if (nonfinite >> i & 1) plans[i] = plan_ref(i);
    }
  }
}

// The SIMD planners' loop, shared by both paths: tiles (tile i at src + i * stride) four at a
// time, each through the path's range pass `range(tile, max_acc, nmin_acc)` (its TileRange),
// the four results side by side as fp32 bits (the min uncomplemented; zero when not kWantMin),
// then `plan_four(first tile, tiles in the group, amax bits, amin bits)`.
template <bool kBf16In, bool kWantMin, class RangeFn, class PlanFourFn>
[[gnu::always_inline]] inline void PlanTileGroups(const uint8_t* src, size_t stride, uint32_t count, RangeFn range,
                                                  PlanFourFn plan_four) {
  for (uint32_t g = 0; g < count; g += 4) {
    const uint32_t m = count - g < 4 ? count - g : 4;
    __m128i mx[4], nmn[4];
    for (uint32_t i = 0; i < 4; ++i) {
      mx[i] = nmn[i] = _mm_setzero_si128();
      if (i < m) range(src + (g + i) * stride, mx[i], nmn[i]);
    }
    __m128i amax, amin = _mm_setzero_si128();
    if constexpr (kBf16In) {
      amax = MaxWords4(mx[0], mx[1], mx[2], mx[3]);
      if constexpr (kWantMin) {
        amin = _mm_xor_si128(MaxWords4(nmn[0], nmn[1], nmn[2], nmn[3]), _mm_set1_epi32(static_cast<int>(0xffff0000u)));
      }
    } else {
      amax = MaxDwords4(mx[0], mx[1], mx[2], mx[3]);
      if constexpr (kWantMin) amin = _mm_xor_si128(MaxDwords4(nmn[0], nmn[1], nmn[2], nmn[3]), _mm_set1_epi32(-1));
    }
    plan_four(g, m, amax, amin);
  }
}

}  // namespace
}  // namespace sparsekv::compress
