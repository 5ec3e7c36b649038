#include "sparsekv/cache_manager.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "tests/cache/cache_test_util.h"

namespace sparsekv {
namespace {

using testing::Concat;
using testing::EventLog;
using testing::MakeCache;
using testing::MakeOneKind;
using testing::OneKindSpec;
using testing::Prompt;
using testing::RunAndFree;
using testing::RunPrompt;
using testing::Table;

std::vector<TokenId> Head(const std::vector<TokenId>& t, size_t n) {
  return {t.begin(), t.begin() + n};
}

PrefixMatch Lookup(const CacheManager& c, std::span<const TokenId> tokens,
                   std::string_view salt = "") {
  PrefixQuery q;
  q.namespace_salt = salt;
  q.tokens = tokens;
  auto m = c.LookupPrefix(q);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : PrefixMatch{};
}

std::vector<BlockDigest> Digests(const CacheManager& c, std::span<const TokenId> tokens,
                                 std::string_view salt = "") {
  std::vector<BlockDigest> d;
  c.hasher().HashFullBlocks(c.hasher().Root(salt), tokens, "", &d);
  return d;
}

void ExpectHealthy(const CacheManager& c) {
  EXPECT_EQ(c.Stats().internal_errors, 0u) << c.Stats().first_internal_error;
  for (size_t q = 0; q < c.num_pools(); ++q)
    EXPECT_EQ(c.pool(q).Stats().misuse, 0u) << "pool " << q;
}

// ---------------------------------------------------------------------------------------------
// Hits

TEST(CacheManager, SharedPrefixHitsWhileTheFirstRequestStillHoldsIt) {
  auto c = MakeOneKind(16);
  const auto p = Prompt(13, 1);  // three full blocks of 4 and one token
  const SequenceId a = RunPrompt(*c, p);
  PrefixMatch hit;
  const SequenceId b = RunPrompt(*c, p, &hit);
  EXPECT_EQ(hit.blocks, 3u);
  EXPECT_EQ(hit.tokens, 12u);
  const auto ta = Table(*c, a), tb = Table(*c, b);
  ASSERT_EQ(ta.size(), 4u);
  ASSERT_EQ(tb.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ta[i], tb[i]);
    EXPECT_EQ(c->pool(0).RefCount(ta[i]), 2u);
  }
  EXPECT_NE(ta[3], tb[3]);  // partial blocks are never shared
  auto info = c->GetSequenceInfo(b);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->computed_tokens, 13u);
  EXPECT_EQ(info->cached_blocks, 3u);
  const CacheStats s = c->Stats();
  EXPECT_EQ(s.lookups, 2u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hit_tokens, 12u);
  EXPECT_EQ(s.lookup_tokens, 26u);
  ASSERT_TRUE(c->Free(a).ok());
  ASSERT_TRUE(c->Free(b).ok());
  EXPECT_EQ(c->pool(0).Stats().used, 0u);
  EXPECT_EQ(c->pool(0).Stats().cached, 3u);
  ExpectHealthy(*c);
}

TEST(CacheManager, FreedCachedBlocksStayFindableAndAreTakenBack) {
  auto c = MakeOneKind(16);
  const auto p = Prompt(13, 1);
  const SequenceId a = RunPrompt(*c, p);
  const auto ta = Table(*c, a);
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_EQ(c->pool(0).Stats().cached, 3u);
  EXPECT_EQ(c->pool(0).Stats().free, 13u);  // the partial block's page is free at once
  PrefixMatch hit;
  const SequenceId b = RunPrompt(*c, p, &hit);
  EXPECT_EQ(hit.blocks, 3u);
  const auto tb = Table(*c, b);
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 3, tb.begin()));
  EXPECT_EQ(c->pool(0).Stats().cached, 0u);
  ASSERT_TRUE(c->Free(b).ok());
  ExpectHealthy(*c);
}

