// OffloadedCache: a CacheManager (L1) with a TierChain (L2 host DRAM, L3 SSD, RocksDB) under it.
//
// What it does, through the manager's public API and its eviction hook:
//   - Demote, by OffloadedCacheOptions::write_policy:
//       write-through: CommitComputed copies every block that becomes full into a bundle (all
//         kinds of the block, plus the block's verification digest) before committing it, and
//         hands the bundles to the chain in the background. Every committed block reaches the
//         chain, whether or not L1 ever evicts it.
//       write-back: the manager's eviction hook (cache_manager.h) copies a cached block's pages
//         out when an allocation is about to evict it, while they are intact (a memcpy under
//         the manager's lock, nothing more), and a background thread makes bundles of them
//         (header, checksum) and hands them to the chain.
//         Only blocks that leave L1 are written; this covers every cached block of the manager,
//         including those of sequences created on manager() directly. A V4 block whose window or
//         snapshot pages are evicted first is demoted then, complete (unless
//         demote_on_boundary_eviction is false); its later eviction without them demotes its
//         history record (below), so its history survives a dropped or skipped whole demote. A block on its way to the
//         chain stays findable by LookupPrefix and AcquirePrefix. manager().Reset() forgets L1
//         blocks without evicting them: they are not demoted.
//     A demote that cannot complete (a tier full, an I/O error, or too many bytes already
//     waiting: max_pending_demote_bytes) drops the block and is counted; L1 is not affected.
//   - Lookup: LookupPrefix counts the resumable prefix in L1, then the blocks after it that the
//     chain holds.
//   - Promote (onload): AcquirePrefix attaches the L1 prefix, then fetches the following blocks
//     from the chain, copies every kind into freshly allocated pages and commits them, exactly
//     as an engine commits computed KV; then prefetches the next blocks into the chain's first
//     tier. A bundle that is missing, corrupt (the tiers check XXH3), laid out for another
//     geometry, or whose digest `check` differs (a hash collision) ends the restored prefix.
// Durability: under write-back, a block that is only in L1 is lost with the process; a restart
// finds what was evicted (and acknowledged by a persistent tier) before it.
//
// Suspend and resume (issue 35). Suspend saves a running sequence at its computed token P and
// frees its L1 pages: its full blocks (shared with every sequence that has them; those the chain
// lacks are written now), plus one small *tail record* that holds what continuing at exactly P
// needs beyond them. Its key is derived from the tokens (SuspensionKey), so one conversation
// suspended after every turn costs its blocks once plus one tail per live suspension
// (DropSuspension erases an old one).
//
// History-only blocks. A V4 block's sliding-window and compressor-state pages are only needed to
// resume *at* its end, and they are most of its bytes (15.1 of 15.6 MB in deepseek-v4-flash at
// fp8). So the blocks Suspend writes carry only the full-history kinds (latent/compressed
// entries, indexer keys): a *history record*, with those segments empty, filed under
// HistoryKey(digest), a key of its own so that a lookup never takes one for a resume point. The
// window and state at P go in the tail instead. (Models without such pools, V3.2, write
// ordinary bundles: a history record would be the same bytes.) The blocks that write-through
// and write-back demote stay whole, so any block edge they cover is a prefix hit.
//
// Resume rebuilds a sequence from the tokens: the longest exact prefix from L1 and the chain,
// then the tail; whatever is missing or damaged ends the exact state there, and the result says
// how many tokens must be computed again. With the tail, each block may come from a whole or a
// history record, and the L1 pages of blocks whose window or state nobody reads are not even
// allocated (CacheManager::AllocateRestoreSlots), so a 1M-token V4 sequence resumes into an L1
// sized for its history. Without a usable tail, only whole records count, up to the last block
// edge they make resumable.
//
// The tail record's layout (little-endian), segments of one bundle:
//   0  header (64 bytes): u32 magic "SKVT", u16 version 2, u16 pools, u32 block_tokens, u32 tail
//      tokens, u64 state tokens P, 16-byte check of the parent block's digest (the root's for
//      P < one block), u64 XXH3 of the pools' block strides, u32 first window block w, u32
//      window blocks, u32 state blocks (0 or 1), u32 0
//   1  the tail tokens, i32 each
//   2.. one page per pool for the block P falls in, only when P is not a multiple of
//      block_tokens (the partial block's entries, its window rows, the compressor's running
//      state at P)
//   .. then, for each sliding-window pool in pool order, its pages of the full blocks
//      [w, P / block_tokens) that the window at P reaches into, and for each compressor-state
//      pool, when P is a block edge, its page of the block before P (the snapshot there)
// Version 1 (no window or state blocks, a 48-byte header) is still read: its blocks were whole.
// Durability: Suspend returns once the chain has acknowledged the tail and the blocks it wrote
// (the chain's Demote: the first tier under write-back, every tier under write-through).
//
// Sequences must be created, fed and freed through this class (it keeps their tokens' digests
// to name bundles); AllocateSlots, GetBlockTable and the rest are called on manager().
//
// Ownership: does not own the manager or the chain; both must outlive it. Under write-back it
// installs the manager's eviction hook for its lifetime (one per manager: do not put two
// write-back caches, or another hook, on one manager); the destructor removes the hook, then
// waits for the demotes in flight. Thread safety: every method is thread-safe; calls on one
// sequence are ordered by the caller, as with the manager. Lock order: the manager's lock (the
// hook runs under it), then this class's; it never calls the manager holding its own locks.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sparsekv/cache_manager.h"
#include "sparsekv/thread_annotations.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv {
namespace offload {
class WorkerPool;
}

