// Page bytes at the offsets DESIGN.md documents, read directly (not through the codec), with the
// expected scales and values computed here from the format definitions.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/fp8.h"
#include "sparsekv/storage_format.h"
#include "tests/compress/codec_test_util.h"

namespace sparsekv {
namespace {

using codec_testing::kFill;
using codec_testing::Rows;

float F32At(const std::vector<uint8_t>& page, uint64_t off) {
  float v;
  std::memcpy(&v, page.data() + off, 4);
  return v;
}
uint16_t U16At(const std::vector<uint8_t>& page, uint64_t off) {
  uint16_t v;
  std::memcpy(&v, page.data() + off, 2);
  return v;
}

double AbsMax(const Rows& rows, RowType t, uint32_t r, uint32_t first, uint32_t n) {
  double m = 0;
  for (uint32_t i = first; i < first + n; ++i)
    m = std::max(m, std::fabs(static_cast<double>(rows.Seen(t, r, i))));
  return m;
}

// The linear scale rule, as CANN's golden computes it (hicann/pypto, DeepSeek V3.2 SFA quant
// test): max(amax, 1e-8) / n in fp32.
float LinearScale(double amax, float n) {
  return std::max(static_cast<float>(amax), 1e-8f) / n;
}

// The public writers' power-of-two scales, written as they compute them, in fp32 (amax is the
// tile's largest |x| of the fp32 or bf16-widened input):
// fp8_ds_mla and fp8_v4 (FlashMLA tests/quant.py quantize_k_cache, vLLM's fp8_ds_mla writer,
// FlashMLA MODEL1_FP8Sparse): s = 2^ceil(log2(max(amax / 448, 1e-4))).
int DsMlaExponent(double amax) {
  const float r = std::max(static_cast<float>(amax) / 448.0f, 1e-4f);
  return static_cast<int>(std::ceil(std::log2(r)));
}
// idx_fp8 (DeepSeek V3.2 Indexer act_quant with scale_fmt "ue8m0", vLLM
// indexer_k_quant_and_cache with use_ue8m0, SGLang's NSA indexer):
// s = 2^ceil(log2(max(amax, 1e-4) / 448)).
int IdxFp8Exponent(double amax) {
  const float r = std::max(static_cast<float>(amax), 1e-4f) / 448.0f;
  return static_cast<int>(std::ceil(std::log2(r)));
}

// Rows whose tiles are tiny or zero, where the floors above decide the scale: each row is
// Gaussian values times a factor from 0 to 1 (0, 1e-9, 1e-6, 1e-5, 2.2e-5, 1e-4, 1.1e-4,
// 1e-3, 0.0273, 0.0448, 0.05, 1).
Rows TinyRows(uint32_t count, uint32_t dims, uint64_t seed) {
  static constexpr float kFactors[] = {0.0f, 1e-9f, 1e-6f, 1e-5f, 2.2e-5f, 1e-4f,
                                       1.1e-4f, 1e-3f, 0.0273f, 0.0448f, 0.05f, 1.0f};
  Rows rows = codec_testing::GaussianRows(count, dims, seed);
  for (uint32_t r = 0; r < count; ++r) {
    const float f = kFactors[r % std::size(kFactors)];
    for (uint32_t i = 0; i < dims; ++i) rows.at(r, i) = std::fmod(rows.at(r, i), 3.0f) * f;
  }
  rows.Finish();
  return rows;
}

// int8 value of x under scale s: round(x * (1/s)) with the reciprocal and product in fp32.
int8_t Int8Of(float x, float s) {
  return static_cast<int8_t>(std::fmax(-128.0f, std::fmin(127.0f, std::nearbyint(x / s))));
}

// CANN's key for npu_kv_quant_sparse_flash_attention (key_quant_mode 2, tile 128): per token
// 512 int8 nope values, 64 bf16 rope values, then the 4 fp32 tile scales (byte 640).
TEST(PageLayout, C8Mla) {
  const uint32_t entries = 16;
  const Rows rows = codec_testing::GaussianRows(entries, 576, 31);
  for (RowType t : {RowType::kBf16, RowType::kFp32}) {
    auto codec = PageCodec::Create(StorageFormat::kC8Mla, 576, entries);
    ASSERT_TRUE(codec.ok());
    ASSERT_EQ(codec->page_bytes(), entries * 656u);
    std::vector<uint8_t> page(codec->page_bytes(), kFill);
    ASSERT_TRUE(codec->WriteTokens(page.data(), 0, rows.View(t)).ok());
    for (uint32_t slot = 0; slot < entries; ++slot) {
      const uint64_t base = uint64_t{slot} * layout::kMla8BitBytes;
      for (uint32_t tile = 0; tile < 4; ++tile) {
        const float s = F32At(page, base + 640 + 4 * tile);
        ASSERT_EQ(s, LinearScale(AbsMax(rows, t, slot, tile * 128, 128), 127.0f))
            << slot << " " << tile;
        for (uint32_t i = tile * 128; i < tile * 128 + 128; ++i) {
          ASSERT_EQ(static_cast<int8_t>(page[base + i]), Int8Of(rows.Seen(t, slot, i), s))
              << slot << " " << i;
        }
      }
      for (uint32_t i = 0; i < 64; ++i) {
        ASSERT_EQ(U16At(page, base + 512 + 2 * i),
                  rows.bf16[size_t{slot} * 576 + 512 + i]);
      }
    }
  }
}

TEST(PageLayout, Fp8DsMla) {
  const uint32_t entries = 16;
  // Gaussian rows, and rows of tiny and zero tiles where the scale floors decide.
  for (const Rows& rows : {codec_testing::GaussianRows(entries, 576, 32), TinyRows(entries, 576, 32)}) {
    for (RowType t : {RowType::kBf16, RowType::kFp32}) {
      auto codec = PageCodec::Create(StorageFormat::kFp8DsMla, 576, entries);
      ASSERT_TRUE(codec.ok());
      std::vector<uint8_t> page(codec->page_bytes(), kFill);
      ASSERT_TRUE(codec->WriteTokens(page.data(), 0, rows.View(t)).ok());
      for (uint32_t slot = 0; slot < entries; ++slot) {
        const uint64_t base = uint64_t{slot} * 656;
        for (uint32_t tile = 0; tile < 4; ++tile) {
          const int k = DsMlaExponent(AbsMax(rows, t, slot, tile * 128, 128));
          const float s = F32At(page, base + 512 + 4 * tile);
          ASSERT_EQ(static_cast<double>(s), std::ldexp(1.0, k))
              << slot << " " << tile;  // a power of two
          for (uint32_t i = tile * 128; i < tile * 128 + 128; ++i) {
            // x / 2^k is exact, so the code is the plain e4m3 rounding of it.
            const float scaled =
                static_cast<float>(std::ldexp(static_cast<double>(rows.Seen(t, slot, i)), -k));
            ASSERT_EQ(page[base + i], E4m3FromFloat(scaled)) << slot << " " << i;
          }
        }
        for (uint32_t i = 0; i < 64; ++i)
          ASSERT_EQ(U16At(page, base + 528 + 2 * i), rows.bf16[size_t{slot} * 576 + 512 + i]);
      }
    }
  }
}

TEST(PageLayout, Fp8V4PageMajorWithPadding) {
  // 32 entries (a V4 CSA page): 32 x 584 = 18,688 bytes, padded to 19,008 (33 x 576).
  const uint32_t entries = 32;
  // Gaussian rows, and rows of tiny and zero tiles where the scale floors decide.
  for (const Rows& rows : {codec_testing::GaussianRows(entries, 512, 33), TinyRows(entries, 512, 33)}) {
    auto codec = PageCodec::Create(StorageFormat::kFp8V4, 512, entries);
    ASSERT_TRUE(codec.ok());
    ASSERT_EQ(codec->page_bytes(), 19008u);
    for (RowType t : {RowType::kBf16, RowType::kFp32}) {
      std::vector<uint8_t> page(codec->page_bytes(), kFill);
      ASSERT_TRUE(codec->WriteTokens(page.data(), 0, rows.View(t)).ok());
      for (uint32_t slot = 0; slot < entries; ++slot) {
        const uint64_t data = uint64_t{slot} * 576;
        const uint64_t scales = uint64_t{entries} * 576 + uint64_t{slot} * 8;
        ASSERT_EQ(data, layout::Fp8V4DataOffset(slot));
        ASSERT_EQ(scales, layout::Fp8V4ScaleOffset(entries, slot));
        for (uint32_t tile = 0; tile < 7; ++tile) {
          const int k = DsMlaExponent(AbsMax(rows, t, slot, tile * 64, 64));
          ASSERT_EQ(page[scales + tile], k + 127) << slot << " " << tile;  // ue8m0: 2^(e - 127)
          for (uint32_t i = tile * 64; i < tile * 64 + 64; ++i) {
            const float scaled =
                static_cast<float>(std::ldexp(static_cast<double>(rows.Seen(t, slot, i)), -k));
            ASSERT_EQ(page[data + i], E4m3FromFloat(scaled)) << slot << " " << i;
          }
        }
        ASSERT_EQ(page[scales + 7], 0) << "pad byte";
        for (uint32_t i = 0; i < 64; ++i)
          ASSERT_EQ(U16At(page, data + 448 + 2 * i), rows.bf16[size_t{slot} * 512 + 448 + i]);
      }
      for (uint64_t b = entries * 584u; b < page.size(); ++b)
        ASSERT_EQ(page[b], kFill) << "page padding " << b;
    }
  }
}

TEST(PageLayout, IndexerFormatsArePageMajor) {
  const uint32_t entries = 24, dims = 128;
  // Gaussian rows, and rows of tiny and zero tiles where the scale floors decide.
  for (const Rows& rows : {codec_testing::GaussianRows(entries, dims, 34), TinyRows(entries, dims, 34)}) {
    for (StorageFormat f : {StorageFormat::kIdxFp8, StorageFormat::kIdxC8}) {
      auto codec = PageCodec::Create(f, dims, entries);
      ASSERT_TRUE(codec.ok());
      ASSERT_EQ(codec->page_bytes(), entries * 132u);
      for (RowType t : {RowType::kBf16, RowType::kFp32}) {
        std::vector<uint8_t> page(codec->page_bytes(), kFill);
        ASSERT_TRUE(codec->WriteTokens(page.data(), 0, rows.View(t)).ok());
        for (uint32_t slot = 0; slot < entries; ++slot) {
          const uint64_t values = uint64_t{slot} * dims;                  // all values first
          const uint64_t scale_at = uint64_t{entries} * dims + slot * 4;  // then all fp32 scales
          const double amax = AbsMax(rows, t, slot, 0, dims);
          const float s = F32At(page, scale_at);
          if (f == StorageFormat::kIdxFp8) {
            const int k = IdxFp8Exponent(amax);
            ASSERT_EQ(static_cast<double>(s), std::ldexp(1.0, k)) << slot;  // a power of two
            for (uint32_t i = 0; i < dims; ++i) {
              // x / 2^k is exact, so the code is the plain e4m3 rounding of it.
              const float scaled = static_cast<float>(std::ldexp(static_cast<double>(rows.Seen(t, slot, i)), -k));
              ASSERT_EQ(page[values + i], E4m3FromFloat(scaled)) << slot << " " << i;
            }
          } else {
            ASSERT_EQ(s, LinearScale(amax, 127.0f)) << slot;
            for (uint32_t i = 0; i < dims; ++i) {
              ASSERT_EQ(static_cast<int8_t>(page[values + i]), Int8Of(rows.Seen(t, slot, i), s))
                  << slot << " " << i;
            }
          }
        }
      }
    }
  }
}

TEST(PageLayout, RawFormats) {
  const uint32_t entries = 5;
  const Rows rows = codec_testing::GaussianRows(entries, 96, 35);
  auto bf16 = PageCodec::Create(StorageFormat::kBf16, 96, entries);
  auto fp32 = PageCodec::Create(StorageFormat::kFp32, 96, entries);
  ASSERT_TRUE(bf16.ok() && fp32.ok());
  std::vector<uint8_t> p16(bf16->page_bytes()), p32(fp32->page_bytes());
  ASSERT_TRUE(bf16->WriteTokens(p16.data(), 0, rows.View(RowType::kFp32)).ok());
  ASSERT_TRUE(fp32->WriteTokens(p32.data(), 0, rows.View(RowType::kFp32)).ok());
  for (uint32_t k = 0; k < entries * 96; ++k) {
    ASSERT_EQ(U16At(p16, 2 * k), rows.bf16[k]);
    ASSERT_EQ(F32At(p32, 4 * k), rows.fp32[k]);
  }
}

}  // namespace
}  // namespace sparsekv
