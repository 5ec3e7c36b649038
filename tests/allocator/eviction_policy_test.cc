// EvictionPolicy: each policy against a slow reference written from the header's contract
// (std::list and std::map, no shared code), under random operations; and the behaviours that
// make ARC worth having, one by one.
#include "sparsekv/eviction_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <random>
#include <vector>

namespace sparsekv {
namespace {

constexpr uint32_t kNone = EvictionPolicy::kNone;

// The contract, the slow way.
class Reference {
 public:
  Reference(EvictionPolicyKind kind, uint32_t capacity) : kind_(kind), c_(capacity), e_(capacity) {}

  void Add(uint32_t id) {
    Entry& e = e_[id];
    if (e.where != kOut) return;
    if (e.home == kT1 || e.home == kT2) e.home = kOut;
    if (e.prot) {
      Push(kProt, id);
    } else if (kind_ == EvictionPolicyKind::kLru) {
      Push(kT1, id);
    } else {
      Push(e.reused || e.comeback ? kT2 : kT1, id);
      e.comeback = false;
    }
    e.seen = true;
  }
  void Remove(uint32_t id) {
    Entry& e = e_[id];
    if (e.where == kOut) return;
    const int l = e.where;
    Unlink(id);
    if (l != kProt) e.home = l;
  }
  void Evict(uint32_t id) {
    Entry& e = e_[id];
    const int l = e.where;
    Unlink(id);
    if (kind_ == EvictionPolicyKind::kArc && l != kProt && e.key != 0) {
      std::list<uint64_t>& g = l == kT1 ? b1_ : b2_;
      if (g.size() >= c_) g.pop_front();
      g.push_back(e.key);
    }
    Clear(id);
  }
  void Forget(uint32_t id) {
    if (e_[id].where != kOut) Unlink(id);
    e_[id].home = kOut;
    Clear(id);
  }
  void SetKey(uint32_t id, uint64_t key) {
    Entry& e = e_[id];
    e.key = key;
    if (kind_ != EvictionPolicyKind::kArc || key == 0 || e.seen || e.comeback) return;
    for (int g = 0; g < 2; ++g) {
      std::list<uint64_t>& l = g == 0 ? b1_ : b2_;
      auto it = std::find(l.begin(), l.end(), key);
      if (it == l.end()) continue;
      const uint64_t s1 = b1_.size(), s2 = b2_.size();
      if (g == 0) {
        p_ = std::min<uint64_t>(c_, p_ + std::max<uint64_t>(1, s2 / std::max<uint64_t>(1, s1)));
      } else {
        const uint64_t d = std::max<uint64_t>(1, s1 / std::max<uint64_t>(1, s2));
        p_ = p_ > d ? p_ - d : 0;
      }
      l.erase(it);
      e.comeback = true;
      return;
    }
  }
  void MarkReused(uint32_t id) { e_[id].reused = true; }
  void SetParent(uint32_t id, uint32_t parent) {
    Entry& e = e_[id];
    if (e.parent != kNone && e_[e.parent].gen == e.parent_gen && e_[e.parent].kids > 0) --e_[e.parent].kids;
    e.parent = kNone;
    if (parent == kNone || parent >= c_ || parent == id) return;
    e.parent = parent;
    e.parent_gen = e_[parent].gen;
    ++e_[parent].kids;
  }
  void SetProtected(uint32_t id, bool on) {
    Entry& e = e_[id];
    if (e.prot == on) return;
    const bool listed = e.where != kOut;
    if (listed) Remove(id);
    e.prot = on;
    if (listed) Add(id);
  }

  uint32_t Victim() const {
    uint32_t v = kNone;
    if (kind_ == EvictionPolicyKind::kLru) {
      v = lists_[kT1].empty() ? kNone : lists_[kT1].front();
    } else {
      uint64_t t1 = lists_[kT1].size();
      for (const Entry& e : e_) t1 += e.where == kOut && e.home == kT1;
      const int first = t1 > 0 && t1 > p_ ? kT1 : kT2, second = first == kT1 ? kT2 : kT1;
      v = Leaf(first);
      if (v == kNone) v = Leaf(second);
      if (v == kNone && !lists_[first].empty()) v = lists_[first].front();
      if (v == kNone && !lists_[second].empty()) v = lists_[second].front();
    }
    if (v == kNone && !lists_[kProt].empty()) v = lists_[kProt].front();
    return v;
  }
  bool HasDependents(uint32_t id) const { return e_[id].kids > 0; }
  bool Protected(uint32_t id) const { return e_[id].prot; }
  bool Evictable(uint32_t id) const { return e_[id].where != kOut; }
  uint64_t size() const { return lists_[kT1].size() + lists_[kT2].size() + lists_[kProt].size(); }
  uint64_t protected_size() const { return lists_[kProt].size(); }
  uint64_t history() const { return b1_.size() + b2_.size(); }

