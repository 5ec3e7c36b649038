// SparseMla against the dequantize-then-dense reference on every format and SIMD path, plus
// empty selections, sinks, the V4 second cache, determinism, in-place reads (poisoned pages)
// and the no-allocation contract.
#include "sparsekv/sparse_mla.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <map>
#include <optional>
#include <set>

#include "attention/reference.h"
#include "sparsekv/attention_state.h"
#include "tests/attention/test_cache.h"

// Heap allocations in this test binary (alloc_counter.cc), to hold SparseMla::Run to "no
// allocation".
uint64_t HeapAllocations();

namespace sparsekv::attention {
namespace {

using testing::MakeCache;
using testing::RandomBf16;
using testing::TestCache;

SparseMlaOptions Opts(uint32_t threads, std::optional<SimdPath> path = std::nullopt) {
  SparseMlaOptions o;
  o.threads = threads;
  o.simd_path = path;
  return o;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

// A selection of `top_k` distinct logical entries per token (sorted, as the indexer writes
// them), with `holes` of them replaced by -1 at random places.
// A batch over the main cache only: bf16 queries, `top_k` indices per token.
SparseMlaBatch MainBatch(const std::vector<uint16_t>& q, uint32_t tokens, uint32_t heads, float softmax_scale,
                         const TestCache& c, const std::vector<int32_t>& idx, uint32_t top_k) {
  SparseMlaBatch b;
  b.q = q.data();
  b.tokens = tokens;
  b.heads = heads;
  b.softmax_scale = softmax_scale;
  b.main.view = c.view;
  b.main.indices = idx.data();
  b.main.top_k = top_k;
  return b;
}

std::vector<int32_t> RandomSelection(const TestCache& c, uint32_t tokens, uint32_t top_k,
                                     uint32_t holes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> idx(uint64_t{tokens} * top_k);
  for (uint32_t t = 0; t < tokens; ++t) {
    std::set<uint32_t> chosen;
    std::uniform_int_distribution<uint32_t> pick(0, c.seq_entries - 1);
    while (chosen.size() < top_k) chosen.insert(pick(rng));
    uint32_t j = 0;
    for (uint32_t e : chosen) idx[uint64_t{t} * top_k + j++] = c.Index(e);
    std::uniform_int_distribution<uint32_t> hole(0, top_k - 1);
    for (uint32_t h = 0; h < holes; ++h) idx[uint64_t{t} * top_k + hole(rng)] = -1;
  }
  return idx;
}

struct Case {
  StorageFormat format;
  uint32_t dims;
};

void ExpectClose(const std::vector<float>& ref_out, const std::vector<float>& ref_lse,
                 const std::vector<float>& out, const std::vector<float>& lse, uint32_t rows,
                 const std::string& what) {
  for (uint32_t r = 0; r < rows; ++r) {
    if (std::isinf(ref_lse[r])) {
      EXPECT_EQ(lse[r], ref_lse[r]) << what << " row " << r;
    } else {
      EXPECT_LE(std::fabs(lse[r] - ref_lse[r]), 1e-5 * std::fabs(ref_lse[r]) + 1e-6)
          << what << " row " << r << " lse " << lse[r] << " vs " << ref_lse[r];
    }
    const float* o = out.data() + uint64_t{r} * kMlaValueDims;
    const float* e = ref_out.data() + uint64_t{r} * kMlaValueDims;
    int bad = 0;
    for (uint32_t d = 0; d < kMlaValueDims; ++d) {
      const float err = std::fabs(o[d] - e[d]);
      if (!(err <= 1e-3f || err <= 2.0f / 128 * std::fabs(e[d]))) ++bad;
    }
    EXPECT_EQ(bad, 0) << what << " row " << r;
    EXPECT_LE(CalcDiff(e, o, kMlaValueDims), 5e-6) << what << " row " << r;
  }
}

class SparseMlaFormats : public ::testing::TestWithParam<std::tuple<Case, SimdPath>> {};

TEST_P(SparseMlaFormats, MatchesReference) {
  const auto [fc, path] = GetParam();
  constexpr uint32_t kTokens = 3, kHeads = 32, kTopK = 300;
  TestCache c = MakeCache(fc.format, fc.dims, 64, 24, 16, 7);
  auto idx = RandomSelection(c, kTokens, kTopK, 20, 11);
  auto q = RandomBf16(uint64_t{kTokens} * kHeads * fc.dims, 13, 0.5f);
  std::vector<float> sink(kHeads);
  for (uint32_t h = 0; h < kHeads; ++h) sink[h] = 0.25f * (h % 7) - 0.5f;
  for (bool with_sink : {false, true}) {
    SparseMlaBatch b = MainBatch(q, kTokens, kHeads, 1.0f / std::sqrt(192.0f), c, idx, kTopK);
    b.sink = with_sink ? sink.data() : nullptr;
    std::vector<float> ref_out, ref_lse;
    ASSERT_TRUE(ReferenceSparseMla(b, &ref_out, &ref_lse).ok());
    auto mla = SparseMla::Create(Opts(2, path));
    ASSERT_TRUE(mla.ok());
    std::vector<float> out(ref_out.size(), 7.0f), lse(ref_lse.size(), 7.0f);
    ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
    ExpectClose(ref_out, ref_lse, out, lse, kTokens * kHeads,
                std::string(StorageFormatName(fc.format)) + "/" +
                    std::string(SimdPathName(path)) + (with_sink ? "/sink" : ""));
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SparseMlaFormats,
    ::testing::Combine(::testing::Values(Case{StorageFormat::kC8Mla, 576},
                                         Case{StorageFormat::kFp8DsMla, 576},
                                         Case{StorageFormat::kBf16, 576},
                                         Case{StorageFormat::kFp8V4, 512}),
                       ::testing::ValuesIn(testing::Paths())),
    [](const auto& info) {
      return std::string(StorageFormatName(std::get<0>(info.param).format)) + "_" +
             std::string(SimdPathName(std::get<1>(info.param)));
    });

// The V3.2 decode shape: 128 heads, top-k 2048 over a 64-block (8K-token) cache, c8_mla.
TEST(SparseMla, V32DecodeShapeMatchesReference) {
  constexpr uint32_t kHeads = 128, kTopK = 2048;
  TestCache c = MakeCache(StorageFormat::kC8Mla, 576, 128, 80, 64, 3);
  auto idx = RandomSelection(c, 1, kTopK, 0, 5);
  auto q = RandomBf16(uint64_t{kHeads} * 576, 9, 0.3f);
  SparseMlaBatch b = MainBatch(q, 1, kHeads, 0.1352f, c, idx, kTopK);
  std::vector<float> ref_out, ref_lse;
  ASSERT_TRUE(ReferenceSparseMla(b, &ref_out, &ref_lse).ok());
  auto mla = SparseMla::Create(Opts(2));
  ASSERT_TRUE(mla.ok());
  std::vector<float> out(ref_out.size()), lse(ref_lse.size());
  ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
  ExpectClose(ref_out, ref_lse, out, lse, kHeads, "v3.2 decode");
}

// Head counts that are not a multiple of the vector width take the narrower or scalar items.
TEST(SparseMla, OddHeadCounts) {
  TestCache c = MakeCache(StorageFormat::kFp8DsMla, 576, 64, 8, 8, 21);
  for (uint32_t heads : {1u, 6u, 16u, 48u}) {
    auto idx = RandomSelection(c, 2, 100, 5, heads);
    auto q = RandomBf16(uint64_t{2} * heads * 576, 17 + heads, 0.5f);
    SparseMlaBatch b = MainBatch(q, 2, heads, 0.07f, c, idx, 100);
    std::vector<float> ref_out, ref_lse;
    ASSERT_TRUE(ReferenceSparseMla(b, &ref_out, &ref_lse).ok());
    auto mla = SparseMla::Create(Opts(2));
    ASSERT_TRUE(mla.ok());
    std::vector<float> out(ref_out.size()), lse(ref_lse.size());
    ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
    ExpectClose(ref_out, ref_lse, out, lse, 2 * heads, "heads " + std::to_string(heads));
  }
}

TEST(SparseMla, EmptySelectionGivesZeroAndMinusInfinity) {
  TestCache c = MakeCache(StorageFormat::kC8Mla, 576, 64, 4, 4, 1);
  constexpr uint32_t kHeads = 32, kTopK = 64;
  std::vector<int32_t> idx(2 * kTopK, -1);
  idx[kTopK + 5] = c.Index(3);  // token 1 has one entry
  auto q = RandomBf16(2 * kHeads * 576, 2);
  std::vector<float> sink(kHeads, 1.5f);
  for (const float* s : {static_cast<const float*>(nullptr), static_cast<const float*>(sink.data())}) {
    for (SimdPath path : testing::Paths()) {
      SparseMlaBatch b = MainBatch(q, 2, kHeads, 0.1f, c, idx, kTopK);
      b.sink = s;
      auto mla = SparseMla::Create(Opts(1, path));
      ASSERT_TRUE(mla.ok());
      std::vector<float> out(2 * kHeads * 512, 9.0f), lse(2 * kHeads, 9.0f);
      ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
      for (uint32_t h = 0; h < kHeads; ++h) {
        EXPECT_EQ(lse[h], s ? 1.5f : -kInf);
        for (uint32_t d = 0; d < 512; ++d) ASSERT_EQ(out[h * 512 + d], 0.0f);
      }
      // One entry: the output is that entry's value part (times its softmax weight with a sink).
      auto entry = DequantizeEntry(c.view, uint64_t(c.Index(3)));
      ASSERT_TRUE(entry.ok());
      for (uint32_t d = 0; d < 512; ++d) {
        const float o = out[(kHeads + 0) * 512 + d];
        if (!s) {
          EXPECT_FLOAT_EQ(o, (*entry)[d]);
        } else {
          EXPECT_LE(std::fabs(o), std::fabs((*entry)[d]) + 1e-6f);
        }
      }
      // top_k 0 is the same as all -1.
      b.main.top_k = 0;
      ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
      EXPECT_EQ(lse[kHeads], s ? 1.5f : -kInf);
    }
  }
}

// V4: compressed entries plus the sliding window through one state equals the reference over
// the union, and equals merging two separate runs.
TEST(SparseMla, SecondCacheMergesThroughOneState) {
  constexpr uint32_t kHeads = 64, kTokens = 2;
  TestCache main = MakeCache(StorageFormat::kFp8V4, 512, 32, 16, 12, 31);
  TestCache window = MakeCache(StorageFormat::kBf16, 512, 128, 4, 2, 37);
  auto idx_main = RandomSelection(main, kTokens, 256, 10, 41);
  auto idx_win = RandomSelection(window, kTokens, 128, 0, 43);
  auto q = RandomBf16(uint64_t{kTokens} * kHeads * 512, 47, 0.4f);
  std::vector<float> sink(kHeads);
  for (uint32_t h = 0; h < kHeads; ++h) sink[h] = 0.1f * h - 2.0f;
  SparseMlaBatch b;
  b.q = q.data();
  b.tokens = kTokens;
  b.heads = kHeads;
  b.softmax_scale = 1.0f / std::sqrt(512.0f);
  b.sink = sink.data();
  b.main.view = main.view;
  b.main.indices = idx_main.data();
  b.main.top_k = 256;
  b.extra = SparseMlaSource{};
  b.extra->view = window.view;
  b.extra->indices = idx_win.data();
  b.extra->top_k = 128;
  std::vector<float> ref_out, ref_lse;
  ASSERT_TRUE(ReferenceSparseMla(b, &ref_out, &ref_lse).ok());
  for (SimdPath path : testing::Paths()) {
    auto mla = SparseMla::Create(Opts(2, path));
    ASSERT_TRUE(mla.ok());
    std::vector<float> out(ref_out.size()), lse(ref_lse.size());
    ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
    ExpectClose(ref_out, ref_lse, out, lse, kTokens * kHeads, std::string(SimdPathName(path)));

    // The same from two runs without sink, merged, then the sink applied.
    SparseMlaBatch only_main = b, only_win = b;
    only_main.extra.reset();
    only_main.sink = nullptr;
    only_win.main = *b.extra;
    only_win.extra.reset();
    only_win.sink = nullptr;
    std::vector<float> o1(out.size()), l1(lse.size()), o2(out.size()), l2(lse.size());
    ASSERT_TRUE((*mla)->Run(only_main, {o1.data(), l1.data()}).ok());
    ASSERT_TRUE((*mla)->Run(only_win, {o2.data(), l2.data()}).ok());
    MergeAttentionStates(o1.data(), l1.data(), o2.data(), l2.data(), kTokens * kHeads, 512);
    ApplyAttentionSink(o1.data(), l1.data(), sink.data(), kHeads, kTokens * kHeads, 512);
    ExpectClose(ref_out, ref_lse, o1, l1, kTokens * kHeads, "merged");
  }
}

// A token's output bytes are the same alone, in a batch of 8, on 1 or 2 threads.
TEST(SparseMla, DeterministicAndBatchInvariant) {
  constexpr uint32_t kHeads = 64, kTopK = 512, kBatch = 8;
  TestCache c = MakeCache(StorageFormat::kC8Mla, 576, 128, 40, 32, 5);
  auto idx = RandomSelection(c, kBatch, kTopK, 30, 6);
  auto q = RandomBf16(uint64_t{kBatch} * kHeads * 576, 8, 0.5f);
  for (SimdPath path : testing::Paths()) {
    std::vector<std::vector<float>> outs, lses;
    for (uint32_t threads : {1u, 2u}) {
      auto mla = SparseMla::Create(Opts(threads, path));
      ASSERT_TRUE(mla.ok());
      SparseMlaBatch b = MainBatch(q, kBatch, kHeads, 0.1f, c, idx, kTopK);
      std::vector<float> out(uint64_t{kBatch} * kHeads * 512), lse(kBatch * kHeads);
      ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
      outs.push_back(out);
      lses.push_back(lse);
      // Each token alone.
      for (uint32_t t = 0; t < kBatch; ++t) {
        SparseMlaBatch one = b;
        one.tokens = 1;
        one.q = q.data() + uint64_t{t} * kHeads * 576;
        one.main.indices = idx.data() + uint64_t{t} * kTopK;
        std::vector<float> o(kHeads * 512), l(kHeads);
        ASSERT_TRUE((*mla)->Run(one, {o.data(), l.data()}).ok());
        EXPECT_EQ(std::memcmp(o.data(), out.data() + uint64_t{t} * kHeads * 512, o.size() * 4), 0)
            << SimdPathName(path) << " token " << t << " threads " << threads;
        EXPECT_EQ(std::memcmp(l.data(), lse.data() + t * kHeads, l.size() * 4), 0);
      }
    }
    EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4), 0)
        << SimdPathName(path) << ": 1 vs 2 threads";
    EXPECT_EQ(std::memcmp(lses[0].data(), lses[1].data(), lses[0].size() * 4), 0);
  }
}

// Pages are read in place: every entry the indices do not name is overwritten with NaN (whole
// unnamed pages with 0xff bytes, which is NaN in every format's scales or values) and the
// output bytes do not change. Dense rows of the same entries give the same bytes too.
TEST(SparseMla, ReadsOnlyTheNamedEntries) {
  constexpr uint32_t kHeads = 32, kTopK = 256, kTokens = 2;
  for (auto [format, dims] : {std::pair{StorageFormat::kC8Mla, 576u},
                              std::pair{StorageFormat::kFp8V4, 512u}}) {
    TestCache c = MakeCache(format, dims, 64, 32, 12, 77);
    auto idx = RandomSelection(c, kTokens, kTopK, 7, 78);
    auto q = RandomBf16(uint64_t{kTokens} * kHeads * dims, 79, 0.5f);
    SparseMlaBatch b = MainBatch(q, kTokens, kHeads, 0.08f, c, idx, kTopK);
    auto mla = SparseMla::Create(Opts(2));
    ASSERT_TRUE(mla.ok());
    std::vector<float> before(uint64_t{kTokens} * kHeads * 512), lse_before(kTokens * kHeads);
    ASSERT_TRUE((*mla)->Run(b, {before.data(), lse_before.data()}).ok());
    for (float x : before) ASSERT_FALSE(std::isnan(x));

    std::set<int32_t> named(idx.begin(), idx.end());
    auto codec = PageCodec::Create(format, dims, 64);
    ASSERT_TRUE(codec.ok());
    std::vector<float> nan_row(dims, std::numeric_limits<float>::quiet_NaN());
    for (uint32_t blk = 0; blk < c.view.num_blocks; ++blk) {
      bool page_named = false;
      for (uint32_t s = 0; s < 64; ++s) page_named |= named.count(int32_t(blk * 64 + s)) > 0;
      std::byte* page = c.arena.get() + blk * c.view.block_stride;
      if (!page_named) {
        std::memset(page, 0xff, c.view.block_stride);
        continue;
      }
      for (uint32_t s = 0; s < 64; ++s) {
        if (named.count(int32_t(blk * 64 + s))) continue;
        ASSERT_TRUE(codec->WriteTokens(page, s, RowsView::Fp32(nan_row.data(), 1, dims)).ok());
      }
    }
    std::vector<float> after(before.size()), lse_after(lse_before.size());
    ASSERT_TRUE((*mla)->Run(b, {after.data(), lse_after.data()}).ok());
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * 4), 0);
    EXPECT_EQ(std::memcmp(lse_before.data(), lse_after.data(), lse_before.size() * 4), 0);

