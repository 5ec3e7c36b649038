// The AVX-512 path's tile primitives (F/BW/VL/DQ + F16C), included by kernels_avx512.cc and,
// with SPARSEKV_AVX512_HW_BF16 set to 1, by kernels_avx512_bf16.cc, whose unit is also built
// with -mavx512bf16. Private to compress/. Everything is in an anonymous namespace: each unit
// keeps its own copy (see scalar_math.h).
//
// Each primitive computes exactly scalar_math.h's operations, 16 lanes at a time:
//  - one pass over the tile finds max |x| and min |x| as unsigned maxima and minima of |x|'s
//    bits (for bf16 input on 16-bit lanes, 32 at a time), which order finite values like floats
//    and put NaN and inf above them all; a tile with either, or one small enough to need a
//    prescale, goes to the scalar reference;
//  - the scale comes from ComputeTileQuant, the same scalar code every path calls;
//  - int8: the quotient x / scale, from one multiply by 1/scale and a correction with two fused
//    multiply-adds (bf16 input), or from the multiply alone where no product lies within 2^-14
//    of a half-integer (fp32 input; such a tile is divided); scalar_math.h says why either is
//    exact;
//  - e4m3: one fp32 multiply, then the reference's integer rounding of the bits. If the tile's
//    min |x| lands below 2^-6 (e4m3 subnormals, zeros) the tile takes a slower loop whose lanes
//    below 2^-6 use the reference's 2^14 magic addition; most tiles have none;
//  - decode: value * scale in one rounding. e4m3 codes become fp16 with two integer ops (their
//    bits are an fp16's shifted by 8 exponents, subnormals included), widen exactly with
//    VCVTPH2PS, and the 2^8 is folded into the scale: (v * 2^-8) * (scale * 2^8) is the same
//    real product as v * scale, so its one rounding is the same. NaN codes are looked for once
//    per tile;
//  - bf16 output uses VCVTNE2PS2BF16 where it agrees with the reference, that is unless a lane
//    is an fp32 denormal (the instruction flushes those); a tile whose scale rules denormal
//    products out skips the per-vector check.
#pragma once

// GCC 12 warns that the _mm*_undefined_*() placeholders inside its own intrinsics "may be" or
// "are used uninitialized" (GCC bug 105593): a false positive in its headers, not in this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>

#include "compress/e4m3_bits.h"
#include "compress/format_drivers.h"
#include "compress/kernels.h"
#include "compress/scalar_math.h"
#include "compress/simd_plan.h"

#ifndef SPARSEKV_AVX512_HW_BF16
#error "define SPARSEKV_AVX512_HW_BF16 to 0 or 1 before including kernels_avx512_impl.h"
#endif