TEST(CacheManager, AtLeastOnePromptTokenIsComputed) {
  auto c = MakeOneKind(16);
  const auto p = Prompt(12, 2);  // exactly three blocks
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  EXPECT_EQ(Lookup(*c, p).blocks, 2u);
  PrefixQuery whole;
  whole.tokens = p;
  whole.leave_last_token = false;
  EXPECT_EQ(c->LookupPrefix(whole)->blocks, 3u);
  EXPECT_EQ(RunAndFree(*c, p), 2u);  // the last block is computed again...
  EXPECT_EQ(c->Stats().duplicate_blocks, 1u);
  EXPECT_EQ(c->pool(0).Stats().cached, 3u);  // ...and its copy is not cached twice
  EXPECT_EQ(Lookup(*c, Prompt(1, 2)).blocks, 0u);
  ExpectHealthy(*c);
}

TEST(CacheManager, DecodedTokensRegisterTheBlocksTheyComplete) {
  auto c = MakeOneKind(16);
  const auto full = Prompt(9, 3);
  auto seq = c->CreateSequence();
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(c->AppendTokens(*seq, Head(full, 5)).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*seq).ok());
  ASSERT_TRUE(c->AllocateSlots(*seq, 5).ok());
  ASSERT_TRUE(c->CommitComputed(*seq, 5).ok());
  EXPECT_EQ(c->Stats().stored_blocks, 1u);
  for (size_t n = 6; n <= 9; ++n) {  // one token at a time, across the block boundary
    ASSERT_TRUE(c->AppendTokens(*seq, std::span<const TokenId>(full).subspan(n - 1, 1)).ok());
    ASSERT_TRUE(c->AllocateSlots(*seq, n).ok());
    ASSERT_TRUE(c->CommitComputed(*seq, n).ok());
  }
  EXPECT_EQ(c->Stats().stored_blocks, 2u);
  EXPECT_EQ(Lookup(*c, full).blocks, 2u);
  EXPECT_EQ(Table(*c, *seq).size(), 3u);
  ASSERT_TRUE(c->Free(*seq).ok());
  ExpectHealthy(*c);
}

// ---------------------------------------------------------------------------------------------
// Eviction

TEST(CacheManager, EvictionTakesHashlessPagesFirstThenCachedTailsFirst) {
  auto c = MakeOneKind(6);
  EventLog log(*c);
  const auto a = Prompt(17, 1);  // four full blocks and a partial one: five pages
  const auto da = Digests(*c, a);
  EXPECT_EQ(RunAndFree(*c, a), 0u);
  EXPECT_EQ(c->pool(0).Stats().free, 2u);  // never used, and the partial block's
  EXPECT_EQ(c->pool(0).Stats().cached, 4u);
  log.Take();

  // Three pages: the two free ones, then the least recently released cached one, A's tail.
  EXPECT_EQ(RunAndFree(*c, Prompt(9, 2)), 0u);
  auto ev = log.Take();
  ASSERT_EQ(ev.size(), 2u);  // removed, then the new request's stored blocks
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{da[3].hash});
  EXPECT_EQ(c->Stats().evicted_blocks, 1u);
  EXPECT_EQ(Lookup(*c, a).blocks, 3u);  // the shared prefix outlives the tail

  // Next: one free page, then A's blocks 2 and 1, tail first.
  EXPECT_EQ(RunAndFree(*c, Prompt(9, 3)), 0u);
  ev = log.Take();
  ASSERT_GE(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[0].block_hashes, (std::vector<BlockHash>{da[2].hash, da[1].hash}));
  EXPECT_EQ(Lookup(*c, a).blocks, 1u);
  ExpectHealthy(*c);
}

