// OffloadedCache under write-back: L1 blocks reach the chain only when the manager evicts them
// (through its eviction hook), are found there after the L1 prefix and restored with every
// kind's bytes identical; a failing tier or a full backlog drops blocks cleanly, counted, and L1
// keeps working; what was evicted survives a restart; and all of it holds with several threads
// evicting while demotes run.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <latch>
#include <mutex>
#include <random>
#include <thread>

#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"
#include "tests/support/page_pattern.h"

namespace sparsekv {
namespace {

// A tier in front of another that holds puts back until Open(): a demote stays on its way for
// as long as a test needs.
class GatedTier : public testing::ForwardingTier {
 public:
  explicit GatedTier(std::unique_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {}
  ~GatedTier() override { Open(); }
  void Open() {
    std::vector<std::pair<std::vector<BundlePtr>, StatusesCallback>> held;
    {
      std::lock_guard<std::mutex> l(mu_);
      open_ = true;
      held.swap(held_);
    }
    for (auto& [bundles, done] : held) inner_->PutAsync(std::move(bundles), std::move(done));
  }
  size_t held_puts() {
    std::lock_guard<std::mutex> l(mu_);
    return held_.size();
  }
  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!open_) {
        held_.emplace_back(std::move(bundles), std::move(done));
        return;
      }
    }
    inner_->PutAsync(std::move(bundles), std::move(done));
  }

 private:
  std::mutex mu_;
  bool open_ = false;
  std::vector<std::pair<std::vector<BundlePtr>, StatusesCallback>> held_;
};

struct StackOptions {
  ModelSpec spec = *ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8);
  uint32_t block_tokens = 64;
  uint32_t l1_blocks = 8;
  uint32_t l1_window_blocks = 0;  // CacheManagerOptions::window_capacity_blocks
  // Host tier capacity in blocks; 0: no host tier.
  uint64_t host_blocks = 64;
  // SSD tier directory; empty: no SSD tier.
  std::string ssd_dir;
  FileSystem* fs = nullptr;
  WritePolicy chain_policy = WritePolicy::kWriteThrough;
  // Put the first tier behind a GatedTier, closed.
  bool gate_first_tier = false;
  // CacheManagerOptions::check_invariants: checked after every change (slow).
  bool check_invariants = false;
  // Evicting ahead is off: most tests here count the evictions AllocateSlots makes itself
  // (the eviction hook's path); those of EvictAhead set evict_ahead_blocks.
  OffloadedCacheOptions cache = [] {
    OffloadedCacheOptions c;
    c.evict_ahead_blocks = 0;
    return c;
  }();
};

struct Stack {
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
  uint64_t block_record_bytes = 0;
  GatedTier* gate = nullptr;  // owned by the chain
};

