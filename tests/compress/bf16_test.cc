// bf16 conversion: exact widening, round-to-nearest-even narrowing against an independent
// reference, NaN kept NaN, denormals not flushed.
#include "sparsekv/bf16.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace sparsekv {
namespace {

// Nearest bf16 by comparing the two candidates around x in double; ties to the even one. The
// candidate above the largest finite bf16 is 2^128, so overflow rounds to infinity as IEEE says.
uint16_t ReferenceBf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffff;
  const uint16_t lo = static_cast<uint16_t>(a >> 16), hi = static_cast<uint16_t>(lo + 1);
  const double va = std::fabs(static_cast<double>(x));
  const double vlo = std::fabs(static_cast<double>(std::bit_cast<float>(uint32_t{lo} << 16)));
  const double vhi = hi == 0x7f80
                         ? std::ldexp(1.0, 128)
                         : std::fabs(static_cast<double>(std::bit_cast<float>(uint32_t{hi} << 16)));
  const double dlo = va - vlo, dhi = vhi - va;
  const uint16_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | pick;
}

TEST(Bf16, WidensExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    EXPECT_EQ(std::bit_cast<uint32_t>(Bf16ToFloat(static_cast<uint16_t>(h))), h << 16);
  }
}

TEST(Bf16, RoundTripsEveryNonNaN) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    if ((b & 0x7fff) > 0x7f80) {
      EXPECT_EQ(Bf16FromFloat(Bf16ToFloat(b)), b | 0x40) << h;  // NaN: quieted, payload kept
    } else {
      EXPECT_EQ(Bf16FromFloat(Bf16ToFloat(b)), b) << h;
    }
  }
}

TEST(Bf16, MatchesReferenceOnAStrideOfAllFloats) {
  // Every 251st bit pattern (about 17 million values), plus every pattern of a few binades
  // around the edges: denormals, the normal boundary, and the top binade that overflows.
  auto check = [](uint32_t u) {
    const float x = std::bit_cast<float>(u);
    if (std::isnan(x)) return;
    ASSERT_EQ(Bf16FromFloat(x), ReferenceBf16(x)) << std::hex << u;
  };
  for (uint64_t u = 0; u < (1ull << 32); u += 251) check(static_cast<uint32_t>(u));
  for (uint32_t u = 0; u < (1u << 24); ++u) check(u);  // denormals, first binade
  for (uint32_t u = 0x7f000000; u < 0x7f800000; ++u) check(u | 0x80000000);  // top binade, negative
}

TEST(Bf16, EdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Bf16FromFloat(inf), 0x7f80);
  EXPECT_EQ(Bf16FromFloat(-inf), 0xff80);
  EXPECT_EQ(Bf16FromFloat(std::numeric_limits<float>::max()), 0x7f80);  // rounds up into inf
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7f);  // just below the midpoint
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x7f800001u)), 0x7fc0);  // NaN with a low payload
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0xffc00000u)), 0xffc0);
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x00000001u)),
            0x0000);  // denormals round, not flush
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x00018000u)), 0x0002);  // tie to even
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x00008000u)), 0x0000);  // tie to even
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x007fffffu)), 0x0080);  // up into the least normal
  EXPECT_EQ(Bf16FromFloat(-0.0f), 0x8000);
}

}  // namespace
}  // namespace sparsekv
