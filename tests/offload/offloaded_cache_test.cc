// The tier chain under a real cache manager: a DeepSeek-V3.2 sequence's prefix leaves L1, the
// process "restarts" (every object is destroyed and rebuilt over the same SSD directory), and
// the prefix is found in the SSD tier and restored into L1 with every kind's bytes identical.
#include "sparsekv/offloaded_cache.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

constexpr uint32_t kBlockTokens = 64;
constexpr uint32_t kBlocks = 4;

struct Stack {
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
};

// `host_blocks`: the host tier's capacity in blocks; `l1_blocks`: L1's.
Stack Build(const std::string& ssd_dir, uint64_t host_blocks = 2, uint32_t l1_blocks = 8) {
  Stack s;
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8);
  EXPECT_TRUE(spec.ok());
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = l1_blocks;
  mo.huge_pages = false;
  auto m = CacheManager::Create(*spec, mo);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  s.manager = std::move(m).value();
  uint64_t block_bytes = 0;
  std::vector<uint64_t> sizes;
  for (const auto& p : s.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  block_bytes = BundleRecordBytes(sizes);
  HostTierOptions h;
  h.max_record_bytes = block_bytes;
  // By default smaller than the prefix: it spills.
  h.capacity_bytes = host_blocks * ((block_bytes + 4095) & ~uint64_t{4095});
  h.huge_pages = false;
  SsdTierOptions d;
  d.path = ssd_dir;
  d.capacity_bytes = 256 << 20;
  d.read_arena_bytes = 64 << 20;
  d.slab_grow_bytes = 32 << 20;
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(HostTier::Open(h).value());
  tiers.push_back(SsdTier::Open(d).value());
  TierChainOptions co;
  co.write_policy =
      WritePolicy::kWriteThrough;  // what must survive a restart goes to the SSD at once
  s.chain = std::make_unique<TierChain>(std::move(tiers), co);
  s.cache = std::make_unique<OffloadedCache>(*s.manager, *s.chain);
  return s;
}

std::vector<TokenId> Prompt(uint32_t blocks = kBlocks) {
  std::vector<TokenId> t(blocks * kBlockTokens + 1);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<TokenId>(1000 + i * 7);
  return t;
}

// Writes pseudo-random bytes into every page of the sequence, as an engine computing it would.
void FillRandom(CacheManager& m, SequenceId seq, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t p = 0; p < m.num_pools(); ++p) {
    std::vector<PageId> table;
    ASSERT_TRUE(m.GetBlockTable(seq, p, &table).ok());
    for (PageId page : table) {
      std::byte* d = m.pool(p).PageData(page);
      for (uint64_t i = 0; i < m.geometry().pools[p].block_stride; i += 8) {
        const uint64_t v = rng();
        std::memcpy(d + i, &v, 8);
      }
    }
  }
}

// (block, pool) -> the page's bytes.
using Snapshot = std::map<std::pair<uint32_t, size_t>, std::vector<std::byte>>;

Snapshot Read(CacheManager& m, SequenceId seq, uint32_t blocks) {
  Snapshot out;
  for (size_t p = 0; p < m.num_pools(); ++p) {
    std::vector<PageId> table;
    EXPECT_TRUE(m.GetBlockTable(seq, p, &table).ok());
    const uint64_t n = m.geometry().pools[p].block_stride;
    for (uint32_t b = 0; b < blocks; ++b) {
      const std::byte* d = m.pool(p).PageData(table[b]);
      out[{b, p}] = std::vector<std::byte>(d, d + n);
    }
  }
  return out;
}

