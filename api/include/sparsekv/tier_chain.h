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
};

class TierChain {
 public:
  // Preconditions: at least one tier.
  TierChain(std::vector<std::unique_ptr<Tier>> tiers, TierChainOptions options);
  ~TierChain();
  TierChain(const TierChain&) = delete;
  TierChain& operator=(const TierChain&) = delete;

  // Per item: OK once the bundle is in the first tier (write-back) or in every tier
  // (write-through: the first error otherwise).
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

  // Erases from every tier. Per item: the first error, or OK.
  std::future<std::vector<Status>> Erase(std::vector<BundleKey> keys);

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
  void PromoteImpl(std::vector<BundleKey> keys, bool onload, bool prefetch,
                   Tier::BundlesCallback done);
  void GetFrom(size_t tier, std::vector<size_t> slots, std::shared_ptr<PromoteState> state);
  void Onload(std::vector<BundlePtr> bundles, bool prefetch);
  void BeginBackground();
  void EndBackground();

  std::vector<std::unique_ptr<Tier>> tiers_;
  const TierChainOptions options_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace sparsekv
