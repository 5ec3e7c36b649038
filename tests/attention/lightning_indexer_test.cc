// LightningIndexer against the reference: logits, exact top-k and the FlashMLA index
// convention on every key format and SIMD path; causality, ties, NaN keys, the V4 ratio with a
// separate target cache, determinism and bad input.
#include "sparsekv/lightning_indexer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>

#include "attention/reference.h"
#include "tests/attention/test_cache.h"

namespace sparsekv::attention {
namespace {

using testing::MakeCache;
using testing::RandomBf16;
using testing::TestCache;

LightningIndexerOptions Opts(uint32_t top_k, uint32_t threads,
                             std::optional<SimdPath> path = std::nullopt) {
  LightningIndexerOptions o;
  o.top_k = top_k;
  o.threads = threads;
  o.simd_path = path;
  return o;
}

std::vector<float> RandomWeights(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  std::vector<float> w(n);
  for (auto& x : w) x = u(rng);
  return w;
}

struct Fixture {
  TestCache keys;
  std::vector<uint16_t> q;
  std::vector<float> w;
  std::vector<uint64_t> positions;
  std::vector<IndexerSequence> seqs;
  IndexerBatch batch;
};

Fixture MakeFixture(StorageFormat format, uint32_t heads, uint32_t tokens, uint32_t seed,
                    uint32_t blocks = 12) {
  Fixture f;
  f.keys = MakeCache(format, 128, 64, blocks + 4, blocks, seed);
  f.q = RandomBf16(uint64_t{tokens} * heads * 128, seed + 1);
  f.w = RandomWeights(uint64_t{tokens} * heads, seed + 2);
  std::mt19937 rng(seed + 3);
  std::uniform_int_distribution<uint64_t> pos(0, f.keys.seq_entries - 1);
  for (uint32_t t = 0; t < tokens; ++t) f.positions.push_back(pos(rng));
  f.positions[0] = f.keys.seq_entries - 1;  // one token sees everything
  if (tokens > 1) f.positions[1] = 10;      // and one sees fewer keys than top_k
  f.seqs.push_back({f.keys.table, {}, 0});
  f.batch.q = f.q.data();
  f.batch.weights = f.w.data();
  f.batch.tokens = tokens;
  f.batch.heads = heads;
  f.batch.sequences = f.seqs;
  f.batch.positions = f.positions.data();
  return f;
}

class IndexerFormats : public ::testing::TestWithParam<std::tuple<StorageFormat, SimdPath>> {};

TEST_P(IndexerFormats, MatchesReference) {
  const auto [format, path] = GetParam();
  constexpr uint32_t kTopK = 200;
  for (uint32_t heads : {64u, 32u}) {
    Fixture f = MakeFixture(format, heads, 4, 100 + heads);
    auto ref = ReferenceIndexer(f.keys.view, f.batch, kTopK);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    auto ix = LightningIndexer::Create(Opts(kTopK, 2, path));
    ASSERT_TRUE(ix.ok());
    const uint64_t stride = f.keys.seq_entries;
    std::vector<float> logits(uint64_t{f.batch.tokens} * stride, 0.0f);
    std::vector<int32_t> indices(uint64_t{f.batch.tokens} * kTopK, 99);
    std::vector<float> top(indices.size());
    ASSERT_TRUE(
        (*ix)->Run(f.keys.view, f.batch, {indices.data(), top.data(), logits.data(), stride}).ok());
    for (uint32_t t = 0; t < f.batch.tokens; ++t) {
      const auto& rl = ref->logits[t];
      const float* l = logits.data() + t * stride;
      EXPECT_LE(CalcDiff(rl, l, rl.size()), 1e-6) << "token " << t;
      double worst = 0;
      for (size_t s = 0; s < rl.size(); ++s) {
        worst = std::max(worst, std::fabs(rl[s] - l[s]) / (std::fabs(rl[s]) + 1e-3));
      }
      EXPECT_LE(worst, 1e-4) << "token " << t;
      // Logits of random keys are distinct: the selection must equal the reference's.
      for (uint32_t i = 0; i < kTopK; ++i) {
        ASSERT_EQ(indices[t * kTopK + i], ref->indices[t * kTopK + i])
            << StorageFormatName(format) << "/" << SimdPathName(path) << " token " << t
            << " slot " << i;
        if (indices[t * kTopK + i] < 0) {
          EXPECT_EQ(top[t * kTopK + i], -std::numeric_limits<float>::infinity());
        }
      }
    }
    // Position 10 sees 11 keys: 11 indices then -1.
    EXPECT_GE(indices[1 * kTopK + 10], 0);
    EXPECT_EQ(indices[1 * kTopK + 11], -1);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, IndexerFormats,
    ::testing::Combine(::testing::Values(StorageFormat::kIdxFp8, StorageFormat::kIdxC8,
                                         StorageFormat::kBf16),
                       ::testing::ValuesIn(testing::Paths())),
    [](const auto& info) {
      return std::string(StorageFormatName(std::get<0>(info.param))) + "_" +
             std::string(SimdPathName(std::get<1>(info.param)));
    });

// Keys after a token's position are never read: poisoning them changes nothing.
TEST(LightningIndexer, CausalKeysOnly) {
  Fixture f = MakeFixture(StorageFormat::kIdxFp8, 64, 1, 7);
  f.positions[0] = 300;
  auto ix = LightningIndexer::Create(Opts(64, 2));
  ASSERT_TRUE(ix.ok());
  std::vector<int32_t> a(64), b(64);
  ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {a.data()}).ok());
  auto codec = PageCodec::Create(StorageFormat::kIdxFp8, 128, 64);
  std::vector<float> nan_row(128, std::numeric_limits<float>::quiet_NaN());
  for (uint64_t k = 301; k < f.keys.seq_entries; ++k) {
    std::byte* page = f.keys.arena.get() + f.keys.table[k / 64] * f.keys.view.block_stride;
    ASSERT_TRUE(
        codec->WriteTokens(page, uint32_t(k % 64), RowsView::Fp32(nan_row.data(), 1, 128)).ok());
  }
  ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {b.data()}).ok());
  EXPECT_EQ(a, b);
}