 private:
  static constexpr int kOut = -1, kProt = 0, kT1 = 1, kT2 = 2;
  struct Entry {
    int where = kOut, home = kOut;
    uint64_t key = 0;
    bool reused = false, prot = false, seen = false, comeback = false;
    uint32_t parent = kNone, parent_gen = 0, gen = 0, kids = 0;
  };
  void Push(int l, uint32_t id) {
    lists_[l].push_back(id);
    e_[id].where = l;
  }
  void Unlink(uint32_t id) {
    lists_[e_[id].where].remove(id);
    e_[id].where = kOut;
  }
  void Clear(uint32_t id) {
    SetParent(id, kNone);
    Entry& e = e_[id];
    e.kids = 0;
    ++e.gen;
    e.key = 0;
    e.reused = e.prot = e.seen = e.comeback = false;
  }
  uint32_t Leaf(int l) const {
    int n = 0;
    for (uint32_t id : lists_[l]) {
      if (n++ == static_cast<int>(EvictionPolicy::kLeafScan)) break;
      if (e_[id].kids == 0) return id;
    }
    return kNone;
  }

  EvictionPolicyKind kind_;
  uint64_t c_;
  std::vector<Entry> e_;
  std::list<uint32_t> lists_[3];
  std::list<uint64_t> b1_, b2_;
  uint64_t p_ = 0;
};

class PolicyTest : public ::testing::TestWithParam<EvictionPolicyKind> {};

// Random operations on both, comparing every answer. Keys repeat (content comes back), parents
// form chains, hints come and go, and the owner's order of calls is what a pool's is: content
// is told while the entry is in use, Add after, Evict only of the victim.
TEST_P(PolicyTest, MatchesTheReferenceUnderRandomOperations) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const uint32_t cap = seed % 2 ? 24 : 64;
    auto policy = EvictionPolicy::Create(GetParam(), cap);
    Reference ref(GetParam(), cap);
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> in_use(cap, 0), filled(cap, 0);
    std::vector<uint64_t> keys(cap, 0);
    uint64_t evictions = 0, comebacks_possible = 0;
    for (int step = 0; step < 20000; ++step) {
      const uint32_t id = static_cast<uint32_t>(rng() % cap);
      switch (rng() % 9) {
        case 0:  // fill a free entry with content (a key from a small space, so keys come back;
                 // never one a filled entry holds, as a cache holds one copy of a block)
          if (!filled[id]) {
            const uint64_t key = 1 + rng() % (cap * 3);
            bool held = false;
            for (uint32_t i = 0; i < cap; ++i) held = held || (filled[i] && keys[i] == key);
            if (held) break;
            keys[id] = key;
            policy->SetKey(id, key);
            ref.SetKey(id, key);
            const uint32_t parent = static_cast<uint32_t>(rng() % cap);
            if (filled[parent] && parent != id && rng() % 2) {
              policy->SetParent(id, parent);
              ref.SetParent(id, parent);
            }
            filled[id] = in_use[id] = 1;
          }
          break;
        case 1:
        case 2:  // release to the cache
          if (filled[id] && in_use[id]) {
            policy->Add(id);
            ref.Add(id);
            in_use[id] = 0;
          }
          break;
        case 3:  // a hit takes it back
          if (filled[id] && !in_use[id]) {
            policy->Remove(id);
            ref.Remove(id);
            policy->MarkReused(id);
            ref.MarkReused(id);
            in_use[id] = 1;
          }
          break;
        case 4:
        case 5: {  // an allocation evicts
          const uint32_t v = policy->Victim();
          ASSERT_EQ(v, ref.Victim()) << "seed " << seed << " step " << step;
          if (v != kNone) {
            policy->Evict(v);
            ref.Evict(v);
            filled[v] = in_use[v] = 0;
            ++evictions;
          }
          break;
        }
        case 6:  // dropped without eviction (freed, or a record's other page)
          if (filled[id] && rng() % 4 == 0) {
            policy->Forget(id);
            ref.Forget(id);
            filled[id] = in_use[id] = 0;
          }
          break;
        case 7:  // a hint starts or ends
          if (filled[id]) {
            const bool on = rng() % 2;
            policy->SetProtected(id, on);
            ref.SetProtected(id, on);
          }
          break;
        case 8:  // a new parent link (a chain registered later)
          if (filled[id]) {
            const uint32_t parent = static_cast<uint32_t>(rng() % cap);
            if (filled[parent]) {
              policy->SetParent(id, parent);
              ref.SetParent(id, parent);
            }
          }
          break;
      }
      ASSERT_EQ(policy->Victim(), ref.Victim()) << "seed " << seed << " step " << step;
      ASSERT_EQ(policy->size(), ref.size());
      ASSERT_EQ(policy->protected_size(), ref.protected_size());
      if (step % 97 == 0) {
        ASSERT_TRUE(policy->Check().ok()) << policy->Check().ToString();
        for (uint32_t i = 0; i < cap; ++i) {
          ASSERT_EQ(policy->HasDependents(i), ref.HasDependents(i)) << "id " << i << " step " << step;
          ASSERT_EQ(policy->Protected(i), ref.Protected(i));
          ASSERT_EQ(policy->Evictable(i), ref.Evictable(i));
        }
        if (GetParam() == EvictionPolicyKind::kArc) {
          ASSERT_EQ(policy->history_size(), ref.history()) << "seed " << seed << " step " << step;
        }
      }
      comebacks_possible += GetParam() == EvictionPolicyKind::kArc && ref.history() > 0;
    }
    EXPECT_GT(evictions, 1000u);
    if (GetParam() == EvictionPolicyKind::kArc) {
      EXPECT_GT(comebacks_possible, 0u);
    }
    ASSERT_TRUE(policy->Check().ok()) << policy->Check().ToString();
  }
}

