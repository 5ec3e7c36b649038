// The AVX2 path (AVX2 + F16C + FMA). Built with those flags only (and -ffp-contract=off: no
// multiply-add is fused unless written so, since a fused one rounds once where the reference
// rounds twice) and chosen at run time. The same operations as the
// AVX-512 path (kernels_avx512_impl.h says how each one matches scalar_math.h), 8 lanes at a
// time, with vector compares and blends where AVX-512 has mask registers.
#if defined(__x86_64__)
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

namespace sparsekv::compress {
namespace {

inline __m256i Set1(uint32_t v) {
  return _mm256_set1_epi32(static_cast<int>(v));
}

template <bool kBf16In>
constexpr uint32_t kInBytes = kBf16In ? 2 : 4;

template <bool kBf16In>
inline __m256 Load8(const uint8_t* p) {
  if constexpr (kBf16In) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// One tile's max |x| and min |x| bits, folded to 128 bits: 8 words (bf16 input: the top halves
// of the fp32 bits) or 4 dwords (fp32 input). The min comes back complemented, so that both
// finish with the same max tree (simd_plan.h). n is a multiple of 16.
template <bool kBf16In, bool kWantMin>
[[gnu::always_inline]] inline void TileRange(const uint8_t* src, uint32_t n, __m128i& max_acc, __m128i& nmin_acc) {
  if constexpr (kBf16In) {
    const __m256i abs16 = _mm256_set1_epi16(0x7fff);
    __m256i mx = _mm256_setzero_si256();
    __m256i mn = _mm256_set1_epi16(-1);
#pragma GCC unroll 8
    for (uint32_t i = 0; i < n; i += 16) {
      const __m256i a = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i)), abs16);
      mx = _mm256_max_epu16(mx, a);
      if constexpr (kWantMin) mn = _mm256_min_epu16(mn, a);
    }
    max_acc = _mm_max_epu16(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    if constexpr (kWantMin) {
      nmin_acc =
          _mm_xor_si128(_mm_min_epu16(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1)),
                        _mm_set1_epi32(-1));
    }
  } else {
    const __m256i abs32 = Set1(kAbsMask);
    __m256i mx = _mm256_setzero_si256();
    __m256i mn = Set1(0xffffffffu);
    for (uint32_t i = 0; i < n; i += 8) {
      const __m256i a = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 4 * i)), abs32);
      mx = _mm256_max_epu32(mx, a);
      if constexpr (kWantMin) mn = _mm256_min_epu32(mn, a);
    }
    max_acc = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    if constexpr (kWantMin) {
      nmin_acc =
          _mm_xor_si128(_mm_min_epu32(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1)),
                        _mm_set1_epi32(-1));
    }
  }
}

// Reorders packs(packs(a, b), packs(c, d)) (128-bit lanes interleaved) into a, b, c, d order.
inline __m256i PackOrder() {
  return _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
}

// E4m3FromFloatRef for finite 2^-6 <= |v| < 464, on the signed bits (see the AVX-512 twin).
inline __m256i E4m3NormalLanes(__m256 v) {
  const __m256i vb = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(vb, 20), Set1(1));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(vb, Set1(0x7ffffu - (120u << 23))), odd);
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(t, 20), Set1(0x7f)),
                         _mm256_and_si256(_mm256_srli_epi32(vb, 24), Set1(0x80)));
}

// E4m3FromFloatRef for any finite |v| < 464: lanes below 2^-6 take the 2^14 magic addition.
inline __m256i E4m3AnyLanes(__m256 v) {
  const __m256i vb = _mm256_castps_si256(v);
  const __m256i a = _mm256_and_si256(vb, Set1(kAbsMask));
  const __m256i small = _mm256_cmpgt_epi32(Set1(kE4m3MinNormalBits), a);
  __m256i code = E4m3NormalLanes(v);
  if (!_mm256_testz_si256(small, small)) {
    const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f));
    const __m256i sub =
        _mm256_or_si256(_mm256_sub_epi32(_mm256_castps_si256(sum), Set1(0x46800000u)),
                        _mm256_and_si256(_mm256_srli_epi32(vb, 24), Set1(0x80)));
    code = _mm256_blendv_epi8(code, sub, small);
  }
  return code;
}

