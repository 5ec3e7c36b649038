// The AArch64 NEON path (Advanced SIMD, which every AArch64 CPU has, so it is always chosen
// there). Built with -ffp-contract=off like the others: a multiply-add is fused only where
// written so. It computes exactly scalar_math.h's operations, as the x86 paths do:
//  - planning: one NEON pass finds a tile's max and min |x| bits (unsigned max and min of the
//    bits, which order finite values like floats and put NaN and inf above them), the across-
//    vector max and min reduce them, and the scale comes from ComputeTileQuant, the same scalar
//    code every path calls; kVector and kVectorAny are chosen as simd_plan.h's PlanFour chooses;
//  - int8 values of bf16 rows: x * inv corrected with two fused multiply-adds (scalar_math.h
//    says why that is the correctly rounded quotient), rounded to nearest even by FCVTNS; of fp32
//    rows: divided, which AArch64 does in vectors;
//  - e4m3 codes of kVector tiles: of bf16 rows in 16-bit lanes, the bits plus one constant (the
//    x86 paths' e4m3_bits.h trick); of fp32 rows, one multiply and the reference's integer
//    rounding of the bits. Other tiles take the reference loop;
//  - decode: int8 times scale in one rounding, then the reference's integer rounding to bf16;
//    e4m3 to bf16 by moving bits where the scale is a power of two and every code is normal, to
//    fp32 through an exact fp16 widening with 2^8 folded into the scale. Anything else (NaN codes,
//    non-finite scales) goes to the reference loop.
// The suite (every path against scalar, bit for bit) runs on this path under qemu-aarch64:
// tests/neon/run.sh, the NeonPath test.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>

#include "compress/format_drivers.h"
#include "compress/kernels.h"
#include "compress/scalar_math.h"

namespace sparsekv::compress {
namespace {

inline uint16x8_t LoadU16x8(const uint8_t* p) {
  return vreinterpretq_u16_u8(vld1q_u8(p));
}
inline uint32x4_t LoadU32x4(const uint8_t* p) {
  return vreinterpretq_u32_u8(vld1q_u8(p));
}

// A tile's max and min |x| bits as fp32 bits (n a multiple of 16).
template <bool kBf16In>
inline void TileRange(const uint8_t* src, uint32_t n, uint32_t& amax_bits, uint32_t& amin_bits) {
  if constexpr (kBf16In) {
    const uint16x8_t abs = vdupq_n_u16(0x7fff);
    uint16x8_t mx = vdupq_n_u16(0), mn = vdupq_n_u16(0xffff);
    for (uint32_t i = 0; i < n; i += 8) {
      const uint16x8_t a = vandq_u16(LoadU16x8(src + 2 * i), abs);
      mx = vmaxq_u16(mx, a);
      mn = vminq_u16(mn, a);
    }
    amax_bits = uint32_t{vmaxvq_u16(mx)} << 16;
    amin_bits = uint32_t{vminvq_u16(mn)} << 16;
  } else {
    const uint32x4_t abs = vdupq_n_u32(kAbsMask);
    uint32x4_t mx = vdupq_n_u32(0), mn = vdupq_n_u32(0xffffffffu);
    for (uint32_t i = 0; i < n; i += 4) {
      const uint32x4_t a = vandq_u32(LoadU32x4(src + 4 * i), abs);
      mx = vmaxq_u32(mx, a);
      mn = vminq_u32(mn, a);
    }
    amax_bits = vmaxvq_u32(mx);
    amin_bits = vminvq_u32(mn);
  }
}

// 8 values as two fp32 vectors (bf16 widens exactly).
template <bool kBf16In>
inline void Load8(const uint8_t* p, float32x4_t& lo, float32x4_t& hi) {
  if constexpr (kBf16In) {
    const uint16x8_t h = LoadU16x8(p);
    lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
    hi = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
  } else {
    lo = vld1q_f32(reinterpret_cast<const float*>(p));
    hi = vld1q_f32(reinterpret_cast<const float*>(p + 16));
  }
}

// Two vectors of int32 (values in [-128, 127] or saturated by FCVTNS) to 8 signed bytes,
// saturating as the reference clamps.
inline int8x8_t NarrowToInt8(int32x4_t lo, int32x4_t hi) {
  return vqmovn_s16(vcombine_s16(vqmovn_s32(lo), vqmovn_s32(hi)));
}

// E4m3FromFloatRef of finite 2^-6 <= |v| < 464, on the bits (the x86 paths' E4m3NormalLanes).
inline uint16x4_t E4m3Normal4(float32x4_t v) {
  const uint32x4_t vb = vreinterpretq_u32_f32(v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(vb, 20), vdupq_n_u32(1));
  const uint32x4_t t = vaddq_u32(vaddq_u32(vb, vdupq_n_u32(0x7ffffu - (120u << 23))), odd);
  const uint32x4_t code = vorrq_u32(vandq_u32(vshrq_n_u32(t, 20), vdupq_n_u32(0x7f)),
                                    vandq_u32(vshrq_n_u32(vb, 24), vdupq_n_u32(0x80)));
  return vmovn_u32(code);
}

// E4m3FromBf16Lanes (e4m3_bits.h) on 8 bf16 values of a kVector tile: the bits plus `bias`
// (7 - ((120 + k) << 7) for inv = 2^-k) and the lowest kept bit; the code is bits 10..4 with
// the sign bit 15 over them.
inline uint8x8_t E4m3FromBf16x8(uint16x8_t x, uint16x8_t bias) {
  const uint16x8_t odd = vandq_u16(vshrq_n_u16(x, 4), vdupq_n_u16(1));
  const uint16x8_t t = vaddq_u16(vaddq_u16(x, bias), odd);
  const uint16x8_t hi = vorrq_u16(vshlq_n_u16(t, 4), vandq_u16(x, vdupq_n_u16(0x8000)));
  return vshrn_n_u16(hi, 8);
}

// Bf16FromFloatRef of 8 values known not to be NaN.
inline uint16x8_t Bf16NoNaN8(float32x4_t lo, float32x4_t hi) {
  auto round = [](float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    return vshrn_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), odd), 16);
  };
  return vcombine_u16(round(lo), round(hi));
}

