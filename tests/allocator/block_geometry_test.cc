#include "sparsekv/block_geometry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace sparsekv {
namespace {

using ::testing::HasSubstr;

TEST(StorageFormat, ByteSizesMatchTheDesign) {
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kBf16, 576), 1152u);
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kC8Mla, 576), 656u);
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kFp8DsMla, 576), 656u);
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kFp8V4, 512), 584u);
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kIdxFp8, 128), 132u);
  EXPECT_EQ(FormatEntryBytes(StorageFormat::kIdxC8, 128), 132u);
  // fp8_v4 pages are padded to a multiple of 576 bytes.
  EXPECT_EQ(FormatPageBytes(StorageFormat::kFp8V4, 512, 128), 74880u);  // 128*584 = 74752 -> 130*576
  EXPECT_EQ(FormatPageBytes(StorageFormat::kFp8V4, 512, 64), 37440u);   // 64*584 = 37376 -> 65*576
  EXPECT_EQ(FormatPageBytes(StorageFormat::kFp8V4, 512, 1), 1152u);
  EXPECT_EQ(FormatPageBytes(StorageFormat::kIdxFp8, 128, 64), 64u * 132u);
  EXPECT_EQ(layout::Fp8V4ScaleOffset(64, 3), 64u * 576u + 3u * 8u);
  EXPECT_EQ(layout::IdxScaleOffset(128, 64, 5), 64u * 128u + 5u * 4u);
}

TEST(BlockGeometry, V32PoolsAreBlockMajor) {
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8);
  ASSERT_TRUE(spec.ok());
  auto g = ComputeBlockGeometry(*spec, 64);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  ASSERT_EQ(g->pools.size(), 2u);
  const PoolGeometry& mla = g->pools[g->PoolIndex(0, CacheKind::kMlaLatent)];
  EXPECT_EQ(mla.entries_per_block, 64u);
  EXPECT_EQ(mla.page_bytes, 64u * 656u);
  EXPECT_EQ(mla.layer_stride, 64u * 656u);
  EXPECT_EQ(mla.block_stride, 61u * 64u * 656u);
  EXPECT_EQ(mla.Offset(3, 5), 3u * mla.block_stride + 5u * mla.layer_stride);
  const PoolGeometry& idx = g->pools[g->PoolIndex(60, CacheKind::kIndexerKey)];
  EXPECT_EQ(idx.page_bytes, 64u * 132u);
  EXPECT_EQ(idx.layers.size(), 61u);
  EXPECT_EQ(g->PoolIndex(61, CacheKind::kMlaLatent), -1);
}

TEST(BlockGeometry, V4GroupsEachDistinctKindSpec) {
  auto spec = ModelPreset("deepseek-v4-flash", KvPrecision::kFp8);
  ASSERT_TRUE(spec.ok());
  auto g = ComputeBlockGeometry(*spec, 128);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  // swa, csa, indexer, csa state, hca, hca state.
  ASSERT_EQ(g->pools.size(), 6u);
  const PoolGeometry& csa = g->pools[g->PoolIndex(2, CacheKind::kCsaCompressed)];
  EXPECT_EQ(csa.entries_per_block, 32u);
  EXPECT_EQ(csa.layers.size(), 21u);
  EXPECT_EQ(csa.page_bytes, 19008u);  // 32*584 = 18688 -> 33*576
  const PoolGeometry& hca = g->pools[g->PoolIndex(3, CacheKind::kHcaCompressed)];
  EXPECT_EQ(hca.entries_per_block, 1u);
  EXPECT_EQ(hca.layers.size(), 20u);
  const PoolGeometry& swa = g->pools[g->PoolIndex(0, CacheKind::kSwaWindow)];
  EXPECT_EQ(swa.layers.size(), 43u);
  const PoolGeometry& csa_state = g->pools[g->PoolIndex(2, CacheKind::kCompressorState)];
  EXPECT_EQ(csa_state.bytes_per_entry, 2u * 8u * 1024u * 4u);
  const PoolGeometry& hca_state = g->pools[g->PoolIndex(3, CacheKind::kCompressorState)];
  EXPECT_EQ(hca_state.bytes_per_entry, 2u * 128u * 512u * 4u);
  EXPECT_NE(g->PoolIndex(2, CacheKind::kCompressorState), g->PoolIndex(3, CacheKind::kCompressorState));
  for (const PoolGeometry& p : g->pools) EXPECT_EQ(p.layer_stride % kLayerStrideAlign, 0u);
}

TEST(BlockGeometry, MisalignedBlockNamesTheRatio) {
  auto spec = ModelPreset("deepseek-v4-flash", KvPrecision::kBf16);
  ASSERT_TRUE(spec.ok());
  auto g = ComputeBlockGeometry(*spec, 64);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("compression ratio 128"));
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("hca_compressed"));
  auto g6 = ComputeBlockGeometry(*spec, 6);
  ASSERT_FALSE(g6.ok());
  EXPECT_THAT(std::string(g6.status().message()), HasSubstr("compression ratio 4"));
  EXPECT_FALSE(ComputeBlockGeometry(*spec, 0).ok());
  EXPECT_TRUE(ComputeBlockGeometry(*spec, 256).ok());
}

}  // namespace
}  // namespace sparsekv
