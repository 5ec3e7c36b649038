// The manager's eviction hook (CacheManager::SetBlockEvictHook): called for exactly the cached
// blocks an allocation evicts, once per eviction, before their pages are reused, so the bytes it
// reads are the ones the engine wrote; never for Reset, freed or uncached blocks; replaced and
// removed safely, from other threads too.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <latch>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "sparsekv/cache_manager.h"
#include "tests/cache/cache_test_util.h"
#include "tests/support/page_pattern.h"

namespace sparsekv {
namespace {

using testing::EventLog;
using testing::MakeCache;
using testing::OneKindSpec;
using testing::Prompt;
using testing::RunAndFree;

using testing::FillPattern;
using testing::HoldsPattern;
using testing::PatternSeed;

std::unique_ptr<CacheManager> MakeOneKindWithBytes(uint32_t capacity, uint32_t block_tokens = 4) {
  CacheManagerOptions o;
  o.block_tokens = block_tokens;
  o.capacity_blocks = capacity;
  o.huge_pages = false;
  return MakeCache(OneKindSpec(), o);
}

std::vector<BlockDigest> Digests(const CacheManager& c, std::span<const TokenId> tokens) {
  std::vector<BlockDigest> d;
  c.hasher().HashFullBlocks(c.hasher().Root(""), tokens, "", &d);
  return d;
}

// An engine's request that writes every page it computes (full blocks with their pattern, the
// partial block with noise) and checks every page it is given from the cache. Returns the blocks
// that hit, or -1 when the allocation was refused.
int RunWritingPages(CacheManager& c, std::span<const TokenId> tokens, std::atomic<uint64_t>* bad,
                    bool free_it = true) {
  const std::vector<BlockDigest> digests = Digests(c, tokens);
  auto seq = c.CreateSequence();
  EXPECT_TRUE(seq.ok());
  EXPECT_TRUE(c.AppendTokens(*seq, tokens).ok());
  auto hit = c.AcquireCachedPrefix(*seq);
  EXPECT_TRUE(hit.ok());
  auto slots = c.AllocateSlots(*seq, tokens.size());
  if (!slots.ok()) {
    EXPECT_EQ(slots.status().code(), StatusCode::kResourceExhausted) << slots.status().ToString();
    EXPECT_TRUE(c.Free(*seq).ok());
    return -1;
  }
  for (size_t q = 0; q < c.num_pools(); ++q) {
    std::vector<PageId> table;
    EXPECT_TRUE(c.GetBlockTable(*seq, q, &table).ok());
    const uint64_t n = c.geometry().pools[q].block_stride;
    for (uint32_t b = 0; b < table.size(); ++b) {
      if (table[b] == kInvalidPage) continue;
      std::byte* page = c.pool(q).PageData(table[b]);
      if (b < hit->blocks) {
        if (!HoldsPattern(page, n, PatternSeed(digests[b].hash, q))) ++*bad;
      } else {
        FillPattern(page, n, b < digests.size() ? PatternSeed(digests[b].hash, q) : ~uint64_t{b});
      }
    }
  }
  EXPECT_TRUE(c.CommitComputed(*seq, tokens.size()).ok());
  if (free_it) {
    EXPECT_TRUE(c.Free(*seq).ok());
  }
  return static_cast<int>(hit->blocks);
}

struct HookCall {
  BlockDigest digest;
  std::vector<PageId> pages;
  bool whole_block = true;
  bool bytes_intact = true;  // every valid page held the block's pattern
};

// Records every call; with `check_bytes`, compares each valid page with the block's pattern.
class HookLog {
 public:
  HookLog(CacheManager& c, bool check_bytes) : c_(c) {
    c.SetBlockEvictHook([this, check_bytes](const EvictingBlock& e) {
      HookCall call;
      call.digest = e.digest;
      call.pages.assign(e.pages.begin(), e.pages.end());
      call.whole_block = e.whole_block;
      for (size_t q = 0; check_bytes && q < e.pages.size(); ++q) {
        if (e.pages[q] == kInvalidPage) continue;
        call.bytes_intact &= HoldsPattern(c_.pool(q).PageData(e.pages[q]), c_.geometry().pools[q].block_stride,
                                          PatternSeed(e.digest.hash, q));
      }
      std::lock_guard<std::mutex> l(mu_);
      calls_.push_back(std::move(call));
    });
  }
  ~HookLog() { c_.SetBlockEvictHook(nullptr); }
  std::vector<HookCall> Take() {
    std::lock_guard<std::mutex> l(mu_);
    return std::move(calls_);
  }

