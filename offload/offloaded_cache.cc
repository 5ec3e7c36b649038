#include "sparsekv/offloaded_cache.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <future>
#include <limits>
#include <optional>
#include <unordered_set>
#include <utility>

#include <xxhash.h>

#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/storage_format.h"
#include "worker_pool.h"

namespace sparsekv {

// What the wrapper knows of a sequence: enough to name its blocks' bundles.
struct OffloadedCache::SequenceState {
  std::string namespace_salt;
  std::string extra_keys;
  bool cache_blocks = true;
  BlockDigest root;
  std::vector<TokenId> tail;         // tokens after the last full block
  std::vector<BlockDigest> digests;  // one per full block
  uint64_t tokens = 0;
  std::vector<TokenId> all;  // every token: a suspension's tail names those since its block
};

// Write-back: a block the eviction hook copied out, not yet a bundle: every pool's page back to
// back, then the digest check (the bundle's segments, in order). The hook only copies; the
// bundle (its allocation, header and checksum, several times the cost of the copy) is made on
// the demote thread, off the manager's lock. Immutable once queued.
//
// Staging buffers are reused: a fresh one costs a page fault every 4 KiB, several times the copy
// itself, under the manager's lock. A Staged gives its buffer back when its last holder lets go
// (the shared_ptr's release orders every read of it before the next write).
struct OffloadedCache::SparePool {
  Mutex mu;  // a leaf: nothing else is locked while it is held
  std::vector<RecordBuffer> buffers SPARSEKV_GUARDED_BY(mu);
  size_t max_buffers = 0;
};

struct OffloadedCache::Staged {
  BlockDigest digest;
  // A history record (its full-history pools' pages only, filed under HistoryKey): the block's
  // window or state pages had left L1 before it.
  bool history = false;
  BundleKey key;          // what it is filed under
  uint64_t reserved = 0;  // its record bytes, counted in pending_demote_bytes
  // A block is megabytes: RecordBuffer maps those with huge pages, so that a fresh buffer costs
  // the hook (under the manager's lock) a few 2 MiB faults rather than one per 4 KiB.
  RecordBuffer bytes;
  std::shared_ptr<SparePool> spare;

  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (!bytes || !spare) return;
    MutexLock lock(spare->mu);
    if (spare->buffers.size() < spare->max_buffers) spare->buffers.push_back(std::move(bytes));
  }  // a buffer that did not fit is freed after the lock is released
};

namespace {

// A block with a page in every pool: one that can be demoted as a bundle.
bool HasEveryPage(std::span<const PageId> pages) {
  return std::none_of(pages.begin(), pages.end(), [](PageId p) { return p == kInvalidPage; });
}

}  // namespace

// Write-back: a block evicted ahead of need whose pages are still held (CacheManager::
// EvictAhead), until it is stored and no lookup reads them; the last holder gives them back.
struct OffloadedCache::Held {
  CacheManager* manager = nullptr;
  HeldBlock block;

  bool history = false;   // demoted as a history record (its window or state pages were gone)
  bool demoted = false;   // whole or as history: counted in pending_demote_bytes
  uint64_t reserved = 0;  // its record bytes there
  BundleKey key;

  Held(CacheManager* m, HeldBlock b) : manager(m), block(std::move(b)) {}
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() { manager->ReleaseHeldBlock(block); }
  bool complete() const {
    return HasEveryPage(block.pages);
  }
};

struct OffloadedCache::Shared {
  Mutex mu;
  std::condition_variable_any idle;
  // Blocks gathered for the chain whose demote has not finished.
  uint64_t in_flight SPARSEKV_GUARDED_BY(mu) = 0;
  // Write-back: blocks the hook copied out, waiting for the demote thread.
  std::vector<std::shared_ptr<Staged>> queue SPARSEKV_GUARDED_BY(mu);
  bool drain_scheduled SPARSEKV_GUARDED_BY(mu) = false;
  // Write-back: every block copied out until the chain has answered for it, so that a lookup
  // finds it between its eviction from L1 and its arrival in the chain: first as the staged
  // copy, then as the bundle made of it.
  struct Pending {
    std::shared_ptr<Staged> staged;
    BundlePtr bundle;
    std::shared_ptr<Held> held;  // evicted ahead: its pages, until the bundle is made
  };
  bool evict_ahead_due SPARSEKV_GUARDED_BY(mu) = false;    // an EvictAhead run is queued or running
  bool evict_ahead_again SPARSEKV_GUARDED_BY(mu) = false;  // ... and was asked for meanwhile
  std::unordered_map<BundleKey, Pending, BundleKeyHasher> pending SPARSEKV_GUARDED_BY(mu);
  OffloadedCacheStats stats SPARSEKV_GUARDED_BY(mu);  // pending_demote_bytes: see the header
  // Pages tags of other pages already reported in the log, and whether an untagged record was.
  std::unordered_set<uint32_t> reported_tags SPARSEKV_GUARDED_BY(mu);
  bool reported_untagged SPARSEKV_GUARDED_BY(mu) = false;
};

OffloadedCache::OffloadedCache(CacheManager& manager, TierChain& chain,
                               OffloadedCacheOptions options)
    : manager_(manager), chain_(chain), options_(options), shared_(std::make_shared<Shared>()) {
  std::vector<uint64_t> sizes;
  for (const PoolGeometry& g : manager_.geometry().pools) sizes.push_back(g.block_stride);
  sizes.push_back(sizeof(BlockHash));
  block_record_bytes_ = BundleRecordBytes(sizes);
  {
    const BlockGeometry& geo = manager_.geometry();
    window_blocks_ = (manager_.window_tokens() + geo.block_tokens - 1) / geo.block_tokens;
    // The largest tail: a partial block (every pool's page) and the window pages before it.
    std::vector<uint64_t> tail = {64, uint64_t{geo.block_tokens} * sizeof(TokenId)};
    tail.insert(tail.end(), sizes.begin(), sizes.end() - 1);
    for (const PoolGeometry& g : geo.pools) {
      if (IsFullHistoryKind(g.spec.kind)) continue;
      has_boundary_pools_ = true;
      if (g.spec.kind == CacheKind::kSwaWindow) tail.insert(tail.end(), window_blocks_, g.block_stride);
    }
    max_tail_record_bytes_ = BundleRecordBytes(tail);
  }
  {
    std::vector<uint64_t> history = sizes;
    for (size_t p = 0; p < manager_.geometry().pools.size(); ++p) {
      if (!IsFullHistoryKind(manager_.geometry().pools[p].spec.kind)) history[p] = 0;
    }
    history_record_bytes_ = BundleRecordBytes(history);
  }
  geometry_fingerprint_ = XXH3_64bits(sizes.data(), sizes.size() * sizeof(uint64_t)) ^
                          manager_.geometry().block_tokens;
  pages_description_ = PagesDescription(manager_.model_name(), manager_.geometry());
  pages_tag_ = PagesTag(pages_description_);
  // The presets' pages at this block size, to name what another tag holds, and those an
  // untagged record of these sizes could be.
  for (const std::string& preset : ModelPresetNames()) {
    for (KvPrecision precision : {KvPrecision::kBf16, KvPrecision::kC8, KvPrecision::kFp8}) {
      Result<ModelSpec> spec = ModelPreset(preset, precision);
      if (!spec.ok()) continue;
      Result<BlockGeometry> geo = ComputeBlockGeometry(*spec, manager_.geometry().block_tokens);
      if (!geo.ok()) continue;
      const uint32_t tag = PagesTag(PagesDescription(spec->name, *geo));
      const std::string label = fmt::format("{} {}", spec->name, KvPrecisionName(precision));
      if (std::any_of(known_tags_.begin(), known_tags_.end(), [&](const auto& k) { return k.first == tag; }))
        continue;
      known_tags_.emplace_back(tag, label);
      if (tag == pages_tag_ || geo->pools.size() != manager_.geometry().pools.size()) continue;
      bool same = true;
      for (size_t p = 0; p < geo->pools.size(); ++p)
        same &= geo->pools[p].block_stride == manager_.geometry().pools[p].block_stride;
      if (same) same_size_presets_ += (same_size_presets_.empty() ? "" : ", ") + label;
    }
  }
  for (uint64_t n : sizes) block_payload_bytes_ += n;
  // Spare staging buffers kept for reuse: what the backlog may hold, at most 64 MiB of them.
  spare_ = std::make_shared<SparePool>();
  spare_->max_buffers = std::max<uint64_t>(
      1, std::min<uint64_t>(options_.max_pending_demote_bytes, 64ull << 20) / block_payload_bytes_);
  const uint32_t restore_threads = std::clamp<uint32_t>(options_.restore_threads, 1, 16);
  if (restore_threads > 1)
    restorers_ = std::make_unique<offload::WorkerPool>("skv-restore", restore_threads - 1);
  if (options_.write_policy == WritePolicy::kWriteBack) {
    // One thread: the chain's put is asynchronous past the first tier, so it only has to keep
    // the host tier's copies off the manager's lock; one drain per wake-up batches the puts.
    demoter_ = std::make_unique<offload::WorkerPool>("skv-demote", 1);
    manager_.SetBlockEvictHook([this](const EvictingBlock& b) { OnEvict(b); });
    // At most a quarter of the smallest full-history pool: the pages kept free are cache
    // capacity given up.
    const uint64_t cap = manager_.options().capacity_blocks / 4;  // the full-history pools' size
    evict_ahead_target_ = static_cast<uint32_t>(std::min<uint64_t>(options_.evict_ahead_blocks, cap));
    if (auto* host = dynamic_cast<HostTier*>(&chain_.tier(0)))
      gather_into_host_ = host->capacity_bytes() >= 16 * kEvictAheadBatch * block_record_bytes_;
    // Woken once half the reserve is gone, it refills it all: one wake-up (a futex call, tens
    // of microseconds on a VM) per several allocations, not one per allocation.
    if (evict_ahead_target_ > 0)
      manager_.SetLowFreePagesNotify(std::max<uint32_t>(1, evict_ahead_target_ / 2), [this] { ScheduleEvictAhead(); });
  }
}