Stack Build(StackOptions o) {
  Stack s;
  CacheManagerOptions mo;
  mo.block_tokens = o.block_tokens;
  mo.capacity_blocks = o.l1_blocks;
  mo.window_capacity_blocks = o.l1_window_blocks;
  mo.huge_pages = false;
  mo.check_invariants = o.check_invariants;
  auto m = CacheManager::Create(o.spec, mo);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  s.manager = std::move(m).value();
  std::vector<uint64_t> sizes;
  for (const auto& p : s.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  s.block_record_bytes = BundleRecordBytes(sizes);
  std::vector<std::unique_ptr<Tier>> tiers;
  if (o.host_blocks > 0) {
    HostTierOptions h;
    h.max_record_bytes = s.block_record_bytes;
    h.capacity_bytes = o.host_blocks * ((s.block_record_bytes + 4095) & ~uint64_t{4095});
    h.huge_pages = false;
    tiers.push_back(HostTier::Open(h).value());
  }
  if (!o.ssd_dir.empty()) {
    SsdTierOptions d;
    d.path = o.ssd_dir;
    d.capacity_bytes = 256 << 20;
    d.read_arena_bytes = 64 << 20;
    d.slab_grow_bytes = 32 << 20;
    auto t = SsdTier::Open(d, o.fs);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    tiers.push_back(std::move(t).value());
  }
  if (o.gate_first_tier) {
    auto gated = std::make_unique<GatedTier>(std::move(tiers[0]));
    s.gate = gated.get();
    tiers[0] = std::move(gated);
  }
  TierChainOptions co;
  co.write_policy = o.chain_policy;
  s.chain = std::make_unique<TierChain>(std::move(tiers), co);
  o.cache.write_policy = WritePolicy::kWriteBack;
  s.cache = std::make_unique<OffloadedCache>(*s.manager, *s.chain, o.cache);
  return s;
}

using testing::FillPattern;
using testing::HoldsPattern;
using testing::PatternSeed;

std::vector<TokenId> Prompt(size_t n, uint32_t seed) {
  std::vector<TokenId> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = seed * 100003u + static_cast<TokenId>(i * 7);
  return t;
}

struct RequestResult {
  bool allocated = false;
  OffloadedPrefix hit;
  uint64_t bad_pages = 0;  // pages given from L1 or the chain that did not hold their block
};

// One request as an engine makes it, through the OffloadedCache: acquire (L1, then the chain),
// check every page it is given, write every page it computes, commit, free.
RequestResult Request(Stack& s, std::span<const TokenId> tokens) {
  RequestResult r;
  CacheManager& m = *s.manager;
  std::vector<BlockDigest> digests;
  m.hasher().HashFullBlocks(m.hasher().Root(""), tokens, "", &digests);
  auto seq = s.cache->CreateSequence();
  EXPECT_TRUE(seq.ok());
  EXPECT_TRUE(s.cache->AppendTokens(*seq, tokens).ok());
  auto hit = s.cache->AcquirePrefix(*seq);
  EXPECT_TRUE(hit.ok()) << hit.status().ToString();
  r.hit = *hit;
  auto slots = m.AllocateSlots(*seq, tokens.size());
  if (!slots.ok()) {
    EXPECT_EQ(slots.status().code(), StatusCode::kResourceExhausted) << slots.status().ToString();
    EXPECT_TRUE(s.cache->Free(*seq).ok());
    return r;
  }
  r.allocated = true;
  for (size_t q = 0; q < m.num_pools(); ++q) {
    std::vector<PageId> table;
    EXPECT_TRUE(m.GetBlockTable(*seq, q, &table).ok());
    const uint64_t n = m.geometry().pools[q].block_stride;
    for (uint32_t b = 0; b < table.size(); ++b) {
      if (table[b] == kInvalidPage) continue;  // a window or snapshot page not needed here
      std::byte* page = m.pool(q).PageData(table[b]);
      if (b < r.hit.blocks) {
        r.bad_pages += !HoldsPattern(page, n, PatternSeed(digests[b].hash, q));
      } else {
        FillPattern(page, n, b < digests.size() ? PatternSeed(digests[b].hash, q) : ~uint64_t{b});
      }
    }
  }
  EXPECT_TRUE(s.cache->CommitComputed(*seq, tokens.size()).ok());
  EXPECT_TRUE(s.cache->Free(*seq).ok());
  return r;
}

OffloadedPrefix Lookup(Stack& s, std::span<const TokenId> tokens) {
  PrefixQuery q;
  q.tokens = tokens;
  auto r = s.cache->LookupPrefix(q);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

constexpr uint32_t kBt = 64;

TEST(OffloadedCacheWriteBack, EvictedBlocksGoDownAndComeBackWithEveryKindIdentical) {
  Stack s = Build({});
  ASSERT_EQ(s.manager->num_pools(), 2u);  // mla_latent and indexer_key
  const auto p = Prompt(4 * kBt + 1, 1);
  const auto q = Prompt(7 * kBt + 1, 2);
  ASSERT_TRUE(Request(s, p).allocated);
  s.cache->WaitIdle();
  // Committing does not demote under write-back.
  EXPECT_EQ(s.cache->Stats().demoted_blocks, 0u);
  EXPECT_EQ(s.chain->tier(0).Stats().items, 0u);

  // Eight pages for q: the four free ones, then p's four cached blocks are evicted.
  ASSERT_TRUE(Request(s, q).allocated);
  EXPECT_EQ(s.manager->Stats().evicted_blocks, 4u);
  // Findable at once, whether still on the way or already in the chain.
  OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.l1_blocks, 0u);
  EXPECT_EQ(look.lower_blocks, 4u);
  s.cache->WaitIdle();
  OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.evicted_demoted, 4u);
  EXPECT_EQ(st.demoted_blocks, 4u);
  EXPECT_EQ(st.demote_failures, 0u);
  EXPECT_EQ(st.evicted_incomplete, 0u);
  EXPECT_EQ(st.demote_backlog_drops, 0u);
  EXPECT_EQ(st.pending_demote_bytes, 0u);
  EXPECT_EQ(s.chain->tier(0).Stats().items, 4u);

  // p again: restored from the chain into fresh pages, every kind of every block identical
  // (Request checks each page against the block's pattern).
  RequestResult again = Request(s, p);
  ASSERT_TRUE(again.allocated);
  EXPECT_EQ(again.hit.l1_blocks, 0u);
  EXPECT_EQ(again.hit.lower_blocks, 4u);
  EXPECT_EQ(again.bad_pages, 0u);
  EXPECT_EQ(s.cache->Stats().restored_blocks, 4u);
  PrefixQuery pq;
  pq.tokens = p;
  EXPECT_EQ(s.manager->LookupPrefix(pq)->blocks, 4u);  // L1 blocks again

  // Making room for p evicted q's tail blocks (released first): q's head is still in L1 and its
  // tail follows in the chain.
  s.cache->WaitIdle();
  const uint64_t q_evicted = s.manager->Stats().evicted_blocks - 4;
  ASSERT_GT(q_evicted, 0u);
  look = Lookup(s, q);
  EXPECT_EQ(look.l1_blocks, 7 - q_evicted);
  EXPECT_EQ(look.lower_blocks, q_evicted);
  RequestResult q_again = Request(s, q);
  EXPECT_EQ(q_again.hit.blocks, 7u);
  EXPECT_EQ(q_again.bad_pages, 0u);
  EXPECT_EQ(s.manager->Stats().internal_errors, 0u) << s.manager->Stats().first_internal_error;
}

