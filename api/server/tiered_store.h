// TieredStore: the DaemonStore over a TierChain (host memory, then SSD and/or RocksDB).
//
// A client's bytes for one block become one single-segment bundle filed under
// (namespace id, block hash); its XXH3 checksum is checked on every read by every tier, so
// corrupt bytes are reported and never served. Pinned blocks are held in memory, outside the
// tiers' eviction orders, up to a byte budget: a pin that does not fit displaces pins of lower priority
// or is refused. Unpinning hands the block back to the chain. Hinted blocks stay in the tiers,
// protected from eviction within each tier's hint bound, for the hint's time to live.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "server/daemon_store.h"
#include "sparsekv/offload_options.h"
#include "sparsekv/thread_annotations.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv::server {

struct TieredStoreOptions {
  // Tiers and their stacking. Default: a 1 GiB host tier only.
  OffloadOptions offload;
  // Bytes of pinned blocks held in memory. Default: 256 MiB.
  uint64_t pin_budget_bytes = 256ull << 20;
  // Blocks one session may hint at once (each HINT's blocks count until it ends). Default: 65536.
  uint64_t max_hinted_blocks_per_session = 65536;
  // The longest time to live a HINT may ask for. Default: 10 minutes.
  uint32_t max_hint_ttl_ms = 600000;
};

class TieredStore : public DaemonStore {
 public:
  static Result<std::unique_ptr<TieredStore>> Open(const TieredStoreOptions& options);
  ~TieredStore() override;

  wire::LookupReply Lookup(uint32_t ns, std::span<const wire::WireHash> hashes) override;
  std::vector<wire::ItemStatus> Put(uint32_t ns, std::span<const wire::PutItem> items) override;
  // With a host tier first: the values are copied into it at once, and nothing waits for I/O
  // (a write-through copy below, or erasing an older version below, finishes later on the
  // chain's threads). It may wait briefly for another thread handing an evicted older copy of a
  // key down (HostTier::EraseOlderAsync), never for the tier below to store it.
  bool TryPutWithoutBlocking(uint32_t ns, std::span<const wire::PutItem> items, PutDone done) override;
  bool PutsWithoutBlocking() const override;
  bool LooksUpWithoutBlocking() const override;
  void Get(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) override;
  void GetInPlace(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) override;
  bool TryGetWithoutBlocking(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink,
                             bool check) override;
  Status Recheck(uint32_t ns, const wire::WireHash& hash, const Keep& keep) override;
  // Pinned blocks and the host tier answer from memory in place; the SSD tier reads the 4 KiB
  // sectors the ranges lie in (an item needing more than 256 of them reads its whole record,
  // so one request holds at most 1 MiB of sectors at a time); any other tier hands the record
  // up, as a GET does.
  void GetRanges(uint32_t ns, std::span<const wire::RangeItem> items, const RangesSink& sink) override;
  // The host tier's arena when it is memfd-backed (offload.host.backing).
  Arena SharedArena() const override;
  Arena LendTable() const override;
  wire::LendInfo Lend(uint32_t ns, const wire::WireHash& hash, const Keep& keep) override;
  uint64_t TouchRead(uint32_t ns, std::span<const wire::WireHash> hashes) override;
  // Write leases: the room is an extent of the host tier (HostTier::Reserve), and a commit
  // checks it there (HostTier::CommitReserved) before the put's usual course (DemoteAsync: the
  // tiers below, the pins, the events). The version is taken at the reservation: a PUT of the
  // same key acknowledged between a reservation and its commit wins over it.
  Result<std::unique_ptr<PutReservation>> ReservePut(uint32_t ns, const wire::WireHash& hash,
                                                     uint64_t bytes, bool shared = true) override;
  void CommitPuts(uint32_t ns, std::vector<std::unique_ptr<PutReservation>> reserved, std::vector<uint64_t> checksums,
                  PutDone done) override;
  void CommitWritten(uint32_t ns, std::unique_ptr<PutReservation> room, PutDone done) override;
  std::vector<wire::ItemStatus> Pin(uint32_t ns, std::span<const wire::WireHash> hashes, uint8_t priority) override;
  std::vector<wire::ItemStatus> Unpin(uint32_t ns, std::span<const wire::WireHash> hashes) override;
  std::vector<wire::ItemStatus> Delete(uint32_t ns, std::span<const wire::WireHash> hashes) override;
  std::string StatsJson(uint32_t ns) override;
  std::vector<wire::WireHash> ListHashes(uint32_t ns) override;
  // Hints end at their time to live, checked as requests arrive (Lookup, Put, Get, Hint,
  // StatsJson): only a put or a read can evict, so none outlives its time where it matters.
  Result<wire::HintReply> Hint(uint64_t session, uint32_t ns, std::span<const wire::WireHash> hashes,
                               uint32_t ttl_ms) override;
  Status DropHint(uint64_t session, uint64_t hint) override;
  void EndSession(uint64_t session) override;
  // Under write-back, what the first tier holds; under write-through, what every local tier does.
  uint64_t MaxValueBytes() const override;
  std::vector<TierInfo> Tiers() override;
  uint64_t Subscribe(uint32_t ns, EventSink sink) override;
  void Unsubscribe(uint64_t subscription) override;
  void RenderMetrics(std::string& out) override;
  Status Flush() override;

  TierChain& chain() { return *chain_; }
  // The keys pinned in memory now (outside the tiers), every namespace.
  std::vector<BundleKey> PinnedKeys() SPARSEKV_EXCLUDES(mu_);
  // Called with every event record of every namespace, after the subscribers (the KV-event
  // tracker's view of the remote tier). Set before the store is shared.
  using RecordObserver = std::function<void(uint32_t ns, const wire::EventRecord&)>;
  void SetRecordObserver(RecordObserver observer) { observer_ = std::move(observer); }

