// The reference arithmetic of every storage format: bf16 and FP8 conversions, tile scales and
// the scalar tile codecs. Private to compress/.
//
// This file is the definition the SIMD paths are held to: each path computes the same IEEE
// single-precision operations in the same order, so its bytes and decoded values are identical
// to these. Tile scales come from ComputeTileQuant below, on every path.
//
// Everything here is in an anonymous namespace on purpose: each translation unit gets its own
// copy of every function (member functions included), compiled with that unit's ISA flags. An
// external-linkage inline function would be emitted as a COMDAT in the AVX-512 unit too (an
// unoptimized build emits them all), and the linker could then hand that AVX-512 copy to the
// scalar path, which would crash on a CPU without AVX-512. For the same reason the SIMD units
// call no external-linkage inline function (standard library templates, layout:: helpers):
// only these, compiler builtins and intrinsics.
//
// Assumes the default floating-point environment (round to nearest even, no FTZ/DAZ).
#pragma once

#include <cstdint>

namespace sparsekv::compress {
namespace {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// Unaligned, alias-safe loads and stores: page slots and caller rows carry no alignment promise.
inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreU16(uint8_t* p, uint16_t v) {
  __builtin_memcpy(p, &v, sizeof v);
}
inline float LoadF32(const uint8_t* p) {
  float v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreF32(uint8_t* p, float v) {
  __builtin_memcpy(p, &v, sizeof v);
}

inline constexpr uint32_t kAbsMask = 0x7fffffffu;
inline constexpr uint32_t kInfBits = 0x7f800000u;  // abs bits at or above this: inf or NaN
inline constexpr uint32_t kQuietNaNBits = 0x7fc00000u;

// ---- bf16 ----

// Round to nearest even. NaN stays NaN: it is truncated and its quiet bit set (so a payload only
// in the low 16 bits cannot turn into an infinity); infinities stay infinities; fp32 denormals
// round like any other value (bf16 shares fp32's exponent range), nothing is flushed. The same
// rule as the AVX512-BF16 instruction VCVTNEPS2BF16 apart from denormals, which it flushes.
inline uint16_t Bf16FromFloatRef(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & kAbsMask) > kInfBits) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float Bf16ToFloatRef(uint16_t h) {
  return BitsToFloat(uint32_t{h} << 16);
}

// ---- FP8 e4m3 (OCP "e4m3fn") ----

inline constexpr uint8_t kE4m3NaNCode = 0x7f;
inline constexpr uint32_t kE4m3MinNormalBits = 121u << 23;  // 2^-6: below it e4m3 is subnormal

// Exact value of a code, as an fp32 (every e4m3 value is one). NaN codes give a quiet NaN with
// the code's sign.
inline float E4m3ToFloatRef(uint8_t code) {
  const uint32_t sign = uint32_t{code & 0x80u} << 24;
  const uint32_t mag = code & 0x7fu;
  if (mag == 0x7f) return BitsToFloat(sign | kQuietNaNBits);
  const uint32_t exp = mag >> 3, man = mag & 7u;
  // Subnormal m * 2^-9; normal (1 + m/8) * 2^(e-7).
  const uint32_t bits = exp == 0 ? (man == 0 ? 0u : FloatBits(static_cast<float>(man) * 0x1p-9f))
                                 : ((exp + 120u) << 23) | (man << 20);
  return BitsToFloat(sign | bits);
}

// Round to nearest even. Finite values beyond ±448 (after rounding) and ±inf saturate to ±448,
// the OCP "saturating" conversion; NaN becomes the NaN code with the input's sign.
inline uint8_t E4m3FromFloatRef(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & kAbsMask;
  if (a > kInfBits) return sign | kE4m3NaNCode;
  uint32_t code;
  if (a < kE4m3MinNormalBits) {
    // One rounding of |f| to a multiple of 2^-9: 2^14 has an ulp of exactly 2^-9.
    code = FloatBits(BitsToFloat(a) + 16384.0f) - FloatBits(16384.0f);
  } else if (a >= FloatBits(464.0f)) {
    code = 0x7e;  // 464 is the midpoint between 448 and the NaN code's 480; ties go to 448
  } else {
    // Rebias the exponent (127 -> 7) and round the mantissa to 3 bits, ties to even.
    code = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  }
  return static_cast<uint8_t>(sign | (code > 0x7e ? 0x7e : code));
}

// ---- UE8M0: an exponent-only byte, 2^(e - 127); 0xff is NaN ----

inline float Ue8m0ToFloatRef(uint8_t e) {
  if (e == 0xff) return BitsToFloat(kQuietNaNBits);
  if (e == 0) return 0x1p-127f;
  return BitsToFloat(uint32_t{e} << 23);
}

// 2^k as an fp32, for k in [-149, 127].
inline float Pow2(int k) {
  return k >= -126 ? BitsToFloat(static_cast<uint32_t>(k + 127) << 23)
                   : BitsToFloat(1u << (k + 149));
}

// ---- Tile scales ----

enum class ScaleRule : uint8_t {
  // int8 (c8_mla, idx_c8): scale = fp32(max(amax, 1e-8) / 127), as CANN's golden for DeepSeek
  // V3.2's quantized sparse flash attention writes it (hicann/pypto
  // models/deepseek_v32_exp/deepseekv32_sparse_flash_attention_quant.py and
  // deepseekv32_sparse_attention_antiquant.py, at b945dd2d2fd6015f11ad4e44ed108358cc7a4303);
  // values are rne(fp32(x / scale)) clamped to [-128, 127] (Int8FromRatio).
  kLinear127,
  // fp8_ds_mla: scale = 2^ceil(log2(max(amax / 448, 1e-4))) stored as fp32, as FlashMLA's
  // quantize_k_cache (tests/quant.py) and vLLM's fp8_ds_mla writers store it: the 1e-4 floor
  // comes before the ceil-log2, so the least scale is 2^-13 (an all-zero tile's too).
  kPow2Fp32,
  // fp8_v4: the same power of two (same floor) stored as a ue8m0 byte, as FlashMLA's
  // MODEL1_FP8Sparse cache.
  kPow2Ue8m0,
  // idx_fp8: scale = 2^ceil(log2(max(amax, 1e-4) / 448)) stored as fp32, as DeepSeek's V3.2
  // reference indexer (act_quant, scale_fmt "ue8m0"), vLLM's indexer_k_quant_and_cache and
  // SGLang's NSA indexer store it: the floor is on amax, so the least scale is 2^-22.
  kPow2Fp32AmaxFloor,
};

// The least exponent of each power-of-two rule (its floor, above): ceil(log2(1e-4)) = -13 and
// ceil(log2(1e-4 / 448)) = ceil(-22.095) = -22.
inline int Pow2RuleMinExponent(ScaleRule rule) { return rule == ScaleRule::kPow2Fp32AmaxFloor ? -22 : -13; }

// How one tile is quantized. An e4m3 value x becomes round((x * prescale) * inv): two fp32
// multiplies, the first exact. `prescale` is 1 except for tiles so small that 1/scale would
// overflow (a denormal scale); the SIMD paths hand such tiles to the scalar loops.
struct TileQuant {
  float scale = 0;      // what is stored (fp32 formats) and what decode multiplies by
  float prescale = 1;   // 1 or 2^64
  float inv = 0;        // 1 / (scale * prescale), rounded; 0 for an all-zero tile
  uint8_t ue8m0 = 127;  // kPow2Ue8m0 only: the stored exponent byte
};

// `amax_bits`: the bits of the tile's largest |x| over its finite values (0 for all zeros).
//
// The linear (int8) rule stores scale = max(amax, 1e-8) / 127 rounded to nearest, so the least
// scale is 1e-8 / 127 (an all-zero tile's too) and every scale is a normal fp32 number; `inv` is
// 1 / scale rounded, which the SIMD paths use to find the values quickly (Int8FromRatio says how
// they stay exact). |x| / scale <= 127 * (1 + 2^-24), which rounds to at most 127. Power-of-two
// rules store the smallest 2^k with 448 * 2^k >= amax, computed
// exactly from the bits (ceil(log2(amax / 448)) without a rounding step), but never less than
// their floor (Pow2RuleMinExponent): that is max(ceil(log2(x)), ceil(log2(floor))), which is
// ceil(log2(max(x, floor))), the public writers' formula.
// An all-zero tile stores the floor: 1e-8 / 127 under the linear rule, 2^-13 (or 2^-22 for
// idx_fp8) under the power-of-two ones, as the public writers do.
inline constexpr float kInt8AmaxFloor = 1e-8f;
inline TileQuant ComputeTileQuant(ScaleRule rule, uint32_t amax_bits) {
  TileQuant q;
  if (rule == ScaleRule::kLinear127) {
    const float amax = BitsToFloat(amax_bits);
    q.scale = (amax > kInt8AmaxFloor ? amax : kInt8AmaxFloor) / 127.0f;
    q.inv = 1.0f / q.scale;
    return q;
  }
  const int kmin = Pow2RuleMinExponent(rule);
  int k = kmin;
  if (amax_bits != 0) {
    int e;       // floor(log2(amax))
    bool above;  // amax > 1.75 * 2^e, i.e. 448 * 2^(e-8) < amax
    if (amax_bits >= 0x00800000u) {
      e = static_cast<int>(amax_bits >> 23) - 127;
      above = (amax_bits & 0x7fffffu) > 0x600000u;
    } else {
      const int top = 31 - __builtin_clz(amax_bits);  // denormal: amax = bits * 2^-149
      e = top - 149;
      above = uint64_t{amax_bits} * 4 > uint64_t{7} << top;
    }
    k = above ? e - 7 : e - 8;
  }
  if (k < kmin) k = kmin;
  q.scale = Pow2(k);
  q.ue8m0 = static_cast<uint8_t>(k + 127 < 0 ? 0 : k + 127);
  if (k >= -127) {
    q.inv = Pow2(-k);  // exact: k <= 120 for any finite amax
  } else {
    q.prescale = 0x1p64f;
    q.inv = Pow2(-k - 64);
  }
  return q;
}

// ---- Scalar tile codecs: the reference for every path ----

// Reads element i of a row as fp32: bf16 rows widen exactly.
template <bool kBf16In>
inline float LoadIn(const uint8_t* src, uint32_t i) {
  if constexpr (kBf16In) {
    return Bf16ToFloatRef(LoadU16(src + 2 * i));
  } else {
    return LoadF32(src + 4 * i);
  }
}

template <bool kBf16In>
inline uint32_t AbsBitsIn(const uint8_t* src, uint32_t i) {
  return FloatBits(LoadIn<kBf16In>(src, i)) & kAbsMask;
}

// Rounds to the nearest integer, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves an ulp
// of exactly 1, so the one rounding of that addition is the rounding we want.
inline float RoundHalfEven(float v) {
  return (v + 12582912.0f) - 12582912.0f;
}

// ---- Tile codecs in two steps ----
//
// Plan reads a tile once for its range and computes its scale; Apply writes its values. The fp8
// format loops plan the next token's tiles before applying the current one's, so the scale
// arithmetic overlaps other work instead of stalling the value loop that needs it.

enum class TileMode : uint8_t {
  kVector,     // SIMD: every value takes the common path
  kVectorAny,  // SIMD e4m3: some values fall below 2^-6 and need the subnormal path
  kScalar,     // the reference loop below (NaN/inf in an fp8 tile, a prescaled tile)
  kNonFinite,  // int8 tile holding NaN or inf: NaN scale, zero values
};

// 16 bytes, aligned: the SIMD planners write four at once, a 16-byte store each (simd_plan.h,
// StorePlans4), and the value loops read them back at once, field by field; a load that lies
// inside one earlier store forwards from it.
struct alignas(16) TilePlan {
  float scale = 0;  // what the page stores (NaN for an int8 kNonFinite tile)
  float prescale = 1;
  float inv = 0;
  uint8_t ue8m0 = 127;
  TileMode mode = TileMode::kScalar;
  // kVector e4m3 tiles planned by the SIMD planners (simd_plan.h, PlanFour): the 16-bit constant
  // that E4m3FromBf16Lanes (e4m3_bits.h) adds, so the value loop of bf16 rows need not derive it
  // from inv (eight scalar instructions a tile; 3% of fp8_v4's AVX2 encode). Else unused.
  // Named, too, so that a copy moves all 16 bytes in aligned halves: with two unnamed bytes of
  // padding here GCC copied 14, the second half as a load overlapping two stores, which cannot
  // forward from them (21% of c8_mla's AVX2 encode time in perf).
  uint16_t e4m3_bf16_bias = 0;

