// Forks of sequences that hold lookahead slots (issue 16): copy on write must never change how
// many blocks a sequence has, whatever the order of fork, commit and allocation.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sparsekv/cache_manager.h"
#include "tests/cache/cache_test_util.h"

namespace sparsekv {
namespace {

using testing::MakeCache;
using testing::Prompt;
using testing::Table;

// check_invariants off for the issue's black-box steps (as the reporter ran them), on for the rest.
std::unique_ptr<CacheManager> MakeV32(uint32_t capacity, bool check_invariants = false) {
  CacheManagerOptions o;
  o.block_tokens = 4;
  o.capacity_blocks = capacity;
  o.metadata_only = true;
  o.check_invariants = check_invariants;
  return MakeCache(*ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8), o);
}

std::unique_ptr<CacheManager> MakeV4(uint32_t capacity) {
  CacheManagerOptions o;
  o.block_tokens = 128;
  o.capacity_blocks = capacity;
  o.metadata_only = true;
  o.check_invariants = true;
  return MakeCache(*ModelPreset("deepseek-v4-flash", KvPrecision::kFp8), o);
}

::testing::AssertionResult Healthy(const CacheManager& c) {
  const Status st = c.CheckInvariants();
  if (st.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << st.ToString();
}

Status Append(CacheManager& c, SequenceId seq, const std::vector<TokenId>& tokens, size_t from,
              size_t n) {
  return c.AppendTokens(seq, std::span<const TokenId>(tokens).subspan(from, n));
}

// A sequence with the first `n` of `tokens`, looked up, `slots` allocated, `commit` committed.
SequenceId Start(CacheManager& c, const std::vector<TokenId>& tokens, size_t n, uint64_t slots,
                 uint64_t commit) {
  auto seq = c.CreateSequence();
  EXPECT_TRUE(seq.ok());
  EXPECT_TRUE(Append(c, *seq, tokens, 0, n).ok());
  EXPECT_TRUE(c.AcquireCachedPrefix(*seq).ok());
  auto a = c.AllocateSlots(*seq, slots);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  const Status st = c.CommitComputed(*seq, commit);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return *seq;
}

size_t CountCopies(const SlotAllocation& a, CopyReason reason) {
  size_t n = 0;
  for (const PageCopy& cp : a.copies) n += cp.reason == reason;
  return n;
}

uint64_t Used(const CacheManager& c) {
  uint64_t used = 0;
  for (size_t q = 0; q < c.num_pools(); ++q) used += c.pool(q).Stats().used;
  return used;
}

// Every pool's table has `blocks` entries and the slots fit in them.
void ExpectShape(const CacheManager& c, SequenceId seq, const std::string& where) {
  auto info = c.GetSequenceInfo(seq);
  ASSERT_TRUE(info.ok()) << where;
  for (size_t q = 0; q < c.num_pools(); ++q) {
    EXPECT_EQ(Table(c, seq, q).size(), info->blocks) << where << ", pool " << q;
  }
  EXPECT_LE(info->slot_tokens, uint64_t{info->blocks} * c.options().block_tokens) << where;
}

void ExpectHealthy(const CacheManager& c) {
  EXPECT_EQ(c.Stats().internal_errors, 0u) << c.Stats().first_internal_error;
  for (size_t q = 0; q < c.num_pools(); ++q)
    EXPECT_EQ(c.pool(q).Stats().misuse, 0u) << "pool " << q;
}

// The black-box sequence of issue 16, step by step.
TEST(ForkLookahead, Issue16AllocatingFewerSlotsThanHeldAfterAFork) {
  auto c = MakeV32(32);
  ASSERT_EQ(c->num_pools(), 2u);
  const auto tokens = Prompt(16, 7);

  // 1. A: 6 prompt tokens, three blocks of lookahead, 6 committed.
  auto a = c->CreateSequence();
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c->AppendTokens(*a, std::span<const TokenId>(tokens).first(6)).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*a).ok());
  auto slots = c->AllocateSlots(*a, 12);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  EXPECT_EQ(slots->new_blocks, 3u);
  ASSERT_TRUE(c->CommitComputed(*a, 6).ok());