OffloadedCache::~OffloadedCache() {
  // Once the hook is gone no eviction queues anything; then what is queued drains.
  if (demoter_) {
    manager_.SetLowFreePagesNotify(0, nullptr);
    manager_.SetBlockEvictHook(nullptr);
  }
  WaitIdle();
  demoter_.reset();
  restorers_.reset();
}

void OffloadedCache::WaitIdle() {
  {
    MutexLock lock(shared_->mu);
    shared_->idle.wait(shared_->mu, [this]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
      return shared_->in_flight == 0;
    });
  }
  chain_.WaitIdle();
}

OffloadedCacheStats OffloadedCache::Stats() const {
  MutexLock lock(shared_->mu);
  return shared_->stats;
}

Result<std::shared_ptr<OffloadedCache::SequenceState>> OffloadedCache::FindSequence(SequenceId seq) const {
  MutexLock lock(mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return Status::NotFound(fmt::format("offloaded cache: no sequence {}", seq));
  return it->second;
}

Result<SequenceId> OffloadedCache::CreateSequence(const SequenceOptions& options) {
  SPARSEKV_ASSIGN_OR_RETURN(SequenceId id, manager_.CreateSequence(options));
  auto st = std::make_shared<SequenceState>();
  st->namespace_salt = options.namespace_salt;
  st->extra_keys = options.extra_keys;
  st->cache_blocks = options.cache_blocks && manager_.options().enable_prefix_caching;
  st->root = manager_.hasher().Root(options.namespace_salt);
  MutexLock lock(mu_);
  sequences_[id] = std::move(st);
  return id;
}

Status OffloadedCache::AppendTokens(SequenceId seq, std::span<const TokenId> tokens) {
  SPARSEKV_ASSIGN_OR_RETURN(std::shared_ptr<SequenceState> st, FindSequence(seq));
  SPARSEKV_RETURN_IF_ERROR(manager_.AppendTokens(seq, tokens));
  // The same chain the manager hashes (block_hash.h), kept here to name bundles.
  st->tail.insert(st->tail.end(), tokens.begin(), tokens.end());
  st->all.insert(st->all.end(), tokens.begin(), tokens.end());
  st->tokens += tokens.size();
  const BlockDigest parent = st->digests.empty() ? st->root : st->digests.back();
  const size_t added =
      manager_.hasher().HashFullBlocks(parent, st->tail, st->extra_keys, &st->digests);
  st->tail.erase(
      st->tail.begin(),
      st->tail.begin() + static_cast<std::ptrdiff_t>(added * manager_.geometry().block_tokens));
  return Status::OK();
}

Status OffloadedCache::Free(SequenceId seq) {
  {
    MutexLock lock(mu_);
    sequences_.erase(seq);
  }
  Status st = manager_.Free(seq);
  // Its blocks are cached now: when the pools are short of free pages, the oldest can go ahead
  // of the next allocation (EvictAhead does nothing otherwise).
  if (st.ok() && evict_ahead_target_ > 0) ScheduleEvictAhead();
  return st;
}

BundlePtr OffloadedCache::GatherBlock(SequenceId seq, uint32_t block, const BlockDigest& digest,
                                      const std::vector<std::vector<PageId>>& tables,
                                      bool into_host) const {
  std::vector<PageId> pages;
  for (const std::vector<PageId>& table : tables)
    pages.push_back(block < table.size() ? table[block] : kInvalidPage);
  return GatherPages(digest, pages, into_host);
}

BundlePtr OffloadedCache::GatherPages(const BlockDigest& digest, std::span<const PageId> pages,
                                      bool into_host, bool history) const {
  const BlockGeometry& geo = manager_.geometry();
  std::vector<std::span<const std::byte>> segments;
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    if (history && !IsFullHistoryKind(geo.pools[p].spec.kind)) {
      segments.emplace_back(reinterpret_cast<const std::byte*>(&digest), 0);  // empty, not null
      continue;
    }
    if (pages[p] == kInvalidPage) return nullptr;
    segments.emplace_back(manager_.pool(p).PageData(pages[p]), geo.pools[p].block_stride);
  }
  segments.emplace_back(reinterpret_cast<const std::byte*>(&digest.check), sizeof digest.check);
  const BundleKey key = history ? HistoryKey(digest) : KeyOf(digest);
  const uint64_t sequence = chain_.NextSequence();
  // Written straight into the host tier's memory when it is the chain's first tier: one
  // copy-and-hash pass, and the demote that follows only refreshes it there and writes the
  // tiers below from it. Where it cannot (no room, a newer version held), a bundle of our own
  // goes to the chain, which decides as for any put.
  auto* host = into_host ? dynamic_cast<HostTier*>(&chain_.tier(0)) : nullptr;
  if (host != nullptr) {
    Result<BundlePtr> b = host->PutGathered(key, segments, sequence, pages_tag_);
    if (b.ok()) return *b;
  }
  auto b = Bundle::Make(key, segments, sequence, pages_tag_);
  return b.ok() ? *b : nullptr;
}

BundleKey OffloadedCache::HistoryKey(const BlockDigest& digest) const {
  if (!has_boundary_pools_) return KeyOf(digest);  // the same bytes as a whole bundle
  // A domain of its own: XXH3-128 of a tag and the block's key.
  static constexpr char kTag[] = "sparsekv.history.v1";
  std::byte in[sizeof kTag - 1 + sizeof(BlockHash)];
  std::memcpy(in, kTag, sizeof kTag - 1);
  std::memcpy(in + sizeof kTag - 1, &digest.hash, sizeof(BlockHash));
  const XXH128_hash_t h = XXH3_128bits(in, sizeof in);
  return BundleKey{options_.namespace_id, BlockHash{h.low64, h.high64}};
}

void OffloadedCache::OnEvict(const EvictingBlock& block) {
  // Runs under the manager's lock (cache_manager.h): only the lock-free pool accessors, and our
  // own short locks, which are never held across a manager call.
  const bool complete = HasEveryPage(block.pages);
  // A block leaving L1 whole after its window or state pages went: its history is kept, as a
  // history record (V4). Only the window or state pages going: the whole block, so its edge
  // stays a resume point in the tiers, unless the options say not to.
  const bool history = !complete && block.whole_block && has_boundary_pools_;
  const uint64_t reserved = history ? history_record_bytes_ : block_record_bytes_;
  {
    MutexLock lock(shared_->mu);
    if (!complete && !history) {
      ++shared_->stats.evicted_incomplete;
      return;
    }
    if (!block.whole_block && !options_.demote_on_boundary_eviction) {
      ++shared_->stats.boundary_evictions_not_demoted;
      return;
    }
    if (shared_->stats.pending_demote_bytes + reserved > options_.max_pending_demote_bytes) {
      ++shared_->stats.demote_backlog_drops;
      return;
    }
    // Reserved before the copy, so that concurrent evictions cannot all pass the limit.
    shared_->stats.pending_demote_bytes += reserved;
    ++shared_->in_flight;
    if (history) ++shared_->stats.evicted_history;
  }
  auto staged = std::make_shared<Staged>();
  staged->history = history;
  staged->key = history ? HistoryKey(block.digest) : KeyOf(block.digest);
  staged->reserved = reserved;
  staged->spare = spare_;
  if (evict_ahead_target_ > 0) ScheduleEvictAhead();  // the pool ran out: get ahead again
  {
    MutexLock lock(spare_->mu);
    if (!spare_->buffers.empty()) {
      staged->bytes = std::move(spare_->buffers.back());
      spare_->buffers.pop_back();
    }
  }
  staged->digest = block.digest;
  // Every byte is copied over just below.
  if (!staged->bytes) staged->bytes = RecordBuffer::Allocate(block_payload_bytes_);
  const BlockGeometry& geo = manager_.geometry();
  std::byte* out = staged->bytes.data();
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    if (history && !IsFullHistoryKind(geo.pools[p].spec.kind)) continue;
    std::memcpy(out, manager_.pool(p).PageData(block.pages[p]), geo.pools[p].block_stride);
    out += geo.pools[p].block_stride;
  }
  std::memcpy(out, &block.digest.check, sizeof block.digest.check);
  bool schedule = false;
  {
    MutexLock lock(shared_->mu);
    ++shared_->stats.evicted_demoted;
    shared_->pending[staged->key] = Shared::Pending{staged, nullptr, nullptr};
    shared_->queue.push_back(std::move(staged));
    schedule = !shared_->drain_scheduled;
    shared_->drain_scheduled = true;
  }
  if (schedule) demoter_->Submit([this](size_t) { DrainEvicted(); });
}

void OffloadedCache::ScheduleEvictAhead() {
  {
    MutexLock lock(shared_->mu);
    if (shared_->evict_ahead_due) {
      shared_->evict_ahead_again = true;  // the run in progress may have looked already
      return;
    }
    shared_->evict_ahead_due = true;
    ++shared_->in_flight;  // WaitIdle waits for the run
  }
  demoter_->Submit([this](size_t) { EvictAhead(); });
}