TEST(OffloadedCacheWriteBack, BlocksOnTheirWayDownStayFindableAndRestorable) {
  StackOptions o;
  o.gate_first_tier = true;
  Stack s = Build(o);
  const auto p = Prompt(4 * kBt + 1, 1);
  ASSERT_TRUE(Request(s, p).allocated);
  ASSERT_TRUE(Request(s, Prompt(7 * kBt + 1, 2)).allocated);  // evicts p
  // The chain has not stored p (its put is held), yet p is found below L1...
  EXPECT_EQ(s.chain->tier(0).Stats().items, 0u);
  OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.l1_blocks, 0u);
  EXPECT_EQ(look.lower_blocks, 4u);
  EXPECT_GE(s.cache->Stats().pending_demote_bytes, 4 * s.block_record_bytes);
  // ... and restored, byte-identical, from the copies on their way.
  RequestResult r = Request(s, p);
  ASSERT_TRUE(r.allocated);
  EXPECT_EQ(r.hit.lower_blocks, 4u);
  EXPECT_EQ(r.bad_pages, 0u);
  EXPECT_EQ(s.cache->Stats().restored_blocks, 4u);
  EXPECT_EQ(s.chain->tier(0).Stats().items, 0u);
  s.gate->Open();
  s.cache->WaitIdle();
  const OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.pending_demote_bytes, 0u);
  EXPECT_EQ(st.demote_failures, 0u);
  EXPECT_EQ(s.chain->tier(0).Stats().items, st.evicted_demoted);
  EXPECT_GE(st.evicted_demoted, 4u);
}

