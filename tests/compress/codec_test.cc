// PageCodec: every format on every SIMD path this CPU has gives the scalar path's bytes and
// values; error bounds; NaN, infinity, zero and denormal tiles; slot isolation; errors.
#include "sparsekv/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/fp8.h"
#include "tests/compress/codec_test_util.h"

namespace sparsekv {
namespace {

using codec_testing::AllShapes;
using codec_testing::kFill;
using codec_testing::MakeCodec;
using codec_testing::Paths;
using codec_testing::Rows;
using codec_testing::Shape;
using codec_testing::ShapeName;

constexpr RowType kRowTypes[] = {RowType::kFp32, RowType::kBf16};
const char* RowTypeName(RowType t) {
  return t == RowType::kBf16 ? "bf16" : "fp32";
}

std::vector<uint8_t> Encode(const PageCodec& codec, const Rows& rows, RowType t,
                            uint32_t first_slot) {
  std::vector<uint8_t> page(codec.page_bytes(), kFill);
  Status s = codec.WriteTokens(page.data(), first_slot, rows.View(t));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return page;
}

template <typename T>
std::vector<T> Decode(const PageCodec& codec, const std::vector<uint8_t>& page, uint32_t first_slot,
                      uint32_t count) {
  std::vector<T> out(size_t{count} * codec.dims());
  MutableRowsView view =
      std::is_same_v<T, float>
          ? MutableRowsView::Fp32(reinterpret_cast<float*>(out.data()), count, codec.dims())
          : MutableRowsView::Bf16(reinterpret_cast<uint16_t*>(out.data()), count, codec.dims());
  Status s = codec.ReadTokens(page.data(), first_slot, view);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

template <typename T>
size_t FirstBitDifference(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return i;
  }
  return a.size();
}

// Encodes with every path and checks bytes against scalar; decodes the scalar page with every
// path to fp32 and bf16 and checks the bits against scalar's.
void ExpectAllPathsAgree(const Shape& shape, const Rows& rows, const char* what) {
  const uint32_t first = 2, entries = rows.count + 3;
  const PageCodec ref = MakeCodec(shape, entries, SimdPath::kScalar);
  for (RowType t : kRowTypes) {
    const std::vector<uint8_t> ref_page = Encode(ref, rows, t, first);
    const auto ref_f32 = Decode<float>(ref, ref_page, first, rows.count);
    const auto ref_b16 = Decode<uint16_t>(ref, ref_page, first, rows.count);
    for (SimdPath path : Paths()) {
      SCOPED_TRACE(std::string(what) + " " + ShapeName(shape) + " from " + RowTypeName(t) + " on " +
                   std::string(SimdPathName(path)));
      const PageCodec codec = MakeCodec(shape, entries, path);
      const std::vector<uint8_t> page = Encode(codec, rows, t, first);
      const size_t byte = FirstBitDifference(page, ref_page);
      ASSERT_EQ(byte, page.size()) << "page byte " << byte << ": " << int(page[byte])
                                   << " vs scalar " << int(ref_page[byte]);
      const auto f32 = Decode<float>(codec, ref_page, first, rows.count);
      const size_t i = FirstBitDifference(f32, ref_f32);
      ASSERT_EQ(i, f32.size()) << "fp32 value " << i << ": " << f32[i] << " vs scalar "
                               << ref_f32[i];
      const auto b16 = Decode<uint16_t>(codec, ref_page, first, rows.count);
      const size_t j = FirstBitDifference(b16, ref_b16);
      ASSERT_EQ(j, b16.size()) << "bf16 value " << j << ": " << b16[j] << " vs scalar "
                               << ref_b16[j];
    }
  }
}

// The scalar page of `rows` holds, per tile, scale = max(amax, 1e-8) / 127 and values
// rne(fp32(x / scale)) clamped to [-128, 127], from fp32 and from bf16 input: CANN's golden, by
// division. (ExpectAllPathsAgree then holds every path to it.)
void ExpectInt8Quotients(const Shape& shape, const Rows& rows) {
  const uint32_t tile = shape.format == StorageFormat::kC8Mla ? 128 : shape.dims;
  const uint32_t quantized = shape.format == StorageFormat::kC8Mla ? 512 : shape.dims;
  const uint32_t first = 2, entries = rows.count + 3;
  const PageCodec ref = MakeCodec(shape, entries, SimdPath::kScalar);
  for (RowType t : kRowTypes) {
    SCOPED_TRACE(RowTypeName(t));
    const std::vector<uint8_t> page = Encode(ref, rows, t, first);
    for (uint32_t r = 0; r < rows.count; ++r) {
      for (uint32_t t0 = 0; t0 < quantized; t0 += tile) {
        float amax = 0;
        for (uint32_t i = 0; i < tile; ++i) amax = std::max(amax, std::fabs(rows.Seen(t, r, t0 + i)));
        const float s = std::max(amax, 1e-8f) / 127.0f;
        const uint32_t slot = first + r;
        float stored;
        const uint8_t* q;
        if (shape.format == StorageFormat::kC8Mla) {
          std::memcpy(&stored, page.data() + size_t{slot} * 656 + 640 + 4 * (t0 / tile), 4);
          q = page.data() + size_t{slot} * 656 + t0;
        } else {
          std::memcpy(&stored, page.data() + layout::IdxScaleOffset(shape.dims, entries, slot), 4);
          q = page.data() + size_t{slot} * shape.dims;
        }
        ASSERT_EQ(std::bit_cast<uint32_t>(stored), std::bit_cast<uint32_t>(s)) << "row " << r << " tile " << t0 / tile;
        for (uint32_t i = 0; i < tile; ++i) {
          const float want = std::clamp(std::nearbyint(rows.Seen(t, r, t0 + i) / s), -128.0f, 127.0f);
          ASSERT_EQ(static_cast<int8_t>(q[i]), static_cast<int>(want)) << "row " << r << " dim " << t0 + i;
        }
      }
    }
  }
}

TEST(PageCodec, EveryPathMatchesScalarBitForBit) {
  for (const Shape& shape : AllShapes()) {
    ExpectAllPathsAgree(shape, codec_testing::GaussianRows(67, shape.dims, 1), "gaussian");
    ExpectAllPathsAgree(shape, codec_testing::ChaosRows(33, shape.dims, 2), "random bits");
    ExpectAllPathsAgree(shape, codec_testing::EdgeRows(shape.dims), "edge cases");
    ExpectAllPathsAgree(shape, codec_testing::NonFiniteRows(shape.dims), "nan and inf");
  }
}

// Rows whose every tile is one binade, 2^e for e from -60 to 127, with every bf16 mantissa
// and both signs: the fp8 tiles' scales then run from their floor to 2^120, and the AVX2
// path's 16-bit encoder (which folds the scale into an exponent offset) meets each of them.
TEST(PageCodec, Fp8TilesAtEveryScaleExponentMatchScalar) {
  for (const Shape& shape : AllShapes()) {
    if (!codec_testing::IsFp8(shape.format)) continue;
    const uint32_t count = 188;
    codec_testing::Rows rows(count, shape.dims);
    for (uint32_t r = 0; r < count; ++r) {
      const int e = -60 + static_cast<int>(r);
      for (uint32_t i = 0; i < shape.dims; ++i) {
        const float m = 1.0f + static_cast<float>((i * 37 + r) % 128) / 128.0f;  // exact in bf16
        rows.at(r, i) = std::ldexp((i & 1) ? -m : m, e);
      }
    }
    rows.Finish();
    ExpectAllPathsAgree(shape, rows, "one binade per row");
  }
}

// Pages of random bytes: NaN, infinite, denormal, negative and huge scales, NaN codes, ...
// Decoding them must still agree bit for bit.
TEST(PageCodec, EveryPathDecodesArbitraryBytesLikeScalar) {
  std::mt19937_64 rng(3);
  for (const Shape& shape : AllShapes()) {
    const uint32_t entries = 19;
    const PageCodec ref = MakeCodec(shape, entries, SimdPath::kScalar);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<uint8_t> page(ref.page_bytes());
      for (auto& b : page) b = static_cast<uint8_t>(rng());
      if (trial % 4 == 1) {  // plausible scales, so the values themselves get exercised
        for (uint32_t e = 0; e < entries; ++e) {
          const float s = std::ldexp(1.0f, static_cast<int>(rng() % 260) - 150);
          if (shape.format == StorageFormat::kIdxFp8 || shape.format == StorageFormat::kIdxC8) {
            std::memcpy(page.data() + layout::IdxScaleOffset(shape.dims, entries, e), &s, 4);
          } else if (shape.format == StorageFormat::kC8Mla ||
                     shape.format == StorageFormat::kFp8DsMla) {
            const uint32_t at = shape.format == StorageFormat::kC8Mla ? 640 : 512;
            for (int t = 0; t < 4; ++t) std::memcpy(page.data() + e * 656 + at + 4 * t, &s, 4);
          }
        }
      }
      const auto ref_f32 = Decode<float>(ref, page, 0, entries);
      const auto ref_b16 = Decode<uint16_t>(ref, page, 0, entries);
      for (SimdPath path : Paths()) {
        SCOPED_TRACE(ShapeName(shape) + " on " + std::string(SimdPathName(path)));
        const PageCodec codec = MakeCodec(shape, entries, path);
        const auto f32 = Decode<float>(codec, page, 0, entries);
        ASSERT_EQ(FirstBitDifference(f32, ref_f32), f32.size());
        const auto b16 = Decode<uint16_t>(codec, page, 0, entries);
        ASSERT_EQ(FirstBitDifference(b16, ref_b16), b16.size());
      }
    }
  }
}

// int8 values are rne(fp32(x / scale)), scale = max(amax, 1e-8) / 127 (CANN's golden divides).
// The SIMD paths multiply by fp32(1 / scale) and divide a tile where a product lies within
// 2^-14 of a half-integer. Rows whose values sit next to half-integer multiples of their
// tile's scale, where the product and the quotient round to different integers, must come out
// as the quotient on every path; so must exact halves (ties to even) and tiles below the floor.
TEST(PageCodec, Int8ValuesAreRoundedQuotientsOnEveryPath) {
  std::mt19937_64 rng(36);
  for (const Shape& shape : {Shape{StorageFormat::kC8Mla, 576}, Shape{StorageFormat::kIdxC8, 128},
                             Shape{StorageFormat::kIdxC8, 48}}) {
    const uint32_t tile = shape.format == StorageFormat::kC8Mla ? 128 : shape.dims;
    const uint32_t quantized = shape.format == StorageFormat::kC8Mla ? 512 : shape.dims;
    Rows rows(96, shape.dims);
    uint64_t differ = 0;  // values where x * fp32(1 / s) and fp32(x / s) round apart
    for (uint32_t r = 0; r < rows.count; ++r) {
      for (uint32_t t0 = 0; t0 < quantized; t0 += tile) {
        // Tile kinds: near-half ratios at a random scale; exact halves of a power-of-two scale
        // (amax = 127 * 2^k); everything below the 1e-8 floor.
        const uint32_t kind = (r + t0 / tile) % 3;
        const float amax = kind == 1 ? std::ldexp(127.0f, static_cast<int>(rng() % 40) - 20)
                           : kind == 2 ? 3e-9f
                                       : std::ldexp(1.0f + static_cast<float>(rng() % 8388608) / 8388608.0f,
                                                    static_cast<int>(rng() % 60) - 30);
        const float s = std::max(amax, 1e-8f) / 127.0f, inv = 1.0f / s;
        rows.at(r, t0) = rng() % 2 ? amax : -amax;
        for (uint32_t i = 1; i < tile; ++i) {
          float x;
          if (kind == 2) {
            x = static_cast<float>(rng() % 2001) * 1.5e-12f - 1.5e-9f;
          } else {
            const float k = static_cast<float>(static_cast<int>(rng() % 253) - 126) + 0.5f;
            x = k * s;  // a half-integer multiple, rounded
            if (kind == 0) {
              for (int step = static_cast<int>(rng() % 7) - 3; step != 0; step += step > 0 ? -1 : 1)
                x = std::nextafter(x, step > 0 ? 1e30f : -1e30f);
            }
            if (std::fabs(x) > amax) x = k > 0 ? amax : -amax;
          }
          rows.at(r, t0 + i) = x;
          differ += std::nearbyint(x * inv) != std::nearbyint(x / s);
        }
      }
      for (uint32_t i = quantized; i < shape.dims; ++i) rows.at(r, i) = 0.25f;
    }
    rows.Finish();
    EXPECT_GT(differ, 20u) << "the rows must reach the values where multiplying is wrong";
    ExpectAllPathsAgree(shape, rows, "near-half ratios");
    ExpectInt8Quotients(shape, rows);
  }
}

// Every bf16 value against every scale a bf16 tile can have, on every path: the scale's
// significand depends only on amax's (128 of them, plus the 1e-8 floor), and x / scale only on
// the significands and the exponent difference while |x / scale| >= 1/4 (below, everything
// rounds to 0). So tiles whose largest value is each bf16 significand (at three exponents) and
// whose other values are every bf16 value from amax down to amax / 1024, both signs, cover
// every case of the bf16 encoders' quotient (scalar_math.h, kInt8NearHalf).
TEST(PageCodec, Int8QuotientsOfEveryBf16Value) {
  std::vector<std::vector<float>> tiles;  // 128 values each, the largest first
  auto add_class = [&](float amax, float low) {
    std::vector<float> xs;
    for (uint32_t b = 0; b < 0x7f80; ++b) {  // every finite positive bf16
      const float x = std::bit_cast<float>(b << 16);
      if (x > amax || x < low) continue;
      xs.push_back(x);
      xs.push_back(-x);
    }
    for (size_t at = 0; at < xs.size(); at += 127) {
      std::vector<float> t(128, 0.0f);
      t[0] = amax;
      for (size_t i = 0; i < 127 && at + i < xs.size(); ++i) t[1 + i] = xs[at + i];
      tiles.push_back(std::move(t));
    }
  };
  for (int e : {0, 37, -40}) {
    for (uint32_t m = 0; m < 128; ++m) {
      const float amax = std::ldexp(1.0f + static_cast<float>(m) / 128.0f, e);
      add_class(amax, amax / 1024.0f);
    }
  }
  add_class(std::bit_cast<float>(Bf16FromFloat(9e-9f) << 16), 1e-8f / 127.0f / 8.0f);  // the floor's scale
  for (const Shape& shape : {Shape{StorageFormat::kC8Mla, 576}, Shape{StorageFormat::kIdxC8, 128}}) {
    const uint32_t per_row = shape.format == StorageFormat::kC8Mla ? 4 : 1;
    Rows rows(static_cast<uint32_t>((tiles.size() + per_row - 1) / per_row), shape.dims);
    for (size_t t = 0; t < tiles.size(); ++t) {
      for (uint32_t i = 0; i < 128; ++i) rows.at(static_cast<uint32_t>(t / per_row), (t % per_row) * 128 + i) = tiles[t][i];
    }
    rows.Finish();
    for (size_t i = 0; i < rows.fp32.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(rows.fp32[i]), uint32_t{rows.bf16[i]} << 16) << "not a bf16 value";
    }
    ExpectAllPathsAgree(shape, rows, "every bf16 quotient");
    ExpectInt8Quotients(shape, rows);
  }
}