  void Set(const TileQuant& q, TileMode m) {
    scale = q.scale;
    prescale = q.prescale;
    inv = q.inv;
    ue8m0 = q.ue8m0;
    mode = m;
  }
};

// One int8 value from its ratio x / scale (fp32, as divided): rounded to nearest, ties to even,
// clamped to [-128, 127] as the golden clamps (|x| <= amax makes it at most 127 in magnitude).
inline uint8_t Int8FromRatio(float v) {
  v = RoundHalfEven(v);
  v = v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v);
  return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(v)));
}

// How the SIMD paths get fp32(x / scale) without dividing:
//  - bf16 input: q = x * inv, then one correction with fused multiply-adds (Markstein):
//    r = x - q * scale (exact), q' = q + r * inv, rounded once. For inv = fp32(1 / scale) and a
//    faithful q this is the correctly rounded quotient; PageCodec.Int8QuotientsOfEveryBf16Value
//    checks it for every bf16 significand and every scale a bf16 tile can have (the scale's
//    significand depends only on amax's, and nothing here depends on exponents while
//    |x / scale| >= 1/4; below that every value rounds to 0 anyway).
//  - fp32 input: x * inv, which is within 2^-16 of x / scale (|x / scale| <= 127.0001, two
//    roundings of 2^-24 relative), while fp32(x / scale) is within 2^-18 of it (half an ulp at
//    127). So where x * inv lies more than 2^-14 from the nearest half-integer, fp32(x / scale)
//    rounds to the same integer; a tile with any value closer than that is divided.
inline constexpr float kInt8NearHalf = 0.5f - 0x1p-14f;

