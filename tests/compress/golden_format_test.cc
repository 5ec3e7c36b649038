// Golden pages: a reference written here from the public writers' formulas (no code of theirs),
// producing whole pages for deterministic bf16 inputs, compared byte for byte with what every
// SIMD path of our codec writes; then the reference's pages decoded by ours.
//
// Sources of the formulas (read at these commits):
//  - fp8_ds_mla, fp8_v4: FlashMLA tests/quant.py, quantize_k_cache (deepseek-ai/FlashMLA
//    @520fec6): per tile of 128 (V32_FP8Sparse) or 64 (MODEL1_FP8Sparse) values,
//    s = 2^ceil(log2(max(fp32(amax) / 448, 1e-4))), value = e4m3(fp32(x) / s); V3.2 token =
//    512 fp8 | 4 fp32 s | 64 bf16 rope; V4 page = n x (448 fp8 | 64 bf16 rope) then
//    n x (7 ue8m0 | 1 pad), padded to a multiple of 576 bytes.
//  - idx_fp8: DeepSeek-V3.2-Exp inference/model.py Indexer (act_quant(k, 128, scale_fmt) with
//    scale_fmt "ue8m0" in the released config) and its kernel: amax floored at 1e-4,
//    s = 2^ceil(log2(max(amax, 1e-4) / 448)) stored as fp32, value = e4m3(clamp(x / s, ±448));
//    the paged layout is vLLM's indexer_k_quant_and_cache (n x 128 fp8, then n x fp32).
//  - c8_mla: CANN npu_kv_quant_sparse_flash_attention's key with key_quant_mode 2, tile 128
//    (Ascend op-plugin docs @461b5f7): per token 512 int8 | 64 bf16 rope | 4 fp32 scales. The
//    arithmetic is the golden of CANN's quantized sparse flash attention for DeepSeek V3.2 in
//    hicann/pypto (models/deepseek_v32_exp/deepseekv32_sparse_flash_attention_quant.py and
//    deepseekv32_sparse_attention_antiquant.py, last changed at
//    b945dd2d2fd6015f11ad4e44ed108358cc7a4303): per token and tile of 128, in fp32,
//    s = max(amax, 1e-8) / 127, q = round-half-even(x / s) clamped to [-128, 127].
//
// e4m3 here is the OCP 8-bit float E4M3 (bias 7, no infinities, S.1111.111 NaN, largest 448),
// rounded to nearest, ties to the even code: written from the spec by searching the 126 finite
// magnitudes, not by bit manipulation as the codec does.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {
namespace {

// ---- numbers from their definitions ----

double E4m3Magnitude(uint32_t code7) {  // code without the sign bit, 0 .. 0x7e
  const uint32_t e = code7 >> 3, m = code7 & 7;
  return e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, static_cast<int>(e) - 7);
}

// Nearest e4m3 code of a finite v with |v| <= 448; ties to the even code.
uint8_t E4m3Nearest(double v) {
  const double a = std::fabs(v);
  uint32_t best = 0;
  for (uint32_t c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(E4m3Magnitude(c) - a), db = std::fabs(E4m3Magnitude(best) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 0x80 : 0));
}

