// TierEventTracker: sparsekvd's tiers on vLLM's KV-event wire (sparsekv/vllm_kv_events.h).
//
// Every `tick_ms` it takes the keys each local tier added and removed since the last tick
// (Tier::SetKeyJournal; pins count as host memory) and publishes the difference from what it
// published before, per medium: host memory "CPU", SSD and RocksDB "DISK". A tick costs
// O(changes), not O(blocks held); the tiers are listed (Tier::ListKeys) only at the first tick,
// after dropped events, when a journal overflowed, or for a tier that keeps none. So PUT, promotion, demotion to the SSD tier, eviction, DELETE,
// FLUSHDB and corruption all reach subscribers as BlockStored / BlockRemoved within a tick, and
// the index a subscriber keeps equals the tiers' contents at each tick (a block stored and gone
// within one tick is not reported). When every medium empties at once it publishes
// AllBlocksCleared instead. At start it publishes AllBlocksCleared, then what the tiers hold
// (after a restart, the SSD's blocks), so a subscriber drops what an earlier run reported.
// The Redis Cluster tier ("SHARED") cannot be listed: its blocks are published as PUTs and
// DELETEs succeed (the chain writes every PUT behind to it), never as it evicts.
//
// Events the publisher drops on a full queue (a sequence gap, never in the replay buffer) would
// leave subscribers wrong for good: the tracker then publishes AllBlocksCleared and the whole
// contents again at its next tick with an empty queue (sparsekv_kv_events_resyncs_total).
//
// Hashes are the 16 bytes a client named the block with, high 64 bits first (a native hash as
// `sparsekv get` prints it, a RESP bridge key's hex), so uint64 mode publishes the low 64 bits.
// Namespaces share one stream.
//
// The listing runs on the tracker's thread; PUT and GET never wait for it or for subscribers.
// Thread safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "server/tiered_store.h"
#include "sparsekv/vllm_kv_events.h"

namespace sparsekv::server {

struct TierEventTrackerOptions {
  VllmKvEventOptions publisher;
  // How often the tiers are listed and the differences published. Default: 100 ms.
  uint32_t tick_ms = 100;
};

class TierEventTracker {
 public:
  // Binds the publisher's sockets and starts listing `store`'s tiers; `store` must outlive it.
  static Result<std::unique_ptr<TierEventTracker>> Start(const TierEventTrackerOptions& options,
                                                         TieredStore& store);
  ~TierEventTracker();

  // Lists the tiers now and publishes the differences (tests; the thread does it every tick).
  void Tick();
  VllmKvEventStats Stats() const { return publisher_->Stats(); }
  // Full listings of the tiers done so far (the first tick's, and after drops or overflows).
  uint64_t listings() const {
    std::lock_guard<std::mutex> l(tick_mu_);
    return listings_;
  }
  // Prometheus text: sparsekv_kv_events_* counters.
  void RenderMetrics(std::string& out) const;

 private:
  TierEventTracker(const TierEventTrackerOptions& options, TieredStore& store,
                   std::unique_ptr<VllmKvEventPublisher> publisher);
  void OnRecord(uint32_t ns, const wire::EventRecord& e);
  void Run();

  const TierEventTrackerOptions options_;
  TieredStore& store_;
  std::unique_ptr<VllmKvEventPublisher> publisher_;
  std::vector<std::string> media_;  // per chain tier
  bool has_remote_ = false;

  // The full path: lists every local tier (its journal emptied first) and publishes the
  // difference from what was published.
  std::vector<VllmKvEvent> ListAndDiff(const std::vector<BundleKey>& pins);

  mutable std::mutex tick_mu_;  // one Tick at a time
  std::unordered_map<std::string, std::unordered_set<BundleKey, BundleKeyHasher>> published_;
  // Per chain tier: its journal (null for the remote tier or a tier that keeps none) and the
  // keys it held at the last tick, as its journal told.
  std::vector<std::shared_ptr<KeyJournal>> journals_;
  std::vector<std::unordered_set<BundleKey, BundleKeyHasher>> tier_keys_;
  uint64_t listings_ = 0;  // full listings done (tests)
  bool first_tick_ = true;
  // The publisher dropped some of a tick's events (its queue was full): the next tick with room
  // publishes AllBlocksCleared and the whole contents again.
  bool resync_ = false;
  std::atomic<uint64_t> resyncs_{0};
  std::vector<BundleKey> last_pins_;  // sorted

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace sparsekv::server