uint32_t OffloadedCache::Evict(uint32_t free_pages, uint32_t max_blocks) {
  if (options_.write_policy == WritePolicy::kWriteBack) {
    MutexLock lock(evict_mu_);
    return EvictBlocks(free_pages, max_blocks);
  }
  // Write-through: every committed block was handed to the chain when it was committed.
  return manager_.EvictAhead(free_pages, max_blocks, [this](HeldBlock b) { manager_.ReleaseHeldBlock(b); });
}

void OffloadedCache::EvictAhead() {
  {
    MutexLock lock(evict_mu_);
    EvictBlocks(evict_ahead_target_, std::numeric_limits<uint32_t>::max());
  }
  FinishEvictAhead();
}

uint32_t OffloadedCache::EvictBlocks(uint32_t free_target, uint32_t max_blocks) {
  uint32_t evicted = 0;
  while (evicted < max_blocks) {
    uint32_t batch = 0;
    {
      MutexLock lock(shared_->mu);
      const uint64_t waiting = shared_->stats.pending_demote_bytes;
      const uint64_t room = options_.max_pending_demote_bytes > waiting ? options_.max_pending_demote_bytes - waiting : 0;
      batch = static_cast<uint32_t>(
          std::min<uint64_t>({kEvictAheadBatch, room / block_record_bytes_, max_blocks - evicted}));
    }
    if (batch == 0) break;  // the backlog is full: evictions in AllocateSlots drop, as before
    std::vector<std::shared_ptr<Held>> taken;
    // Under the manager's lock: registered as pending before the block leaves the index is
    // visible, so a lookup finds it all along.
    const auto t0 = std::chrono::steady_clock::now();
    evicted += manager_.EvictAhead(free_target, batch, [&](HeldBlock b) {
      auto held = std::make_shared<Held>(&manager_, std::move(b));
      // As OnEvict: a block whose window or state pages went before goes as a history record.
      held->history = !held->complete() && has_boundary_pools_;
      held->demoted = held->complete() || held->history;
      held->key = held->history ? HistoryKey(held->block.digest) : KeyOf(held->block.digest);
      held->reserved = held->history ? history_record_bytes_ : block_record_bytes_;
      MutexLock lock(shared_->mu);
      if (!held->demoted) {
        ++shared_->stats.evicted_incomplete;
      } else {
        shared_->stats.pending_demote_bytes += held->reserved;
        ++shared_->in_flight;
        ++shared_->stats.evicted_demoted;
        ++shared_->stats.evicted_ahead;
        if (held->history) ++shared_->stats.evicted_history;
        shared_->pending[held->key] = Shared::Pending{nullptr, nullptr, held};
      }
      taken.push_back(std::move(held));  // an incomplete one's pages go back below, off the lock
    });
    {
      MutexLock lock(shared_->mu);
      shared_->stats.evict_ahead_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (taken.empty()) break;
    // Off every lock, on the restore threads too: straight into the host tier when it is large
    // (one copy-and-hash pass, no allocation), else a bundle of its own that the chain's put
    // copies. Records pinned there until the chain answers left a small host tier no room for
    // the blocks that cascade from it, so a batch pins at most a sixteenth of the tier.
    std::vector<BundlePtr> made(taken.size());
    RunSplit(static_cast<uint32_t>(taken.size()), [&](uint32_t from, uint32_t to) {
      for (uint32_t i = from; i < to; ++i) {
        if (taken[i]->demoted)
          made[i] = GatherPages(taken[i]->block.digest, taken[i]->block.pages, gather_into_host_, taken[i]->history);
      }
    });
    std::vector<BundlePtr> bundles;
    for (size_t i = 0; i < taken.size(); ++i) {
      const std::shared_ptr<Held>& held = taken[i];
      if (!held->demoted) continue;
      BundlePtr b = std::move(made[i]);
      MutexLock lock(shared_->mu);
      auto it = shared_->pending.find(held->key);
      const bool current = it != shared_->pending.end() && it->second.held == held;
      if (b == nullptr) {
        if (current) shared_->pending.erase(it);
        shared_->stats.pending_demote_bytes -= held->reserved;
        ++shared_->stats.demote_failures;
        if (--shared_->in_flight == 0) shared_->idle.notify_all();
        continue;
      }
      if (current) it->second = Shared::Pending{nullptr, b, nullptr};
      bundles.push_back(std::move(b));
    }
    taken.clear();  // the pages go back to their pools unless a lookup still reads them
    if (!bundles.empty()) Demote(std::move(bundles), /*evicted=*/true);
  }
  return evicted;
}

void OffloadedCache::FinishEvictAhead() {
  {
    MutexLock lock(shared_->mu);
    if (shared_->evict_ahead_again) {  // asked again while this run went: go round once more
      shared_->evict_ahead_again = false;
      demoter_->Submit([this](size_t) { EvictAhead(); });  // still due, still counted in flight
      return;
    }
    shared_->evict_ahead_due = false;
    if (--shared_->in_flight == 0) shared_->idle.notify_all();
  }
}

BundlePtr OffloadedCache::BundleOf(const Staged& staged) const {
  const BlockGeometry& geo = manager_.geometry();
  std::vector<std::span<const std::byte>> segments;
  const std::byte* in = staged.bytes.data();
  for (const PoolGeometry& g : geo.pools) {
    if (staged.history && !IsFullHistoryKind(g.spec.kind)) {
      segments.emplace_back(in, 0);  // empty, not null
      continue;
    }
    segments.emplace_back(in, g.block_stride);
    in += g.block_stride;
  }
  // The check from the digest, not the buffer: a history record's payload ends earlier.
  segments.emplace_back(reinterpret_cast<const std::byte*>(&staged.digest.check), sizeof staged.digest.check);
  auto b = Bundle::Make(staged.key, segments, chain_.NextSequence(), pages_tag_);
  return b.ok() ? *b : nullptr;
}

void OffloadedCache::DrainEvicted() {
  std::vector<std::shared_ptr<Staged>> batch;
  {
    MutexLock lock(shared_->mu);
    batch.swap(shared_->queue);
    shared_->drain_scheduled = false;
  }
  std::vector<BundlePtr> bundles;
  std::vector<BundlePtr> made(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) made[i] = BundleOf(*batch[i]);
  {
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < batch.size(); ++i) {
      auto it = shared_->pending.find(batch[i]->key);
      const bool current = it != shared_->pending.end() && it->second.staged == batch[i];
      if (made[i] == nullptr) {
        // Bundle::MakeWith refused the sizes: cannot happen for a geometry the manager took.
        if (current) shared_->pending.erase(it);
        shared_->stats.pending_demote_bytes -= batch[i]->reserved;
        ++shared_->stats.demote_failures;
        if (--shared_->in_flight == 0) shared_->idle.notify_all();
        continue;
      }
      // The staged copy goes once no lookup holds it; the bundle serves from now on.
      if (current) it->second = Shared::Pending{nullptr, made[i], nullptr};
      bundles.push_back(made[i]);
    }
  }
  batch.clear();  // staged copies no lookup holds give their buffers back (~Staged)
  if (!bundles.empty()) Demote(std::move(bundles), /*evicted=*/true);
}

void OffloadedCache::Demote(std::vector<BundlePtr> bundles, bool evicted) {
  {
    MutexLock lock(shared_->mu);
    shared_->stats.demoted_blocks += bundles.size();
  }
  auto shared = shared_;
  std::vector<BundlePtr> sent = evicted ? bundles : std::vector<BundlePtr>{};
  const uint64_t n = bundles.size();
  chain_.DemoteAsync(std::move(bundles), [shared, sent = std::move(sent), n](std::vector<Status> results) {
    uint64_t failed = 0;
    for (const Status& s : results) {
      if (!s.ok()) {
        ++failed;
        spdlog::debug("offloaded cache: demote failed, block dropped: {}", s.ToString());
      }
    }
    MutexLock lock(shared->mu);
    shared->stats.demote_failures += failed;
    for (const BundlePtr& b : sent) {
      // Findable in the chain from now on (or dropped); a newer copy of the key stays.
      auto it = shared->pending.find(b->key());
      if (it != shared->pending.end() && it->second.bundle == b) shared->pending.erase(it);
      shared->stats.pending_demote_bytes -= b->record_bytes();  // what its eviction reserved
    }
    shared->in_flight -= n;
    if (shared->in_flight == 0) shared->idle.notify_all();
  });
}

std::vector<BundlePtr> OffloadedCache::PendingBundles(std::span<const BundleKey> keys) const {
  std::vector<BundlePtr> out(keys.size());
  std::vector<std::shared_ptr<Staged>> staged(keys.size());
  std::vector<std::shared_ptr<Held>> held(keys.size());
  {
    MutexLock lock(shared_->mu);
    if (shared_->pending.empty()) return out;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = shared_->pending.find(keys[i]);
      if (it == shared_->pending.end()) continue;
      out[i] = it->second.bundle;
      staged[i] = it->second.staged;
      held[i] = it->second.held;
    }
  }
  // Not yet made into a bundle by the demote thread: make one here, outside the locks.
  for (size_t i = 0; i < keys.size(); ++i) {
    if (out[i] != nullptr) continue;
    if (staged[i] != nullptr) {
      out[i] = BundleOf(*staged[i]);
    } else if (held[i] != nullptr) {
      out[i] = GatherPages(held[i]->block.digest, held[i]->block.pages, /*into_host=*/false, held[i]->history);
    }
  }
  return out;
}