TEST(CacheManager, FailedAllocationChangesNothing) {
  auto c = MakeOneKind(6);
  EventLog log(*c);
  const auto cached = Prompt(9, 1);
  EXPECT_EQ(RunAndFree(*c, cached), 0u);                  // 2 cached, 4 free
  const SequenceId holder = RunPrompt(*c, Prompt(9, 2));  // 3 in use: 2 cached + 1 free left
  const PagePoolStats before = c->pool(0).Stats();
  const CacheStats cs_before = c->Stats();
  log.Take();

  auto x = c->CreateSequence();
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(c->AppendTokens(*x, Prompt(17, 3)).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*x).ok());
  auto slots = c->AllocateSlots(*x, 17);  // five pages, three available
  ASSERT_FALSE(slots.ok());
  EXPECT_EQ(slots.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(slots.status().retryable());
  EXPECT_NE(slots.status().message().find("nothing was allocated or evicted"),
            std::string_view::npos);

  const PagePoolStats after = c->pool(0).Stats();
  EXPECT_EQ(after.free, before.free);
  EXPECT_EQ(after.cached, before.cached);
  EXPECT_EQ(after.used, before.used);
  EXPECT_EQ(after.evictions, before.evictions);
  EXPECT_EQ(c->Stats().evicted_blocks, cs_before.evicted_blocks);
  EXPECT_EQ(c->Stats().failed_allocations, cs_before.failed_allocations + 1);
  EXPECT_TRUE(log.Take().empty());
  EXPECT_EQ(c->GetSequenceInfo(*x)->blocks, 0u);
  EXPECT_EQ(Lookup(*c, cached).blocks, 2u);

  // A request that fits still goes through afterwards.
  auto fits = c->AllocateSlots(*x, 8);
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ(fits->new_blocks, 2u);
  ASSERT_TRUE(c->Free(*x).ok());
  ASSERT_TRUE(c->Free(holder).ok());
  ExpectHealthy(*c);
}

// ---------------------------------------------------------------------------------------------
// Isolation and duplicates

TEST(CacheManager, NamespacesAndExtraKeysIsolate) {
  auto c = MakeOneKind(32);
  const auto p = Prompt(9, 1);
  SequenceOptions a, b, a_lora;
  a.namespace_salt = "tenant-a";
  b.namespace_salt = "tenant-b";
  a_lora.namespace_salt = "tenant-a";
  a_lora.extra_keys = "lora-1";
  EXPECT_EQ(RunAndFree(*c, p, a), 0u);
  EXPECT_EQ(RunAndFree(*c, p, b), 0u);  // same tokens, other namespace: no hit
  EXPECT_EQ(RunAndFree(*c, p, a), 2u);
  EXPECT_EQ(RunAndFree(*c, p, a_lora), 0u);
  EXPECT_EQ(RunAndFree(*c, p), 0u);  // the default namespace is a namespace too
  EXPECT_EQ(Lookup(*c, p, "tenant-b").blocks, 2u);
  EXPECT_EQ(Lookup(*c, p, "tenant-c").blocks, 0u);
  ExpectHealthy(*c);
}

TEST(CacheManager, DuplicateContentInTwoBlocksIsTwoBlocks) {
  auto c = MakeOneKind(32);
  EventLog log(*c);
  std::vector<TokenId> p;
  for (int b = 0; b < 3; ++b) p.insert(p.end(), {5, 5, 5, 5});
  p.push_back(9);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  EXPECT_EQ(c->Stats().stored_blocks, 3u);
  auto ev = log.Take();
  ASSERT_EQ(ev.size(), 1u);
  ASSERT_EQ(ev[0].block_hashes.size(), 3u);
  EXPECT_NE(ev[0].block_hashes[0], ev[0].block_hashes[1]);
  EXPECT_NE(ev[0].block_hashes[1], ev[0].block_hashes[2]);
  EXPECT_EQ(RunAndFree(*c, p), 3u);
  ExpectHealthy(*c);
}

TEST(CacheManager, TheSameBlockComputedTwiceIsCachedOnce) {
  auto c = MakeOneKind(32);
  EventLog log(*c);
  const auto q = Prompt(9, 7);
  // Both look up before either commits, as two requests in one batch would.
  SequenceId s[2];
  for (SequenceId& id : s) {
    id = *c->CreateSequence();
    ASSERT_TRUE(c->AppendTokens(id, q).ok());
    EXPECT_EQ(c->AcquireCachedPrefix(id)->blocks, 0u);
    ASSERT_TRUE(c->AllocateSlots(id, q.size()).ok());
  }
  ASSERT_TRUE(c->CommitComputed(s[0], q.size()).ok());
  ASSERT_TRUE(c->CommitComputed(s[1], q.size()).ok());
  EXPECT_EQ(c->Stats().stored_blocks, 2u);
  EXPECT_EQ(c->Stats().duplicate_blocks, 2u);
  EXPECT_EQ(log.Take().size(), 1u);
  const auto t0 = Table(*c, s[0]);
  ASSERT_TRUE(c->Free(s[0]).ok());
  ASSERT_TRUE(c->Free(s[1]).ok());
  EXPECT_EQ(c->pool(0).Stats().cached, 2u);  // the second copy went back to the free list
  PrefixMatch hit;
  const SequenceId again = RunPrompt(*c, q, &hit);
  EXPECT_EQ(hit.blocks, 2u);
  EXPECT_EQ(Table(*c, again)[0], t0[0]);
  ASSERT_TRUE(c->Free(again).ok());
  ExpectHealthy(*c);
}

