// TierChain: offload tiers stacked fastest first (host DRAM, SSD, RocksDB), moved between as a
// cache manager needs: demote what L1 evicts, find which tier holds a block, promote hits back.
//
// Demote writes a batch to the first tier (write-back) or to every tier (write-through). Under
// write-back, what a tier evicts goes on to the next tier in the background (tiers that hand
// over evicted bundles: the host tier), so a block leaves the chain only when the last tier
// evicts it. A demote that cannot complete (tier full, I/O error) drops the block cleanly and
// is counted; nothing else is affected. While a bundle is on its way down it stays findable.
//
// Locate says which tier holds each key; CountPrefix how many leading keys of a prefix the chain
// holds. Promote fetches each key from the fastest tier that holds it; a corrupt or failed read
// falls through to the next tier holding a copy; a hit below the first tier is copied into the
// first tier in the background (onload). Prefetch does the same without returning the bundles.
//
// Versions. The rule: a key's value is its last acknowledged Demote; after an acknowledged Erase
// it is not found. Every bundle carries a sequence (bundle.h) that NextSequence hands out in
// increasing order, resumed after a restart from the largest sequence the tiers hold. No tier
// lets a copy replace a newer one (tier.h). A Demote is acknowledged only once no tier it did
// not write keeps an older copy (EraseOlder, durable in the durable tiers; a copy of the key on
// its way down is waited for first, so a crash cannot leave it behind); an Erase likewise, for
// every tier. While a write or a background copy (write-back move, onload, prefetch) of a key is
// in flight, the chain remembers the newest sequence written or erased for it, and a read that
// finds an older copy skips it as stale (counted) and falls through, so no interleaving of
// background copies with new writes returns an older version. Unversioned bundles
// (sequence 0) take no part: they neither invalidate nor are invalidated by one another.
//
// Remote tiers (Tier::remote(), a cluster other machines share) come last. Every Demote also
// writes its bundles to them in the background (write-behind, whatever the write policy); the
// Demote is acknowledged by the local tiers alone, and nothing on a write's path waits for the
// remote tier. Until that copy lands, and for good if it fails, the key's newer version is
// remembered, so a read never takes an older copy from the remote tier. Evicted bundles are
// not moved into it (the write-behind put them there). A read asks the local tiers, and reads
// the remote tier straight away for the keys none holds; Locate and CountPrefix ask it too.
// Erase erases there as well; a remote failure is not an error (its nodes fail as misses) but
// keeps the key's version remembered. With a remote tier, sequences come from the clock
// (max(last + 1, microseconds since the epoch)), so versions written by different chains order
// by when they were written.
//
// Ownership: the chain owns its tiers. Destruction waits for the background work. Thread
// safety: every method is thread-safe; callbacks run on tier threads or the caller's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "sparsekv/tier.h"

namespace sparsekv {
namespace offload {
class WorkerPool;
}  // namespace offload

enum class WritePolicy : uint8_t {
  kWriteBack = 0,  // demote into the first tier; its evictions flow down
  kWriteThrough,   // demote into every tier at once
};
std::string_view WritePolicyName(WritePolicy p);
Result<WritePolicy> ParseWritePolicy(std::string_view name);  // "write-back", "write-through"

struct TierChainOptions {
  // Default: kWriteBack.
  WritePolicy write_policy = WritePolicy::kWriteBack;
  // Copy a hit below the first tier into the first tier. Default: true.
  bool promote_into_first_tier = true;
  // Blocks after a promoted prefix a cache manager should prefetch. Default: 4.
  uint32_t prefetch_blocks = 4;
};

struct TierChainStats {
  uint64_t demoted = 0;         // bundles demoted into the chain
  uint64_t demote_dropped = 0;  // demotes (or write-back moves) that failed: the block was dropped
  uint64_t cascaded = 0;        // evicted bundles moved to the next tier
  uint64_t promoted = 0;        // bundles returned by Promote
  uint64_t promote_misses = 0;  // keys Promote found nowhere
  uint64_t fallbacks = 0;       // reads that failed in one tier and were served by a lower one
  uint64_t onloaded = 0;        // bundles copied into the first tier after a lower-tier hit
  uint64_t prefetched = 0;      // bundles Prefetch brought into the first tier
  uint64_t in_flight = 0;       // background writes not finished
  uint64_t stale_skipped = 0;   // copies a read found older than the key's newest version
  uint64_t invalidated = 0;     // older copies erased from tiers a new version did not reach
  uint64_t invalidate_failures = 0;  // erasures of older copies that failed (the write failed)
  uint64_t written_behind = 0;       // bundles written to a remote tier behind a demote
  uint64_t write_behind_failures = 0;  // ... that failed (a node down, the queue full): reads skip
                                       // an older copy there
  uint64_t stale_keys = 0;  // keys some tier may hold an older copy of, after such failures:
                            // reads skip it there until the repair erases it
  uint64_t repaired = 0;    // such copies the repair erased (once their tier answered again)
};

class TierChain {
 public:
  // Preconditions: at least one tier; remote tiers after every local one, and a local one.
  TierChain(std::vector<std::unique_ptr<Tier>> tiers, TierChainOptions options);
  ~TierChain();
  TierChain(const TierChain&) = delete;
  TierChain& operator=(const TierChain&) = delete;

