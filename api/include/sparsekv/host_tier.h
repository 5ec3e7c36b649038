// HostTier: the host-DRAM offload tier (L2), bundles in the fixed-size pages of a PagePool.
//
// Each bundle takes one page ("slot") of `slot_bytes`; a bundle whose record is larger is
// refused with InvalidArgument. Stored bundles sit in the pool's LRU of cached pages: a get
// pins the page while it copies and checks the record, then puts it back at the most recently
// used end; a put that finds no free page evicts the least recently used bundle. With an
// eviction listener set, evicted bundles are copied out first and handed over (write-back to
// the next tier). Every operation completes on the caller's thread before the call returns.
// Each slot takes `slot_bytes` rounded up to 4 KiB of memory, so a record in place can be
// handed out as a bundle (GetPinned), padding included.
//
// Ownership: the tier owns its pool. Thread safety: every method is thread-safe; page copies
// run outside the tier's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "sparsekv/page_pool.h"
#include "sparsekv/tier.h"

namespace sparsekv {

struct HostTierOptions {
  // Name used in messages and statistics. Default: "host".
  std::string name = "host";
  // Bytes of host memory for bundles; rounded down to whole slots. Default: 1 GiB.
  uint64_t capacity_bytes = 1ull << 30;
  // Bytes per slot: the largest record stored. The daemon sets it to BundleRecordBytes of the
  // model's block. Default: 0 (must be set).
  uint64_t slot_bytes = 0;
  // What backs the pool (a memfd lets another process map it). Default: kAnonymous.
  ArenaBacking backing = ArenaBacking::kAnonymous;
  // Ask for transparent huge pages. Default: true.
  bool huge_pages = true;
};

class HostTier : public Tier {
 public:
  // Errors: slot_bytes of 0, a capacity below one slot, a pool that cannot be mapped.
  static Result<std::unique_ptr<HostTier>> Open(const HostTierOptions& options);

  // A stored bundle without copying it: checked like any read, and its bytes are the tier's
  // own page, pinned (neither evicted nor reused) until the last owner of the result lets go.
  // The result must not outlive the tier. Errors: NotFound, Corruption (the bundle is dropped).
  // With `check` false only the record's header is checked (its layout can be trusted: no
  // span reaches past it), not its checksum: the caller must call CheckPinned on the result
  // before it trusts the bytes (it may first hand them to the kernel, which brings them into
  // the cache the check then reads from).
  virtual Result<BundlePtr> GetPinned(const BundleKey& key, bool check = true) = 0;
  // Checks a bundle GetPinned(key, false) returned; a damaged one is dropped from the tier and
  // Corruption returned.
  virtual Status CheckPinned(const BundlePtr& bundle, const BundleKey& key) = 0;

  // The pool's memory: its memfd (-1 unless `backing` is kMemfd), first byte and size. Every
  // record lies inside; another process may map the fd to read records handed out pinned.
  struct Arena {
    int fd = -1;
    const std::byte* base = nullptr;
    uint64_t bytes = 0;
  };
  virtual Arena arena() const = 0;

  // Test hook: flips one bit of the stored record of `key` at `offset`.
  virtual Status CorruptForTesting(const BundleKey& key, uint64_t offset) = 0;
};

}  // namespace sparsekv