TEST(OffloadedCacheWriteBack, AFailingTierDropsBlocksCleanlyAndL1KeepsWorking) {
  testing::TempDir dir("wbfault");
  FaultInjectionFileSystem fault(FileSystem::Default(), 7);
  StackOptions o;
  o.host_blocks = 0;  // the SSD tier alone: its write errors are the demotes' errors
  o.ssd_dir = dir.path();
  o.fs = &fault;
  Stack s = Build(o);
  fault.AddRule({FaultOp::kWrite, FaultKind::kEio, "data.dat", UINT64_MAX, 1.0});
  const auto p = Prompt(4 * kBt + 1, 1);
  const auto q = Prompt(7 * kBt + 1, 2);
  ASSERT_TRUE(Request(s, p).allocated);
  ASSERT_TRUE(Request(s, q).allocated);  // evicts p
  s.cache->WaitIdle();
  OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.evicted_demoted, 4u);
  EXPECT_EQ(st.demote_failures, 4u);
  EXPECT_EQ(st.pending_demote_bytes, 0u);
  EXPECT_GT(fault.Stats().eio, 0u);
  EXPECT_EQ(s.chain->Stats().demote_dropped, 4u);
  EXPECT_EQ(Lookup(s, p).blocks, 0u);  // dropped, and never claimed

  // L1 works on: q hits in full, p is computed again and hits next time.
  RequestResult r = Request(s, q);
  EXPECT_EQ(r.hit.l1_blocks, 7u);
  EXPECT_EQ(r.bad_pages, 0u);
  r = Request(s, p);
  ASSERT_TRUE(r.allocated);
  EXPECT_EQ(r.hit.blocks, 0u);
  r = Request(s, p);
  EXPECT_EQ(r.hit.l1_blocks, 4u);
  EXPECT_EQ(r.bad_pages, 0u);

  // Once the device recovers, evicted blocks reach it again.
  s.cache->WaitIdle();
  fault.ClearRules();
  const uint64_t failures = s.cache->Stats().demote_failures;
  ASSERT_TRUE(Request(s, Prompt(7 * kBt + 1, 3)).allocated);
  s.cache->WaitIdle();
  st = s.cache->Stats();
  EXPECT_EQ(st.demote_failures, failures);
  EXPECT_GT(st.evicted_demoted, 4u);
  EXPECT_EQ(Lookup(s, p).blocks, 4u);  // p was evicted by the last request, and kept
  r = Request(s, p);
  EXPECT_EQ(r.hit.blocks, 4u);
  EXPECT_EQ(r.bad_pages, 0u);
  EXPECT_EQ(s.manager->Stats().internal_errors, 0u) << s.manager->Stats().first_internal_error;
}

TEST(OffloadedCacheWriteBack, AFullBacklogDropsEvictedBlocksWithoutCopyingThem) {
  StackOptions o;
  o.cache.max_pending_demote_bytes = 0;
  Stack s = Build(o);
  const auto p = Prompt(4 * kBt + 1, 1);
  ASSERT_TRUE(Request(s, p).allocated);
  ASSERT_TRUE(Request(s, Prompt(7 * kBt + 1, 2)).allocated);
  s.cache->WaitIdle();
  const OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.demote_backlog_drops, 4u);
  EXPECT_EQ(st.evicted_demoted, 0u);
  EXPECT_EQ(st.demoted_blocks, 0u);
  EXPECT_EQ(s.chain->tier(0).Stats().puts, 0u);
  EXPECT_EQ(Lookup(s, p).blocks, 0u);
  RequestResult r = Request(s, p);
  ASSERT_TRUE(r.allocated);
  EXPECT_EQ(r.hit.blocks, 0u);
}