std::vector<bool> OffloadedCache::IsPending(std::span<const BundleKey> keys) const {
  std::vector<bool> out(keys.size(), false);
  MutexLock lock(shared_->mu);
  for (size_t i = 0; i < keys.size() && !shared_->pending.empty(); ++i) out[i] = shared_->pending.count(keys[i]) > 0;
  return out;
}

size_t OffloadedCache::CountLower(std::span<const BundleKey> keys) const {
  // Pending first: a block that leaves `pending` has been answered for by the chain, so a key
  // missed here is found by the chain below unless the chain dropped it.
  std::vector<bool> pending(keys.size(), false);
  bool any = false;
  {
    MutexLock lock(shared_->mu);
    for (size_t i = 0; i < keys.size() && !shared_->pending.empty(); ++i) {
      pending[i] = shared_->pending.count(keys[i]) > 0;
      any |= pending[i];
    }
  }
  if (!any) return chain_.CountPrefix(keys);
  const std::vector<int> where = chain_.Locate(keys);
  size_t n = 0;
  while (n < keys.size() && (where[n] >= 0 || pending[n])) ++n;
  return n;
}

std::string OffloadedCache::PagesDescription(std::string_view model, const BlockGeometry& geometry) {
  // Everything that decides how a page's bytes are read. Block-major pages: a pool's page holds
  // every layer of one block, layer_stride apart (DESIGN.md).
  std::string out = fmt::format("sparsekv.pages.v1 model={} block_tokens={} layout=block-major", model,
                                geometry.block_tokens);
  for (const PoolGeometry& g : geometry.pools) {
    out += fmt::format(" | {} {} dims={} ratio={} state_rows={} entries={} page={} layer_stride={} layers=",
                       CacheKindName(g.spec.kind), StorageFormatName(g.spec.format), g.spec.dims, g.spec.ratio,
                       g.spec.state_rows, g.entries_per_block, g.page_bytes, g.layer_stride);
    for (size_t i = 0; i < g.layers.size(); ++i) out += fmt::format("{}{}", i ? "," : "", g.layers[i]);
  }
  return out;
}

uint32_t OffloadedCache::PagesTag(std::string_view description) {
  const auto tag = static_cast<uint32_t>(XXH3_64bits(description.data(), description.size()));
  return tag != 0 ? tag : 1;  // 0 means "not recorded"
}

Status OffloadedCache::OtherPages(const Bundle& b, std::string_view what) const {
  std::string theirs = fmt::format("pages tag {:08x}", b.pages());
  for (const auto& [tag, label] : known_tags_) {
    if (tag == b.pages()) theirs = fmt::format("{} pages (tag {:08x})", label, tag);
  }
  std::string msg = fmt::format("{} {} holds {}; this cache reads {} (tag {:08x}): a miss, left in the tiers",
                                what, b.key().ToString(), theirs, pages_description_, pages_tag_);
  bool first = false;
  {
    MutexLock lock(shared_->mu);
    first = shared_->reported_tags.insert(b.pages()).second;
  }
  if (first) spdlog::warn("offloaded cache: {} (said once per tag)", msg);
  return Status::NotSupported(std::move(msg));
}

void OffloadedCache::NoteUntagged() const {
  {
    MutexLock lock(shared_->mu);
    ++shared_->stats.restore_untagged;
    if (std::exchange(shared_->reported_untagged, true)) return;
  }
  if (same_size_presets_.empty()) {
    spdlog::info("offloaded cache: records without a pages tag (written before sparsekv recorded it) are read as "
                 "this cache's pages by their sizes, which no other preset shares");
  } else {
    spdlog::warn("offloaded cache: records without a pages tag (written before sparsekv recorded it) are read as "
                 "this cache's pages ({}) by their sizes, which {} share: if the tiers hold pages of one of "
                 "those (a kv_format or model switch with the same namespace salt), empty them or change the salt",
                 pages_description_, same_size_presets_);
  }
}

Status OffloadedCache::CheckLayout(const Bundle& b, const BlockDigest& digest, bool history) const {
  const BlockGeometry& geo = manager_.geometry();
  // Other pages are never decoded, whatever their sizes; untagged ones are judged by them.
  if (b.pages() != 0 && b.pages() != pages_tag_) return OtherPages(b, history ? "history record" : "bundle");
  if (b.segment_count() != geo.pools.size() + 1) {
    return Status::Corruption(
        fmt::format("bundle {} has {} segments; this model's block has {} kinds + a digest",
                    b.key().ToString(), b.segment_count(), geo.pools.size()));
  }
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    const uint64_t want =
        history && !IsFullHistoryKind(geo.pools[p].spec.kind) ? 0 : geo.pools[p].block_stride;
    if (b.segment_bytes(static_cast<uint32_t>(p)) != want) {
      return Status::Corruption(fmt::format(
          "{} {}: kind {} holds {} bytes, expected {}", history ? "history record" : "bundle",
          b.key().ToString(), p, b.segment_bytes(static_cast<uint32_t>(p)), want));
    }
  }
  BlockHash check;
  const auto seg = b.segment(static_cast<uint32_t>(geo.pools.size()));
  if (seg.size() != sizeof check)
    return Status::Corruption("bundle " + b.key().ToString() + ": no digest check");
  std::memcpy(&check, seg.data(), sizeof check);
  if (!(check == digest.check)) {
    return Status::Corruption("bundle " + b.key().ToString() +
                              ": digest check differs (a hash collision)");
  }
  if (b.pages() == 0) NoteUntagged();
  return Status::OK();
}

Status OffloadedCache::CommitComputed(SequenceId seq, uint64_t num_tokens) {
  SPARSEKV_ASSIGN_OR_RETURN(std::shared_ptr<SequenceState> st, FindSequence(seq));
  std::vector<BundlePtr> bundles;
  if (options_.write_policy == WritePolicy::kWriteThrough && st->cache_blocks) {
    // Gather before committing: the commit releases window and snapshot pages that left the
    // sequence's window, and a bundle must hold every kind of its block.
    SPARSEKV_ASSIGN_OR_RETURN(SequenceInfo info, manager_.GetSequenceInfo(seq));
    const uint32_t bt = manager_.geometry().block_tokens;
    const auto first = static_cast<uint32_t>(info.computed_tokens / bt);
    const auto end = static_cast<uint32_t>(std::min<uint64_t>(num_tokens / bt, st->digests.size()));
    if (first < end) {
      std::vector<std::vector<PageId>> tables(manager_.num_pools());
      for (size_t p = 0; p < tables.size(); ++p)
        SPARSEKV_RETURN_IF_ERROR(manager_.GetBlockTable(seq, p, &tables[p]));
      // Stored in the host tier as they are gathered, pinned there until the chain has them
      // below: at most half the tier at once, so the batch never crowds out its own later
      // blocks (those go as bundles of their own, and the tier evicts as for any put).
      auto* host = dynamic_cast<HostTier*>(&chain_.tier(0));
      const uint64_t in_place_limit = host != nullptr ? host->capacity_bytes() / 2 : 0;
      const uint32_t count = end - first;
      const auto in_place_blocks = static_cast<uint32_t>(
          std::min<uint64_t>(count, in_place_limit / std::max<uint64_t>(1, block_record_bytes_)));
      // Copy-and-hash is compute-bound per thread: the blocks are split as a restore's are.
      std::vector<BundlePtr> made(count);
      auto gather = [&](uint32_t from, uint32_t to) {
        for (uint32_t i = from; i < to; ++i)
          made[i] = GatherBlock(seq, first + i, st->digests[first + i], tables,
                                /*into_host=*/i < in_place_blocks);
      };
      RunSplit(count, gather);
      for (BundlePtr& b : made) {
        if (b) bundles.push_back(std::move(b));
      }
    }
  }
  SPARSEKV_RETURN_IF_ERROR(manager_.CommitComputed(seq, num_tokens));
  if (bundles.empty()) return Status::OK();
  {
    MutexLock lock(shared_->mu);
    shared_->in_flight += bundles.size();
  }
  Demote(std::move(bundles), /*evicted=*/false);
  return Status::OK();
}

void OffloadedCache::RunSplit(uint32_t count,
                              const std::function<void(uint32_t, uint32_t)>& range) const {
  const uint32_t parts =
      restorers_ ? std::min<uint32_t>(count, static_cast<uint32_t>(restorers_->size()) + 1) : 1;
  if (parts <= 1) {
    range(0, count);
    return;
  }
  std::vector<std::future<void>> helpers;
  for (uint32_t k = 1; k < parts; ++k) {
    auto done = std::make_shared<std::promise<void>>();
    helpers.push_back(done->get_future());
    const uint32_t from = count * k / parts, to = count * (k + 1) / parts;
    restorers_->Submit([&range, from, to, done](size_t) {
      range(from, to);
      done->set_value();
    });
  }
  range(0, count / parts);
  for (auto& h : helpers) h.wait();
}

// A tail record checked against the state it should hold (ParseTail), and where its pages are.
struct OffloadedCache::Tail {
  BundlePtr bundle;
  uint64_t state_tokens = 0;
  uint32_t block = 0;          // the block the state ends in (or at)
  bool partial = false;        // segments 2.. hold that block's page of every pool
  bool edges = false;          // version 2: it holds the window and state its state needs
  uint32_t window_first = 0;   // full blocks [window_first, block) have window pages here
  uint32_t state_blocks = 0;   // 1: the state pools' page of block - 1 is here
  std::vector<int> edge_segment;  // [pool]: segment of its first window or state page, or -1