// int8 tile: scale = max(amax, 1e-8) / 127, q = rne(x / scale). A tile holding any NaN or
// infinity gets a NaN scale and zero values, so all of it (and only it) decodes as NaN: int8 has
// no code to mark one element.
template <bool kBf16In>
inline TilePlan PlanInt8Ref(const uint8_t* src, uint32_t n) {
  uint32_t amax = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t a = AbsBitsIn<kBf16In>(src, i);
    amax = a > amax ? a : amax;
  }
  TilePlan plan;
  if (amax >= kInfBits) {
    plan.scale = BitsToFloat(kQuietNaNBits);
    plan.mode = TileMode::kNonFinite;
    return plan;
  }
  plan.Set(ComputeTileQuant(ScaleRule::kLinear127, amax), TileMode::kScalar);
  return plan;
}

template <bool kBf16In>
inline void ApplyInt8Ref(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
  if (plan.mode == TileMode::kNonFinite) {
    __builtin_memset(dst, 0, n);
    return;
  }
  for (uint32_t i = 0; i < n; ++i) dst[i] = Int8FromRatio(LoadIn<kBf16In>(src, i) / plan.scale);
}

// e4m3 tile. The scale comes from the finite values only; a NaN or an infinity becomes the NaN
// code (with its sign) in its own element and changes nothing else: e4m3fn has no infinity, and
// a finite stand-in (±448 × scale) would hide the fault from the attention that reads it.
template <bool kBf16In>
inline TilePlan PlanE4m3Ref(const uint8_t* src, uint32_t n, ScaleRule rule) {
  uint32_t amax = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t a = AbsBitsIn<kBf16In>(src, i);
    if (a < kInfBits && a > amax) amax = a;
  }
  TilePlan plan;
  plan.Set(ComputeTileQuant(rule, amax), TileMode::kScalar);
  return plan;
}