TEST(OffloadedCacheWriteBack, EvictedPrefixSurvivesRestartAndIsRestoredByteIdentical) {
  testing::TempDir dir("wbrestart");
  StackOptions o;
  o.host_blocks = 2;  // smaller than the prefix
  o.ssd_dir = dir.path();
  o.chain_policy = WritePolicy::kWriteThrough;  // what must survive a restart goes to the SSD
  const auto p = Prompt(4 * kBt + 1, 1);
  const auto q = Prompt(7 * kBt + 1, 2);
  {
    Stack s = Build(o);
    ASSERT_EQ(Request(s, p).hit.blocks, 0u);
    ASSERT_TRUE(Request(s, q).allocated);  // evicts p's four blocks
    s.cache->WaitIdle();
    EXPECT_EQ(s.cache->Stats().evicted_demoted, 4u);
    EXPECT_EQ(s.cache->Stats().demote_failures, 0u);
    EXPECT_EQ(s.chain->tier(1).Stats().items, 4u);
  }
  // Restart over the same SSD directory: a new manager, an empty host tier.
  Stack s = Build(o);
  OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.l1_blocks, 0u);
  EXPECT_EQ(look.lower_blocks, 4u);
  // q was never evicted, so under write-back it was never written: L1 died with it.
  EXPECT_EQ(Lookup(s, q).blocks, 0u);
  RequestResult r = Request(s, p);
  ASSERT_TRUE(r.allocated);
  EXPECT_EQ(r.hit.lower_blocks, 4u);
  EXPECT_EQ(r.hit.tokens, uint64_t{4} * kBt);
  EXPECT_EQ(r.bad_pages, 0u) << "a restored page differs from what was written before the restart";
  EXPECT_EQ(s.cache->Stats().restored_blocks, 4u);
  PrefixQuery pq;
  pq.tokens = p;
  EXPECT_EQ(s.manager->LookupPrefix(pq)->blocks, 4u);
}

// A small V4-shaped model: a sliding-window-only layer, a CSA layer and an HCA layer, so six
// pools in three roles as in DeepSeek-V4-Flash, at a fraction of its block size.
ModelSpec SmallV4Spec() {
  ModelSpec s;
  s.name = "small-v4";
  s.window_tokens = 128;
  const StorageFormat kv = StorageFormat::kFp8V4;
  s.layers.push_back(LayerSpec{{KindSpec{CacheKind::kSwaWindow, kv, 512, 1, 0}}});
  s.layers.push_back(
      LayerSpec{{KindSpec{CacheKind::kSwaWindow, kv, 512, 1, 0},
                 KindSpec{CacheKind::kCsaCompressed, kv, 512, 4, 0},
                 KindSpec{CacheKind::kIndexerKey, StorageFormat::kIdxFp8, 128, 4, 0},
                 KindSpec{CacheKind::kCompressorState, StorageFormat::kFp32, 1024, 4, 8}}});
  s.layers.push_back(
      LayerSpec{{KindSpec{CacheKind::kSwaWindow, kv, 512, 1, 0},
                 KindSpec{CacheKind::kHcaCompressed, kv, 512, 128, 0},
                 KindSpec{CacheKind::kCompressorState, StorageFormat::kFp32, 512, 128, 128}}});
  return s;
}

