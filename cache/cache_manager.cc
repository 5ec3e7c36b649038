#include "sparsekv/cache_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <queue>
#include <thread>
#include <unordered_map>
#include <utility>

#include "block_index.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv {

using cache_internal::BlockIndex;
using cache_internal::kNoRecord;
using cache_internal::RecordId;

namespace {

// What a pool's pages are needed for when resuming at a block boundary.
enum class PoolRole : uint8_t {
  kFullHistory,  // every block back to the start
  kWindow,       // the ceil(window / block_tokens) blocks before the boundary
  kState,        // the block just before the boundary (its end-of-block snapshot)
};

// A sequence's tokens as far as hashing needs them: the digests of its full blocks and the tokens
// of its partial last block. AppendTokens writes it holding only `mu`, so hashing never blocks the
// manager. Lock order: the manager's lock, then this one.
struct SequenceTokens {
  // Set before the object is shared, then read-only.
  BlockDigest root;
  std::string extra_keys;
  bool hashing = false;
  bool keep_tokens = false;  // CacheManagerOptions::event_token_ids

  Mutex mu;
  uint64_t num_tokens SPARSEKV_GUARDED_BY(mu) = 0;
  std::vector<TokenId> tail SPARSEKV_GUARDED_BY(mu);
  std::vector<BlockDigest> digests SPARSEKV_GUARDED_BY(mu);
  std::vector<TokenId> kept SPARSEKV_GUARDED_BY(mu);  // every token, when keep_tokens
  bool freed SPARSEKV_GUARDED_BY(mu) = false;
};

// A sequence's pages; guarded by the manager's lock (it lives in a guarded map).
struct SequenceEntry {
  std::shared_ptr<SequenceTokens> tokens;
  std::vector<std::vector<PageId>> tables;  // [pool][block]; kInvalidPage once released early
  std::vector<RecordId> records;            // [block]: the record these pages belong to, if any
  std::vector<uint32_t> released_upto;      // [pool]: blocks below were released early
  uint64_t computed = 0;
  uint64_t slot_tokens = 0;
  uint32_t num_blocks = 0;
  uint32_t registered_upto = 0;  // blocks below were registered or found already cached
  bool looked_up = false;
};

struct Pin {
  uint32_t priority = 0;
  std::vector<std::pair<uint32_t, PageId>> pages;  // (pool, page), tail first
};

std::string SeqNotFound(SequenceId seq) {
  return fmt::format("sequence {} does not exist (never created, or already freed)", seq);
}

// Managers whose events this thread is delivering: a listener that changes its manager leaves
// the delivery of the new events to the loop already running below it on this thread.
thread_local std::vector<const void*> tls_delivering;

}  // namespace

class CacheManager::Impl {
 public:
  Impl(const ModelSpec& spec, const CacheManagerOptions& options, BlockGeometry geometry)
      : options_(options),
        geometry_(std::move(geometry)),
        hasher_(options.hash_mode, options.block_tokens),
        block_tokens_(options.block_tokens),
        window_tokens_(spec.window_tokens),
        model_name_(spec.name),
        window_blocks_((spec.window_tokens + options.block_tokens - 1) / options.block_tokens) {}

  Status Init() SPARSEKV_EXCLUDES(mu_);