namespace sparsekv::compress {
namespace {

constexpr bool kHwBf16 = SPARSEKV_AVX512_HW_BF16;

inline __m512i Set1(uint32_t v) {
  return _mm512_set1_epi32(static_cast<int>(v));
}

template <bool kBf16In>
constexpr uint32_t kInBytes = kBf16In ? 2 : 4;

// 16 values as fp32 (bf16 widens exactly).
template <bool kBf16In>
inline __m512 Load16(const uint8_t* p) {
  if constexpr (kBf16In) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(p);
  }
}

// One tile's max |x| and min |x| bits, folded to 128 bits: 8 words (bf16 input: the top halves
// of the fp32 bits) or 4 dwords (fp32 input). The min comes back complemented, so that both
// finish with the same max tree (simd_plan.h). n is a multiple of 16.
template <bool kBf16In, bool kWantMin>
inline void TileRange(const uint8_t* src, uint32_t n, __m128i& max_acc, __m128i& nmin_acc) {
  if constexpr (kBf16In) {
    const __m512i abs16 = _mm512_set1_epi16(0x7fff);
    __m512i mx = _mm512_setzero_si512();
    __m512i mn = _mm512_set1_epi16(-1);
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(src + 2 * i), abs16);
      mx = _mm512_max_epu16(mx, a);
      if constexpr (kWantMin) mn = _mm512_min_epu16(mn, a);
    }
    if (i < n) {  // 16 left
      const __m256i a =
          _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i)),
                           _mm256_set1_epi16(0x7fff));
      mx = _mm512_max_epu16(mx, _mm512_zextsi256_si512(a));
      if constexpr (kWantMin)
        mn = _mm512_min_epu16(mn, _mm512_inserti64x4(_mm512_set1_epi16(-1), a, 0));
    }
    const __m256i mx256 =
        _mm256_max_epu16(_mm512_castsi512_si256(mx), _mm512_extracti64x4_epi64(mx, 1));
    max_acc = _mm_max_epu16(_mm256_castsi256_si128(mx256), _mm256_extracti128_si256(mx256, 1));
    if constexpr (kWantMin) {
      const __m256i mn256 =
          _mm256_min_epu16(_mm512_castsi512_si256(mn), _mm512_extracti64x4_epi64(mn, 1));
      nmin_acc = _mm_xor_si128(
          _mm_min_epu16(_mm256_castsi256_si128(mn256), _mm256_extracti128_si256(mn256, 1)),
          _mm_set1_epi32(-1));
    }
  } else {
    const __m512i abs32 = Set1(kAbsMask);
    __m512i mx = _mm512_setzero_si512();
    __m512i mn = Set1(0xffffffffu);
    for (uint32_t i = 0; i < n; i += 16) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(src + 4 * i), abs32);
      mx = _mm512_max_epu32(mx, a);
      if constexpr (kWantMin) mn = _mm512_min_epu32(mn, a);
    }
    const __m256i mx256 =
        _mm256_max_epu32(_mm512_castsi512_si256(mx), _mm512_extracti64x4_epi64(mx, 1));
    max_acc = _mm_max_epu32(_mm256_castsi256_si128(mx256), _mm256_extracti128_si256(mx256, 1));
    if constexpr (kWantMin) {
      const __m256i mn256 =
          _mm256_min_epu32(_mm512_castsi512_si256(mn), _mm512_extracti64x4_epi64(mn, 1));
      nmin_acc = _mm_xor_si128(
          _mm_min_epu32(_mm256_castsi256_si128(mn256), _mm256_extracti128_si256(mn256, 1)),
          _mm_set1_epi32(-1));
    }
  }
}

// Reorders the bytes of packs(packs(a, b), packs(c, d)), which interleave 128-bit lanes, back
// into a, b, c, d order.
inline __m512i PackOrder() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// E4m3FromFloatRef for finite 2^-6 <= |v| < 464, the common case (the tile scale guarantees
// |v| <= 448 * (1 + 2^-21)). Works on the signed bits: with an exponent of at least 121 the
// rebias cannot borrow from the sign, and the select puts the sign back at bit 7.
inline __m512i E4m3NormalLanes(__m512 v) {
  const __m512i vb = _mm512_castps_si512(v);
  const __mmask16 odd = _mm512_test_epi32_mask(vb, Set1(1u << 20));
  __m512i t = _mm512_add_epi32(vb, Set1(0x7ffffu - (120u << 23)));
  t = _mm512_mask_add_epi32(t, odd, t, Set1(1));
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 20), _mm512_srli_epi32(vb, 24), Set1(0x7f),
                                   0xE4);  // c ? a : b
}

// E4m3FromFloatRef for any finite |v| < 464: lanes below 2^-6 (e4m3 subnormals and zeros) take
// the reference's single rounding by adding 2^14, whose ulp is 2^-9.
inline __m512i E4m3AnyLanes(__m512 v) {
  const __m512i vb = _mm512_castps_si512(v);
  const __m512i a = _mm512_and_si512(vb, Set1(kAbsMask));
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, Set1(kE4m3MinNormalBits));
  __m512i code = E4m3NormalLanes(v);
  if (small != 0) {
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f));
    const __m512i sub =
        _mm512_sub_epi32(_mm512_castps_si512(sum), Set1(0x46800000u));  // bits of 2^14
    const __m512i signed_sub =
        _mm512_ternarylogic_epi32(sub, _mm512_srli_epi32(vb, 24), Set1(0x80), 0xF8);
    code = _mm512_mask_mov_epi32(code, small, signed_sub);  // 0xF8 above: a | (b & c)
  }
  return code;
}

