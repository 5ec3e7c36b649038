#include "sparsekv/tier_chain.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "sparsekv/thread_annotations.h"

namespace sparsekv {
namespace {

template <typename T>
std::pair<std::function<void(T)>, std::future<T>> PromiseCallback() {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  return {[promise](T value) { promise->set_value(std::move(value)); }, std::move(future)};
}

}  // namespace

std::string_view WritePolicyName(WritePolicy p) {
  return p == WritePolicy::kWriteThrough ? "write-through" : "write-back";
}

Result<WritePolicy> ParseWritePolicy(std::string_view name) {
  if (name == "write-back") return WritePolicy::kWriteBack;
  if (name == "write-through") return WritePolicy::kWriteThrough;
  return Status::InvalidArgument("unknown write policy '" + std::string(name) +
                                 "', expected write-back or write-through");
}

// State the background work shares with the chain.
struct TierChain::Shared {
  Mutex mu;
  std::condition_variable_any idle;
  // Bundles evicted by tier `to - 1` and being written to tier `to`: findable meanwhile.
  struct Moving {
    BundlePtr bundle;
    size_t to = 0;
  };
  std::unordered_map<BundleKey, Moving, BundleKeyHasher> moving SPARSEKV_GUARDED_BY(mu);
  // Keys erased while moving: erased from their destination once the move lands.
  std::unordered_set<BundleKey, BundleKeyHasher> erased_while_moving SPARSEKV_GUARDED_BY(mu);
  uint64_t in_flight SPARSEKV_GUARDED_BY(mu) = 0;
  TierChainStats stats SPARSEKV_GUARDED_BY(mu);
};

// One Promote: results filled as tiers answer; `done` runs when the last slot is resolved.
struct TierChain::PromoteState {
  Mutex mu;
  std::vector<BundleKey> keys;
  std::vector<std::optional<Result<BundlePtr>>> results SPARSEKV_GUARDED_BY(mu);
  size_t unresolved SPARSEKV_GUARDED_BY(mu) = 0;
  bool onload = false;    // copy hits below the first tier into it
  bool prefetch = false;  // ... counted as prefetched rather than onloaded
  Tier::BundlesCallback done;
};

TierChain::TierChain(std::vector<std::unique_ptr<Tier>> tiers, TierChainOptions options)
    : tiers_(std::move(tiers)), options_(options), shared_(std::make_shared<Shared>()) {
  if (options_.write_policy != WritePolicy::kWriteBack) return;
  for (size_t i = 0; i + 1 < tiers_.size(); ++i) {
    const Status s = tiers_[i]->SetEvictionListener(
        [this, i](std::vector<BundlePtr> evicted) { Cascade(i, std::move(evicted)); });
    if (!s.ok())
      spdlog::debug("tier chain: evictions from {} are final: {}", tiers_[i]->name(), s.ToString());
  }
}

TierChain::~TierChain() {
  WaitIdle();
  // Tiers go fastest first: nothing cascades any more.
  for (auto& t : tiers_) t->SetEvictionListener(nullptr).IgnoreError();
}

void TierChain::BeginBackground() {
  MutexLock lock(shared_->mu);
  ++shared_->in_flight;
}

void TierChain::EndBackground() {
  MutexLock lock(shared_->mu);
  if (--shared_->in_flight == 0) shared_->idle.notify_all();
}

void TierChain::WaitIdle() {
  MutexLock lock(shared_->mu);
  shared_->idle.wait(
      shared_->mu, [this]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { return shared_->in_flight == 0; });
}

TierChainStats TierChain::Stats() const {
  MutexLock lock(shared_->mu);
  TierChainStats s = shared_->stats;
  s.in_flight = shared_->in_flight;
  return s;
}

void TierChain::DemoteAsync(std::vector<BundlePtr> bundles, Tier::StatusesCallback done) {
  const size_t n = bundles.size();
  {
    MutexLock lock(shared_->mu);
    shared_->stats.demoted += n;
  }
  const size_t targets = options_.write_policy == WritePolicy::kWriteThrough ? tiers_.size() : 1;
  struct Combine {
    Mutex mu;
    std::vector<Status> first_error SPARSEKV_GUARDED_BY(mu);
    std::vector<size_t> stored SPARSEKV_GUARDED_BY(mu);  // tiers that took each item
    size_t waiting SPARSEKV_GUARDED_BY(mu) = 0;
  };
  auto combine = std::make_shared<Combine>();
  {
    MutexLock lock(combine->mu);
    combine->first_error.resize(n);
    combine->stored.assign(n, 0);
    combine->waiting = targets;
  }
  auto shared = shared_;
  for (size_t t = 0; t < targets; ++t) {
    tiers_[t]->PutAsync(bundles, [combine, shared, done, n](std::vector<Status> st) {
      std::vector<Status> out;
      uint64_t dropped = 0;
      {
        MutexLock lock(combine->mu);
        for (size_t i = 0; i < n; ++i) {
          if (st[i].ok()) {
            ++combine->stored[i];
          } else if (combine->first_error[i].ok()) {
            combine->first_error[i] = std::move(st[i]);
          }
        }
        if (--combine->waiting > 0) return;
        for (size_t i = 0; i < n; ++i) dropped += combine->stored[i] == 0;
        out = std::move(combine->first_error);
      }
      if (dropped) {
        MutexLock lock(shared->mu);
        shared->stats.demote_dropped += dropped;
      }
      done(std::move(out));
    });
  }
}

std::future<std::vector<Status>> TierChain::Demote(std::vector<BundlePtr> bundles) {
  auto [cb, f] = PromiseCallback<std::vector<Status>>();
  DemoteAsync(std::move(bundles), std::move(cb));
  return std::move(f);
}

void TierChain::Cascade(size_t from_tier, std::vector<BundlePtr> evicted) {
  const size_t to = from_tier + 1;
  if (to >= tiers_.size() || evicted.empty()) return;
  {
    MutexLock lock(shared_->mu);
    ++shared_->in_flight;
    for (const BundlePtr& b : evicted) shared_->moving[b->key()] = {b, to};
  }
  auto shared = shared_;
  Tier* dest = tiers_[to].get();
  dest->PutAsync(evicted, [this, shared, evicted, dest](std::vector<Status> st) {
    std::vector<BundleKey> erase_now;
    {
      MutexLock lock(shared->mu);
      for (size_t i = 0; i < evicted.size(); ++i) {
        const BundleKey& k = evicted[i]->key();
        auto it = shared->moving.find(k);
        if (it != shared->moving.end() && it->second.bundle == evicted[i]) shared->moving.erase(it);
        if (shared->erased_while_moving.erase(k) && st[i].ok()) erase_now.push_back(k);
        if (st[i].ok()) {
          ++shared->stats.cascaded;
        } else {
          ++shared->stats.demote_dropped;
          spdlog::debug("tier chain: moving {} to {} failed, dropped: {}", k.ToString(),
                        dest->name(), st[i].ToString());
        }
      }
      if (!erase_now.empty()) ++shared->in_flight;
    }
    if (!erase_now.empty()) {
      dest->EraseAsync(std::move(erase_now), [this](std::vector<Status>) { EndBackground(); });
    }
    EndBackground();
  });
}

std::vector<int> TierChain::Locate(std::span<const BundleKey> keys) {
  std::vector<int> out(keys.size(), -1);
  {
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = shared_->moving.find(keys[i]);
      if (it != shared_->moving.end()) out[i] = static_cast<int>(it->second.to);
    }
  }
  for (size_t t = 0; t < tiers_.size(); ++t) {
    std::vector<BundleKey> ask;
    std::vector<size_t> at;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (out[i] < 0 || out[i] > static_cast<int>(t)) {
        ask.push_back(keys[i]);
        at.push_back(i);
      }
    }
    if (ask.empty()) break;
    const std::vector<bool> has = tiers_[t]->Contains(std::move(ask)).get();
    for (size_t j = 0; j < at.size(); ++j) {
      if (has[j]) out[at[j]] = static_cast<int>(t);
    }
  }
  return out;
}