    // Dense rows: the named entries decoded by the reference codec, indices renumbered.
    std::vector<float> rows;
    std::vector<int32_t> dense_idx(idx.size());
    std::map<int32_t, int32_t> row_of;
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] < 0) {
        dense_idx[i] = -1;
        continue;
      }
      auto [it, fresh] = row_of.emplace(idx[i], int32_t(row_of.size()));
      if (fresh) {
        auto e = DequantizeEntry(c.view, uint64_t(idx[i]));
        ASSERT_TRUE(e.ok());
        rows.insert(rows.end(), e->begin(), e->end());
      }
      dense_idx[i] = it->second;
    }
    SparseMlaBatch d = b;
    d.main.rows = rows.data();
    d.main.num_rows = row_of.size();
    d.main.indices = dense_idx.data();
    std::vector<float> dense(before.size()), lse_dense(lse_before.size());
    ASSERT_TRUE((*mla)->Run(d, {dense.data(), lse_dense.data()}).ok());
    EXPECT_EQ(std::memcmp(before.data(), dense.data(), before.size() * 4), 0);
  }
}

// After a first call has sized everything, a call allocates nothing from the heap.
TEST(SparseMla, RunAllocatesNothing) {
  constexpr uint32_t kHeads = 128, kTopK = 2048;
  TestCache c = MakeCache(StorageFormat::kC8Mla, 576, 128, 24, 20, 50);
  auto idx = RandomSelection(c, 2, kTopK, 0, 51);
  auto q = RandomBf16(2 * kHeads * 576, 52);
  auto mla = SparseMla::Create(Opts(2));
  ASSERT_TRUE(mla.ok());
  SparseMlaBatch b = MainBatch(q, 2, kHeads, 0.1f, c, idx, kTopK);
  std::vector<float> out(2 * kHeads * 512), lse(2 * kHeads);
  ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
  const uint64_t before = HeapAllocations();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*mla)->Run(b, {out.data(), lse.data()}).ok());
  EXPECT_EQ(HeapAllocations(), before);
}