// Bf16FromFloatRef on 16 lanes.
inline __m256i Bf16Soft(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  __m512i r = _mm512_add_epi32(
      u, _mm512_add_epi32(Set1(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), Set1(1))));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, Set1(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// 32 int8 values times a scale to bf16, as the AVX2 path's Int8x16ToBf16 does 16 (its comment
// says why it is exact; s16 = scale * 2^-16 exactly, scale finite): the even and odd value of
// each 32-bit lane widened in place, multiplied, their bf16 halves blended under a mask and
// rounded in 16-bit lanes. 15 operations for 32 values where Bf16Soft's 32-bit rounding and
// narrowing took about 24; used where there is no VCVTNE2PS2BF16.
inline __m512i Int8x32ToBf16(const uint8_t* q, __m512 s16) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512i pe = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(w, 16)), s16));
  const __m512i po =
      _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, Set1(0xffff0000u))), s16));
  constexpr __mmask32 kOdd = 0xAAAAAAAAu;
  const __m512i top = _mm512_mask_blend_epi16(kOdd, _mm512_srli_epi32(pe, 16), po);
  const __m512i rest = _mm512_mask_blend_epi16(kOdd, pe, _mm512_slli_epi32(po, 16));
  // 0x7ffe | (top & 1): 0xF8 is a | (b & c).
  const __m512i bias = _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x7ffe), top, _mm512_set1_epi16(1), 0xF8);
  return _mm512_add_epi16(top, _mm512_srli_epi16(_mm512_avg_epu16(rest, bias), 15));
}

constexpr int kDenormalClass = 0x20;  // VFPCLASSPS: denormal

// `no_denormals`: the caller knows no lane is an fp32 denormal.
inline void StoreBf16x16(uint8_t* dst, __m512 v, bool no_denormals) {
  __m256i r;
  if constexpr (kHwBf16) {
    if (no_denormals || _mm512_fpclass_ps_mask(v, kDenormalClass) == 0) {
      r = (__m256i)_mm512_cvtneps_pbh(v);
    } else {
      r = Bf16Soft(v);
    }
  } else {
    r = Bf16Soft(v);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), r);
}

inline void StoreBf16x32(uint8_t* dst, __m512 lo, __m512 hi, bool no_denormals) {
  if constexpr (kHwBf16) {
    if (no_denormals || (_mm512_fpclass_ps_mask(lo, kDenormalClass) |
                         _mm512_fpclass_ps_mask(hi, kDenormalClass)) == 0) {
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      return;
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), Bf16Soft(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), Bf16Soft(hi));
}

// True when no product of `scale` and a value of magnitude >= `min_value` can be an fp32
// denormal, given min_value * threshold >= 2^-126 (zero, NaN and inf scales qualify).
inline bool NoDenormalProducts(float scale, float threshold) {
  const float a = __builtin_fabsf(scale);
  return !(a < threshold) || a == 0.0f;
}

// Canonical quiet NaN with each code's sign, for the lanes in `nan`.
inline __m512 FixNaNLanes(__m512 v, __m128i codes16, __mmask16 nan) {
  const __m512i sign = _mm512_and_si512(_mm512_cvtepi8_epi32(codes16), Set1(0x80000000u));
  return _mm512_mask_mov_ps(v, nan,
                            _mm512_castsi512_ps(_mm512_or_si512(sign, Set1(kQuietNaNBits))));
}