// V4: a block's window page is evicted long before its full-history pages (it went to the cache
// when it left the running sequence's window). The block is demoted then, complete; its later
// eviction without the window page demotes its history record (a resume through a tail can use
// it; a prefix hit cannot); and the prefix comes back with the window and snapshot pages needed
// to resume.
TEST(OffloadedCacheWriteBack, V4BlockIsDemotedCompleteWhenItsWindowPageGoesFirst) {
  StackOptions o;
  o.spec = SmallV4Spec();
  o.block_tokens = 128;
  o.l1_blocks = 8;
  o.l1_window_blocks = 6;
  Stack s = Build(o);
  ASSERT_EQ(s.manager->num_pools(), 6u);
  const auto p = Prompt(4 * 128 + 1, 1);
  ASSERT_TRUE(Request(s, p).allocated);
  // Window pool: p's blocks 2, 1, 0 went to the cache at commit and 3 at Free; this request
  // takes the two free window pages and evicts block 2's. Block 2 stays in L1, and is demoted.
  ASSERT_TRUE(Request(s, Prompt(2 * 128 + 1, 2)).allocated);
  s.cache->WaitIdle();
  EXPECT_EQ(s.manager->Stats().evicted_blocks, 0u);
  EXPECT_EQ(s.manager->Stats().evicted_boundary_pages, 1u);
  EXPECT_EQ(s.cache->Stats().evicted_demoted, 1u);
  EXPECT_EQ(s.chain->tier(0).Stats().items, 1u);

  // A five-block request evicts p's full-history pages, block 2's among them: it lacks its
  // window page now, and goes as a history record (the whole one is in the chain already).
  ASSERT_TRUE(Request(s, Prompt(4 * 128 + 1, 3)).allocated);
  s.cache->WaitIdle();
  const OffloadedCacheStats st = s.cache->Stats();
  EXPECT_GT(s.manager->Stats().evicted_blocks, 0u);
  EXPECT_EQ(st.evicted_incomplete, 0u);
  EXPECT_EQ(st.evicted_history, 1u);
  EXPECT_EQ(st.demote_failures, 0u);
  const OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.blocks, 4u);
  EXPECT_GE(look.lower_blocks, 3u);

  // Restored: every page the resumed request holds (all full-history pages, and the window and
  // snapshot of block 3) is byte-identical to what was written.
  RequestResult r = Request(s, p);
  ASSERT_TRUE(r.allocated);
  EXPECT_EQ(r.hit.blocks, 4u);
  EXPECT_EQ(r.bad_pages, 0u);
  EXPECT_EQ(s.manager->Stats().internal_errors, 0u) << s.manager->Stats().first_internal_error;
}

// A small V3.2-shaped model (two layers), so that many requests fit in a test under TSan.
ModelSpec SmallSpec() {
  ModelSpec s;
  s.name = "small-v32";
  for (int l = 0; l < 2; ++l) {
    s.layers.push_back(
        LayerSpec{{KindSpec{CacheKind::kMlaLatent, StorageFormat::kFp8DsMla, 576, 1, 0},
                   KindSpec{CacheKind::kIndexerKey, StorageFormat::kIdxFp8, 128, 1, 0}}});
  }
  return s;
}

// With evict_ahead_blocks, an allocation that leaves fewer free pages makes the demote thread
// evict the oldest cached blocks and copy them off the manager's lock: the next allocations
// find free pages, the hook copies nothing, and the blocks come back byte-identical.
TEST(OffloadedCacheWriteBack, EvictingAheadKeepsPagesFreeAndItsBlocksComeBackIdentical) {
  StackOptions o;
  o.l1_blocks = 16;
  o.cache.evict_ahead_blocks = 4;
  Stack s = Build(o);
  const auto p = Prompt(10 * kBt + 1, 1);
  const auto q = Prompt(4 * kBt + 1, 2);
  ASSERT_TRUE(Request(s, p).allocated);  // 10 cached, 6 free: nothing to do
  s.cache->WaitIdle();
  EXPECT_EQ(s.cache->Stats().evicted_ahead, 0u);
  ASSERT_TRUE(Request(s, q).allocated);  // 5 pages: 1 left free, so p's 3 oldest blocks go
  s.cache->WaitIdle();
  OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.evicted_ahead, 3u);
  EXPECT_EQ(st.evicted_demoted, st.evicted_ahead) << "the hook copied some";
  EXPECT_EQ(s.manager->Stats().evicted_blocks, 3u);
  EXPECT_EQ(st.demoted_blocks, 3u);
  EXPECT_EQ(st.demote_failures, 0u);
  EXPECT_EQ(st.pending_demote_bytes, 0u);
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) {
    // 1 left by q's allocation, 3 evicted ahead, and q's partial page freed with it.
    EXPECT_EQ(s.manager->pool(pool).FreeCount(), 5u) << "pool " << pool;
    EXPECT_EQ(s.manager->pool(pool).Stats().misuse, 0u);
  }
  // p's tail blocks went (tails are released first), so its prefix is 7 in L1 then 3 below.
  const OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.l1_blocks, 7u);
  EXPECT_EQ(look.lower_blocks, 3u);
  const RequestResult again = Request(s, p);
  ASSERT_TRUE(again.allocated);
  EXPECT_EQ(again.hit.blocks, 10u);
  EXPECT_EQ(again.bad_pages, 0u);
  s.cache->WaitIdle();
  EXPECT_EQ(s.cache->Stats().evicted_demoted, s.cache->Stats().evicted_ahead);
}