  // 2. F shares all three pages.
  auto f = c->Fork(*a);
  ASSERT_TRUE(f.ok());
  ExpectShape(*c, *f, "after fork");

  // 3. One more token for A, slots for 7 (fewer than the 12 held): the shared partial block 1 is
  // copied in every pool, and A keeps its three blocks and 12 slots.
  ASSERT_TRUE(c->AppendTokens(*a, std::span<const TokenId>(tokens).subspan(6, 1)).ok());
  const auto before = Table(*c, *a, 0);
  slots = c->AllocateSlots(*a, 7);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  EXPECT_EQ(slots->new_blocks, 0u);
  ASSERT_EQ(slots->copies.size(), c->num_pools());
  for (const PageCopy& cp : slots->copies) EXPECT_EQ(cp.reason, CopyReason::kCopyOnWrite);
  ExpectShape(*c, *a, "step 3");
  EXPECT_EQ(c->GetSequenceInfo(*a)->blocks, 3u);
  EXPECT_EQ(c->GetSequenceInfo(*a)->slot_tokens, 12u);
  const auto after = Table(*c, *a, 0);
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after[0], before[0]);
  EXPECT_NE(after[1], before[1]);
  EXPECT_EQ(after[2], before[2]);  // still shared: nothing is written there yet
  ASSERT_TRUE(c->CommitComputed(*a, 7).ok());
  EXPECT_TRUE(Healthy(*c));

  // 4. A grows to 16 tokens: block 2 (still shared with F) is copied before it is written.
  ASSERT_TRUE(c->AppendTokens(*a, std::span<const TokenId>(tokens).subspan(7)).ok());
  slots = c->AllocateSlots(*a, 16);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  EXPECT_EQ(slots->first_new_block, 3u);
  EXPECT_EQ(slots->new_blocks, 1u);
  ExpectShape(*c, *a, "step 4");
  EXPECT_EQ(c->GetSequenceInfo(*a)->blocks, 4u);
  const auto grown = Table(*c, *a, 0);
  EXPECT_EQ(grown.size(), 4u);
  if (grown.size() > 2) {
    EXPECT_NE(grown[2], after[2]);
  }
  ASSERT_TRUE(c->CommitComputed(*a, 16).ok());
  EXPECT_TRUE(Healthy(*c));

  // 5. Freeing both leaves no page in use.
  ASSERT_TRUE(c->Free(*a).ok());
  ASSERT_TRUE(c->Free(*f).ok());
  for (size_t q = 0; q < c->num_pools(); ++q)
    EXPECT_EQ(c->pool(q).Stats().used, 0u) << "pool " << q;
  EXPECT_TRUE(Healthy(*c));

  // 6. A prompt starting with A's 16 tokens hits 4 blocks, each with a live page in every pool.
  auto n = c->CreateSequence();
  ASSERT_TRUE(n.ok());
  std::vector<TokenId> longer = tokens;
  longer.push_back(99);
  ASSERT_TRUE(c->AppendTokens(*n, longer).ok());
  auto hit = c->AcquireCachedPrefix(*n);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->blocks, 4u);
  for (size_t q = 0; q < c->num_pools(); ++q) {
    const auto t = Table(*c, *n, q);
    EXPECT_EQ(t.size(), 4u) << "pool " << q;
    for (size_t b = 0; b < t.size(); ++b) {
      EXPECT_NE(t[b], kInvalidPage) << "pool " << q << " block " << b;
    }
  }
  ExpectHealthy(*c);
  ASSERT_TRUE(c->Free(*n).ok());
  EXPECT_TRUE(Healthy(*c));
}

