#include "server/kv_event_tracker.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <tuple>

#include "sparsekv/host_tier.h"

namespace sparsekv::server {
namespace {

// The 16 bytes a client named the block with, high 64 bits first (kv_event_tracker.h).
KvEventDigest DigestOfKey(const BundleKey& k) { return DigestOf(k.hash); }

KvEventDigest DigestOfWire(const wire::WireHash& h) { return DigestOf(FromWire(h)); }

constexpr const char* kShared = "SHARED";

}  // namespace

Result<std::unique_ptr<TierEventTracker>> TierEventTracker::Start(const TierEventTrackerOptions& options,
                                                                  TieredStore& store) {
  if (options.tick_ms == 0) return Status::InvalidArgument("kv_events: tick_ms must be at least 1");
  auto publisher = VllmKvEventPublisher::Start(options.publisher);
  if (!publisher.ok()) return publisher.status();
  std::unique_ptr<TierEventTracker> t(new TierEventTracker(options, store, std::move(publisher).value()));
  if (t->has_remote_) {
    TierEventTracker* self = t.get();
    store.SetRecordObserver([self](uint32_t ns, const wire::EventRecord& e) { self->OnRecord(ns, e); });
  }
  t->Tick();  // AllBlocksCleared, then what the tiers hold
  t->thread_ = std::thread([self = t.get()] { self->Run(); });
  return t;
}

TierEventTracker::TierEventTracker(const TierEventTrackerOptions& options, TieredStore& store,
                                   std::unique_ptr<VllmKvEventPublisher> publisher)
    : options_(options), store_(store), publisher_(std::move(publisher)) {
  TierChain& chain = store_.chain();
  journals_.resize(chain.tier_count());
  tier_keys_.resize(chain.tier_count());
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    Tier& tier = chain.tier(i);
    if (tier.remote()) {
      media_.push_back(kShared);
      has_remote_ = true;
      continue;
    }
    media_.push_back(dynamic_cast<HostTier*>(&tier) != nullptr ? "CPU" : "DISK");  // SSD, RocksDB: DISK
    // Room for a few seconds of a heavy load's changes between ticks; past it, a listing.
    auto journal = std::make_shared<KeyJournal>(size_t{1} << 20);
    if (tier.SetKeyJournal(journal)) journals_[i] = std::move(journal);
  }
}

TierEventTracker::~TierEventTracker() {
  TierChain& chain = store_.chain();
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    if (journals_[i]) chain.tier(i).SetKeyJournal(nullptr);
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  publisher_->Flush();
}

void TierEventTracker::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!cv_.wait_for(l, std::chrono::milliseconds(options_.tick_ms), [&] { return stop_; })) {
    l.unlock();
    Tick();
    l.lock();
  }
}

void TierEventTracker::OnRecord(uint32_t ns, const wire::EventRecord& e) {
  // The remote tier: every successful PUT was written behind to it, every DELETE erased there.
  if (e.type != 1 && e.type != 2) return;
  VllmKvEvent v;
  v.type = e.type == 1 ? VllmKvEvent::Type::kBlockStored : VllmKvEvent::Type::kBlockRemoved;
  v.medium = kShared;
  for (const wire::WireHash& h : e.hashes) v.block_hashes.push_back(DigestOfWire(h));
  if (!v.block_hashes.empty()) publisher_->Publish(std::move(v));
}

namespace {

// Splits `hashes` into events of at most 4,096 hashes (a payload's bound) of `type`.
void AddEvents(std::vector<VllmKvEvent>& events, VllmKvEvent::Type type, const std::string& medium,
               const std::vector<KvEventDigest>& hashes) {
  constexpr size_t kMaxHashes = 4096;
  for (size_t i = 0; i < hashes.size(); i += kMaxHashes) {
    VllmKvEvent e;
    e.type = type;
    e.medium = medium;
    e.block_hashes.assign(hashes.begin() + i, hashes.begin() + std::min(hashes.size(), i + kMaxHashes));
    events.push_back(std::move(e));
  }
}

}  // namespace

