// The resumable-prefix rule on DeepSeek-V4-Flash (window 128 tokens, compressor snapshots),
// with 128-token blocks: a prefix of k blocks hits only if the full-history kinds of blocks
// 0..k-1, the window page of block k-1 and the compressor snapshot of block k-1 are cached.
#include <gtest/gtest.h>

#include "sparsekv/cache_manager.h"
#include "tests/cache/cache_test_util.h"

namespace sparsekv {
namespace {

using testing::EventLog;
using testing::MakeCache;
using testing::Prompt;
using testing::RunAndFree;
using testing::RunPrompt;
using testing::Table;

constexpr uint32_t kBt = 128;

std::unique_ptr<CacheManager> MakeV4(uint32_t capacity, uint32_t window_capacity = 0,
                                     uint32_t state_capacity = 0) {
  CacheManagerOptions o;
  o.block_tokens = kBt;
  o.capacity_blocks = capacity;
  o.window_capacity_blocks = window_capacity;
  o.state_capacity_blocks = state_capacity;
  o.metadata_only = true;
  return MakeCache(*ModelPreset("deepseek-v4-flash", KvPrecision::kFp8), o);
}

std::vector<size_t> PoolsOf(const CacheManager& c, CacheKind kind) {
  std::vector<size_t> out;
  for (size_t q = 0; q < c.num_pools(); ++q) {
    if (c.geometry().pools[q].spec.kind == kind) out.push_back(q);
  }
  return out;
}

uint32_t Hit(const CacheManager& c, const std::vector<TokenId>& p, size_t tokens) {
  PrefixQuery q;
  q.tokens = std::span<const TokenId>(p).subspan(0, tokens);
  return c.LookupPrefix(q)->blocks;
}

KindSet AllV4Kinds() {
  KindSet k;
  for (CacheKind kind : {CacheKind::kSwaWindow, CacheKind::kCsaCompressed, CacheKind::kIndexerKey,
                         CacheKind::kCompressorState, CacheKind::kHcaCompressed}) {
    k.Add(kind);
  }
  return k;
}

TEST(ResumablePrefix, V4HasSixPoolsInThreeRoles) {
  auto c = MakeV4(8);
  ASSERT_EQ(c->num_pools(), 6u);
  EXPECT_EQ(PoolsOf(*c, CacheKind::kSwaWindow).size(), 1u);
  EXPECT_EQ(PoolsOf(*c, CacheKind::kCompressorState).size(), 2u);  // CSA and HCA snapshots
}

TEST(ResumablePrefix, RunningSequenceReleasesWindowAndSnapshotPagesEarly) {
  auto c = MakeV4(16);
  const auto p = Prompt(4 * kBt + 1, 1);
  const SequenceId a = RunPrompt(*c, p);
  const size_t w = PoolsOf(*c, CacheKind::kSwaWindow)[0];
  const auto window = Table(*c, a, w);
  ASSERT_EQ(window.size(), 5u);
  // The next token (513) attends to tokens 385..512: blocks 3 and 4 only.
  for (int b = 0; b < 3; ++b) EXPECT_EQ(window[b], kInvalidPage) << b;
  EXPECT_NE(window[3], kInvalidPage);
  EXPECT_NE(window[4], kInvalidPage);
  for (size_t q : PoolsOf(*c, CacheKind::kCompressorState)) {
    const auto state = Table(*c, a, q);
    for (int b = 0; b < 4; ++b)
      EXPECT_EQ(state[b], kInvalidPage) << b;  // running state is in block 4
    EXPECT_NE(state[4], kInvalidPage);
  }
  for (size_t q : PoolsOf(*c, CacheKind::kCsaCompressed)) {
    for (PageId page : Table(*c, a, q)) EXPECT_NE(page, kInvalidPage);
  }
  // Registered blocks' released pages stay cached: a later request can resume at them.
  EXPECT_EQ(c->pool(w).Stats().cached, 3u);
  EXPECT_EQ(c->Stats().early_released_pages, 3u + 2 * 4u);
  EXPECT_EQ(Hit(*c, p, 2 * kBt + 1), 2u);
  EXPECT_EQ(Hit(*c, p, 3 * kBt + 1), 3u);
  EXPECT_EQ(Hit(*c, p, p.size()), 4u);
  ASSERT_TRUE(c->Free(a).ok());

  // Without caching they are freed at once.
  SequenceOptions no_cache;
  no_cache.cache_blocks = false;
  auto d = MakeV4(16);
  const SequenceId b = RunPrompt(*d, Prompt(4 * kBt + 1, 2), nullptr, no_cache);
  EXPECT_EQ(d->pool(w).Stats().cached, 0u);
  EXPECT_EQ(d->pool(w).Stats().used, 2u);
  ASSERT_TRUE(d->Free(b).ok());
  EXPECT_EQ(d->Stats().internal_errors, 0u) << d->Stats().first_internal_error;
}

TEST(ResumablePrefix, NoHitAtABoundaryWhoseWindowPageWasEvicted) {
  auto c = MakeV4(16, /*window_capacity=*/6);
  EventLog log(*c);
  const auto p = Prompt(4 * kBt + 1, 1);
  std::vector<BlockDigest> d;
  c->hasher().HashFullBlocks(c->hasher().Root(""), p, "", &d);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  log.Take();
  // Window pool: blocks 2, 1, 0 were released at commit (tail first), then block 3 at the end;
  // two pages are free. A three-block request evicts one window page: block 2's.
  EXPECT_EQ(RunAndFree(*c, Prompt(2 * kBt + 1, 2)), 0u);
  const auto ev = log.Take();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[0].kinds, KindSet::Of(CacheKind::kSwaWindow));
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{d[2].hash});
  EXPECT_EQ(c->Stats().evicted_boundary_pages, 1u);
  EXPECT_EQ(c->Stats().evicted_blocks, 0u);

