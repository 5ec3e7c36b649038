// Planning four tiles at once on 128-bit vectors, for the SIMD paths (both include this after
// <immintrin.h>). Private to compress/; anonymous namespace for the reason scalar_math.h gives.
//
// Each tile's range pass leaves one accumulator per tile; a transposing max tree then puts the
// four tiles' results side by side, and the linear scale rules run on all four lanes with the
// same IEEE operations, in the same order, as ComputeTileQuant (scalar_math.h). That replaces
// four scalar reductions and eight scalar divisions per group with a handful of vector ops,
// which matters because scalar work competes for the ports the value loops need.
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

// ComputeTileQuant for a linear rule (n = 127 or 448) on four finite amax values.
struct Quant4 {
  __m128 scale, prescale, inv;
};
inline Quant4 LinearQuant4(__m128i amax_bits, float n) {
  const __m128 amax = _mm_castsi128_ps(amax_bits);
  const __m128 vn = _mm_set1_ps(n);
  const __m128 min_normal = _mm_set1_ps(0x1p-126f);
  __m128 s = _mm_div_ps(amax, vn);
  // A denormal scale that undershoots moves up one ulp (an integer add on its bits).
  const __m128 bump =
      _mm_and_ps(_mm_cmplt_ps(s, min_normal), _mm_cmplt_ps(_mm_mul_ps(s, vn), amax));
  s = _mm_castsi128_ps(
      _mm_sub_epi32(_mm_castps_si128(s), _mm_castps_si128(bump)));  // bump is all ones: -(-1)
  const __m128i zero = _mm_cmpeq_epi32(amax_bits, _mm_setzero_si128());
  const __m128 normal = _mm_or_ps(_mm_cmpge_ps(s, min_normal), _mm_castsi128_ps(zero));
  const __m128 p = _mm_blendv_ps(_mm_set1_ps(0x1p64f), _mm_set1_ps(1.0f), normal);
  const __m128 inv =
      _mm_andnot_ps(_mm_castsi128_ps(zero), _mm_div_ps(_mm_set1_ps(1.0f), _mm_mul_ps(s, p)));
  return {s, p, inv};
}

// Lane i of each vector into plans[i] (i < count), with the mode each lane's facts give.
// `vector_ok`: lanes the SIMD value loop can take; `any`: of those, lanes that need its
// subnormal-aware form (fp8 only).
[[gnu::always_inline]] inline void StorePlans4(const Quant4& q, int vector_ok, int any,
                                               uint32_t count, TilePlan* plans) {
  alignas(16) float scale[4], prescale[4], inv[4];
  _mm_store_ps(scale, q.scale);
  _mm_store_ps(prescale, q.prescale);
  _mm_store_ps(inv, q.inv);
  for (uint32_t i = 0; i < count; ++i) {
    plans[i].scale = scale[i];
    plans[i].prescale = prescale[i];
    plans[i].inv = inv[i];
    plans[i].ue8m0 = 127;
    plans[i].mode = !(vector_ok >> i & 1)
                        ? TileMode::kScalar
                        : ((any >> i & 1) ? TileMode::kVectorAny : TileMode::kVector);
  }
}

// Plans up to four e4m3 tiles from their max and min |x| bits (finite or not). Tiles with NaN
// or inf go through `plan_ref(i)`, the reference planner of tile i; power-of-two rules compute
// their (division-free) scales lane by lane; the linear rule runs on all four lanes at once.
template <class PlanRefFn>
[[gnu::always_inline]] inline void PlanFour(__m128i amax_bits, __m128i amin_bits, uint32_t count,
                                            ScaleRule rule, TilePlan* plans, PlanRefFn plan_ref) {
  // Bits at or above kInfBits: NaN or inf. (They are below 2^31, so a signed compare works.)
  const int nonfinite = _mm_movemask_ps(
      _mm_castsi128_ps(_mm_cmpgt_epi32(amax_bits, _mm_set1_epi32(static_cast<int>(kInfBits - 1)))));
  if (rule == ScaleRule::kLinear127 || rule == ScaleRule::kLinear448) {
    const Quant4 q = LinearQuant4(amax_bits, rule == ScaleRule::kLinear127 ? 127.0f : 448.0f);
    const int unit = _mm_movemask_ps(_mm_cmpeq_ps(q.prescale, _mm_set1_ps(1.0f)));
    // Rounding is monotonic, so the smallest |x| decides for the whole tile.
    const __m128 low = _mm_mul_ps(_mm_castsi128_ps(amin_bits), q.inv);
    const int any = _mm_movemask_ps(_mm_cmplt_ps(low, _mm_set1_ps(0x1p-6f)));
    StorePlans4(q, unit & ~nonfinite, any, count, plans);
  } else {
    alignas(16) uint32_t amax[4], amin[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(amax), amax_bits);
    _mm_store_si128(reinterpret_cast<__m128i*>(amin), amin_bits);
    for (uint32_t i = 0; i < count; ++i) {
      if (nonfinite >> i & 1) continue;
      const TileQuant q = ComputeTileQuant(rule, amax[i]);
      plans[i].Set(q, q.prescale != 1.0f                        ? TileMode::kScalar
                      : BitsToFloat(amin[i]) * q.inv >= 0x1p-6f ? TileMode::kVector
                                                                : TileMode::kVectorAny);
    }
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (nonfinite >> i & 1) plans[i] = plan_ref(i);
  }
}

}  // namespace
}  // namespace sparsekv::compress