std::vector<VllmKvEvent> TierEventTracker::ListAndDiff(const std::vector<BundleKey>& pins) {
  ++listings_;
  TierChain& chain = store_.chain();
  std::unordered_map<std::string, std::unordered_set<BundleKey, BundleKeyHasher>> now;
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    if (media_[i] == kShared) continue;
    // The journal is emptied before the listing: what it notes from here on is applied after
    // the listing, in order, which ends in the tier's state whichever of it the listing saw.
    if (journals_[i]) {
      bool overflowed = false;
      journals_[i]->Take(&overflowed);
    }
    tier_keys_[i].clear();
    if (std::optional<std::vector<BundleKey>> keys = chain.tier(i).ListKeys()) {
      tier_keys_[i].insert(keys->begin(), keys->end());
    }
    now[media_[i]].insert(tier_keys_[i].begin(), tier_keys_[i].end());
  }
  for (const BundleKey& k : pins) now["CPU"].insert(k);

  std::vector<VllmKvEvent> events;
  if (first_tick_) {
    first_tick_ = false;
    VllmKvEvent cleared;
    cleared.type = VllmKvEvent::Type::kAllBlocksCleared;
    events.push_back(std::move(cleared));
  }
  // Removals first, then stores.
  for (auto& [medium, before] : published_) {
    const auto& after = now[medium];
    std::vector<KvEventDigest> gone;
    for (const BundleKey& k : before) {
      if (!after.count(k)) gone.push_back(DigestOfKey(k));
    }
    AddEvents(events, VllmKvEvent::Type::kBlockRemoved, medium, gone);
  }
  for (auto& [medium, after] : now) {
    const auto& before = published_[medium];
    std::vector<KvEventDigest> added;
    for (const BundleKey& k : after) {
      if (!before.count(k)) added.push_back(DigestOfKey(k));
    }
    AddEvents(events, VllmKvEvent::Type::kBlockStored, medium, added);
  }
  published_ = std::move(now);
  return events;
}