  // ---- public API, one to one ----
  Result<SequenceId> CreateSequence(const SequenceOptions& options) SPARSEKV_EXCLUDES(mu_);
  Status AppendTokens(SequenceId seq, std::span<const TokenId> tokens) SPARSEKV_EXCLUDES(mu_);
  Result<PrefixMatch> AcquireCachedPrefix(SequenceId seq, uint32_t max_blocks, bool resume)
      SPARSEKV_EXCLUDES(mu_);
  Result<HeldBlock> HoldCachedBlock(const BlockDigest& digest) SPARSEKV_EXCLUDES(mu_) {
    MutexLock l(mu_);
    const RecordId r = index_.Find(digest.hash);
    if (r == kNoRecord || !(record_digest_[r].check == digest.check)) {
      return Status::NotFound("the block is not cached");
    }
    // As EvictAhead holds a block's pages, but the block stays cached and findable.
    HeldBlock held;
    held.digest = record_digest_[r];
    held.cached = true;
    held.pages.assign(P(), kInvalidPage);
    for (size_t p = 0; p < P(); ++p) {
      const PageId page = RecPage(r, p);
      if (page == kInvalidPage) continue;
      Status st = pools_[p]->State(page) == PageState::kCached ? pools_[p]->Revive(page) : pools_[p]->Retain(page);
      if (!st.ok()) {
        Internal(st);
        continue;
      }
      held.pages[p] = page;
      held_pages_[p].fetch_add(1, std::memory_order_relaxed);
      held_refs_[p][page].fetch_add(1, std::memory_order_relaxed);
    }
    return held;
  }
  Result<SlotAllocation> AllocateSlots(SequenceId seq, uint64_t num_tokens,
                                       const BoundarySkip* skip = nullptr) SPARSEKV_EXCLUDES(mu_);
  Status TrimSlots(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  Status CommitComputed(SequenceId seq, uint64_t num_tokens) SPARSEKV_EXCLUDES(mu_);
  Result<SequenceId> Fork(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  Status Free(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  Status GetBlockTable(SequenceId seq, size_t pool, std::vector<PageId>* out) const
      SPARSEKV_EXCLUDES(mu_);
  Result<SequenceInfo> GetSequenceInfo(SequenceId seq) const SPARSEKV_EXCLUDES(mu_);
  Result<PrefixMatch> LookupPrefix(const PrefixQuery& query) const SPARSEKV_EXCLUDES(mu_);
  PrefixMatch LookupDigests(std::span<const BlockDigest> digests, uint64_t prompt_tokens) const
      SPARSEKV_EXCLUDES(mu_);
  Result<PinInfo> PinPrefix(const PrefixQuery& query, uint32_t priority) SPARSEKV_EXCLUDES(mu_);
  Status Unpin(PinId pin) SPARSEKV_EXCLUDES(mu_);
  Status Reset() SPARSEKV_EXCLUDES(mu_);
  Result<HintInfo> HintDigests(std::span<const BlockDigest> digests, const HintOptions& options)
      SPARSEKV_EXCLUDES(mu_);
  Status DropHint(HintId hint) SPARSEKV_EXCLUDES(mu_);
  uint32_t EvictAhead(uint32_t free_target, uint32_t max_blocks, const HeldBlockTaker& take) SPARSEKV_EXCLUDES(mu_);
  void SetLowFreePagesNotify(uint32_t low_free_pages, std::function<void()> notify) SPARSEKV_EXCLUDES(mu_);
  void ReleaseHeldBlock(const HeldBlock& block);
  // When a pool short of `need` has pages held by blocks evicted ahead: waits (mu_ released)
  // until some come back, or briefly, and returns true (the caller starts over). False when
  // waiting cannot help.
  bool WaitForHeldLocked(std::span<const uint32_t> need) SPARSEKV_REQUIRES(mu_);
  // The low-free-pages notification to call after an allocation, or null.
  std::shared_ptr<const std::function<void()>> LowNotifyLocked() const SPARSEKV_REQUIRES(mu_);
  void SetBlockEvictHook(BlockEvictHook hook) SPARSEKV_EXCLUDES(mu_);
  SubscriptionId Subscribe(KvEventListener listener) SPARSEKV_EXCLUDES(mu_);
  SubscriptionId SubscribeBatch(KvEventBatchListener listener) SPARSEKV_EXCLUDES(mu_);
  void Unsubscribe(SubscriptionId id) SPARSEKV_EXCLUDES(mu_, delivery_mu_);
  CacheStats Stats() const SPARSEKV_EXCLUDES(mu_);
  Status CheckInvariants() const SPARSEKV_EXCLUDES(mu_);

  const CacheManagerOptions options_;
  const BlockGeometry geometry_;
  const BlockHasher hasher_;
  uint32_t window_tokens() const { return window_tokens_; }
  const std::string& model_name() const { return model_name_; }
  std::vector<std::unique_ptr<PagePool>> pools_;  // set by Init, then fixed

 private:
  size_t P() const { return pools_.size(); }
  bool Caching() const { return options_.enable_prefix_caching; }

  // ---- records ----
  PageId& RecPage(RecordId r, size_t q) SPARSEKV_REQUIRES(mu_) {
    return record_pages_[r * P() + q];
  }
  PageId RecPage(RecordId r, size_t q) const SPARSEKV_REQUIRES(mu_) {
    return record_pages_[r * P() + q];
  }
  void RemoveRecordLocked(RecordId r) SPARSEKV_REQUIRES(mu_);
  // Gives record r the window and snapshot pages it lacks from block b of sequence s (an equal
  // block computed again); returns the kinds it gained.
  KindSet RepairBoundaryLocked(RecordId r, SequenceEntry& s, uint32_t b) SPARSEKV_REQUIRES(mu_);
  KindSet RecordKindsLocked(RecordId r) const SPARSEKV_REQUIRES(mu_);
  // Tells the eviction policy that record r's pages are protected by a hint, or no longer.
  void ProtectRecordLocked(RecordId r, bool on) SPARSEKV_REQUIRES(mu_);
  // One page joins record r (a repair): the policy learns what it knows about the record.
  void TellNewPageLocked(RecordId r, size_t q, PageId page) SPARSEKV_REQUIRES(mu_);

  // ---- hints ----
  struct Hint {
    std::chrono::steady_clock::time_point deadline;
    std::vector<BlockHash> hashes;  // the blocks it names, cached or not
  };
  // Record r (whose hash some live hint names) becomes protected, unless the bound is reached.
  void ProtectHintedLocked(RecordId r) SPARSEKV_REQUIRES(mu_);
  void EndHintLocked(Hint& hint) SPARSEKV_REQUIRES(mu_);
  // Ends the hints whose time is up; cheap when none is live.
  void ExpireHintsLocked() SPARSEKV_REQUIRES(mu_);

  // ---- lookup ----
  bool ResumableLocked(std::span<const RecordId> chain) const SPARSEKV_REQUIRES(mu_);
  PrefixMatch FindResumableLocked(std::span<const BlockDigest> digests, size_t max_blocks,
                                  std::vector<RecordId>* chain) const SPARSEKV_REQUIRES(mu_);
  // Which blocks of a k-block resumable prefix a holder needs from pool q.
  uint32_t FirstNeededBlock(size_t q, uint32_t k) const;
  size_t MaxLookupBlocks(uint64_t prompt_tokens, size_t digests, bool leave_last_token) const;

  // ---- pages ----
  SequenceEntry* FindLocked(SequenceId seq) SPARSEKV_REQUIRES(mu_);
  const SequenceEntry* FindLocked(SequenceId seq) const SPARSEKV_REQUIRES(mu_);
  // Releases one page of a sequence: to the cache when it is its record's page, else free.
  void ReleaseSeqPageLocked(SequenceEntry& s, size_t q, uint32_t b) SPARSEKV_REQUIRES(mu_);
  // Makes sure `need[q]` pages can be allocated in every pool, giving up pins if it must. On
  // failure nothing has changed.
  Status EnsureAvailableLocked(std::span<const uint32_t> need) SPARSEKV_REQUIRES(mu_);
  void ReleasePinLocked(const Pin& pin) SPARSEKV_REQUIRES(mu_);
  // The pools tell us, under their own locks, which cached page an allocation reuses; the
  // bookkeeping and the drops in other pools happen after the pool call returns.
  void OnPoolEvict(size_t q, PageId page) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS;
  // With `take`, the evicted blocks go to it whole, with a reference on each of their pages,
  // instead of to the eviction hook with their other pages dropped (EvictAhead).
  void ProcessEvictionsLocked(const HeldBlockTaker* take = nullptr) SPARSEKV_REQUIRES(mu_);
  void Internal(const Status& st) SPARSEKV_REQUIRES(mu_);

  // ---- events ----
  void QueueEventLocked(KvEventType type, KindSet kinds, std::span<const BlockHash> hashes,
                        BlockHash parent, std::span<const TokenId> tokens = {}) SPARSEKV_REQUIRES(mu_);
  // Queues a "stored" event for a run of consecutive new blocks and empties the run. With
  // `token_begin`, the run's tokens are already at the end of the queue's tokens, from there.
  void FlushStoredLocked(std::vector<BlockHash>* run, BlockHash parent, KindSet kinds,
                         const size_t* token_begin) SPARSEKV_REQUIRES(mu_);
  void NoteRemovedLocked(const BlockHash& hash, KindSet kinds) SPARSEKV_REQUIRES(mu_);
  void FlushRemovedLocked() SPARSEKV_REQUIRES(mu_);
  void DeliverEvents() SPARSEKV_EXCLUDES(mu_, delivery_mu_);

  void RecordLookupLocked(uint64_t hit_tokens, uint64_t prompt_tokens) SPARSEKV_REQUIRES(mu_);

  // ---- invariants ----
  class ChangeCheck;
  // The manager's bookkeeping against the pools (see CheckInvariants in the header).
  Status CheckAllLocked() const SPARSEKV_REQUIRES(mu_);
  // One sequence's shape and pages; adds its references to `refs` ([pool][page]) when given.
  Status CheckSequenceLocked(SequenceId id, const SequenceEntry& s,
                             std::vector<std::vector<uint32_t>>* refs) const SPARSEKV_REQUIRES(mu_);
  // At the end of a call that changed the manager: the whole check with check_invariants, else,
  // in debug builds, the sequences the call changed (0: none).
  void AfterChangeLocked(SequenceId a, SequenceId b) SPARSEKV_REQUIRES(mu_);

  const uint32_t block_tokens_;
  const uint32_t window_tokens_;
  const std::string model_name_;
  const uint32_t window_blocks_;
  // Set by Init, then fixed.
  std::vector<PoolRole> roles_;
  std::vector<CacheKind> kinds_;
  std::vector<uint32_t> window_pools_, state_pools_;
  // Full-history pools first: a block they evict takes its window and snapshot pages along,
  // which then serve the boundary pools' allocations instead of evicting other blocks' pages.
  std::vector<uint32_t> alloc_order_;
  uint64_t max_records_ = 0;

  mutable Mutex mu_;
  BlockIndex index_ SPARSEKV_GUARDED_BY(mu_) = BlockIndex(0);
  std::vector<BlockDigest> record_digest_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<PageId> record_pages_ SPARSEKV_GUARDED_BY(mu_);  // [record * pools + pool]
  std::vector<RecordId> free_records_ SPARSEKV_GUARDED_BY(mu_);
  // Hints name block hashes, cached or not: a block registered later under a hinted hash is
  // protected from its registration on. How many live hints name each hash; whether each record
  // is protected (its hash is named, and the bound let it).
  // (An open-addressing table: a hint names every block of a prompt, and a scheduler hints every
  // request it queues. Full, a hint leaves the hashes it cannot add unnamed.)
  BlockIndex hinted_hashes_ SPARSEKV_GUARDED_BY(mu_) = BlockIndex(0);
  std::vector<uint8_t> record_protected_ SPARSEKV_GUARDED_BY(mu_);
  std::unordered_map<HintId, Hint> hints_ SPARSEKV_GUARDED_BY(mu_);
  // (deadline, hint), soonest first; entries of hints already dropped are skipped when reached.
  std::priority_queue<std::pair<std::chrono::steady_clock::time_point, HintId>,
                      std::vector<std::pair<std::chrono::steady_clock::time_point, HintId>>,
                      std::greater<>>
      hint_deadlines_ SPARSEKV_GUARDED_BY(mu_);
  HintId next_hint_ SPARSEKV_GUARDED_BY(mu_) = 1;
  uint64_t hinted_records_ SPARSEKV_GUARDED_BY(mu_) = 0;  // records protected
  uint64_t max_hinted_records_ = 0;
  std::vector<std::vector<RecordId>> owners_ SPARSEKV_GUARDED_BY(mu_);  // [pool][page]
  std::vector<std::pair<uint32_t, PageId>> evicted_ SPARSEKV_GUARDED_BY(mu_);
  // Called under mu_, so that installing or removing it waits for a call in progress.
  BlockEvictHook evict_hook_ SPARSEKV_GUARDED_BY(mu_);
  uint32_t low_free_pages_ SPARSEKV_GUARDED_BY(mu_) = 0;
  // Pages of each pool that blocks evicted ahead still hold (EvictAhead to ReleaseHeldBlock):
  // an allocation short of pages waits for them rather than fail.
  std::unique_ptr<std::atomic<uint64_t>[]> held_pages_;
  // The same per page, for CheckInvariants: a held page has references no table or pin explains.
  std::vector<std::unique_ptr<std::atomic<uint16_t>[]>> held_refs_;
  std::condition_variable_any held_back_;
  std::shared_ptr<const std::function<void()>> low_notify_ SPARSEKV_GUARDED_BY(mu_);
  std::unordered_map<SequenceId, SequenceEntry> seqs_ SPARSEKV_GUARDED_BY(mu_);
  SequenceId next_seq_ SPARSEKV_GUARDED_BY(mu_) = 1;
  std::map<PinId, Pin> pins_ SPARSEKV_GUARDED_BY(mu_);
  PinId next_pin_ SPARSEKV_GUARDED_BY(mu_) = 1;
  std::vector<std::vector<PageId>> alloc_scratch_ SPARSEKV_GUARDED_BY(mu_);
  mutable std::vector<RecordId> chain_scratch_ SPARSEKV_GUARDED_BY(mu_);
  // CheckAllLocked's counts, kept so that checking after every call allocates nothing.
  mutable std::vector<std::vector<uint32_t>> check_refs_ SPARSEKV_GUARDED_BY(mu_);
  mutable std::vector<uint8_t> check_live_ SPARSEKV_GUARDED_BY(mu_);
  // The automatic check found a violation: it is counted once and checking stops, so that the
  // first one stays the reported one and a broken manager does not pay for the check again.
  bool invariants_broken_ SPARSEKV_GUARDED_BY(mu_) = false;

  // Statistics.
  CacheStats stats_ SPARSEKV_GUARDED_BY(mu_);
  mutable uint64_t hash_collisions_ SPARSEKV_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<uint64_t, uint64_t>> recent_
      SPARSEKV_GUARDED_BY(mu_);  // (hit, prompt) tokens
  size_t recent_next_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t recent_hit_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t recent_prompt_ SPARSEKV_GUARDED_BY(mu_) = 0;

  // Events: queued under mu_ in the order of the changes, delivered under delivery_mu_ in the
  // same order (one drainer at a time, each taking the whole queue).
  // One of `each` (called per event) and `batch` (per delivered run, may take the events) is set.
  struct Listener {
    SubscriptionId id = 0;
    std::shared_ptr<KvEventListener> each;
    std::shared_ptr<KvEventBatchListener> batch;
  };
  // Copied on write (Subscribe, Unsubscribe): a delivery takes a reference, not a copy.
  std::shared_ptr<const std::vector<Listener>> listeners_ SPARSEKV_GUARDED_BY(mu_) =
      std::make_shared<const std::vector<Listener>>();
  SubscriptionId next_subscription_ SPARSEKV_GUARDED_BY(mu_) = 1;
  uint64_t listeners_generation_ SPARSEKV_GUARDED_BY(mu_) = 0;  // +1 per change of listeners_
  std::atomic<bool> has_listeners_{false};
  // Queued events, flat (kv_events.h, KvEventRun); every vector keeps its capacity, so a
  // steady load queues and delivers events without allocating.
  struct EventQueue {
    std::vector<KvEventRecord> events;
    std::vector<BlockHash> hashes;
    std::vector<TokenId> tokens;
    bool empty() const { return events.empty(); }
    void clear() {
      events.clear();
      hashes.clear();
      tokens.clear();
    }
  };
  EventQueue pending_events_ SPARSEKV_GUARDED_BY(mu_);
  EventQueue delivering_ SPARSEKV_GUARDED_BY(delivery_mu_);
  // The listeners the last delivery used, and their generation: taken again only when changed.
  std::shared_ptr<const std::vector<Listener>> delivery_listeners_ SPARSEKV_GUARDED_BY(delivery_mu_);
  uint64_t delivery_generation_ SPARSEKV_GUARDED_BY(delivery_mu_) = ~uint64_t{0};
  // Blocks removed since the last FlushRemovedLocked: runs of equal kinds, in order.
  std::vector<BlockHash> removed_hashes_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<std::pair<KindSet, size_t>> removed_groups_ SPARSEKV_GUARDED_BY(mu_);
  // CommitComputed's run of new blocks (scratch, kept for its capacity).
  std::vector<BlockHash> run_hashes_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t next_event_ SPARSEKV_GUARDED_BY(mu_) = 1;
  Mutex delivery_mu_;
};

// ---------------------------------------------------------------------------------------------
// Construction

Status CacheManager::Impl::Init() {
  MutexLock l(mu_);
  const uint32_t window_cap =
      options_.window_capacity_blocks ? options_.window_capacity_blocks : options_.capacity_blocks;
  const uint32_t state_cap =
      options_.state_capacity_blocks ? options_.state_capacity_blocks : options_.capacity_blocks;
  uint64_t min_full_cap = UINT64_MAX, boundary_caps = 0;
  for (size_t q = 0; q < geometry_.pools.size(); ++q) {
    const PoolGeometry& g = geometry_.pools[q];
    const CacheKind kind = g.spec.kind;
    const PoolRole role = IsFullHistoryKind(kind)         ? PoolRole::kFullHistory
                          : kind == CacheKind::kSwaWindow ? PoolRole::kWindow
                                                          : PoolRole::kState;
    PagePoolOptions po;
    po.name = fmt::format("{}#{}", CacheKindName(kind), q);
    po.capacity = role == PoolRole::kFullHistory ? options_.capacity_blocks
                  : role == PoolRole::kWindow    ? window_cap
                                                 : state_cap;
    po.page_bytes = options_.metadata_only ? 0 : g.block_stride;
    po.backing = options_.backing;
    po.huge_pages = options_.huge_pages;
    po.eviction = options_.eviction;
    auto pool = PagePool::Create(po);
    if (!pool.ok()) return pool.status().WithContext("cache manager");
    pools_.push_back(std::move(pool).value());
    roles_.push_back(role);
    kinds_.push_back(kind);
    if (role == PoolRole::kWindow) window_pools_.push_back(static_cast<uint32_t>(q));
    if (role == PoolRole::kState) state_pools_.push_back(static_cast<uint32_t>(q));
    if (role == PoolRole::kFullHistory) {
      min_full_cap = std::min<uint64_t>(min_full_cap, po.capacity);
    } else {
      boundary_caps += po.capacity;
    }
    owners_.emplace_back(po.capacity, kNoRecord);
  }
  // Every record holds its own page in each full-history pool (or, without one, at least one
  // page somewhere), which bounds how many can exist at once.
  max_records_ = min_full_cap != UINT64_MAX ? min_full_cap : boundary_caps;
  index_ = BlockIndex(max_records_);
  record_digest_.resize(max_records_);
  record_pages_.assign(max_records_ * pools_.size(), kInvalidPage);
  free_records_.reserve(max_records_);
  for (uint64_t r = max_records_; r-- > 0;) free_records_.push_back(static_cast<RecordId>(r));
  record_protected_.assign(max_records_, 0);
  hinted_hashes_ = BlockIndex(std::max<uint64_t>(uint64_t{1} << 16, 4 * max_records_));
  max_hinted_records_ = static_cast<uint64_t>(options_.hint_bound * static_cast<double>(options_.capacity_blocks));
  alloc_scratch_.resize(pools_.size());
  for (PoolRole role : {PoolRole::kFullHistory, PoolRole::kWindow, PoolRole::kState}) {
    for (size_t q = 0; q < pools_.size(); ++q) {
      if (roles_[q] == role) alloc_order_.push_back(static_cast<uint32_t>(q));
    }
  }
  recent_.assign(std::max<uint32_t>(1, options_.stats_window_requests), {0, 0});
  held_pages_ = std::make_unique<std::atomic<uint64_t>[]>(pools_.size());
  for (size_t q = 0; q < pools_.size(); ++q)
    held_refs_.push_back(std::make_unique<std::atomic<uint16_t>[]>(pools_[q]->capacity()));
  for (size_t q = 0; q < pools_.size(); ++q) {
    pools_[q]->SetEvictListener([this, q](PageId page) { OnPoolEvict(q, page); });
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Helpers

SequenceEntry* CacheManager::Impl::FindLocked(SequenceId seq) {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? nullptr : &it->second;
}

const SequenceEntry* CacheManager::Impl::FindLocked(SequenceId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? nullptr : &it->second;
}

void CacheManager::Impl::Internal(const Status& st) {
  // A broken invariant: counted, and the first one kept, so that tests and the daemon's health
  // check see it; the operation carries on with what is consistent.
  if (stats_.internal_errors++ == 0) stats_.first_internal_error = st.ToString();
}

void CacheManager::Impl::RemoveRecordLocked(RecordId r) {
  if (record_protected_[r]) {
    ProtectRecordLocked(r, false);  // pages a sequence still holds are not the cache's any more
    record_protected_[r] = 0;
    --hinted_records_;
  }
  for (size_t q = 0; q < P(); ++q) {
    PageId& page = RecPage(r, q);
    if (page != kInvalidPage) owners_[q][page] = kNoRecord;
    page = kInvalidPage;
  }
  index_.Erase(record_digest_[r].hash);
  free_records_.push_back(r);
}

KindSet CacheManager::Impl::RepairBoundaryLocked(RecordId r, SequenceEntry& s, uint32_t b) {
  KindSet gained;
  for (size_t q = 0; q < P(); ++q) {
    if (roles_[q] == PoolRole::kFullHistory) continue;
    const PageId page = s.tables[q][b];
    if (RecPage(r, q) != kInvalidPage || page == kInvalidPage) continue;
    RecPage(r, q) = page;
    owners_[q][page] = r;
    TellNewPageLocked(r, q, page);
    gained.Add(kinds_[q]);
  }
  if (!gained.empty()) {
    // The sequence's pages of this block are now partly the record's: releasing them sends
    // exactly those to the cache (ReleaseSeqPageLocked compares page by page).
    s.records[b] = r;
    ++stats_.repaired_blocks;
  }
  return gained;
}

void CacheManager::Impl::ProtectRecordLocked(RecordId r, bool on) {
  for (size_t q = 0; q < P(); ++q) {
    const PageId page = RecPage(r, q);
    if (page == kInvalidPage || pools_[q]->State(page) == PageState::kFree) continue;
    Status st = pools_[q]->SetPageProtected(page, on);
    if (!st.ok()) Internal(st);
  }
}

void CacheManager::Impl::TellNewPageLocked(RecordId r, size_t q, PageId page) {
  // (Repairs give window and snapshot pages, which get no lineage: see ReleaseSeqPageLocked.)
  Status st;
  if (record_protected_[r]) st = pools_[q]->SetPageProtected(page, true);
  if (!st.ok()) Internal(st);
}

KindSet CacheManager::Impl::RecordKindsLocked(RecordId r) const {
  KindSet k;
  for (size_t q = 0; q < P(); ++q) {
    if (RecPage(r, q) != kInvalidPage) k.Add(kinds_[q]);
  }
  return k;
}

uint32_t CacheManager::Impl::FirstNeededBlock(size_t q, uint32_t k) const {
  switch (roles_[q]) {
    case PoolRole::kFullHistory:
      return 0;
    case PoolRole::kWindow:
      return k - std::min(k, window_blocks_);
    case PoolRole::kState:
      return k == 0 ? 0 : k - 1;
  }
  return 0;
}

size_t CacheManager::Impl::MaxLookupBlocks(uint64_t prompt_tokens, size_t digests,
                                           bool leave_last_token) const {
  if (!leave_last_token || prompt_tokens == 0) return digests;
  return std::min<uint64_t>(digests, (prompt_tokens - 1) / block_tokens_);
}

bool CacheManager::Impl::ResumableLocked(std::span<const RecordId> chain) const {
  const uint32_t k = static_cast<uint32_t>(chain.size());
  for (uint32_t q : state_pools_) {
    if (RecPage(chain[k - 1], q) == kInvalidPage) return false;
  }
  for (uint32_t q : window_pools_) {
    for (uint32_t b = FirstNeededBlock(q, k); b < k; ++b) {
      if (RecPage(chain[b], q) == kInvalidPage) return false;
    }
  }
  return true;
}

PrefixMatch CacheManager::Impl::FindResumableLocked(std::span<const BlockDigest> digests,
                                                    size_t max_blocks,
                                                    std::vector<RecordId>* chain) const {
  PrefixMatch m;
  chain->clear();
  const size_t n = std::min(digests.size(), max_blocks);
  for (size_t i = 0; i < n; ++i) {
    const RecordId r = index_.Find(digests[i].hash);
    if (r == kNoRecord) break;
    if (!(record_digest_[r].check == digests[i].check)) {
      ++hash_collisions_;
      break;
    }
    chain->push_back(r);
    // A live record always has every full-history page; only the boundary kinds can be missing.
    if (ResumableLocked(*chain)) m.blocks = static_cast<uint32_t>(i + 1);
  }
  m.chain_blocks = static_cast<uint32_t>(chain->size());
  m.tokens = uint64_t{m.blocks} * block_tokens_;
  return m;
}

void CacheManager::Impl::ReleaseSeqPageLocked(SequenceEntry& s, size_t q, uint32_t b) {
  PageId& page = s.tables[q][b];
  if (page == kInvalidPage) return;
  const RecordId r = s.records[b];
  const bool keep = r != kNoRecord && RecPage(r, q) == page;
  Status st;
  if (keep && roles_[q] == PoolRole::kFullHistory && pools_[q]->policy_uses_lineage()) {
    // The block's key and the page it extends, for the policy's history and its dependents
    // (the first time the page is cached; the pool ignores them after). The parent is block
    // b-1's page when that page is its record's (released after this one: tail first), none
    // when the sequence's copy of block b-1 was a duplicate or is gone.
    PagePool::Lineage lineage{page, record_digest_[r].hash.lo, kInvalidPage};
    if (b > 0) {
      const PageId up = s.tables[q][b - 1];
      const RecordId ur = s.records[b - 1];
      if (up != kInvalidPage && ur != kNoRecord && RecPage(ur, q) == up) lineage.parent = up;
    }
    st = pools_[q]->ReleaseToCache(page, &lineage);
  } else {
    st = keep ? pools_[q]->ReleaseToCache(page) : pools_[q]->Release(page);
  }
  if (!st.ok()) Internal(st);
  page = kInvalidPage;
}

void CacheManager::Impl::ReleasePinLocked(const Pin& pin) {
  for (const auto& [q, page] : pin.pages) {
    Status st = pools_[q]->ReleaseToCache(page);
    if (!st.ok()) Internal(st);
  }
}

void CacheManager::Impl::OnPoolEvict(size_t q, PageId page) {
  // Runs inside a pool call made by this manager with mu_ held (the only caller that allocates).
  evicted_.emplace_back(static_cast<uint32_t>(q), page);
}

void CacheManager::Impl::ProcessEvictionsLocked(const HeldBlockTaker* take) {
  for (size_t i = 0; i < evicted_.size(); ++i) {
    const auto [q, page] = evicted_[i];
    const RecordId r = owners_[q][page];
    if (r == kNoRecord) {
      Internal(
          Status::Internal(fmt::format("evicted page {} of pool {} belongs to no block", page, q)));
      continue;
    }
    const PoolRole role = roles_[q];
    if (take != nullptr) {
      // The taker holds every page of the block; the evicted one is already in use (ours). The
      // others are cached (revived: out of the LRU) or held by a sequence that computed the
      // block again (one more reference). Either way no page is dropped below.
      HeldBlock held;
      held.digest = record_digest_[r];
      held.pages.assign(P(), kInvalidPage);
      for (size_t p = 0; p < P(); ++p) {
        const PageId other = RecPage(r, p);
        if (other == kInvalidPage) continue;
        if (p != q) {
          Status st = pools_[p]->State(other) == PageState::kCached ? pools_[p]->Revive(other)
                                                                    : pools_[p]->Retain(other);
          if (!st.ok()) {
            Internal(st);
            continue;
          }
        }
        held.pages[p] = other;
        held_pages_[p].fetch_add(1, std::memory_order_relaxed);
        held_refs_[p][other].fetch_add(1, std::memory_order_relaxed);
      }
      (*take)(std::move(held));
    } else if (evict_hook_) {
      // Before any page of the block is dropped or handed out: the evicted page is in
      // alloc_scratch_, not yet returned to the caller, and the others are cached or held.
      EvictingBlock e;
      e.digest = record_digest_[r];
      e.pages = std::span<const PageId>(&record_pages_[r * P()], P());
      e.whole_block = role == PoolRole::kFullHistory;
      evict_hook_(e);
    }
    owners_[q][page] = kNoRecord;
    RecPage(r, q) = kInvalidPage;
    KindSet lost = KindSet::Of(kinds_[q]);
    // Losing a full-history page loses the block; losing a window or snapshot page loses that
    // role's pages of the block in every pool (half a snapshot resumes nothing).
    uint64_t dropped = 1;
    for (size_t p = 0; p < P(); ++p) {
      if (role != PoolRole::kFullHistory && roles_[p] != role) continue;
      const PageId other = RecPage(r, p);
      if (other == kInvalidPage) continue;
      // Usually cached. A sequence that recomputed the block and lent the record its window or
      // snapshot page (see CommitComputed) may still hold that page: it then just stops being
      // the cache's, and is freed by its holder. A taker holds them all.
      if (take == nullptr && pools_[p]->State(other) == PageState::kCached) {
        Status st = pools_[p]->Drop(other);
        if (!st.ok()) Internal(st);
      }
      owners_[p][other] = kNoRecord;
      RecPage(r, p) = kInvalidPage;
      lost.Add(kinds_[p]);
      ++dropped;
    }
    NoteRemovedLocked(record_digest_[r].hash, lost);
    if (role == PoolRole::kFullHistory) {
      ++stats_.evicted_blocks;
      RemoveRecordLocked(r);
    } else {
      stats_.evicted_boundary_pages += dropped;
      if (RecordKindsLocked(r).empty()) RemoveRecordLocked(r);
    }
  }
  evicted_.clear();
}

Status CacheManager::Impl::EnsureAvailableLocked(std::span<const uint32_t> need) {
  std::vector<uint64_t> avail(P());
  auto short_of = [&]() -> int {
    for (size_t q = 0; q < P(); ++q) {
      if (need[q] > avail[q]) return static_cast<int>(q);
    }
    return -1;
  };
  for (size_t q = 0; q < P(); ++q) {
    if (need[q] == 0) continue;
    const PagePoolStats ps = pools_[q]->Stats();
    avail[q] = ps.free + ps.cached;
  }
  int q_short = short_of();
  if (q_short < 0) return Status::OK();

  // Give up pins, lowest priority (then oldest) first, counting what they would free before
  // touching anything, so that a request that cannot be met changes nothing.
  std::vector<std::pair<uint32_t, PinId>> order;
  for (const auto& [id, pin] : pins_) {
    if (pin.priority != kPinForever) order.emplace_back(pin.priority, id);
  }
  std::sort(order.begin(), order.end());
  std::unordered_map<uint64_t, uint32_t> refs_left;
  size_t chosen = 0;
  while (q_short >= 0 && chosen < order.size()) {
    for (const auto& [q, page] : pins_.at(order[chosen].second).pages) {
      auto [it, fresh] = refs_left.try_emplace((uint64_t{q} << 32) | page, 0);
      if (fresh) it->second = pools_[q]->RefCount(page);
      if (it->second > 0 && --it->second == 0) ++avail[q];
    }
    ++chosen;
    q_short = short_of();
  }
  if (q_short >= 0) {
    const auto ps = pools_[q_short]->Stats();
    return Status::ResourceExhausted(fmt::format(
        "pool {} ({}): {} pages needed, {} available ({} free, {} cached, {} in use); nothing was "
        "allocated or evicted",
        q_short, CacheKindName(kinds_[q_short]), need[q_short], ps.free + ps.cached, ps.free,
        ps.cached, ps.used));
  }
  for (size_t i = 0; i < chosen; ++i) {
    auto it = pins_.find(order[i].second);
    ReleasePinLocked(it->second);
    pins_.erase(it);
    ++stats_.pins_released;
  }
  return Status::OK();
}

void CacheManager::Impl::RecordLookupLocked(uint64_t hit_tokens, uint64_t prompt_tokens) {
  ++stats_.lookups;
  ++(hit_tokens ? stats_.hits : stats_.misses);
  stats_.lookup_tokens += prompt_tokens;
  stats_.hit_tokens += hit_tokens;
  stats_.hit_blocks += hit_tokens / block_tokens_;
  auto& slot = recent_[recent_next_];
  recent_hit_ += hit_tokens - slot.first;
  recent_prompt_ += prompt_tokens - slot.second;
  slot = {hit_tokens, prompt_tokens};
  recent_next_ = (recent_next_ + 1) % recent_.size();
  stats_.recent_lookups = std::min<uint64_t>(stats_.recent_lookups + 1, recent_.size());
}

// ---------------------------------------------------------------------------------------------
// Invariants

// Runs AfterChangeLocked when a changing call's locked section ends, whichever return it takes.
// Declared right after the MutexLock it relies on, so it runs before the lock is released (and
// after any token lock declared later is released: the check takes token locks itself).
class CacheManager::Impl::ChangeCheck {
 public:
  ChangeCheck(Impl& impl, SequenceId seq) : impl_(impl), a_(seq) {}
  ChangeCheck(const ChangeCheck&) = delete;
  ChangeCheck& operator=(const ChangeCheck&) = delete;
  // A second sequence the call changed (Fork's child).
  void Also(SequenceId seq) { b_ = seq; }
  // The analysis cannot see that the lock outlives this object; the declaration order ensures it.
  ~ChangeCheck() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { impl_.AfterChangeLocked(a_, b_); }

 private:
  Impl& impl_;
  SequenceId a_;
  SequenceId b_ = 0;
};

namespace {

#ifdef NDEBUG
constexpr bool kDebugBuild = false;
#else
constexpr bool kDebugBuild = true;
#endif

const char* PageStateName(PageState st) {
  switch (st) {
    case PageState::kFree:
      return "free";
    case PageState::kLocal:
      return "in a thread cache";
    case PageState::kInUse:
      return "in use";
    case PageState::kCached:
      return "cached";
  }
  return "?";
}

}  // namespace

void CacheManager::Impl::AfterChangeLocked(SequenceId a, SequenceId b) {
  if (invariants_broken_ || (!options_.check_invariants && !kDebugBuild)) return;
  Status st;
  if (options_.check_invariants) {
    st = CheckAllLocked();
  } else {
    for (SequenceId id : {a, b}) {
      const SequenceEntry* s = id != 0 ? FindLocked(id) : nullptr;
      if (s != nullptr) st = CheckSequenceLocked(id, *s, nullptr);
      if (!st.ok()) break;
    }
  }
  if (!st.ok()) {
    invariants_broken_ = true;
    Internal(st);
  }
}

Status CacheManager::Impl::CheckSequenceLocked(SequenceId id, const SequenceEntry& s,
                                               std::vector<std::vector<uint32_t>>* refs) const {
  auto fail = [id](std::string what) {
    return Status::Internal(fmt::format("invariant: sequence {}: {}", id, what));
  };
  const uint32_t n = s.num_blocks;
  if (s.tables.size() != P() || s.released_upto.size() != P())
    return fail(fmt::format("{} tables for {} pools", s.tables.size(), P()));
  if (s.records.size() != n)
    return fail(fmt::format("{} block records for {} blocks", s.records.size(), n));
  // Every block holds at least one slot: a table entry past the slots would be a page nobody
  // writes, still held (a leak until Free), and the next allocation would count from there.
  if (s.slot_tokens > uint64_t{n} * block_tokens_ ||
      (n > 0 && s.slot_tokens <= uint64_t{n - 1} * block_tokens_)) {
    return fail(
        fmt::format("{} slot tokens in {} blocks of {} tokens", s.slot_tokens, n, block_tokens_));
  }
  if (s.computed > s.slot_tokens)
    return fail(fmt::format("{} computed tokens but {} slots", s.computed, s.slot_tokens));
  if (s.registered_upto > n)
    return fail(fmt::format("blocks below {} registered but only {} blocks", s.registered_upto, n));
  {
    MutexLock tl(s.tokens->mu);
    if (s.computed > s.tokens->num_tokens) {
      return fail(
          fmt::format("{} computed tokens but {} appended", s.computed, s.tokens->num_tokens));
    }
  }
  for (uint32_t b = 0; b < n; ++b) {
    if (s.records[b] != kNoRecord && b >= s.registered_upto)
      return fail(fmt::format("block {} has a record but lies past the registered blocks", b));
  }
  for (size_t q = 0; q < P(); ++q) {
    const std::vector<PageId>& table = s.tables[q];
    if (table.size() != n)
      return fail(fmt::format("pool {}: table of {} entries for {} blocks", q, table.size(), n));
    if (s.released_upto[q] > n)
      return fail(fmt::format("pool {}: released up to block {} of {}", q, s.released_upto[q], n));
    const PagePool& pool = *pools_[q];
    for (uint32_t b = 0; b < n; ++b) {
      const PageId page = table[b];
      // Pages are released early (window and snapshot roles only) from the front, and only there;
      // a restore's block not computed yet may lack them (AllocateRestoreSlots).
      const bool may_lack = roles_[q] != PoolRole::kFullHistory && uint64_t{b} * block_tokens_ >= s.computed;
      if ((page == kInvalidPage) != (b < s.released_upto[q]) && !(page == kInvalidPage && may_lack)) {
        return fail(page == kInvalidPage
                        ? fmt::format("pool {} block {}: no page, but released only below block {}",
                                      q, b, s.released_upto[q])
                        : fmt::format("pool {} block {}: page {} kept below block {}, where "
                                      "pages were released",
                                      q, b, page, s.released_upto[q]));
      }
      if (page == kInvalidPage) continue;
      if (!pool.Valid(page))
        return fail(fmt::format("pool {} block {}: page {} is out of range", q, b, page));
      const PageState st = pool.State(page);
      if (st != PageState::kInUse || pool.RefCount(page) == 0) {
        return fail(fmt::format("pool {} block {}: page {} is {} with {} references", q, b, page,
                                PageStateName(st), pool.RefCount(page)));
      }
      // A block's page that a record owns is shared with the cache: only a sequence that knows it
      // (records[b]) may hold it, or its release would free the cache's page.
      const RecordId owner = owners_[q][page];
      if (owner != kNoRecord && s.records[b] != owner) {
        return fail(
            fmt::format("pool {} block {}: page {} belongs to cached block record {}, "
                        "which the sequence does not know",
                        q, b, page, owner));
      }
      if (refs != nullptr) ++(*refs)[q][page];
    }
  }
  return Status::OK();
}

Status CacheManager::Impl::CheckAllLocked() const {
  check_refs_.resize(P());
  for (size_t q = 0; q < P(); ++q) check_refs_[q].assign(pools_[q]->capacity(), 0);
  for (const auto& [id, s] : seqs_) {
    SPARSEKV_RETURN_IF_ERROR(CheckSequenceLocked(id, s, &check_refs_));
  }
  for (const auto& [id, pin] : pins_) {
    for (const auto& [q, page] : pin.pages) {
      if (q >= P() || !pools_[q]->Valid(page)) {
        return Status::Internal(
            fmt::format("invariant: pin {}: page {} of pool {} does not exist", id, page, q));
      }
      ++check_refs_[q][page];
    }
  }
  if (seqs_.size() != stats_.sequences) {
    return Status::Internal(fmt::format("invariant: {} sequences, but the statistics count {}",
                                        seqs_.size(), stats_.sequences));
  }

  // Records: live unless in the free list (once), findable under their own hash, each page owned
  // back, every full-history page present.
  check_live_.assign(max_records_, 1);
  for (RecordId r : free_records_) {
    if (r >= max_records_ || !check_live_[r]) {
      return Status::Internal(
          fmt::format("invariant: block record {} is in the free list twice or out of range", r));
    }
    check_live_[r] = 0;
  }
  uint64_t live = 0;
  for (RecordId r = 0; r < max_records_; ++r) {
    bool any = false;
    for (size_t q = 0; q < P(); ++q) {
      const PageId page = RecPage(r, q);
      if (page == kInvalidPage) {
        if (check_live_[r] && roles_[q] == PoolRole::kFullHistory) {
          return Status::Internal(fmt::format(
              "invariant: cached block record {} has no page in full-history pool {}", r, q));
        }
        continue;
      }
      if (!check_live_[r]) {
        return Status::Internal(fmt::format(
            "invariant: free block record {} still names page {} of pool {}", r, page, q));
      }
      if (!pools_[q]->Valid(page) || owners_[q][page] != r) {
        return Status::Internal(fmt::format(
            "invariant: block record {}: page {} of pool {} is owned by record {}", r, page, q,
            pools_[q]->Valid(page) ? static_cast<int64_t>(owners_[q][page]) : -1));
      }
      any = true;
    }
    if (!check_live_[r]) continue;
    ++live;
    if (!any) return Status::Internal(fmt::format("invariant: block record {} has no page", r));
    if (index_.Find(record_digest_[r].hash) != r) {
      return Status::Internal(
          fmt::format("invariant: block record {} is not what the index finds under its hash", r));
    }
  }
  if (live != index_.size()) {
    return Status::Internal(
        fmt::format("invariant: {} live block records but {} indexed", live, index_.size()));
  }

  // What the eviction policies know: each pool's policy holds exactly its cached pages (and its
  // own bookkeeping of dependents agrees), and a record's pages are protected exactly when a
  // live hint names it.
  uint64_t hinted = 0;
  for (RecordId r = 0; r < max_records_; ++r) {
    if (!check_live_[r]) {
      if (record_protected_[r]) return Status::Internal(fmt::format("invariant: free block record {} is protected", r));
      continue;
    }
    if (record_protected_[r] && hinted_hashes_.Find(record_digest_[r].hash) == kNoRecord) {
      return Status::Internal(fmt::format("invariant: block record {} is protected but no live hint names it", r));
    }
    hinted += record_protected_[r];
    for (size_t q = 0; q < P(); ++q) {
      const PageId page = RecPage(r, q);
      if (page == kInvalidPage) continue;
      if (pools_[q]->PageProtected(page) != (record_protected_[r] != 0)) {
        return Status::Internal(fmt::format("invariant: block record {} is {}protected but page {} of pool {} is {}",
                                            r, record_protected_[r] ? "" : "not ", page, q,
                                            record_protected_[r] ? "not" : "protected"));
      }
    }
  }
  if (hinted != hinted_records_) {
    return Status::Internal(fmt::format("invariant: {} block records are hinted but {} are counted", hinted, hinted_records_));
  }
  for (size_t q = 0; q < P(); ++q) {
    Status st = pools_[q]->CheckPolicy();
    if (!st.ok()) return Status::Internal(fmt::format("invariant: {}", st.message()));
  }

  // Pages: each reference is a table's or a pin's; cached pages are findable; no page that a
  // record names is free.
  for (size_t q = 0; q < P(); ++q) {
    const PagePool& pool = *pools_[q];
    uint64_t used = 0, cached = 0;
    // No page is held now if none was when the scan began: holds are only taken under mu_.
    const bool holds = held_pages_[q].load(std::memory_order_acquire) > 0;
    for (PageId page = 0; page < pool.capacity(); ++page) {
      const uint32_t want = check_refs_[q][page];
      // A block evicted ahead holds its pages beyond the tables and pins. Given back without
      // the lock (ReleaseHeldBlock: the reference goes, then its count), so either may be seen.
      // A page being given back may also show its state and count mid-change: with a hold
      // seen, only the count's range is checked.
      const uint32_t held = held_refs_[q][page].load(std::memory_order_acquire);
      const uint32_t rc = pool.RefCount(page);
      const PageState st = pool.State(page);
      const RecordId owner = owners_[q][page];
      if (rc < want || rc > want + held || (held == 0 && (rc > 0) != (st == PageState::kInUse))) {
        return Status::Internal(fmt::format(
            "invariant: pool {} page {} is {} with {} references, but {} tables and pins hold it",
            q, page, PageStateName(st), rc, want));
      }
      if (st == PageState::kCached && owner == kNoRecord) {
        return Status::Internal(fmt::format(
            "invariant: pool {} page {} is cached but belongs to no block record", q, page));
      }
      if (owner != kNoRecord) {
        if (!check_live_[owner] || RecPage(owner, q) != page) {
          return Status::Internal(fmt::format(
              "invariant: pool {} page {} is owned by block record {}, which does not name it", q,
              page, owner));
        }
        if (st != PageState::kCached && st != PageState::kInUse) {
          return Status::Internal(
              fmt::format("invariant: pool {} page {} of cached block record {} is {}", q, page,
                          owner, PageStateName(st)));
        }
      }
      used += st == PageState::kInUse;
      cached += st == PageState::kCached;
    }
    const PagePoolStats ps = pool.Stats();
    if (!holds && (ps.used != used || ps.cached != cached)) {  // held pages may come back meanwhile
      return Status::Internal(fmt::format(
          "invariant: pool {} counts {} used and {} cached pages, its pages say {} and {}", q,
          ps.used, ps.cached, used, cached));
    }
  }
  return Status::OK();
}

Status CacheManager::Impl::CheckInvariants() const {
  MutexLock l(mu_);
  SPARSEKV_RETURN_IF_ERROR(CheckAllLocked());
  if (stats_.internal_errors != 0) {
    return Status::Internal(fmt::format("invariant: {} internal errors counted, the first: {}",
                                        stats_.internal_errors, stats_.first_internal_error));
  }
  for (size_t q = 0; q < P(); ++q) {
    const uint64_t misuse = pools_[q]->Stats().misuse;
    if (misuse != 0) {
      return Status::Internal(
          fmt::format("invariant: pool {} ({}) counted {} misuses", q, pools_[q]->name(), misuse));
    }
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Events

void CacheManager::Impl::QueueEventLocked(KvEventType type, KindSet kinds,
                                          std::span<const BlockHash> hashes, BlockHash parent,
                                          std::span<const TokenId> tokens) {
  KvEventRecord e;
  e.type = type;
  e.sequence_number = next_event_++;
  e.kinds = kinds;
  e.parent_hash = parent;
  e.block_tokens = block_tokens_;
  e.hash_begin = pending_events_.hashes.size();
  e.hash_count = hashes.size();
  pending_events_.hashes.insert(pending_events_.hashes.end(), hashes.begin(), hashes.end());
  e.token_begin = pending_events_.tokens.size();
  e.token_count = tokens.size();
  pending_events_.tokens.insert(pending_events_.tokens.end(), tokens.begin(), tokens.end());
  pending_events_.events.push_back(e);
  ++stats_.events;
}

void CacheManager::Impl::FlushStoredLocked(std::vector<BlockHash>* run, BlockHash parent,
                                           KindSet kinds, const size_t* token_begin) {
  if (run->empty()) return;
  QueueEventLocked(KvEventType::kBlocksStored, kinds, *run, parent);
  if (token_begin != nullptr) {
    KvEventRecord& e = pending_events_.events.back();
    e.token_begin = *token_begin;
    e.token_count = pending_events_.tokens.size() - *token_begin;
  }
  run->clear();
}

void CacheManager::Impl::NoteRemovedLocked(const BlockHash& hash, KindSet kinds) {
  if (!has_listeners_.load(std::memory_order_relaxed)) return;
  if (removed_groups_.empty() || removed_groups_.back().first != kinds) removed_groups_.push_back({kinds, 0});
  ++removed_groups_.back().second;
  removed_hashes_.push_back(hash);
}

void CacheManager::Impl::FlushRemovedLocked() {
  size_t begin = 0;
  for (const auto& [kinds, count] : removed_groups_) {
    QueueEventLocked(KvEventType::kBlocksRemoved, kinds,
                     std::span<const BlockHash>(removed_hashes_.data() + begin, count), BlockHash{});
    begin += count;
  }
  removed_groups_.clear();
  removed_hashes_.clear();
}

void CacheManager::Impl::DeliverEvents() {
  if (!has_listeners_.load(std::memory_order_acquire)) return;
  if (std::find(tls_delivering.begin(), tls_delivering.end(), this) != tls_delivering.end()) return;
  MutexLock d(delivery_mu_);
  tls_delivering.push_back(this);
  for (;;) {
    {
      MutexLock l(mu_);
      if (pending_events_.empty()) break;
      delivering_.clear();
      std::swap(delivering_, pending_events_);  // the emptied buffers go back to be filled
      if (delivery_generation_ != listeners_generation_) {
        delivery_listeners_ = listeners_;
        delivery_generation_ = listeners_generation_;
      }
    }
    const std::vector<Listener>* listeners = delivery_listeners_.get();
    const KvEventRun run{delivering_.events, delivering_.hashes, delivering_.tokens};
    // Per-event listeners first, each event to every one of them; then the batch listeners.
    bool each = false;
    for (const Listener& fn : *listeners) each |= static_cast<bool>(fn.each);
    if (each) {
      for (size_t i = 0; i < run.events.size(); ++i) {
        const KvEvent e = run.Event(i);
        for (const Listener& fn : *listeners) {
          if (fn.each) (*fn.each)(e);
        }
      }
    }
    for (const Listener& fn : *listeners) {
      if (fn.batch) (*fn.batch)(run);
    }
  }
  tls_delivering.pop_back();
}

uint32_t CacheManager::Impl::EvictAhead(uint32_t free_target, uint32_t max_blocks, const HeldBlockTaker& take) {
  uint32_t n = 0;
  bool events = false;
  {
    MutexLock l(mu_);
    while (n < max_blocks) {
      // The full-history pool furthest below the target: evicting its oldest page takes the
      // block's pages in every pool.
      size_t q = P();
      uint64_t least = free_target;
      for (size_t p = 0; p < P(); ++p) {
        if (roles_[p] != PoolRole::kFullHistory) continue;
        // Pages still held by blocks evicted ahead are as good as free: counting them keeps a
        // second call, before they come back, from evicting more.
        const uint64_t free = pools_[p]->FreeCount() + held_pages_[p].load(std::memory_order_acquire);
        if (free < least) {
          least = free;
          q = p;
        }
      }
      if (q == P()) break;
      const PageId page = pools_[q]->EvictOldest();  // OnPoolEvict queues it
      if (page == kInvalidPage) break;               // nothing cached there
      ProcessEvictionsLocked(&take);
      ++n;
    }
    FlushRemovedLocked();
    events = !pending_events_.empty();
  }
  if (events) DeliverEvents();
  return n;
}

void CacheManager::Impl::ReleaseHeldBlock(const HeldBlock& block) {
  for (size_t p = 0; p < block.pages.size() && p < P(); ++p) {
    if (block.pages[p] == kInvalidPage) continue;
    // The pools' own locks only. A page given back twice is refused and counted by its pool
    // (PagePoolStats::misuse), where the tests look.
    const Status st = block.cached ? pools_[p]->ReleaseToCache(block.pages[p]) : pools_[p]->Release(block.pages[p]);
    if (st.ok()) {
      held_refs_[p][block.pages[p]].fetch_sub(1, std::memory_order_release);
      held_pages_[p].fetch_sub(1, std::memory_order_release);
    }
  }
  // Without mu_ (a taker may call this): a waiter that misses the wake-up looks again within
  // its short wait anyway.
  held_back_.notify_all();
}

bool CacheManager::Impl::WaitForHeldLocked(std::span<const uint32_t> need) {
  // Waiting helps when every pool would have enough with its held pages back (pins given up are
  // left out: EnsureAvailableLocked counted them already). Only held pages coming back change
  // the counts while mu_ is held, so a pool that has enough now got pages back since
  // EnsureAvailableLocked looked: the caller starts over at once.
  bool wait = false;
  for (size_t q = 0; q < P(); ++q) {
    if (need[q] == 0) continue;
    // Held first: ReleaseHeldBlock frees a page before it stops counting it, so a page is
    // always seen in one of the two.
    const uint64_t held = held_pages_[q].load(std::memory_order_acquire);
    const PagePoolStats ps = pools_[q]->Stats();
    if (need[q] > ps.free + ps.cached + held) return false;
    wait |= need[q] > ps.free + ps.cached;
  }
  if (wait) held_back_.wait_for(mu_, std::chrono::milliseconds(1));
  return true;
}

void CacheManager::Impl::SetLowFreePagesNotify(uint32_t low_free_pages, std::function<void()> notify) {
  std::shared_ptr<const std::function<void()>> old;
  {
    MutexLock l(mu_);
    old.swap(low_notify_);
    low_free_pages_ = low_free_pages;
    if (notify) low_notify_ = std::make_shared<const std::function<void()>>(std::move(notify));
  }
  // A call made just before may still hold `old`: wait for it, so the owner may go.
  while (old && old.use_count() > 1) std::this_thread::yield();
}

std::shared_ptr<const std::function<void()>> CacheManager::Impl::LowNotifyLocked() const {
  if (!low_notify_) return nullptr;
  for (size_t p = 0; p < P(); ++p) {
    if (roles_[p] == PoolRole::kFullHistory && pools_[p]->FreeCount() < low_free_pages_) return low_notify_;
  }
  return nullptr;
}

void CacheManager::Impl::SetBlockEvictHook(BlockEvictHook hook) {
  BlockEvictHook old;
  {
    MutexLock l(mu_);
    old.swap(evict_hook_);
    evict_hook_ = std::move(hook);
  }
  // `old` (and what it captured) is destroyed here, outside the lock.
}

SubscriptionId CacheManager::Impl::Subscribe(KvEventListener listener) {
  MutexLock l(mu_);
  const SubscriptionId id = next_subscription_++;
  auto next = std::make_shared<std::vector<Listener>>(*listeners_);
  next->push_back({id, std::make_shared<KvEventListener>(std::move(listener)), nullptr});
  listeners_ = std::move(next);
  ++listeners_generation_;
  has_listeners_.store(true, std::memory_order_release);
  return id;
}

SubscriptionId CacheManager::Impl::SubscribeBatch(KvEventBatchListener listener) {
  MutexLock l(mu_);
  const SubscriptionId id = next_subscription_++;
  auto next = std::make_shared<std::vector<Listener>>(*listeners_);
  next->push_back({id, nullptr, std::make_shared<KvEventBatchListener>(std::move(listener))});
  listeners_ = std::move(next);
  ++listeners_generation_;
  has_listeners_.store(true, std::memory_order_release);
  return id;
}

void CacheManager::Impl::Unsubscribe(SubscriptionId id) {
  std::shared_ptr<const std::vector<Listener>> old;  // destroyed outside the lock
  {
    MutexLock l(mu_);
    auto next = std::make_shared<std::vector<Listener>>(*listeners_);
    std::erase_if(*next, [id](const Listener& e) { return e.id == id; });
    old = std::move(listeners_);
    listeners_ = std::move(next);
    ++listeners_generation_;
    if (listeners_->empty()) {
      has_listeners_.store(false, std::memory_order_release);
      pending_events_.clear();
      removed_groups_.clear();
      removed_hashes_.clear();
    }
  }
  // Wait for a delivery in flight on another thread, so the listener is not called after this
  // returns (unless this is that listener).
  if (std::find(tls_delivering.begin(), tls_delivering.end(), this) == tls_delivering.end()) {
    MutexLock d(delivery_mu_);
    delivery_listeners_.reset();  // nor kept alive by the deliveries' cached list
    delivery_generation_ = ~uint64_t{0};
  }
}

// ---------------------------------------------------------------------------------------------
// Sequences

Result<SequenceId> CacheManager::Impl::CreateSequence(const SequenceOptions& options) {
  auto tokens = std::make_shared<SequenceTokens>();
  tokens->hashing = Caching() && options.cache_blocks;
  tokens->extra_keys = options.extra_keys;
  tokens->keep_tokens = options_.event_token_ids;
  if (tokens->hashing) tokens->root = hasher_.Root(options.namespace_salt);
  MutexLock l(mu_);
  const SequenceId id = next_seq_++;
  ChangeCheck check(*this, id);
  SequenceEntry& s = seqs_[id];
  s.tokens = std::move(tokens);
  s.tables.resize(P());
  s.released_upto.assign(P(), 0);
  ++stats_.sequences;
  return id;
}

Status CacheManager::Impl::AppendTokens(SequenceId seq, std::span<const TokenId> tokens) {
  std::shared_ptr<SequenceTokens> t;
  {
    MutexLock l(mu_);
    const SequenceEntry* s = FindLocked(seq);
    if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
    t = s->tokens;
  }
  MutexLock tl(t->mu);
  if (t->freed) return Status::NotFound(SeqNotFound(seq));
  t->num_tokens += tokens.size();
  if (!t->hashing) return Status::OK();
  if (t->keep_tokens) t->kept.insert(t->kept.end(), tokens.begin(), tokens.end());
  std::span<const TokenId> rest = tokens;
  if (!t->tail.empty()) {
    const size_t take = std::min<size_t>(block_tokens_ - t->tail.size(), rest.size());
    t->tail.insert(t->tail.end(), rest.begin(), rest.begin() + take);
    rest = rest.subspan(take);
    if (t->tail.size() < block_tokens_) return Status::OK();
    const BlockDigest& parent = t->digests.empty() ? t->root : t->digests.back();
    t->digests.push_back(hasher_.Next(parent, t->tail, t->extra_keys));
    t->tail.clear();
  }
  const BlockDigest parent = t->digests.empty() ? t->root : t->digests.back();
  const size_t n = hasher_.HashFullBlocks(parent, rest, t->extra_keys, &t->digests);
  rest = rest.subspan(n * block_tokens_);
  t->tail.assign(rest.begin(), rest.end());
  return Status::OK();
}

Result<PrefixMatch> CacheManager::Impl::AcquireCachedPrefix(SequenceId seq, uint32_t max_blocks,
                                                            bool resume) {
  MutexLock l(mu_);
  ChangeCheck check(*this, seq);
  SequenceEntry* s = FindLocked(seq);
  if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
  if (s->num_blocks != 0 || s->computed != 0 || s->looked_up) {
    return Status::FailedPrecondition(fmt::format(
        "sequence {}: a cached prefix can only be acquired once, before any slot is allocated "
        "(it has {} blocks, {} computed tokens)",
        seq, s->num_blocks, s->computed));
  }
  s->looked_up = true;
  SequenceTokens& t = *s->tokens;
  MutexLock tl(t.mu);
  if (!t.hashing || t.num_tokens == 0) return PrefixMatch{};
  const PrefixMatch m = FindResumableLocked(
      t.digests,
      std::min<size_t>(max_blocks, MaxLookupBlocks(t.num_tokens, t.digests.size(), !resume)),
      &chain_scratch_);
  RecordLookupLocked(m.tokens, t.num_tokens);
  const uint32_t k = m.blocks;
  if (k == 0) return m;
  s->records.assign(chain_scratch_.begin(), chain_scratch_.begin() + k);
  for (size_t q = 0; q < P(); ++q) {
    s->tables[q].assign(k, kInvalidPage);
    const uint32_t first = FirstNeededBlock(q, k);
    for (uint32_t b = first; b < k; ++b) {
      const PageId page = RecPage(s->records[b], q);
      Status st = pools_[q]->Revive(page);
      if (!st.ok()) {
        Internal(st);
        continue;
      }
      s->tables[q][b] = page;
    }
    s->released_upto[q] = first;
  }
  s->num_blocks = k;
  s->computed = s->slot_tokens = m.tokens;
  s->registered_upto = k;
  return m;
}

Result<SlotAllocation> CacheManager::Impl::AllocateSlots(SequenceId seq, uint64_t num_tokens,
                                                        const BoundarySkip* skip) {
  SlotAllocation out;
  bool events = false;
  std::shared_ptr<const std::function<void()>> low;
  for (;;) {
    MutexLock l(mu_);
    ChangeCheck check(*this, seq);
    SequenceEntry* s = FindLocked(seq);
    if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
    ExpireHintsLocked();
    const uint64_t want64 = (num_tokens + block_tokens_ - 1) / block_tokens_;
    if (want64 >= UINT32_MAX) {
      return Status::InvalidArgument(
          fmt::format("sequence {}: {} tokens is too many", seq, num_tokens));
    }
    const uint32_t want = static_cast<uint32_t>(want64);
    const uint32_t old_blocks = s->num_blocks;
    const uint32_t new_blocks = want > old_blocks ? want - old_blocks : 0;

    // Blocks the new tokens will be written into that are shared with a fork get their own copy
    // first. Committed full blocks are never written again, so only blocks from the one holding
    // the first uncomputed token on can need it.
    std::vector<std::pair<uint32_t, uint32_t>> cow;  // (pool, block)
    const uint32_t write_end = std::min(old_blocks, want);
    for (uint32_t b = static_cast<uint32_t>(s->computed / block_tokens_); b < write_end; ++b) {
      if (s->records[b] != kNoRecord) continue;
      for (size_t q = 0; q < P(); ++q) {
        const PageId page = s->tables[q][b];
        if (page != kInvalidPage && pools_[q]->RefCount(page) > 1)
          cow.emplace_back(static_cast<uint32_t>(q), b);
      }
    }
    if (new_blocks == 0 && cow.empty()) {
      s->slot_tokens = std::max(s->slot_tokens, num_tokens);
      out.first_new_block = old_blocks;
      return out;
    }
    // A restore's blocks below `skip`'s edges get no page of the boundary pools.
    std::vector<uint32_t> skipped(P(), 0);
    if (skip != nullptr) {
      for (size_t q = 0; q < P(); ++q) {
        if (roles_[q] == PoolRole::kFullHistory) continue;
        const uint32_t from = roles_[q] == PoolRole::kWindow ? skip->window_from_block : skip->state_from_block;
        skipped[q] = std::min(new_blocks, from > old_blocks ? from - old_blocks : 0);
      }
    }
    std::vector<uint32_t> need(P(), new_blocks);
    for (size_t q = 0; q < P(); ++q) need[q] -= skipped[q];
    for (const auto& c : cow) ++need[c.first];
    Status st = EnsureAvailableLocked(need);
    if (!st.ok() && WaitForHeldLocked(need)) continue;  // pages came back: start over
    if (!st.ok()) {
      ++stats_.failed_allocations;
      return st.WithContext(fmt::format("sequence {}: allocating {} new blocks", seq, new_blocks));
    }
    for (size_t i = 0; i < P(); ++i) {
      const uint32_t q = alloc_order_[i];
      alloc_scratch_[q].resize(need[q]);
      st = pools_[q]->AllocateBatch(alloc_scratch_[q]);
      ProcessEvictionsLocked();
      if (!st.ok()) {
        // EnsureAvailableLocked said there was room: a bug. Hand back what was taken.
        for (size_t j = 0; j < i; ++j) {
          pools_[alloc_order_[j]]
              ->ReleaseBatch(alloc_scratch_[alloc_order_[j]], false)
              .IgnoreError();
        }
        Internal(st);
        FlushRemovedLocked();
        return Status::Internal(
            st.WithContext("allocation after a successful availability check").ToString());
      }
    }
    std::vector<size_t> used(P(), 0);
    for (const auto& [q, b] : cow) {
      PageId& page = s->tables[q][b];
      const PageId fresh = alloc_scratch_[q][used[q]++];
      out.copies.push_back({q, page, fresh, CopyReason::kCopyOnWrite});
      Status rs = pools_[q]->Release(page);  // ours was one of several references
      if (!rs.ok()) Internal(rs);
      page = fresh;
    }
    for (size_t q = 0; q < P(); ++q) {
      for (uint32_t i = 0; i < new_blocks; ++i)
        s->tables[q].push_back(i < skipped[q] ? kInvalidPage : alloc_scratch_[q][used[q]++]);
    }
    // Fewer tokens than the sequence holds slots for (lookahead taken before a fork) copies the
    // shared blocks it writes but keeps every block: the tables keep their length, and so must
    // the records and the count, or the blocks past `want` are held by nobody's bookkeeping.
    const uint32_t blocks = std::max(old_blocks, want);
    s->records.resize(blocks, kNoRecord);
    if (new_blocks > 0 && old_blocks > 0) {
      for (uint32_t q : state_pools_) {
        const PageId src = s->tables[q][old_blocks - 1];
        if (src != kInvalidPage && s->tables[q][old_blocks] != kInvalidPage)
          out.copies.push_back({q, src, s->tables[q][old_blocks], CopyReason::kCarryState});
      }
    }
    s->num_blocks = blocks;
    s->slot_tokens = std::max(s->slot_tokens, num_tokens);
    out.first_new_block = old_blocks;
    out.new_blocks = new_blocks;
    FlushRemovedLocked();
    events = !pending_events_.empty();
    low = LowNotifyLocked();
    break;
  }
  if (events) DeliverEvents();
  if (low) (*low)();
  return out;
}

Status CacheManager::Impl::TrimSlots(SequenceId seq) {
  bool events = false;
  {
    MutexLock l(mu_);
    ChangeCheck check(*this, seq);
    SequenceEntry* s = FindLocked(seq);
    if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
    const auto keep = static_cast<uint32_t>(
        std::min<uint64_t>((s->computed + block_tokens_ - 1) / block_tokens_, s->num_blocks));
    // Past the computed tokens nothing is registered, so each page is the sequence's alone (or
    // shared with a fork, which keeps its reference): released, not cached. Tail first.
    for (uint32_t b = s->num_blocks; b-- > keep;) {
      for (size_t q = 0; q < P(); ++q) ReleaseSeqPageLocked(*s, q, b);
    }
    for (size_t q = 0; q < P(); ++q) {
      s->tables[q].resize(keep);
      s->released_upto[q] = std::min(s->released_upto[q], keep);
    }
    s->records.resize(keep, kNoRecord);
    s->num_blocks = keep;
    s->slot_tokens = s->computed;
    s->registered_upto = std::min(s->registered_upto, keep);
    FlushRemovedLocked();
    events = !pending_events_.empty();
  }
  if (events) DeliverEvents();
  return Status::OK();
}

Status CacheManager::Impl::CommitComputed(SequenceId seq, uint64_t num_tokens) {
  bool events = false;
  {
    MutexLock l(mu_);
    ChangeCheck check(*this, seq);
    SequenceEntry* s = FindLocked(seq);
    if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
    SequenceTokens& t = *s->tokens;
    MutexLock tl(t.mu);
    if (num_tokens < s->computed) {
      return Status::InvalidArgument(fmt::format(
          "sequence {}: commit of {} tokens but {} are already computed; commits only move forward",
          seq, num_tokens, s->computed));
    }
    if (num_tokens > s->slot_tokens || num_tokens > t.num_tokens) {
      return Status::FailedPrecondition(fmt::format(
          "sequence {}: commit of {} tokens but only {} have slots and {} were appended", seq,
          num_tokens, s->slot_tokens, t.num_tokens));
    }
    // The new tokens' KV went into these blocks. A page still shared with a fork (slots taken
    // before the fork, no AllocateSlots since) now holds this sequence's KV where the fork expects
    // its own, and registering it would give the cache a page the fork frees at its end.
    if (num_tokens > s->computed) {
      const uint32_t first = static_cast<uint32_t>(s->computed / block_tokens_);
      const uint32_t end = static_cast<uint32_t>(
          std::min<uint64_t>((num_tokens + block_tokens_ - 1) / block_tokens_, s->num_blocks));
      for (uint32_t b = first; b < end; ++b) {
        for (size_t q = 0; q < P(); ++q) {
          const PageId page = s->tables[q][b];
          if (page == kInvalidPage || pools_[q]->RefCount(page) <= 1) continue;
          return Status::FailedPrecondition(fmt::format(
              "sequence {}: commit of tokens {}..{}, but block {} is still shared with a fork "
              "(page {} of pool {}); call AllocateSlots for these tokens before writing them and "
              "make the copies it lists (nothing was committed)",
              seq, s->computed, num_tokens - 1, b, page, q));
        }
      }
    }
    s->computed = num_tokens;

    // Register the newly computed full blocks, as one stored event per run of new records.
    if (t.hashing) {
      const uint32_t end =
          static_cast<uint32_t>(std::min<uint64_t>(num_tokens / block_tokens_, t.digests.size()));
      const bool emit = !listeners_->empty();
      std::vector<BlockHash>& run = run_hashes_;
      run.clear();
      // The run's tokens (when kept) go straight to the end of the event queue's tokens, from
      // `run_token_begin` (nothing else is queued while a run is open).
      size_t run_token_begin = 0;
      const size_t* keep = t.keep_tokens ? &run_token_begin : nullptr;
      BlockHash run_parent;
      KindSet run_kinds;
      for (uint32_t b = s->registered_upto; b < end; ++b) {
        if (s->records[b] != kNoRecord) {
          FlushStoredLocked(&run, run_parent, run_kinds, keep);
          continue;
        }
        const BlockDigest& d = t.digests[b];
        const RecordId existing = index_.Find(d.hash);
        if (existing != kNoRecord && record_digest_[existing].check == d.check) {
          // An equal block is cached already (computed twice, or recomputed because the hit had
          // to stop before it): this copy stays private and is freed with the sequence, except
          // window and snapshot pages the cached block has lost, which it takes over, so the
          // boundary after it becomes resumable again.
          ++stats_.duplicate_blocks;
          FlushStoredLocked(&run, run_parent, run_kinds, keep);
          const KindSet repaired = RepairBoundaryLocked(existing, *s, b);
          if (!repaired.empty() && emit) {
            std::span<const TokenId> block_tokens;
            if (t.keep_tokens && t.kept.size() >= uint64_t{b + 1} * block_tokens_) {
              block_tokens = std::span<const TokenId>(t.kept.data() + uint64_t{b} * block_tokens_, block_tokens_);
            }
            QueueEventLocked(KvEventType::kBlocksStored, repaired, std::span<const BlockHash>(&d.hash, 1),
                             b == 0 ? t.root.hash : t.digests[b - 1].hash, block_tokens);
          }
          continue;
        }
        if (existing != kNoRecord || free_records_.empty()) {
          if (existing == kNoRecord) {
            Internal(Status::Internal("no free block record"));
          } else {
            ++hash_collisions_;  // same key, other content: never served, never overwritten
          }
          FlushStoredLocked(&run, run_parent, run_kinds, keep);
          continue;
        }
        const RecordId r = free_records_.back();
        free_records_.pop_back();
        record_digest_[r] = d;
        KindSet kinds;
        for (size_t q = 0; q < P(); ++q) {
          const PageId page = s->tables[q][b];
          RecPage(r, q) = page;
          if (page != kInvalidPage) {
            owners_[q][page] = r;
            kinds.Add(kinds_[q]);
          }
        }
        index_.Insert(d.hash, r);
        s->records[b] = r;
        if (hinted_hashes_.size() != 0 && hinted_hashes_.Find(d.hash) != kNoRecord) ProtectHintedLocked(r);
        ++stats_.stored_blocks;
        if (emit) {
          if (!run.empty() && run_kinds != kinds) FlushStoredLocked(&run, run_parent, run_kinds, keep);
          if (run.empty()) {
            run_parent = b == 0 ? t.root.hash : t.digests[b - 1].hash;
            run_kinds = kinds;
            run_token_begin = pending_events_.tokens.size();
          }
          run.push_back(d.hash);
          if (keep != nullptr && t.kept.size() >= uint64_t{b + 1} * block_tokens_) {
            pending_events_.tokens.insert(pending_events_.tokens.end(), t.kept.begin() + uint64_t{b} * block_tokens_,
                                          t.kept.begin() + uint64_t{b + 1} * block_tokens_);
          }
        }
      }
      FlushStoredLocked(&run, run_parent, run_kinds, keep);
      s->registered_upto = std::max(s->registered_upto, end);
    }

    // Window and snapshot pages the next token no longer needs: to the cache when a registered
    // block owns them (a later request may resume there), free otherwise. Tail first.
    for (size_t q = 0; q < P(); ++q) {
      if (roles_[q] == PoolRole::kFullHistory) continue;
      uint32_t first_needed;
      if (roles_[q] == PoolRole::kWindow) {
        first_needed = num_tokens > window_tokens_
                           ? static_cast<uint32_t>((num_tokens - window_tokens_) / block_tokens_)
                           : 0;
      } else {
        first_needed =
            num_tokens == 0 ? 0 : static_cast<uint32_t>((num_tokens - 1) / block_tokens_);
      }
      first_needed = std::min(first_needed, s->num_blocks);
      for (uint32_t b = first_needed; b-- > s->released_upto[q];) {
        if (s->tables[q][b] == kInvalidPage) continue;
        ReleaseSeqPageLocked(*s, q, b);
        ++stats_.early_released_pages;
      }
      s->released_upto[q] = std::max(s->released_upto[q], first_needed);
    }
    events = !pending_events_.empty();
  }
  if (events) DeliverEvents();
  return Status::OK();
}

Result<SequenceId> CacheManager::Impl::Fork(SequenceId seq) {
  MutexLock l(mu_);
  ChangeCheck check(*this, seq);
  const SequenceEntry* parent = FindLocked(seq);
  if (parent == nullptr) return Status::NotFound(SeqNotFound(seq));
  SequenceEntry child = *parent;
  {
    const SequenceTokens& pt = *parent->tokens;
    auto t = std::make_shared<SequenceTokens>();
    t->root = pt.root;
    t->extra_keys = pt.extra_keys;
    t->hashing = pt.hashing;
    MutexLock ptl(parent->tokens->mu);
    MutexLock tl(t->mu);
    t->num_tokens = parent->tokens->num_tokens;
    t->tail = parent->tokens->tail;
    t->digests = parent->tokens->digests;
    child.tokens = std::move(t);
  }
  for (size_t q = 0; q < P(); ++q) {
    for (uint32_t b = 0; b < child.num_blocks; ++b) {
      const PageId page = child.tables[q][b];
      if (page == kInvalidPage) continue;
      Status st = pools_[q]->Retain(page);
      if (!st.ok()) {
        Internal(st);
        child.tables[q][b] = kInvalidPage;
      }
    }
  }
  const SequenceId id = next_seq_++;
  check.Also(id);
  seqs_.emplace(id, std::move(child));
  ++stats_.sequences;
  return id;
}

Status CacheManager::Impl::Free(SequenceId seq) {
  MutexLock l(mu_);
  ChangeCheck check(*this, 0);
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Status::NotFound(SeqNotFound(seq));
  SequenceEntry& s = it->second;
  for (uint32_t b = s.num_blocks; b-- > 0;) {
    for (size_t q = 0; q < P(); ++q) ReleaseSeqPageLocked(s, q, b);
  }
  {
    MutexLock tl(s.tokens->mu);
    s.tokens->freed = true;
  }
  seqs_.erase(it);
  --stats_.sequences;
  return Status::OK();
}

Status CacheManager::Impl::GetBlockTable(SequenceId seq, size_t pool,
                                         std::vector<PageId>* out) const {
  if (pool >= P()) {
    return Status::OutOfRange(
        fmt::format("pool {} does not exist; the model has {} pools", pool, P()));
  }
  MutexLock l(mu_);
  const SequenceEntry* s = FindLocked(seq);
  if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
  *out = s->tables[pool];
  return Status::OK();
}

Result<SequenceInfo> CacheManager::Impl::GetSequenceInfo(SequenceId seq) const {
  MutexLock l(mu_);
  const SequenceEntry* s = FindLocked(seq);
  if (s == nullptr) return Status::NotFound(SeqNotFound(seq));
  SequenceInfo info;
  {
    MutexLock tl(s->tokens->mu);
    info.tokens = s->tokens->num_tokens;
  }
  info.computed_tokens = s->computed;
  info.slot_tokens = s->slot_tokens;
  info.blocks = s->num_blocks;
  for (RecordId r : s->records) info.cached_blocks += r != kNoRecord;
  return info;
}

// ---------------------------------------------------------------------------------------------
// Prefix cache

PrefixMatch CacheManager::Impl::LookupDigests(std::span<const BlockDigest> digests,
                                              uint64_t prompt_tokens) const {
  if (!Caching()) return {};
  const size_t max_blocks = MaxLookupBlocks(prompt_tokens, digests.size(), prompt_tokens != 0);
  std::vector<RecordId> chain;
  MutexLock l(mu_);
  return FindResumableLocked(digests, max_blocks, &chain);
}

Result<PrefixMatch> CacheManager::Impl::LookupPrefix(const PrefixQuery& query) const {
  if (!Caching()) return PrefixMatch{};
  std::vector<BlockDigest> digests;
  hasher_.HashFullBlocks(hasher_.Root(query.namespace_salt), query.tokens, query.extra_keys,
                         &digests);
  return LookupDigests(digests, query.leave_last_token ? query.tokens.size() : 0);
}

Result<PinInfo> CacheManager::Impl::PinPrefix(const PrefixQuery& query, uint32_t priority) {
  if (!Caching())
    return Status::FailedPrecondition("prefix caching is disabled: nothing can be pinned");
  std::vector<BlockDigest> digests;
  hasher_.HashFullBlocks(hasher_.Root(query.namespace_salt), query.tokens, query.extra_keys,
                         &digests);
  MutexLock l(mu_);
  ChangeCheck check(*this, 0);
  const PrefixMatch m = FindResumableLocked(digests, digests.size(), &chain_scratch_);
  if (m.blocks == 0) {
    return Status::NotFound(
        fmt::format("no resumable prefix of these {} tokens is cached ({} blocks found in the "
                    "index); run the prompt "
                    "and commit it first",
                    query.tokens.size(), m.chain_blocks));
  }
  Pin pin;
  pin.priority = priority;
  for (uint32_t b = m.blocks; b-- > 0;) {
    for (size_t q = 0; q < P(); ++q) {
      if (b < FirstNeededBlock(q, m.blocks)) continue;
      const PageId page = RecPage(chain_scratch_[b], q);
      Status st = pools_[q]->Revive(page);
      if (!st.ok()) {
        Internal(st);
        continue;
      }
      pin.pages.emplace_back(static_cast<uint32_t>(q), page);
    }
  }
  const PinId id = next_pin_++;
  pins_.emplace(id, std::move(pin));
  return PinInfo{id, m.blocks};
}

Status CacheManager::Impl::Unpin(PinId pin) {
  MutexLock l(mu_);
  ChangeCheck check(*this, 0);
  auto it = pins_.find(pin);
  if (it == pins_.end()) {
    return Status::NotFound(
        fmt::format("pin {} does not exist (never made, unpinned, or given up under memory "
                    "pressure; see pins_released)",
                    pin));
  }
  ReleasePinLocked(it->second);
  pins_.erase(it);
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Hints

void CacheManager::Impl::ProtectHintedLocked(RecordId r) {
  if (record_protected_[r]) return;
  if (hinted_records_ >= max_hinted_records_) {
    ++stats_.hint_blocks_cut;
    return;
  }
  record_protected_[r] = 1;
  ++hinted_records_;
  ProtectRecordLocked(r, true);
}

void CacheManager::Impl::EndHintLocked(Hint& hint) {
  for (const BlockHash& h : hint.hashes) {
    RecordId* count = hinted_hashes_.FindMutable(h);
    if (count == nullptr || --*count > 0) continue;
    hinted_hashes_.Erase(h);
    const RecordId r = index_.Find(h);
    if (r != kNoRecord && record_protected_[r]) {
      record_protected_[r] = 0;
      --hinted_records_;
      ProtectRecordLocked(r, false);
    }
  }
  hint.hashes.clear();
}

void CacheManager::Impl::ExpireHintsLocked() {
  if (hint_deadlines_.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  while (!hint_deadlines_.empty() && hint_deadlines_.top().first <= now) {
    const HintId id = hint_deadlines_.top().second;
    hint_deadlines_.pop();
    auto it = hints_.find(id);
    if (it == hints_.end()) continue;  // dropped already
    EndHintLocked(it->second);
    hints_.erase(it);
    ++stats_.hints_expired;
  }
  if (hints_.empty()) hint_deadlines_ = {};
}

Result<HintInfo> CacheManager::Impl::HintDigests(std::span<const BlockDigest> digests, const HintOptions& options) {
  if (!Caching()) return Status::FailedPrecondition("prefix caching is disabled: nothing can be hinted");
  if (options.ttl.count() <= 0) {
    return Status::InvalidArgument(fmt::format("hint time to live of {} ms; expected a positive one", options.ttl.count()));
  }
  MutexLock l(mu_);
  ChangeCheck check(*this, 0);
  ExpireHintsLocked();
  if (hints_.size() >= options_.max_hints) {
    return Status::ResourceExhausted(fmt::format(
        "{} hints are live, the most max_hints allows; drop some or let them expire", hints_.size()));
  }
  HintInfo info;
  Hint hint;
  hint.hashes.reserve(digests.size());
  bool chain = true;  // the blocks found so far are consecutive from the start
  for (const BlockDigest& d : digests) {
    if (RecordId* count = hinted_hashes_.FindMutable(d.hash)) {
      ++*count;
      hint.hashes.push_back(d.hash);
    } else if (hinted_hashes_.size() < hinted_hashes_.max_entries()) {
      hinted_hashes_.Insert(d.hash, 1);
      hint.hashes.push_back(d.hash);
    } else {
      ++stats_.hint_blocks_cut;  // no room to name it
      continue;
    }
    const RecordId r = index_.Find(d.hash);
    const bool cached = r != kNoRecord && record_digest_[r].check == d.check;
    chain = chain && cached;
    if (!chain) continue;
    ++info.found_blocks;
    ProtectHintedLocked(r);
    info.protected_blocks += record_protected_[r];
  }
  const auto ttl = std::min<std::chrono::milliseconds>(options.ttl, std::chrono::hours(24 * 365));
  hint.deadline = std::chrono::steady_clock::now() + ttl;
  info.id = next_hint_++;
  hint_deadlines_.emplace(hint.deadline, info.id);
  hints_.emplace(info.id, std::move(hint));
  ++stats_.hints_given;
  return info;
}

Status CacheManager::Impl::DropHint(HintId id) {
  MutexLock l(mu_);
  ChangeCheck check(*this, 0);
  ExpireHintsLocked();
  auto it = hints_.find(id);
  if (it == hints_.end()) {
    return Status::NotFound(fmt::format("hint {} does not exist (never made, dropped, or expired)", id));
  }
  EndHintLocked(it->second);
  hints_.erase(it);
  if (hints_.empty()) hint_deadlines_ = {};
  return Status::OK();
}

Status CacheManager::Impl::Reset() {
  {
    MutexLock l(mu_);
    ChangeCheck check(*this, 0);
    uint64_t holding = 0;
    for (const auto& [id, s] : seqs_) {
      for (const auto& table : s.tables) {
        if (std::any_of(table.begin(), table.end(), [](PageId p) { return p != kInvalidPage; })) {
          ++holding;
          break;
        }
      }
    }
    if (holding > 0) {
      return Status::FailedPrecondition(fmt::format(
          "reset refused: {} sequences hold pages; free them first (nothing was cleared)",
          holding));
    }
    for (const auto& [id, pin] : pins_) ReleasePinLocked(pin);
    pins_.clear();
    for (size_t q = 0; q < P(); ++q) {
      pools_[q]->DropAllCached();
      std::fill(owners_[q].begin(), owners_[q].end(), kNoRecord);
    }
    index_.Clear();
    std::fill(record_pages_.begin(), record_pages_.end(), kInvalidPage);
    std::fill(record_protected_.begin(), record_protected_.end(), 0);
    hinted_hashes_.Clear();
    hints_.clear();
    hint_deadlines_ = {};
    hinted_records_ = 0;
    stats_.hints = 0;
    free_records_.clear();
    for (uint64_t r = max_records_; r-- > 0;) free_records_.push_back(static_cast<RecordId>(r));
    removed_groups_.clear();
    removed_hashes_.clear();
    if (!listeners_->empty()) QueueEventLocked(KvEventType::kAllCleared, KindSet{}, {}, BlockHash{});
  }
  DeliverEvents();
  return Status::OK();
}

CacheStats CacheManager::Impl::Stats() const {
  MutexLock l(mu_);
  CacheStats s = stats_;
  s.hash_collisions = hash_collisions_;
  s.recent_token_hit_ratio =
      recent_prompt_ ? static_cast<double>(recent_hit_) / static_cast<double>(recent_prompt_) : 0;
  s.cached_blocks = index_.size();
  s.pins = pins_.size();
  s.hints = hints_.size();
  s.hinted_blocks = hinted_records_;
  return s;
}

// ---------------------------------------------------------------------------------------------
// CacheManager: forwards to Impl.

Result<std::unique_ptr<CacheManager>> CacheManager::Create(const ModelSpec& spec,
                                                           const CacheManagerOptions& options) {
  if (options.capacity_blocks == 0) {
    return Status::InvalidArgument(
        "cache manager: capacity_blocks is 0; expected at least 1 block");
  }
  if (!(options.hint_bound >= 0 && options.hint_bound <= 1)) {
    return Status::InvalidArgument(
        fmt::format("cache manager: hint_bound is {}; expected a share of the cache in [0, 1]", options.hint_bound));
  }
  if (options.eviction != EvictionPolicyKind::kLru && options.eviction != EvictionPolicyKind::kArc) {
    return Status::InvalidArgument(fmt::format("cache manager: eviction policy {} does not exist",
                                               static_cast<int>(options.eviction)));
  }
  if (options.backing == ArenaBacking::kFile) {
    return Status::InvalidArgument(
        "cache manager: kFile backing is not supported (one file per pool is not modelled); use "
        "kAnonymous or "
        "kMemfd");
  }
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geometry,
                            ComputeBlockGeometry(spec, options.block_tokens));
  auto impl = std::make_unique<Impl>(spec, options, std::move(geometry));
  SPARSEKV_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CacheManager>(new CacheManager(std::move(impl)));
}

CacheManager::CacheManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CacheManager::~CacheManager() = default;

const BlockGeometry& CacheManager::geometry() const {
  return impl_->geometry_;
}
const CacheManagerOptions& CacheManager::options() const {
  return impl_->options_;
}
const BlockHasher& CacheManager::hasher() const {
  return impl_->hasher_;
}
uint32_t CacheManager::window_tokens() const { return impl_->window_tokens(); }
const std::string& CacheManager::model_name() const { return impl_->model_name(); }
size_t CacheManager::num_pools() const {
  return impl_->pools_.size();
}
const PagePool& CacheManager::pool(size_t i) const {
  return *impl_->pools_[i];
}

Result<SequenceId> CacheManager::CreateSequence(const SequenceOptions& options) {
  return impl_->CreateSequence(options);
}
Status CacheManager::AppendTokens(SequenceId seq, std::span<const TokenId> tokens) {
  return impl_->AppendTokens(seq, tokens);
}
Result<PrefixMatch> CacheManager::AcquireCachedPrefix(SequenceId seq) {
  return impl_->AcquireCachedPrefix(seq, UINT32_MAX, /*resume=*/false);
}

Result<HeldBlock> CacheManager::HoldCachedBlock(const BlockDigest& digest) {
  return impl_->HoldCachedBlock(digest);
}

Result<PrefixMatch> CacheManager::AcquireResumePrefix(SequenceId seq, uint32_t max_blocks) {
  return impl_->AcquireCachedPrefix(seq, max_blocks, /*resume=*/true);
}
Result<SlotAllocation> CacheManager::AllocateSlots(SequenceId seq, uint64_t num_tokens) {
  return impl_->AllocateSlots(seq, num_tokens);
}
Result<SlotAllocation> CacheManager::AllocateRestoreSlots(SequenceId seq, uint64_t num_tokens,
                                                         const BoundarySkip& skip) {
  return impl_->AllocateSlots(seq, num_tokens, &skip);
}
Status CacheManager::TrimSlots(SequenceId seq) { return impl_->TrimSlots(seq); }
Status CacheManager::CommitComputed(SequenceId seq, uint64_t num_tokens) {
  return impl_->CommitComputed(seq, num_tokens);
}
Result<SequenceId> CacheManager::Fork(SequenceId seq) {
  return impl_->Fork(seq);
}
Status CacheManager::Free(SequenceId seq) {
  return impl_->Free(seq);
}
Status CacheManager::GetBlockTable(SequenceId seq, size_t pool, std::vector<PageId>* out) const {
  return impl_->GetBlockTable(seq, pool, out);
}
Result<SequenceInfo> CacheManager::GetSequenceInfo(SequenceId seq) const {
  return impl_->GetSequenceInfo(seq);
}
Result<PrefixMatch> CacheManager::LookupPrefix(const PrefixQuery& query) const {
  return impl_->LookupPrefix(query);
}
PrefixMatch CacheManager::LookupDigests(std::span<const BlockDigest> digests,
                                        uint64_t prompt_tokens) const {
  return impl_->LookupDigests(digests, prompt_tokens);
}
Result<PinInfo> CacheManager::PinPrefix(const PrefixQuery& query, uint32_t priority) {
  return impl_->PinPrefix(query, priority);
}
Status CacheManager::Unpin(PinId pin) {
  return impl_->Unpin(pin);
}
Result<HintInfo> CacheManager::HintPrefix(const PrefixQuery& query, const HintOptions& options) {
  std::vector<BlockDigest> digests;
  impl_->hasher_.HashFullBlocks(impl_->hasher_.Root(query.namespace_salt), query.tokens, query.extra_keys, &digests);
  return impl_->HintDigests(digests, options);
}

Result<HintInfo> CacheManager::HintDigests(std::span<const BlockDigest> digests, const HintOptions& options) {
  return impl_->HintDigests(digests, options);
}

Status CacheManager::DropHint(HintId hint) { return impl_->DropHint(hint); }

Status CacheManager::Reset() {
  return impl_->Reset();
}
void CacheManager::SetBlockEvictHook(BlockEvictHook hook) {
  impl_->SetBlockEvictHook(std::move(hook));
}
void CacheManager::SetLowFreePagesNotify(uint32_t low_free_pages, std::function<void()> notify) {
  impl_->SetLowFreePagesNotify(low_free_pages, std::move(notify));
}
void CacheManager::ReleaseHeldBlock(const HeldBlock& block) { impl_->ReleaseHeldBlock(block); }
uint32_t CacheManager::EvictAhead(uint32_t free_target, uint32_t max_blocks, const HeldBlockTaker& take) {
  return impl_->EvictAhead(free_target, max_blocks, take);
}
SubscriptionId CacheManager::Subscribe(KvEventListener listener) {
  return impl_->Subscribe(std::move(listener));
}
SubscriptionId CacheManager::SubscribeBatch(KvEventBatchListener listener) {
  return impl_->SubscribeBatch(std::move(listener));
}
void CacheManager::Unsubscribe(SubscriptionId id) {
  impl_->Unsubscribe(id);
}
CacheStats CacheManager::Stats() const {
  return impl_->Stats();
}
Status CacheManager::CheckInvariants() const {
  return impl_->CheckInvariants();
}

}  // namespace sparsekv