size_t TierChain::CountPrefix(std::span<const BundleKey> keys) {
  const std::vector<int> where = Locate(keys);
  size_t n = 0;
  while (n < where.size() && where[n] >= 0) ++n;
  return n;
}

void TierChain::PromoteAsync(std::vector<BundleKey> keys, Tier::BundlesCallback done) {
  PromoteImpl(std::move(keys), options_.promote_into_first_tier, /*prefetch=*/false,
              std::move(done));
}

std::future<std::vector<Result<BundlePtr>>> TierChain::Promote(std::vector<BundleKey> keys) {
  auto [cb, f] = PromiseCallback<std::vector<Result<BundlePtr>>>();
  PromoteAsync(std::move(keys), std::move(cb));
  return std::move(f);
}

void TierChain::Prefetch(std::vector<BundleKey> keys) {
  const std::vector<int> where = Locate(keys);
  std::vector<BundleKey> below;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (where[i] > 0) below.push_back(keys[i]);
  }
  if (below.empty()) return;
  BeginBackground();
  PromoteImpl(std::move(below), /*onload=*/true, /*prefetch=*/true,
              [this](std::vector<Result<BundlePtr>>) { EndBackground(); });
}

void TierChain::PromoteImpl(std::vector<BundleKey> keys, bool onload, bool prefetch,
                            Tier::BundlesCallback done) {
  auto state = std::make_shared<PromoteState>();
  state->keys = std::move(keys);
  state->onload = onload;
  state->prefetch = prefetch;
  state->done = std::move(done);
  const size_t n = state->keys.size();
  std::vector<std::vector<size_t>> by_tier(tiers_.size());
  std::vector<BundlePtr> moving_hits;
  const std::vector<int> where = Locate(state->keys);
  {
    MutexLock lock(state->mu);
    state->results.resize(n);
    MutexLock shared_lock(shared_->mu);
    for (size_t i = 0; i < n; ++i) {
      auto m = shared_->moving.find(state->keys[i]);
      if (m != shared_->moving.end()) {
        state->results[i] = m->second.bundle;  // on its way down: serve it from memory
        moving_hits.push_back(m->second.bundle);
        ++shared_->stats.promoted;
      } else if (where[i] < 0) {
        state->results[i] =
            Status::NotFound("tier chain: no tier holds " + state->keys[i].ToString());
        ++shared_->stats.promote_misses;
      } else {
        by_tier[static_cast<size_t>(where[i])].push_back(i);
        ++state->unresolved;
      }
    }
  }
  if (onload && !moving_hits.empty()) Onload(std::move(moving_hits), prefetch);
  bool any = false;
  for (size_t t = 0; t < tiers_.size(); ++t) {
    if (by_tier[t].empty()) continue;
    any = true;
    GetFrom(t, std::move(by_tier[t]), state);
  }
  if (!any) {
    std::vector<Result<BundlePtr>> out;
    {
      MutexLock lock(state->mu);
      for (auto& r : state->results) out.push_back(std::move(*r));
    }
    state->done(std::move(out));
  }
}