// ---------------------------------------------------------------------------------------------
// Reset, lookups, statistics

TEST(CacheManager, ResetIsRefusedWhilePagesAreInUse) {
  auto c = MakeOneKind(16);
  EventLog log(*c);
  const auto p = Prompt(9, 1);
  const SequenceId a = RunPrompt(*c, p);
  Status st = c->Reset();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("1 sequences hold pages"), std::string_view::npos);
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_EQ(Lookup(*c, p).blocks, 2u);  // nothing was cleared

  auto idle = c->CreateSequence();  // a sequence without pages does not block a reset
  ASSERT_TRUE(idle.ok());
  ASSERT_TRUE(c->AppendTokens(*idle, p).ok());
  log.Take();
  ASSERT_TRUE(c->Reset().ok());
  EXPECT_EQ(Lookup(*c, p).blocks, 0u);
  EXPECT_EQ(c->pool(0).Stats().cached, 0u);
  EXPECT_EQ(c->pool(0).Stats().free, 16u);
  EXPECT_EQ(c->Stats().cached_blocks, 0u);
  auto ev = log.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEventType::kAllCleared);
  EXPECT_EQ(RunAndFree(*c, p), 0u);  // and the cache works afterwards
  EXPECT_EQ(RunAndFree(*c, p), 2u);
  ExpectHealthy(*c);
}

TEST(CacheManager, LookupIsReadOnlyAndCollisionsAreCaughtByTheCheck) {
  auto c = MakeOneKind(16);
  const auto p = Prompt(9, 1);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  const uint64_t lookups = c->Stats().lookups;
  EXPECT_EQ(Lookup(*c, p).blocks, 2u);
  EXPECT_EQ(c->Stats().lookups, lookups);
  EXPECT_EQ(c->pool(0).Stats().cached, 2u);  // no reference taken

  auto d = Digests(*c, p);
  EXPECT_EQ(c->LookupDigests(d, p.size()).blocks, 2u);
  EXPECT_EQ(c->LookupDigests(d, 0).blocks, 2u);
  EXPECT_EQ(c->LookupDigests(d, 8).blocks, 1u);  // a prompt of exactly two blocks
  d[1].check.lo ^= 1;  // same key, other content: a collision of the 128-bit key
  const PrefixMatch m = c->LookupDigests(d, p.size());
  EXPECT_EQ(m.blocks, 1u);
  EXPECT_EQ(m.chain_blocks, 1u);
  EXPECT_EQ(c->Stats().hash_collisions, 1u);
  ExpectHealthy(*c);
}

TEST(CacheManager, StatisticsAndTheRecentHitRatio) {
  CacheManagerOptions o;
  o.block_tokens = 4;
  o.capacity_blocks = 16;
  o.metadata_only = true;
  o.stats_window_requests = 2;
  auto c = MakeCache(OneKindSpec(), o);
  const auto p = Prompt(9, 1);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  EXPECT_EQ(c->Stats().recent_token_hit_ratio, 0.0);
  EXPECT_EQ(RunAndFree(*c, p), 2u);
  EXPECT_DOUBLE_EQ(c->Stats().recent_token_hit_ratio, 8.0 / 18.0);
  EXPECT_EQ(RunAndFree(*c, p), 2u);
  const CacheStats s = c->Stats();
  EXPECT_DOUBLE_EQ(s.recent_token_hit_ratio, 16.0 / 18.0);  // the miss left the window
  EXPECT_EQ(s.recent_lookups, 2u);
  EXPECT_EQ(s.lookups, 3u);
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hit_blocks, 4u);
  EXPECT_EQ(s.lookup_tokens, 27u);
  EXPECT_EQ(s.stored_blocks, 2u);
  EXPECT_EQ(s.cached_blocks, 2u);
  EXPECT_EQ(s.sequences, 0u);
}