// Equal logits: the lower key wins. NaN keys rank below everything.
TEST(LightningIndexer, TiesTakeTheLowerKeyAndNaNRanksLast) {
  Fixture f = MakeFixture(StorageFormat::kBf16, 32, 1, 9, 4);
  f.positions[0] = f.keys.seq_entries - 1;
  // Every key the same: every logit ties.
  auto codec = PageCodec::Create(StorageFormat::kBf16, 128, 64);
  std::vector<float> row(128, 0.5f);
  for (uint32_t b = 0; b < f.keys.view.num_blocks; ++b) {
    for (uint32_t s = 0; s < 64; ++s) {
      ASSERT_TRUE(codec
                      ->WriteTokens(f.keys.arena.get() + b * f.keys.view.block_stride, s,
                                    RowsView::Fp32(row.data(), 1, 128))
                      .ok());
    }
  }
  for (auto& x : f.q) x = Bf16FromFloat(1.0f);
  // Key 0 is NaN.
  std::vector<float> nan_row(128, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(codec
                  ->WriteTokens(f.keys.arena.get() + f.keys.table[0] * f.keys.view.block_stride, 0,
                                RowsView::Fp32(nan_row.data(), 1, 128))
                  .ok());
  auto ix = LightningIndexer::Create(Opts(16, 2));
  ASSERT_TRUE(ix.ok());
  std::vector<int32_t> idx(16);
  ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {idx.data()}).ok());
  for (uint32_t i = 0; i < 16; ++i) EXPECT_EQ(idx[i], f.keys.Index(i + 1)) << i;
  // With only 5 visible keys, the NaN one is taken too (fewer numbers than k), in key order.
  f.positions[0] = 4;
  ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {idx.data()}).ok());
  for (uint32_t i = 0; i < 5; ++i) EXPECT_EQ(idx[i], f.keys.Index(i));
  EXPECT_EQ(idx[5], -1);
}

// V4's CSA: one key per 4 tokens, indices into the compressed cache's own pages.
TEST(LightningIndexer, KeyRatioAndTargetTable) {
  Fixture f = MakeFixture(StorageFormat::kIdxFp8, 32, 3, 21);
  std::vector<uint32_t> target = {40, 7, 13, 2, 99, 5, 6, 8, 9, 10, 11, 12};
  f.seqs[0].target_blocks = target;
  f.seqs[0].target_block_entries = 64;
  f.batch.key_ratio = 4;
  f.positions = {4 * f.keys.seq_entries - 1, 4 * 100 + 2, 3};  // sees all, 100, 1 key
  auto ref = ReferenceIndexer(f.keys.view, f.batch, 50);
  ASSERT_TRUE(ref.ok());
  auto ix = LightningIndexer::Create(Opts(50, 2));
  ASSERT_TRUE(ix.ok());
  std::vector<int32_t> idx(3 * 50);
  ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {idx.data()}).ok());
  EXPECT_EQ(idx, ref->indices);
  EXPECT_EQ(idx[2 * 50], 40 * 64);  // key 0 -> target block 40, offset 0
  EXPECT_EQ(idx[2 * 50 + 1], -1);
  for (int32_t e : idx) {
    if (e >= 0) {
      EXPECT_NE(std::find(target.begin(), target.end(), uint32_t(e / 64)), target.end());
    }
  }
}