// Evict on the caller's request: blocks leave L1 until the pools have the pages asked for,
// each reaching the chain first (write-back: copied out then; write-through: at commit), and
// come back identical. Blocks a sequence holds are never taken.
class OffloadedCacheEvict : public ::testing::TestWithParam<WritePolicy> {};

TEST_P(OffloadedCacheEvict, EvictsToTheFreePagesAskedForAndTheBlocksComeBackIdentical) {
  StackOptions o;
  o.l1_blocks = 16;
  o.cache.write_policy = GetParam();
  Stack s = Build(o);
  const auto p = Prompt(10 * kBt + 1, 1);
  ASSERT_TRUE(Request(s, p).allocated);
  s.cache->WaitIdle();
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) EXPECT_EQ(s.manager->pool(pool).FreeCount(), 6u);

  // A second request holds its 2 pages while the rest is evicted: 16 - 2 held = at most 14 free.
  const auto held_prompt = Prompt(2 * kBt, 2);
  auto held = s.cache->CreateSequence();
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(s.cache->AppendTokens(*held, held_prompt).ok());
  ASSERT_TRUE(s.manager->AllocateSlots(*held, held_prompt.size()).ok());

  EXPECT_EQ(s.cache->Evict(8, 1), 1u);  // max_blocks bounds it
  EXPECT_EQ(s.cache->Evict(8), 3u);     // 4 free after the allocation + 1 + 3 = 8
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) EXPECT_EQ(s.manager->pool(pool).FreeCount(), 8u);
  EXPECT_EQ(s.cache->Evict(8), 0u);  // already there
  EXPECT_EQ(s.cache->Evict(16), 6u);  // every cached block, and no held page
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) EXPECT_EQ(s.manager->pool(pool).FreeCount(), 14u);
  EXPECT_EQ(s.manager->Stats().evicted_blocks, 10u);
  s.cache->WaitIdle();
  const OffloadedCacheStats st = s.cache->Stats();
  EXPECT_EQ(st.demoted_blocks, 10u);
  EXPECT_EQ(st.demote_failures, 0u);
  if (GetParam() == WritePolicy::kWriteBack) {
    EXPECT_EQ(st.evicted_demoted, 10u);
    EXPECT_EQ(st.evicted_ahead, 10u);  // copied off the manager's lock
  }
  const OffloadedPrefix look = Lookup(s, p);
  EXPECT_EQ(look.l1_blocks, 0u);
  EXPECT_EQ(look.lower_blocks, 10u);
  ASSERT_TRUE(s.cache->Free(*held).ok());
  const RequestResult again = Request(s, p);
  ASSERT_TRUE(again.allocated);
  EXPECT_EQ(again.hit.lower_blocks, 10u);
  EXPECT_EQ(again.bad_pages, 0u);
  EXPECT_EQ(s.manager->Stats().internal_errors, 0u) << s.manager->Stats().first_internal_error;
}

INSTANTIATE_TEST_SUITE_P(Policies, OffloadedCacheEvict,
                         ::testing::Values(WritePolicy::kWriteBack, WritePolicy::kWriteThrough),
                         [](const auto& info) {
                           return info.param == WritePolicy::kWriteBack ? "WriteBack" : "WriteThrough";
                         });

// Four threads run requests over shared prefixes through a small L1, so blocks are evicted,
// demoted, cascaded from the host tier to the SSD and restored all the time, while an observer
// looks prefixes up. Every page a request is given must hold its block. The parameter is
// evict_ahead_blocks: 0, every eviction in AllocateSlots (the hook copies); 4, most ahead of
// need on the demote thread, the rest in AllocateSlots when four threads outrun it.
class OffloadedCacheWriteBackThreads : public ::testing::TestWithParam<uint32_t> {};