  // The tail's page of boundary pool `pool` for full block `b`, or an empty span.
  std::span<const std::byte> Edge(size_t pool, uint32_t b, bool window) const {
    if (edge_segment[pool] < 0) return {};
    if (window) {
      if (b < window_first || b >= block) return {};
      return bundle->segment(static_cast<uint32_t>(edge_segment[pool]) + (b - window_first));
    }
    if (state_blocks == 0 || b + 1 != block) return {};
    return bundle->segment(static_cast<uint32_t>(edge_segment[pool]));
  }
};

struct OffloadedCache::RestorePlan {
  std::vector<BundleKey> keys;  // one per block: a whole bundle's key or a history record's
  std::vector<bool> history;    // keys[i] is a history record's
  BoundarySkip skip;            // blocks whose boundary pages nobody reads: not even allocated
  const Tail* tail = nullptr;   // the boundary pages of the blocks `skip` leaves
};

uint32_t OffloadedCache::RestoreBlocks(SequenceId seq, uint32_t first_block,
                                       std::span<const BlockDigest> digests, const RestorePlan* plan) {
  std::vector<BundleKey> keys;
  if (plan != nullptr) {
    keys = plan->keys;
  } else {
    for (const BlockDigest& d : digests) keys.push_back(KeyOf(d));
  }
  const std::vector<BundlePtr> pending = PendingBundles(keys);
  // What the host tier holds is read where it lies (pinned, not copied out) and checked as it
  // is copied into the L1 pages below: one pass over its bytes, no allocation. The rest comes
  // through the chain, checked there.
  std::vector<Result<BundlePtr>> got(keys.size(), Status::NotFound(""));
  std::vector<bool> in_place(keys.size(), false);
  auto* host = dynamic_cast<HostTier*>(&chain_.tier(0));
  std::vector<BundleKey> rest;
  std::vector<size_t> rest_at;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (host != nullptr) {
      Result<BundlePtr> b = host->GetPinned(keys[i], /*check=*/false);
      if (b.ok() && !chain_.IsStale(keys[i], (*b)->sequence())) {
        got[i] = std::move(b);
        in_place[i] = true;
        continue;
      }
    }
    rest.push_back(keys[i]);
    rest_at.push_back(i);
  }
  // What comes through the chain is asked for in chunks, all at once: the tiers read them in
  // order while the blocks of the chunks already read are copied into L1 (an SSD restore used
  // to copy only after its last read).
  // A chunk holds at most 32 MiB of records (one block at least) and the chunks asked for ahead
  // at most 128 MiB, within kRestoreChunkBlocks and kReadAheadChunks: a prefix of large blocks
  // (a V4 block's whole record is 15.6 MB) then lands in the SSD tier's registered read arena
  // rather than in fresh heap memory, with still 16 MiB or more in flight.
  constexpr uint64_t kChunkBytes = 32ull << 20, kAheadBytes = 128ull << 20;
  const uint64_t per_block = std::max<uint64_t>(1, plan != nullptr ? history_record_bytes_ : block_record_bytes_);
  const size_t chunk = rest.empty() ? keys.size()
                                    : static_cast<size_t>(std::clamp<uint64_t>(kChunkBytes / per_block, 1, kRestoreChunkBlocks));
  const size_t read_ahead =
      static_cast<size_t>(std::clamp<uint64_t>(kAheadBytes / (uint64_t{chunk} * per_block), 1, kReadAheadChunks));
  // At most kReadAheadChunks chunks are asked for ahead of the copy: enough to keep the tier
  // busy, few enough that a long prefix's reads land in the tier's read arena rather than in
  // fresh memory the kernel must zero first (asking for a 128K-token prefix at once did that).
  std::vector<std::future<std::vector<Result<BundlePtr>>>> reads;
  const size_t chunks = rest.empty() ? 0 : (rest.size() + chunk - 1) / chunk;
  auto ask_upto = [&](size_t n) {
    while (reads.size() < std::min(n, chunks)) {
      const size_t c = reads.size() * chunk;
      reads.push_back(chain_.Promote(std::vector<BundleKey>(
          rest.begin() + static_cast<std::ptrdiff_t>(c),
          rest.begin() + static_cast<std::ptrdiff_t>(std::min(c + chunk, rest.size())))));
    }
  };
  ask_upto(read_ahead);
  size_t collected = 0;  // reads whose bundles are in `got`
  auto collect_before = [&](size_t key_end) {
    while (collected < chunks && rest_at[collected * chunk] < key_end) {
      ask_upto(collected + 1 + read_ahead);
      std::vector<Result<BundlePtr>> r = reads[collected].get();
      for (size_t j = 0; j < r.size(); ++j) got[rest_at[collected * chunk + j]] = std::move(r[j]);
      ++collected;
    }
  };

  const uint32_t bt = manager_.geometry().block_tokens;
  const BlockGeometry& geo = manager_.geometry();
  std::vector<std::vector<PageId>> tables(geo.pools.size());
  std::vector<Status> checked(keys.size());
  uint64_t rejected = 0, no_room = 0, other_pages = 0;
  uint32_t restored = 0;  // leading blocks copied into L1 and checked
  // Each block's pages are written and (from the host tier) checked on one thread; blocks are
  // split between the caller and the restorers.
  auto restore_range = [&](uint32_t from, uint32_t to) {
    std::vector<std::byte*> dst(geo.pools.size() + 1, nullptr);  // the digest is not copied
    for (uint32_t i = from; i < to; ++i) {
      const Bundle& b = **got[i];
      const uint32_t block = first_block + i;
      for (size_t p = 0; p < geo.pools.size(); ++p) {
        const PageId page = tables[p][block];
        // Under a plan, the boundary pages come from its tail, and only where allocated.
        const bool from_tail = plan != nullptr && !IsFullHistoryKind(geo.pools[p].spec.kind);
        dst[p] = page == kInvalidPage || from_tail ? nullptr : manager_.pool(p).PageData(page);
      }
      if (in_place[i]) {
        checked[i] = b.CopySegmentsVerified(dst);
      } else {
        for (size_t p = 0; p < geo.pools.size(); ++p) {
          if (dst[p] == nullptr) continue;
          const std::span<const std::byte> seg = b.segment(static_cast<uint32_t>(p));
          std::memcpy(dst[p], seg.data(), seg.size());
        }
      }
      if (plan == nullptr) continue;
      for (size_t p = 0; p < geo.pools.size() && checked[i].ok(); ++p) {
        const PageId page = tables[p][block];
        if (page == kInvalidPage || IsFullHistoryKind(geo.pools[p].spec.kind)) continue;
        const std::span<const std::byte> edge =
            plan->tail->Edge(p, block, geo.pools[p].spec.kind == CacheKind::kSwaWindow);
        if (edge.size() != geo.pools[p].block_stride) {
          checked[i] = Status::Internal(fmt::format(
              "offloaded cache: the tail holds no page of pool {} for block {}", p, block));
          continue;
        }
        std::memcpy(manager_.pool(p).PageData(page), edge.data(), edge.size());
      }
    }
  };
  for (size_t b0 = 0; b0 < keys.size();) {
    const size_t b1 = std::min(b0 + chunk, keys.size());
    collect_before(b1);
    // The usable prefix of this chunk: found, and laid out as this cache's blocks.
    size_t end = b0;
    for (; end < b1; ++end) {
      // Evicted from L1 and not yet in the chain (write-back): the gathered copy serves.
      if (!got[end].ok() && pending[end] != nullptr) got[end] = pending[end];
      if (!got[end].ok()) {
        rejected += !got[end].status().Is(StatusCode::kNotFound);
        break;
      }
      const Status layout = CheckLayout(**got[end], digests[end], plan != nullptr && plan->history[end]);
      if (!layout.ok() && layout.Is(StatusCode::kNotSupported)) {
        ++other_pages;  // reported once per tag by CheckLayout
        break;
      }
      if (!layout.ok()) {
        spdlog::warn("offloaded cache: not restoring: {}", layout.ToString());
        ++rejected;
        break;
      }
    }
    if (end == b0) break;
    const uint64_t upto = uint64_t{first_block + end} * bt;
    Result<SlotAllocation> alloc = plan != nullptr ? manager_.AllocateRestoreSlots(seq, upto, plan->skip)
                                                   : manager_.AllocateSlots(seq, upto);
    if (!alloc.ok()) {
      no_room = 1;  // no room in L1: what is restored so far stands
      break;
    }
    for (const PageCopy& c : alloc->copies) {
      std::memcpy(manager_.pool(c.pool).PageData(c.dst), manager_.pool(c.pool).PageData(c.src),
                  geo.pools[c.pool].block_stride);
    }
    bool tables_ok = true;
    for (size_t p = 0; p < geo.pools.size(); ++p) tables_ok &= manager_.GetBlockTable(seq, p, &tables[p]).ok();
    if (!tables_ok) break;
    RunSplit(static_cast<uint32_t>(end - b0), [&](uint32_t from, uint32_t to) {
      restore_range(static_cast<uint32_t>(b0) + from, static_cast<uint32_t>(b0) + to);
    });
    size_t good = b0;
    for (; good < end && checked[good].ok(); ++good) {
    }
    if (good < end) {
      // Damaged in host memory: the tier drops it, and the restored prefix ends before it. The
      // pages allocated past it stay the sequence's, uncommitted, as any allocation.
      if (in_place[good] && checked[good].Is(StatusCode::kCorruption))
        host->CheckPinned(*got[good], keys[good]).IgnoreError();
      spdlog::warn("offloaded cache: not restoring: {}", checked[good].ToString());
      ++rejected;
    }
    restored = static_cast<uint32_t>(good);
    // This chunk's bundles go: host records unpinned, SSD read buffers back to their arena.
    for (size_t i = b0; i < end; ++i) got[i] = Status::NotFound("restored");
    if (good < end || end < b1) break;
    b0 = b1;
  }
  got.clear();  // pinned records past the prefix go back; reads not waited for drop theirs
  auto count = [&](uint64_t blocks) {
    MutexLock lock(shared_->mu);
    shared_->stats.restored_blocks += blocks;
    shared_->stats.restore_rejected += rejected;
    shared_->stats.restore_other_pages += other_pages;
    shared_->stats.restore_no_room += no_room;
  };
  if (restored == 0 || plan != nullptr) {  // a plan's caller commits (at the tail's state) and counts
    count(0);
    return restored;
  }
  // Committed like computed KV: the blocks become the sequence's and findable again.
  const Status s = manager_.CommitComputed(seq, uint64_t{first_block + restored} * bt);
  if (!s.ok()) {
    spdlog::warn("offloaded cache: committing restored blocks: {}", s.ToString());
    count(0);
    return 0;
  }
  count(restored);
  return restored;
}