struct OffloadedCacheOptions {
  // Namespace id of the bundles this cache writes: distinct caches sharing tiers use distinct
  // ids. Default: 0.
  uint32_t namespace_id = 0;
  // When L1 blocks are copied into the chain (see the top): kWriteThrough on commit, kWriteBack
  // on eviction. (The chain's own TierChainOptions::write_policy says how a demoted block
  // moves between the tiers below.) Default: kWriteThrough.
  WritePolicy write_policy = WritePolicy::kWriteThrough;
  // Write-back: bytes of evicted blocks copied out and not yet stored by the chain. An eviction
  // that would go past it is dropped (demote_backlog_drops), so a slow tier costs hits, not
  // memory. Default: 256 MiB.
  uint64_t max_pending_demote_bytes = 256ull << 20;
  // Write-back: free pages kept in every full-history pool (at most a quarter of the smallest)
  // by evicting blocks ahead of need on the demote thread (CacheManager::EvictAhead), which
  // copies their pages off the manager's lock. An allocation that still has to evict (one
  // larger than the reserve, or faster than the demote thread) copies under the lock, as
  // with 0 (off). Default: 8.
  uint32_t evict_ahead_blocks = 8;
  // Write-back: when L1 evicts only a block's sliding-window or compressor-state pages (the block
  // stays, a prefix but no resume point), demote the whole block first, so that its edge stays a
  // resume point in the tiers. For V4 that is the block's full size (15.6 MB in
  // deepseek-v4-flash at fp8, against 0.5 MB of history) for every block a long sequence
  // leaves behind; false skips those demotes (counted in boundary_evictions_not_demoted), and
  // the block's history is still demoted when the block itself is evicted (a history record) or
  // its sequence suspended. Default: true.
  bool demote_on_boundary_eviction = true;
  // Blocks after a restored prefix to prefetch; -1 takes the chain's prefetch_blocks. Default: -1.
  int prefetch_blocks = -1;
  // Threads copying a restore into the L1 pages (checking host-tier records as they land) and
  // a write-through store out of them (hashing as it copies): the caller and
  // restore_threads - 1 of the cache's own, for 2 blocks or more. Copy and hash together are
  // compute-bound per thread; one thread does not saturate memory. Clamped to [1, 16].
  // Default: 2.
  uint32_t restore_threads = 2;
};