 private:
  explicit TieredStore(const TieredStoreOptions& options, std::unique_ptr<TierChain> chain);
  uint8_t WireTier(int chain_index) const;
  // The blocks of `keys` from the chain, each the newest version when the call returns.
  std::vector<Result<BundlePtr>> FetchForPin(const std::vector<BundleKey>& keys) SPARSEKV_EXCLUDES(mu_);
  void Emit(uint32_t ns, const wire::EventRecord& e);
  // Put's work: the bytes are copied before it returns; `done` is called once the chain answers.
  void StartPut(uint32_t ns, std::span<const wire::PutItem> items, PutDone done);
  void CountPuts(uint32_t ns, uint64_t ok, uint64_t failed, uint64_t bytes);
  // CommitPuts and CommitWritten: with `resequence`, each version takes a new sequence at its
  // commit (HostTier::CommitReserved).
  void Commit(uint32_t ns, std::vector<std::unique_ptr<PutReservation>> reserved, std::vector<uint64_t> checksums,
              bool resequence, PutDone done);
  // A put's bundles on their way to the chain: the answer of each item, the bundles made, and
  // for each bundle its item, hash and value size.
  struct PendingPut {
    std::vector<wire::ItemStatus> out;
    std::vector<BundlePtr> bundles;
    std::vector<size_t> index;  // item of each bundle
    std::vector<wire::WireHash> hashes;
    std::vector<uint64_t> sizes;
  };
  // The rest of a put once its bundles are made: the chain takes them, then the pins, counters
  // and events follow, and `done` gets the answers.
  void FinishPut(uint32_t ns, std::shared_ptr<PendingPut> p, PutDone done);

  void CountGets(uint32_t ns, uint64_t asked, uint64_t hits, uint64_t bytes, uint64_t corrupt);
  // Ends the hints whose time to live is over; cheap (one clock read) when none is.
  void ExpireHints() SPARSEKV_EXCLUDES(hint_mu_);
  // Ends one live hint: its keys are hinted once less in every tier. `how` counts it.
  void EndHintLocked(uint64_t id, uint64_t* how) SPARSEKV_REQUIRES(hint_mu_);

  struct Pinned {
    BundlePtr bundle;
    uint8_t priority = 0;
  };
  struct NamespaceCounters {
    uint64_t lookups = 0, lookup_blocks = 0, lookup_hits = 0;
    uint64_t puts = 0, put_failures = 0, put_bytes = 0;
    uint64_t gets = 0, get_hits = 0, get_bytes = 0;
    uint64_t pins = 0, pinned_blocks = 0, pinned_bytes = 0, deletes = 0, corrupt = 0;
  };
  using Clock = std::chrono::steady_clock;
  struct HintRecord {
    uint64_t session = 0;
    uint32_t ns = 0;
    std::vector<BundleKey> keys;
    Clock::time_point expiry;
  };
  struct HintCounters {
    uint64_t given = 0, blocks = 0, expired = 0, dropped = 0, ended_with_session = 0, refused = 0;
  };

  const TieredStoreOptions options_;
  std::unique_ptr<TierChain> chain_;
  RecordObserver observer_;
  std::vector<uint8_t> wire_tiers_;  // per chain index: the wire code of that tier's kind

  Mutex mu_;
  std::unordered_map<BundleKey, Pinned, BundleKeyHasher> pinned_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t pinned_bytes_ SPARSEKV_GUARDED_BY(mu_) = 0;
  // Pins reading their blocks, and the keys PUT or DELETEd meanwhile (FetchForPin).
  uint32_t pinning_ SPARSEKV_GUARDED_BY(mu_) = 0;
  std::unordered_set<BundleKey, BundleKeyHasher> changed_while_pinning_ SPARSEKV_GUARDED_BY(mu_);
  std::unordered_map<uint32_t, NamespaceCounters> counters_ SPARSEKV_GUARDED_BY(mu_);
  struct Subscriber {
    uint32_t ns;
    EventSink sink;
  };
  std::unordered_map<uint64_t, Subscriber> subscribers_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t next_subscription_ SPARSEKV_GUARDED_BY(mu_) = 1;

  // Hints: live ones by id, their expiries (earliest first; ids of hints ended since are
  // skipped), blocks hinted per session, counters per namespace.
  Mutex hint_mu_;
  std::unordered_map<uint64_t, HintRecord> hints_ SPARSEKV_GUARDED_BY(hint_mu_);
  std::priority_queue<std::pair<Clock::time_point, uint64_t>, std::vector<std::pair<Clock::time_point, uint64_t>>,
                      std::greater<>>
      hint_expiry_ SPARSEKV_GUARDED_BY(hint_mu_);
  std::unordered_map<uint64_t, uint64_t> session_hinted_ SPARSEKV_GUARDED_BY(hint_mu_);
  std::unordered_map<uint32_t, HintCounters> hint_counters_ SPARSEKV_GUARDED_BY(hint_mu_);
  uint64_t next_hint_ SPARSEKV_GUARDED_BY(hint_mu_) = 1;
  uint64_t hinted_blocks_ SPARSEKV_GUARDED_BY(hint_mu_) = 0;
  // The earliest expiry (steady clock, ns), INT64_MAX when no hint lives: ExpireHints's test.
  std::atomic<int64_t> next_hint_expiry_ns_{INT64_MAX};
};

// The wire's 16 hash bytes as a BlockHash (lo first, little-endian) and back.
BlockHash FromWire(const wire::WireHash& h);
wire::WireHash ToWire(const BlockHash& h);

}  // namespace sparsekv::server