Result<OffloadedPrefix> OffloadedCache::AcquirePrefix(SequenceId seq) {
  SPARSEKV_ASSIGN_OR_RETURN(std::shared_ptr<SequenceState> st, FindSequence(seq));
  SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch l1, manager_.AcquireCachedPrefix(seq));
  OffloadedPrefix out;
  out.l1_blocks = l1.blocks;
  const uint32_t bt = manager_.geometry().block_tokens;
  // A request computes at least one token: at most (tokens - 1) / bt blocks can hit.
  const uint64_t limit =
      st->tokens == 0 ? 0 : std::min<uint64_t>((st->tokens - 1) / bt, st->digests.size());
  if (st->cache_blocks && l1.blocks < limit) {
    std::span<const BlockDigest> rest(st->digests.data() + l1.blocks, limit - l1.blocks);
    std::vector<BundleKey> keys;
    for (const BlockDigest& d : rest) keys.push_back(KeyOf(d));
    const size_t present = CountLower(keys);
    if (present > 0) out.lower_blocks = RestoreBlocks(seq, l1.blocks, rest.first(present));
    // Prefetch what follows, so the next request of this conversation finds it in host DRAM.
    const uint32_t prefetch = options_.prefetch_blocks >= 0
                                  ? static_cast<uint32_t>(options_.prefetch_blocks)
                                  : chain_.options().prefetch_blocks;
    std::vector<BundleKey> next;
    for (size_t i = l1.blocks + out.lower_blocks; i < st->digests.size() && next.size() < prefetch;
         ++i) {
      next.push_back(KeyOf(st->digests[i]));
    }
    if (!next.empty()) chain_.Prefetch(std::move(next));
  }
  out.blocks = out.l1_blocks + out.lower_blocks;
  out.tokens = uint64_t{out.blocks} * bt;
  return out;
}

Result<std::vector<BlockDigest>> OffloadedCache::BlockDigests(SequenceId seq) const {
  SPARSEKV_ASSIGN_OR_RETURN(std::shared_ptr<SequenceState> st, FindSequence(seq));
  return st->digests;  // changed only by AppendTokens, which the caller orders with this
}

Result<OffloadedPrefix> OffloadedCache::LookupPrefix(const PrefixQuery& query) {
  SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch l1, manager_.LookupPrefix(query));
  OffloadedPrefix out;
  out.l1_blocks = l1.blocks;
  const uint32_t bt = manager_.geometry().block_tokens;
  std::vector<BlockDigest> digests;
  manager_.hasher().HashFullBlocks(manager_.hasher().Root(query.namespace_salt), query.tokens,
                                   query.extra_keys, &digests);
  uint64_t limit = digests.size();
  if (query.leave_last_token)
    limit = query.tokens.empty() ? 0 : std::min<uint64_t>(limit, (query.tokens.size() - 1) / bt);
  if (l1.blocks < limit) {
    std::vector<BundleKey> keys;
    for (uint64_t i = l1.blocks; i < limit; ++i) keys.push_back(KeyOf(digests[i]));
    out.lower_blocks = static_cast<uint32_t>(CountLower(keys));
  }
  out.blocks = out.l1_blocks + out.lower_blocks;
  out.tokens = uint64_t{out.blocks} * bt;
  return out;
}

// ---- suspend and resume ----

namespace {

constexpr uint32_t kTailMagic = 0x544b5653;  // "SKVT" read as little-endian bytes
constexpr uint16_t kTailVersion = 2;

struct TailHeaderV1 {
  uint32_t magic = kTailMagic;
  uint16_t version = 1;
  uint16_t pools = 0;
  uint32_t block_tokens = 0;
  uint32_t tail_tokens = 0;
  uint64_t state_tokens = 0;
  BlockHash parent_check;
  uint64_t geometry = 0;
};
static_assert(sizeof(TailHeaderV1) == 48);

struct TailHeader : TailHeaderV1 {
  uint32_t window_first = 0;   // first full block whose window pages follow
  uint32_t window_blocks = 0;  // window pages per sliding-window pool
  uint32_t state_blocks = 0;   // state pages per compressor-state pool (0 or 1)
  uint32_t reserved = 0;
};
static_assert(sizeof(TailHeader) == 64);

}  // namespace

BlockHash OffloadedCache::TailKey(const BlockDigest& parent, std::string_view extra_keys,
                                  std::span<const TokenId> tail_tokens,
                                  uint64_t state_tokens) const {
  // A domain of its own, so no tail key equals a block's: XXH3-128 of a tag, the parent's
  // digest, the state's length, the extra keys and the tail tokens.
  XXH3_state_t* h = XXH3_createState();
  XXH3_128bits_reset(h);
  static constexpr char kTag[] = "sparsekv.tail.v1";
  XXH3_128bits_update(h, kTag, sizeof kTag - 1);
  XXH3_128bits_update(h, &parent, sizeof parent);
  XXH3_128bits_update(h, &state_tokens, sizeof state_tokens);
  const uint64_t extra = extra_keys.size();
  XXH3_128bits_update(h, &extra, sizeof extra);
  XXH3_128bits_update(h, extra_keys.data(), extra_keys.size());
  XXH3_128bits_update(h, tail_tokens.data(), tail_tokens.size_bytes());
  const XXH128_hash_t r = XXH3_128bits_digest(h);
  XXH3_freeState(h);
  return BlockHash{r.low64, r.high64};
}

Result<BlockHash> OffloadedCache::SuspensionKey(const SequenceOptions& options,
                                                std::span<const TokenId> tokens,
                                                uint64_t state_tokens) const {
  if (state_tokens > tokens.size()) {
    return Status::InvalidArgument(fmt::format(
        "offloaded cache: a state of {} tokens for a sequence of {}", state_tokens, tokens.size()));
  }
  const uint32_t bt = manager_.geometry().block_tokens;
  const uint64_t full = state_tokens / bt * bt;
  std::vector<BlockDigest> digests;
  const BlockDigest root = manager_.hasher().Root(options.namespace_salt);
  manager_.hasher().HashFullBlocks(root, tokens.first(full), options.extra_keys, &digests);
  return TailKey(digests.empty() ? root : digests.back(), options.extra_keys,
                 tokens.subspan(full, state_tokens - full), state_tokens);
}

