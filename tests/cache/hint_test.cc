// Scheduler hints (CacheManager::HintPrefix, HintDigests, DropHint): what they protect, the
// bound, expiry, the limits, and that they never make an allocation fail.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "cache_test_util.h"

namespace sparsekv {
namespace {

using namespace sparsekv::testing;

std::unique_ptr<CacheManager> Make(uint32_t capacity, EvictionPolicyKind policy, double bound = 0.5,
                                   uint32_t max_hints = 64) {
  CacheManagerOptions o;
  o.block_tokens = 4;
  o.capacity_blocks = capacity;
  o.metadata_only = true;
  o.eviction = policy;
  o.hint_bound = bound;
  o.max_hints = max_hints;
  o.check_invariants = true;
  return MakeCache(OneKindSpec(), o);
}

PrefixMatch Lookup(const CacheManager& c, std::span<const TokenId> tokens) {
  PrefixQuery q;
  q.tokens = tokens;
  auto m = c.LookupPrefix(q);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : PrefixMatch{};
}

void ExpectHealthy(const CacheManager& c) {
  EXPECT_EQ(c.Stats().internal_errors, 0u) << c.Stats().first_internal_error;
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants().ToString();
  for (size_t q = 0; q < c.num_pools(); ++q) EXPECT_EQ(c.pool(q).Stats().misuse, 0u) << "pool " << q;
}

PrefixQuery Query(const std::vector<TokenId>& t) {
  PrefixQuery q;
  q.tokens = t;
  return q;
}

class HintTest : public ::testing::TestWithParam<EvictionPolicyKind> {};

// A hinted prompt survives the churn that evicts an unhinted one of the same age.
TEST_P(HintTest, AHintedPrefixOutlivesTheChurn) {
  auto c = Make(12, GetParam());
  const auto a = Prompt(9, 1), b = Prompt(9, 2);  // two full blocks and a partial one each
  RunAndFree(*c, a);
  RunAndFree(*c, b);
  auto h = c->HintPrefix(Query(a));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->found_blocks, 2u);
  EXPECT_EQ(h->protected_blocks, 2u);
  EXPECT_EQ(c->Stats().hinted_blocks, 2u);
  EXPECT_EQ(c->pool(0).Stats().protected_cached, 2u);
  for (uint32_t i = 0; i < 8; ++i) RunAndFree(*c, Prompt(9, 100 + i));  // 3 pages each
  EXPECT_EQ(Lookup(*c, a).blocks, 2u) << "the hinted prompt is still cached";
  EXPECT_EQ(Lookup(*c, b).blocks, 0u) << "the unhinted one of the same age is not";
  ASSERT_TRUE(c->DropHint(h->id).ok());
  EXPECT_EQ(c->Stats().hinted_blocks, 0u);
  EXPECT_EQ(c->pool(0).Stats().protected_cached, 0u);
  EXPECT_EQ(c->DropHint(h->id).code(), StatusCode::kNotFound);
  ExpectHealthy(*c);
}

// Blocks registered while a hint lives are protected from their registration on.
TEST_P(HintTest, BlocksCachedAfterTheHintAreProtectedToo) {
  auto c = Make(12, GetParam());
  const auto a = Prompt(9, 1);
  auto h = c->HintPrefix(Query(a));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->found_blocks, 0u);
  RunAndFree(*c, a);  // now computed and registered
  EXPECT_EQ(c->Stats().hinted_blocks, 2u);
  for (uint32_t i = 0; i < 8; ++i) RunAndFree(*c, Prompt(9, 100 + i));
  EXPECT_EQ(Lookup(*c, a).blocks, 2u);
  ExpectHealthy(*c);
}

// Hints never starve an allocation: with everything cached protected, the protected go.
TEST_P(HintTest, HintsNeverMakeAnAllocationFail) {
  auto c = Make(6, GetParam(), /*bound=*/1.0);
  const auto a = Prompt(21, 1);  // five full blocks and a partial one: the whole cache
  RunAndFree(*c, a);
  auto h = c->HintPrefix(Query(a));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->protected_blocks, 5u);
  EXPECT_EQ(RunAndFree(*c, Prompt(21, 2)), 0u);  // needs all six pages: allowed
  EXPECT_EQ(Lookup(*c, a).blocks, 0u);
  EXPECT_EQ(c->Stats().failed_allocations, 0u);
  EXPECT_EQ(c->Stats().hinted_blocks, 0u) << "evicted blocks are no longer counted";
  ASSERT_TRUE(c->DropHint(h->id).ok());
  ExpectHealthy(*c);
}