 private:
  CacheManager& c_;
  std::mutex mu_;
  std::vector<HookCall> calls_;
};

// The hashes of every "blocks removed" event, in order.
std::vector<BlockHash> Removed(const std::vector<KvEvent>& events) {
  std::vector<BlockHash> out;
  for (const KvEvent& e : events) {
    if (e.type != KvEventType::kBlocksRemoved) continue;
    out.insert(out.end(), e.block_hashes.begin(), e.block_hashes.end());
  }
  return out;
}

TEST(EvictHook, CalledForEachEvictedCachedBlockWithItsBytesIntact) {
  auto c = MakeOneKindWithBytes(4);
  std::atomic<uint64_t> bad{0};
  HookLog hook(*c, /*check_bytes=*/true);
  EventLog log(*c);
  // Two full blocks and a partial one; freed tail first: block 2 is freed, 1 and 0 cached.
  const auto a = Prompt(10, 1);
  const auto da = Digests(*c, a);
  ASSERT_EQ(RunWritingPages(*c, a, &bad), 0);
  EXPECT_TRUE(hook.Take().empty());
  log.Take();

  // Four pages: the two free ones first, then the cached blocks, least recently released first.
  const auto b = Prompt(13, 2);
  ASSERT_EQ(RunWritingPages(*c, b, &bad), 0);
  const std::vector<HookCall> calls = hook.Take();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].digest, da[1]);
  EXPECT_EQ(calls[1].digest, da[0]);
  for (const HookCall& call : calls) {
    EXPECT_TRUE(call.whole_block);
    ASSERT_EQ(call.pages.size(), 1u);
    EXPECT_NE(call.pages[0], kInvalidPage);
    EXPECT_TRUE(call.bytes_intact) << "the hook saw a page that was no longer its block's";
  }
  EXPECT_EQ(Removed(log.Take()), (std::vector<BlockHash>{da[1].hash, da[0].hash}));
  EXPECT_EQ(c->Stats().evicted_blocks, calls.size());
  EXPECT_EQ(bad.load(), 0u);