  // Resuming at token 384 needs tokens 256..383 of the window: gone. The hit stops before.
  PrefixQuery q;
  q.tokens = std::span<const TokenId>(p).subspan(0, 3 * kBt + 1);
  const PrefixMatch m = *c->LookupPrefix(q);
  EXPECT_EQ(m.blocks, 2u);
  EXPECT_EQ(m.chain_blocks, 3u);  // block 2's full-history pages are still there
  PrefixMatch got;
  const SequenceId s =
      RunPrompt(*c, std::vector<TokenId>(p.begin(), p.begin() + 3 * kBt + 1), &got);
  EXPECT_EQ(got.blocks, 2u);
  ASSERT_TRUE(c->Free(s).ok());
  // That request computed block 2 again; the cached block took its window page back.
  EXPECT_EQ(c->Stats().repaired_blocks, 1u);
  EXPECT_EQ(Hit(*c, p, 3 * kBt + 1), 3u);
  // Resuming at token 512 needs only block 3's window and snapshot, which are there: the window
  // of block 2 is outside the last 128 tokens.
  EXPECT_EQ(Hit(*c, p, p.size()), 4u);
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

TEST(ResumablePrefix, NoHitAtABoundaryWhoseSnapshotWasEvicted) {
  auto c = MakeV4(16, /*window_capacity=*/0, /*state_capacity=*/6);
  EventLog log(*c);
  const auto p = Prompt(4 * kBt + 1, 1);
  std::vector<BlockDigest> d;
  c->hasher().HashFullBlocks(c->hasher().Root(""), p, "", &d);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  log.Take();
  // Snapshot pools: blocks 3, 2, 1, 0 were released at commit, block 4 (the running state) freed
  // at the end. A three-block request evicts block 3's snapshot, in both snapshot pools.
  EXPECT_EQ(RunAndFree(*c, Prompt(2 * kBt + 1, 2)), 0u);
  const auto ev = log.Take();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[0].kinds, KindSet::Of(CacheKind::kCompressorState));
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{d[3].hash});
  EXPECT_EQ(c->Stats().evicted_boundary_pages, 2u);
  for (size_t q : PoolsOf(*c, CacheKind::kCompressorState))
    EXPECT_EQ(c->pool(q).Stats().cached, 5u) << q;

  EXPECT_EQ(Hit(*c, p, p.size()), 3u);     // no hit past block 3, whose snapshot is gone
  const auto longer = Prompt(6 * kBt, 1);  // the same first 513 tokens, and more
  EXPECT_EQ(Hit(*c, longer, longer.size()), 3u);
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