// ---- error bounds ----

struct TileRef {
  uint32_t first;  // first dim of the tile
  uint32_t size;
  float scale;
};

// The tiles of entry `slot` and their scales, read from the page at the DESIGN.md offsets.
std::vector<TileRef> Tiles(const Shape& s, const std::vector<uint8_t>& page, uint32_t entries,
                           uint32_t slot) {
  std::vector<TileRef> tiles;
  auto f32_at = [&](uint64_t off) {
    float v;
    std::memcpy(&v, page.data() + off, 4);
    return v;
  };
  switch (s.format) {
    case StorageFormat::kC8Mla:
    case StorageFormat::kFp8DsMla:
      for (uint32_t t = 0; t < 4; ++t) {
        // fp8_ds_mla: nope | scales | rope (FlashMLA); c8_mla: nope | rope | scales (CANN).
        const uint32_t at = s.format == StorageFormat::kC8Mla ? 640 : 512;
        tiles.push_back({t * 128, 128, f32_at(uint64_t{slot} * 656 + at + 4 * t)});
      }
      break;
    case StorageFormat::kFp8V4:
      for (uint32_t t = 0; t < 7; ++t) {
        tiles.push_back(
            {t * 64, 64, Ue8m0ToFloat(page[layout::Fp8V4ScaleOffset(entries, slot) + t])});
      }
      break;
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      tiles.push_back({0, s.dims, f32_at(layout::IdxScaleOffset(s.dims, entries, slot))});
      break;
    default:
      break;
  }
  return tiles;
}