template <bool kBf16In>
inline void ApplyE4m3Ref(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
  for (uint32_t i = 0; i < n; ++i) {
    const float x = LoadIn<kBf16In>(src, i);
    const uint32_t xb = FloatBits(x);
    if ((xb & kAbsMask) >= kInfBits) {
      dst[i] = static_cast<uint8_t>(((xb >> 24) & 0x80u) | kE4m3NaNCode);
    } else {
      dst[i] = E4m3FromFloatRef((x * plan.prescale) * plan.inv);
    }
  }
}

template <bool kBf16Out>
inline void StoreOut(uint8_t* dst, uint32_t i, float v) {
  if constexpr (kBf16Out) {
    StoreU16(dst + 2 * i, Bf16FromFloatRef(v));
  } else {
    StoreF32(dst + 4 * i, v);
  }
}

// out[i] = q[i] * scale: one fp32 rounding (then bf16's, for bf16 output).
template <bool kBf16Out>
inline void DecodeInt8Ref(const uint8_t* q, float scale, uint32_t n, uint8_t* dst) {
  for (uint32_t i = 0; i < n; ++i) {
    StoreOut<kBf16Out>(dst, i, static_cast<float>(static_cast<int8_t>(q[i])) * scale);
  }
}

// out[i] = value(code) * scale. A NaN code decodes to the canonical quiet NaN with its sign,
// whatever the scale: the multiply alone would choose between two payloads if both were NaN.
template <bool kBf16Out>
inline void DecodeE4m3Ref(const uint8_t* codes, float scale, uint32_t n, uint8_t* dst) {
  for (uint32_t i = 0; i < n; ++i) {
    const float v = E4m3ToFloatRef(codes[i]);
    StoreOut<kBf16Out>(dst, i, (codes[i] & 0x7f) == 0x7f ? v : v * scale);
  }
}

inline void WidenBf16Ref(const uint8_t* src, uint32_t n, uint8_t* dst) {
  for (uint32_t i = 0; i < n; ++i) StoreF32(dst + 4 * i, Bf16ToFloatRef(LoadU16(src + 2 * i)));
}

inline void NarrowToBf16Ref(const uint8_t* src, uint32_t n, uint8_t* dst) {
  for (uint32_t i = 0; i < n; ++i) StoreU16(dst + 2 * i, Bf16FromFloatRef(LoadF32(src + 4 * i)));
}

}  // namespace
}  // namespace sparsekv::compress
