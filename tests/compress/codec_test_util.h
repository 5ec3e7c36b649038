// Shared helpers of the codec tests: format shapes, row generators, bit comparisons.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/storage_format.h"

namespace sparsekv::codec_testing {

struct Shape {
  StorageFormat format;
  uint32_t dims;
};

// Every format, at its real dims, plus odd dims where the format allows them (to reach the
// SIMD tails).
inline std::vector<Shape> AllShapes() {
  return {
      {StorageFormat::kBf16, 576},  {StorageFormat::kBf16, 100},   {StorageFormat::kFp32, 512},
      {StorageFormat::kFp32, 37},   {StorageFormat::kC8Mla, 576},  {StorageFormat::kFp8DsMla, 576},
      {StorageFormat::kFp8V4, 512}, {StorageFormat::kIdxFp8, 128}, {StorageFormat::kIdxFp8, 48},
      {StorageFormat::kIdxC8, 128}, {StorageFormat::kIdxC8, 48}};
}

inline std::string ShapeName(const Shape& s) {
  return std::string(StorageFormatName(s.format)) + "/" + std::to_string(s.dims);
}

inline bool IsEightBit(StorageFormat f) {
  return f == StorageFormat::kC8Mla || f == StorageFormat::kFp8DsMla ||
         f == StorageFormat::kFp8V4 || f == StorageFormat::kIdxFp8 || f == StorageFormat::kIdxC8;
}
inline bool IsFp8(StorageFormat f) {
  return f == StorageFormat::kFp8DsMla || f == StorageFormat::kFp8V4 || f == StorageFormat::kIdxFp8;
}

// Rows of fp32 values; bf16 rows are these rounded (so both inputs see the same data).
struct Rows {
  uint32_t count = 0;
  uint32_t dims = 0;
  std::vector<float> fp32;
  std::vector<uint16_t> bf16;

  Rows(uint32_t n, uint32_t d) : count(n), dims(d), fp32(size_t{n} * d), bf16(size_t{n} * d) {}
  float& at(uint32_t r, uint32_t i) { return fp32[size_t{r} * dims + i]; }
  void Finish() {
    for (size_t i = 0; i < fp32.size(); ++i) bf16[i] = Bf16FromFloat(fp32[i]);
  }
  RowsView View(RowType t) const {
    return t == RowType::kBf16 ? RowsView::Bf16(bf16.data(), count, dims)
                               : RowsView::Fp32(fp32.data(), count, dims);
  }
  // The value the codec sees for element (r, i) when given rows of type t.
  float Seen(RowType t, uint32_t r, uint32_t i) const {
    const size_t k = size_t{r} * dims + i;
    return t == RowType::kBf16 ? Bf16ToFloat(bf16[k]) : fp32[k];
  }
};

// Gaussian values whose magnitude changes every 16 values over 10^-4 .. 10^4, so tiles and rows
// see many scales.
inline Rows GaussianRows(uint32_t count, uint32_t dims, uint64_t seed) {
  Rows rows(count, dims);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-4.0f, 4.0f);
  float mag = 1;
  for (uint32_t r = 0; r < count; ++r) {
    for (uint32_t i = 0; i < dims; ++i) {
      if (i % 16 == 0) mag = std::pow(10.0f, decade(rng));
      rows.at(r, i) = normal(rng) * mag;
    }
  }
  rows.Finish();
  return rows;
}

// Finite values with random bit patterns: every exponent, denormals included.
inline Rows ChaosRows(uint32_t count, uint32_t dims, uint64_t seed) {
  Rows rows(count, dims);
  std::mt19937_64 rng(seed);
  for (auto& v : rows.fp32) {
    do {
      v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    } while (!std::isfinite(v) || std::fabs(v) > 1e37f);
  }
  rows.Finish();
  return rows;
}

// Midpoints between consecutive e4m3 values (in units where 448 is the largest).
inline float E4m3Mid(uint32_t i) {
  static const float* table = [] {
    static float t[126];
    for (int c = 0; c < 126; ++c) {
      const int e = c >> 3, m = c & 7;
      const double lo = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
      const int c1 = c + 1, e1 = c1 >> 3, m1 = c1 & 7;
      const double hi = e1 == 0 ? std::ldexp(m1 / 8.0, -6) : std::ldexp(1 + m1 / 8.0, e1 - 7);
      t[c] = static_cast<float>((lo + hi) / 2);
    }
    return t;
  }();
  return table[i % 126];
}

// Hand-made rows, each a case the codecs must get right: zeros, -0, denormals, a tiny amax,
// exact ties of every rounding, huge values, one large value among tiny ones, single values.
inline Rows EdgeRows(uint32_t dims) {
  constexpr uint32_t kKinds = 12;
  Rows rows(kKinds, dims);
  std::mt19937_64 rng(99);
  std::uniform_int_distribution<uint32_t> denormal(1, 0x7fffff);
  for (uint32_t i = 0; i < dims; ++i) {
    const float sign = (i % 3 == 1) ? -1.0f : 1.0f;
    rows.at(0, i) = 0.0f;
    rows.at(1, i) = -0.0f;
    rows.at(2, i) = sign * std::bit_cast<float>(denormal(rng));  // all fp32 denormals
    rows.at(3, i) = sign * std::ldexp(1.0f + (i % 7) / 8.0f, -126 - int(i % 5));  // around FLT_MIN
    rows.at(4, i) = sign * std::ldexp(static_cast<float>(i % 9), -140);  // amax about 2^-137
    // Ties: with amax 448 (fp8) or 127 (int8) the scale is 1 for fp8_ds_mla/fp8_v4 and close to
    // it elsewhere, so these land on or next to e4m3 and int8 midpoints.
    rows.at(5, i) = i == 0 ? 448.0f : sign * (static_cast<float>(i % 127) + 0.5f);
    rows.at(6, i) = i == 0 ? 448.0f : sign * (E4m3Mid(i));
    rows.at(7, i) = sign * std::ldexp(1.0f + (i % 11) / 11.0f, 120);  // near 1e36
    rows.at(8, i) =
        i % 64 == 0 ? 1e4f : sign * 1e-6f * static_cast<float>(i % 5);  // e4m3 subnormals
    rows.at(9, i) = i == dims / 2 ? -3.0f : 0.0f;                       // one value
    rows.at(10, i) = sign * 127.0f;                                     // all at amax
    rows.at(11, i) = sign * std::ldexp(1.0f, -149 + int(i % 3));        // least denormals
  }
  rows.Finish();
  return rows;
}

// Rows holding NaN and infinities at known places, finite values elsewhere.
inline Rows NonFiniteRows(uint32_t dims) {
  Rows rows = GaussianRows(4, dims, 5);
  const float inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  rows.at(1, 5) = nan;
  rows.at(1, 6) = -nan;
  rows.at(1, 7) = inf;
  rows.at(1, 8) = -inf;
  rows.at(2, dims - 1) = nan;  // the last value: rope for MLA formats, a tile's last lane otherwise
  rows.at(3, dims / 2) = inf;
  rows.Finish();
  return rows;
}

inline std::vector<SimdPath> Paths() {
  return SupportedSimdPaths();
}

inline PageCodec MakeCodec(const Shape& s, uint32_t entries, SimdPath path) {
  CodecOptions o;
  o.simd_path = path;
  auto c = PageCodec::Create(s.format, s.dims, entries, o);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

inline constexpr uint8_t kFill = 0xA5;

}  // namespace sparsekv::codec_testing