void TierEventTracker::Tick() {
  std::lock_guard<std::mutex> tick_lock(tick_mu_);
  TierChain& chain = store_.chain();
  std::vector<BundleKey> pins = store_.PinnedKeys();
  std::sort(pins.begin(), pins.end(), [](const BundleKey& a, const BundleKey& b) {
    return std::tie(a.namespace_id, a.hash.hi, a.hash.lo) < std::tie(b.namespace_id, b.hash.hi, b.hash.lo);
  });
  // After dropped events subscribers hold a wrong picture: start over (AllBlocksCleared, then
  // everything), once the queue has room for it.
  const bool resync = resync_ && publisher_->Stats().queued_events == 0;
  bool list = first_tick_ || resync;
  for (size_t i = 0; i < chain.tier_count() && !list; ++i) {
    if (media_[i] != kShared && !journals_[i]) list = true;  // a tier that keeps no journal
  }

  // The tiers' changes since the last tick, applied to the mirror of each tier's keys; the keys
  // touched, per medium. A journal that overflowed lost some: list the tiers instead.
  std::unordered_map<std::string, std::vector<BundleKey>> touched;
  for (size_t i = 0; i < chain.tier_count() && !list; ++i) {
    if (!journals_[i]) continue;
    bool overflowed = false;
    std::vector<std::pair<BundleKey, bool>> changes = journals_[i]->Take(&overflowed);
    if (overflowed) {
      list = true;
      break;
    }
    auto& keys = tier_keys_[i];
    auto& t = touched[media_[i]];
    for (const auto& [k, present] : changes) {
      if (present) {
        keys.insert(k);
      } else {
        keys.erase(k);
      }
      t.push_back(k);
    }
  }
  if (!list && pins != last_pins_) {  // pins count as host memory
    std::vector<BundleKey> changed;
    std::set_symmetric_difference(pins.begin(), pins.end(), last_pins_.begin(), last_pins_.end(),
                                  std::back_inserter(changed), [](const BundleKey& a, const BundleKey& b) {
                                    return std::tie(a.namespace_id, a.hash.hi, a.hash.lo) <
                                           std::tie(b.namespace_id, b.hash.hi, b.hash.lo);
                                  });
    auto& t = touched["CPU"];
    t.insert(t.end(), changed.begin(), changed.end());
  }

  std::vector<VllmKvEvent> events;
  if (list) {
    if (resync) {
      resync_ = false;
      published_.clear();
      resyncs_.fetch_add(1, std::memory_order_relaxed);
      first_tick_ = true;  // AllBlocksCleared, then everything
    }
    events = ListAndDiff(pins);
  } else if (!touched.empty()) {
    bool any_before = false;
    for (const auto& [medium, set] : published_) any_before = any_before || !set.empty();
    const auto pinned = [&](const BundleKey& k) {
      return std::binary_search(pins.begin(), pins.end(), k, [](const BundleKey& a, const BundleKey& b) {
        return std::tie(a.namespace_id, a.hash.hi, a.hash.lo) < std::tie(b.namespace_id, b.hash.hi, b.hash.lo);
      });
    };
    // Removals first, then stores, each key once: what it is now against what was published.
    std::vector<std::pair<std::string, std::vector<KvEventDigest>>> gone, added;
    for (auto& [medium, keys] : touched) {
      auto& published = published_[medium];
      std::vector<KvEventDigest> g, a;
      for (const BundleKey& k : keys) {
        bool present = medium == "CPU" && pinned(k);
        for (size_t i = 0; i < chain.tier_count() && !present; ++i) {
          present = media_[i] == medium && tier_keys_[i].count(k) != 0;
        }
        if (present && published.insert(k).second) {
          a.push_back(DigestOfKey(k));
        } else if (!present && published.erase(k) != 0) {
          g.push_back(DigestOfKey(k));
        }
      }
      gone.emplace_back(medium, std::move(g));
      added.emplace_back(medium, std::move(a));
    }
    bool all_empty = true;
    for (const auto& [medium, set] : published_) all_empty = all_empty && set.empty();
    if (all_empty && any_before && !has_remote_) {
      // Every medium emptied at once (FLUSHDB): one AllBlocksCleared instead of the removals.
      VllmKvEvent cleared;
      cleared.type = VllmKvEvent::Type::kAllBlocksCleared;
      events.push_back(std::move(cleared));
    } else {
      for (const auto& [medium, g] : gone) AddEvents(events, VllmKvEvent::Type::kBlockRemoved, medium, g);
      for (const auto& [medium, a] : added) AddEvents(events, VllmKvEvent::Type::kBlockStored, medium, a);
    }
  }
  last_pins_ = std::move(pins);
  if (!events.empty() && publisher_->Publish(std::move(events)) > 0) resync_ = true;
}

void TierEventTracker::RenderMetrics(std::string& out) const {
  const VllmKvEventStats s = publisher_->Stats();
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
  };
  counter("sparsekv_kv_events_batches_total", "KV-event batches published (vLLM wire)", s.published_batches);
  counter("sparsekv_kv_events_total", "KV events published (vLLM wire)", s.published_events);
  counter("sparsekv_kv_events_dropped_total", "KV events dropped on a full queue (shown as sequence gaps)",
          s.dropped_events);
  counter("sparsekv_kv_events_sequence_gaps_total", "Sequence numbers skipped for dropped KV events",
          s.sequence_gaps);
  counter("sparsekv_kv_events_replay_requests_total", "KV-event replay requests served", s.replay_requests);
  counter("sparsekv_kv_events_replayed_batches_total", "KV-event batches sent again through replay",
          s.replayed_batches);
  {
    std::lock_guard<std::mutex> l(tick_mu_);
    counter("sparsekv_kv_events_listings_total",
            "Times the tiers were listed whole (at start, after dropped events, when a tier's journal overflowed)",
            listings_);
  }
  counter("sparsekv_kv_events_resyncs_total",
          "Times the tiers' whole contents were published again after dropped events",
          resyncs_.load(std::memory_order_relaxed));
  out += fmt::format("# HELP sparsekv_kv_events_queued KV events waiting to be published\n"
                     "# TYPE sparsekv_kv_events_queued gauge\nsparsekv_kv_events_queued {}\n",
                     s.queued_events);
}

}  // namespace sparsekv::server