  // A hit is not an eviction, and a freed block is not either.
  ASSERT_EQ(RunWritingPages(*c, b, &bad), 3);
  EXPECT_TRUE(hook.Take().empty());
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

// CacheManager::EvictAhead: the oldest cached blocks leave the cache and the index as in an
// eviction (events, statistics), whole, with their pages held for the taker and their bytes
// intact; the eviction hook is not called for them; a pool with enough pages free or held is
// left alone; an allocation short of pages waits for held ones rather than fail.
TEST(EvictAhead, HandsTheOldestBlocksOverWholeAndAnAllocationWaitsForThem) {
  auto c = MakeOneKindWithBytes(8);
  std::atomic<uint64_t> bad{0};
  HookLog hook(*c, /*check_bytes=*/false);
  EventLog log(*c);
  // Six full blocks and a partial one: freed tail first, so block 5 is the oldest cached one.
  const auto a = Prompt(26, 1);
  const auto da = Digests(*c, a);
  ASSERT_EQ(RunWritingPages(*c, a, &bad), 0);
  log.Take();
  ASSERT_EQ(c->pool(0).FreeCount(), 2u);

  std::vector<HeldBlock> held;
  auto take = [&](HeldBlock b) { held.push_back(std::move(b)); };
  EXPECT_EQ(c->EvictAhead(/*free_target=*/2, 10, take), 0u) << "two pages are free already";
  // Free 2 + held must reach 4: blocks 5 and 4 go, oldest first, and no more.
  EXPECT_EQ(c->EvictAhead(/*free_target=*/4, 10, take), 2u);
  EXPECT_EQ(c->EvictAhead(/*free_target=*/4, 10, take), 0u) << "held pages count as free";
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].digest, da[5]);
  EXPECT_EQ(held[1].digest, da[4]);
  for (const HeldBlock& h : held) {
    ASSERT_EQ(h.pages.size(), 1u);
    EXPECT_EQ(c->pool(0).State(h.pages[0]), PageState::kInUse);
    EXPECT_TRUE(HoldsPattern(c->pool(0).PageData(h.pages[0]), c->geometry().pools[0].block_stride,
                             PatternSeed(h.digest.hash, 0)));
  }
  EXPECT_TRUE(hook.Take().empty()) << "EvictAhead's blocks go to the taker, not the hook";
  EXPECT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString() << " (pages held)";
  EXPECT_EQ(Removed(log.Take()), (std::vector<BlockHash>{da[5].hash, da[4].hash}));
  EXPECT_EQ(c->Stats().evicted_blocks, 2u);
  PrefixQuery q;
  q.tokens = a;
  EXPECT_EQ(c->LookupPrefix(q)->blocks, 4u);

  // Eight pages: 2 free + 4 cached are not enough while 2 are held. The allocation waits.
  std::atomic<int> got{-2};
  std::thread t([&] { got = RunWritingPages(*c, Prompt(29, 2), &bad); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(got.load(), -2) << "the allocation did not wait for the held pages";
  // Still the blocks' bytes: nothing was handed out over them.
  for (const HeldBlock& h : held) {
    EXPECT_TRUE(HoldsPattern(c->pool(0).PageData(h.pages[0]), c->geometry().pools[0].block_stride,
                             PatternSeed(h.digest.hash, 0)));
  }
  for (const HeldBlock& h : held) c->ReleaseHeldBlock(h);
  t.join();
  EXPECT_EQ(got.load(), 0) << "the allocation failed instead of waiting";
  EXPECT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(c->pool(0).Stats().misuse, 0u);
  // Giving a block back twice is refused and counted, nothing else.
  c->ReleaseHeldBlock(held[0]);
  EXPECT_EQ(c->pool(0).Stats().misuse, 1u);
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

// An allocation that cannot be met even once every held page is back fails as before.
TEST(EvictAhead, AnAllocationThatHeldPagesCannotHelpFailsAtOnce) {
  auto c = MakeOneKindWithBytes(4);
  std::atomic<uint64_t> bad{0};
  ASSERT_EQ(RunWritingPages(*c, Prompt(8, 1), &bad), 0);  // 2 cached, 2 free
  std::vector<HeldBlock> held;
  EXPECT_EQ(c->EvictAhead(4, 1, [&](HeldBlock b) { held.push_back(std::move(b)); }), 1u);
  auto seq = c->CreateSequence();
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(c->AppendTokens(*seq, Prompt(40, 3)).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto slots = c->AllocateSlots(*seq, 40);  // 10 pages of a 4-page pool
  EXPECT_EQ(slots.status().code(), StatusCode::kResourceExhausted);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  ASSERT_TRUE(c->Free(*seq).ok());
  for (const HeldBlock& h : held) c->ReleaseHeldBlock(h);
  EXPECT_EQ(c->pool(0).Stats().used, 0u);
}

TEST(EvictHook, NeverCalledForUncachedBlocksNorReset) {
  auto c = MakeOneKindWithBytes(4);
  HookLog hook(*c, /*check_bytes=*/false);
  // Blocks of a sequence that does not cache, and uncommitted blocks, are freed, not evicted.
  SequenceOptions no_cache;
  no_cache.cache_blocks = false;
  for (uint32_t i = 0; i < 5; ++i) EXPECT_EQ(RunAndFree(*c, Prompt(16, 10 + i), no_cache), 0u);
  for (uint32_t i = 0; i < 5; ++i) {
    auto seq = c->CreateSequence();
    const auto p = Prompt(16, 20 + i);
    ASSERT_TRUE(c->AppendTokens(*seq, p).ok());
    ASSERT_TRUE(c->AllocateSlots(*seq, p.size()).ok());
    ASSERT_TRUE(c->CommitComputed(*seq, 7).ok());  // block 0 only; 1..3 never committed
    ASSERT_TRUE(c->Free(*seq).ok());
  }
  // Each round above evicted the previous round's block 0: four calls, one per eviction.
  EXPECT_EQ(hook.Take().size(), 4u);
  EXPECT_EQ(c->Stats().evicted_blocks, 4u);
  ASSERT_EQ(c->Stats().cached_blocks, 1u);
  ASSERT_TRUE(c->Reset().ok());
  EXPECT_EQ(RunAndFree(*c, Prompt(16, 30)), 0u);
  EXPECT_TRUE(hook.Take().empty()) << "Reset forgets blocks; it does not evict them";
}

TEST(EvictHook, ReplacedOrRemovedHookIsNotCalledAgain) {
  auto c = MakeOneKindWithBytes(2);
  int first = 0, second = 0;
  c->SetBlockEvictHook([&](const EvictingBlock&) { ++first; });
  // Two-block prompts in a two-page pool: each one evicts the previous one's blocks.
  EXPECT_EQ(RunAndFree(*c, Prompt(8, 1)), 0u);
  EXPECT_EQ(RunAndFree(*c, Prompt(8, 2)), 0u);
  EXPECT_EQ(first, 2);
  c->SetBlockEvictHook([&](const EvictingBlock&) { ++second; });
  EXPECT_EQ(RunAndFree(*c, Prompt(8, 3)), 0u);
  EXPECT_EQ(first, 2);
  EXPECT_EQ(second, 2);
  c->SetBlockEvictHook(nullptr);
  EXPECT_EQ(RunAndFree(*c, Prompt(8, 4)), 0u);
  EXPECT_EQ(second, 2);
  EXPECT_EQ(c->Stats().evicted_blocks, 6u);
}

std::vector<size_t> PoolsOf(const CacheManager& c, CacheKind kind) {
  std::vector<size_t> out;
  for (size_t q = 0; q < c.num_pools(); ++q) {
    if (c.geometry().pools[q].spec.kind == kind) out.push_back(q);
  }
  return out;
}

TEST(EvictHook, V4BlockLosingItsWindowPageFirstIsReportedCompleteThenWithoutIt) {
  constexpr uint32_t kBt = 128;
  CacheManagerOptions o;
  o.block_tokens = kBt;
  o.capacity_blocks = 8;
  o.window_capacity_blocks = 6;
  o.metadata_only = true;
  auto c = MakeCache(*ModelPreset("deepseek-v4-flash", KvPrecision::kFp8), o);
  ASSERT_EQ(c->num_pools(), 6u);
  const size_t w = PoolsOf(*c, CacheKind::kSwaWindow)[0];
  HookLog hook(*c, /*check_bytes=*/false);
  EventLog log(*c);
  const auto p = Prompt(4 * kBt + 1, 1);
  const auto d = Digests(*c, p);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  log.Take();
  // Window pool: blocks 2, 1, 0 went to the cache at commit, tail first; a three-block request
  // takes the two free pages and evicts block 2's window page. The block stays cached.
  EXPECT_EQ(RunAndFree(*c, Prompt(2 * kBt + 1, 2)), 0u);
  std::vector<HookCall> calls = hook.Take();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].digest, d[2]);
  EXPECT_FALSE(calls[0].whole_block);
  ASSERT_EQ(calls[0].pages.size(), 6u);
  for (PageId page : calls[0].pages) EXPECT_NE(page, kInvalidPage) << "still complete";
  EXPECT_EQ(Removed(log.Take()), std::vector<BlockHash>{d[2].hash});

  // A five-block request evicts full-history pages: p's blocks 3, 2, 1 (released at Free, tail
  // first). Block 2 is reported again, now without its window page.
  EXPECT_EQ(RunAndFree(*c, Prompt(4 * kBt + 1, 3)), 0u);
  calls = hook.Take();
  const std::vector<BlockHash> removed = Removed(log.Take());
  ASSERT_EQ(calls.size(), removed.size());
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i].digest.hash, removed[i]) << i;
  uint64_t whole = 0;
  bool saw_block_2 = false;
  for (const HookCall& call : calls) {
    whole += call.whole_block;
    if (call.digest == d[2]) {
      saw_block_2 = true;
      EXPECT_TRUE(call.whole_block);
      EXPECT_EQ(call.pages[w], kInvalidPage);
      for (size_t q : PoolsOf(*c, CacheKind::kCsaCompressed)) EXPECT_NE(call.pages[q], kInvalidPage);
    }
  }
  EXPECT_TRUE(saw_block_2);
  EXPECT_EQ(whole, c->Stats().evicted_blocks);
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