// Bf16FromFloatRef of 4 values, NaN included: a NaN keeps its top half with the quiet bit set.
inline uint16x4_t Bf16Any4(uint32x4_t u) {
  const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(kAbsMask)), vdupq_n_u32(kInfBits));
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), odd);
  return vshrn_n_u32(vbslq_u32(nan, vorrq_u32(u, vdupq_n_u32(0x00400000)), r), 16);
}

inline bool AnyNaNCode(const uint8_t* codes, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    if ((codes[i] & 0x7f) == kE4m3NaNCode) return true;
  }
  return false;
}

inline bool AllNormalCodes(const uint8_t* codes, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    const uint8_t m = codes[i] & 0x7f;
    if (m < 8 || m == 0x7f) return false;
  }
  return true;
}

struct NeonPrims {
  template <bool kBf16In>
  static void PlanInt8(const uint8_t* src, size_t stride, uint32_t n, uint32_t count,
                       TilePlan* plans) {
    for (uint32_t i = 0; i < count; ++i) {
      const uint8_t* tile = src + i * stride;
      uint32_t amax = 0, amin = 0;
      TileRange<kBf16In>(tile, n, amax, amin);
      if (amax >= kInfBits) {
        plans[i] = PlanInt8Ref<kBf16In>(tile, n);  // NaN scale, zero values
      } else {
        plans[i] = TilePlan{};
        plans[i].Set(ComputeTileQuant(ScaleRule::kLinear127, amax), TileMode::kVector);
      }
    }
  }