uint32_t NopeDims(const Shape& s) {
  switch (s.format) {
    case StorageFormat::kC8Mla:
    case StorageFormat::kFp8DsMla:
      return 512;
    case StorageFormat::kFp8V4:
      return 448;
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      return s.dims;
    default:
      return 0;
  }
}

struct BoundStats {
  double int8_max_err_over_scale = 0;     // |x - dec| / scale, int8 formats
  double fp8_max_rel_err = 0;             // |x - dec| / |x| where |x| / scale >= 2^-6
  double fp8_max_sub_err_over_scale = 0;  // |x - dec| / scale where |x| / scale < 2^-6
};

void CheckBounds(const Shape& shape, const Rows& rows, RowType t, BoundStats& stats) {
  const uint32_t entries = rows.count;
  const PageCodec codec = MakeCodec(shape, entries, ActiveSimdPath());
  const std::vector<uint8_t> page = Encode(codec, rows, t, 0);
  const auto dec = Decode<float>(codec, page, 0, rows.count);
  const auto dec16 = Decode<uint16_t>(codec, page, 0, rows.count);
  const bool fp8 = codec_testing::IsFp8(shape.format);
  const uint32_t nope = NopeDims(shape);
  for (uint32_t r = 0; r < rows.count; ++r) {
    const auto tiles = Tiles(shape, page, entries, r);
    for (const TileRef& tile : tiles) {
      const double s = tile.scale;
      ASSERT_TRUE(std::isfinite(s) && s >= 0) << ShapeName(shape) << " row " << r;
      for (uint32_t i = tile.first; i < tile.first + tile.size; ++i) {
        const double x = rows.Seen(t, r, i);
        const double y = dec[size_t{r} * shape.dims + i];
        const double err = std::fabs(x - y);
        // bf16 output is the fp32 output rounded to bf16.
        ASSERT_EQ(dec16[size_t{r} * shape.dims + i], Bf16FromFloat(static_cast<float>(y)));
        if (!fp8) {
          // scale/2, plus the reciprocal's and the products' fp32 roundings, plus denormal steps.
          const double tol = 0.5 * s + 127 * s * 0x1p-22 + std::fabs(y) * 0x1p-24 + 0x1p-149;
          ASSERT_LE(err, tol) << ShapeName(shape) << " row " << r << " dim " << i << " x " << x
                              << " dec " << y << " scale " << s;
          if (s > 0)
            stats.int8_max_err_over_scale = std::max(stats.int8_max_err_over_scale, err / s);
        } else if (std::fabs(x) >= 0x1p-6 * s && s > 0) {
          const double rel = err / std::fabs(x);
          ASSERT_LE(rel, 0x1p-4 * (1 + 0x1p-16) + 0x1p-149 / std::fabs(x))
              << ShapeName(shape) << " row " << r << " dim " << i << " x " << x << " dec " << y
              << " scale " << s;
          stats.fp8_max_rel_err = std::max(stats.fp8_max_rel_err, rel);
        } else {
          // Half the least subnormal step (2^-9) of the scaled value, plus fp32 rounding.
          const double tol = 0x1p-10 * s * (1 + 0x1p-16) + 0x1p-149;
          ASSERT_LE(err, tol) << ShapeName(shape) << " row " << r << " dim " << i << " x " << x
                              << " dec " << y << " scale " << s;
          if (s > 0)
            stats.fp8_max_sub_err_over_scale = std::max(stats.fp8_max_sub_err_over_scale, err / s);
        }
      }
    }
    // Everything past the 8-bit part is stored exactly (bf16 rope; raw formats).
    for (uint32_t i = nope; i < shape.dims; ++i) {
      const size_t k = size_t{r} * shape.dims + i;
      const float expect = shape.format == StorageFormat::kFp32
                               ? rows.Seen(t, r, i)
                               : Bf16ToFloat(Bf16FromFloat(rows.Seen(t, r, i)));
      ASSERT_EQ(std::bit_cast<uint32_t>(dec[k]), std::bit_cast<uint32_t>(expect))
          << ShapeName(shape) << " row " << r << " dim " << i;
      if (t == RowType::kBf16) {
        ASSERT_EQ(dec16[k], rows.bf16[k]) << "bf16 passes through bit-exact";
      }
    }
  }
}

