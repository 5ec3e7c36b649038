// The host and SSD tiers evict through an EvictionPolicy: every policy keeps the tiers' rules
// (a record being read is never evicted, a put fails only when everything left is being read),
// hints protect within their bound and never make a put fail, and the policy is really used
// (ARC keeps a key read twice through a scan that LRU lets push it out).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "sparsekv/host_tier.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

constexpr uint64_t kPayload = 10000;  // a record of 3 units of 4 KiB

std::unique_ptr<HostTier> OpenHost(EvictionPolicyKind kind, uint64_t records, double hint_bound = 0.5) {
  HostTierOptions o;
  o.capacity_bytes = records * 3 * 4096;
  o.huge_pages = false;
  o.eviction = kind;
  o.hint_bound = hint_bound;
  auto t = HostTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

bool Held(Tier& t, uint64_t id) { return t.Contains({KeyOf(id)}).get()[0]; }

void Put(Tier& t, uint64_t id, uint64_t bytes = kPayload) {
  const Status st = t.Put({MakeBundleOfBytes(id, bytes)}).get()[0];
  ASSERT_TRUE(st.ok()) << st.ToString();
}

class HostTierPolicy : public ::testing::TestWithParam<EvictionPolicyKind> {};

TEST_P(HostTierPolicy, HintedKeysSurviveAScanUntilTheHintEnds) {
  auto tier = OpenHost(GetParam(), 8);
  Put(*tier, 1);
  const BundleKey k1 = KeyOf(1), k2 = KeyOf(2);
  tier->Hint({&k1, 1}, true);
  tier->Hint({&k2, 1}, true);  // not held yet: protected once stored
  Put(*tier, 2);
  EXPECT_EQ(tier->Stats().protected_items, 2u);
  EXPECT_EQ(tier->Stats().hinted_keys, 2u);
  for (uint64_t f = 100; f < 140; ++f) Put(*tier, f);
  EXPECT_TRUE(Held(*tier, 1));
  EXPECT_TRUE(Held(*tier, 2));
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
  // Hints nest: one of two hints of key 1 ended, it is still protected.
  tier->Hint({&k1, 1}, true);
  tier->Hint({&k1, 1}, false);
  tier->Hint({&k2, 1}, false);
  for (uint64_t f = 200; f < 240; ++f) Put(*tier, f);
  EXPECT_TRUE(Held(*tier, 1));
  EXPECT_FALSE(Held(*tier, 2)) << "no longer hinted: a scan of 40 records pushes it out";
  tier->Hint({&k1, 1}, false);
  EXPECT_EQ(tier->Stats().protected_items, 0u);
  EXPECT_EQ(tier->Stats().hinted_keys, 0u);
  for (uint64_t f = 300; f < 340; ++f) Put(*tier, f);
  EXPECT_FALSE(Held(*tier, 1));
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
}

TEST_P(HostTierPolicy, HintsProtectAtMostTheBoundAndNeverMakeAPutFail) {
  auto tier = OpenHost(GetParam(), 8, /*hint_bound=*/0.25);  // 2 records' bytes of 8
  std::vector<BundleKey> keys;
  for (uint64_t id = 1; id <= 8; ++id) keys.push_back(KeyOf(id));
  tier->Hint(keys, true);
  for (uint64_t id = 1; id <= 8; ++id) Put(*tier, id);
  TierStats s = tier->Stats();
  EXPECT_EQ(s.protected_items, 2u);
  EXPECT_LE(s.protected_bytes, tier->capacity_bytes() / 4);
  EXPECT_EQ(s.hint_cut, 6u);
  // Everything hinted, the tier full: puts still land, evicting the unprotected first.
  for (uint64_t f = 100; f < 106; ++f) Put(*tier, f);
  EXPECT_TRUE(Held(*tier, 1));
  EXPECT_TRUE(Held(*tier, 2));
  // With a bound of the whole tier, every record protected: a put evicts protected ones.
  auto all = OpenHost(GetParam(), 4, 1.0);
  std::vector<BundleKey> four;
  for (uint64_t id = 1; id <= 4; ++id) four.push_back(KeyOf(id));
  all->Hint(four, true);
  for (uint64_t id = 1; id <= 4; ++id) Put(*all, id);
  EXPECT_EQ(all->Stats().protected_items, 4u);
  Put(*all, 50);
  EXPECT_TRUE(Held(*all, 50));
  EXPECT_EQ(all->Stats().protected_items, 3u);
  ASSERT_TRUE(all->CheckEviction().ok()) << all->CheckEviction().ToString();
}

TEST_P(HostTierPolicy, ARecordBeingReadIsNeverEvictedAndRejoinsTheOrderAfter) {
  auto tier = OpenHost(GetParam(), 4);
  for (uint64_t id = 1; id <= 4; ++id) Put(*tier, id);
  // Key 1 is the policy's first victim (oldest, read never); a reader holds it in place.
  Result<BundlePtr> held = tier->GetPinned(KeyOf(1));
  ASSERT_TRUE(held.ok());
  for (uint64_t f = 100; f < 110; ++f) Put(*tier, f);
  EXPECT_TRUE(Held(*tier, 1)) << "evicted while read";
  EXPECT_TRUE(SameBytes(**held, *MakeBundleOfBytes(1, kPayload)));
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
  held->reset();
  // Released, it is evictable again: with every other record read, a put evicts it.
  std::vector<BundlePtr> others;
  for (const BundleKey& k : tier->Keys()) {
    if (!(k == KeyOf(1))) others.push_back(*tier->GetPinned(k));
  }
  ASSERT_EQ(others.size(), 3u);
  Put(*tier, 200);
  EXPECT_FALSE(Held(*tier, 1));
  others.clear();
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
  // Every record read: a put finds no room and says so, evicting nothing.
  std::vector<BundlePtr> readers;
  for (const BundleKey& k : tier->Keys()) readers.push_back(*tier->GetPinned(k));
  const uint64_t before = tier->Stats().evictions;
  const Status st = tier->Put({MakeBundleOfBytes(999, kPayload)}).get()[0];
  EXPECT_TRUE(st.Is(StatusCode::kResourceExhausted)) << st.ToString();
  EXPECT_EQ(tier->Stats().evictions, before);
  readers.clear();
  Put(*tier, 999);
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
}

// Random puts of mixed sizes, gets, pinned reads held a while, erases and hints: the eviction
// order stays consistent, every held key reads back its bytes, a pinned read's bytes never
// change, and Keys() lists exactly what Contains finds.
TEST_P(HostTierPolicy, RandomOperationsKeepTheOrderConsistent) {
  auto tier = OpenHost(GetParam(), 24, 0.3);
  std::mt19937_64 rng(34);
  std::map<uint64_t, uint64_t> sizes;  // what each id was last stored with
  std::vector<std::pair<uint64_t, BundlePtr>> pinned;
  std::multiset<uint64_t> hinted;
  for (int op = 0; op < 4000; ++op) {
    const uint64_t id = rng() % 60;
    switch (rng() % 8) {
      case 0:
      case 1:
      case 2: {
        const uint64_t bytes = 1000 + rng() % 20000;
        const Status st = tier->Put({MakeBundleOfBytes(id, bytes)}).get()[0];
        ASSERT_TRUE(st.ok() || st.Is(StatusCode::kResourceExhausted)) << st.ToString();
        if (st.ok()) sizes[id] = bytes;
        break;
      }
      case 3: {
        auto got = tier->Get({KeyOf(id)}).get()[0];
        if (got.ok()) {
          EXPECT_TRUE(SameBytes(**got, *MakeBundleOfBytes(id, sizes.at(id))));
        }
        break;
      }
      case 4: {
        auto got = tier->GetPinned(KeyOf(id));
        if (got.ok()) pinned.emplace_back(sizes.at(id), std::move(*got));
        if (pinned.size() > 6) pinned.erase(pinned.begin());
        break;
      }
      case 5: ASSERT_TRUE(tier->Erase({KeyOf(id)}).get()[0].ok()); break;
      case 6: {
        const BundleKey k = KeyOf(id);
        tier->Hint({&k, 1}, true);
        hinted.insert(id);
        break;
      }
      case 7: {
        if (hinted.empty()) break;
        const uint64_t h = *hinted.begin();
        hinted.erase(hinted.begin());
        const BundleKey k = KeyOf(h);
        tier->Hint({&k, 1}, false);
        break;
      }
    }
    const Status check = tier->CheckEviction();
    ASSERT_TRUE(check.ok()) << "after op " << op << ": " << check.ToString();
    for (const auto& [bytes, b] : pinned) {
      const uint64_t id = b->key().hash.lo;  // KeyOf(id)
      ASSERT_TRUE(SameBytes(*b, *MakeBundleOfBytes(id, bytes))) << "a pinned record changed under its reader";
    }
  }
  const std::vector<BundleKey> keys = tier->Keys();
  EXPECT_EQ(keys.size(), tier->Stats().items);
  for (const BundleKey& k : keys) EXPECT_TRUE(tier->Contains({k}).get()[0]);
  EXPECT_EQ(tier->Stats().hinted_keys, std::set<uint64_t>(hinted.begin(), hinted.end()).size());
}

INSTANTIATE_TEST_SUITE_P(Policies, HostTierPolicy, ::testing::ValuesIn(AllEvictionPolicies()),
                         [](const auto& info) { return std::string(EvictionPolicyName(info.param)); });

// The policy is the tier's: under ARC a key read again outlives a scan of one-off keys; under
// LRU the scan pushes it out.
TEST(HostTier, ArcKeepsAReusedKeyThroughAScanLruDoesNot) {
  for (EvictionPolicyKind kind : AllEvictionPolicies()) {
    auto tier = OpenHost(kind, 8);
    Put(*tier, 1);
    ASSERT_TRUE(tier->Get({KeyOf(1)}).get()[0].ok());
    for (uint64_t f = 100; f < 120; ++f) Put(*tier, f);
    EXPECT_EQ(Held(*tier, 1), kind == EvictionPolicyKind::kArc) << EvictionPolicyName(kind);
    // The same bundle stored again (a chain's repeated demote, the daemon's put of a record it
    // wrote in place) is not a read: it stays with the one-off keys and a scan pushes it out.
    const BundlePtr twice = MakeBundleOfBytes(2, kPayload);
    ASSERT_TRUE(tier->Put({twice}).get()[0].ok());
    ASSERT_TRUE(tier->Put({twice}).get()[0].ok());
    for (uint64_t f = 200; f < 220; ++f) Put(*tier, f);
    EXPECT_FALSE(Held(*tier, 2)) << EvictionPolicyName(kind);
  }
}

// The SSD tier: hints, the order rebuilt at a restart (hints are not persisted: a reopened tier
// knows none), and ARC's scan resistance.
class SsdTierPolicy : public ::testing::TestWithParam<EvictionPolicyKind> {
 protected:
  std::unique_ptr<SsdTier> Open(uint64_t records) {
    SsdTierOptions o;
    o.path = dir_.path();
    o.capacity_bytes = records * 3 * 4096;
    o.queue_depth = 4;
    o.io_bytes = 64 << 10;
    o.slab_grow_bytes = 3 * 4096;
    o.max_record_bytes = 1 << 20;
    o.read_arena_bytes = 4 << 20;
    o.eviction = GetParam();
    auto t = SsdTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  testing::TempDir dir_{"ssd_policy"};
};

TEST_P(SsdTierPolicy, HintsProtectAndTheOrderIsRebuiltAtARestart) {
  auto tier = Open(6);
  const BundleKey k1 = KeyOf(1);
  tier->Hint({&k1, 1}, true);
  for (uint64_t id = 1; id <= 6; ++id) Put(*tier, id);
  EXPECT_EQ(tier->Stats().protected_items, 1u);
  for (uint64_t f = 100; f < 120; ++f) Put(*tier, f);
  EXPECT_TRUE(Held(*tier, 1));
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
  tier->Hint({&k1, 1}, false);
  for (uint64_t f = 200; f < 220; ++f) Put(*tier, f);
  EXPECT_FALSE(Held(*tier, 1));
  std::vector<BundleKey> keys = tier->Keys();
  ASSERT_EQ(keys.size(), 6u);
  EXPECT_TRUE(tier->Get(keys).get()[0].ok());
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
  tier.reset();
  tier = Open(6);
  EXPECT_EQ(tier->Stats().items, 6u);
  EXPECT_EQ(tier->Stats().protected_items, 0u);
  for (uint64_t f = 300; f < 306; ++f) Put(*tier, f);
  for (uint64_t f = 300; f < 306; ++f) EXPECT_TRUE(Held(*tier, f));
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
}

TEST_P(SsdTierPolicy, ReusedKeyThroughAScan) {
  auto tier = Open(8);
  Put(*tier, 1);
  ASSERT_TRUE(tier->Get({KeyOf(1)}).get()[0].ok());
  for (uint64_t f = 100; f < 120; ++f) Put(*tier, f);
  EXPECT_EQ(Held(*tier, 1), GetParam() == EvictionPolicyKind::kArc);
  ASSERT_TRUE(tier->CheckEviction().ok()) << tier->CheckEviction().ToString();
}

INSTANTIATE_TEST_SUITE_P(Policies, SsdTierPolicy, ::testing::ValuesIn(AllEvictionPolicies()),
                         [](const auto& info) { return std::string(EvictionPolicyName(info.param)); });

}  // namespace
}  // namespace sparsekv