// Whether any of n codes is a NaN code (0x7f or 0xff); the last n % 32 are left to the caller's
// scalar tail, which handles NaN codes itself.
inline bool AnyNaNCode(const uint8_t* codes, uint32_t n) {
  const __m512i m7f = _mm512_set1_epi8(0x7f);
  __mmask64 any = 0;
  uint32_t i = 0;
  for (; i + 64 <= n; i += 64) {
    any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(codes + i), m7f), m7f);
  }
  if (i + 32 <= n) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    any |=
        _mm256_cmpeq_epi8_mask(_mm256_and_si256(c, _mm256_set1_epi8(0x7f)), _mm256_set1_epi8(0x7f));
  }
  return any != 0;
}

// fp16 bits of value(code) * 2^-8, 32 codes: sign-extend, shift the 7 magnitude bits into
// place, and clear bit 14 (a copy of the sign).
inline __m512i E4m3ToHalfBits(__m256i codes) {
  return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7),
                          _mm512_set1_epi16(static_cast<short>(0xBF80)));
}

// The primitives are forced inline so that the format loops hoist their constants out of the
// per-token and per-key loops.
#define SPARSEKV_INLINE [[gnu::always_inline]] inline

template <bool kBf16In, class LanesFn>
SPARSEKV_INLINE void StoreCodes(const uint8_t* src, uint32_t n, __m512 inv, uint8_t* dst,
                                LanesFn lanes) {
  constexpr uint32_t in = kInBytes<kBf16In>;
  uint32_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i c0 = lanes(_mm512_mul_ps(Load16<kBf16In>(src + i * in), inv));
    const __m512i c1 = lanes(_mm512_mul_ps(Load16<kBf16In>(src + (i + 16) * in), inv));
    const __m512i c2 = lanes(_mm512_mul_ps(Load16<kBf16In>(src + (i + 32) * in), inv));
    const __m512i c3 = lanes(_mm512_mul_ps(Load16<kBf16In>(src + (i + 48) * in), inv));
    // int8 values are in [-127, 127] and e4m3 codes in [0, 255]: the signed 32->16 pack keeps
    // both, then a signed (int8) or unsigned (codes) 16->8 pack; nothing saturates.
    __m512i p;
    if constexpr (LanesFn::kSigned) {
      p = _mm512_packs_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
    } else {
      p = _mm512_packus_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
    }
    _mm512_storeu_si512(dst + i, _mm512_permutexvar_epi32(PackOrder(), p));
  }
  for (; i < n; i += 16) {
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(dst + i),
        _mm512_cvtepi32_epi8(lanes(_mm512_mul_ps(Load16<kBf16In>(src + i * in), inv))));
  }
}

// int8 values of a tile, rne(fp32(x / scale)) (scalar_math.h, kInt8NearHalf): for bf16 input the
// quotient corrected with fused multiply-adds; for fp32 input rne(x * inv), returning false
// (having written garbage) when some product lies too near a half-integer to tell, and the
// tile must be divided. Divides itself with kDivide.
template <bool kBf16In, bool kDivide>
SPARSEKV_INLINE bool StoreInt8(const uint8_t* src, uint32_t n, float inv, float scale, uint8_t* dst) {
  constexpr uint32_t in = kInBytes<kBf16In>;
  const __m512 vinv = _mm512_set1_ps(inv), vscale = _mm512_set1_ps(scale);
  const __m512 near_half = _mm512_set1_ps(kInt8NearHalf);
  __mmask16 near = 0;
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  auto lanes = [&](uint32_t i) {
    const __m512 x = Load16<kBf16In>(src + i * in);
    if constexpr (kDivide) {
      return _mm512_cvt_roundps_epi32(_mm512_div_ps(x, vscale), kRne);
    } else if constexpr (kBf16In) {
      const __m512 q = _mm512_mul_ps(x, vinv);
      const __m512 r = _mm512_fnmadd_ps(q, vscale, x);  // x - q * scale, exact
      return _mm512_cvt_roundps_epi32(_mm512_fmadd_ps(r, vinv, q), kRne);
    } else {
      const __m512 y = _mm512_mul_ps(x, vinv);
      const __m512 r = _mm512_roundscale_ps(y, kRne);
      near |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(y, r)), near_half, _CMP_GT_OQ);
      return _mm512_cvttps_epi32(r);  // r is whole: no rounding left
    }
  };
  uint32_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i c0 = lanes(i), c1 = lanes(i + 16), c2 = lanes(i + 32), c3 = lanes(i + 48);
    // Values in [-128, 127]: the signed packs saturate nothing.
    const __m512i p = _mm512_packs_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
    _mm512_storeu_si512(dst + i, _mm512_permutexvar_epi32(PackOrder(), p));
  }
  for (; i < n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(lanes(i)));
  return near == 0;
}
struct E4m3NormalFn {
  static constexpr bool kSigned = false;
  __m512i operator()(__m512 v) const { return E4m3NormalLanes(v); }
};
struct E4m3AnyFn {
  static constexpr bool kSigned = false;
  __m512i operator()(__m512 v) const { return E4m3AnyLanes(v); }
};