TEST(PageCodec, ErrorBoundsHold) {
  BoundStats stats;
  for (const Shape& shape : AllShapes()) {
    for (RowType t : kRowTypes) {
      CheckBounds(shape, codec_testing::GaussianRows(200, shape.dims, 11), t, stats);
      CheckBounds(shape, codec_testing::EdgeRows(shape.dims), t, stats);
      CheckBounds(shape, codec_testing::ChaosRows(50, shape.dims, 12), t, stats);
    }
  }
  std::printf(
      "measured: int8 max |x - dec| / scale = %.6f; fp8 max relative error (normal range) = %.6f "
      "(2^-4 = %.6f); fp8 max |x - dec| / scale below 2^-6 = %.3g (2^-10 = %.3g)\n",
      stats.int8_max_err_over_scale, stats.fp8_max_rel_err, 0x1p-4,
      stats.fp8_max_sub_err_over_scale, 0x1p-10);
  RecordProperty("int8_max_err_over_scale", std::to_string(stats.int8_max_err_over_scale));
  RecordProperty("fp8_max_rel_err", std::to_string(stats.fp8_max_rel_err));
  RecordProperty("fp8_max_sub_err_over_scale", std::to_string(stats.fp8_max_sub_err_over_scale));
  EXPECT_GT(stats.int8_max_err_over_scale, 0.45);  // the bound is tight, not vacuous
  EXPECT_GT(stats.fp8_max_rel_err, 0.05);
}