Result<SuspendInfo> OffloadedCache::Suspend(SequenceId seq) {
  SPARSEKV_ASSIGN_OR_RETURN(std::shared_ptr<SequenceState> st, FindSequence(seq));
  if (!st->cache_blocks) {
    return Status::FailedPrecondition(fmt::format(
        "offloaded cache: sequence {} does not cache its blocks; it cannot be suspended", seq));
  }
  SPARSEKV_ASSIGN_OR_RETURN(SequenceInfo info, manager_.GetSequenceInfo(seq));
  const BlockGeometry& geo = manager_.geometry();
  const uint32_t bt = geo.block_tokens;
  const uint64_t P = info.computed_tokens;
  const auto nb = static_cast<uint32_t>(P / bt);
  std::vector<std::vector<PageId>> tables(geo.pools.size());
  for (size_t p = 0; p < tables.size(); ++p)
    SPARSEKV_RETURN_IF_ERROR(manager_.GetBlockTable(seq, p, &tables[p]));

  SuspendInfo out;
  out.tokens = P;
  out.blocks = nb;
  // Full blocks the chain holds in neither form (nor has on the way) are written now, from the
  // sequence's own pages: as history records where the model has boundary pools (the tail
  // carries the window and state at P), whole otherwise.
  std::vector<BundleKey> keys, history_keys;
  for (uint32_t b = 0; b < nb; ++b) {
    keys.push_back(KeyOf(st->digests[b]));
    if (has_boundary_pools_) history_keys.push_back(HistoryKey(st->digests[b]));
  }
  const std::vector<int> where = chain_.Locate(keys);
  const std::vector<int> where_history =
      has_boundary_pools_ ? chain_.Locate(history_keys) : std::vector<int>(nb, -1);
  const std::vector<bool> pending = IsPending(keys);
  const std::vector<bool> pending_history =
      has_boundary_pools_ ? IsPending(history_keys) : std::vector<bool>(nb, false);
  std::vector<uint32_t> missing;
  for (uint32_t b = 0; b < nb; ++b) {
    if (where[b] < 0 && where_history[b] < 0 && !pending[b] && !pending_history[b]) missing.push_back(b);
  }
  // Gathered (copy and hash, split between threads as a write-through commit is) and handed to
  // the chain a chunk at a time, a few chunks in flight: memory stays bounded for a sequence of
  // any length, and the tier writes one chunk while the next is gathered.
  constexpr size_t kChunk = 8, kInFlight = 4;
  std::deque<std::future<std::vector<Status>>> flying;
  auto settle = [&](size_t keep) -> Status {
    while (flying.size() > keep) {
      const std::vector<Status> got = flying.front().get();
      flying.pop_front();
      for (const Status& s : got) {
        if (!s.ok()) return s.WithContext(fmt::format("offloaded cache: suspending sequence {}", seq));
      }
    }
    return Status::OK();
  };
  for (size_t c = 0; c < missing.size(); c += kChunk) {
    const auto count = static_cast<uint32_t>(std::min(kChunk, missing.size() - c));
    std::vector<BundlePtr> made(count);
    RunSplit(count, [&](uint32_t from, uint32_t to) {
      std::vector<PageId> pages(geo.pools.size());
      for (uint32_t i = from; i < to; ++i) {
        const uint32_t b = missing[c + i];
        for (size_t p = 0; p < geo.pools.size(); ++p)
          pages[p] = b < tables[p].size() ? tables[p][b] : kInvalidPage;
        made[i] = GatherPages(st->digests[b], pages, /*into_host=*/true, /*history=*/has_boundary_pools_);
      }
    });
    std::vector<BundlePtr> chunk;
    for (BundlePtr& b : made) {
      if (b == nullptr) {
        ++out.unsaved_blocks;
        continue;
      }
      out.written_bytes += b->record().size();
      chunk.push_back(std::move(b));
    }
    out.written_blocks += static_cast<uint32_t>(chunk.size());
    if (has_boundary_pools_) out.history_blocks += static_cast<uint32_t>(chunk.size());
    if (chunk.empty()) continue;
    flying.push_back(chain_.Demote(std::move(chunk)));
    SPARSEKV_RETURN_IF_ERROR(settle(kInFlight - 1));
  }

  // The tail record.
  const BlockDigest parent = nb == 0 ? st->root : st->digests[nb - 1];
  const std::span<const TokenId> tail_tokens(st->all.data() + uint64_t{nb} * bt, P - uint64_t{nb} * bt);
  out.tail = TailKey(parent, st->extra_keys, tail_tokens, P);
  TailHeader header;
  header.version = kTailVersion;
  header.pools = static_cast<uint16_t>(geo.pools.size());
  header.block_tokens = bt;
  header.tail_tokens = static_cast<uint32_t>(tail_tokens.size());
  header.state_tokens = P;
  header.parent_check = parent.check;
  header.geometry = geometry_fingerprint_;
  // The window at P reaches back to token P - window: those full blocks' window pages, and at a
  // block edge the snapshot of the block before it (a partial block's page holds the running
  // state at P).
  const uint64_t window = manager_.window_tokens();
  header.window_first = has_boundary_pools_ ? static_cast<uint32_t>(P > window ? (P - window) / bt : 0) : nb;
  header.window_blocks = nb - std::min(nb, header.window_first);
  header.state_blocks = has_boundary_pools_ && P % bt == 0 && nb > 0 ? 1 : 0;
  std::vector<std::span<const std::byte>> segments;
  segments.emplace_back(reinterpret_cast<const std::byte*>(&header), sizeof header);
  segments.emplace_back(reinterpret_cast<const std::byte*>(tail_tokens.data()), tail_tokens.size_bytes());
  auto page_of = [&](size_t p, uint32_t b) -> Result<std::span<const std::byte>> {
    const PageId page = b < tables[p].size() ? tables[p][b] : kInvalidPage;
    if (page == kInvalidPage) {
      return Status::Internal(fmt::format(
          "offloaded cache: sequence {} holds no page of pool {} for block {} (state at {} tokens)", seq, p, b, P));
    }
    return std::span<const std::byte>(manager_.pool(p).PageData(page), geo.pools[p].block_stride);
  };
  if (P % bt != 0) {
    for (size_t p = 0; p < geo.pools.size(); ++p) {
      SPARSEKV_ASSIGN_OR_RETURN(std::span<const std::byte> page, page_of(p, nb));
      segments.push_back(page);
    }
  }
  for (CacheKind kind : {CacheKind::kSwaWindow, CacheKind::kCompressorState}) {
    const bool is_window = kind == CacheKind::kSwaWindow;
    const uint32_t first = is_window ? header.window_first : nb - header.state_blocks;
    const uint32_t n = is_window ? header.window_blocks : header.state_blocks;
    for (size_t p = 0; p < geo.pools.size(); ++p) {
      if (geo.pools[p].spec.kind != kind) continue;
      for (uint32_t b = first; b < first + n; ++b) {
        SPARSEKV_ASSIGN_OR_RETURN(std::span<const std::byte> page, page_of(p, b));
        segments.push_back(page);
      }
    }
  }
  SPARSEKV_ASSIGN_OR_RETURN(BundlePtr tail,
                            Bundle::Make(BundleKey{options_.namespace_id, out.tail}, segments,
                                         chain_.NextSequence(), pages_tag_));
  out.tail_bytes = tail->record().size();
  out.written_bytes += out.tail_bytes;
  // Acknowledged by the chain before the pages go: a crash after this returns finds it all.
  flying.push_back(chain_.Demote({std::move(tail)}));
  SPARSEKV_RETURN_IF_ERROR(settle(0));
  SPARSEKV_RETURN_IF_ERROR(Free(seq));
  return out;
}

Result<OffloadedCache::Tail> OffloadedCache::ParseTail(BundlePtr b, const BlockDigest& parent,
                                                       std::span<const TokenId> tail_tokens,
                                                       uint64_t state_tokens) const {
  const BlockGeometry& geo = manager_.geometry();
  const uint32_t bt = geo.block_tokens;
  const std::string name = "tail record " + b->key().ToString();
  if (b->pages() != 0 && b->pages() != pages_tag_) return OtherPages(*b, "tail record");
  TailHeader h;
  const auto hs = b->segment(0);
  if (hs.size() < sizeof(TailHeaderV1)) return Status::Corruption(name + ": header size");
  std::memcpy(static_cast<void*>(&h), hs.data(), sizeof(TailHeaderV1));
  if (h.magic != kTailMagic || (h.version != 1 && h.version != kTailVersion)) {
    return Status::Corruption(fmt::format("{}: magic {:#x} version {} (expected version 1 or {})", name,
                                          h.magic, h.version, kTailVersion));
  }
  if (hs.size() != (h.version == 1 ? sizeof(TailHeaderV1) : sizeof(TailHeader)))
    return Status::Corruption(name + ": header size");
  if (h.version == 1) {
    h.window_first = static_cast<uint32_t>(state_tokens / bt);  // version 1: no window or state pages
  } else {
    std::memcpy(static_cast<void*>(&h), hs.data(), sizeof h);
  }
  if (h.pools != geo.pools.size() || h.block_tokens != bt || h.geometry != geometry_fingerprint_)
    return Status::Corruption(name + ": laid out for another geometry");
  if (h.state_tokens != state_tokens || !(h.parent_check == parent.check) ||
      h.tail_tokens != tail_tokens.size())
    return Status::Corruption(name + ": names another state (a hash collision)");
  Tail t;
  t.bundle = b;
  t.state_tokens = state_tokens;
  t.block = static_cast<uint32_t>(state_tokens / bt);
  t.partial = state_tokens % bt != 0;
  t.edges = h.version >= 2;
  t.window_first = h.window_first;
  t.state_blocks = h.state_blocks;
  // Exactly what Suspend writes for this model: fewer window or state pages would leave the
  // resumed sequence without some of what its next token reads.
  const uint64_t window = manager_.window_tokens();
  uint32_t want_first = t.block, want_state = 0;  // version 1, or a model without those pools
  if (h.version >= 2 && has_boundary_pools_) {
    want_first = static_cast<uint32_t>(state_tokens > window ? (state_tokens - window) / bt : 0);
    want_state = !t.partial && t.block > 0 ? 1 : 0;
  }
  if (h.window_first != want_first || h.window_blocks != t.block - want_first || h.state_blocks != want_state ||
      h.reserved != 0) {
    return Status::Corruption(fmt::format(
        "{}: window pages of blocks {}+{} and {} state pages for a state of {} tokens (expected {}+{} and {})", name,
        h.window_first, h.window_blocks, h.state_blocks, state_tokens, want_first, t.block - want_first, want_state));
  }
  // Segments: header, tokens, the partial block's pages, then the window and state pages.
  uint32_t next = 2 + (t.partial ? static_cast<uint32_t>(geo.pools.size()) : 0);
  t.edge_segment.assign(geo.pools.size(), -1);
  for (CacheKind kind : {CacheKind::kSwaWindow, CacheKind::kCompressorState}) {
    const uint32_t n = kind == CacheKind::kSwaWindow ? h.window_blocks : h.state_blocks;
    for (size_t p = 0; p < geo.pools.size(); ++p) {
      if (geo.pools[p].spec.kind != kind || n == 0) continue;
      t.edge_segment[p] = static_cast<int>(next);
      next += n;
    }
  }
  if (b->segment_count() != next)
    return Status::Corruption(fmt::format("{}: {} segments, expected {}", name, b->segment_count(), next));
  const auto ts = b->segment(1);
  if (ts.size() != tail_tokens.size_bytes() || std::memcmp(ts.data(), tail_tokens.data(), ts.size()) != 0)
    return Status::Corruption(name + ": its tokens differ (a hash collision)");
  for (uint32_t i = 2; i < next; ++i) {
    // Every page segment is one pool's block; which pool is fixed by the order above.
    size_t pool = 0;
    if (i < 2 + (t.partial ? geo.pools.size() : 0)) {
      pool = i - 2;
    } else {
      int best = -1;  // the pool whose pages start last at or before i
      for (size_t p = 0; p < geo.pools.size(); ++p) {
        if (t.edge_segment[p] > best && static_cast<uint32_t>(t.edge_segment[p]) <= i) {
          best = t.edge_segment[p];
          pool = p;
        }
      }
    }
    if (b->segment(i).size() != geo.pools[pool].block_stride)
      return Status::Corruption(fmt::format("{}: segment {} (pool {}) of {} bytes", name, i, pool, b->segment(i).size()));
  }
  return t;
}

