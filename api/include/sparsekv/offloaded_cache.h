// OffloadedCache: a CacheManager (L1) with a TierChain (L2 host DRAM, L3 SSD, RocksDB) under it.
//
// What it does, through the manager's public API only:
//   - Demote (write-through from L1): CommitComputed copies every block that becomes full into a
//     bundle (all kinds of the block, plus the block's verification digest) before committing
//     it, and hands the bundles to the chain in the background. A block evicted from L1 later is
//     thus still in the chain, and a failed demote only means the block is not there.
//   - Lookup: LookupPrefix counts the resumable prefix in L1, then the blocks after it that the
//     chain holds.
//   - Promote (onload): AcquirePrefix attaches the L1 prefix, then fetches the following blocks
//     from the chain, copies every kind into freshly allocated pages and commits them, exactly
//     as an engine commits computed KV; then prefetches the next blocks into the chain's first
//     tier. A bundle that is missing, corrupt (the tiers check XXH3), laid out for another
//     geometry, or whose digest `check` differs (a hash collision) ends the restored prefix.
// Why write-through: the manager's eviction happens inside its allocation, and neither its
// events nor its API hand out the pages of an evicted block before they are reused, so a
// write-back demote (on eviction) needs a hook in the cache manager (see the offload issue
// note); the chain itself supports write-back between its own tiers.
//
// Sequences must be created, fed and freed through this class (it keeps their tokens' digests
// to name bundles); AllocateSlots, GetBlockTable and the rest are called on manager().
//
// Ownership: does not own the manager or the chain; both must outlive it. Thread safety: every
// method is thread-safe; calls on one sequence are ordered by the caller, as with the manager.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>

#include "sparsekv/cache_manager.h"
#include "sparsekv/thread_annotations.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv {

struct OffloadedCacheOptions {
  // Namespace id of the bundles this cache writes: distinct caches sharing tiers use distinct
  // ids. Default: 0.
  uint32_t namespace_id = 0;
  // Copy each block into the chain when it is committed. Default: true.
  bool demote_on_commit = true;
  // Blocks after a restored prefix to prefetch; -1 takes the chain's prefetch_blocks. Default: -1.
  int prefetch_blocks = -1;
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
  uint64_t demote_failures = 0;  // ... that it could not keep
  uint64_t restored_blocks = 0;  // blocks copied back into L1
  uint64_t restore_rejected =
      0;  // bundles found but unusable (corrupt, wrong layout, digest mismatch)
  uint64_t restore_no_room = 0;  // restores given up for want of L1 pages
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
  // CacheManager::CommitComputed, demoting the blocks it makes full.
  Status CommitComputed(SequenceId seq, uint64_t num_tokens) SPARSEKV_EXCLUDES(mu_);
  Status Free(SequenceId seq) SPARSEKV_EXCLUDES(mu_);
  // Read-only: how much of a prompt L1 and the chain hold.
  Result<OffloadedPrefix> LookupPrefix(const PrefixQuery& query);

  // Blocks until background demotes and prefetches are done.
  void WaitIdle();
  OffloadedCacheStats Stats() const SPARSEKV_EXCLUDES(mu_);
  CacheManager& manager() const { return manager_; }
  TierChain& chain() const { return chain_; }

 private:
  struct SequenceState;
  struct Shared;
  BundleKey KeyOf(const BlockDigest& d) const { return BundleKey{options_.namespace_id, d.hash}; }
  // Copies block `block` of `seq` (every pool, then the digest check) into a bundle; nullptr if
  // one of its pages is gone.
  BundlePtr GatherBlock(SequenceId seq, uint32_t block, const BlockDigest& digest,
                        const std::vector<std::vector<PageId>>& tables) const;
  Status CheckLayout(const Bundle& b, const BlockDigest& digest) const;
  uint32_t RestoreBlocks(SequenceId seq, uint32_t first_block,
                         std::span<const BlockDigest> digests);

  CacheManager& manager_;
  TierChain& chain_;
  const OffloadedCacheOptions options_;
  std::shared_ptr<Shared> shared_;
  mutable Mutex mu_;
  std::unordered_map<SequenceId, std::shared_ptr<SequenceState>> sequences_
      SPARSEKV_GUARDED_BY(mu_);
};

}  // namespace sparsekv
