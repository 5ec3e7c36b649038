// Pages of one storage format or model are never read as another's. V3.2's c8 and fp8 presets
// have the same page sizes (656 bytes per latent token, 132 per indexer key), so before bundles
// named what their pages are, an engine that switched kv_format over a persistent tier with the
// same namespace salt restored the other format's pages and decoded garbage. Each test here
// runs engines one after another over one SSD directory, writes real values through each
// format's codec, and decodes what a restore brings back.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "sparsekv/codec.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

constexpr uint32_t kBlockTokens = 64;
constexpr uint32_t kBlocks = 4;

struct Engine {
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
};

ModelSpec V32(KvPrecision precision) {
  auto spec = ModelPreset("deepseek-v3.2-exp", precision);
  EXPECT_TRUE(spec.ok());
  return *spec;
}

// An engine over the SSD directory `dir` (a small host tier in front, write-through so that
// every committed block reaches the SSD), with the default namespace salt.
Engine Start(const std::string& dir, const ModelSpec& spec) {
  Engine e;
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = 8;
  mo.huge_pages = false;
  auto m = CacheManager::Create(spec, mo);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  e.manager = std::move(m).value();
  std::vector<uint64_t> sizes;
  for (const auto& p : e.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  const uint64_t block_bytes = BundleRecordBytes(sizes);
  HostTierOptions h;
  h.max_record_bytes = block_bytes;
  h.capacity_bytes = 2 * ((block_bytes + 4095) & ~uint64_t{4095});
  h.huge_pages = false;
  SsdTierOptions d;
  d.path = dir;
  d.capacity_bytes = 64 << 20;
  d.read_arena_bytes = 16 << 20;
  d.slab_grow_bytes = 16 << 20;
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(HostTier::Open(h).value());
  auto ssd = SsdTier::Open(d);
  EXPECT_TRUE(ssd.ok()) << ssd.status().ToString();
  tiers.push_back(std::move(*ssd));
  TierChainOptions co;
  co.write_policy = WritePolicy::kWriteThrough;
  e.chain = std::make_unique<TierChain>(std::move(tiers), co);
  e.cache = std::make_unique<OffloadedCache>(*e.manager, *e.chain);
  return e;
}

std::vector<TokenId> Prompt() {
  std::vector<TokenId> t(kBlocks * kBlockTokens + 1);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<TokenId>(500 + i * 3);
  return t;
}

PageCodec CodecOf(const PoolGeometry& g) {
  auto c = PageCodec::Create(g.spec.format, g.spec.dims, g.entries_per_block);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

// Writes the same values (from `seed`, whatever the format) into every layer of every block of
// `seq` through each pool's codec, as an engine computing the prompt would.
void ComputePages(CacheManager& m, SequenceId seq, uint64_t seed) {
  for (size_t p = 0; p < m.num_pools(); ++p) {
    const PoolGeometry& g = m.geometry().pools[p];
    const PageCodec codec = CodecOf(g);
    std::vector<PageId> table;
    ASSERT_TRUE(m.GetBlockTable(seq, p, &table).ok());
    for (uint32_t b = 0; b < kBlocks; ++b) {
      for (uint32_t l = 0; l < g.layers.size(); ++l) {
        std::mt19937 rng(static_cast<uint32_t>(seed * 1000003 + b * 1009 + p * 101 + l));
        std::normal_distribution<float> dist(0.0f, 2.0f);
        std::vector<float> rows(size_t{g.entries_per_block} * g.spec.dims);
        for (float& v : rows) v = dist(rng);
        std::byte* page = m.pool(p).PageData(table[b]) + uint64_t{l} * g.layer_stride;
        ASSERT_TRUE(codec.WriteTokens(page, 0, RowsView::Fp32(rows.data(), g.entries_per_block, g.spec.dims)).ok());
      }
    }
  }
}

// (block, pool) -> every layer's entries decoded to fp32 with the pool's own codec.
using Decoded = std::map<std::pair<uint32_t, size_t>, std::vector<float>>;

Decoded Decode(CacheManager& m, SequenceId seq, uint32_t blocks) {
  Decoded out;
  for (size_t p = 0; p < m.num_pools(); ++p) {
    const PoolGeometry& g = m.geometry().pools[p];
    const PageCodec codec = CodecOf(g);
    std::vector<PageId> table;
    EXPECT_TRUE(m.GetBlockTable(seq, p, &table).ok());
    for (uint32_t b = 0; b < blocks && b < table.size(); ++b) {
      std::vector<float>& v = out[{b, p}];
      v.resize(size_t{g.layers.size()} * g.entries_per_block * g.spec.dims);
      for (uint32_t l = 0; l < g.layers.size(); ++l) {
        const std::byte* page = m.pool(p).PageData(table[b]) + uint64_t{l} * g.layer_stride;
        codec.DecodeEntriesFp32(page, 0, g.entries_per_block,
                                v.data() + size_t{l} * g.entries_per_block * g.spec.dims);
      }
    }
  }
  return out;
}

// Pages of `restored` (the blocks a restore brought back) whose decoded values differ from what
// the engine computed for them.
size_t Misread(const Decoded& restored, const Decoded& computed) {
  size_t bad = 0;
  for (const auto& [where, values] : restored) {
    const auto it = computed.find(where);
    if (it == computed.end() || it->second.size() != values.size() ||
        std::memcmp(it->second.data(), values.data(), values.size() * sizeof(float)) != 0)
      ++bad;
  }
  return bad;
}

struct Served {
  uint32_t lower_blocks = 0;  // restored from the tiers
  Decoded restored;           // what those blocks decode to
  Decoded computed;           // what the engine's own computation of every block decodes to
  OffloadedCacheStats stats;
};

// One request of the prompt: restore what the tiers give, decode it, then compute every block
// (as the engine would after a miss), commit them (written through to the SSD) and free.
Served Serve(Engine& e, uint64_t seed) {
  Served r;
  const std::vector<TokenId> prompt = Prompt();
  auto seq = e.cache->CreateSequence();
  EXPECT_TRUE(seq.ok());
  EXPECT_TRUE(e.cache->AppendTokens(*seq, prompt).ok());
  auto hit = e.cache->AcquirePrefix(*seq);
  EXPECT_TRUE(hit.ok()) << hit.status().ToString();
  r.lower_blocks = hit->lower_blocks;
  r.restored = Decode(*e.manager, *seq, hit->lower_blocks);
  EXPECT_TRUE(e.cache->Free(*seq).ok());
  EXPECT_TRUE(e.manager->Reset().ok());  // L1 lets the restored blocks go
  // The engine's own computation, in a sequence that does not look the prefix up.
  auto again = e.cache->CreateSequence();
  EXPECT_TRUE(again.ok());
  EXPECT_TRUE(e.cache->AppendTokens(*again, prompt).ok());
  EXPECT_TRUE(e.manager->AllocateSlots(*again, prompt.size()).ok());
  ComputePages(*e.manager, *again, seed);
  r.computed = Decode(*e.manager, *again, kBlocks);
  EXPECT_TRUE(e.cache->CommitComputed(*again, prompt.size()).ok());
  EXPECT_TRUE(e.cache->Free(*again).ok());
  e.cache->WaitIdle();
  EXPECT_TRUE(e.manager->Reset().ok());
  r.stats = e.cache->Stats();
  return r;
}

TEST(PageFormats, TheTagNamesModelFormatAndLayoutAndDiffersBetweenC8AndFp8OfTheSameSizes) {
  const ModelSpec fp8 = V32(KvPrecision::kFp8), c8 = V32(KvPrecision::kC8);
  const BlockGeometry gf = ComputeBlockGeometry(fp8, kBlockTokens).value();
  const BlockGeometry gc = ComputeBlockGeometry(c8, kBlockTokens).value();
  ASSERT_EQ(gf.pools.size(), gc.pools.size());
  for (size_t p = 0; p < gf.pools.size(); ++p) ASSERT_EQ(gf.pools[p].block_stride, gc.pools[p].block_stride);
  const std::string df = OffloadedCache::PagesDescription(fp8.name, gf);
  const std::string dc = OffloadedCache::PagesDescription(c8.name, gc);
  EXPECT_NE(df.find("fp8_ds_mla"), std::string::npos) << df;
  EXPECT_NE(df.find("idx_fp8"), std::string::npos) << df;
  EXPECT_NE(dc.find("c8_mla"), std::string::npos) << dc;
  EXPECT_NE(df.find("model=deepseek-v3.2-exp"), std::string::npos) << df;
  EXPECT_NE(df.find("layout=block-major"), std::string::npos) << df;
  EXPECT_NE(OffloadedCache::PagesTag(df), OffloadedCache::PagesTag(dc));
  EXPECT_NE(OffloadedCache::PagesTag(df), 0u);
  EXPECT_NE(OffloadedCache::PagesTag(df), OffloadedCache::PagesTag(OffloadedCache::PagesDescription("other", gf)));
  EXPECT_NE(OffloadedCache::PagesTag(df),
            OffloadedCache::PagesTag(OffloadedCache::PagesDescription(
                fp8.name, ComputeBlockGeometry(fp8, 2 * kBlockTokens).value())));
}

// An fp8 engine, then a c8 engine, then the c8 engine again, then fp8 again, over one SSD
// directory with the same salt: every restore of the other format's blocks is a miss (counted),
// and every block restored decodes to exactly what its engine computed.
TEST(PageFormats, AKvFormatSwitchOverOneSsdTierMisreadsNoPageAndCountsTheSwitchAsMisses) {
  testing::TempDir dir("pagefmt");
  {
    Engine fp8 = Start(dir.path(), V32(KvPrecision::kFp8));
    const Served r = Serve(fp8, 1);
    EXPECT_EQ(r.lower_blocks, 0u);
    EXPECT_EQ(r.stats.demoted_blocks, kBlocks);
  }
  Decoded c8_computed;
  {
    Engine c8 = Start(dir.path(), V32(KvPrecision::kC8));
    const Served r = Serve(c8, 1);
    EXPECT_EQ(Misread(r.restored, r.computed), 0u) << "c8 pages decoded from fp8 records";
    EXPECT_EQ(r.lower_blocks, 0u) << "the fp8 engine's blocks are not this engine's";
    EXPECT_EQ(r.stats.restored_blocks, 0u);
    EXPECT_EQ(r.stats.restore_other_pages, 1u);  // the first block ends the prefix
    EXPECT_EQ(r.stats.restore_rejected, 0u) << "another format is a miss, not damage";
    c8_computed = r.computed;
  }
  {
    Engine c8 = Start(dir.path(), V32(KvPrecision::kC8));
    const Served r = Serve(c8, 1);
    EXPECT_EQ(r.lower_blocks, kBlocks) << "its own blocks come back";
    EXPECT_EQ(Misread(r.restored, c8_computed), 0u);
    EXPECT_EQ(r.stats.restore_other_pages, 0u);
    EXPECT_EQ(r.stats.restore_untagged, 0u);
  }
  {
    Engine fp8 = Start(dir.path(), V32(KvPrecision::kFp8));
    const Served r = Serve(fp8, 1);
    EXPECT_EQ(r.lower_blocks, 0u);
    EXPECT_EQ(Misread(r.restored, r.computed), 0u);
    EXPECT_EQ(r.stats.restore_other_pages, 1u);
    // The SSD tier read good records of its own bundle format: nothing was damaged or erased.
    EXPECT_EQ(fp8.chain->tier(1).Stats().corrupt, 0u);
  }
}

// The same for a model switch: a model of the same geometry under another name (a fine-tune)
// never reads the first model's blocks.
TEST(PageFormats, AModelSwitchOverOneSsdTierIsAMissForEveryBlock) {
  testing::TempDir dir("pagefmt");
  {
    Engine base = Start(dir.path(), V32(KvPrecision::kFp8));
    Serve(base, 1);
  }
  ModelSpec tuned = V32(KvPrecision::kFp8);
  tuned.name = "deepseek-v3.2-exp-tuned";
  {
    Engine e = Start(dir.path(), tuned);
    const Served r = Serve(e, 2);
    EXPECT_EQ(r.lower_blocks, 0u);
    EXPECT_EQ(r.stats.restore_other_pages, 1u);
  }
  {
    Engine e = Start(dir.path(), tuned);
    const Served r = Serve(e, 2);
    EXPECT_EQ(r.lower_blocks, kBlocks);
    EXPECT_EQ(Misread(r.restored, r.computed), 0u);
  }
}

// Records written before bundles carried a pages tag (tag 0) still read, by their sizes, and
// are counted as such.
TEST(PageFormats, UntaggedRecordsOfAnEarlierReleaseStillRestoreByTheirSizes) {
  testing::TempDir dir("pagefmt");
  Decoded computed;
  {
    Engine e = Start(dir.path(), V32(KvPrecision::kFp8));
    computed = Serve(e, 3).computed;
    // Rewrite every record in the SSD tier as an earlier release wrote it: no tag.
    const std::vector<TokenId> prompt = Prompt();
    auto seq = e.cache->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(e.cache->AppendTokens(*seq, prompt).ok());
    auto digests = e.cache->BlockDigests(*seq);
    ASSERT_TRUE(digests.ok());
    ASSERT_EQ(digests->size(), kBlocks);
    ASSERT_TRUE(e.cache->Free(*seq).ok());
    Tier& ssd = e.chain->tier(1);
    for (const BlockDigest& d : *digests) {
      const BundleKey key{0, d.hash};
      auto got = ssd.Get({key}).get();
      ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
      const Bundle& b = **got[0];
      EXPECT_EQ(b.pages(), e.cache->pages_tag());
      std::vector<std::span<const std::byte>> segs;
      for (uint32_t i = 0; i < b.segment_count(); ++i) segs.push_back(b.segment(i));
      auto old = Bundle::Make(key, segs, b.sequence() + 1, /*pages=*/0);
      ASSERT_TRUE(old.ok());
      ASSERT_TRUE(ssd.Put({*old}).get()[0].ok());
    }
  }
  Engine e = Start(dir.path(), V32(KvPrecision::kFp8));
  const Served r = Serve(e, 3);
  EXPECT_EQ(r.lower_blocks, kBlocks);
  EXPECT_EQ(Misread(r.restored, computed), 0u);
  EXPECT_EQ(r.stats.restore_untagged, kBlocks);
  EXPECT_EQ(r.stats.restore_other_pages, 0u);
}

}  // namespace
}  // namespace sparsekv
