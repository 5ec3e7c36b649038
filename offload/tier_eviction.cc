#include "tier_eviction.h"

#include <fmt/format.h>

namespace sparsekv::offload {

TierEviction::TierEviction(EvictionPolicyKind kind, uint64_t protect_limit_bytes)
    : policy_(EvictionPolicy::Create(kind, 0)), protect_limit_bytes_(protect_limit_bytes) {}

void TierEviction::Grow(uint32_t id) {
  if (id < bytes_.size()) return;
  // Doubling, so that a tier filling up grows its policy a logarithmic number of times.
  const uint32_t n = std::max<uint32_t>(id + 1, static_cast<uint32_t>(bytes_.size() * 2));
  bytes_.resize(n, 0);
  parked_.resize(n, 0);
  policy_->Grow(n);
}

void TierEviction::Insert(uint32_t id, const BundleKey& key, uint64_t bytes) {
  Grow(id);
  bytes_[id] = bytes;
  parked_[id] = 0;
  policy_->SetKey(id, KeyOf(key));  // a key evicted lately and back now: the history knows it
  if (!hinted_.empty() && hinted_.count(key) != 0) Protect(id);
  policy_->Add(id);
}

void TierEviction::Touch(uint32_t id) {
  policy_->MarkReused(id);
  if (policy_->Evictable(id)) {  // to the most recent end (a parked one goes there when free)
    policy_->Remove(id);
    policy_->Add(id);
  }
}

void TierEviction::Refresh(uint32_t id) {
  if (policy_->Evictable(id)) {
    policy_->Remove(id);
    policy_->Add(id);
  }
}

void TierEviction::Erase(uint32_t id) {
  if (policy_->Protected(id)) Unprotect(id);
  policy_->Forget(id);
  parked_[id] = 0;
  bytes_[id] = 0;
}

void TierEviction::Evicted(uint32_t id) {
  if (policy_->Protected(id)) Unprotect(id);
  policy_->Evict(id);
  parked_[id] = 0;
  bytes_[id] = 0;
}

void TierEviction::Unbusy(uint32_t id) {
  if (id >= parked_.size() || parked_[id] == 0) return;
  parked_[id] = 0;
  policy_->Add(id);
}

void TierEviction::Hint(const BundleKey& key, uint32_t id, bool on) {
  if (on) {
    if (++hinted_[key] == 1 && id != kNone && id < bytes_.size() && !policy_->Protected(id))
      Protect(id);
    return;
  }
  auto it = hinted_.find(key);
  if (it == hinted_.end()) return;
  if (--it->second > 0) return;
  hinted_.erase(it);
  if (id != kNone && id < bytes_.size() && policy_->Protected(id)) Unprotect(id);
}

void TierEviction::Protect(uint32_t id) {
  if (protected_bytes_ + bytes_[id] > protect_limit_bytes_) {
    ++hint_cut_;
    return;
  }
  protected_bytes_ += bytes_[id];
  ++protected_items_;
  policy_->SetProtected(id, true);
}

void TierEviction::Unprotect(uint32_t id) {
  protected_bytes_ -= bytes_[id];
  --protected_items_;
  policy_->SetProtected(id, false);
}

Status TierEviction::Check() const {
  SPARSEKV_RETURN_IF_ERROR(policy_->Check());
  uint64_t items = 0, bytes = 0;
  for (uint32_t id = 0; id < bytes_.size(); ++id) {
    if (!policy_->Protected(id)) continue;
    ++items;
    bytes += bytes_[id];
  }
  if (items != protected_items_ || bytes != protected_bytes_) {
    return Status::Internal(fmt::format("tier eviction: {} protected entries of {} bytes counted, {} of {} found",
                                        protected_items_, protected_bytes_, items, bytes));
  }
  if (protected_bytes_ > protect_limit_bytes_) {
    return Status::Internal(fmt::format("tier eviction: {} bytes protected, above the bound of {}",
                                        protected_bytes_, protect_limit_bytes_));
  }
  return Status::OK();
}

}  // namespace sparsekv::offload