struct Avx512Prims {
  template <bool kBf16In>
  SPARSEKV_INLINE static void PlanInt8(const uint8_t* src, size_t stride, uint32_t n, uint32_t count,
                                       TilePlan* plans) {
    PlanTileGroups<kBf16In, false>(
        src, stride, count, [n](const uint8_t* t, __m128i& mx, __m128i& nmn) { TileRange<kBf16In, false>(t, n, mx, nmn); },
        [&](uint32_t g, uint32_t m, __m128i amax, __m128i) {
          PlanInt8Four(amax, m, plans + g, [&](uint32_t i) { return PlanInt8Ref<kBf16In>(src + (g + i) * stride, n); });
        });
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void PlanE4m3(const uint8_t* src, size_t stride, uint32_t n,
                                       uint32_t count, ScaleRule rule, TilePlan* plans) {
    PlanTileGroups<kBf16In, true>(
        src, stride, count, [n](const uint8_t* t, __m128i& mx, __m128i& nmn) { TileRange<kBf16In, true>(t, n, mx, nmn); },
        [&](uint32_t g, uint32_t m, __m128i amax, __m128i amin) {
          PlanFour(amax, amin, m, rule, plans + g,
                   [&](uint32_t i) { return PlanE4m3Ref<kBf16In>(src + (g + i) * stride, n, rule); });
        });
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void ApplyInt8(const uint8_t* src, uint32_t n, const TilePlan& plan,
                                        uint8_t* dst) {
    if (plan.mode != TileMode::kVector) {
      ApplyInt8Ref<kBf16In>(src, n, plan, dst);
    } else if (!StoreInt8<kBf16In, false>(src, n, plan.inv, plan.scale, dst)) [[unlikely]] {
      StoreInt8<kBf16In, true>(src, n, plan.inv, plan.scale, dst);
    }
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void ApplyE4m3(const uint8_t* src, uint32_t n, const TilePlan& plan,
                                        uint8_t* dst) {
    const __m512 inv = _mm512_set1_ps(plan.inv);
    if (plan.mode == TileMode::kVector) [[likely]] {
      if constexpr (kBf16In) {
        StoreE4m3FromBf16(src, n, plan.e4m3_bf16_bias, dst);  // e4m3_bits.h
      } else {
        StoreCodes<kBf16In>(src, n, inv, dst, E4m3NormalFn{});
      }
    } else if (plan.mode == TileMode::kVectorAny) {
      StoreCodes<kBf16In>(src, n, inv, dst, E4m3AnyFn{});
    } else {
      ApplyE4m3Ref<kBf16In>(src, n, plan, dst);
    }
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void ToBf16(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      __builtin_memcpy(dst, src, 2 * size_t{n});
    } else {
      uint32_t i = 0;
      for (; i + 32 <= n; i += 32) {
        StoreBf16x32(dst + 2 * i, _mm512_loadu_ps(src + 4 * i), _mm512_loadu_ps(src + 4 * (i + 16)),
                     false);
      }
      for (; i + 16 <= n; i += 16) StoreBf16x16(dst + 2 * i, _mm512_loadu_ps(src + 4 * i), false);
      NarrowToBf16Ref(src + 4 * i, n - i, dst + 2 * i);
    }
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void ToFp32(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      uint32_t i = 0;
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + 4 * i, Load16<true>(src + 2 * i));
      WidenBf16Ref(src + 2 * i, n - i, dst + 4 * i);
    } else {
      __builtin_memcpy(dst, src, 4 * size_t{n});
    }
  }

  template <bool kBf16Out>
  SPARSEKV_INLINE static void DecodeInt8(const uint8_t* q, float scale, uint32_t n, uint8_t* dst) {
    const __m512 s = _mm512_set1_ps(scale);
    auto lanes = [&](uint32_t i) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
    };
    uint32_t i = 0;
    if constexpr (kBf16Out) {
      if constexpr (!kHwBf16) {
        const uint32_t exponent = FloatBits(scale) >> 23 & 0xff;
        if ((exponent >= 17 && exponent < 255) || (FloatBits(scale) & kAbsMask) == 0) [[likely]] {
          const __m512 s16 = _mm512_set1_ps(scale * 0x1p-16f);  // exact: normal or zero
          for (; i + 32 <= n; i += 32) {
            _mm512_storeu_si512(dst + 2 * i, Int8x32ToBf16(q + i, s16));
          }
        }
      }
      const bool no_denormals = NoDenormalProducts(scale, 0x1p-126f);  // |q| >= 1
      for (; i + 32 <= n; i += 32) StoreBf16x32(dst + 2 * i, lanes(i), lanes(i + 16), no_denormals);
      for (; i + 16 <= n; i += 16) StoreBf16x16(dst + 2 * i, lanes(i), no_denormals);
      DecodeInt8Ref<true>(q + i, scale, n - i, dst + 2 * i);
    } else {
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + 4 * i, lanes(i));
      DecodeInt8Ref<false>(q + i, scale, n - i, dst + 4 * i);
    }
  }