struct OffloadedPrefix {
  uint32_t l1_blocks = 0;  // resumable prefix found in L1
  uint32_t lower_blocks =
      0;  // blocks after it held (LookupPrefix) or restored (AcquirePrefix) from the chain
  uint32_t blocks = 0;  // l1_blocks + lower_blocks
  uint64_t tokens = 0;  // blocks * block_tokens
};

struct OffloadedCacheStats {
  uint64_t demoted_blocks = 0;   // blocks handed to the chain
  uint64_t demote_failures = 0;  // ... that it could not keep (tier full, I/O error): dropped
  uint64_t evicted_demoted = 0;  // write-back: evicted blocks copied out for the chain
  uint64_t evicted_ahead = 0;    // ... of which evicted ahead of need, copied off the lock
  // Write-back: seconds the demote thread spent in CacheManager::EvictAhead (the manager's lock
  // held for the bookkeeping of those evictions, and waiting for it).
  double evict_ahead_seconds = 0;
  // Write-back: evictions that lacked a kind and were not demoted: the window or snapshot
  // pages of a block that had already lost some of them.
  uint64_t evicted_incomplete = 0;
  // Write-back: evictions of a block whose window or state pages went earlier, demoted as a
  // history record (its full-history kinds; HistoryKey).
  uint64_t evicted_history = 0;
  // Write-back: evictions of a block's window or state pages alone that were not demoted
  // (demote_on_boundary_eviction false).
  uint64_t boundary_evictions_not_demoted = 0;
  // Write-back: evicted blocks dropped because max_pending_demote_bytes were already waiting.
  uint64_t demote_backlog_drops = 0;
  // Write-back: record bytes of the blocks copied out and not yet stored by the chain (now).
  uint64_t pending_demote_bytes = 0;
  uint64_t restored_blocks = 0;       // blocks copied back into L1
  // Bundles found but unusable (corrupt, wrong layout, digest mismatch).
  uint64_t restore_rejected = 0;
  // Bundles found that hold other pages than this cache's (another storage format, model or
  // layout: their pages tag differs, bundle.h): misses, never decoded, left in the tiers.
  uint64_t restore_other_pages = 0;
  // Bundles read that carry no pages tag (written before it was recorded), taken for this
  // cache's pages by their sizes alone.
  uint64_t restore_untagged = 0;
  uint64_t restore_no_room = 0;  // restores given up for want of L1 pages
};

struct SuspendInfo {
  BlockHash tail;             // the tail record's key (namespace OffloadedCacheOptions::namespace_id)
  uint64_t tokens = 0;        // state tokens: the sequence's computed tokens when suspended
  uint32_t blocks = 0;        // full blocks the state covers
  uint32_t written_blocks = 0;  // of those, written to the chain by this call (the rest were there)
  // Blocks the chain lacked that could not be written (a page of a full-history pool missing
  // from the sequence: never, short of a bug): a resume recomputes from the first.
  uint32_t unsaved_blocks = 0;
  uint32_t history_blocks = 0;  // of written_blocks, those written as history records
  uint64_t tail_bytes = 0;      // the tail record's bytes
  uint64_t written_bytes = 0;   // record bytes written by this call, tail included
};

struct ResumeInfo {
  SequenceId seq = 0;           // the resumed sequence (tokens appended, state restored)
  uint64_t tokens = 0;          // tokens appended
  uint64_t state_tokens = 0;    // the suspended state asked for
  uint64_t restored_tokens = 0;  // computed tokens after the resume: exact up to here
  uint64_t recompute_tokens = 0;  // state_tokens - restored_tokens (0 when all was found)
  uint32_t l1_blocks = 0;       // blocks found in L1
  uint32_t lower_blocks = 0;    // blocks restored from the chain
  // The tail record was used: for the partial block, or for the window and state at a block
  // edge that L1 could not give (V4 blocks restored from history records).
  bool tail_restored = false;
  std::string lost;             // what ended the exact state early, when recompute_tokens > 0
};