// ---- NaN and infinity ----

TEST(PageCodec, NonFiniteValuesStayInTheirTileOrElement) {
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  for (const Shape& shape : AllShapes()) {
    if (!codec_testing::IsEightBit(shape.format)) continue;
    for (RowType t : kRowTypes) {
      SCOPED_TRACE(ShapeName(shape) + " from " + RowTypeName(t));
      // Row 1 has NaN, -NaN, inf, -inf at dims 5..8 (the first tile); rows 0 and 2 are clean.
      Rows rows = codec_testing::GaussianRows(3, shape.dims, 21);
      Rows clean = rows;  // row 1 with the specials replaced by zeros
      const float specials[] = {nan, -nan, inf, -inf};
      for (int k = 0; k < 4; ++k) {
        rows.at(1, 5 + k) = specials[k];
        clean.at(1, 5 + k) = 0.0f;
      }
      rows.Finish();
      clean.Finish();
      const uint32_t entries = 3;
      const PageCodec codec = MakeCodec(shape, entries, ActiveSimdPath());
      const auto page = Encode(codec, rows, t, 0);
      const auto clean_page = Encode(codec, clean, t, 0);
      const auto dec = Decode<float>(codec, page, 0, 3);
      const auto clean_dec = Decode<float>(codec, clean_page, 0, 3);
      // Neighbours are untouched: identical decoded values (and so identical bytes).
      for (uint32_t r : {0u, 2u}) {
        for (uint32_t i = 0; i < shape.dims; ++i) {
          const size_t k = size_t{r} * shape.dims + i;
          ASSERT_EQ(std::bit_cast<uint32_t>(dec[k]), std::bit_cast<uint32_t>(clean_dec[k]))
              << r << " " << i;
        }
      }
      const auto tiles = Tiles(shape, page, entries, 1);
      const auto clean_tiles = Tiles(shape, clean_page, entries, 1);
      ASSERT_FALSE(tiles.empty());
      for (size_t ti = 0; ti < tiles.size(); ++ti) {
        const bool hit = tiles[ti].first <= 5 && 8 < tiles[ti].first + tiles[ti].size;
        for (uint32_t i = tiles[ti].first; i < tiles[ti].first + tiles[ti].size; ++i) {
          const float y = dec[shape.dims + i];
          if (!hit) {  // other tiles of the same row: as if nothing happened
            ASSERT_EQ(std::bit_cast<uint32_t>(y),
                      std::bit_cast<uint32_t>(clean_dec[shape.dims + i]))
                << i;
          } else if (!codec_testing::IsFp8(shape.format)) {
            ASSERT_TRUE(std::isnan(tiles[ti].scale));  // int8: the whole tile decodes as NaN
            ASSERT_TRUE(std::isnan(y)) << i;
          } else if (i >= 5 && i <= 8) {  // fp8: the element itself is the NaN code, sign kept
            ASSERT_TRUE(std::isnan(y)) << i;
            ASSERT_EQ(std::signbit(y), i == 6 || i == 8) << i;
          } else {  // fp8: the rest of the tile encodes as if the specials were absent
            ASSERT_EQ(tiles[ti].scale, clean_tiles[ti].scale);
            ASSERT_EQ(std::bit_cast<uint32_t>(y),
                      std::bit_cast<uint32_t>(clean_dec[shape.dims + i]))
                << i;
          }
        }
      }
    }
  }
}

