// TileKernels: every path's primitives equal the definition (value * scale, one rounding) and
// each other bit for bit, for every length (so every SIMD tail is reached).
#include "sparsekv/tile_kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/fp8.h"

namespace sparsekv {
namespace {

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

TEST(TileKernels, EveryPathEqualsTheDefinition) {
  std::mt19937_64 rng(41);
  const float scales[] = {1.0f, 0.0123f, 0x1p-130f, 0x1p-120f, 0x1p118f, 0x1p121f, 0.0f, -2.5f};
  for (SimdPath path : SupportedSimdPaths()) {
    auto k = TileKernelsFor(path);
    ASSERT_TRUE(k.ok());
    const TileKernels& tk = **k;
    EXPECT_EQ(tk.path, path);
    for (uint32_t n = 0; n <= 200; n += (n < 70 ? 1 : 13)) {
      std::vector<int8_t> q(n);
      std::vector<uint8_t> codes(n);
      std::vector<uint16_t> b16(n);
      std::vector<float> f32(n);
      for (uint32_t i = 0; i < n; ++i) {
        q[i] = static_cast<int8_t>(rng());
        codes[i] = static_cast<uint8_t>(rng());
        b16[i] = static_cast<uint16_t>(rng());
        f32[i] = std::bit_cast<float>(static_cast<uint32_t>(rng()));
      }
      for (float s : scales) {
        SCOPED_TRACE(std::string(SimdPathName(path)) + " n=" + std::to_string(n) +
                     " scale=" + std::to_string(s));
        std::vector<float> out(n), want(n);
        std::vector<uint16_t> out16(n), want16(n);
        for (uint32_t i = 0; i < n; ++i) want[i] = static_cast<float>(q[i]) * s;
        for (uint32_t i = 0; i < n; ++i) want16[i] = Bf16FromFloat(want[i]);
        tk.int8_to_fp32(q.data(), s, n, out.data());
        ASSERT_TRUE(SameBits(out, want));
        tk.int8_to_bf16(q.data(), s, n, out16.data());
        ASSERT_TRUE(SameBits(out16, want16));
        for (uint32_t i = 0; i < n; ++i) {
          const bool nan = (codes[i] & 0x7f) == 0x7f;
          want[i] = nan ? E4m3ToFloat(codes[i]) : E4m3ToFloat(codes[i]) * s;
          want16[i] = Bf16FromFloat(want[i]);
        }
        tk.e4m3_to_fp32(codes.data(), s, n, out.data());
        ASSERT_TRUE(SameBits(out, want));
        tk.e4m3_to_bf16(codes.data(), s, n, out16.data());
        ASSERT_TRUE(SameBits(out16, want16));
      }
      std::vector<float> wide(n), want_wide(n);
      for (uint32_t i = 0; i < n; ++i) want_wide[i] = Bf16ToFloat(b16[i]);
      tk.bf16_to_fp32(b16.data(), n, wide.data());
      ASSERT_TRUE(SameBits(wide, want_wide));
      std::vector<uint16_t> narrow(n), want_narrow(n);
      for (uint32_t i = 0; i < n; ++i) want_narrow[i] = Bf16FromFloat(f32[i]);
      tk.fp32_to_bf16(f32.data(), n, narrow.data());
      ASSERT_TRUE(SameBits(narrow, want_narrow)) << SimdPathName(path) << " n=" << n;
    }
  }
  EXPECT_EQ(ActiveTileKernels().path, ActiveSimdPath());
}


// Tiles of normal codes only (no zero, subnormal or NaN code), which the AVX2 path decodes by
// moving bits, at every power-of-two scale from 2^-140 to 2^140: inside 2^-120 .. 2^119 by bits,
// outside by multiplying, every one equal to the definition.
TEST(TileKernels, NormalE4m3CodesAtEveryPowerOfTwoScale) {
  std::mt19937_64 rng(43);
  for (SimdPath path : SupportedSimdPaths()) {
    auto k = TileKernelsFor(path);
    ASSERT_TRUE(k.ok());
    const TileKernels& tk = **k;
    for (uint32_t n : {16u, 32u, 48u, 64u, 128u, 131u}) {
      std::vector<uint8_t> codes(n);
      for (uint32_t i = 0; i < n; ++i) {
        uint8_t c;
        do {
          c = static_cast<uint8_t>(rng());
        } while ((c & 0x7f) < 8 || (c & 0x7f) == 0x7f);
        codes[i] = c;
      }
      for (int e = -140; e <= 140; ++e) {
        const float s = std::ldexp(1.0f, e);
        SCOPED_TRACE(std::string(SimdPathName(path)) + " n=" + std::to_string(n) + " scale=2^" + std::to_string(e));
        std::vector<float> out(n), want(n);
        std::vector<uint16_t> out16(n), want16(n);
        for (uint32_t i = 0; i < n; ++i) {
          want[i] = E4m3ToFloat(codes[i]) * s;
          want16[i] = Bf16FromFloat(want[i]);
        }
        tk.e4m3_to_fp32(codes.data(), s, n, out.data());
        ASSERT_TRUE(SameBits(out, want));
        tk.e4m3_to_bf16(codes.data(), s, n, out16.data());
        ASSERT_TRUE(SameBits(out16, want16));
      }
    }
  }
}

// Every int8 value times scales of every exponent, denormal scales included, with random
// mantissas and both signs: the AVX2 decode to bf16 multiplies by scale * 2^-16, which is exact
// only from 2^-110 up, and rounds in 16-bit lanes, so both the edge of that range and ties
// (scale mantissas of few bits make q * scale land on a bf16 tie) must match the definition.
TEST(TileKernels, EveryInt8ValueAtEveryScaleExponent) {
  std::mt19937_64 rng(44);
  std::vector<uint8_t> q(256 + 15);
  for (uint32_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>(i * 7 + 3);  // 0..255, shuffled
  for (SimdPath path : SupportedSimdPaths()) {
    auto k = TileKernelsFor(path);
    ASSERT_TRUE(k.ok());
    const TileKernels& tk = **k;
    for (int e = -150; e <= 127; ++e) {
      for (uint32_t trial = 0; trial < 5; ++trial) {
        // Trial 0: a mantissa of one bit; 1: of nine bits (products on bf16 ties); 4: one whose
        // low bits 1 0111...1 put 1 * scale just under a bf16 tie with an odd bf16 below it, so
        // that a scale * 2^-16 rounded to a denormal (the tie moving up) shows; else random.
        const uint32_t mantissa = trial == 0   ? 0
                                  : trial == 1 ? static_cast<uint32_t>(rng() & 0x1ff) << 14
                                  : trial == 4 ? (static_cast<uint32_t>(rng() & 0x3f) << 17) | 0x17fffu
                                               : static_cast<uint32_t>(rng() & 0x7fffff);
        // Below 2^-126 the scale is denormal (ldexp rounds it), at 2^-150 it may be zero.
        float s = std::ldexp(1.0f + static_cast<float>(mantissa) * 0x1p-23f, e);
        if (trial & 1) s = -s;
        uint32_t bits;
        std::memcpy(&bits, &s, 4);
        SCOPED_TRACE(std::string(SimdPathName(path)) + " scale bits " + std::to_string(bits));
        const uint32_t n = static_cast<uint32_t>(q.size());
        std::vector<uint16_t> out16(n), want16(n);
        std::vector<float> out(n), want(n);
        for (uint32_t i = 0; i < n; ++i) {
          want[i] = static_cast<float>(static_cast<int8_t>(q[i])) * s;
          want16[i] = Bf16FromFloat(want[i]);
        }
        tk.int8_to_bf16(reinterpret_cast<const int8_t*>(q.data()), s, n, out16.data());
        ASSERT_TRUE(SameBits(out16, want16));
        tk.int8_to_fp32(reinterpret_cast<const int8_t*>(q.data()), s, n, out.data());
        ASSERT_TRUE(SameBits(out, want));
      }
    }
  }
}

}  // namespace
}  // namespace sparsekv