TEST(LightningIndexer, DeterministicAndBatchInvariant) {
  Fixture f = MakeFixture(StorageFormat::kIdxC8, 64, 8, 31, 40);
  for (SimdPath path : testing::Paths()) {
    std::vector<std::vector<float>> all;
    const uint64_t stride = f.keys.seq_entries;
    for (uint32_t threads : {1u, 2u}) {
      auto ix = LightningIndexer::Create(Opts(256, threads, path));
      ASSERT_TRUE(ix.ok());
      std::vector<float> logits(8 * stride, 0.0f);
      std::vector<int32_t> idx(8 * 256);
      ASSERT_TRUE((*ix)->Run(f.keys.view, f.batch, {idx.data(), nullptr, logits.data(), stride}).ok());
      all.push_back(logits);
      for (uint32_t t = 0; t < 8; ++t) {
        IndexerBatch one = f.batch;
        one.tokens = 1;
        one.q = f.q.data() + uint64_t{t} * 64 * 128;
        one.weights = f.w.data() + t * 64;
        one.positions = f.positions.data() + t;
        std::vector<float> l(stride, 0.0f);
        std::vector<int32_t> i1(256);
        ASSERT_TRUE((*ix)->Run(f.keys.view, one, {i1.data(), nullptr, l.data(), stride}).ok());
        EXPECT_EQ(std::memcmp(l.data(), logits.data() + t * stride, stride * 4), 0) << t;
        EXPECT_TRUE(std::equal(i1.begin(), i1.end(), idx.begin() + t * 256));
      }
    }
    EXPECT_EQ(std::memcmp(all[0].data(), all[1].data(), all[0].size() * 4), 0);
  }
}

TEST(LightningIndexer, BadInputIsRefused) {
  Fixture f = MakeFixture(StorageFormat::kIdxFp8, 64, 2, 41);
  auto ix = LightningIndexer::Create(Opts(32, 1));
  ASSERT_TRUE(ix.ok());
  std::vector<int32_t> idx(64, 5);
  auto refused = [&](const PagedCacheView& v, const IndexerBatch& b, const char* needle) {
    Status s = (*ix)->Run(v, b, {idx.data()});
    EXPECT_TRUE(s.Is(StatusCode::kInvalidArgument)) << s.ToString();
    EXPECT_NE(s.ToString().find(needle), std::string::npos) << s.ToString();
    for (int32_t x : idx) ASSERT_EQ(x, 5);
  };
  std::vector<uint32_t> short_table(f.keys.table.begin(), f.keys.table.begin() + 2);
  std::vector<IndexerSequence> seqs = {{short_table, {}, 0}};
  IndexerBatch b = f.batch;
  b.sequences = seqs;
  refused(f.keys.view, b, "key blocks");
  std::vector<uint32_t> bad_table = f.keys.table;
  bad_table[1] = f.keys.view.num_blocks;
  seqs = {{bad_table, {}, 0}};
  refused(f.keys.view, b, "past the");
  std::vector<uint32_t> token_seq = {0, 1};
  b = f.batch;
  b.token_sequence = token_seq.data();
  refused(f.keys.view, b, "names sequence 1");
  PagedCacheView v = f.keys.view;
  v.format = StorageFormat::kC8Mla;
  v.dims = 576;
  refused(v, f.batch, "idx_fp8, idx_c8 or bf16");
  std::vector<float> logits(10);
  Status s = (*ix)->Run(f.keys.view, f.batch, {idx.data(), nullptr, logits.data(), 10});
  EXPECT_NE(s.ToString().find("logits_stride"), std::string::npos);
  EXPECT_FALSE(LightningIndexer::Create(Opts(0, 1)).ok());
}

}  // namespace
}  // namespace sparsekv::attention