TEST(OffloadedCache, V32PrefixEvictedFromL1SurvivesRestartAndIsRestoredByteIdentical) {
  testing::TempDir dir("offcache");
  const std::vector<TokenId> prompt = Prompt();
  PrefixQuery query;
  query.tokens = prompt;
  Snapshot before;
  {
    Stack s = Build(dir.path());
    ASSERT_EQ(s.manager->num_pools(), 2u);  // mla_latent and indexer_key
    auto seq = s.cache->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
    auto hit = s.cache->AcquirePrefix(*seq);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->blocks, 0u);
    ASSERT_TRUE(s.manager->AllocateSlots(*seq, prompt.size()).ok());
    // The "engine" writes every kind of every block.
    FillRandom(*s.manager, *seq, 5);
    before = Read(*s.manager, *seq, kBlocks);
    ASSERT_TRUE(s.cache->CommitComputed(*seq, prompt.size()).ok());
    ASSERT_TRUE(s.cache->Free(*seq).ok());
    s.cache->WaitIdle();
    EXPECT_EQ(s.cache->Stats().demoted_blocks, kBlocks);
    EXPECT_EQ(s.cache->Stats().demote_failures, 0u);
    // L1 lets go of the prefix; the chain still counts it.
    ASSERT_TRUE(s.manager->Reset().ok());
    auto look = s.cache->LookupPrefix(query);
    ASSERT_TRUE(look.ok());
    EXPECT_EQ(look->l1_blocks, 0u);
    EXPECT_EQ(look->lower_blocks, kBlocks);
  }
  // Restart: a new manager and chain; the host tier starts empty, the SSD tier reopens.
  Stack s = Build(dir.path());
  auto look = s.cache->LookupPrefix(query);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->lower_blocks, kBlocks);
  auto seq = s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
  auto hit = s.cache->AcquirePrefix(*seq);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->l1_blocks, 0u);
  EXPECT_EQ(hit->lower_blocks, kBlocks);
  EXPECT_EQ(hit->tokens, uint64_t{kBlocks} * kBlockTokens);
  auto info = s.manager->GetSequenceInfo(*seq);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->computed_tokens, uint64_t{kBlocks} * kBlockTokens);
  const Snapshot after = Read(*s.manager, *seq, kBlocks);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [where, bytes] : before) {
    EXPECT_TRUE(after.at(where) == bytes) << "block " << where.first << " pool " << where.second;
  }
  // Restored blocks are L1 blocks again: the manager itself now finds them.
  auto l1 = s.manager->LookupPrefix(query);
  ASSERT_TRUE(l1.ok());
  EXPECT_EQ(l1->blocks, kBlocks);
  EXPECT_EQ(s.cache->Stats().restored_blocks, kBlocks);
  ASSERT_TRUE(s.cache->Free(*seq).ok());
}

// A restore of many blocks asks the SSD for them in chunks (kRestoreChunkBlocks, all at once)
// and copies each chunk into L1 while the next ones are read: every block comes back
// byte-identical; a corrupt block in a later chunk ends the prefix just before it; an L1 with
// room for part of the prefix takes the chunks that fit.
TEST(OffloadedCache, ARestoreInChunksIsByteIdenticalEndsAtACorruptBlockAndTakesWhatFits) {
  testing::TempDir dir("offcache");
  constexpr uint32_t kMany = 20;  // three chunks of 8, 8 and 4
  const std::vector<TokenId> prompt = Prompt(kMany);
  Snapshot before;
  std::vector<BlockDigest> digests;
  {
    Stack s = Build(dir.path(), 2, 24);
    auto seq = s.cache->CreateSequence();
    ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
    ASSERT_TRUE(s.cache->AcquirePrefix(*seq).ok());
    ASSERT_TRUE(s.manager->AllocateSlots(*seq, prompt.size()).ok());
    FillRandom(*s.manager, *seq, 9);
    before = Read(*s.manager, *seq, kMany);
    ASSERT_TRUE(s.cache->CommitComputed(*seq, prompt.size()).ok());
    ASSERT_TRUE(s.cache->Free(*seq).ok());
    s.cache->WaitIdle();
    ASSERT_EQ(s.cache->Stats().demoted_blocks, kMany);
    s.manager->hasher().HashFullBlocks(s.manager->hasher().Root(""), prompt, "", &digests);
  }
  auto restore = [&](Stack& s, uint32_t expect_blocks) {
    auto seq = s.cache->CreateSequence();
    ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
    auto hit = s.cache->AcquirePrefix(*seq);
    ASSERT_TRUE(hit.ok()) << hit.status().ToString();
    EXPECT_EQ(hit->lower_blocks, expect_blocks);
    EXPECT_EQ(s.manager->GetSequenceInfo(*seq)->computed_tokens, uint64_t{expect_blocks} * kBlockTokens);
    const Snapshot after = Read(*s.manager, *seq, expect_blocks);
    for (const auto& [where, bytes] : after) {
      EXPECT_TRUE(bytes == before.at(where)) << "block " << where.first << " pool " << where.second;
    }
    ASSERT_TRUE(s.cache->Free(*seq).ok());
  };
  {
    Stack s = Build(dir.path(), 2, 24);  // the host tier starts empty: all 20 from the SSD
    restore(s, kMany);
    EXPECT_EQ(s.cache->Stats().restored_blocks, kMany);
    EXPECT_EQ(s.cache->Stats().restore_no_room, 0u);
  }
  {
    Stack s = Build(dir.path(), 2, 12);  // room for the first chunk, not the second
    restore(s, 8);
    EXPECT_EQ(s.cache->Stats().restore_no_room, 1u);
  }
  std::string victim_file;
  uint64_t victim_offset = 0;
  {
    Stack s = Build(dir.path(), 2, 24);
    auto loc = static_cast<SsdTier&>(s.chain->tier(1)).Locate(BundleKey{0, digests[13].hash});
    ASSERT_TRUE(loc.ok());
    victim_file = loc->file;
    victim_offset = loc->offset + loc->record_bytes / 2;
  }
  FaultInjectionFileSystem fs(FileSystem::Default());
  ASSERT_TRUE(fs.FlipBitInFile(victim_file, victim_offset, 1).ok());
  Stack s = Build(dir.path(), 2, 24);
  restore(s, 13);  // block 13, in the second chunk, is corrupt
  EXPECT_EQ(s.cache->Stats().restore_rejected, 1u);
  EXPECT_EQ(s.chain->tier(1).Stats().corrupt, 1u);
}