TEST(SparseMla, BadInputIsRefusedAndNothingWritten) {
  TestCache c = MakeCache(StorageFormat::kC8Mla, 576, 64, 4, 4, 60);
  auto q = RandomBf16(32 * 576, 61);
  std::vector<int32_t> idx = {0, 1, 2, -1};
  auto mla = SparseMla::Create(Opts(1));
  ASSERT_TRUE(mla.ok());
  auto base = [&] {
    SparseMlaBatch b = MainBatch(q, 1, 32, 0.1f, c, idx, 4);
    return b;
  };
  std::vector<float> out(32 * 512, 3.0f), lse(32, 3.0f);
  auto expect_refused = [&](const SparseMlaBatch& b, const char* needle) {
    Status s = (*mla)->Run(b, {out.data(), lse.data()});
    EXPECT_TRUE(s.Is(StatusCode::kInvalidArgument)) << s.ToString();
    EXPECT_NE(s.ToString().find(needle), std::string::npos) << s.ToString();
    for (float x : out) ASSERT_EQ(x, 3.0f);
    for (float x : lse) ASSERT_EQ(x, 3.0f);
  };
  idx[1] = 4 * 64;  // one past the cache
  expect_refused(base(), "token 0 index 1 is 256");
  idx[1] = -2;
  expect_refused(base(), "index 1 is -2");
  idx[1] = 1;
  SparseMlaBatch b = base();
  b.softmax_scale = 0;
  expect_refused(b, "softmax_scale");
  b = base();
  b.main.view.format = StorageFormat::kIdxFp8;
  b.main.view.dims = 576;
  expect_refused(b, "idx_fp8");
  b = base();
  b.main.view.dims = 128;
  expect_refused(b, "128 dims");
  b = base();
  b.extra = b.main;
  b.extra->view.dims = 512;
  b.extra->view.format = StorageFormat::kFp8V4;
  expect_refused(b, "extra cache has 512 dims");
  b = base();
  b.main.view.base = nullptr;
  expect_refused(b, "base pointer");
  EXPECT_FALSE(SparseMla::Create(Opts(0)).ok());
}

}  // namespace
}  // namespace sparsekv::attention