// Hints never make eviction fail: protected entries go last, oldest first.
TEST_P(PolicyTest, ProtectedEntriesGoLastButDoGo) {
  auto p = EvictionPolicy::Create(GetParam(), 8);
  for (uint32_t i = 0; i < 4; ++i) p->SetProtected(i, true);
  for (uint32_t i = 0; i < 8; ++i) p->Add(i);
  EXPECT_EQ(p->protected_size(), 4u);
  std::vector<uint32_t> order;
  for (uint32_t v = p->Victim(); v != kNone; v = p->Victim()) {
    order.push_back(v);
    p->Evict(v);
  }
  EXPECT_EQ(order, (std::vector<uint32_t>{4, 5, 6, 7, 0, 1, 2, 3}));
  EXPECT_EQ(p->size(), 0u);
  EXPECT_FALSE(p->Protected(0)) << "eviction clears what the owner told";
}

INSTANTIATE_TEST_SUITE_P(Policies, PolicyTest, ::testing::ValuesIn(AllEvictionPolicies()),
                         [](const auto& info) { return std::string(EvictionPolicyName(info.param)); });

TEST(EvictionPolicy, NamesRoundTripAndUnknownNamesAreRefused) {
  for (EvictionPolicyKind k : AllEvictionPolicies()) {
    auto parsed = ParseEvictionPolicy(EvictionPolicyName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  auto bad = ParseEvictionPolicy("lfu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("lru or arc"), std::string_view::npos);
}

TEST(EvictionPolicy, LruEvictsInReleaseOrderAndIgnoresHistory) {
  auto p = EvictionPolicy::Create(EvictionPolicyKind::kLru, 4);
  for (uint32_t i = 0; i < 4; ++i) {
    p->SetKey(i, 100 + i);
    p->Add(i);
  }
  p->Remove(0);
  p->MarkReused(0);
  p->Add(0);  // 0 is now the most recent
  EXPECT_EQ(p->Victim(), 1u);
  p->SetParent(2, 1);  // LRU does not care
  EXPECT_EQ(p->Victim(), 1u);
  p->Evict(1);
  EXPECT_EQ(p->history_size(), 0u);
}

// A scan of content used once does not flush what is read again and again: ARC keeps reused
// entries in T2 while the scan cycles through T1, where LRU loses them.
TEST(EvictionPolicy, ArcResistsAScanThatFlushesLru) {
  constexpr uint32_t kCap = 16;
  for (EvictionPolicyKind kind : AllEvictionPolicies()) {
    auto p = EvictionPolicy::Create(kind, kCap);
    // Entries 0..3 are hot: filled, cached, hit, cached again.
    for (uint32_t i = 0; i < 4; ++i) {
      p->SetKey(i, 1000 + i);
      p->Add(i);
      p->Remove(i);
      p->MarkReused(i);
      p->Add(i);
    }
    // A scan: every other slot is refilled with new content, over and over.
    uint32_t hot_evicted = 0;
    uint64_t key = 5000;
    std::vector<uint8_t> used(kCap, 0);
    for (uint32_t i = 0; i < 4; ++i) used[i] = 1;
    for (uint32_t i = 4; i < kCap; ++i) {
      p->SetKey(i, key++);
      p->Add(i);
      used[i] = 1;
    }
    for (int round = 0; round < 100; ++round) {
      const uint32_t v = p->Victim();
      ASSERT_NE(v, kNone);
      hot_evicted += v < 4;
      p->Evict(v);
      p->SetKey(v, key++);  // the slot gets new, never-seen content
      p->Add(v);
    }
    if (kind == EvictionPolicyKind::kLru) {
      EXPECT_GT(hot_evicted, 0u) << "LRU loses the hot entries to the scan";
    } else {
      EXPECT_EQ(hot_evicted, 0u) << "ARC keeps them";
    }
  }
}

// Content evicted from T1 that comes back while remembered joins T2 (it is reused after all).
TEST(EvictionPolicy, ArcRemembersEvictedKeys) {
  auto p = EvictionPolicy::Create(EvictionPolicyKind::kArc, 4);
  for (uint32_t i = 0; i < 4; ++i) {
    p->SetKey(i, 10 + i);
    p->Add(i);
  }
  const uint32_t v = p->Victim();
  ASSERT_EQ(v, 0u);
  p->Evict(v);
  EXPECT_EQ(p->history_size(), 1u);
  p->SetKey(0, 10);  // the same content, recomputed into the same slot
  EXPECT_EQ(p->history_size(), 0u) << "the ghost is consumed";
  p->Add(0);
  // 0 is in T2 now: T1 (1, 2, 3) goes first although 0 is the most recent.
  EXPECT_EQ(p->Victim(), 1u);
  ASSERT_TRUE(p->Check().ok()) << p->Check().ToString();
}

// A parent is passed over while an entry depends on it, and becomes evictable once it does not.
TEST(EvictionPolicy, ArcEvictsTheTailOfAChainBeforeItsHead) {
  auto p = EvictionPolicy::Create(EvictionPolicyKind::kArc, 8);
  for (uint32_t i = 0; i < 4; ++i) p->SetKey(i, 1 + i);
  for (uint32_t i = 1; i < 4; ++i) p->SetParent(i, i - 1);
  // Released head first (the wrong order for LRU): 0 is the oldest.
  for (uint32_t i = 0; i < 4; ++i) p->Add(i);
  EXPECT_TRUE(p->HasDependents(0));
  std::vector<uint32_t> order;
  for (uint32_t v = p->Victim(); v != kNone; v = p->Victim()) {
    order.push_back(v);
    p->Evict(v);
  }
  EXPECT_EQ(order, (std::vector<uint32_t>{3, 2, 1, 0}));
  // A stale link: the parent's slot was reused, its new content has no dependents.
  p->SetKey(0, 50);
  p->SetKey(1, 51);
  p->SetParent(1, 0);
  p->Evict(0);  // (as Forget after a drop; not evictable, so only cleared)
  p->SetKey(0, 60);
  EXPECT_FALSE(p->HasDependents(0)) << "a link to the slot's earlier content does not count";
  ASSERT_TRUE(p->Check().ok()) << p->Check().ToString();
}

TEST(EvictionPolicy, GrowKeepsTheOrder) {
  for (EvictionPolicyKind kind : AllEvictionPolicies()) {
    auto p = EvictionPolicy::Create(kind, 2);
    p->Add(0);
    p->Add(1);
    p->Grow(6);
    EXPECT_EQ(p->capacity(), 6u);
    p->Add(5);
    EXPECT_EQ(p->Victim(), 0u);
    EXPECT_EQ(p->size(), 3u);
    ASSERT_TRUE(p->Check().ok()) << p->Check().ToString();
  }
}

}  // namespace
}  // namespace sparsekv
