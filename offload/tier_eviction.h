// TierEviction: the eviction order of an offload tier (host, SSD): an EvictionPolicy over the
// tier's entry ids, plus what a tier needs beyond it.
//
//   - Busy entries. A tier cannot evict an entry somebody reads (or writes), and reads are
//     short, so an entry stays in the order while read; when the policy names a busy one as
//     its victim, it is parked (out of the order) and the next is asked. The tier calls
//     Unbusy when the last reader lets go, and a parked entry joins the order again as the most
//     recent (it was just read).
//   - Hints. A scheduler names keys it will read soon (Hint, counted per key: hints nest).
//     A hinted key's entry, held now or stored while the hint lives, is protected: evicted only
//     when nothing else can be. At most `protect_limit_bytes` of record bytes are protected at
//     once; a hinted entry beyond that is not protected (counted in hint_cut), so hints can
//     never leave the tier without room for new records' recency.
//
// Ids are the tier's own dense entry ids; the policy grows with them. Not thread-safe: the
// tier's lock guards it.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/eviction_policy.h"

namespace sparsekv::offload {

class TierEviction {
 public:
  static constexpr uint32_t kNone = EvictionPolicy::kNone;

  TierEviction(EvictionPolicyKind kind, uint64_t protect_limit_bytes);

  EvictionPolicyKind kind() const { return policy_->kind(); }

  // Entry `id` now holds `key` (`bytes` of record): it joins the order as the most recent,
  // protected when the key is hinted and the bound allows.
  void Insert(uint32_t id, const BundleKey& key, uint64_t bytes);
  // Entry `id` was read: a use, and the most recent.
  void Touch(uint32_t id);
  // Entry `id` was stored again unchanged (a repeated demote): the most recent, not a use.
  void Refresh(uint32_t id);
  // Entry `id` leaves the tier other than by eviction (erased, replaced, found damaged).
  void Erase(uint32_t id);
  // The entry to evict next, parking the busy ones it meets (busy(id) true); kNone when every
  // entry is busy or there is none. Call Evicted(id) once it is evicted.
  template <class Busy>
  uint32_t Victim(Busy&& busy) {
    for (;;) {
      const uint32_t v = policy_->Victim();
      if (v == kNone || !busy(v)) return v;
      policy_->Remove(v);
      parked_[v] = 1;
    }
  }
  void Evicted(uint32_t id);
  // Entry `id` is no longer busy: a parked one joins the order again.
  void Unbusy(uint32_t id);

  // One more (on) or one fewer (off) hint of `key`; `id` is its entry when the tier holds it,
  // else kNone.
  void Hint(const BundleKey& key, uint32_t id, bool on);
  bool Protected(uint32_t id) const { return id < bytes_.size() && policy_->Protected(id); }

  // Evictable ids (not the parked ones), roughly in eviction order.
  template <class Fn>
  void ForEach(Fn&& fn) const {
    policy_->ForEachEvictable(fn);
  }
  bool Parked(uint32_t id) const { return id < parked_.size() && parked_[id] != 0; }

  uint64_t protected_items() const { return protected_items_; }
  uint64_t protected_bytes() const { return protected_bytes_; }
  uint64_t hinted_keys() const { return hinted_.size(); }
  uint64_t hint_cut() const { return hint_cut_; }
  uint64_t history() const { return policy_->history_size(); }
  // The policy's own check, and the protected bytes add up.
  Status Check() const;

 private:
  // All 128 bits and the namespace, mixed: keys that share a half must not share a history.
  static uint64_t KeyOf(const BundleKey& key) {
    uint64_t k = key.hash.lo ^ ((key.hash.hi << 29 | key.hash.hi >> 35) * 0x9e3779b97f4a7c15ull) ^
                 (uint64_t{key.namespace_id} * 0xc2b2ae3d27d4eb4full);
    k ^= k >> 31;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 29;
    return k != 0 ? k : 1;  // 0 means "no key" to the policy
  }
  void Grow(uint32_t id);
  void Protect(uint32_t id);
  void Unprotect(uint32_t id);

  std::unique_ptr<EvictionPolicy> policy_;
  const uint64_t protect_limit_bytes_;
  std::vector<uint64_t> bytes_;  // per id: its record bytes while it holds one
  std::vector<uint8_t> parked_;  // per id: busy when named as victim, out of the order
  std::unordered_map<BundleKey, uint32_t, BundleKeyHasher> hinted_;  // key -> live hints
  uint64_t protected_items_ = 0, protected_bytes_ = 0, hint_cut_ = 0;
};

}  // namespace sparsekv::offload