void TierChain::GetFrom(size_t tier, std::vector<size_t> slots,
                        std::shared_ptr<PromoteState> state) {
  std::vector<BundleKey> keys;
  keys.reserve(slots.size());
  for (size_t i : slots) keys.push_back(state->keys[i]);
  tiers_[tier]->GetAsync(
      std::move(keys), [this, tier, slots, state](std::vector<Result<BundlePtr>> got) {
        std::vector<BundlePtr> to_onload;
        std::vector<std::vector<size_t>> retry(tiers_.size());
        uint64_t promoted = 0, fallbacks = 0, misses = 0;
        // A failed read falls through to the next tier that holds a copy.
        std::vector<BundleKey> failed_keys;
        std::vector<size_t> failed_slots;
        for (size_t j = 0; j < slots.size(); ++j) {
          if (!got[j].ok()) {
            failed_keys.push_back(state->keys[slots[j]]);
            failed_slots.push_back(j);
          }
        }
        std::vector<int> lower(failed_keys.size(), -1);
        for (size_t t = tier + 1; t < tiers_.size() && !failed_keys.empty(); ++t) {
          const std::vector<bool> has = tiers_[t]->Contains(failed_keys).get();
          for (size_t j = 0; j < has.size(); ++j) {
            if (has[j] && lower[j] < 0) lower[j] = static_cast<int>(t);
          }
        }
        bool finished = false;
        std::vector<Result<BundlePtr>> out;
        {
          MutexLock lock(state->mu);
          size_t f = 0;
          for (size_t j = 0; j < slots.size(); ++j) {
            const size_t i = slots[j];
            if (got[j].ok()) {
              if (state->onload && tier > 0) to_onload.push_back(*got[j]);
              state->results[i] = std::move(got[j]);
              ++promoted;
              --state->unresolved;
              continue;
            }
            const int next = lower[f++];
            if (next >= 0) {
              retry[static_cast<size_t>(next)].push_back(i);
              ++fallbacks;
              spdlog::warn("tier chain: {} failed in {} ({}); reading the copy in {}",
                           state->keys[i].ToString(), tiers_[tier]->name(),
                           got[j].status().ToString(), tiers_[static_cast<size_t>(next)]->name());
              continue;
            }
            if (got[j].status().Is(StatusCode::kNotFound)) ++misses;
            state->results[i] = std::move(got[j]);
            --state->unresolved;
          }
          if (state->unresolved == 0) {
            finished = true;
            for (auto& r : state->results) out.push_back(std::move(*r));
          }
        }
        {
          MutexLock lock(shared_->mu);
          shared_->stats.promoted += promoted;
          shared_->stats.fallbacks += fallbacks;
          shared_->stats.promote_misses += misses;
        }
        if (!to_onload.empty()) Onload(std::move(to_onload), state->prefetch);
        for (size_t t = 0; t < retry.size(); ++t) {
          if (!retry[t].empty()) GetFrom(t, std::move(retry[t]), state);
        }
        if (finished) state->done(std::move(out));
      });
}