TEST(PageCodec, RopeKeepsNaNAndInfinity) {
  for (const Shape shape : {Shape{StorageFormat::kC8Mla, 576}, Shape{StorageFormat::kFp8V4, 512}}) {
    Rows rows = codec_testing::GaussianRows(1, shape.dims, 4);
    rows.at(0, shape.dims - 1) = std::numeric_limits<float>::quiet_NaN();
    rows.at(0, shape.dims - 2) = -std::numeric_limits<float>::infinity();
    rows.Finish();
    for (RowType t : kRowTypes) {
      const PageCodec codec = MakeCodec(shape, 1, ActiveSimdPath());
      const auto dec = Decode<float>(codec, Encode(codec, rows, t, 0), 0, 1);
      EXPECT_TRUE(std::isnan(dec[shape.dims - 1]));
      EXPECT_EQ(dec[shape.dims - 2], -std::numeric_limits<float>::infinity());
    }
  }
}

// ---- zero tiles ----

TEST(PageCodec, ZeroTilesStoreTheDocumentedScaleAndDecodeToZero) {
  for (const Shape& shape : AllShapes()) {
    if (!codec_testing::IsEightBit(shape.format)) continue;
    const Rows rows = codec_testing::EdgeRows(shape.dims);  // rows 0 and 1: +0 and -0
    for (RowType t : kRowTypes) {
      const PageCodec codec = MakeCodec(shape, rows.count, ActiveSimdPath());
      const auto page = Encode(codec, rows, t, 0);
      const auto dec = Decode<float>(codec, page, 0, rows.count);
      for (uint32_t r = 0; r < 2; ++r) {
        // The public writers' floors: 2^-13 for fp8_ds_mla and fp8_v4 (max(amax / 448, 1e-4)),
        // 2^-22 for idx_fp8 (max(amax, 1e-4) / 448); the int8 formats 1e-8 / 127 (CANN's golden).
        const float expected = shape.format == StorageFormat::kFp8DsMla || shape.format == StorageFormat::kFp8V4
                                   ? 0x1p-13f
                                   : shape.format == StorageFormat::kIdxFp8 ? 0x1p-22f : 1e-8f / 127.0f;
        for (const TileRef& tile : Tiles(shape, page, rows.count, r)) EXPECT_EQ(tile.scale, expected);
        for (uint32_t i = 0; i < NopeDims(shape); ++i) {
          const float y = dec[size_t{r} * shape.dims + i];
          EXPECT_EQ(y, 0.0f);
          // fp8 keeps the sign of zero (0x80 is -0); int8 has one zero.
          if (codec_testing::IsFp8(shape.format)) {
            EXPECT_EQ(std::signbit(y), r == 1);
          }
        }
      }
    }
  }
}