class OffloadedCache {
 public:
  OffloadedCache(CacheManager& manager, TierChain& chain, OffloadedCacheOptions options = {});
  ~OffloadedCache();
  OffloadedCache(const OffloadedCache&) = delete;
  OffloadedCache& operator=(const OffloadedCache&) = delete;

  Result<SequenceId> CreateSequence(const SequenceOptions& options = {}) SPARSEKV_EXCLUDES(mu_);
  Status AppendTokens(SequenceId seq, std::span<const TokenId> tokens) SPARSEKV_EXCLUDES(mu_);
  // CacheManager::AcquireCachedPrefix, then the restore from the chain (see the top).
  Result<OffloadedPrefix> AcquirePrefix(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  // CacheManager::CommitComputed; under write-through, demoting the blocks it makes full.
  Status CommitComputed(SequenceId seq, uint64_t num_tokens) SPARSEKV_EXCLUDES(mu_);
  Status Free(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  // Read-only: how much of a prompt L1 and the chain hold.
  Result<OffloadedPrefix> LookupPrefix(const PrefixQuery& query);
  // The digests of the sequence's full blocks so far, in order: what its bundles are filed
  // under ({namespace_id, digest.hash}), and what an engine files other records of the same
  // blocks under (sparse records, sparse_offload.h). Errors: NotFound (no such sequence).
  Result<std::vector<BlockDigest>> BlockDigests(SequenceId seq) const SPARSEKV_EXCLUDES(mu_);

  // ---- suspend and resume (see the top) ----
  // Saves `seq` at its computed tokens and frees it. Errors: NotFound; FailedPrecondition for a
  // sequence created with cache_blocks false; a chain error (the sequence is then left as it
  // was, not freed).
  Result<SuspendInfo> Suspend(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  // A new sequence with `tokens` appended and the state suspended at `state_tokens` of them
  // restored as far as it is found exact. Errors: state_tokens > tokens.size() (InvalidArgument),
  // those of CreateSequence and AppendTokens. Not finding (or rejecting) a block or the tail is
  // not an error: see ResumeInfo::recompute_tokens and lost.
  Result<ResumeInfo> Resume(const SequenceOptions& options, std::span<const TokenId> tokens,
                            uint64_t state_tokens) SPARSEKV_EXCLUDES(mu_);
  // The key a history record of that block is filed under (namespace_id of the options).
  BundleKey HistoryKey(const BlockDigest& digest) const;
  // The tail record's key for that state (what Suspend returned for it).
  Result<BlockHash> SuspensionKey(const SequenceOptions& options, std::span<const TokenId> tokens,
                                  uint64_t state_tokens) const;
  // The largest tail record of this geometry: a tier refusing records above it (its
  // max_record_bytes) refuses some suspensions.
  uint64_t max_tail_record_bytes() const { return max_tail_record_bytes_; }
  // Erases a tail record from every tier (its blocks stay: other sequences may share them).
  Status DropSuspension(const BlockHash& tail);

  // Evicts cached blocks no sequence holds, least recently used first, until every
  // full-history pool has `free_pages` free pages or `max_blocks` have gone; returns how many
  // left L1. Under write-back each is copied out for the chain first, off the manager's lock
  // (stopping early while max_pending_demote_bytes are waiting); under write-through the chain
  // was handed it when it was committed. Events and statistics are those of an eviction.
  uint32_t Evict(uint32_t free_pages, uint32_t max_blocks = UINT32_MAX) SPARSEKV_EXCLUDES(evict_mu_);

  // Blocks until background demotes and prefetches are done (those of evictions that happen
  // meanwhile too).
  void WaitIdle();
  OffloadedCacheStats Stats() const SPARSEKV_EXCLUDES(mu_);
  CacheManager& manager() const { return manager_; }

  // What a bundle's pages are (bundle.h, "pages tag"): the model's name, the block layout and,
  // per pool, the cache kind, storage format, dims, ratio, layers and page strides, as one line
  // of text. Two caches read each other's bundles only when these agree.
  static std::string PagesDescription(std::string_view model, const BlockGeometry& geometry);
  // The tag of a description: the low 32 bits of its XXH3-64, never 0.
  static uint32_t PagesTag(std::string_view description);
  // This cache's: every bundle, history and tail record it writes carries pages_tag().
  uint32_t pages_tag() const { return pages_tag_; }
  const std::string& pages_description() const { return pages_description_; }
  TierChain& chain() const { return chain_; }

 private:
  struct SequenceState;
  struct Staged;
  struct SparePool;
  struct Shared;
  struct Held;
  struct Tail;
  struct RestorePlan;
  // The sequence's state; NotFound when this cache does not know it.
  Result<std::shared_ptr<SequenceState>> FindSequence(SequenceId seq) const SPARSEKV_EXCLUDES(mu_);
  BundleKey KeyOf(const BlockDigest& d) const { return BundleKey{options_.namespace_id, d.hash}; }
  // Copies block `block` of `seq` (every pool, then the digest check) into a bundle; nullptr if
  // one of its pages is gone.
  BundlePtr GatherBlock(SequenceId seq, uint32_t block, const BlockDigest& digest,
                        const std::vector<std::vector<PageId>>& tables, bool into_host) const;
  // The same from one page per pool; nullptr if one is missing. With `into_host` and a host
  // tier first in the chain, the record is stored there as it is gathered
  // (HostTier::PutGathered) and returned pinned there: only for a bundle demoted next. With
  // `history`, a history record instead: the full-history pools' pages only (the others'
  // segments empty), filed under HistoryKey.
  BundlePtr GatherPages(const BlockDigest& digest, std::span<const PageId> pages, bool into_host,
                        bool history = false) const;
  // Runs range(from, to) over [0, count) split between the caller and the restorers (one part
  // each), and returns when every part has.
  void RunSplit(uint32_t count, const std::function<void(uint32_t, uint32_t)>& range) const;
  // Write-back: the manager's eviction hook (runs under the manager's lock): copies the block's
  // pages out and queues them.
  void OnEvict(const EvictingBlock& block);
  // Write-back: a staged block as a bundle; nullptr if Bundle refuses the sizes.
  BundlePtr BundleOf(const Staged& staged) const;
  // Write-back: makes bundles of what the hook queued and hands them to the chain (on the
  // demote thread).
  void DrainEvicted();
  // Write-back: runs EvictAhead on the demote thread unless it is already due to.
  void ScheduleEvictAhead();
  // Write-back (demote thread): evicts blocks ahead of need until every full-history pool has
  // evict_ahead_blocks free pages, storing each from its pages into the chain.
  void EvictAhead() SPARSEKV_EXCLUDES(evict_mu_);
  // Write-back: EvictAhead's work for any target (the demote thread's, or Evict's); returns
  // the blocks evicted.
  uint32_t EvictBlocks(uint32_t free_target, uint32_t max_blocks) SPARSEKV_REQUIRES(evict_mu_);
  // Write-back: ends a scheduled EvictAhead run (runs it again if asked meanwhile).
  void FinishEvictAhead();
  // Hands bundles to the chain; the caller has counted them in flight.
  void Demote(std::vector<BundlePtr> bundles, bool evicted);
  // Per key: the bundle on its way to the chain (write-back), or nullptr.
  std::vector<BundlePtr> PendingBundles(std::span<const BundleKey> keys) const;
  // Per key: whether it is on its way to the chain (write-back), without making its bundle.
  std::vector<bool> IsPending(std::span<const BundleKey> keys) const;
  // How many leading keys the chain holds or has on the way.
  size_t CountLower(std::span<const BundleKey> keys) const;
  // A whole bundle of this geometry, or with `history` a history record, of block `digest`.
  Status CheckLayout(const Bundle& b, const BlockDigest& digest, bool history = false) const;
  // Copies blocks [first_block, first_block + digests.size()) from L1's pending copies and the
  // chain into the sequence and returns how many leading ones were restored. Without a plan:
  // whole bundles, committed. With one: its keys, its skipped boundary pages, the window and
  // state pages from its tail, and no commit (the caller commits at the tail's state or trims).
  uint32_t RestoreBlocks(SequenceId seq, uint32_t first_block,
                         std::span<const BlockDigest> digests, const RestorePlan* plan = nullptr);
  // The tail key for tokens [0, state_tokens) given the digests of their full blocks.
  BlockHash TailKey(const BlockDigest& parent, std::string_view extra_keys,
                    std::span<const TokenId> tail_tokens, uint64_t state_tokens) const;
  // Checks a tail record against the state it should hold; an error says why it is unusable.
  Result<Tail> ParseTail(BundlePtr b, const BlockDigest& parent, std::span<const TokenId> tail_tokens,
                         uint64_t state_tokens) const;
  // Copies the tail's partial block into the sequence's block `state_tokens / block_tokens`
  // (allocated here) and commits up to state_tokens; an error says why not (nothing committed).
  Status RestorePartial(SequenceId seq, const Tail& tail);
  bool has_boundary_pools_ = false;   // the model keeps sliding-window or compressor-state pools
  uint32_t window_blocks_ = 0;        // ceil(window_tokens / block_tokens)
  uint64_t geometry_fingerprint_ = 0;
  uint64_t max_tail_record_bytes_ = 0;
  std::string pages_description_;
  uint32_t pages_tag_ = 0;
  // The presets (every precision, this block size) whose pages have this cache's sizes but
  // another tag: what an untagged record might really hold, for the log.
  std::string same_size_presets_;
  // Pages tags of the presets (every precision, this block size) and what they are: names what
  // a record of other pages holds, in the log.
  std::vector<std::pair<uint32_t, std::string>> known_tags_;
  // Reports a record of other pages (once per tag) or without a tag (once); returns the error
  // for the former.
  Status OtherPages(const Bundle& b, std::string_view what) const;
  void NoteUntagged() const;

  CacheManager& manager_;
  TierChain& chain_;
  const OffloadedCacheOptions options_;
  std::shared_ptr<Shared> shared_;
  uint64_t block_record_bytes_ = 0;   // record bytes of one block's bundle
  uint64_t history_record_bytes_ = 0;  // ... and of its history record
  uint64_t block_payload_bytes_ = 0;  // its segments' bytes: every pool's page and the check
  uint32_t evict_ahead_target_ = 0;   // write-back: free pages EvictAhead keeps; 0: off
  static constexpr uint32_t kEvictAheadBatch = 4;  // blocks held at a time
  // Blocks a restore asks the chain for at a time (chunks copied in order as they land).
  static constexpr size_t kRestoreChunkBlocks = 8;
  // Chunks a restore has asked for beyond the one it copies.
  static constexpr size_t kReadAheadChunks = 8;
  bool gather_into_host_ = false;     // EvictAhead gathers straight into a large host tier
  std::shared_ptr<SparePool> spare_;  // write-back: staging buffers kept for reuse
  std::unique_ptr<offload::WorkerPool> demoter_;  // write-back only
  std::unique_ptr<offload::WorkerPool> restorers_;  // restore_threads - 1 threads, or none
  mutable Mutex mu_;
  // Write-back: one EvictBlocks at a time (the demote thread's and Evict's callers'). Taken
  // before the manager's lock.
  Mutex evict_mu_;
  std::unordered_map<SequenceId, std::shared_ptr<SequenceState>> sequences_
      SPARSEKV_GUARDED_BY(mu_);
};

}  // namespace sparsekv