  // A sequence larger than every one handed out before, and than every sequence the tiers held
  // when the chain was made: stamp each new version with one (Bundle::Make).
  uint64_t NextSequence();

  // Per item: OK once the bundle is in the first tier (write-back) or in every tier
  // (write-through: the first error otherwise), and no other tier holds an older copy of its
  // key (the error of that erasure otherwise).
  void DemoteAsync(std::vector<BundlePtr> bundles, Tier::StatusesCallback done);
  std::future<std::vector<Status>> Demote(std::vector<BundlePtr> bundles);

  // Index of the fastest tier holding each key, or -1.
  std::vector<int> Locate(std::span<const BundleKey> keys);
  // The number of leading keys the chain holds.
  size_t CountPrefix(std::span<const BundleKey> keys);

  // Per item: the bundle, NotFound, or the last tier's error when every copy failed.
  void PromoteAsync(std::vector<BundleKey> keys, Tier::BundlesCallback done);
  std::future<std::vector<Result<BundlePtr>>> Promote(std::vector<BundleKey> keys);
  // Brings keys held below the first tier into it, in the background.
  void Prefetch(std::vector<BundleKey> keys);

  // Erases from every tier, as a version of its own: a copy of the key on its way down is waited
  // for and erased too, and a background copy landing later is erased again. Per item: the
  // first error, or OK. May block the caller while such a copy lands.
  std::future<std::vector<Status>> Erase(std::vector<BundleKey> keys);

  // Whether a copy of `key` with `sequence` is older than the newest version the chain knows
  // of (a read that bypasses Promote, such as the daemon's in-place host reads, checks this).
  bool IsStale(const BundleKey& key, uint64_t sequence) const;

  // Blocks until no background write is in flight.
  void WaitIdle();

  size_t tier_count() const { return tiers_.size(); }
  Tier& tier(size_t i) const { return *tiers_[i]; }
  const TierChainOptions& options() const { return options_; }
  TierChainStats Stats() const;

 private:
  struct Shared;
  struct PromoteState;
  void Cascade(size_t from_tier, std::vector<BundlePtr> evicted);
  // Writes a demote's bundles to the remote tiers in the background.
  void WriteBehind(const std::vector<BundlePtr>& bundles);
  // Locate over tiers [0, tier_end).
  std::vector<int> LocateIn(std::span<const BundleKey> keys, size_t tier_end);
  // Erases copies older than each bundle from the tiers that do not hold it (stored[i][t] says
  // which do), then calls done with `st` updated; may hand the work to the chain's worker.
  void Invalidate(std::vector<BundlePtr> bundles, std::vector<std::vector<bool>> stored,
                  std::vector<Status> st, Tier::StatusesCallback done);
  // The worker: every demote waiting to invalidate, one erase per tier for all of them.
  void DrainInvalidations();
  // After a background copy landed in `tier`: erases it again where a newer version was written
  // or erased meanwhile, then drops the copies' references on their keys' versions.
  void SettleBackground(size_t tier, const std::vector<BundlePtr>& landed,
                        const std::vector<Status>& st);
  void WaitNotMoving(const std::vector<BundleKey>& keys);
  void PromoteImpl(std::vector<BundleKey> keys, bool onload, bool prefetch,
                   Tier::BundlesCallback done);
  void GetFrom(size_t tier, std::vector<size_t> slots, std::shared_ptr<PromoteState> state);
  void Onload(std::vector<BundlePtr> bundles, bool prefetch);
  void BeginBackground();
  void EndBackground();
  // Erases, on the worker, the older copies tiers were left holding after failures (see
  // Shared::stale); started by demotes, reads and erases when Shared::StartRepairLocked says.
  void StartRepair();
  void RepairStale();

  std::vector<std::unique_ptr<Tier>> tiers_;
  const TierChainOptions options_;
  size_t local_ = 0;              // tiers before the first remote one
  bool clock_sequences_ = false;  // a remote tier: sequences from the clock
  std::shared_ptr<Shared> shared_;
  // Runs invalidations that must wait (for a copy on its way down, for tier I/O) off the tier
  // threads that complete puts.
  std::unique_ptr<offload::WorkerPool> worker_;
};

}  // namespace sparsekv