TEST(CacheManager, EventsAreDeliveredInOrder) {
  auto c = MakeOneKind(4);
  EventLog log(*c);
  const auto a = Prompt(9, 1);
  const auto da = Digests(*c, a);
  EXPECT_EQ(RunAndFree(*c, a), 0u);              // stored a0 a1
  EXPECT_EQ(RunAndFree(*c, Prompt(13, 2)), 0u);  // evicts a1 a0, stores three
  ASSERT_TRUE(c->Reset().ok());
  const auto ev = log.Take();
  ASSERT_EQ(ev.size(), 4u);
  for (size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i].sequence_number, ev[0].sequence_number + i);
    EXPECT_EQ(ev[i].block_tokens, 4u);
  }
  EXPECT_EQ(ev[0].type, KvEventType::kBlocksStored);
  EXPECT_EQ(ev[0].block_hashes, (std::vector<BlockHash>{da[0].hash, da[1].hash}));
  EXPECT_EQ(ev[0].parent_hash, c->hasher().Root("").hash);
  EXPECT_EQ(ev[0].kinds, KindSet::Of(CacheKind::kMlaLatent));
  EXPECT_EQ(ev[1].type, KvEventType::kBlocksRemoved);
  EXPECT_EQ(ev[1].block_hashes, (std::vector<BlockHash>{da[1].hash, da[0].hash}));
  EXPECT_EQ(ev[2].type, KvEventType::kBlocksStored);
  EXPECT_EQ(ev[2].block_hashes.size(), 3u);
  EXPECT_EQ(ev[3].type, KvEventType::kAllCleared);
  EXPECT_EQ(KvEventTypeName(ev[3].type), "all_cleared");
  EXPECT_EQ(c->Stats().events, 4u);
}

TEST(CacheManager, ListenersMayCallBackIntoTheManager) {
  auto c = MakeOneKind(8);
  std::vector<uint64_t> seen;
  bool nested = false;
  const SubscriptionId id = c->Subscribe([&](const KvEvent& e) {
    seen.push_back(e.sequence_number);
    if (!nested) {
      // A change made from inside a listener is delivered after this call returns, in order.
      nested = true;
      EXPECT_EQ(RunAndFree(*c, Prompt(9, 2)), 0u);
      EXPECT_EQ(seen.size(), 1u);
      EXPECT_EQ(c->Stats().cached_blocks, 4u);
    }
  });
  const SequenceId s = RunPrompt(*c, Prompt(9, 1));
  ASSERT_TRUE(c->Free(s).ok());
  ASSERT_TRUE(c->Reset().ok());
  c->Unsubscribe(id);
  EXPECT_EQ(seen, (std::vector<uint64_t>{1, 2, 3}));
  ASSERT_TRUE(c->Reset().ok());
  EXPECT_EQ(seen.size(), 3u);  // unsubscribed
}

// ---------------------------------------------------------------------------------------------
// Fork, pins, options, errors