  template <bool kBf16In>
  static void PlanE4m3(const uint8_t* src, size_t stride, uint32_t n, uint32_t count,
                       ScaleRule rule, TilePlan* plans) {
    for (uint32_t i = 0; i < count; ++i) {
      const uint8_t* tile = src + i * stride;
      uint32_t amax = 0, amin = 0;
      TileRange<kBf16In>(tile, n, amax, amin);
      const TileQuant q = ComputeTileQuant(rule, amax);
      if (amax >= kInfBits || q.prescale != 1.0f) {
        plans[i] = PlanE4m3Ref<kBf16In>(tile, n, rule);  // the reference loop
        continue;
      }
      // Rounding is monotonic, so the smallest |x| decides whether every scaled value is normal.
      const bool normal = BitsToFloat(amin) * q.inv >= 0x1p-6f;
      TilePlan plan;
      plan.Set(q, normal ? TileMode::kVector : TileMode::kVectorAny);
      const int k = 127 - static_cast<int>(FloatBits(q.inv) >> 23);  // inv = 2^-k
      plan.e4m3_bf16_bias = static_cast<uint16_t>(7 - ((120 + k) << 7));
      plans[i] = plan;
    }
  }

  template <bool kBf16In>
  static void ApplyInt8(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
    if (plan.mode != TileMode::kVector) {
      ApplyInt8Ref<kBf16In>(src, n, plan, dst);
      return;
    }
    constexpr uint32_t in = kBf16In ? 2 : 4;
    const float32x4_t inv = vdupq_n_f32(plan.inv), scale = vdupq_n_f32(plan.scale);
    auto quotient = [&](float32x4_t x) {
      if constexpr (kBf16In) {
        const float32x4_t q = vmulq_f32(x, inv);
        const float32x4_t r = vfmsq_f32(x, q, scale);  // x - q * scale, exact
        return vcvtnq_s32_f32(vfmaq_f32(q, r, inv));   // rounded once, then to nearest even
      } else {
        return vcvtnq_s32_f32(vdivq_f32(x, scale));
      }
    };
    for (uint32_t i = 0; i < n; i += 8) {
      float32x4_t lo, hi;
      Load8<kBf16In>(src + i * in, lo, hi);
      vst1_s8(reinterpret_cast<int8_t*>(dst + i), NarrowToInt8(quotient(lo), quotient(hi)));
    }
  }

  template <bool kBf16In>
  static void ApplyE4m3(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
    if (plan.mode != TileMode::kVector) {
      ApplyE4m3Ref<kBf16In>(src, n, plan, dst);
      return;
    }
    if constexpr (kBf16In) {
      const uint16x8_t bias = vdupq_n_u16(plan.e4m3_bf16_bias);
      for (uint32_t i = 0; i < n; i += 8)
        vst1_u8(dst + i, E4m3FromBf16x8(LoadU16x8(src + 2 * i), bias));
    } else {
      const float32x4_t inv = vdupq_n_f32(plan.inv);
      for (uint32_t i = 0; i < n; i += 8) {
        float32x4_t lo, hi;
        Load8<false>(src + 4 * i, lo, hi);
        const uint16x8_t codes =
            vcombine_u16(E4m3Normal4(vmulq_f32(lo, inv)), E4m3Normal4(vmulq_f32(hi, inv)));
        vst1_u8(dst + i, vmovn_u16(codes));
      }
    }
  }

