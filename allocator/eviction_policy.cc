#include "sparsekv/eviction_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

namespace sparsekv {

std::string_view EvictionPolicyName(EvictionPolicyKind kind) {
  switch (kind) {
    case EvictionPolicyKind::kLru: return "lru";
    case EvictionPolicyKind::kArc: return "arc";
  }
  return "?";
}

Result<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name) {
  for (EvictionPolicyKind k : AllEvictionPolicies()) {
    if (name == EvictionPolicyName(k)) return k;
  }
  return Status::InvalidArgument(fmt::format("unknown eviction policy '{}': expected lru or arc", name));
}

std::vector<EvictionPolicyKind> AllEvictionPolicies() {
  return {EvictionPolicyKind::kLru, EvictionPolicyKind::kArc};
}

// ---------------------------------------------------------------------------------------------
// The shared part: lists over one pair of link arrays, flags, protection.

EvictionPolicy::EvictionPolicy(uint32_t capacity) : capacity_(0) { GrowLinks(capacity); }

void EvictionPolicy::Grow(uint32_t capacity) {
  if (capacity <= capacity_) return;
  GrowLinks(capacity);
  PolicyGrow(capacity);
}

void EvictionPolicy::GrowLinks(uint32_t capacity) {
  e_.resize(capacity, Entry{});
  capacity_ = capacity;
}

void EvictionPolicy::PushBack(uint8_t l, uint32_t id) {
  List& L = lists_[l];
  e_[id].prev = L.tail;
  e_[id].next = kNone;
  if (L.tail != kNone) {
    e_[L.tail].next = id;
  } else {
    L.head = id;
  }
  L.tail = id;
  ++L.size;
  e_[id].where = l;
}

void EvictionPolicy::Unlink(uint32_t id) {
  List& L = lists_[e_[id].where];
  const uint32_t p = e_[id].prev, n = e_[id].next;
  if (p != kNone) {
    e_[p].next = n;
  } else {
    L.head = n;
  }
  if (n != kNone) {
    e_[n].prev = p;
  } else {
    L.tail = p;
  }
  e_[id].prev = e_[id].next = kNone;
  --L.size;
  e_[id].where = kOut;
}

uint32_t EvictionPolicy::OldestLeaf(uint8_t l) const {
  uint32_t id = lists_[l].head;
  for (uint32_t n = 0; n < kLeafScan && id != kNone; ++n, id = e_[id].next) {
    if (e_[id].kids == 0) return id;
  }
  return kNone;
}

void EvictionPolicy::Add(uint32_t id) {
  if (e_[id].where != kOut) return;  // already evictable: the owner's bug; keep the order sane
  ClearHome(id);
  ++size_;
  if (e_[id].flags & kProtected) {
    PushBack(kProtectedList, id);
  } else {
    PolicyAdd(id);
  }
  e_[id].flags |= kSeen;
}

void EvictionPolicy::Remove(uint32_t id) {
  const uint8_t l = e_[id].where;
  if (l == kOut) return;
  Unlink(id);
  --size_;
  if (l >= kFirstPolicyList) {
    e_[id].home = l;
    ++away_[l];
  }
}

void EvictionPolicy::ClearHome(uint32_t id) {
  if (e_[id].home == kOut) return;
  --away_[e_[id].home];
  e_[id].home = kOut;
}

uint32_t EvictionPolicy::Victim() const {
  const uint32_t v = PolicyVictim();
  return v != kNone ? v : lists_[kProtectedList].head;
}

void EvictionPolicy::Evict(uint32_t id) {
  const uint8_t l = e_[id].where;
  if (l != kOut) {
    Unlink(id);
    --size_;
    if (l != kProtectedList) PolicyEvicted(id, l);
  }
  Clear(id);
}

void EvictionPolicy::Forget(uint32_t id) {
  Remove(id);
  ClearHome(id);
  Clear(id);
}

void EvictionPolicy::Clear(uint32_t id) {
  SetParent(id, kNone);
  e_[id].kids = 0;
  ++e_[id].gen;  // its dependents' links go stale
  e_[id].key = 0;
  e_[id].flags = 0;
  e_[id].extra = 0;
}

void EvictionPolicy::SetParent(uint32_t id, uint32_t parent) {
  const uint32_t old = e_[id].parent;
  if (old != kNone && e_[old].gen == e_[id].parent_gen && e_[old].kids > 0) --e_[old].kids;
  e_[id].parent = parent;
  if (parent == kNone || parent >= capacity_ || parent == id) {
    e_[id].parent = kNone;
    return;
  }
  e_[id].parent_gen = e_[parent].gen;
  ++e_[parent].kids;
}