// At most hint_bound of the cache is protected; the rest of a hint is counted as cut.
TEST_P(HintTest, TheBoundCutsWhatAHintProtects) {
  auto c = Make(20, GetParam(), /*bound=*/0.25);  // five blocks at most
  const auto a = Prompt(33, 1);                    // eight full blocks
  RunAndFree(*c, a);
  auto h = c->HintPrefix(Query(a));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->found_blocks, 8u);
  EXPECT_EQ(h->protected_blocks, 5u);
  EXPECT_EQ(c->Stats().hint_blocks_cut, 3u);
  EXPECT_EQ(c->pool(0).Stats().protected_cached, 5u);
  // A second hint of the same prompt protects nothing more.
  auto again = c->HintPrefix(Query(a));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(c->Stats().hinted_blocks, 5u);
  ASSERT_TRUE(c->DropHint(h->id).ok());
  EXPECT_EQ(c->Stats().hinted_blocks, 5u) << "still named by the second hint";
  ASSERT_TRUE(c->DropHint(again->id).ok());
  EXPECT_EQ(c->Stats().hinted_blocks, 0u);
  ExpectHealthy(*c);
}

TEST_P(HintTest, HintsExpire) {
  auto c = Make(12, GetParam());
  const auto a = Prompt(9, 1);
  RunAndFree(*c, a);
  HintOptions ho;
  ho.ttl = std::chrono::milliseconds(20);
  auto h = c->HintPrefix(Query(a), ho);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(c->Stats().hinted_blocks, 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  RunAndFree(*c, Prompt(9, 7));  // an allocation ends what has expired
  EXPECT_EQ(c->Stats().hints, 0u);
  EXPECT_EQ(c->Stats().hinted_blocks, 0u);
  EXPECT_EQ(c->Stats().hints_expired, 1u);
  EXPECT_EQ(c->DropHint(h->id).code(), StatusCode::kNotFound);
  ExpectHealthy(*c);
}

TEST_P(HintTest, BadHintsAreRefusedAndChangeNothing) {
  auto c = Make(12, GetParam(), 0.5, /*max_hints=*/2);
  const auto a = Prompt(9, 1);
  RunAndFree(*c, a);
  HintOptions zero;
  zero.ttl = std::chrono::milliseconds(0);
  EXPECT_EQ(c->HintPrefix(Query(a), zero).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->HintPrefix(Query(a)).ok());
  ASSERT_TRUE(c->HintPrefix(Query(a)).ok());
  auto third = c->HintPrefix(Query(a));
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(c->Stats().hints, 2u);
  EXPECT_EQ(c->DropHint(12345).code(), StatusCode::kNotFound);
  // Reset forgets hints with everything else.
  ASSERT_TRUE(c->Reset().ok());
  EXPECT_EQ(c->Stats().hints, 0u);
  EXPECT_EQ(c->Stats().hinted_blocks, 0u);
  EXPECT_EQ(c->pool(0).Stats().protected_cached, 0u);
  ExpectHealthy(*c);
}

TEST(HintOptions, ABadBoundOrPolicyIsRefused) {
  CacheManagerOptions o;
  o.capacity_blocks = 8;
  o.metadata_only = true;
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    o.hint_bound = bad;
    EXPECT_EQ(CacheManager::Create(OneKindSpec(), o).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  o.hint_bound = 0.5;
  o.eviction = static_cast<EvictionPolicyKind>(7);
  EXPECT_EQ(CacheManager::Create(OneKindSpec(), o).status().code(), StatusCode::kInvalidArgument);
}

// Another namespace's hint names other hashes: it protects nothing of this one.
TEST_P(HintTest, AHintStaysInItsNamespace) {
  auto c = Make(12, GetParam());
  const auto a = Prompt(9, 1);
  RunAndFree(*c, a);
  PrefixQuery q = Query(a);
  q.namespace_salt = "tenant-b";
  auto h = c->HintPrefix(q);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->found_blocks, 0u);
  EXPECT_EQ(c->Stats().hinted_blocks, 0u);
  ExpectHealthy(*c);
}

INSTANTIATE_TEST_SUITE_P(Policies, HintTest, ::testing::ValuesIn(AllEvictionPolicies()),
                         [](const auto& info) { return std::string(EvictionPolicyName(info.param)); });

}  // namespace
}  // namespace sparsekv