TEST(CacheManager, ForkSharesPagesAndCopiesASharedPartialBlockBeforeWriting) {
  auto c = MakeOneKind(16);
  const auto p = Prompt(6, 1);  // one full block and two tokens
  const SequenceId a = RunPrompt(*c, p);
  const auto ta = Table(*c, a);
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(Table(*c, *f), ta);
  EXPECT_EQ(c->pool(0).RefCount(ta[0]), 2u);
  EXPECT_EQ(c->pool(0).RefCount(ta[1]), 2u);

  const TokenId next = 77;
  ASSERT_TRUE(c->AppendTokens(*f, std::span<const TokenId>(&next, 1)).ok());
  auto slots = c->AllocateSlots(*f, 7);
  ASSERT_TRUE(slots.ok());
  EXPECT_EQ(slots->new_blocks, 0u);
  ASSERT_EQ(slots->copies.size(), 1u);
  const auto tf = Table(*c, *f);
  EXPECT_EQ(slots->copies[0].reason, CopyReason::kCopyOnWrite);
  EXPECT_EQ(slots->copies[0].src, ta[1]);
  EXPECT_EQ(slots->copies[0].dst, tf[1]);
  EXPECT_EQ(tf[0], ta[0]);  // the committed full block stays shared
  EXPECT_NE(tf[1], ta[1]);
  EXPECT_EQ(c->pool(0).RefCount(ta[1]), 1u);
  ASSERT_TRUE(c->CommitComputed(*f, 7).ok());
  EXPECT_EQ(c->GetSequenceInfo(*f)->tokens, 7u);

  const TokenId other[2] = {5, 6};
  ASSERT_TRUE(c->AppendTokens(a, other).ok());
  auto own = c->AllocateSlots(a, 8);
  ASSERT_TRUE(own.ok());
  EXPECT_TRUE(own->copies.empty());  // its partial page is its own again
  ASSERT_TRUE(c->Free(a).ok());
  ASSERT_TRUE(c->Free(*f).ok());
  EXPECT_EQ(c->pool(0).Stats().used, 0u);
  ExpectHealthy(*c);
}

TEST(CacheManager, PinsKeepPrefixesAndGiveWayLowestPriorityFirst) {
  auto c = MakeOneKind(8);
  const auto sys1 = Prompt(9, 1), sys2 = Prompt(9, 2);
  EXPECT_EQ(RunAndFree(*c, sys1), 0u);
  EXPECT_EQ(RunAndFree(*c, sys2), 0u);
  PrefixQuery q1, q2;
  q1.tokens = sys1;
  q2.tokens = sys2;
  auto pin1 = c->PinPrefix(q1, 1);
  auto pin2 = c->PinPrefix(q2, kPinForever);
  ASSERT_TRUE(pin1.ok());
  ASSERT_TRUE(pin2.ok());
  EXPECT_EQ(pin1->blocks, 2u);
  EXPECT_EQ(c->Stats().pins, 2u);
  PrefixQuery unknown;
  const auto u = Prompt(9, 99);
  unknown.tokens = u;
  EXPECT_EQ(c->PinPrefix(unknown, 1).status().code(), StatusCode::kNotFound);

  for (uint32_t k = 10; k < 20; ++k) EXPECT_EQ(RunAndFree(*c, Prompt(9, k)), 0u);  // churn
  EXPECT_EQ(Lookup(*c, sys1).blocks, 2u);
  EXPECT_EQ(Lookup(*c, sys2).blocks, 2u);

  // Six pages with four free or cached: the priority-1 pin gives way, the other stays.
  EXPECT_EQ(RunAndFree(*c, Prompt(21, 30)), 0u);
  EXPECT_EQ(c->Stats().pins_released, 1u);
  EXPECT_EQ(c->Unpin(pin1->id).code(), StatusCode::kNotFound);
  EXPECT_EQ(Lookup(*c, sys1).blocks, 0u);
  EXPECT_EQ(Lookup(*c, sys2).blocks, 2u);

  // Eight pages: only the kPinForever pin could make room, so the allocation fails cleanly.
  auto x = c->CreateSequence();
  ASSERT_TRUE(c->AppendTokens(*x, Prompt(29, 31)).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*x).ok());
  EXPECT_EQ(c->AllocateSlots(*x, 29).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(c->Stats().pins, 1u);
  ASSERT_TRUE(c->Unpin(pin2->id).ok());
  EXPECT_TRUE(c->AllocateSlots(*x, 29).ok());
  ASSERT_TRUE(c->Free(*x).ok());
  ExpectHealthy(*c);
}