// Bf16FromFloatRef on 8 lanes, left in the low half of each 32-bit lane. Without kMayNaN the
// caller knows no lane is NaN (a finite scale times finite values), and the NaN fix-up, three
// of the eight instructions, is left out.
template <bool kMayNaN = true>
inline __m256i Bf16Lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(
      u, _mm256_add_epi32(Set1(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), Set1(1))));
  if constexpr (!kMayNaN) return _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, Set1(0x00400000)), nan), 16);
}

template <bool kMayNaN = true>
inline void StoreBf16x16(uint8_t* dst, __m256 lo, __m256 hi) {
  const __m256i p = _mm256_packus_epi32(Bf16Lanes<kMayNaN>(lo), Bf16Lanes<kMayNaN>(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(p, 0xD8));
}

// 16 values exactly representable in bf16 (an e4m3 value, four significant bits, times a power
// of two, normal): their bf16 is the top half of their fp32 bits, no rounding to do.
inline void StoreExactBf16x16(uint8_t* dst, __m256 lo, __m256 hi) {
  const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                        _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(p, 0xD8));
}

inline void StoreBf16x8(uint8_t* dst, __m256 v) {
  const __m256i r = Bf16Lanes(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// 16 int8 values times a scale to bf16, Bf16FromFloatRef(float(q) * scale) for each, where
// s16 = scale * 2^-16 exactly (scale zero or at least 2^-110) and scale is finite. Each 32-bit
// lane of the sign-extended words holds an even value (low half) and an odd one (high half), and
// both are taken from there without a shuffle: the odd one masked is q * 2^16, the even one
// shifted up is q * 2^16 too, and times s16 each gives q * scale's own product (the same real
// number, so the same rounding). The two products' high halves, blended, are the 16 truncated
// bf16 in order, and their low halves the 16 remainders; rounding to nearest even is then done
// in 16-bit lanes: up where remainder + 0x7fff + (bf16 & 1) carries out of 16 bits, which bit
// 15 of the unsigned average (remainder + (0x7ffe | (bf16 & 1)) + 1) / 2 tells. 16 operations
// (and the store) for 16 values, where widening each half to 32 bits and packing took 18.
inline __m256i Int8x16ToBf16(const uint8_t* q, __m256 s16) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256 even = _mm256_cvtepi32_ps(_mm256_slli_epi32(w, 16));
  const __m256 odd = _mm256_cvtepi32_ps(_mm256_and_si256(w, Set1(0xffff0000u)));
  const __m256i pe = _mm256_castps_si256(_mm256_mul_ps(even, s16));
  const __m256i po = _mm256_castps_si256(_mm256_mul_ps(odd, s16));
  const __m256i top = _mm256_blend_epi16(_mm256_srli_epi32(pe, 16), po, 0xAA);
  const __m256i rest = _mm256_blend_epi16(pe, _mm256_slli_epi32(po, 16), 0xAA);
  const __m256i bias = _mm256_or_si256(_mm256_and_si256(top, _mm256_set1_epi16(1)), _mm256_set1_epi16(0x7ffe));
  return _mm256_add_epi16(top, _mm256_srli_epi16(_mm256_avg_epu16(rest, bias), 15));
}

// Canonical quiet NaN with each code's sign, where a code (8 of them) is a NaN code.
inline __m256 FixNaNLanes(__m256 v, __m128i codes8) {
  const __m256i c = _mm256_cvtepi8_epi32(codes8);
  const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, Set1(0x7f)), Set1(0x7f));
  const __m256i canonical =
      _mm256_or_si256(_mm256_and_si256(c, Set1(0x80000000u)), Set1(kQuietNaNBits));
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(canonical), _mm256_castsi256_ps(nan));
}

