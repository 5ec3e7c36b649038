// EvictionPolicy: which evictable entry goes first, behind one interface (the page pools under
// CacheManager and the host and SSD offload tiers use it).
//
// An owner names its entries by dense ids in [0, capacity) (page ids, entry slots) and tells the
// policy when an entry becomes evictable (Add), when it is taken back into use (Remove), when it
// is evicted (Evict: remembered in the policy's history) and when it is dropped without eviction
// (Forget). Victim names the entry to evict next without changing anything. Every operation is
// constant time (Victim looks at a bounded number of entries) and none allocates: all state is
// sized by the capacity at construction or by Grow.
//
// What an owner may tell about an entry, kept until the entry is evicted or forgotten:
//   - SetKey: the identity of its content (a block hash). A policy with a history (ARC's ghost
//     lists) looks it up there and then, and recognizes content evicted recently that comes back.
//   - MarkReused: it was read or taken back since it was filled (a hit). ARC keeps reused
//     entries apart from entries used once, so that a scan of one-off content cannot flush the
//     entries that are read again and again.
//   - SetParent: the entry extends another one (a block after its parent block in a prefix
//     chain), so the parent has a dependent while this entry holds content. Evicting a parent
//     would make its dependents useless, so a policy that honours it prefers, among the few
//     oldest of a list, an entry without dependents. The count follows at once when a
//     dependent is evicted or forgotten, and a parent evicted first (its id reused) is told
//     apart by a generation number.
//   - SetProtected: a scheduler said it will be read soon (a hint). A protected evictable entry
//     is out of the policy's order, in a list of its own, and becomes the victim only when no
//     other entry is evictable: hints never make an allocation fail. The owner bounds how many
//     entries it protects.
//
// Policies:
//   lru  least recently made evictable first. Dependents and history are ignored: it is the
//        reference every other policy is measured against.
//   arc  Adaptive Replacement Cache (Megiddo and Modha, FAST 2003): T1 holds entries used once,
//        T2 entries reused; ghost lists B1 and B2 remember the keys evicted from each (at most
//        `capacity` keys each), and a key coming back from B1 (B2) grows (shrinks) T1's target
//        share p. T1 and T2 count every entry they hold, evictable or taken into use since (a
//        running request's hits are still in the cache). The victim comes from T1 while it is
//        above p, else from T2: the oldest of that list's first kLeafScan entries without
//        dependents (a prefix cache evicts the tail of a chain before its head), else the same
//        in the other list, else the oldest of the first list.
//
// Not thread-safe: the owner's lock guards it.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

enum class EvictionPolicyKind : uint8_t { kLru = 0, kArc = 1 };

// The policy caches use unless told otherwise: the best measured (README, "Eviction").
inline constexpr EvictionPolicyKind kDefaultEvictionPolicy = EvictionPolicyKind::kArc;

std::string_view EvictionPolicyName(EvictionPolicyKind kind);
// "lru" or "arc"; anything else is InvalidArgument naming the choices.
Result<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name);
// Every kind, in declaration order (tests and tools that try each).
std::vector<EvictionPolicyKind> AllEvictionPolicies();

class EvictionPolicy {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;
  // Entries a policy that honours dependents looks at per list before giving up on them.
  static constexpr uint32_t kLeafScan = 8;

  static std::unique_ptr<EvictionPolicy> Create(EvictionPolicyKind kind, uint32_t capacity);
  virtual ~EvictionPolicy() = default;
  EvictionPolicy(const EvictionPolicy&) = delete;
  EvictionPolicy& operator=(const EvictionPolicy&) = delete;

  virtual EvictionPolicyKind kind() const = 0;
  // Whether keys and parents change anything (an owner may skip telling them when not).
  virtual bool UsesLineage() const = 0;
  uint32_t capacity() const { return capacity_; }
  // Ids up to `capacity` become valid (never shrinks). Allocates; the only call that does.
  void Grow(uint32_t capacity);

  // `id` becomes evictable (it must not be). It joins the policy's order as the most recent, or
  // the protected list when protected.
  void Add(uint32_t id);
  // `id` is no longer evictable (taken back into use). What the owner told about it stays, and
  // so does its membership of the policy's list for the list's share (ARC sizes its lists by
  // every entry they hold, in use or not): Add puts it back.
  void Remove(uint32_t id);
  // The evictable entry to evict next: kNone when none is. Changes nothing.
  uint32_t Victim() const;
  // `id` (evictable) is evicted: out, its key remembered in the history; what the owner told
  // about it is cleared.
  void Evict(uint32_t id);
  // `id` is dropped without eviction, evictable or not: out if it was, no history, cleared.
  void Forget(uint32_t id);