// ---- slots ----

// Every byte of slot `slot` in a page of `entries` entries, by DESIGN.md's layouts.
std::vector<std::pair<uint64_t, uint64_t>> SlotRanges(const Shape& s, uint32_t entries,
                                                      uint32_t slot) {
  const uint64_t e = FormatEntryBytes(s.format, s.dims);
  switch (s.format) {
    case StorageFormat::kFp8V4:
      return {{layout::Fp8V4DataOffset(slot), 576}, {layout::Fp8V4ScaleOffset(entries, slot), 8}};
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      return {{layout::IdxValueOffset(s.dims, slot), s.dims},
              {layout::IdxScaleOffset(s.dims, entries, slot), 4}};
    default:
      return {{e * slot, e}};
  }
}

TEST(PageCodec, WritesTouchOnlyTheirSlots) {
  for (const Shape& shape : AllShapes()) {
    const uint32_t entries = 16, first = 3, count = 4;
    const Rows rows = codec_testing::GaussianRows(count, shape.dims, 8);
    for (SimdPath path : Paths()) {
      const PageCodec codec = MakeCodec(shape, entries, path);
      const auto page = Encode(codec, rows, RowType::kBf16, first);
      std::vector<bool> owned(page.size());
      for (uint32_t slot = first; slot < first + count; ++slot) {
        for (auto [off, len] : SlotRanges(shape, entries, slot)) {
          for (uint64_t b = off; b < off + len; ++b) owned[b] = true;
        }
      }
      size_t changed = 0;
      for (size_t b = 0; b < page.size(); ++b) {
        if (!owned[b]) {
          ASSERT_EQ(page[b], kFill) << ShapeName(shape) << " byte " << b << " outside slots [3, 7)";
        } else {
          changed += page[b] != kFill;
        }
      }
      EXPECT_GT(changed, 0u);
    }
  }
}

TEST(PageCodec, EntryDecodeMatchesRangeDecode) {
  for (const Shape& shape : AllShapes()) {
    const Rows rows = codec_testing::GaussianRows(9, shape.dims, 13);
    for (SimdPath path : Paths()) {
      const PageCodec codec = MakeCodec(shape, 9, path);
      const auto page = Encode(codec, rows, RowType::kBf16, 0);
      const auto all32 = Decode<float>(codec, page, 0, 9);
      const auto all16 = Decode<uint16_t>(codec, page, 0, 9);
      std::vector<float> one32(shape.dims);
      std::vector<uint16_t> one16(shape.dims);
      for (uint32_t slot = 0; slot < 9; ++slot) {
        codec.DecodeEntryFp32(page.data(), slot, one32.data());
        codec.DecodeEntryBf16(page.data(), slot, one16.data());
        ASSERT_EQ(
            std::memcmp(one32.data(), all32.data() + size_t{slot} * shape.dims, shape.dims * 4), 0);
        ASSERT_EQ(
            std::memcmp(one16.data(), all16.data() + size_t{slot} * shape.dims, shape.dims * 2), 0);
      }
    }
  }
}

TEST(PageCodec, StridedRowsAndUnalignedPages) {
  const Shape shape{StorageFormat::kC8Mla, 576};
  const Rows rows = codec_testing::GaussianRows(5, 576, 14);
  std::vector<uint16_t> strided(5 * 600, 0xdead);
  for (uint32_t r = 0; r < 5; ++r) std::memcpy(&strided[r * 600], &rows.bf16[r * 576], 576 * 2);
  const PageCodec codec = MakeCodec(shape, 5, ActiveSimdPath());
  std::vector<uint8_t> buf(codec.page_bytes() + 1);
  ASSERT_TRUE(
      codec.WriteTokens(buf.data() + 1, 0, RowsView::Bf16(strided.data(), 5, 576, 1200)).ok());
  const auto expect = Encode(codec, rows, RowType::kBf16, 0);
  EXPECT_EQ(std::memcmp(buf.data() + 1, expect.data(), expect.size()), 0);
  std::vector<uint16_t> out(5 * 600, 0xbeef);
  ASSERT_TRUE(
      codec.ReadTokens(buf.data() + 1, 0, MutableRowsView::Bf16(out.data(), 5, 576, 1200)).ok());
  for (uint32_t r = 0; r < 5; ++r) {
    EXPECT_EQ(out[r * 600 + 576], 0xbeef);  // the gap between rows is left alone
  }
}