// Fork before anything is committed: every page, lookahead included, is shared, so both
// sequences copy what they write, and a commit that skipped the allocation is refused.
TEST(ForkLookahead, ForkBeforeAnyCommit) {
  auto c = MakeV32(32, true);
  const auto tokens = Prompt(12, 3);
  auto a = c->CreateSequence();
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Append(*c, *a, tokens, 0, 6).ok());
  ASSERT_TRUE(c->AcquireCachedPrefix(*a).ok());
  ASSERT_TRUE(c->AllocateSlots(*a, 12).ok());
  auto f = c->Fork(*a);
  ASSERT_TRUE(f.ok());
  const auto shared = Table(*c, *a, 0);

  const Status refused = c->CommitComputed(*a, 6);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_EQ(c->GetSequenceInfo(*a)->computed_tokens, 0u);
  EXPECT_TRUE(Healthy(*c));

  auto own = c->AllocateSlots(*a, 6);  // fewer than the 12 held
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->new_blocks, 0u);
  EXPECT_EQ(CountCopies(*own, CopyReason::kCopyOnWrite), 2 * c->num_pools());  // blocks 0 and 1
  EXPECT_EQ(c->GetSequenceInfo(*a)->blocks, 3u);
  ASSERT_TRUE(c->CommitComputed(*a, 6).ok());
  const auto ta = Table(*c, *a, 0);
  EXPECT_NE(ta[0], shared[0]);
  EXPECT_NE(ta[1], shared[1]);
  EXPECT_EQ(ta[2], shared[2]);

  // F now holds blocks 0 and 1 alone: nothing to copy there, but block 2 is still shared.
  const auto other = Prompt(12, 4);
  ASSERT_TRUE(Append(*c, *f, other, 0, 10).ok());
  auto fa = c->AllocateSlots(*f, 10);
  ASSERT_TRUE(fa.ok());
  EXPECT_EQ(CountCopies(*fa, CopyReason::kCopyOnWrite), c->num_pools());
  ASSERT_TRUE(c->CommitComputed(*f, 10).ok());
  EXPECT_EQ(Table(*c, *f, 0)[0], shared[0]);
  EXPECT_NE(Table(*c, *f, 0)[2], shared[2]);
  EXPECT_TRUE(Healthy(*c));
  ASSERT_TRUE(c->Free(*f).ok());
  ASSERT_TRUE(c->Free(*a).ok());
  EXPECT_EQ(Used(*c), 0u);
  EXPECT_TRUE(Healthy(*c));
}

// After the fork, more slots than held: the shared blocks written are copied, new ones added, and
// the fork's table does not move.
TEST(ForkLookahead, MoreSlotsThanHeldAfterAFork) {
  auto c = MakeV32(32, true);
  const auto tokens = Prompt(20, 5);
  const SequenceId a = Start(*c, tokens, 6, 12, 6);
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  const auto tf = Table(*c, *f, 1);
  ASSERT_TRUE(Append(*c, a, tokens, 6, 10).ok());
  auto more = c->AllocateSlots(a, 20);
  ASSERT_TRUE(more.ok());
  EXPECT_EQ(more->first_new_block, 3u);
  EXPECT_EQ(more->new_blocks, 2u);
  EXPECT_EQ(CountCopies(*more, CopyReason::kCopyOnWrite), 2 * c->num_pools());  // blocks 1, 2
  EXPECT_EQ(c->GetSequenceInfo(a)->blocks, 5u);
  EXPECT_EQ(Table(*c, *f, 1), tf);
  ASSERT_TRUE(c->CommitComputed(a, 16).ok());
  EXPECT_TRUE(Healthy(*c));
  ASSERT_TRUE(c->Free(a).ok());
  ASSERT_TRUE(c->Free(*f).ok());
  EXPECT_EQ(Used(*c), 0u);

  PrefixMatch hit;
  const SequenceId b =
      testing::RunPrompt(*c, std::vector<TokenId>(tokens.begin(), tokens.begin() + 17), &hit);
  EXPECT_EQ(hit.blocks, 4u);
  ASSERT_TRUE(c->Free(b).ok());
  EXPECT_TRUE(Healthy(*c));
}