TEST(CacheManager, PrefixCachingCanBeTurnedOff) {
  CacheManagerOptions o;
  o.block_tokens = 4;
  o.capacity_blocks = 8;
  o.metadata_only = true;
  o.enable_prefix_caching = false;
  auto c = MakeCache(OneKindSpec(), o);
  const auto p = Prompt(9, 1);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  EXPECT_EQ(RunAndFree(*c, p), 0u);
  EXPECT_EQ(c->pool(0).Stats().cached, 0u);
  EXPECT_EQ(Lookup(*c, p).blocks, 0u);
  PrefixQuery q;
  q.tokens = p;
  EXPECT_EQ(c->PinPrefix(q, 1).status().code(), StatusCode::kFailedPrecondition);
  SequenceOptions no_cache;
  no_cache.cache_blocks = false;
  auto on = MakeOneKind(8);
  EXPECT_EQ(RunAndFree(*on, p, no_cache), 0u);
  EXPECT_EQ(on->pool(0).Stats().cached, 0u);
  EXPECT_EQ(on->Stats().lookups, 0u);
}

TEST(CacheManager, RejectsBadOptionsAndMisuse) {
  CacheManagerOptions o;
  o.metadata_only = true;
  EXPECT_EQ(CacheManager::Create(OneKindSpec(), o).status().code(),
            StatusCode::kInvalidArgument);  // capacity 0
  o.capacity_blocks = 4;
  o.backing = ArenaBacking::kFile;
  EXPECT_EQ(CacheManager::Create(OneKindSpec(), o).status().code(), StatusCode::kInvalidArgument);
  o.backing = ArenaBacking::kAnonymous;
  o.block_tokens = 64;
  auto v4 = CacheManager::Create(*ModelPreset("deepseek-v4-flash"), o);
  ASSERT_FALSE(v4.ok());
  EXPECT_NE(v4.status().message().find("ratio 128"), std::string_view::npos);

  auto c = MakeOneKind(8);
  const SequenceId none = 12345;
  const auto p = Prompt(9, 1);
  std::vector<PageId> t;
  EXPECT_EQ(c->AppendTokens(none, p).code(), StatusCode::kNotFound);
  EXPECT_EQ(c->AcquireCachedPrefix(none).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c->AllocateSlots(none, 4).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c->CommitComputed(none, 4).code(), StatusCode::kNotFound);
  EXPECT_EQ(c->Fork(none).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c->Free(none).code(), StatusCode::kNotFound);
  EXPECT_EQ(c->GetBlockTable(none, 0, &t).code(), StatusCode::kNotFound);
  EXPECT_EQ(c->GetSequenceInfo(none).status().code(), StatusCode::kNotFound);

  auto s = c->CreateSequence();
  ASSERT_TRUE(c->AppendTokens(*s, p).ok());
  EXPECT_EQ(c->GetBlockTable(*s, 1, &t).code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(c->AcquireCachedPrefix(*s).ok());
  EXPECT_EQ(c->AcquireCachedPrefix(*s).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->AllocateSlots(*s, 8).ok());
  EXPECT_EQ(c->CommitComputed(*s, 9).code(),
            StatusCode::kFailedPrecondition);  // no slot for token 8
  ASSERT_TRUE(c->CommitComputed(*s, 8).ok());
  EXPECT_EQ(c->CommitComputed(*s, 4).code(), StatusCode::kInvalidArgument);  // backwards
  ASSERT_TRUE(c->AllocateSlots(*s, 12).ok());
  EXPECT_EQ(c->CommitComputed(*s, 12).code(),
            StatusCode::kFailedPrecondition);  // tokens not appended
  ASSERT_TRUE(c->Free(*s).ok());
  EXPECT_EQ(c->Free(*s).code(), StatusCode::kNotFound);
  ExpectHealthy(*c);
}

TEST(CacheManager, PagesHaveAddressesUnlessMetadataOnly) {
  CacheManagerOptions o;
  o.capacity_blocks = 2;
  o.huge_pages = false;
  auto c = MakeCache(*ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8), o);
  ASSERT_EQ(c->num_pools(), 2u);
  const SequenceId s = RunPrompt(*c, Prompt(200, 1));
  for (size_t q = 0; q < c->num_pools(); ++q) {
    EXPECT_EQ(c->pool(q).page_bytes(), c->geometry().pools[q].block_stride);
    for (PageId page : Table(*c, s, q)) EXPECT_NE(c->pool(q).PageData(page), nullptr);
  }
  ASSERT_TRUE(c->Free(s).ok());
  EXPECT_EQ(MakeOneKind(2)->pool(0).PageData(0), nullptr);
}

}  // namespace
}  // namespace sparsekv