// Several threads allocate, hit and evict while the hook checks every evicted block's bytes
// against what the engine wrote, and another thread keeps replacing the hook. Under TSan this
// also checks that the hook's reads are ordered after the engine's writes and before the next
// holder's.
TEST(EvictHook, ThreadsEvictingWhileTheHookReadsPages) {
  auto c = MakeOneKindWithBytes(40);
  std::atomic<uint64_t> calls{0}, torn{0}, bad_hits{0}, hits{0};
  auto make_hook = [&]() -> BlockEvictHook {
    return [&](const EvictingBlock& e) {
      ++calls;
      if (e.pages[0] == kInvalidPage ||
          !HoldsPattern(c->pool(0).PageData(e.pages[0]), c->geometry().pools[0].block_stride,
                        PatternSeed(e.digest.hash, 0))) {
        ++torn;
      }
    };
  };
  c->SetBlockEvictHook(make_hook());
#if SPARSEKV_TSAN
  constexpr int kIterations = 600;
#else
  constexpr int kIterations = 3000;
#endif
  constexpr int kThreads = 4;
  std::atomic<bool> stop{false};
  std::latch start(kThreads + 1);
  std::vector<std::thread> ts;
  for (int id = 0; id < kThreads; ++id) {
    ts.emplace_back([&, id] {
      std::mt19937 rng(77 + id);
      start.arrive_and_wait();
      for (int it = 0; it < kIterations; ++it) {
        auto tokens = Prompt(8, rng() % 6);  // shared two-block system prompts
        const auto user = Prompt(1 + rng() % 12, 1000 + rng() % 40);
        tokens.insert(tokens.end(), user.begin(), user.end());
        const int h = RunWritingPages(*c, tokens, &bad_hits);
        if (h > 0) hits += static_cast<uint64_t>(h);
      }
    });
  }
  std::thread replacer([&] {
    start.arrive_and_wait();
    while (!stop.load()) {
      c->SetBlockEvictHook(make_hook());
      std::this_thread::yield();
    }
  });
  for (auto& t : ts) t.join();
  stop = true;
  replacer.join();
  c->SetBlockEvictHook(nullptr);
  const CacheStats s = c->Stats();
  EXPECT_EQ(s.internal_errors, 0u) << s.first_internal_error;
  EXPECT_GT(s.evicted_blocks, 0u);
  EXPECT_GT(hits.load(), 0u);
  // Every eviction reached a hook (replacing it never loses a call), and saw intact bytes.
  EXPECT_EQ(calls.load(), s.evicted_blocks);
  EXPECT_EQ(torn.load(), 0u);
  EXPECT_EQ(bad_hits.load(), 0u);
}

}  // namespace
}  // namespace sparsekv