  template <bool kBf16Out>
  SPARSEKV_INLINE static void DecodeE4m3(const uint8_t* codes, float scale, uint32_t n,
                                         uint8_t* dst) {
    constexpr uint32_t out = kBf16Out ? 2 : 4;
    if constexpr (kBf16Out) {
      if (DecodeE4m3ToBf16ByBits(codes, scale, n, dst)) [[likely]] return;  // e4m3_bits.h
    }
    const float scale256 = scale * 256.0f;
    if (__builtin_isinf(scale256) && !__builtin_isinf(scale)) {  // scale >= 2^120: no fold
      DecodeE4m3Ref<kBf16Out>(codes, scale, n, dst);
      return;
    }
    const __m512 s = _mm512_set1_ps(scale256);
    const bool no_denormals = NoDenormalProducts(scale, 0x1p-117f);  // |value| >= 2^-9
    // NaN codes are rare: look for them once per tile rather than in every vector.
    const bool has_nan = AnyNaNCode(codes, n);
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
      const __m512i h = E4m3ToHalfBits(c);
      __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
      __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
      if (has_nan) [[unlikely]] {
        const __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(c, _mm256_set1_epi8(0x7f)),
                                                     _mm256_set1_epi8(0x7f));
        lo = FixNaNLanes(lo, _mm256_castsi256_si128(c), static_cast<__mmask16>(nan));
        hi = FixNaNLanes(hi, _mm256_extracti128_si256(c, 1), static_cast<__mmask16>(nan >> 16));
      }
      if constexpr (kBf16Out) {
        StoreBf16x32(dst + 2 * i, lo, hi, no_denormals);
      } else {
        _mm512_storeu_ps(dst + 4 * i, lo);
        _mm512_storeu_ps(dst + 4 * (i + 16), hi);
      }
    }
    DecodeE4m3Ref<kBf16Out>(codes + i, scale, n - i, dst + out * i);
  }
};

}  // namespace
}  // namespace sparsekv::compress
