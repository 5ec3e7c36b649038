#include "server/kv_event_tracker.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
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
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    Tier& tier = chain.tier(i);
    if (tier.remote()) {
      media_.push_back(kShared);
      has_remote_ = true;
    } else if (dynamic_cast<HostTier*>(&tier) != nullptr) {
      media_.push_back("CPU");
    } else {
      media_.push_back("DISK");  // the SSD and RocksDB tiers
    }
  }
}

TierEventTracker::~TierEventTracker() {
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

void TierEventTracker::Tick() {
  std::lock_guard<std::mutex> tick_lock(tick_mu_);
  TierChain& chain = store_.chain();
  // Nothing to list when no tier stored, evicted, erased or dropped a bundle since the last tick
  // and the pins are the same: an idle daemon holding millions of blocks costs a tick nothing.
  std::vector<uint64_t> marks;
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    if (media_[i] == kShared) continue;
    const TierStats st = chain.tier(i).Stats();
    marks.push_back(st.puts);
    marks.push_back(st.evictions + st.erased + st.corrupt);
    marks.push_back(st.items);
  }
  std::vector<BundleKey> pins = store_.PinnedKeys();
  std::sort(pins.begin(), pins.end(), [](const BundleKey& a, const BundleKey& b) {
    return std::tie(a.namespace_id, a.hash.hi, a.hash.lo) < std::tie(b.namespace_id, b.hash.hi, b.hash.lo);
  });
  // After dropped events subscribers hold a wrong picture: start over (AllBlocksCleared, then
  // everything), once the queue has room for it.
  const bool resync = resync_ && publisher_->Stats().queued_events == 0;
  if (!first_tick_ && !resync && marks == last_marks_ && pins == last_pins_) return;
  last_marks_ = std::move(marks);
  last_pins_ = pins;
  std::unordered_map<std::string, std::unordered_set<BundleKey, BundleKeyHasher>> now;
  for (size_t i = 0; i < chain.tier_count(); ++i) {
    if (media_[i] == kShared) continue;
    auto& set = now[media_[i]];
    if (std::optional<std::vector<BundleKey>> keys = chain.tier(i).ListKeys()) {
      set.insert(keys->begin(), keys->end());
    }
  }
  for (const BundleKey& k : pins) now["CPU"].insert(k);

  std::vector<VllmKvEvent> events;
  if (first_tick_ || resync) {
    if (resync) {
      resync_ = false;
      published_.clear();
      resyncs_.fetch_add(1, std::memory_order_relaxed);
    }
    first_tick_ = false;
    VllmKvEvent cleared;
    cleared.type = VllmKvEvent::Type::kAllBlocksCleared;
    events.push_back(std::move(cleared));
  } else {
    bool all_empty = true, any_before = false;
    for (const auto& [medium, set] : now) all_empty = all_empty && set.empty();
    for (const auto& [medium, set] : published_) any_before = any_before || !set.empty();
    if (all_empty && any_before && !has_remote_) {
      VllmKvEvent cleared;
      cleared.type = VllmKvEvent::Type::kAllBlocksCleared;
      events.push_back(std::move(cleared));
      published_.clear();
    }
  }
  const uint32_t max_hashes = 4096;  // per event, to bound a payload
  auto add = [&](VllmKvEvent::Type type, const std::string& medium, std::vector<KvEventDigest>& hashes) {
    for (size_t i = 0; i < hashes.size(); i += max_hashes) {
      VllmKvEvent e;
      e.type = type;
      e.medium = medium;
      e.block_hashes.assign(hashes.begin() + i, hashes.begin() + std::min<size_t>(hashes.size(), i + max_hashes));
      events.push_back(std::move(e));
    }
  };
  // Removals first: a block moving from CPU to DISK is then never in neither.
  for (auto& [medium, before] : published_) {
    const auto& after = now[medium];
    std::vector<KvEventDigest> gone;
    for (const BundleKey& k : before) {
      if (!after.count(k)) gone.push_back(DigestOfKey(k));
    }
    add(VllmKvEvent::Type::kBlockRemoved, medium, gone);
  }
  for (auto& [medium, after] : now) {
    const auto& before = published_[medium];
    std::vector<KvEventDigest> added;
    for (const BundleKey& k : after) {
      if (!before.count(k)) added.push_back(DigestOfKey(k));
    }
    add(VllmKvEvent::Type::kBlockStored, medium, added);
  }
  published_ = std::move(now);
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
  counter("sparsekv_kv_events_resyncs_total",
          "Times the tiers' whole contents were published again after dropped events",
          resyncs_.load(std::memory_order_relaxed));
  out += fmt::format("# HELP sparsekv_kv_events_queued KV events waiting to be published\n"
                     "# TYPE sparsekv_kv_events_queued gauge\nsparsekv_kv_events_queued {}\n",
                     s.queued_events);
}

}  // namespace sparsekv::server