TEST(ResumablePrefix, FullHistoryEvictionRemovesEveryKindOfTheBlock) {
  auto c = MakeV4(6);
  EventLog log(*c);
  const auto p = Prompt(4 * kBt + 1, 1);
  std::vector<BlockDigest> d;
  c->hasher().HashFullBlocks(c->hasher().Root(""), p, "", &d);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  log.Take();
  EXPECT_EQ(RunAndFree(*c, Prompt(2 * kBt + 1, 2)), 0u);
  const auto ev = log.Take();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[0].kinds, AllV4Kinds());
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{d[3].hash});
  EXPECT_EQ(c->Stats().evicted_blocks, 1u);
  EXPECT_EQ(Hit(*c, p, p.size()), 3u);
  for (size_t q = 0; q < c->num_pools(); ++q) {
    EXPECT_EQ(c->pool(q).Stats().used, 0u) << q;
    EXPECT_EQ(c->pool(q).Stats().misuse, 0u) << q;
  }
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

TEST(ResumablePrefix, StoredEventsCarryEveryKind) {
  auto c = MakeV4(8);
  EventLog log(*c);
  EXPECT_EQ(RunAndFree(*c, Prompt(2 * kBt + 1, 1)), 0u);
  const auto ev = log.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kinds, AllV4Kinds());
  EXPECT_EQ(ev[0].block_tokens, kBt);
  EXPECT_EQ(ev[0].kinds.ToString(),
            "indexer_key,csa_compressed,hca_compressed,swa_window,compressor_state");
}

TEST(ResumablePrefix, NewBlocksStartFromThePreviousSnapshot) {
  auto c = MakeV4(8);
  auto s = c->CreateSequence();
  ASSERT_TRUE(c->AppendTokens(*s, Prompt(300, 1)).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*s).ok());
  auto first = c->AllocateSlots(*s, kBt);
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->copies.empty());  // block 0 starts from the initial state
  ASSERT_TRUE(c->CommitComputed(*s, kBt).ok());
  auto next = c->AllocateSlots(*s, 300);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->first_new_block, 1u);
  EXPECT_EQ(next->new_blocks, 2u);
  const auto state_pools = PoolsOf(*c, CacheKind::kCompressorState);
  ASSERT_EQ(next->copies.size(), state_pools.size());
  for (size_t i = 0; i < state_pools.size(); ++i) {
    const auto& cp = next->copies[i];
    const auto table = Table(*c, *s, state_pools[i]);
    EXPECT_EQ(cp.reason, CopyReason::kCarryState);
    EXPECT_EQ(cp.pool, state_pools[i]);
    EXPECT_EQ(cp.src, table[0]);
    EXPECT_EQ(cp.dst, table[1]);
  }
  ASSERT_TRUE(c->CommitComputed(*s, 300).ok());
  ASSERT_TRUE(c->Free(*s).ok());

  // A sequence resuming from the cache starts from the cached snapshot the same way.
  auto r = c->CreateSequence();
  ASSERT_TRUE(c->AppendTokens(*r, Prompt(300, 1)).ok());
  EXPECT_EQ(c->AcquireCachedPrefix(*r)->blocks, 2u);
  const auto cached_state = Table(*c, *r, state_pools[0]);
  ASSERT_EQ(cached_state.size(), 2u);
  EXPECT_EQ(cached_state[0], kInvalidPage);  // only the snapshot at the boundary is taken
  auto resume = c->AllocateSlots(*r, 300);
  ASSERT_TRUE(resume.ok());
  ASSERT_FALSE(resume->copies.empty());
  EXPECT_EQ(resume->copies[0].src, cached_state[1]);
  ASSERT_TRUE(c->Free(*r).ok());
  EXPECT_EQ(c->Stats().internal_errors, 0u) << c->Stats().first_internal_error;
}

