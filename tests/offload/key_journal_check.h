// A check shared by the tier tests: a tier's KeyJournal (tier.h), applied to a mirror, keeps
// the mirror equal to the tier's ListKeys through puts, replacements, erasures, evictions and a
// corrupt record; a journal past its bound says so.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "sparsekv/tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv::testing {

struct KeyLess {
  bool operator()(const BundleKey& a, const BundleKey& b) const {
    return std::tie(a.namespace_id, a.hash.hi, a.hash.lo) < std::tie(b.namespace_id, b.hash.hi, b.hash.lo);
  }
};
using KeySet = std::set<BundleKey, KeyLess>;

inline void CheckJournalMirrorsListing(Tier& tier, uint64_t keys, uint64_t value_bytes, uint64_t seed,
                                       const std::function<bool(const BundleKey&)>& corrupt = nullptr) {
  auto journal = std::make_shared<KeyJournal>(1 << 20);
  ASSERT_TRUE(tier.SetKeyJournal(journal));
  KeySet mirror;
  {
    auto listed = tier.ListKeys();
    ASSERT_TRUE(listed.has_value());
    mirror.insert(listed->begin(), listed->end());
  }
  auto apply = [&] {
    bool overflowed = true;
    for (const auto& [k, present] : journal->Take(&overflowed)) {
      if (present) {
        mirror.insert(k);
      } else {
        mirror.erase(k);
      }
    }
    EXPECT_FALSE(overflowed);
  };
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 40; ++round) {
    for (int op = 0; op < 25; ++op) {
      const uint64_t k = rng() % keys;
      if (rng() % 4 == 0) {
        tier.Erase({KeyOf(k)}).get();
      } else {
        tier.Put({MakeBundleOfBytes(k, value_bytes, static_cast<uint8_t>(rng()))}).get();
      }
    }
    if (round == 20) {
      auto listed = tier.ListKeys();
      if (corrupt && !listed->empty() && corrupt((*listed)[0])) {
        tier.Get({(*listed)[0]}).get();  // found damaged: dropped
      }
    }
    apply();
    auto listed = tier.ListKeys();
    ASSERT_EQ(mirror, KeySet(listed->begin(), listed->end())) << "round " << round;
  }
  // Past its bound a journal keeps nothing more and says so.
  auto small = std::make_shared<KeyJournal>(3);
  ASSERT_TRUE(tier.SetKeyJournal(small));
  for (uint64_t k = 0; k < 5; ++k) tier.Put({MakeBundleOfBytes(keys + k, value_bytes)}).get();
  bool overflowed = false;
  EXPECT_EQ(small->Take(&overflowed).size(), 3u);
  EXPECT_TRUE(overflowed);
  small->Take(&overflowed);
  EXPECT_FALSE(overflowed);
  ASSERT_TRUE(tier.SetKeyJournal(nullptr));
  tier.Put({MakeBundleOfBytes(keys + 9, value_bytes)}).get();
  EXPECT_TRUE(small->Take(&overflowed).empty());
}

// A tier of `slots` × `slot_bytes` bytes taking records of at most `slot_bytes`.

}  // namespace sparsekv::testing