#define SPARSEKV_INLINE [[gnu::always_inline]] inline
#define SPARSEKV_LAMBDA_INLINE __attribute__((always_inline))

template <bool kBf16In, class LanesFn>
SPARSEKV_INLINE void StoreCodes(const uint8_t* src, uint32_t n, __m256 inv, uint8_t* dst,
                                LanesFn lanes) {
  constexpr uint32_t in = kInBytes<kBf16In>;
  auto pack = [](__m256i a, __m256i b) {
    if constexpr (LanesFn::kSigned) {
      return _mm256_packs_epi16(a, b);
    } else {
      return _mm256_packus_epi16(a, b);
    }
  };
  for (uint32_t i = 0; i < n; i += 16) {
    const __m256i c0 = lanes(_mm256_mul_ps(Load8<kBf16In>(src + i * in), inv));
    const __m256i c1 = lanes(_mm256_mul_ps(Load8<kBf16In>(src + (i + 8) * in), inv));
    if (i + 32 <= n) {
      const __m256i c2 = lanes(_mm256_mul_ps(Load8<kBf16In>(src + (i + 16) * in), inv));
      const __m256i c3 = lanes(_mm256_mul_ps(Load8<kBf16In>(src + (i + 24) * in), inv));
      const __m256i p = pack(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_permutevar8x32_epi32(p, PackOrder()));
      i += 16;
    } else {
      const __m256i p = pack(_mm256_packs_epi32(c0, c1), _mm256_setzero_si256());
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(p, PackOrder())));
    }
  }
}

// int8 values of a tile, rne(fp32(x / scale)) (scalar_math.h, kInt8NearHalf): for bf16 input the
// quotient corrected with fused multiply-adds; for fp32 input rne(x * inv), returning false
// (having written garbage) when some product lies too near a half-integer to tell, and the
// tile must be divided. Divides itself with kDivide.
template <bool kBf16In, bool kDivide>
SPARSEKV_INLINE bool StoreInt8(const uint8_t* src, uint32_t n, float inv, float scale, uint8_t* dst) {
  constexpr uint32_t in = kInBytes<kBf16In>;
  const __m256 vinv = _mm256_set1_ps(inv), vscale = _mm256_set1_ps(scale);
  const __m256 abs = _mm256_castsi256_ps(Set1(kAbsMask));
  const __m256 near_half = _mm256_set1_ps(kInt8NearHalf);
  __m256 near = _mm256_setzero_ps();
  auto lanes = [&](uint32_t i) {
    const __m256 x = Load8<kBf16In>(src + i * in);
    if constexpr (kDivide) {
      return _mm256_cvtps_epi32(_mm256_div_ps(x, vscale));  // MXCSR: nearest even
    } else if constexpr (kBf16In) {
      const __m256 q = _mm256_mul_ps(x, vinv);
      const __m256 r = _mm256_fnmadd_ps(q, vscale, x);  // x - q * scale, exact
      return _mm256_cvtps_epi32(_mm256_fmadd_ps(r, vinv, q));
    } else {
      const __m256 y = _mm256_mul_ps(x, vinv);
      const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      near = _mm256_or_ps(near, _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(y, r), abs), near_half, _CMP_GT_OQ));
      return _mm256_cvttps_epi32(r);  // r is whole: no rounding left
    }
  };
  if constexpr (kBf16In && !kDivide) {
    // bf16 widened by interleaving with zero words (one shuffle each) rather than by a zero
    // extension and a shift, which would take a slot on the two ports the multiply-adds need.
    // The interleave takes values 0-3 and 8-11 (low) and 4-7 and 12-15 (high) of 16; the
    // signed 32-to-16 pack, working per 128-bit lane, puts them back in order.
    const __m256i zero = _mm256_setzero_si256();
    auto ratio = [&](__m256 x) {
      const __m256 q = _mm256_mul_ps(x, vinv);
      const __m256 r = _mm256_fnmadd_ps(q, vscale, x);  // x - q * scale, exact
      return _mm256_cvtps_epi32(_mm256_fmadd_ps(r, vinv, q));
    };
    auto words = [&](uint32_t i) {  // 16 values as 16 int16 in order
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
      return _mm256_packs_epi32(ratio(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h))),
                                ratio(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h))));
    };
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256i p = _mm256_packs_epi16(words(i), words(i + 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permute4x64_epi64(p, 0xD8));
    }
    if (i < n) {
      const __m256i w = words(i);
      const __m256i p = _mm256_packs_epi16(w, w);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0xD8)));
    }
    return true;
  }
  for (uint32_t i = 0; i < n; i += 16) {
    const __m256i c0 = lanes(i), c1 = lanes(i + 8);
    if (i + 32 <= n) {
      const __m256i c2 = lanes(i + 16), c3 = lanes(i + 24);
      // Values in [-128, 127]: the signed packs saturate nothing.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(p, PackOrder()));
      i += 16;
    } else {
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_setzero_si256());
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(p, PackOrder())));
    }
  }
  return _mm256_testz_ps(near, near) != 0;
}
struct E4m3NormalFn {
  static constexpr bool kSigned = false;
  __m256i operator()(__m256 v) const { return E4m3NormalLanes(v); }
};
struct E4m3AnyFn {
  static constexpr bool kSigned = false;
  __m256i operator()(__m256 v) const { return E4m3AnyLanes(v); }
};