// A restore from history records (offloaded_cache.h): blocks whose window and state nobody will
// read get no such pages, so a long prefix restores into boundary pools of two pages; committed,
// it is a resume point at its end only. TrimSlots gives back what a failed restore took, and
// CheckInvariants still catches a commit at an edge whose pages are missing.
TEST(ResumablePrefix, RestoreSlotsSkipBoundaryPagesAndTrimGivesThemBack) {
  auto c = MakeV4(16, /*window_capacity=*/2, /*state_capacity=*/2);
  const size_t w = PoolsOf(*c, CacheKind::kSwaWindow)[0];
  const auto states = PoolsOf(*c, CacheKind::kCompressorState);
  const auto p = Prompt(10 * kBt + 5, 7);
  SequenceId a = c->CreateSequence().value();
  ASSERT_TRUE(c->AppendTokens(a, p).ok());
  ASSERT_TRUE(c->AcquireResumePrefix(a, 10).ok());
  // Plain slots for ten blocks would need ten window pages; two exist.
  EXPECT_TRUE(c->AllocateSlots(a, 10 * kBt).status().Is(StatusCode::kResourceExhausted));
  auto alloc = c->AllocateRestoreSlots(a, 10 * kBt, BoundarySkip{9, 9});
  ASSERT_TRUE(alloc.ok()) << alloc.status().ToString();
  EXPECT_EQ(alloc->new_blocks, 10u);
  for (size_t q : std::vector<size_t>{w, states[0], states[1]}) {
    const auto t = Table(*c, a, q);
    ASSERT_EQ(t.size(), 10u);
    for (uint32_t b = 0; b < 9; ++b) EXPECT_EQ(t[b], kInvalidPage) << "pool " << q << " block " << b;
    EXPECT_NE(t[9], kInvalidPage);
  }
  for (PageId page : Table(*c, a, PoolsOf(*c, CacheKind::kCsaCompressed)[0])) EXPECT_NE(page, kInvalidPage);
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString();
  ASSERT_TRUE(c->CommitComputed(a, 10 * kBt).ok());
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString();
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_EQ(Hit(*c, p, p.size()), 10u);      // its end is a resume point
  EXPECT_EQ(Hit(*c, p, 5 * kBt + 1), 0u);    // no edge before it is

  // A restore that stops short: its slots go back, every pool's pages free again.
  const auto q = Prompt(6 * kBt, 8);
  SequenceId b = c->CreateSequence().value();
  ASSERT_TRUE(c->AppendTokens(b, q).ok());
  const uint32_t free_before = c->pool(w).Stats().free;
  ASSERT_TRUE(c->AllocateRestoreSlots(b, 6 * kBt, BoundarySkip{5, 5}).ok());
  EXPECT_EQ(c->pool(w).Stats().free + 1, free_before);
  ASSERT_TRUE(c->TrimSlots(b).ok());
  EXPECT_EQ(c->GetSequenceInfo(b)->blocks, 0u);
  EXPECT_EQ(c->GetSequenceInfo(b)->slot_tokens, 0u);
  EXPECT_EQ(c->pool(w).Stats().free, free_before);
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString();
  // and it can be computed as any sequence.
  ASSERT_TRUE(c->AllocateSlots(b, kBt + 1).ok());
  ASSERT_TRUE(c->CommitComputed(b, kBt + 1).ok());
  ASSERT_TRUE(c->CheckInvariants().ok()) << c->CheckInvariants().ToString();
  ASSERT_TRUE(c->Free(b).ok());

  // Committing at an edge whose window and state pages were skipped is caught.
  SequenceId d = c->CreateSequence().value();
  ASSERT_TRUE(c->AppendTokens(d, Prompt(4 * kBt, 9)).ok());
  ASSERT_TRUE(c->AllocateRestoreSlots(d, 4 * kBt, BoundarySkip{3, 3}).ok());
  ASSERT_TRUE(c->CommitComputed(d, 2 * kBt).ok());
  EXPECT_FALSE(c->CheckInvariants().ok());
}

}  // namespace
}  // namespace sparsekv
