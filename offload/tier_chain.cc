#include "sparsekv/tier_chain.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "sparsekv/thread_annotations.h"
#include "worker_pool.h"

namespace sparsekv {
namespace {

template <typename T>
std::pair<std::function<void(T)>, std::future<T>> PromiseCallback() {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  return {[promise](T value) { promise->set_value(std::move(value)); }, std::move(future)};
}

// Starts an asynchronous tier call and waits for its answer. The tiers answer Contains and
// EraseOlder on the caller's thread (or, for the SSD tier's erase, after an index write), so
// this is on every PUT's path: a stack latch costs less than a promise and its shared state.
template <typename T, typename Start>
T Await(Start&& start) {
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<T> value;
  } latch;
  start([&latch](T v) {
    std::lock_guard<std::mutex> l(latch.mu);
    latch.value = std::move(v);
    latch.cv.notify_one();  // under the lock: the waiter cannot return, and free it, before
  });
  std::unique_lock<std::mutex> l(latch.mu);
  latch.cv.wait(l, [&] { return latch.value.has_value(); });
  return std::move(*latch.value);
}

std::vector<bool> ContainsNow(Tier& tier, std::vector<BundleKey> keys) {
  return Await<std::vector<bool>>([&](Tier::ContainsCallback done) { tier.ContainsAsync(std::move(keys), std::move(done)); });
}

std::vector<Status> EraseOlderNow(Tier& tier, std::vector<BundleKey> keys, std::vector<uint64_t> below) {
  return Await<std::vector<Status>>([&](Tier::StatusesCallback done) {
    tier.EraseOlderAsync(std::move(keys), std::move(below), std::move(done));
  });
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
  std::condition_variable_any moved;  // a move down landed (or failed)
  // Bundles evicted by tier `to - 1` and being written to tier `to`: findable meanwhile.
  struct Moving {
    BundlePtr bundle;
    size_t to = 0;
  };
  std::unordered_map<BundleKey, Moving, BundleKeyHasher> moving SPARSEKV_GUARDED_BY(mu);
  // Keys with a write, an erase, a read or a background copy in flight: the newest sequence
  // written or erased since the first of them began. Gone once the last ends, when no tier can
  // hold an older copy any more (the writes erased them, the copies settled).
  struct Version {
    uint64_t latest = 0;
    uint32_t refs = 0;
  };
  std::unordered_map<BundleKey, Version, BundleKeyHasher> versions SPARSEKV_GUARDED_BY(mu);
  // Older copies that tiers may still hold because erasing them there failed (or, in a remote
  // tier, writing the newer version over them): per key, copies below `below` are stale in the
  // tiers whose bits `tiers` has. Reads skip them (LatestLocked); RepairStale erases them once
  // the tier answers again, and the key's entry goes with its last tier's success. An outage
  // grows this by an entry per key written meanwhile; the entries go when the tier is back.
  struct Stale {
    uint64_t below = 0;
    uint64_t tiers = 0;
  };
  std::unordered_map<BundleKey, Stale, BundleKeyHasher> stale SPARSEKV_GUARDED_BY(mu);
  bool repairing SPARSEKV_GUARDED_BY(mu) = false;
  std::chrono::steady_clock::time_point next_repair SPARSEKV_GUARDED_BY(mu){};
  std::chrono::milliseconds repair_backoff SPARSEKV_GUARDED_BY(mu){0};
  // Demotes waiting for older copies of their keys to be erased (TierChain::Invalidate), and
  // whether the worker is draining them.
  struct Invalidation {
    std::vector<BundlePtr> bundles;
    std::vector<std::vector<bool>> stored;  // [item][tier]: the tiers that took each bundle
    std::vector<Status> st;
    std::function<void(std::vector<Status>, uint64_t)> finish;
  };
  std::vector<Invalidation> invalidations SPARSEKV_GUARDED_BY(mu);
  bool invalidating SPARSEKV_GUARDED_BY(mu) = false;
  uint64_t in_flight SPARSEKV_GUARDED_BY(mu) = 0;
  TierChainStats stats SPARSEKV_GUARDED_BY(mu);
  std::atomic<uint64_t> next_sequence{1};

  void RefLocked(const BundleKey& k, uint64_t sequence) SPARSEKV_REQUIRES(mu) {
    Version& v = versions[k];
    v.latest = std::max(v.latest, sequence);
    ++v.refs;
  }
  void UnrefLocked(const BundleKey& k) SPARSEKV_REQUIRES(mu) {
    auto it = versions.find(k);
    if (it != versions.end() && --it->second.refs == 0) versions.erase(it);
  }
  uint64_t LatestLocked(const BundleKey& k) const SPARSEKV_REQUIRES(mu) {
    auto it = versions.find(k);
    uint64_t latest = it == versions.end() ? 0 : it->second.latest;
    if (!stale.empty()) {
      auto st = stale.find(k);
      if (st != stale.end()) latest = std::max(latest, st->second.below);
    }
    return latest;
  }
  // Whether a repair should start now (then it is counted as background work and marked running).
  bool StartRepairLocked() SPARSEKV_REQUIRES(mu) {
    if (stale.empty() || repairing || std::chrono::steady_clock::now() < next_repair) return false;
    repairing = true;
    ++in_flight;
    return true;
  }
  void MarkStaleLocked(const BundleKey& k, uint64_t below, size_t tier) SPARSEKV_REQUIRES(mu) {
    Stale& s = stale[k];
    s.below = std::max(s.below, below);
    s.tiers |= uint64_t{1} << tier;
  }
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
    : tiers_(std::move(tiers)),
      options_(options),
      shared_(std::make_shared<Shared>()),
      worker_(std::make_unique<offload::WorkerPool>("skv-chain", 1)) {
  uint64_t held = 0;
  for (const auto& t : tiers_) held = std::max(held, t->max_sequence());
  shared_->next_sequence = held + 1;
  local_ = 0;
  while (local_ < tiers_.size() && !tiers_[local_]->remote()) ++local_;
  if (tiers_.size() > 64) spdlog::error("tier chain: {} tiers, at most 64 are supported", tiers_.size());
  // Versions written through other chains meet in a remote tier: numbered from the clock, they
  // order as they were written across machines (to within the clocks' skew).
  clock_sequences_ = local_ < tiers_.size();
  if (options_.write_policy != WritePolicy::kWriteBack) return;
  for (size_t i = 0; i + 1 < local_; ++i) {
    const Status s = tiers_[i]->SetEvictionListener(
        [this, i](std::vector<BundlePtr> evicted) { Cascade(i, std::move(evicted)); });
    if (!s.ok())
      spdlog::debug("tier chain: evictions from {} are final: {}", tiers_[i]->name(), s.ToString());
  }
}

TierChain::~TierChain() {
  WaitIdle();
  worker_.reset();
  // Nothing cascades any more.
  for (auto& t : tiers_) t->SetEvictionListener(nullptr).IgnoreError();
  // Slowest first: a lower tier's threads may still hold bundles read from a faster tier (the
  // SSD tier's commit thread drops a write's bundles just after answering it), and a host-tier
  // bundle must not outlive its tier. Each tier's destructor joins its threads.
  while (!tiers_.empty()) tiers_.pop_back();
}

uint64_t TierChain::NextSequence() {
  if (!clock_sequences_) return shared_->next_sequence.fetch_add(1);
  // max(last + 1, microseconds since the epoch): increasing here, and comparable with other
  // chains' sequences by when they were drawn.
  const auto now = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  uint64_t cur = shared_->next_sequence.load();
  for (;;) {
    const uint64_t next = std::max(cur, now);
    if (shared_->next_sequence.compare_exchange_weak(cur, next + 1)) return next;
  }
}

bool TierChain::IsStale(const BundleKey& key, uint64_t sequence) const {
  MutexLock lock(shared_->mu);
  return shared_->LatestLocked(key) > sequence;
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

void TierChain::WaitNotMoving(const std::vector<BundleKey>& keys) {
  MutexLock lock(shared_->mu);
  shared_->moved.wait(shared_->mu, [&]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
    return std::none_of(keys.begin(), keys.end(),
                        [&](const BundleKey& k) { return shared_->moving.count(k) != 0; });
  });
}

TierChainStats TierChain::Stats() const {
  MutexLock lock(shared_->mu);
  TierChainStats s = shared_->stats;
  s.in_flight = shared_->in_flight;
  s.stale_keys = shared_->stale.size();
  return s;
}

void TierChain::DemoteAsync(std::vector<BundlePtr> bundles, Tier::StatusesCallback done) {
  const size_t n = bundles.size();
  bool repair = false;
  {
    MutexLock lock(shared_->mu);
    shared_->stats.demoted += n;
    for (const BundlePtr& b : bundles) {
      if (b) shared_->RefLocked(b->key(), b->sequence());
    }
    repair = shared_->StartRepairLocked();
  }
  if (repair) StartRepair();
  const size_t targets = options_.write_policy == WritePolicy::kWriteThrough ? local_ : 1;
  struct Combine {
    Mutex mu;
    std::vector<Status> first_error SPARSEKV_GUARDED_BY(mu);
    std::vector<std::vector<bool>> stored SPARSEKV_GUARDED_BY(mu);  // [item][tier]
    size_t waiting SPARSEKV_GUARDED_BY(mu) = 0;
  };
  auto combine = std::make_shared<Combine>();
  {
    MutexLock lock(combine->mu);
    combine->first_error.resize(n);
    combine->stored.assign(n, std::vector<bool>(tiers_.size(), false));
    combine->waiting = targets;
  }
  WriteBehind(bundles);
  for (size_t t = 0; t < targets; ++t) {
    tiers_[t]->PutAsync(bundles, [this, t, combine, bundles, done, n](std::vector<Status> st) {
      std::vector<Status> out;
      std::vector<std::vector<bool>> stored;
      {
        MutexLock lock(combine->mu);
        for (size_t i = 0; i < n; ++i) {
          if (st[i].ok()) {
            combine->stored[i][t] = true;
          } else if (combine->first_error[i].ok()) {
            combine->first_error[i] = std::move(st[i]);
          }
        }
        if (--combine->waiting > 0) return;
        out = std::move(combine->first_error);
        stored = std::move(combine->stored);
      }
      Invalidate(bundles, std::move(stored), std::move(out), done);
    });
  }
}

void TierChain::Invalidate(std::vector<BundlePtr> bundles, std::vector<std::vector<bool>> stored,
                           std::vector<Status> st, Tier::StatusesCallback done) {
  const size_t n = bundles.size();
  // Ends the demote: drops its references on the keys' versions (an older copy that could not
  // be erased was marked stale first, so that reads go on skipping it) and answers.
  auto finish = [shared = shared_, bundles, stored, done](std::vector<Status> st, uint64_t invalidated) {
    uint64_t dropped = 0;
    {
      MutexLock lock(shared->mu);
      for (size_t i = 0; i < bundles.size(); ++i) {
        if (!bundles[i]) continue;
        dropped += std::none_of(stored[i].begin(), stored[i].end(), [](bool b) { return b; });
        shared->UnrefLocked(bundles[i]->key());
      }
      shared->stats.demote_dropped += dropped;
      shared->stats.invalidated += invalidated;
    }
    done(std::move(st));
  };
  // Which keys may have an older copy somewhere they were not written: in a tier that holds
  // the key, or on its way down. Unversioned bundles order nothing.
  std::vector<BundleKey> keys;
  std::vector<size_t> items;
  for (size_t i = 0; i < n; ++i) {
    if (bundles[i] && bundles[i]->sequence() != 0) {
      keys.push_back(bundles[i]->key());
      items.push_back(i);
    }
  }
  // In write-back the first tier hands its evictions to Cascade. One of an older copy may have
  // left that tier's index (another put evicted it) without being `moving` yet: neither check
  // below would see it, this demote would be acknowledged, and the copy would land below
  // afterwards with nothing left to erase it there. Erasing older copies from the first tier
  // waits for such handovers (HostTier::EraseOlderAsync); it erases nothing this demote stored.
  if (options_.write_policy == WritePolicy::kWriteBack && tiers_.size() > 1 && !keys.empty()) {
    std::vector<uint64_t> own;
    own.reserve(items.size());
    for (size_t i : items) own.push_back(bundles[i]->sequence());
    const std::vector<Status> es = EraseOlderNow(*tiers_[0], keys, own);
    MutexLock lock(shared_->mu);
    for (size_t j = 0; j < es.size(); ++j) {
      if (es[j].ok()) continue;
      shared_->MarkStaleLocked(keys[j], own[j], 0);
      ++shared_->stats.invalidate_failures;
      if (st[items[j]].ok()) st[items[j]] = es[j].WithContext("tier chain: erasing an older copy");
    }
  }
  bool needed = false;
  {
    MutexLock lock(shared_->mu);
    for (const BundleKey& k : keys) needed |= shared_->moving.count(k) != 0;
  }
  // Remote tiers are left out: the write behind this demote replaces an older copy there, and
  // until it lands reads skip that copy (WriteBehind).
  for (size_t t = 0; t < local_ && !needed && !keys.empty(); ++t) {
    const std::vector<bool> has = ContainsNow(*tiers_[t], keys);
    for (size_t j = 0; j < keys.size(); ++j) needed |= has[j] && !stored[items[j]][t];
  }
  if (!needed) {
    finish(std::move(st), 0);
    return;
  }
  {
    MutexLock lock(shared_->mu);
    ++shared_->in_flight;
    shared_->invalidations.push_back(
        {std::move(bundles), std::move(stored), std::move(st), std::move(finish)});
    if (shared_->invalidating) return;  // the worker's drain takes it
    shared_->invalidating = true;
  }
  worker_->Submit([this](size_t) { DrainInvalidations(); });
}

void TierChain::DrainInvalidations() {
  for (;;) {
    std::vector<Shared::Invalidation> batch;
    {
      MutexLock lock(shared_->mu);
      batch.swap(shared_->invalidations);
      if (batch.empty()) {
        shared_->invalidating = false;
        return;
      }
    }
    // Every demote waiting is served by one erase per tier (one index write in the durable
    // tiers). Before a tier below the first is erased, a copy on its way down to it lands, so
    // that the erase cannot miss it (and a crash cannot leave it behind after the demote was
    // acknowledged).
    std::vector<BundleKey> all;
    for (const auto& inv : batch) {
      for (const BundlePtr& b : inv.bundles) {
        if (b && b->sequence() != 0) all.push_back(b->key());
      }
    }
    std::vector<uint64_t> invalidated(batch.size(), 0);
    for (size_t t = 0; t < local_; ++t) {
      // Fastest tier first, as Erase: a tier erased cannot start moving an older copy down.
      if (t > 0) WaitNotMoving(all);
      std::vector<BundleKey> ask;
      std::vector<std::pair<size_t, size_t>> at;  // (demote, item)
      for (size_t b = 0; b < batch.size(); ++b) {
        const auto& inv = batch[b];
        for (size_t i = 0; i < inv.bundles.size(); ++i) {
          if (!inv.bundles[i] || inv.bundles[i]->sequence() == 0 || inv.stored[i][t]) continue;
          ask.push_back(inv.bundles[i]->key());
          at.emplace_back(b, i);
        }
      }
      if (ask.empty()) continue;
      const std::vector<bool> has = ContainsNow(*tiers_[t], ask);
      std::vector<BundleKey> erase;
      std::vector<uint64_t> below;
      std::vector<std::pair<size_t, size_t>> erase_at;
      for (size_t j = 0; j < ask.size(); ++j) {
        if (!has[j]) continue;
        erase.push_back(ask[j]);
        below.push_back(batch[at[j].first].bundles[at[j].second]->sequence());
        erase_at.push_back(at[j]);
      }
      if (erase.empty()) continue;
      const std::vector<Status> es = EraseOlderNow(*tiers_[t], erase, below);
      for (size_t j = 0; j < es.size(); ++j) {
        const auto [b, i] = erase_at[j];
        if (es[j].ok()) {
          ++invalidated[b];
          continue;
        }
        spdlog::warn("tier chain: erasing older copies of {} from {} failed: {}",
                     erase[j].ToString(), tiers_[t]->name(), es[j].ToString());
        {
          MutexLock lock(shared_->mu);
          shared_->MarkStaleLocked(erase[j], below[j], t);
          ++shared_->stats.invalidate_failures;
        }
        if (batch[b].st[i].ok())
          batch[b].st[i] = es[j].WithContext("tier chain: erasing an older copy");
      }
    }
    for (size_t b = 0; b < batch.size(); ++b) {
      batch[b].finish(std::move(batch[b].st), invalidated[b]);
      EndBackground();
    }
  }
}

std::future<std::vector<Status>> TierChain::Demote(std::vector<BundlePtr> bundles) {
  auto [cb, f] = PromiseCallback<std::vector<Status>>();
  DemoteAsync(std::move(bundles), std::move(cb));
  return std::move(f);
}

void TierChain::WriteBehind(const std::vector<BundlePtr>& bundles) {
  std::vector<BundlePtr> send;
  for (const BundlePtr& b : bundles) {
    if (b) send.push_back(b);
  }
  for (size_t t = local_; t < tiers_.size() && !send.empty(); ++t) {
    {
      // Held until the copy lands: a read of this tier meanwhile skips an older copy there.
      MutexLock lock(shared_->mu);
      ++shared_->in_flight;
      for (const BundlePtr& b : send) shared_->RefLocked(b->key(), b->sequence());
    }
    tiers_[t]->PutAsync(send, [this, t, send](std::vector<Status> st) {
      std::vector<BundlePtr> landed;
      std::vector<Status> landed_st;
      uint64_t failed = 0;
      {
        MutexLock lock(shared_->mu);
        for (size_t i = 0; i < send.size(); ++i) {
          if (st[i].ok()) {
            landed.push_back(send[i]);
            landed_st.push_back(Status::OK());
            continue;
          }
          // The tier may keep an older copy of the key: marked stale, reads go on skipping
          // it until the repair erases it (an unversioned bundle orders nothing).
          ++failed;
          if (send[i]->sequence() != 0) shared_->MarkStaleLocked(send[i]->key(), send[i]->sequence(), t);
          shared_->UnrefLocked(send[i]->key());
        }
        shared_->stats.written_behind += landed.size();
        shared_->stats.write_behind_failures += failed;
      }
      if (failed > 0) {
        spdlog::debug("tier chain: {} of {} bundles not written to {}: {}", failed, send.size(), tiers_[t]->name(),
                      std::find_if(st.begin(), st.end(), [](const Status& x) { return !x.ok(); })->ToString());
      }
      SettleBackground(t, landed, landed_st);
      EndBackground();
    });
  }
}

void TierChain::Cascade(size_t from_tier, std::vector<BundlePtr> evicted) {
  const size_t to = from_tier + 1;
  if (to >= tiers_.size() || evicted.empty()) return;
  {
    MutexLock lock(shared_->mu);
    ++shared_->in_flight;
    for (const BundlePtr& b : evicted) {
      shared_->moving[b->key()] = {b, to};
      shared_->RefLocked(b->key(), b->sequence());
    }
  }
  Tier* dest = tiers_[to].get();
  dest->PutAsync(evicted, [this, evicted, dest, to](std::vector<Status> st) {
    {
      MutexLock lock(shared_->mu);
      for (size_t i = 0; i < evicted.size(); ++i) {
        const BundleKey& k = evicted[i]->key();
        auto it = shared_->moving.find(k);
        if (it != shared_->moving.end() && it->second.bundle == evicted[i])
          shared_->moving.erase(it);
        if (st[i].ok()) {
          ++shared_->stats.cascaded;
        } else {
          ++shared_->stats.demote_dropped;
          spdlog::debug("tier chain: moving {} to {} failed, dropped: {}", k.ToString(),
                        dest->name(), st[i].ToString());
        }
      }
      shared_->moved.notify_all();
    }
    SettleBackground(to, evicted, st);
    EndBackground();
  });
}

void TierChain::SettleBackground(size_t tier, const std::vector<BundlePtr>& landed,
                                 const std::vector<Status>& st) {
  std::vector<BundleKey> again;
  std::vector<uint64_t> below;
  {
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < landed.size(); ++i) {
      const BundleKey& k = landed[i]->key();
      const uint64_t latest = shared_->LatestLocked(k);
      if (st[i].ok() && latest > landed[i]->sequence()) {
        again.push_back(k);  // superseded while it was copied: its reference goes after the erase
        below.push_back(latest);
      } else {
        shared_->UnrefLocked(k);
      }
    }
    if (!again.empty()) ++shared_->in_flight;
  }
  if (again.empty()) return;
  tiers_[tier]->EraseOlderAsync(again, below, [this, tier, again, below](std::vector<Status> es) {
    {
      MutexLock lock(shared_->mu);
      for (size_t i = 0; i < again.size(); ++i) {
        if (es[i].ok()) {
          ++shared_->stats.invalidated;
        } else {
          shared_->MarkStaleLocked(again[i], below[i], tier);  // reads skip it until repaired
          ++shared_->stats.invalidate_failures;
        }
        shared_->UnrefLocked(again[i]);
      }
    }
    EndBackground();
  });
}

void TierChain::StartRepair() {
  worker_->Submit([this](size_t) { RepairStale(); });
}

void TierChain::RepairStale() {
  constexpr size_t kBatch = 1024;
  bool failed = false;
  for (;;) {
    // A tier's stale copies are erased once every faster tier's are, and not while the key is
    // on its way down: an older copy can only come into a tier from a faster one.
    std::vector<std::vector<BundleKey>> keys(tiers_.size());
    std::vector<std::vector<uint64_t>> below(tiers_.size());
    size_t picked = 0;
    {
      MutexLock lock(shared_->mu);
      for (const auto& [k, st] : shared_->stale) {
        if (picked == kBatch) break;
        if (st.tiers == 0 || shared_->moving.count(k) != 0) continue;
        const auto t = static_cast<size_t>(std::countr_zero(st.tiers));
        if (t >= tiers_.size()) continue;
        keys[t].push_back(k);
        below[t].push_back(st.below);
        ++picked;
      }
    }
    if (picked == 0) break;
    uint64_t repaired = 0;
    for (size_t t = 0; t < tiers_.size(); ++t) {
      if (keys[t].empty()) continue;
      const std::vector<Status> es = EraseOlderNow(*tiers_[t], keys[t], below[t]);
      MutexLock lock(shared_->mu);
      for (size_t i = 0; i < es.size(); ++i) {
        if (!es[i].ok()) {
          failed = true;
          continue;
        }
        auto it = shared_->stale.find(keys[t][i]);
        // Marked again meanwhile with a newer version: erased in a later round.
        if (it == shared_->stale.end() || it->second.below != below[t][i]) continue;
        it->second.tiers &= ~(uint64_t{1} << t);
        ++repaired;
        if (it->second.tiers == 0) shared_->stale.erase(it);
      }
    }
    {
      MutexLock lock(shared_->mu);
      shared_->stats.repaired += repaired;
    }
    if (failed || repaired == 0) break;  // otherwise the rest (further tiers, more keys) at once
  }
  MutexLock lock(shared_->mu);
  // A tier still failing is asked again after a backoff (from 100 ms to 5 s) by the next
  // demote, read or erase; otherwise what was marked meanwhile is taken at once.
  shared_->repair_backoff = failed ? std::clamp(shared_->repair_backoff * 2, std::chrono::milliseconds(100),
                                                std::chrono::milliseconds(5000))
                                   : std::chrono::milliseconds(0);
  shared_->next_repair = std::chrono::steady_clock::now() + shared_->repair_backoff;
  shared_->repairing = false;
  if (--shared_->in_flight == 0) shared_->idle.notify_all();
}

std::vector<int> TierChain::Locate(std::span<const BundleKey> keys) { return LocateIn(keys, tiers_.size()); }

std::vector<int> TierChain::LocateIn(std::span<const BundleKey> keys, size_t tier_end) {
  std::vector<int> out(keys.size(), -1);
  {
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = shared_->moving.find(keys[i]);
      if (it != shared_->moving.end()) out[i] = static_cast<int>(it->second.to);
    }
  }
  for (size_t t = 0; t < tier_end; ++t) {
    std::vector<BundleKey> ask;
    std::vector<size_t> at;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (out[i] < 0 || out[i] > static_cast<int>(t)) {
        ask.push_back(keys[i]);
        at.push_back(i);
      }
    }
    if (ask.empty()) break;
    const std::vector<bool> has = ContainsNow(*tiers_[t], std::move(ask));
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
  // The read holds its keys' versions from before it looks anywhere, so that a write landing
  // while it reads is known when its results (and their onload) are checked.
  state->done = [shared = shared_, keys = state->keys,
                 done = std::move(done)](std::vector<Result<BundlePtr>> out) {
    {
      MutexLock lock(shared->mu);
      for (const BundleKey& k : keys) shared->UnrefLocked(k);
    }
    done(std::move(out));
  };
  const size_t n = state->keys.size();
  bool repair = false;
  {
    MutexLock lock(shared_->mu);
    for (const BundleKey& k : state->keys) shared_->RefLocked(k, 0);
    repair = shared_->StartRepairLocked();
  }
  if (repair) StartRepair();
  std::vector<std::vector<size_t>> by_tier(tiers_.size());
  std::vector<BundlePtr> moving_hits;
  // Only the local tiers are asked: a key none holds is read from the remote tier straight
  // away (a miss there answers as one), rather than asked about first.
  const std::vector<int> where = LocateIn(state->keys, local_);
  {
    MutexLock lock(state->mu);
    state->results.resize(n);
    MutexLock shared_lock(shared_->mu);
    for (size_t i = 0; i < n; ++i) {
      const BundleKey& k = state->keys[i];
      auto m = shared_->moving.find(k);
      if (m != shared_->moving.end() && where[i] == static_cast<int>(m->second.to) &&
          shared_->LatestLocked(k) <= m->second.bundle->sequence()) {
        // On its way down, and no faster tier holds the key: serve it from memory.
        state->results[i] = m->second.bundle;
        moving_hits.push_back(m->second.bundle);
        ++shared_->stats.promoted;
      } else if (where[i] < 0 && local_ == tiers_.size()) {
        state->results[i] = Status::NotFound("tier chain: no tier holds " + k.ToString());
        ++shared_->stats.promote_misses;
      } else if (where[i] < 0) {
        by_tier[local_].push_back(i);
        ++state->unresolved;
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
  tiers_[tier]->GetAsync(std::move(keys), [this, tier, slots,
                                           state](std::vector<Result<BundlePtr>> got) {
    // A copy older than a version written meanwhile is stale: never returned.
    std::vector<bool> stale(slots.size(), false);
    {
      MutexLock lock(shared_->mu);
      for (size_t j = 0; j < slots.size(); ++j) {
        if (got[j].ok() && shared_->LatestLocked(state->keys[slots[j]]) > (*got[j])->sequence()) {
          stale[j] = true;
          ++shared_->stats.stale_skipped;
        }
      }
    }
    std::vector<BundlePtr> to_onload;
    std::vector<std::vector<size_t>> retry(tiers_.size());
    uint64_t promoted = 0, fallbacks = 0, misses = 0;
    // A failed or stale read falls through to the next tier that holds a copy.
    std::vector<BundleKey> failed_keys;
    for (size_t j = 0; j < slots.size(); ++j) {
      if (!got[j].ok() || stale[j]) failed_keys.push_back(state->keys[slots[j]]);
    }
    std::vector<int> lower(failed_keys.size(), -1);
    for (size_t t = tier + 1; t < local_ && !failed_keys.empty(); ++t) {
      const std::vector<bool> has = ContainsNow(*tiers_[t], failed_keys);
      for (size_t j = 0; j < has.size(); ++j) {
        if (has[j] && lower[j] < 0) lower[j] = static_cast<int>(t);
      }
    }
    // A key that left this tier after the read was routed here (evicted, on its way down, not
    // yet in the tier below's index) is served from the bundle moving down, when it is the
    // newest version: a read racing a write-back move must not miss a key the chain holds.
    std::vector<BundlePtr> in_flight(failed_keys.size());
    {
      MutexLock lock(shared_->mu);
      for (size_t j = 0; j < failed_keys.size(); ++j) {
        if (lower[j] >= 0) continue;
        auto m = shared_->moving.find(failed_keys[j]);
        if (m != shared_->moving.end() && shared_->LatestLocked(failed_keys[j]) <= m->second.bundle->sequence()) {
          in_flight[j] = m->second.bundle;
        }
      }
    }
    // Below the local tiers, the remote tier is tried without asking first.
    if (tier < local_ && local_ < tiers_.size()) {
      for (int& l : lower) {
        if (l < 0) l = static_cast<int>(local_);
      }
    }
    bool finished = false;
    std::vector<Result<BundlePtr>> out;
    {
      MutexLock lock(state->mu);
      size_t f = 0;
      for (size_t j = 0; j < slots.size(); ++j) {
        const size_t i = slots[j];
        if (got[j].ok() && !stale[j]) {
          if (state->onload && tier > 0) to_onload.push_back(*got[j]);
          state->results[i] = std::move(got[j]);
          ++promoted;
          --state->unresolved;
          continue;
        }
        BundlePtr moving_copy = std::move(in_flight[f]);
        const int next = lower[f++];
        if (moving_copy && (next < 0 || next >= static_cast<int>(local_))) {
          state->results[i] = std::move(moving_copy);
          ++promoted;
          --state->unresolved;
          continue;
        }
        if (next >= 0) {
          retry[static_cast<size_t>(next)].push_back(i);
          ++fallbacks;
          if (!stale[j] && !got[j].status().Is(StatusCode::kNotFound)) {
            spdlog::warn("tier chain: {} failed in {} ({}); reading the copy in {}",
                         state->keys[i].ToString(), tiers_[tier]->name(),
                         got[j].status().ToString(), tiers_[static_cast<size_t>(next)]->name());
          }
          continue;
        }
        if (stale[j]) {
          got[j] = Status::NotFound(fmt::format("tier chain: {} holds only an older version of {}",
                                                tiers_[tier]->name(), state->keys[i].ToString()));
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
  {
    MutexLock lock(shared_->mu);
    // A copy already superseded is not brought up at all: landing and erasing it again would
    // leave a moment in which the first tier could move it down below the newer version.
    std::erase_if(bundles, [&](const BundlePtr& b) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
      return shared_->LatestLocked(b->key()) > b->sequence();
    });
    if (bundles.empty()) return;
    ++shared_->in_flight;
    for (const BundlePtr& b : bundles) shared_->RefLocked(b->key(), b->sequence());
  }
  tiers_[0]->PutAsync(bundles, [this, bundles, prefetch](std::vector<Status> st) {
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
    SettleBackground(0, bundles, st);
    EndBackground();
  });
}

std::future<std::vector<Status>> TierChain::Erase(std::vector<BundleKey> keys) {
  // The erase is a version of its own: every copy below it goes, wherever it is or lands.
  const uint64_t version = NextSequence();
  {
    MutexLock lock(shared_->mu);
    for (const BundleKey& k : keys) shared_->RefLocked(k, version);
  }
  // Fastest tier first: once a tier has no copy it cannot start moving one down, so a copy on
  // its way to the next tier is waited for before that tier is erased, and none can land after
  // (where a crash before its own settling would bring the key back).
  const std::vector<uint64_t> below(keys.size(), version);
  std::vector<Status> out(keys.size());
  // A copy a tier failed to erase is marked stale there: reads go on skipping it until the
  // repair erases it. A remote tier that fails is not the caller's error (its nodes fail as
  // misses); a local one is.
  for (size_t t = 0; t < tiers_.size(); ++t) {
    if (t > 0) WaitNotMoving(keys);
    const std::vector<Status> st = EraseOlderNow(*tiers_[t], keys, below);
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < st.size(); ++i) {
      if (st[i].ok()) continue;
      shared_->MarkStaleLocked(keys[i], version, t);
      ++shared_->stats.invalidate_failures;
      if (t < local_ && out[i].ok()) out[i] = st[i];
    }
  }
  bool repair = false;
  {
    MutexLock lock(shared_->mu);
    for (const BundleKey& k : keys) shared_->UnrefLocked(k);
    repair = shared_->StartRepairLocked();
  }
  if (repair) StartRepair();
  std::promise<std::vector<Status>> done;
  done.set_value(std::move(out));
  return done.get_future();
}

}  // namespace sparsekv