void EvictionPolicy::SetProtected(uint32_t id, bool on) {
  if (Protected(id) == on) return;
  const bool listed = e_[id].where != kOut;
  if (listed) Remove(id);
  e_[id].flags = on ? (e_[id].flags | kProtected) : (e_[id].flags & ~kProtected);
  if (listed) Add(id);  // protected: to its list; no longer: back as the most recent
}

Status EvictionPolicy::Check() const {
  uint64_t total = 0;
  for (uint8_t l = kProtectedList; l < kMaxLists; ++l) {
    const List& L = lists_[l];
    uint64_t n = 0;
    uint32_t prev = kNone;
    for (uint32_t id = L.head; id != kNone; prev = id, id = e_[id].next) {
      if (id >= capacity_) return Status::Internal(fmt::format("eviction list {} holds id {} out of range", l, id));
      if (e_[id].where != l) return Status::Internal(fmt::format("id {} is linked in list {} but marked {}", id, l, e_[id].where));
      if (e_[id].prev != prev) return Status::Internal(fmt::format("id {}: broken back link in list {}", id, l));
      if (l == kProtectedList && !(e_[id].flags & kProtected)) {
        return Status::Internal(fmt::format("id {} is in the protected list but not protected", id));
      }
      if (l != kProtectedList && (e_[id].flags & kProtected)) {
        return Status::Internal(fmt::format("protected id {} is in the policy's list {}", id, l));
      }
      if (++n > capacity_) return Status::Internal(fmt::format("eviction list {} loops", l));
    }
    if (prev != L.tail) return Status::Internal(fmt::format("eviction list {}: tail is not its last entry", l));
    if (n != L.size) return Status::Internal(fmt::format("eviction list {} counts {} but links {}", l, L.size, n));
    total += n;
  }
  if (total != size_) return Status::Internal(fmt::format("eviction lists hold {} ids, size says {}", total, size_));
  uint64_t away[kMaxLists] = {};
  for (uint32_t id = 0; id < capacity_; ++id) {
    if (e_[id].home == kOut) continue;
    if (e_[id].where != kOut) return Status::Internal(fmt::format("id {} is evictable but marked taken from list {}", id, e_[id].home));
    if (e_[id].home >= kMaxLists) return Status::Internal(fmt::format("id {} was taken from list {}, out of range", id, e_[id].home));
    ++away[e_[id].home];
  }
  for (uint8_t l = 0; l < kMaxLists; ++l) {
    if (away[l] != away_[l]) return Status::Internal(fmt::format("list {} counts {} entries in use, {} are marked", l, away_[l], away[l]));
  }
  std::vector<uint32_t> kids(capacity_, 0);
  for (uint32_t id = 0; id < capacity_; ++id) {
    const uint32_t p = e_[id].parent;
    if (p != kNone && e_[p].gen == e_[id].parent_gen) ++kids[p];
  }
  for (uint32_t id = 0; id < capacity_; ++id) {
    if (kids[id] != e_[id].kids) return Status::Internal(fmt::format("id {} counts {} dependents; {} name it", id, e_[id].kids, kids[id]));
  }
  return PolicyCheck();
}

namespace {

// ---------------------------------------------------------------------------------------------
// LRU

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(uint32_t capacity) : EvictionPolicy(capacity) {}
  EvictionPolicyKind kind() const override { return EvictionPolicyKind::kLru; }
  bool UsesLineage() const override { return false; }

 private:
  static constexpr uint8_t kOrder = kFirstPolicyList;
  void PolicyAdd(uint32_t id) override { PushBack(kOrder, id); }
  uint32_t PolicyVictim() const override { return list(kOrder).head; }
  void PolicyEvicted(uint32_t, uint8_t) override {}
  void PolicyGrow(uint32_t) override {}
};

// ---------------------------------------------------------------------------------------------
// ARC. Ghosts are nodes of their own (a key outlives its entry, whose id is reused at once),
// found by key in an open-addressing table with linear probing and backward-shift deletion.

class ArcPolicy final : public EvictionPolicy {
 public:
  explicit ArcPolicy(uint32_t capacity) : EvictionPolicy(capacity) { PolicyGrow(capacity); }
  EvictionPolicyKind kind() const override { return EvictionPolicyKind::kArc; }
  bool UsesLineage() const override { return true; }
  uint64_t history_size() const override { return ghost_[0].size + ghost_[1].size; }