// Whether any of n codes (n % 16 == 0 counted; the rest is the caller's scalar tail) is NaN.
inline bool AnyNaNCode(const uint8_t* codes, uint32_t n) {
  const __m256i m7f = _mm256_set1_epi8(0x7f);
  __m256i any = _mm256_setzero_si256();
  uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(c, m7f), m7f));
  }
  int mask = _mm256_movemask_epi8(any);
  if (i + 16 <= n) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    mask |= _mm_movemask_epi8(
        _mm_cmpeq_epi8(_mm_and_si128(c, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)));
  }
  return mask != 0;
}

struct Avx2Prims {
  template <bool kBf16In>
  SPARSEKV_INLINE static void PlanInt8(const uint8_t* src, size_t stride, uint32_t n, uint32_t count,
                                       TilePlan* plans) {
    PlanTileGroups<kBf16In, false>(
        src, stride, count, [n](const uint8_t* t, __m128i& mx, __m128i& nmn) SPARSEKV_LAMBDA_INLINE { TileRange<kBf16In, false>(t, n, mx, nmn); },
        [&](uint32_t g, uint32_t m, __m128i amax, __m128i) SPARSEKV_LAMBDA_INLINE {
          PlanInt8Four(amax, m, plans + g, [&](uint32_t i) { return PlanInt8Ref<kBf16In>(src + (g + i) * stride, n); });
        });
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void PlanE4m3(const uint8_t* src, size_t stride, uint32_t n,
                                       uint32_t count, ScaleRule rule, TilePlan* plans) {
    PlanTileGroups<kBf16In, true>(
        src, stride, count, [n](const uint8_t* t, __m128i& mx, __m128i& nmn) SPARSEKV_LAMBDA_INLINE { TileRange<kBf16In, true>(t, n, mx, nmn); },
        [&](uint32_t g, uint32_t m, __m128i amax, __m128i amin) SPARSEKV_LAMBDA_INLINE {
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
    const __m256 inv = _mm256_set1_ps(plan.inv);
    if (plan.mode == TileMode::kVector) [[likely]] {
      if constexpr (kBf16In) {
        StoreE4m3FromBf16(src, n, plan.e4m3_bf16_bias, dst);
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
      for (; i + 16 <= n; i += 16)
        StoreBf16x16(dst + 2 * i, Load8<false>(src + 4 * i), Load8<false>(src + 4 * (i + 8)));
      NarrowToBf16Ref(src + 4 * i, n - i, dst + 2 * i);
    }
  }

  template <bool kBf16In>
  SPARSEKV_INLINE static void ToFp32(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      uint32_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + 4 * i), Load8<true>(src + 2 * i));
      WidenBf16Ref(src + 2 * i, n - i, dst + 4 * i);
    } else {
      __builtin_memcpy(dst, src, 4 * size_t{n});
    }
  }

  template <bool kBf16Out>
  SPARSEKV_INLINE static void DecodeInt8(const uint8_t* q, float scale, uint32_t n, uint8_t* dst) {
    const __m256 s = _mm256_set1_ps(scale);
    auto lanes = [&](uint32_t i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
    };
    uint32_t i = 0;
    if constexpr (kBf16Out) {
      const uint32_t exponent = FloatBits(scale) >> 23 & 0xff;
      if ((exponent >= 17 && exponent < 255) || (FloatBits(scale) & kAbsMask) == 0) [[likely]] {
        const __m256 s16 = _mm256_set1_ps(scale * 0x1p-16f);  // exact: normal or zero
        for (; i + 16 <= n; i += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), Int8x16ToBf16(q + i, s16));
        }
      } else if (__builtin_isfinite(scale)) {  // q * scale is finite or ±inf, never NaN
        for (; i + 16 <= n; i += 16) StoreBf16x16<false>(dst + 2 * i, lanes(i), lanes(i + 8));
      } else {
        for (; i + 16 <= n; i += 16) StoreBf16x16(dst + 2 * i, lanes(i), lanes(i + 8));
      }
      for (; i + 8 <= n; i += 8) StoreBf16x8(dst + 2 * i, lanes(i));
      DecodeInt8Ref<true>(q + i, scale, n - i, dst + 2 * i);
    } else {
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(reinterpret_cast<float*>(dst + 4 * i), lanes(i));
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
    const __m256 s = _mm256_set1_ps(scale256);
    const bool has_nan = AnyNaNCode(codes, n);  // once per tile rather than in every vector
    // Finite codes times a finite scale are never NaN (an infinite one times a zero code is).
    const bool may_nan = has_nan || !__builtin_isfinite(scale);
    // A power-of-two scale (every fp8 format's) from 2^-117 to 2^119 makes every product an
    // exact normal number of at most four significant bits: exact in bf16.
    const uint32_t sb = FloatBits(scale);
    const bool exact = !may_nan && (sb & 0x807fffffu) == 0 && sb >= (10u << 23) && sb <= (246u << 23);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                         _mm256_set1_epi16(static_cast<short>(0xBF80)));
      __m256 lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s);
      __m256 hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s);
      if (has_nan) [[unlikely]] {
        lo = FixNaNLanes(lo, c);
        hi = FixNaNLanes(hi, _mm_srli_si128(c, 8));
      }
      if constexpr (kBf16Out) {
        if (exact) [[likely]] {
          StoreExactBf16x16(dst + 2 * i, lo, hi);
        } else if (may_nan) {
          StoreBf16x16(dst + 2 * i, lo, hi);
        } else {
          StoreBf16x16<false>(dst + 2 * i, lo, hi);
        }
      } else {
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + 4 * i), lo);
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + 4 * (i + 8)), hi);
      }
    }
    DecodeE4m3Ref<kBf16Out>(codes + i, scale, n - i, dst + out * i);
  }
};

constexpr PathKernels kAvx2Kernels = MakePathKernels<Avx2Prims>(SimdPath::kAvx2);

}  // namespace

const PathKernels* Avx2PathKernels() {
  return &kAvx2Kernels;
}

}  // namespace sparsekv::compress

#else
#include "compress/kernels.h"
namespace sparsekv::compress {
const PathKernels* Avx2PathKernels() {
  return nullptr;
}
}  // namespace sparsekv::compress
#endif