TEST(OffloadedCache, ACorruptBundleEndsTheRestoredPrefixAndIsNeverUsed) {
  testing::TempDir dir("offcache");
  const std::vector<TokenId> prompt = Prompt();
  std::string victim_file;
  uint64_t victim_offset = 0;
  {
    Stack s = Build(dir.path());
    auto seq = s.cache->CreateSequence();
    ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
    ASSERT_TRUE(s.cache->AcquirePrefix(*seq).ok());
    ASSERT_TRUE(s.manager->AllocateSlots(*seq, prompt.size()).ok());
    ASSERT_TRUE(s.cache->CommitComputed(*seq, prompt.size()).ok());
    ASSERT_TRUE(s.cache->Free(*seq).ok());
    s.cache->WaitIdle();
    // Block 2's bundle, found through the SSD tier.
    std::vector<BlockDigest> digests;
    s.manager->hasher().HashFullBlocks(s.manager->hasher().Root(""), prompt, "", &digests);
    auto& ssd = static_cast<SsdTier&>(s.chain->tier(1));
    auto loc = ssd.Locate(BundleKey{0, digests[2].hash});
    ASSERT_TRUE(loc.ok());
    victim_file = loc->file;
    victim_offset = loc->offset + loc->record_bytes / 2;
  }
  FaultInjectionFileSystem fs(FileSystem::Default());
  ASSERT_TRUE(fs.FlipBitInFile(victim_file, victim_offset, 1).ok());
  Stack s = Build(dir.path());
  auto seq = s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
  auto hit = s.cache->AcquirePrefix(*seq);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->lower_blocks, 2u);  // blocks 0 and 1; block 2 is corrupt, so the prefix ends there
  EXPECT_EQ(s.chain->tier(1).Stats().corrupt, 1u);
  EXPECT_EQ(s.cache->Stats().restore_rejected, 1u);
  ASSERT_TRUE(s.cache->Free(*seq).ok());
}

// A restore from the host tier reads the records where they lie and checks them as they are
// copied into L1: a record damaged in host memory ends the restored prefix there, is dropped
// from the host tier, and the next restore takes that block from the SSD, byte-identical.
TEST(OffloadedCache, ABundleDamagedInHostMemoryEndsTheRestoreAndComesBackFromTheSsd) {
  testing::TempDir dir("offcache");
  const std::vector<TokenId> prompt = Prompt();
  Stack s = Build(dir.path(), /*host_blocks=*/8);
  auto seq = s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
  ASSERT_TRUE(s.cache->AcquirePrefix(*seq).ok());
  ASSERT_TRUE(s.manager->AllocateSlots(*seq, prompt.size()).ok());
  FillRandom(*s.manager, *seq, 9);
  const Snapshot before = Read(*s.manager, *seq, kBlocks);
  ASSERT_TRUE(s.cache->CommitComputed(*seq, prompt.size()).ok());
  ASSERT_TRUE(s.cache->Free(*seq).ok());
  s.cache->WaitIdle();
  ASSERT_TRUE(s.manager->Reset().ok());
  std::vector<BlockDigest> digests;
  s.manager->hasher().HashFullBlocks(s.manager->hasher().Root(""), prompt, "", &digests);
  const BundleKey victim{0, digests[2].hash};
  ASSERT_TRUE(s.chain->tier(0).Contains({victim}).get()[0]);
  ASSERT_TRUE(static_cast<HostTier&>(s.chain->tier(0)).CorruptForTesting(victim, 100000).ok());

  seq = s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
  auto hit = s.cache->AcquirePrefix(*seq);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->lower_blocks, 2u) << "blocks 0 and 1; block 2 is damaged";
  EXPECT_EQ(s.chain->tier(0).Stats().corrupt, 1u);
  EXPECT_FALSE(s.chain->tier(0).Contains({victim}).get()[0]) << "dropped from the host tier";
  EXPECT_EQ(s.cache->Stats().restore_rejected, 1u);
  auto info = s.manager->GetSequenceInfo(*seq);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->computed_tokens, 2u * kBlockTokens) << "only what was checked is committed";
  ASSERT_TRUE(s.cache->Free(*seq).ok());
  ASSERT_TRUE(s.manager->Reset().ok());

  seq = s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->AppendTokens(*seq, prompt).ok());
  hit = s.cache->AcquirePrefix(*seq);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->lower_blocks, kBlocks);
  const Snapshot after = Read(*s.manager, *seq, kBlocks);
  for (const auto& [where, bytes] : before) {
    EXPECT_TRUE(after.at(where) == bytes) << "block " << where.first << " pool " << where.second;
  }
  ASSERT_TRUE(s.cache->Free(*seq).ok());
}

}  // namespace
}  // namespace sparsekv