 private:
  static constexpr uint8_t kT1 = kFirstPolicyList, kT2 = kFirstPolicyList + 1;
  static constexpr uint32_t kEmpty = UINT32_MAX;

  // A remembered key: its place in B1 or B2, and its mixed hash (the table's home of it).
  struct Ghost {
    uint64_t key = 0;
    uint32_t prev = kEmpty, next = kEmpty;
    uint32_t hash = 0;
    uint8_t list = 0;
  };
  struct Slot {
    uint32_t hash = 0;  // low bits of the key's mix: its home and a quick filter
    uint32_t node = kEmpty;
  };

  struct GhostList {
    uint32_t head = kEmpty, tail = kEmpty;
    uint64_t size = 0;
  };

  void PolicyGrow(uint32_t capacity) override {
    // Each ghost list holds at most `capacity` keys; the table stays at most a quarter full, so
    // that probe runs (and backward shifts) stay short.
    const uint64_t nodes = uint64_t{capacity} * 2;
    if (nodes <= ghosts_.size()) return;
    const uint64_t old = ghosts_.size();
    ghosts_.resize(nodes, Ghost{});
    for (uint64_t n = nodes; n-- > old;) free_nodes_.push_back(static_cast<uint32_t>(n));
    const uint64_t slots = std::bit_ceil(std::max<uint64_t>(16, nodes * 4));
    table_.assign(slots, Slot{});
    mask_ = slots - 1;
    for (int g = 0; g < 2; ++g) {
      for (uint32_t n = ghost_[g].head; n != kEmpty; n = ghosts_[n].next) TableInsert(n);
    }
  }

  // ---- the policy ----
  // Content evicted recently is back: the list it left was too small. Its entry will join T2.
  void PolicyKeyed(uint32_t id) override {
    if (seen(id) || extra(id)) return;
    const uint32_t g = TableFind(key(id));
    if (g == kEmpty) return;
    const uint64_t c = capacity(), b1 = ghost_[0].size, b2 = ghost_[1].size;
    if (ghosts_[g].list == 0) {
      p_ = std::min<uint64_t>(c, p_ + std::max<uint64_t>(1, b2 / std::max<uint64_t>(1, b1)));
    } else {
      const uint64_t d = std::max<uint64_t>(1, b1 / std::max<uint64_t>(1, b2));
      p_ = p_ > d ? p_ - d : 0;
    }
    DropGhost(g);
    extra(id) = 1;
  }
  void PolicyPrefetch(uint64_t key) const override { __builtin_prefetch(&table_[static_cast<uint32_t>(Mix(key)) & mask_], 0); }
  // extra(id): its key was found in the history, and it has not joined T2 yet (Clear zeroes it).

  void PolicyAdd(uint32_t id) override {
    PushBack(reused(id) || extra(id) ? kT2 : kT1, id);
    extra(id) = 0;
  }

  uint32_t PolicyVictim() const override {
    const uint64_t t1 = members(kT1);
    const uint8_t first = t1 > 0 && t1 > p_ ? kT1 : kT2;
    const uint8_t second = first == kT1 ? kT2 : kT1;
    uint32_t v = OldestLeaf(first);
    if (v == kNone) v = OldestLeaf(second);
    if (v == kNone) v = list(first).head;
    if (v == kNone) v = list(second).head;
    return v;
  }

  void PolicyEvicted(uint32_t id, uint8_t l) override {
    const uint64_t k = key(id);
    if (k == 0) return;
    // (A key is cached at most once, and its ghost goes when it comes back: no ghost of it now.)
    const int g = l == kT1 ? 0 : 1;
    if (ghost_[g].size >= capacity() || free_nodes_.empty()) DropGhost(ghost_[g].head != kEmpty ? ghost_[g].head : ghost_[1 - g].head);
    const uint32_t n = free_nodes_.back();
    free_nodes_.pop_back();
    ghosts_[n].key = k;
    ghosts_[n].hash = static_cast<uint32_t>(Mix(k));
    ghosts_[n].list = static_cast<uint8_t>(g);
    GhostList& L = ghost_[g];
    ghosts_[n].prev = L.tail;
    ghosts_[n].next = kEmpty;
    if (L.tail != kEmpty) {
      ghosts_[L.tail].next = n;
    } else {
      L.head = n;
    }
    L.tail = n;
    ++L.size;
    TableInsert(n);
    // The next eviction from this list drops its oldest ghost: start loading what that touches
    // (the node after the head now, and the head's table slot), so the drop finds it cached.
    const uint32_t h = L.head;
    if (h != kEmpty) {
      __builtin_prefetch(&table_[ghosts_[h].hash & mask_], 1);
      if (ghosts_[h].next != kEmpty) __builtin_prefetch(&ghosts_[ghosts_[h].next], 1);
    }
  }