TEST_P(OffloadedCacheWriteBackThreads, EvictingAndRestoringWhileDemotesRun) {
  testing::TempDir dir("wbthreads");
  StackOptions o;
  o.cache.evict_ahead_blocks = GetParam();
  o.check_invariants = true;  // held pages included
  o.spec = SmallSpec();
  o.block_tokens = 16;
  o.l1_blocks = 24;
  o.host_blocks = 12;
  o.ssd_dir = dir.path();
  o.chain_policy = WritePolicy::kWriteBack;  // the host tier's evictions cascade to the SSD
  Stack s = Build(o);
#if SPARSEKV_TSAN
  constexpr int kIterations = 150;
#else
  constexpr int kIterations = 600;
#endif
  constexpr int kThreads = 4;
  std::atomic<uint64_t> bad{0}, lower_hits{0}, l1_hits{0};
  std::atomic<bool> stop{false};
  std::latch start(kThreads + 1);
  std::vector<std::thread> ts;
  for (int id = 0; id < kThreads; ++id) {
    ts.emplace_back([&, id] {
      std::mt19937 rng(500 + id);
      start.arrive_and_wait();
      for (int it = 0; it < kIterations; ++it) {
        // One of eight two-block system prompts, then a user turn of 1..3 blocks from a small
        // set, so whole conversations come back after their blocks were evicted.
        auto tokens = Prompt(32, rng() % 8);
        const auto user = Prompt(1 + rng() % 48, 1000 + rng() % 16);
        tokens.insert(tokens.end(), user.begin(), user.end());
        const RequestResult r = Request(s, tokens);
        bad += r.bad_pages;
        lower_hits += r.hit.lower_blocks;
        l1_hits += r.hit.l1_blocks;
      }
    });
  }
  std::thread observer([&] {
    std::mt19937 rng(9);
    start.arrive_and_wait();
    while (!stop.load()) {
      const auto p = Prompt(33, rng() % 8);
      PrefixQuery q;
      q.tokens = p;
      auto m = s.cache->LookupPrefix(q);
      ASSERT_TRUE(m.ok());
      ASSERT_LE(m->blocks, 2u);
      (void)s.cache->Stats();
      std::this_thread::yield();
    }
  });
  for (auto& t : ts) t.join();
  stop = true;
  observer.join();
  s.cache->WaitIdle();
  const OffloadedCacheStats st = s.cache->Stats();
  const CacheStats ms = s.manager->Stats();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(ms.internal_errors, 0u) << ms.first_internal_error;
  EXPECT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
  EXPECT_GT(ms.evicted_blocks, 0u);
  // Every evicted block was either demoted or dropped for the backlog, and counted once.
  EXPECT_EQ(st.evicted_demoted + st.demote_backlog_drops + st.evicted_incomplete,
            ms.evicted_blocks);
  EXPECT_EQ(st.evicted_incomplete, 0u);  // a V3.2 block has no window or snapshot pages
  EXPECT_EQ(st.demoted_blocks, st.evicted_demoted);
  EXPECT_EQ(st.demote_failures, 0u);
  EXPECT_EQ(st.pending_demote_bytes, 0u);
  EXPECT_GT(lower_hits.load(), 0u);
  EXPECT_GT(st.restored_blocks, 0u);
  EXPECT_GT(s.chain->Stats().cascaded, 0u);
  for (size_t p = 0; p < s.manager->num_pools(); ++p) {
    EXPECT_EQ(s.manager->pool(p).Stats().used, 0u) << "pool " << p << ": a held page was not given back";
    EXPECT_EQ(s.manager->pool(p).Stats().misuse, 0u) << "pool " << p;
  }
  if (GetParam() > 0) {
    EXPECT_GT(st.evicted_ahead, 0u);
  } else {
    EXPECT_EQ(st.evicted_ahead, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(EvictAhead, OffloadedCacheWriteBackThreads, ::testing::Values(0u, 4u),
                         [](const auto& info) { return info.param == 0 ? std::string("Off") : std::string("On"); });

}  // namespace
}  // namespace sparsekv
