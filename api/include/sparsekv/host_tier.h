// HostTier: the host-DRAM offload tier (L2): records in one arena, allocated by the byte.
//
// Each bundle's record takes a contiguous extent of 4 KiB units of the arena (its size rounded
// up to 4 KiB, so a record in place can be handed out as a bundle with its padding, GetPinned),
// so a 64 KiB value takes 64 KiB whatever the largest bundle is: any mix of sizes fills the
// arena before the first eviction. A put that does not fit evicts the eviction policy's victims
// (never one being read; hinted ones last) until a free extent holds it; with an eviction listener set, evicted
// bundles are copied out first and handed over (write-back to the next tier). A put never
// replaces a copy with a larger sequence (tier.h). Every operation completes on the caller's
// thread before the call returns.
//
// Ownership: the tier owns its arena. Thread safety: every method is thread-safe; record
// copies into and out of the arena run outside the tier's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsekv/eviction_policy.h"
#include "sparsekv/page_pool.h"
#include "sparsekv/tier.h"

namespace sparsekv {

struct HostTierOptions {
  // Name used in messages and statistics. Default: "host".
  std::string name = "host";
  // Bytes of host memory for bundles; rounded down to 4 KiB. Default: 1 GiB.
  uint64_t capacity_bytes = 1ull << 30;
  // The largest record accepted; larger ones are refused with InvalidArgument. 0: the
  // capacity. Default: 0.
  uint64_t max_record_bytes = 0;
  // What backs the pool (a memfd lets another process map it). Default: kAnonymous.
  ArenaBacking backing = ArenaBacking::kAnonymous;
  // Ask for transparent huge pages. Default: true.
  bool huge_pages = true;
  // Fault the whole arena in at Open (MAP_POPULATE): the kernel zeroes every page then, not on
  // the first put that lands there (on a VM, zeroing a fresh page costs more than the put's own
  // copy). Default: false.
  bool populate = false;
  // Which bundle a put that does not fit evicts first (eviction_policy.h). Default: the
  // library's default policy (kDefaultEvictionPolicy).
  EvictionPolicyKind eviction = kDefaultEvictionPolicy;
  // At most this share of the capacity, in record bytes, is protected by hints (Tier::Hint).
  // From 0 to 1. Default: 0.5.
  double hint_bound = 0.5;
};

class HostTier : public Tier {
 public:
  // Errors: a capacity below 4 KiB, a max_record_bytes above the capacity or below a header,
  // an arena that cannot be mapped.
  static Result<std::unique_ptr<HostTier>> Open(const HostTierOptions& options);

  // A stored bundle without copying it: checked like any read, and its bytes are the tier's
  // own page, pinned (neither evicted nor reused) until the last owner of the result lets go.
  // The result must not outlive the tier. Errors: NotFound, Corruption (the bundle is dropped).
  // With `check` false only the record's header is checked (its layout can be trusted: no
  // span reaches past it), not its checksum: the caller must call CheckPinned on the result
  // before it trusts the bytes (it may first hand them to the kernel, which brings them into
  // the cache the check then reads from).
  virtual Result<BundlePtr> GetPinned(const BundleKey& key, bool check = true) = 0;
  // Stores a new version of `key` gathered straight from `segments` (the record Bundle::Make
  // would build, written into the tier's memory in one copy-and-hash pass, no bundle in
  // between) and returns it pinned, as GetPinned does: a write-through store hands that to the
  // chain, whose put of it here then changes only its recency, and the tiers below write from
  // this memory. Evictions it causes go to the eviction listener as a put's do. Errors: as
  // Bundle::Make, a record above max_record_bytes, no room (ResourceExhausted), a newer
  // version of `key` already held (FailedPrecondition: nothing stored). `pages`: the record's
  // pages tag (bundle.h).
  virtual Result<BundlePtr> PutGathered(const BundleKey& key,
                                        std::span<const std::span<const std::byte>> segments,
                                        uint64_t sequence, uint32_t pages = 0) = 0;
  // A write lease's room (api/PROTOCOL.md, PUT_LEASE): an extent holding the header of `key`'s
  // new version `sequence` (one segment of `payload_bytes`), whose payload a writer outside the
  // tier fills in place. Nothing is findable until CommitReserved has checked it; meanwhile the
  // extent is neither evicted nor reused. Each reservation ends exactly once: CommitReserved or
  // AbortReserved. Errors: as PutGathered (too large, no room, a newer version held).
  struct Reservation {
    uint64_t id = 0;            // the tier's entry
    std::byte* record = nullptr;  // the record's first byte (its header)
    uint64_t record_bytes = 0;  // header + payload
    uint64_t header_bytes = 0;
  };
  virtual Result<Reservation> Reserve(const BundleKey& key, uint64_t payload_bytes, uint64_t sequence) = 0;
  // Checks the reserved record against what Reserve wrote (its header, byte for byte, computed
  // again here, never parsed from the shared bytes) and its bytes against `checksum` (the
  // record's XXH3-64, bundle.h), then publishes it and returns it pinned, as PutGathered does.
  // Errors, with the extent freed and nothing published: Corruption (a header or checksum
  // mismatch: a torn or forged write), FailedPrecondition (a newer version landed meanwhile).
  // With `resequence` (a sequence newer than the reservation's, 0: none), the version takes it,
  // as if put now, and the header is written again: only for a record the daemon wrote itself,
  // with `checksum` 0 (a writer that followed the header Reserve wrote would not match it).
  virtual Result<BundlePtr> CommitReserved(const Reservation& r, uint64_t checksum, uint64_t resequence = 0) = 0;
  // Gives a reservation's extent back, unpublished.
  virtual void AbortReserved(const Reservation& r) = 0;
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

  // Local reads (api/PROTOCOL.md, "Local reads"): with a memfd arena, the tier keeps a table of
  // one u32 per 4 KiB unit of the arena, in a memfd of its own, and adds 1 to a record's entry
  // (at its first unit) whenever the record leaves the index (erased, replaced, evicted, found
  // damaged), before its room can be reused. A reader in another process that saw entry value
  // v before copying a record and still sees v after knows the record was the key's copy all
  // along. The table is written only here, under the tier's lock, each change followed by a full
  // fence; an entry stops at its largest value. fd -1 (no table) unless the arena is a memfd.
  virtual Arena lend_table() const = 0;
  // For a bundle GetPinned just returned: when it is still `key`'s copy in the index, its entry
  // in the lend table plus 1 (a token; the entry is read under the same lock that changes it);
  // else 0 (a token of 0 is never valid). Also 0 without a table, or when the entry is at its
  // largest value (where it stays: that unit is not lent for local reads again).
  virtual uint32_t LendToken(const BundleKey& key, const BundlePtr& bundle) = 0;
  // Reads made elsewhere from records lent before (local reads): each key the tier holds counts
  // as read now for its eviction order and its statistics (hits, bytes read). Unknown keys are
  // skipped. Returns how many it holds and their records' bytes.
  struct Touched {
    uint64_t items = 0;
    uint64_t bytes = 0;
  };
  virtual Touched TouchRead(std::span<const BundleKey> keys) = 0;

  // The keys of the bundles held now, roughly in the order they would be evicted.
  virtual std::vector<BundleKey> Keys() const = 0;
  // The eviction order's own check (the policy's lists, the protected bytes): for tests.
  virtual Status CheckEviction() const = 0;

  // Test hook: flips one bit of the stored record of `key` at `offset`.
  virtual Status CorruptForTesting(const BundleKey& key, uint64_t offset) = 0;
};

}  // namespace sparsekv