  Status PolicyCheck() const override {
    uint64_t total = 0;
    for (int g = 0; g < 2; ++g) {
      uint64_t n = 0;
      for (uint32_t x = ghost_[g].head; x != kEmpty; x = ghosts_[x].next) {
        if (ghosts_[x].list != g) return Status::Internal(fmt::format("arc: ghost node {} in list B{} marked B{}", x, g + 1, ghosts_[x].list + 1));
        if (!TableHas(x)) return Status::Internal(fmt::format("arc: ghost node {} is not found by its key", x));
        if (++n > ghosts_.size()) return Status::Internal("arc: a ghost list loops");
      }
      if (n != ghost_[g].size) return Status::Internal(fmt::format("arc: ghost list B{} counts {} but links {}", g + 1, ghost_[g].size, n));
      if (n > capacity()) return Status::Internal(fmt::format("arc: ghost list B{} holds {} keys, above capacity {}", g + 1, n, capacity()));
      total += n;
    }
    uint64_t in_table = 0;
    for (const Slot& s : table_) in_table += s.node != kEmpty;
    if (in_table != total) return Status::Internal(fmt::format("arc: {} ghosts but {} table slots used", total, in_table));
    if (total + free_nodes_.size() != ghosts_.size()) return Status::Internal("arc: ghost nodes leaked");
    if (p_ > capacity()) return Status::Internal(fmt::format("arc: target {} above capacity {}", p_, capacity()));
    for (uint32_t id = 0; id < capacity(); ++id) {
      // (A protected one keeps the mark until it joins the policy's lists.)
      if (extra(id) && Evictable(id) && where(id) != kProtectedList) {
        return Status::Internal(fmt::format("arc: id {} is in T1 or T2 but still marked as back from the history", id));
      }
    }
    return Status::OK();
  }

  // ---- ghosts ----
  void DropGhost(uint32_t n) {
    TableErase(n);
    GhostList& L = ghost_[ghosts_[n].list];
    const uint32_t p = ghosts_[n].prev, x = ghosts_[n].next;
    if (p != kEmpty) {
      ghosts_[p].next = x;
    } else {
      L.head = x;
    }
    if (x != kEmpty) {
      ghosts_[x].prev = p;
    } else {
      L.tail = p;
    }
    --L.size;
    ghosts_[n].prev = ghosts_[n].next = kEmpty;
    free_nodes_.push_back(n);
  }

  static uint64_t Mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
  }
  uint32_t TableFind(uint64_t k) const {
    const uint32_t h = static_cast<uint32_t>(Mix(k));
    for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = table_[i];
      if (s.node == kEmpty) return kEmpty;
      if (s.hash == h && ghosts_[s.node].key == k) return s.node;
    }
  }
  bool TableHas(uint32_t n) const {
    for (uint64_t i = ghosts_[n].hash & mask_;; i = (i + 1) & mask_) {
      if (table_[i].node == kEmpty) return false;
      if (table_[i].node == n) return true;
    }
  }
  void TableInsert(uint32_t n) {
    const uint32_t h = ghosts_[n].hash;
    uint64_t i = h & mask_;
    while (table_[i].node != kEmpty) i = (i + 1) & mask_;
    table_[i] = Slot{h, n};
  }
  void TableErase(uint32_t n) {
    uint64_t i = ghosts_[n].hash & mask_;
    while (table_[i].node != n) i = (i + 1) & mask_;
    // Backward shift: pull later members of the probe run into the hole when their home lets them.
    for (uint64_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      const Slot m = table_[j];
      if (m.node == kEmpty) break;
      const uint64_t home = m.hash & mask_;
      // m may move to i when i lies cyclically in [home, j).
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        table_[i] = m;
        i = j;
      }
    }
    table_[i] = Slot{};
  }

  uint64_t p_ = 0;  // target size of T1
  GhostList ghost_[2];
  std::vector<Ghost> ghosts_;
  std::vector<uint32_t> free_nodes_;
  std::vector<Slot> table_;
  uint64_t mask_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> EvictionPolicy::Create(EvictionPolicyKind kind, uint32_t capacity) {
  switch (kind) {
    case EvictionPolicyKind::kLru: return std::make_unique<LruPolicy>(capacity);
    case EvictionPolicyKind::kArc: return std::make_unique<ArcPolicy>(capacity);
  }
  return std::make_unique<LruPolicy>(capacity);
}

}  // namespace sparsekv