// A fork of a fork: three holders of the same lookahead pages; each copy leaves one reference
// fewer, and the last holder writes in place.
TEST(ForkLookahead, ForksOfForks) {
  auto c = MakeV32(32, true);
  const auto tokens = Prompt(8, 6);
  const SequenceId a = Start(*c, tokens, 6, 12, 6);
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  auto g = c->Fork(*f);
  ASSERT_TRUE(g.ok());
  const auto shared = Table(*c, a, 0);
  EXPECT_EQ(c->pool(0).RefCount(shared[1]), 3u);
  EXPECT_EQ(c->pool(0).RefCount(shared[2]), 3u);

  std::vector<PageId> partial;
  const SequenceId order[] = {a, *f, *g};
  for (size_t i = 0; i < 3; ++i) {
    const SequenceId s = order[i];
    const auto next = Prompt(2, 10 + static_cast<uint32_t>(i));
    ASSERT_TRUE(c->AppendTokens(s, next).ok());
    auto al = c->AllocateSlots(s, 8);  // fewer than the 12 held
    ASSERT_TRUE(al.ok());
    EXPECT_EQ(CountCopies(*al, CopyReason::kCopyOnWrite), i < 2 ? c->num_pools() : 0u) << i;
    EXPECT_EQ(c->GetSequenceInfo(s)->blocks, 3u);
    ASSERT_TRUE(c->CommitComputed(s, 8).ok());
    partial.push_back(Table(*c, s, 0)[1]);
    EXPECT_TRUE(Healthy(*c)) << i;
  }
  EXPECT_EQ(partial[2], shared[1]);  // the last holder kept the original page
  EXPECT_NE(partial[0], partial[1]);
  EXPECT_EQ(c->pool(0).RefCount(shared[2]), 3u);  // block 2 not written by anyone yet
  ASSERT_TRUE(c->Free(*f).ok());
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_EQ(c->pool(0).RefCount(shared[2]), 1u);
  ASSERT_TRUE(c->Free(*g).ok());
  EXPECT_EQ(Used(*c), 0u);
  EXPECT_TRUE(Healthy(*c));
}

// The slots a sequence took before a fork are shared: committing into them without allocating
// again would put this sequence's KV in the fork's page, and is refused without a change.
TEST(ForkLookahead, CommitIntoABlockStillSharedIsRefused) {
  auto c = MakeV32(32, true);
  const auto tokens = Prompt(12, 8);
  const SequenceId a = Start(*c, tokens, 6, 12, 6);
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(Append(*c, a, tokens, 6, 4).ok());
  const Status st = c->CommitComputed(a, 10);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_EQ(c->GetSequenceInfo(a)->computed_tokens, 6u);
  EXPECT_TRUE(Healthy(*c));
  ASSERT_TRUE(c->AllocateSlots(a, 10).ok());
  ASSERT_TRUE(c->CommitComputed(a, 10).ok());
  // Once the fork is gone nothing is shared, and the lookahead slots need no new allocation.
  ASSERT_TRUE(c->Free(*f).ok());
  ASSERT_TRUE(Append(*c, a, tokens, 10, 2).ok());
  ASSERT_TRUE(c->CommitComputed(a, 12).ok());
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_EQ(Used(*c), 0u);
  EXPECT_TRUE(Healthy(*c));
}