  // A policy with a history looks the key up here, where an owner tells many at once (after
  // Prefetch of each), rather than when the entry first becomes evictable.
  void SetKey(uint32_t id, uint64_t key) {
    e_[id].key = key;
    if (key != 0) PolicyKeyed(id);
  }
  // Starts the memory loads that SetKey(_, key) and SetParent(_, parent) will need.
  void Prefetch(uint64_t key, uint32_t parent) const {
    if (parent < capacity_) {
      __builtin_prefetch(&e_[parent], 1);
    }
    if (key != 0) PolicyPrefetch(key);
  }
  uint64_t key(uint32_t id) const { return e_[id].key; }
  void MarkReused(uint32_t id) { e_[id].flags |= kReused; }
  // `id` depends on `parent` (kNone: on nothing) from now until either is evicted or forgotten.
  void SetParent(uint32_t id, uint32_t parent);
  void SetProtected(uint32_t id, bool on);
  // Whether `id` became evictable at least once since it got its content.
  bool Seen(uint32_t id) const { return (e_[id].flags & kSeen) != 0; }
  bool Evictable(uint32_t id) const { return e_[id].where != kOut; }
  bool Protected(uint32_t id) const { return (e_[id].flags & kProtected) != 0; }
  bool HasDependents(uint32_t id) const { return e_[id].kids != 0; }

  // Calls fn(id) for every evictable entry, roughly in the order the policy would evict them
  // (each of its lists oldest first, the protected list last). For listings, not for victims.
  template <class Fn>
  void ForEachEvictable(Fn&& fn) const {
    for (uint8_t l = kFirstPolicyList; l <= kMaxLists; ++l) {
      const uint8_t list = l == kMaxLists ? kProtectedList : l;
      for (uint32_t id = lists_[list].head; id != kNone; id = e_[id].next) fn(id);
    }
  }

  // Evictable entries, and how many of them are protected.
  uint64_t size() const { return size_; }
  uint64_t protected_size() const { return lists_[kProtectedList].size; }
  // Keys remembered in the history (ghosts).
  virtual uint64_t history_size() const { return 0; }
  // The policy's own bookkeeping: list links, sizes and the history table agree.
  Status Check() const;

 protected:
  // Where an id is: out (not evictable), or in one of the lists. Lists 1.. are the policy's.
  static constexpr uint8_t kOut = 0;
  static constexpr uint8_t kProtectedList = 1;
  static constexpr uint8_t kFirstPolicyList = 2;
  static constexpr uint8_t kMaxLists = 4;
  // kSeen: added before since it got its content (a later Add is a return from use, never a
  // comeback from the history, so ARC skips the history lookup).
  static constexpr uint8_t kReused = 1, kProtected = 2, kSeen = 4;

  struct List {
    uint32_t head = kNone, tail = kNone;
    uint64_t size = 0;
  };

  explicit EvictionPolicy(uint32_t capacity);

  // The policy's part: `id` joins its order (not protected), leaves it, is its victim, is evicted.
  virtual void PolicyAdd(uint32_t id) = 0;
  virtual uint32_t PolicyVictim() const = 0;
  virtual void PolicyEvicted(uint32_t id, uint8_t list) = 0;
  virtual void PolicyGrow(uint32_t capacity) = 0;
  virtual void PolicyKeyed(uint32_t) {}
  virtual void PolicyPrefetch(uint64_t) const {}
  virtual Status PolicyCheck() const { return Status::OK(); }

  void PushBack(uint8_t list, uint32_t id);
  void Unlink(uint32_t id);
  // The oldest of the first kLeafScan entries of `list` without dependents, else kNone.
  uint32_t OldestLeaf(uint8_t list) const;
  const List& list(uint8_t l) const { return lists_[l]; }
  // Entries of list l: evictable ones and those taken into use from it since.
  uint64_t members(uint8_t l) const { return lists_[l].size + away_[l]; }
  // The list `id` was taken from into use (kOut: none).
  uint8_t home(uint32_t id) const { return e_[id].home; }
  uint8_t where(uint32_t id) const { return e_[id].where; }
  bool reused(uint32_t id) const { return (e_[id].flags & kReused) != 0; }
  bool seen(uint32_t id) const { return (e_[id].flags & kSeen) != 0; }
  // A byte per id the policy may use as it likes; zeroed when the id loses its content.
  uint8_t& extra(uint32_t id) { return e_[id].extra; }
  uint8_t extra(uint32_t id) const { return e_[id].extra; }

 private:
  void GrowLinks(uint32_t capacity);
  void ClearHome(uint32_t id);
  // `id` loses its content: its parent loses a dependent, its dependents lose their parent.
  void Clear(uint32_t id);

  uint32_t capacity_;
  uint64_t size_ = 0;
  List lists_[kMaxLists];
  uint64_t away_[kMaxLists] = {};
  // Everything about one id in one cache line's worth: a policy touches ids at random.
  struct Entry {
    uint32_t prev = kNone, next = kNone;  // list links
    uint32_t parent = kNone, parent_gen = 0, gen = 0, kids = 0;
    uint64_t key = 0;
    uint8_t where = kOut, home = kOut, flags = 0, extra = 0;
  };
  std::vector<Entry> e_;
};

}  // namespace sparsekv