void TierChain::Onload(std::vector<BundlePtr> bundles, bool prefetch) {
  BeginBackground();
  tiers_[0]->PutAsync(std::move(bundles), [this, prefetch](std::vector<Status> st) {
    uint64_t ok = 0;
    for (const Status& s : st) ok += s.ok();
    {
      MutexLock lock(shared_->mu);
      if (prefetch) {
        shared_->stats.prefetched += ok;
      } else {
        shared_->stats.onloaded += ok;
      }
    }
    EndBackground();
  });
}

std::future<std::vector<Status>> TierChain::Erase(std::vector<BundleKey> keys) {
  {
    MutexLock lock(shared_->mu);
    for (const BundleKey& k : keys) {
      if (shared_->moving.erase(k)) shared_->erased_while_moving.insert(k);
    }
  }
  struct Combine {
    Mutex mu;
    std::vector<Status> out SPARSEKV_GUARDED_BY(mu);
    size_t waiting SPARSEKV_GUARDED_BY(mu) = 0;
    std::promise<std::vector<Status>> promise;
  };
  auto combine = std::make_shared<Combine>();
  {
    MutexLock lock(combine->mu);
    combine->out.resize(keys.size());
    combine->waiting = tiers_.size();
  }
  std::future<std::vector<Status>> f = combine->promise.get_future();
  for (auto& t : tiers_) {
    t->EraseAsync(keys, [combine](std::vector<Status> st) {
      std::vector<Status> out;
      {
        MutexLock lock(combine->mu);
        for (size_t i = 0; i < st.size(); ++i) {
          if (combine->out[i].ok() && !st[i].ok()) combine->out[i] = std::move(st[i]);
        }
        if (--combine->waiting > 0) return;
        out = std::move(combine->out);
      }
      combine->promise.set_value(std::move(out));
    });
  }
  return f;
}

}  // namespace sparsekv