// V4-Flash: window and compressor-state pools, early-released pages, lookahead and a fork.
TEST(ForkLookahead, V4WindowAndStatePools) {
  constexpr uint32_t kBt = 128;
  auto c = MakeV4(32);
  ASSERT_EQ(c->num_pools(), 6u);
  const auto tokens = Prompt(5 * kBt, 9);
  // One full block and 72 tokens computed, four blocks held.
  const SequenceId a = Start(*c, tokens, 200, 4 * kBt, 200);
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  ExpectShape(*c, *f, "fork");

  ASSERT_TRUE(Append(*c, a, tokens, 200, 1).ok());
  auto one = c->AllocateSlots(a, 201);  // fewer than the 512 held
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->new_blocks, 0u);
  EXPECT_EQ(CountCopies(*one, CopyReason::kCopyOnWrite), 6u);  // block 1 in every pool
  EXPECT_EQ(CountCopies(*one, CopyReason::kCarryState), 0u);
  EXPECT_EQ(c->GetSequenceInfo(a)->blocks, 4u);
  ExpectShape(*c, a, "fewer slots");
  ASSERT_TRUE(c->CommitComputed(a, 201).ok());
  EXPECT_TRUE(Healthy(*c));

  ASSERT_TRUE(Append(*c, a, tokens, 201, 399).ok());
  auto grow = c->AllocateSlots(a, 600);
  ASSERT_TRUE(grow.ok());
  EXPECT_EQ(grow->first_new_block, 4u);
  EXPECT_EQ(grow->new_blocks, 1u);
  // Blocks 2 and 3 are copied in every pool, then the two snapshot kinds carry into block 4
  // from A's own (copied) block 3.
  EXPECT_EQ(CountCopies(*grow, CopyReason::kCopyOnWrite), 12u);
  ASSERT_EQ(CountCopies(*grow, CopyReason::kCarryState), 2u);
  std::vector<PageId> t3;
  for (const PageCopy& cp : grow->copies) {
    if (cp.reason != CopyReason::kCarryState) continue;
    t3 = Table(*c, a, cp.pool);
    EXPECT_EQ(cp.src, t3[3]);
    EXPECT_EQ(cp.dst, t3[4]);
  }
  EXPECT_EQ(grow->copies.back().reason, CopyReason::kCarryState);
  ASSERT_TRUE(c->CommitComputed(a, 600).ok());
  ExpectShape(*c, a, "grown");
  EXPECT_TRUE(Healthy(*c));

  ASSERT_TRUE(c->Free(a).ok());
  ASSERT_TRUE(c->Free(*f).ok());
  EXPECT_EQ(Used(*c), 0u);
  EXPECT_TRUE(Healthy(*c));
  auto b = c->CreateSequence();
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(Append(*c, *b, tokens, 0, 601).ok());
  auto hit = c->AcquireCachedPrefix(*b);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->blocks, 4u);
  for (size_t q = 0; q < c->num_pools(); ++q) {
    const auto t = Table(*c, *b, q);
    ASSERT_EQ(t.size(), 4u) << q;
    EXPECT_NE(t[3], kInvalidPage) << q;  // every kind resumes at block 4
  }
  ASSERT_TRUE(c->Free(*b).ok());
  ExpectHealthy(*c);
  EXPECT_TRUE(Healthy(*c));
}

// A failed copy on write (no page for the copy) changes nothing, the blocks past the write
// included.
TEST(ForkLookahead, RefusedCopyChangesNothing) {
  auto c = MakeV32(3, true);
  const auto tokens = Prompt(8, 11);
  const SequenceId a = Start(*c, tokens, 6, 12, 6);  // all three pages
  auto f = c->Fork(a);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(Append(*c, a, tokens, 6, 1).ok());
  const auto before = Table(*c, a, 0);
  auto r = c->AllocateSlots(a, 7);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Table(*c, a, 0), before);
  EXPECT_EQ(c->GetSequenceInfo(a)->blocks, 3u);
  EXPECT_EQ(c->GetSequenceInfo(a)->slot_tokens, 12u);
  EXPECT_TRUE(Healthy(*c));
  ASSERT_TRUE(c->Free(*f).ok());
  auto ok = c->AllocateSlots(a, 7);  // alone now: nothing to copy
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->copies.empty());
  ASSERT_TRUE(c->Free(a).ok());
  EXPECT_TRUE(Healthy(*c));
}

}  // namespace
}  // namespace sparsekv