TEST(PageCodec, ThreadsMayFillDistinctSlotsOfOnePage) {
  for (const Shape& shape : AllShapes()) {
    const uint32_t entries = 64;
    const Rows rows = codec_testing::GaussianRows(entries, shape.dims, 15);
    const PageCodec codec = MakeCodec(shape, entries, ActiveSimdPath());
    const auto expect = Encode(codec, rows, RowType::kFp32, 0);
    std::vector<uint8_t> page(codec.page_bytes(), kFill);
    std::vector<std::thread> threads;
    for (uint32_t k = 0; k < 4; ++k) {
      threads.emplace_back([&, k] {
        for (uint32_t slot = k; slot < entries; slot += 4) {
          const RowsView one =
              RowsView::Fp32(rows.fp32.data() + size_t{slot} * shape.dims, 1, shape.dims);
          EXPECT_TRUE(codec.WriteTokens(page.data(), slot, one).ok());
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(page, expect) << ShapeName(shape);
  }
}

// ---- errors ----

TEST(PageCodec, CreateRejectsBadShapes) {
  EXPECT_EQ(PageCodec::Create(StorageFormat::kC8Mla, 512, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kFp8DsMla, 577, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kFp8V4, 576, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kIdxFp8, 100, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kIdxC8, 0, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kBf16, 0, 128).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(StorageFormat::kBf16, 64, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PageCodec::Create(static_cast<StorageFormat>(42), 64, 1).status().code(),
            StatusCode::kInvalidArgument);
  auto msg = PageCodec::Create(StorageFormat::kC8Mla, 512, 128).status();
  EXPECT_NE(msg.message().find("c8_mla"), std::string_view::npos);
  EXPECT_NE(msg.message().find("576"), std::string_view::npos);
  for (int i = 0; i < kNumSimdPaths; ++i) {
    CodecOptions o;
    o.simd_path = static_cast<SimdPath>(i);
    auto c = PageCodec::Create(StorageFormat::kIdxFp8, 128, 8, o);
    EXPECT_EQ(c.ok(), SimdPathSupported(static_cast<SimdPath>(i)));
    if (!c.ok()) {
      EXPECT_EQ(c.status().code(), StatusCode::kNotSupported);
    }
  }
}

TEST(PageCodec, CallsRejectBadArgumentsAndWriteNothing) {
  const PageCodec codec = MakeCodec({StorageFormat::kIdxFp8, 128}, 8, ActiveSimdPath());
  EXPECT_EQ(codec.page_bytes(), FormatPageBytes(StorageFormat::kIdxFp8, 128, 8));
  std::vector<uint8_t> page(codec.page_bytes(), kFill);
  std::vector<uint16_t> rows(128 * 9, 0x3f80);
  EXPECT_EQ(codec.WriteTokens(nullptr, 0, RowsView::Bf16(rows.data(), 1, 128)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(codec.WriteTokens(page.data(), 0, RowsView::Bf16(nullptr, 1, 128)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(codec.WriteTokens(page.data(), 0, RowsView::Bf16(rows.data(), 1, 64)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(codec.WriteTokens(page.data(), 0, RowsView::Bf16(rows.data(), 2, 128, 100)).code(),
            StatusCode::kInvalidArgument);
  Status past = codec.WriteTokens(page.data(), 5, RowsView::Bf16(rows.data(), 4, 128));
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  EXPECT_NE(past.message().find("[5, 9)"), std::string_view::npos) << past.ToString();
  EXPECT_EQ(codec.WriteTokens(page.data(), 9, RowsView::Bf16(rows.data(), 0, 128)).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(codec.WriteTokens(page.data(), UINT32_MAX, RowsView::Bf16(rows.data(), 2, 128)).code(),
            StatusCode::kOutOfRange);
  RowsView bad_type = RowsView::Bf16(rows.data(), 1, 128);
  bad_type.type = static_cast<RowType>(7);
  EXPECT_EQ(codec.WriteTokens(page.data(), 0, bad_type).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(page.begin(), page.end(), [](uint8_t b) { return b == kFill; }));
  EXPECT_TRUE(
      codec.WriteTokens(page.data(), 8, RowsView::Bf16(nullptr, 0, 128)).ok());  // empty is fine
  std::vector<float> out(128 * 8);
  EXPECT_EQ(codec.ReadTokens(page.data(), 7, MutableRowsView::Fp32(out.data(), 2, 128)).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(codec.ReadTokens(nullptr, 0, MutableRowsView::Fp32(out.data(), 1, 128)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(codec.ReadTokens(page.data(), 0, MutableRowsView::Fp32(out.data(), 8, 128)).ok());
}

}  // namespace
}  // namespace sparsekv
