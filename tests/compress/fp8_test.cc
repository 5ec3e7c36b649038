// FP8 e4m3 and UE8M0: exhaustive over all 256 codes, and against a brute-force nearest-value
// reference over every bf16 bit pattern and a million random fp32 values.
#include "sparsekv/fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace sparsekv {
namespace {

// The value of a code by the format's definition, computed independently of the library.
double ExpectedValue(uint8_t code) {
  const int sign = code & 0x80 ? -1 : 1;
  const int exp = (code >> 3) & 0xf, man = code & 7;
  if (exp == 0) return sign * std::ldexp(man / 8.0, -6);
  return sign * std::ldexp(1.0 + man / 8.0, exp - 7);
}

bool IsNaNCode(uint8_t code) {
  return (code & 0x7f) == 0x7f;
}

// Nearest finite code by exhaustive search, ties to the even code, saturating at 448.
uint8_t BruteForceEncode(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7e;
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (uint8_t c = 0; c <= 0x7e; ++c) {
    const double err = std::fabs(ExpectedValue(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | best;
}

TEST(E4m3, DecodesEveryCodeByDefinition) {
  for (int c = 0; c < 256; ++c) {
    const float v = E4m3ToFloat(static_cast<uint8_t>(c));
    if (IsNaNCode(static_cast<uint8_t>(c))) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), ExpectedValue(static_cast<uint8_t>(c))) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;  // 0x80 is -0
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(E4m3ToFloat(0x08), 0x1p-6f);
}

TEST(E4m3, RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    EXPECT_EQ(E4m3FromFloat(E4m3ToFloat(code)), code) << c;  // NaN codes keep their sign too
  }
}

TEST(E4m3, MidpointsRoundToEvenAndNeighboursRoundToNearest) {
  for (int sign = 0; sign < 2; ++sign) {
    for (uint8_t c = 0; c < 0x7e; ++c) {
      const uint8_t lo = static_cast<uint8_t>(c | (sign << 7));
      const uint8_t hi = static_cast<uint8_t>((c + 1) | (sign << 7));
      const float a = E4m3ToFloat(lo), b = E4m3ToFloat(hi);
      const float mid = (a + b) / 2;  // exact: both have few bits
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2);
      EXPECT_EQ(E4m3FromFloat(mid), (c & 1) ? hi : lo)
          << "midpoint of " << int(lo) << " and " << int(hi);
      const float toward_b = std::nextafter(mid, b), toward_a = std::nextafter(mid, a);
      EXPECT_EQ(E4m3FromFloat(toward_b), hi) << int(lo);
      EXPECT_EQ(E4m3FromFloat(toward_a), lo) << int(lo);
    }
  }
}

TEST(E4m3, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.0f, 449.0f, 464.0f, 464.5f, 479.9f, 480.0f, 1e6f, 3.4e38f, inf}) {
    EXPECT_EQ(E4m3FromFloat(x), 0x7e) << x;
    EXPECT_EQ(E4m3FromFloat(-x), 0xfe) << x;
  }
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(E4m3FromFloat(qnan), 0x7f);
  EXPECT_EQ(E4m3FromFloat(-qnan), 0xff);
  EXPECT_EQ(E4m3FromFloat(std::bit_cast<float>(0x7f800001u)), 0x7f);  // signalling, low payload
  EXPECT_EQ(E4m3FromFloat(std::bit_cast<float>(0xff800001u)), 0xff);
}

TEST(E4m3, SubnormalsAndZeros) {
  EXPECT_EQ(E4m3FromFloat(0.0f), 0x00);
  EXPECT_EQ(E4m3FromFloat(-0.0f), 0x80);
  EXPECT_EQ(E4m3FromFloat(0x1p-10f), 0x00);  // half the least step: tie to 0
  EXPECT_EQ(E4m3FromFloat(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(E4m3FromFloat(3 * 0x1p-10f), 0x02);                       // 1.5 steps: tie to even 2
  EXPECT_EQ(E4m3FromFloat(std::bit_cast<float>(0x00000001u)), 0x00);  // fp32 denormals
  EXPECT_EQ(E4m3FromFloat(-std::bit_cast<float>(0x007fffffu)), 0x80);
  EXPECT_EQ(E4m3FromFloat(15 * 0x1p-10f), 0x08);  // 7.5 steps: ties to 8 steps, the least normal
}

TEST(E4m3, MatchesBruteForceOnEveryBf16) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = std::bit_cast<float>(h << 16);
    const uint8_t got = E4m3FromFloat(x);
    if (std::isinf(x)) {
      EXPECT_EQ(got, std::signbit(x) ? 0xfe : 0x7e);
      continue;
    }
    ASSERT_EQ(got, BruteForceEncode(x)) << std::hex << h;
  }
}

TEST(E4m3, MatchesBruteForceOnRandomFloats) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> log2mag(-14.0, 10.0);
  for (int i = 0; i < 1000000; ++i) {
    const float x = static_cast<float>(std::exp2(log2mag(rng))) * (rng() & 1 ? -1.0f : 1.0f);
    ASSERT_EQ(E4m3FromFloat(x), BruteForceEncode(x)) << x;
  }
}

TEST(Ue8m0, EveryByte) {
  for (int e = 0; e < 255; ++e) {
    EXPECT_EQ(static_cast<double>(Ue8m0ToFloat(static_cast<uint8_t>(e))), std::ldexp(1.0, e - 127))
        << e;
  }
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(kUe8m0NaN)));
  for (int k = -127; k <= 127; ++k) {
    EXPECT_EQ(Ue8m0FromExponent(k), k + 127);
    EXPECT_EQ(static_cast<double>(Ue8m0ToFloat(Ue8m0FromExponent(k))), std::ldexp(1.0, k));
  }
}

}  // namespace
}  // namespace sparsekv