float Bf16Value(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// The smallest k with 2^k >= q: ceil(log2(q)) without a rounding step.
int CeilLog2(float q) {
  int k = -160;
  while (std::ldexp(1.0, k) < q) ++k;
  return k;
}

// ---- inputs ----

// bf16 bits of the value nearest v (ties to even), for making inputs.
uint16_t ToBf16(float v) {
  uint32_t b = std::bit_cast<uint32_t>(v);
  b += 0x7fff + ((b >> 16) & 1);
  return static_cast<uint16_t>(b >> 16);
}

// The largest |x| each tile is built around: zero tiles, Gaussian tiles at every decade from
// 1e-6 to 1e4, both sides of 0.0448 (448 x 1e-4, where the fp8_ds_mla floor stops deciding),
// powers of two, 1.75 x 2^k (exactly 448 x 2^(k-8), where the exponent steps) and the bf16
// value just above it, both sides of 1e-4 and of 1.068e-4 (the idx_fp8 floor).
std::vector<float> TileMaxima() {
  std::vector<float> m = {0.0f};
  for (int d = -6; d <= 4; ++d) m.push_back(Bf16Value(ToBf16(std::pow(10.0f, d))));
  m.push_back(Bf16Value(ToBf16(0.0448f)));
  for (float v : {0.044677734375f, 0.044921875f, 0.02734375f, 0.0546875f}) m.push_back(v);
  for (int k : {-30, -14, -13, -12, -8, -1, 0, 3, 8, 12}) m.push_back(std::ldexp(1.0f, k));
  for (int k : {-20, -5, 0, 8}) {
    m.push_back(std::ldexp(1.75f, k));
    m.push_back(std::ldexp(1.7578125f, k));  // the next bf16 up
  }
  const uint16_t e4 = ToBf16(1e-4f), f4 = ToBf16(1.068e-4f);
  for (uint16_t b : {uint16_t(e4 - 1), e4, uint16_t(e4 + 1), uint16_t(f4 - 1), f4,
                     uint16_t(f4 + 1)})
    m.push_back(Bf16Value(b));
  return m;
}

// `count` rows of `dims` bf16 values. Each tile of `tile` values (from `first`, up to `upto`)
// is Gaussian scaled so that its largest |x| is exactly one of TileMaxima (cycling, so rows and
// tile positions see every one); values past `upto` (rope) are Gaussian of magnitude 1.
std::vector<uint16_t> GoldenRows(uint32_t count, uint32_t dims, uint32_t tile, uint32_t upto,
                                 uint64_t seed) {
  const std::vector<float> maxima = TileMaxima();
  std::vector<uint16_t> rows(size_t{count} * dims);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  size_t next = seed % maxima.size();
  for (uint32_t r = 0; r < count; ++r) {
    uint16_t* row = rows.data() + size_t{r} * dims;
    for (uint32_t t = 0; t < upto; t += tile) {
      const float amax = maxima[next++ % maxima.size()];
      std::vector<double> g(tile);
      double gmax = 0;
      for (double& x : g) gmax = std::max(gmax, std::fabs(x = normal(rng)));
      const uint32_t peak = static_cast<uint32_t>(rng() % tile);
      for (uint32_t i = 0; i < tile; ++i) {
        const float v = i == peak ? (g[i] < 0 ? -amax : amax)
                                  : static_cast<float>(g[i] / gmax * amax);
        row[t + i] = ToBf16(v);
      }
    }
    for (uint32_t i = upto; i < dims; ++i) row[i] = ToBf16(static_cast<float>(normal(rng)));
  }
  return rows;
}

float TileAmax(const uint16_t* x, uint32_t n) {
  float a = 0;
  for (uint32_t i = 0; i < n; ++i) a = std::max(a, std::fabs(Bf16Value(x[i])));
  return a;
}

void PutF32(std::vector<uint8_t>& page, uint64_t at, float v) {
  std::memcpy(page.data() + at, &v, 4);
}
void PutU16(std::vector<uint8_t>& page, uint64_t at, uint16_t v) {
  std::memcpy(page.data() + at, &v, 2);
}

// FlashMLA's power-of-two scale exponent: ceil(log2(max(fp32(amax) / 448, 1e-4))).
int FlashMlaExponent(float amax) {
  return CeilLog2(std::max(amax / 448.0f, 1e-4f));
}

// ---- the reference writers: whole pages, and which bytes they define ----

struct RefPage {
  std::vector<uint8_t> bytes;
  std::vector<bool> defined;  // bytes the format defines (not page padding)
  std::vector<float> decoded;  // what a reader gets back, per entry and dim, in fp32
};

RefPage RefFp8DsMla(const std::vector<uint16_t>& rows, uint32_t n) {
  RefPage p{std::vector<uint8_t>(size_t{n} * 656), std::vector<bool>(size_t{n} * 656, true),
            std::vector<float>(size_t{n} * 576)};
  for (uint32_t r = 0; r < n; ++r) {
    const uint16_t* x = rows.data() + size_t{r} * 576;
    const uint64_t tok = uint64_t{r} * 656;
    for (uint32_t t = 0; t < 4; ++t) {
      const int k = FlashMlaExponent(TileAmax(x + 128 * t, 128));
      PutF32(p.bytes, tok + 512 + 4 * t, static_cast<float>(std::ldexp(1.0, k)));
      for (uint32_t i = 128 * t; i < 128 * t + 128; ++i) {
        const uint8_t c = E4m3Nearest(std::ldexp(static_cast<double>(Bf16Value(x[i])), -k));
        p.bytes[tok + i] = c;
        p.decoded[size_t{r} * 576 + i] = static_cast<float>(
            (c & 0x80 ? -1 : 1) * std::ldexp(E4m3Magnitude(c & 0x7f), k));
      }
    }
    for (uint32_t i = 0; i < 64; ++i) {
      PutU16(p.bytes, tok + 528 + 2 * i, x[512 + i]);
      p.decoded[size_t{r} * 576 + 512 + i] = Bf16Value(x[512 + i]);
    }
  }
  return p;
}

RefPage RefFp8V4(const std::vector<uint16_t>& rows, uint32_t n) {
  const uint64_t used = uint64_t{n} * (576 + 8);
  const uint64_t padded = (used + 575) / 576 * 576;
  RefPage p{std::vector<uint8_t>(padded), std::vector<bool>(padded, false),
            std::vector<float>(size_t{n} * 512)};
  for (uint32_t r = 0; r < n; ++r) {
    const uint16_t* x = rows.data() + size_t{r} * 512;
    const uint64_t data = uint64_t{r} * 576, scales = uint64_t{n} * 576 + uint64_t{r} * 8;
    for (uint32_t t = 0; t < 7; ++t) {
      const int k = FlashMlaExponent(TileAmax(x + 64 * t, 64));
      p.bytes[scales + t] = static_cast<uint8_t>(k + 127);  // ue8m0: 2^(byte - 127)
      p.defined[scales + t] = true;
      for (uint32_t i = 64 * t; i < 64 * t + 64; ++i) {
        const uint8_t c = E4m3Nearest(std::ldexp(static_cast<double>(Bf16Value(x[i])), -k));
        p.bytes[data + i] = c;
        p.defined[data + i] = true;
        p.decoded[size_t{r} * 512 + i] = static_cast<float>(
            (c & 0x80 ? -1 : 1) * std::ldexp(E4m3Magnitude(c & 0x7f), k));
      }
    }
    // The eighth scale byte is padding to the public writer (torch.empty); ours writes 0.
    for (uint32_t i = 0; i < 64; ++i) {
      PutU16(p.bytes, data + 448 + 2 * i, x[448 + i]);
      p.defined[data + 448 + 2 * i] = p.defined[data + 448 + 2 * i + 1] = true;
      p.decoded[size_t{r} * 512 + 448 + i] = Bf16Value(x[448 + i]);
    }
  }
  return p;
}

RefPage RefIdxFp8(const std::vector<uint16_t>& rows, uint32_t n, uint32_t dims) {
  const uint64_t bytes = uint64_t{n} * (dims + 4);
  RefPage p{std::vector<uint8_t>(bytes), std::vector<bool>(bytes, true),
            std::vector<float>(size_t{n} * dims)};
  for (uint32_t r = 0; r < n; ++r) {
    const uint16_t* x = rows.data() + size_t{r} * dims;
    const float amax = std::max(TileAmax(x, dims), 1e-4f);
    const int k = CeilLog2(amax / 448.0f);
    PutF32(p.bytes, uint64_t{n} * dims + 4ull * r, static_cast<float>(std::ldexp(1.0, k)));
    for (uint32_t i = 0; i < dims; ++i) {
      const double q = std::clamp(std::ldexp(static_cast<double>(Bf16Value(x[i])), -k), -448.0,
                                  448.0);
      const uint8_t c = E4m3Nearest(q);
      p.bytes[uint64_t{r} * dims + i] = c;
      p.decoded[size_t{r} * dims + i] =
          static_cast<float>((c & 0x80 ? -1 : 1) * std::ldexp(E4m3Magnitude(c & 0x7f), k));
    }
  }
  return p;
}

RefPage RefC8Mla(const std::vector<uint16_t>& rows, uint32_t n) {
  RefPage p{std::vector<uint8_t>(size_t{n} * 656), std::vector<bool>(size_t{n} * 656, true),
            std::vector<float>(size_t{n} * 576)};
  for (uint32_t r = 0; r < n; ++r) {
    const uint16_t* x = rows.data() + size_t{r} * 576;
    const uint64_t tok = uint64_t{r} * 656;
    for (uint32_t i = 0; i < 64; ++i) {
      PutU16(p.bytes, tok + 512 + 2 * i, x[512 + i]);  // rope right after the values
      p.decoded[size_t{r} * 576 + 512 + i] = Bf16Value(x[512 + i]);
    }
    for (uint32_t t = 0; t < 4; ++t) {
      const float s = std::max(TileAmax(x + 128 * t, 128), 1e-8f) / 127.0f;
      PutF32(p.bytes, tok + 640 + 4 * t, s);  // scales last
      for (uint32_t i = 128 * t; i < 128 * t + 128; ++i) {
        const float v = std::clamp(std::nearbyint(Bf16Value(x[i]) / s), -128.0f, 127.0f);
        const int8_t q = static_cast<int8_t>(v);
        p.bytes[tok + i] = static_cast<uint8_t>(q);
        p.decoded[size_t{r} * 576 + i] = static_cast<float>(q) * s;
      }
    }
  }
  return p;
}

// ---- the comparisons ----

struct Case {
  StorageFormat format;
  uint32_t dims;
  uint32_t entries;
  uint32_t tile;  // the scale tile, for the inputs
  uint32_t upto;  // quantized dims (the rest is rope)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << StorageFormatName(c.format) << "/" << c.dims << " x " << c.entries;
}

RefPage Reference(const Case& c, const std::vector<uint16_t>& rows) {
  switch (c.format) {
    case StorageFormat::kFp8DsMla: return RefFp8DsMla(rows, c.entries);
    case StorageFormat::kFp8V4: return RefFp8V4(rows, c.entries);
    case StorageFormat::kIdxFp8: return RefIdxFp8(rows, c.entries, c.dims);
    default: return RefC8Mla(rows, c.entries);
  }
}

Result<PageCodec> CodecOn(const Case& c, SimdPath path) {
  CodecOptions o;
  o.simd_path = path;
  return PageCodec::Create(c.format, c.dims, c.entries, o);
}

class GoldenPages : public ::testing::TestWithParam<Case> {};

// Our pages, on every SIMD path, are the reference's bytes wherever the format defines them.
TEST_P(GoldenPages, EveryPathWritesTheReferenceBytes) {
  const Case c = GetParam();
  const std::vector<uint16_t> rows = GoldenRows(c.entries, c.dims, c.tile, c.upto, c.dims);
  const RefPage ref = Reference(c, rows);
  for (SimdPath path : SupportedSimdPaths()) {
    SCOPED_TRACE(std::string(StorageFormatName(c.format)) + " on " +
                 std::string(SimdPathName(path)));
    auto codec = CodecOn(c, path);
    ASSERT_TRUE(codec.ok()) << codec.status().ToString();
    ASSERT_EQ(codec->page_bytes(), ref.bytes.size());
    std::vector<uint8_t> page(codec->page_bytes(), 0xA5);
    ASSERT_TRUE(
        codec->WriteTokens(page.data(), 0, RowsView::Bf16(rows.data(), c.entries, c.dims)).ok());
    size_t mismatches = 0;
    for (size_t i = 0; i < page.size(); ++i) {
      if (!ref.defined[i] || page[i] == ref.bytes[i]) continue;
      if (++mismatches <= 5) {
        ADD_FAILURE() << "byte " << i << ": ours " << int(page[i]) << ", reference "
                      << int(ref.bytes[i]);
      }
    }
    EXPECT_EQ(mismatches, 0u);
  }
}

// The reference's pages decode through ours, on every path, to the values the reference's
// own dequantization gives (exact here: e4m3 values times powers of two, int8 times a scale).
TEST_P(GoldenPages, EveryPathDecodesTheReferencePages) {
  const Case c = GetParam();
  const std::vector<uint16_t> rows = GoldenRows(c.entries, c.dims, c.tile, c.upto, c.dims + 1);
  const RefPage ref = Reference(c, rows);
  for (SimdPath path : SupportedSimdPaths()) {
    SCOPED_TRACE(std::string(StorageFormatName(c.format)) + " on " +
                 std::string(SimdPathName(path)));
    auto codec = CodecOn(c, path);
    ASSERT_TRUE(codec.ok()) << codec.status().ToString();
    std::vector<uint8_t> page = ref.bytes;
    std::vector<float> out(size_t{c.entries} * c.dims);
    codec->DecodeEntriesFp32(page.data(), 0, c.entries, out.data());
    size_t mismatches = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      if (std::bit_cast<uint32_t>(out[i]) == std::bit_cast<uint32_t>(ref.decoded[i])) continue;
      if (++mismatches <= 5) {
        ADD_FAILURE() << "entry " << i / c.dims << " dim " << i % c.dims << ": ours " << out[i]
                      << ", reference " << ref.decoded[i];
      }
    }
    EXPECT_EQ(mismatches, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, GoldenPages,
    ::testing::Values(Case{StorageFormat::kFp8DsMla, 576, 64, 128, 512},
                      Case{StorageFormat::kFp8V4, 512, 64, 64, 448},
                      Case{StorageFormat::kFp8V4, 512, 5, 64, 448},  // padding after 5 x 584
                      Case{StorageFormat::kIdxFp8, 128, 64, 128, 128},
                      Case{StorageFormat::kC8Mla, 576, 64, 128, 512}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(StorageFormatName(info.param.format)) + "_" +
             std::to_string(info.param.entries);
    });

// The inputs reach what they are for: every maximum appears, and with them the scales the
// floors decide and the ones they do not.
TEST(GoldenInputs, CoverTheFloorsAndTheSteps) {
  const std::vector<uint16_t> rows = GoldenRows(64, 576, 128, 512, 576);
  std::vector<int> exponents;
  for (uint32_t r = 0; r < 64; ++r) {
    for (uint32_t t = 0; t < 4; ++t)
      exponents.push_back(FlashMlaExponent(TileAmax(rows.data() + size_t{r} * 576 + 128 * t, 128)));
  }
  EXPECT_GT(std::count(exponents.begin(), exponents.end(), -13), 10) << "floored tiles";
  EXPECT_GT(std::count(exponents.begin(), exponents.end(), -12), 0) << "just above the floor";
  EXPECT_GT(*std::max_element(exponents.begin(), exponents.end()), 3) << "large tiles";
}

// ---- idx_c8 in vllm-ascend's shape ----

double HalfValue(uint16_t b) {
  const int e = (b >> 10) & 31, m = b & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (b & 0x8000) ? -v : v;
}

// vllm-ascend keeps the C8 indexer's int8 keys and fp16 per-key scales as two tensors. The
// export gives exactly the page's int8 bytes and, for each scale, the nearest fp16 (neither
// neighbour is closer; ties to the even pattern).
TEST(IdxC8Export, KeysAreThePageBytesAndScalesTheNearestFp16) {
  constexpr uint32_t kDims = 128, kEntries = 24;
  std::vector<uint16_t> rows = GoldenRows(kEntries, kDims, kDims, kDims, 7);
  for (uint32_t i = 0; i < kDims; ++i) rows[i] = ToBf16(i == 3 ? -127.0f : 1.0f);  // scale 1
  auto codec = PageCodec::Create(StorageFormat::kIdxC8, kDims, kEntries);
  ASSERT_TRUE(codec.ok());
  std::vector<uint8_t> page(codec->page_bytes());
  ASSERT_TRUE(codec->WriteTokens(page.data(), 0, RowsView::Bf16(rows.data(), kEntries, kDims)).ok());
  std::vector<int8_t> keys(kEntries * kDims, 99);
  std::vector<uint16_t> scales(kEntries, 0xffff);
  ASSERT_TRUE(ExportIdxC8(*codec, page.data(), 0, kEntries, keys.data(), scales.data()).ok());
  EXPECT_EQ(std::memcmp(keys.data(), page.data(), keys.size()), 0);
  EXPECT_EQ(scales[0], 0x3c00) << "fp16 1.0";
  for (uint32_t r = 0; r < kEntries; ++r) {
    float s;
    std::memcpy(&s, page.data() + kEntries * kDims + 4 * r, 4);
    const double h = HalfValue(scales[r]);
    ASSERT_FALSE(scales[r] & 0x8000) << r;
    const double up = HalfValue(static_cast<uint16_t>(scales[r] + 1));
    EXPECT_LE(std::fabs(h - s), std::fabs(up - s)) << r << ": scale " << s;
    if (scales[r] > 0) {
      const double down = HalfValue(static_cast<uint16_t>(scales[r] - 1));
      EXPECT_LE(std::fabs(h - s), std::fabs(down - s)) << r << ": scale " << s;
    }
  }
  // A part of the page, and the errors.
  std::vector<int8_t> part(3 * kDims);
  std::vector<uint16_t> part_scales(3);
  ASSERT_TRUE(ExportIdxC8(*codec, page.data(), 20, 3, part.data(), part_scales.data()).ok());
  EXPECT_EQ(std::memcmp(part.data(), page.data() + 20 * kDims, part.size()), 0);
  EXPECT_EQ(part_scales[2], scales[22]);
  EXPECT_EQ(ExportIdxC8(*codec, page.data(), 22, 3, part.data(), part_scales.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ExportIdxC8(*codec, nullptr, 0, 1, part.data(), part_scales.data()).code(),
            StatusCode::kInvalidArgument);
  auto fp8 = PageCodec::Create(StorageFormat::kIdxFp8, kDims, kEntries);
  ASSERT_TRUE(fp8.ok());
  const Status wrong = ExportIdxC8(*fp8, page.data(), 0, 1, part.data(), part_scales.data());
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("idx_fp8"), std::string_view::npos) << wrong.ToString();
}

}  // namespace
}  // namespace sparsekv