  template <bool kBf16In>
  static void ToBf16(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      __builtin_memcpy(dst, src, 2 * size_t{n});
    } else {
      uint32_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const uint16x8_t r =
            vcombine_u16(Bf16Any4(LoadU32x4(src + 4 * i)), Bf16Any4(LoadU32x4(src + 4 * i + 16)));
        vst1q_u8(dst + 2 * i, vreinterpretq_u8_u16(r));
      }
      NarrowToBf16Ref(src + 4 * i, n - i, dst + 2 * i);
    }
  }

  template <bool kBf16In>
  static void ToFp32(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      uint32_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const uint16x8_t h = LoadU16x8(src + 2 * i);
        vst1q_u8(dst + 4 * i, vreinterpretq_u8_u32(vshll_n_u16(vget_low_u16(h), 16)));
        vst1q_u8(dst + 4 * i + 16, vreinterpretq_u8_u32(vshll_high_n_u16(h, 16)));
      }
      WidenBf16Ref(src + 2 * i, n - i, dst + 4 * i);
    } else {
      __builtin_memcpy(dst, src, 4 * size_t{n});
    }
  }

  template <bool kBf16Out>
  static void DecodeInt8(const uint8_t* q, float scale, uint32_t n, uint8_t* dst) {
    if (!__builtin_isfinite(scale)) {  // NaN products: the reference's NaN rule
      DecodeInt8Ref<kBf16Out>(q, scale, n, dst);
      return;
    }
    const float32x4_t s = vdupq_n_f32(scale);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const int16x8_t w = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(q + i)));
      const float32x4_t lo = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), s);
      const float32x4_t hi = vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(w)), s);
      if constexpr (kBf16Out) {
        vst1q_u8(dst + 2 * i, vreinterpretq_u8_u16(Bf16NoNaN8(lo, hi)));  // finite or ±inf
      } else {
        vst1q_f32(reinterpret_cast<float*>(dst + 4 * i), lo);
        vst1q_f32(reinterpret_cast<float*>(dst + 4 * i + 16), hi);
      }
    }
    DecodeInt8Ref<kBf16Out>(q + i, scale, n - i, dst + (kBf16Out ? 2 : 4) * i);
  }

  template <bool kBf16Out>
  static void DecodeE4m3(const uint8_t* codes, float scale, uint32_t n, uint8_t* dst) {
    constexpr uint32_t out = kBf16Out ? 2 : 4;
    const uint32_t sb = FloatBits(scale);
    uint32_t i = 0;
    if constexpr (kBf16Out) {
      // Normal codes under 2^k, -120 <= k <= 119, are exact bf16 numbers: the code's bits moved
      // into place plus the exponent rebias (e4m3_bits.h, DecodeNormalE4m3ToBf16).
      if ((sb & 0x807fffffu) == 0 && sb >= (7u << 23) && sb <= (246u << 23) &&
          AllNormalCodes(codes, n)) {
        const int k = static_cast<int>(sb >> 23) - 127;
        const int16x8_t mask = vdupq_n_s16(static_cast<int16_t>(0x87f0));
        const int16x8_t bias = vdupq_n_s16(static_cast<int16_t>((120 + k) << 7));
        for (; i + 8 <= n; i += 8) {
          const int16x8_t c = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(codes + i)));
          vst1q_u8(dst + 2 * i,
                   vreinterpretq_u8_s16(vaddq_s16(vandq_s16(vshlq_n_s16(c, 4), mask), bias)));
        }
      }
    } else {
      const float scale256 = scale * 256.0f;
      // Finite scale and product scale * 2^8, no NaN code: (v * 2^-8) * (scale * 2^8) is the
      // same real product as v * scale, so its one rounding is the same. e4m3 codes are fp16
      // bits shifted by 8 exponents, subnormals included, so the widening is exact.
      if (__builtin_isfinite(scale256) && !AnyNaNCode(codes, n)) {
        const float32x4_t s = vdupq_n_f32(scale256);
        const int16x8_t mask = vdupq_n_s16(static_cast<int16_t>(0xBF80));
        for (; i + 8 <= n; i += 8) {
          const int16x8_t c = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(codes + i)));
          const float16x8_t h = vreinterpretq_f16_s16(vandq_s16(vshlq_n_s16(c, 7), mask));
          vst1q_f32(reinterpret_cast<float*>(dst + 4 * i),
                    vmulq_f32(vcvt_f32_f16(vget_low_f16(h)), s));
          vst1q_f32(reinterpret_cast<float*>(dst + 4 * i + 16), vmulq_f32(vcvt_high_f32_f16(h), s));
        }
      }
    }
    DecodeE4m3Ref<kBf16Out>(codes + i, scale, n - i, dst + out * i);
  }
};

constexpr PathKernels kNeonKernels = MakePathKernels<NeonPrims>(SimdPath::kNeon);

}  // namespace

const PathKernels* NeonPathKernels() {
  return &kNeonKernels;
}

}  // namespace sparsekv::compress

#else
#include "compress/kernels.h"
namespace sparsekv::compress {
const PathKernels* NeonPathKernels() {
  return nullptr;
}
}  // namespace sparsekv::compress
#endif