Status OffloadedCache::RestorePartial(SequenceId seq, const Tail& tail) {
  const BlockGeometry& geo = manager_.geometry();
  SPARSEKV_ASSIGN_OR_RETURN(SlotAllocation alloc, manager_.AllocateSlots(seq, tail.state_tokens));
  for (const PageCopy& c : alloc.copies) {
    std::memcpy(manager_.pool(c.pool).PageData(c.dst), manager_.pool(c.pool).PageData(c.src),
                geo.pools[c.pool].block_stride);
  }
  std::vector<PageId> table;
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    SPARSEKV_RETURN_IF_ERROR(manager_.GetBlockTable(seq, p, &table));
    if (tail.block >= table.size() || table[tail.block] == kInvalidPage) {
      return Status::Internal(fmt::format("tail record {}: no page of pool {} for block {}",
                                          tail.bundle->key().ToString(), p, tail.block));
    }
    const auto seg = tail.bundle->segment(static_cast<uint32_t>(2 + p));
    std::memcpy(manager_.pool(p).PageData(table[tail.block]), seg.data(), seg.size());
  }
  // The manager's commit: the blocks before were restored from the chain, and a partial one
  // is not demoted.
  return manager_.CommitComputed(seq, tail.state_tokens);
}

Result<ResumeInfo> OffloadedCache::Resume(const SequenceOptions& options,
                                          std::span<const TokenId> tokens, uint64_t state_tokens) {
  if (state_tokens > tokens.size()) {
    return Status::InvalidArgument(fmt::format(
        "offloaded cache: a state of {} tokens for a sequence of {}", state_tokens, tokens.size()));
  }
  SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, CreateSequence(options));
  auto fail = [&](Status s) {
    Free(seq).IgnoreError();
    return s;
  };
  if (Status s = AppendTokens(seq, tokens); !s.ok()) return fail(s);
  Result<std::shared_ptr<SequenceState>> found = FindSequence(seq);
  if (!found.ok()) return fail(found.status());
  const std::shared_ptr<SequenceState> st = *std::move(found);
  const uint32_t bt = manager_.geometry().block_tokens;
  const auto nb = static_cast<uint32_t>(state_tokens / bt);
  const bool partial = state_tokens % bt != 0;
  ResumeInfo out;
  out.seq = seq;
  out.tokens = tokens.size();
  out.state_tokens = state_tokens;
  if (!st->cache_blocks) {
    if (state_tokens > 0) out.lost = "the sequence does not cache blocks";
    out.recompute_tokens = state_tokens;
    return out;
  }

  Result<PrefixMatch> l1 = manager_.AcquireResumePrefix(seq, nb);
  if (!l1.ok()) return fail(l1.status());
  out.l1_blocks = l1->blocks;
  uint32_t have = l1->blocks;

  // The tail, when the state needs one: for a partial block, or for the window and state at a
  // block edge L1 does not reach (a model that has them).
  std::optional<Tail> tail;
  std::string tail_lost;
  const BlockDigest parent = nb == 0 ? st->root : st->digests[nb - 1];
  const std::span<const TokenId> tail_tokens = tokens.subspan(uint64_t{nb} * bt, state_tokens - uint64_t{nb} * bt);
  if (partial || (has_boundary_pools_ && have < nb)) {
    const BundleKey key{options_.namespace_id, TailKey(parent, st->extra_keys, tail_tokens, state_tokens)};
    std::vector<Result<BundlePtr>> got = chain_.Promote({key}).get();
    Result<Tail> t = got[0].ok() ? ParseTail(*got[0], parent, tail_tokens, state_tokens) : got[0].status();
    if (t.ok()) {
      tail = *std::move(t);
    } else if (t.status().Is(StatusCode::kNotFound)) {
      tail_lost = "tail record " + key.ToString() + " not found";
    } else if (t.status().Is(StatusCode::kNotSupported)) {
      tail_lost = t.status().ToString();  // another cache's pages: logged once per tag
      MutexLock lock(shared_->mu);
      ++shared_->stats.restore_other_pages;
    } else {
      tail_lost = t.status().ToString();
      spdlog::warn("offloaded cache: resume: {}", tail_lost);
      MutexLock lock(shared_->mu);
      ++shared_->stats.restore_rejected;
    }
  }

  bool committed_at_state = false;
  auto count_restored = [&](uint32_t blocks) {
    MutexLock lock(shared_->mu);
    shared_->stats.restored_blocks += blocks;
  };
  // With a tail whose window and state pages cover the edge, each block may come from a whole
  // or a history record, and only the boundary pages the tail holds are allocated.
  const bool edges = tail && has_boundary_pools_ && tail->edges;
  if (have < nb && edges) {
    RestorePlan plan;
    plan.tail = &*tail;
    plan.skip.window_from_block = tail->window_first;
    plan.skip.state_from_block = tail->state_blocks > 0 ? nb - 1 : nb;
    std::vector<BundleKey> whole, hist;
    for (uint32_t b = have; b < nb; ++b) {
      whole.push_back(KeyOf(st->digests[b]));
      hist.push_back(HistoryKey(st->digests[b]));
    }
    // Where a block is, as a rank: on its way to the chain (0), in tier t (t + 1), nowhere.
    constexpr int kNowhere = std::numeric_limits<int>::max();
    auto ranks = [&](const std::vector<BundleKey>& keys) {
      const std::vector<int> at = chain_.Locate(keys);
      const std::vector<bool> pending = IsPending(keys);
      std::vector<int> r(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) r[i] = pending[i] ? 0 : at[i] >= 0 ? at[i] + 1 : kNowhere;
      return r;
    };
    const std::vector<int> rank_whole = ranks(whole), rank_hist = ranks(hist);
    uint32_t absent = nb;
    for (size_t i = 0; i < whole.size(); ++i) {
      // The history record where it is as near as the whole bundle: a thirtieth of the bytes,
      // and the whole one's window and state are not read here anyway (the tail's are).
      const bool use_hist = rank_hist[i] != kNowhere && rank_hist[i] <= rank_whole[i];
      if (!use_hist && rank_whole[i] == kNowhere && absent == nb) absent = have + static_cast<uint32_t>(i);
      plan.keys.push_back(use_hist ? hist[i] : whole[i]);
      plan.history.push_back(use_hist);
    }
    // A block in neither form: the tail cannot be reached, so nothing is read for it.
    const uint32_t n = absent < nb ? 0
                                   : RestoreBlocks(seq, have, std::span<const BlockDigest>(st->digests).subspan(have, nb - have), &plan);
    Status s = n == nb - have ? Status::OK()
                              : Status::NotFound(fmt::format("block {} of {} not found whole or as history in L1 or the chain",
                                                             absent < nb ? absent : have + n, nb));
    // Committed at the state, or not at all: the blocks' own edges are not there to stop at.
    if (s.ok()) s = partial ? RestorePartial(seq, *tail) : manager_.CommitComputed(seq, state_tokens);
    if (s.ok()) {
      out.lower_blocks = n;
      have = nb;
      committed_at_state = true;
      out.tail_restored = true;
      count_restored(n);
    } else {
      Status trim = manager_.TrimSlots(seq);
      if (!trim.ok()) return fail(trim);
      out.lost = s.ToString();
    }
  }
  if (!committed_at_state && have < nb) {
    // Whole bundles only, as for a prefix hit; committed as far as they go.
    const uint32_t n = RestoreBlocks(seq, have, std::span<const BlockDigest>(st->digests).subspan(have, nb - have));
    out.lower_blocks = n;
    have += n;
    if (have < nb) {
      std::string why = fmt::format("block {} of {} not found whole in L1 or the chain", have, nb);
      if (!out.lost.empty()) why += "; with the tail's window and state: " + out.lost;
      if (!tail_lost.empty()) why += "; " + tail_lost;
      out.lost = std::move(why);
    } else {
      out.lost.clear();  // whole bundles reached the state after all
    }
  }
  out.restored_tokens = uint64_t{have} * bt;
  if (committed_at_state) {
    out.restored_tokens = state_tokens;
  } else if (have == nb && partial) {
    Status used = tail ? RestorePartial(seq, *tail) : Status::NotFound(tail_lost);
    if (used.ok()) {
      out.tail_restored = true;
      out.restored_tokens = state_tokens;
    } else {
      if (tail) {  // the allocation failed: what it took goes back
        Status trim = manager_.TrimSlots(seq);
        if (!trim.ok()) return fail(trim);
      }
      out.lost = used.message().empty() ? used.ToString() : std::string(used.message());
    }
  }
  out.recompute_tokens = state_tokens - out.restored_tokens;
  return out;
}

Status OffloadedCache::DropSuspension(const BlockHash& tail) {
  const std::vector<Status> st = chain_.Erase({BundleKey{options_.namespace_id, tail}}).get();
  return st[0];
}

}  // namespace sparsekv
