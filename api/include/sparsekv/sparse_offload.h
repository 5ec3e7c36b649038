// Sparse-aware offload (issue 18): the cache the sparse kernel reads (V3.2's MLA latent, V4's
// CSA entries) stays in a lower tier, and each decode step brings into L1 only the entries the
// indexer selected that are not already there.
//
// - A sparse record is how one block of that cache is offloaded, laid out so that any one entry
//   can be read and checked alone, from memory or as one 4 KiB sector of a file. Its entries
//   are packed whole (fp8_v4's data and scales together) into 4 KiB sectors, as many as fit
//   with an XXH3-64 each: 6 per sector for the 656-byte 8-bit latent formats and V4's 584-byte
//   entries, 3 for bf16. Each checksum lies in the tail of its entry's sector and is seeded
//   with the record's key, the layer and the slot, so an entry read from the wrong place, or
//   from a record that has since replaced this one on disk, fails its check. A layer's
//   entries take whole sectors (V3.2 fp8: 22 sectors for 128 entries, 7% more than the page;
//   V4 CSA: 6 sectors for 32 entries, 29% more). The record is an ordinary bundle of two
//   segments: a first one that pads the header to 4 KiB, so that the sectors start on a
//   sector of the record (tiers keep records 4 KiB-aligned), then the sectors. It is checked
//   whole when stored and moved between tiers like any other bundle.
// - SparseWorkingSet is one sequence's L1 share of one layer: a fixed number of entry slots in
//   pages of the kernel's format, an index from logical entry to slot, and LRU replacement.
//   Map() turns a token's selection (logical entries) into indices into view(), in the same
//   order, and names the entries that must be fetched first. The kernel then reads the
//   working set in place: the same entry bytes in the same order, so its output is
//   bit-identical to reading the whole cache (the kernels are batch-invariant).
// - HostEntryFetcher copies selected entries out of sparse records held in the host tier,
//   without copying the records, and checks each.
//
// Thread safety: a working set and a fetcher are used by one thread at a time; the host tier
// they read is thread-safe.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "sparsekv/block_geometry.h"
#include "sparsekv/block_hash.h"
#include "sparsekv/bundle.h"
#include "sparsekv/client.h"
#include "sparsekv/paged_cache_view.h"
#include "sparsekv/status.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {

class HostTier;
class SsdTier;

// Where one entry lies inside a page of `entries` entries: one byte range, or two for fp8_v4
// (its data, then its scales).
struct EntryRanges {
  uint32_t count = 0;
  std::array<uint64_t, 2> offset{};
  std::array<uint32_t, 2> bytes{};
};
// Precondition: CheckFormatFits passed for (format, dims); slot < entries.
EntryRanges EntryByteRanges(StorageFormat format, uint32_t dims, uint32_t entries, uint32_t slot);

inline constexpr uint32_t kSparseSectorBytes = 4096;

// The shape of a sparse record and of the pages it is packed from: `layers` pages of `entries`
// entries each, `page_stride` bytes apart, as a pool keeps one block.
struct SparseRecordLayout {
  StorageFormat format = StorageFormat::kFp8DsMla;
  uint32_t dims = 0;
  uint32_t entries = 0;      // per page (block_tokens / ratio)
  uint32_t layers = 0;
  uint64_t page_stride = 0;  // at least FormatPageBytes(format, dims, entries)

  // The layout of pool `pool` of a block geometry (its pages as the pool keeps them).
  static SparseRecordLayout ForPool(const PoolGeometry& pool);
  Status Validate() const;
  uint64_t pages_bytes() const { return uint64_t{layers} * page_stride; }
  // The pages tag its records carry (bundle.h): a digest of the format, dims, entries, layers
  // and page stride. A record of another tag is never unpacked.
  uint32_t PagesTag() const;

  uint32_t entry_bytes() const;        // one packed entry
  uint32_t entries_per_sector() const;
  uint32_t sectors_per_layer() const;
  uint64_t sectors_bytes() const { return uint64_t{layers} * sectors_per_layer() * kSparseSectorBytes; }
  // Segment 0: the header padded to a sector.
  static uint64_t PadBytes();
  // Where entry `slot` of layer `layer` lies in segment 1: its sector's offset, and the entry's
  // and its checksum's offsets inside that sector.
  struct Place {
    uint64_t sector = 0;
    uint32_t data = 0;
    uint32_t checksum = 0;
  };
  Place Locate(uint32_t layer, uint32_t slot) const;
};

// Packs `pages` (layout.pages_bytes() bytes) into the sectors of a sparse record for `key`
// (layout.sectors_bytes() bytes, written into `sectors`), each entry's checksum computed.
// Errors: a layout that fails Validate, buffers of other sizes.
Status PackSparseRecord(const SparseRecordLayout& layout, const BundleKey& key, std::span<const std::byte> pages,
                        std::span<std::byte> sectors);
// Unpacks sectors into pages (the restore of a whole block), checking every entry. Errors: as
// Pack; Corruption naming the first entry that does not match.
Status UnpackSparseRecord(const SparseRecordLayout& layout, const BundleKey& key, std::span<const std::byte> sectors,
                          std::span<std::byte> pages);
// Checks the packed entry at `place` of a sector (its bytes and checksum as read).
bool SparseEntryMatches(const SparseRecordLayout& layout, const BundleKey& key, uint32_t layer, uint32_t slot,
                        const std::byte* sector, const SparseRecordLayout::Place& place);

// The sparse record of `pages` under `key`, as a bundle any tier can store. Errors: those of
// PackSparseRecord and Bundle::Make.
Result<BundlePtr> MakeSparseRecord(const BundleKey& key, const SparseRecordLayout& layout,
                                   std::span<const std::byte> pages, uint64_t sequence);
// Packs `pages` and stores them as a sparse record under `key` in the host tier. Errors: those
// of PackSparseRecord and of HostTier::PutGathered.
Status StoreSparseRecord(HostTier& host, const BundleKey& key, const SparseRecordLayout& layout,
                         std::span<const std::byte> pages, uint64_t sequence);

struct SparseWorkingSetOptions {
  StorageFormat format = StorageFormat::kFp8DsMla;
  uint32_t dims = 0;
  // Entry slots: at least the most distinct entries one Map call may name (top-k).
  uint32_t capacity_entries = 0;
  // Entries per page of the working set's arena. Default: 64.
  uint32_t page_entries = 64;
  // Logical entries a selection may name (the index from entry to slot holds 4 bytes for each
  // up to the largest named). Default: 2^24.
  uint64_t max_entries = 1ull << 24;
};

class SparseWorkingSet {
 public:
  struct Miss {
    uint64_t entry = 0;  // logical entry of the sequence's cache
    uint32_t slot = 0;   // where it goes: page slot / page_entries, offset slot % page_entries
  };

  // Errors: a format the kernels cannot read, a capacity or page of 0 entries.
  static Result<std::unique_ptr<SparseWorkingSet>> Create(const SparseWorkingSetOptions& options);
  ~SparseWorkingSet();
  SparseWorkingSet(const SparseWorkingSet&) = delete;
  SparseWorkingSet& operator=(const SparseWorkingSet&) = delete;

  // Maps one token's selection (logical entries; -1 for none) onto slots: physical[i] is the
  // index in view() of logical[i] (-1 stays -1), and `misses` (cleared first) lists the entries
  // not held, in order of first appearance, with the slots given to them; they must be filled
  // (Fetch) before a kernel reads them, or given up (Forget). Everything the selection names
  // becomes the most recently used (what was held first, then the misses); room is made by
  // dropping the least recently used entries the selection does not name, so with a capacity
  // of at least top-k the misses are exactly what the last selections did not hold. Errors
  // (nothing mapped, no slot changes hands): sizes
  // that differ, an index below -1 or at max_entries or past, more distinct entries than the
  // capacity.
  Status Map(std::span<const int32_t> logical, std::span<int32_t> physical, std::vector<Miss>* misses);

  // Gives up entries Map assigned but that could not be filled: their slots become free.
  void Forget(std::span<const Miss> misses);

  // Makes room for entries likely to be selected soon (the indexer's next-ranked ones) and
  // names in `misses` (cleared first) those not held, with the slots given to them, to be
  // filled (Fetch) while the kernel reads what the last Map named: no slot the last Map named
  // changes hands, so the kernel's reads and the fill touch different bytes. Each is placed
  // as the most recently used; at most as many as there are slots the last Map did not name,
  // the rest left out. Until the fill completes the caller must neither Map nor Prefetch again
  // (a Map names a prefetched entry as held; a Prefetch may take a slot being filled). After a
  // failed Fetch the caller must Map again before a kernel reads the working set: a forgotten
  // slot is free for a Prefetch to take. Entries below 0 or past max_entries are skipped,
  // repeats once.
  void Prefetch(std::span<const int32_t> logical, std::vector<Miss>* misses);

  // Where slot `slot` lies: its page, and its entry index inside the page.
  std::byte* SlotPage(uint32_t slot) { return arena_ + uint64_t{slot / page_entries_} * page_stride_; }
  uint32_t SlotInPage(uint32_t slot) const { return slot % page_entries_; }

  // The arena as the kernels read it; indices from Map address it.
  PagedCacheView view() const;
  uint32_t page_entries() const { return page_entries_; }
  uint32_t capacity() const { return capacity_; }
  uint64_t held() const { return capacity_ - free_.size(); }
  // Counts over every Map call: entries named that were held, and that were not.
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  // Entries Prefetch named, and those of them a Map named afterwards while still held.
  uint64_t prefetched() const { return prefetched_; }
  uint64_t prefetch_used() const { return prefetch_used_; }
  // Bytes of L1 memory: the arena, the per-slot state and the entry index (which grows with
  // the largest entry named).
  uint64_t memory_bytes() const;

 private:
  SparseWorkingSet() = default;
  void Unlink(uint32_t slot);
  void PushFront(uint32_t slot);
  void Release(uint32_t slot);
  // A slot for a new entry: a free one, else the least recently used, released; for a
  // prefetch, capacity_ when only slots it must leave are left.
  uint32_t TakeSlot(bool for_prefetch);
  // Gives `slot` to `entry` as the most recently used.
  void Assign(uint32_t slot, uint64_t entry, uint64_t stamp);

  StorageFormat format_ = StorageFormat::kFp8DsMla;
  uint32_t dims_ = 0;
  uint32_t capacity_ = 0;
  uint32_t page_entries_ = 0;
  uint64_t max_entries_ = 0;
  uint64_t page_stride_ = 0;
  std::byte* arena_ = nullptr;
  uint64_t arena_bytes_ = 0;
  std::vector<int32_t> slot_of_;    // logical entry -> slot, or -1
  std::vector<uint64_t> entry_of_;  // slot -> logical entry (kFree when free)
  std::vector<uint32_t> prev_, next_;  // LRU list over slots; index capacity_ is the head
  std::vector<uint64_t> stamp_;        // the Map call that last named the slot
  std::vector<uint8_t> prefetch_;      // 1: filled by Prefetch, not named by a Map since
  std::vector<uint32_t> free_;
  uint64_t call_ = 0;
  uint64_t hits_ = 0, misses_ = 0, prefetched_ = 0, prefetch_used_ = 0;
};

// Fetches entries of a sequence's sparse records from the host tier into a working set. The
// sequence's blocks are `blocks`, in logical order (logical entry e lies in block
// e / layout.entries, slot e % layout.entries).
class HostEntryFetcher {
 public:
  HostEntryFetcher(HostTier& host, SparseRecordLayout layout, std::vector<BundleKey> blocks);

  // Copies the entries of layer `layer` named by `misses` (from SparseWorkingSet::Map) into
  // their slots, each checked against its checksum first. A record is pinned, not copied,
  // while its entries are read. Every entry that can be brought is; the first error is
  // returned, and the entries it concerns are forgotten in `ws` (the next Map names them
  // again): NotFound (a record gone from the tier: a cache may evict), Corruption (an entry
  // whose bytes do not match its checksum, named), InvalidArgument (a record of another
  // layout, an entry past the blocks; a working set of another format or a layer past the
  // records', for which every miss is forgotten).
  Status Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses, SparseWorkingSet& ws);

  // Bytes copied into working sets so far.
  uint64_t bytes_fetched() const { return bytes_fetched_; }

 private:
  HostTier& host_;
  SparseRecordLayout layout_;
  std::vector<BundleKey> blocks_;
  std::vector<SparseWorkingSet::Miss> sorted_;
  uint64_t bytes_fetched_ = 0;
};

// Fetches entries of a sequence's sparse records from the SSD tier: for each entry, the one
// 4 KiB sector holding it and its checksum (SsdTier::ReadSectors, O_DIRECT, at the tier's
// queue depth), a sector read once however many of its entries are wanted. An entry costs a
// 4 KiB read for its 656 bytes (V3.2 8-bit; 6.2x). Pages stored as they lie would cost 1.16
// sectors per entry (one in six crosses a sector boundary) plus a sector of a checksum table
// for each block read, which in decode, where most blocks give one entry, doubles it.
class SsdEntryFetcher {
 public:
  SsdEntryFetcher(SsdTier& ssd, SparseRecordLayout layout, std::vector<BundleKey> blocks);
  ~SsdEntryFetcher();

  // As HostEntryFetcher::Fetch, with the same errors but one: a record of another layout is
  // not recognized as such, and its entries fail their checks (Corruption). IOError for a
  // sector that could not be read.
  Status Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses, SparseWorkingSet& ws);

  uint64_t bytes_fetched() const { return bytes_fetched_; }
  uint64_t sectors_read() const { return sectors_read_; }

 private:
  SsdTier& ssd_;
  SparseRecordLayout layout_;
  std::vector<BundleKey> blocks_;
  std::byte* staging_ = nullptr;  // 4 KiB-aligned sectors
  uint64_t staging_sectors_ = 0;
  uint64_t bytes_fetched_ = 0, sectors_read_ = 0;
};

// Prefix caching with the sparse cache offloaded. The engine's CacheManager (and the
// OffloadedCache over it) keeps only the kinds every decode step reads whole: indexer keys, and
// V4's window, HCA entries and compressor state. The kinds the sparse kernel reads by selection
// (V3.2's MLA latent, V4's CSA entries, in layers with an indexer) live only in the tiers, as
// sparse records, one per block and kind, filed under the block's digest in a namespace of
// their own. A prefix hit then restores only the resident kinds (AcquirePrefix), and decode
// brings in the selected entries through a working set (HostEntryFetcher, SsdEntryFetcher; from
// sparsekvd, DaemonEntryFetcher over values made with MakeSparseValue).
struct SparseModelSplit {
  ModelSpec resident;  // for the CacheManager: every layer without its selection-read kinds
  // One per offloaded pool of the full geometry, in its order: the kind, and the layout of its
  // sparse records (the pool's pages for one block, every layer that keeps the kind).
  std::vector<KindSpec> kinds;
  std::vector<SparseRecordLayout> records;
};
// Errors: a spec that fails Validate or ComputeBlockGeometry; no kind read by selection; a
// selected kind in a format the sparse kernel cannot read.
Result<SparseModelSplit> SplitSparseModel(const ModelSpec& spec, uint32_t block_tokens = kDefaultBlockTokens);
// What sparse record `kind_index` (into SparseModelSplit::records) of the block with `digest`
// is filed under, in namespace `namespace_id` (one not used by the OffloadedCache's bundles:
// those are filed under the same digests). Distinct kinds get distinct keys.
BundleKey SparseRecordKey(uint32_t namespace_id, const BlockDigest& digest, uint32_t kind_index);

// Runs entry fetches on a thread of its own, so that they overlap the caller's compute: after a
// step's Map and Fetch, the caller starts the fill of what Prefetch named (the indexer's
// next-ranked entries) and runs the kernel on the working set meanwhile; before the next Map of
// that working set it waits. The fetch function must not share state with the caller's own
// fetches (give it a fetcher of its own); it runs on one thread, in the order started.
class AsyncEntryFetcher {
 public:
  using FetchFn = std::function<Status(uint32_t layer, std::span<const SparseWorkingSet::Miss>, SparseWorkingSet&)>;
  explicit AsyncEntryFetcher(FetchFn fetch);
  ~AsyncEntryFetcher();  // waits for what was started
  AsyncEntryFetcher(const AsyncEntryFetcher&) = delete;
  AsyncEntryFetcher& operator=(const AsyncEntryFetcher&) = delete;

  // Starts filling `misses` of `ws` (from Prefetch). The caller does not touch `ws` until Wait.
  void Start(uint32_t layer, std::vector<SparseWorkingSet::Miss> misses, SparseWorkingSet& ws);
  // Waits for every fill of `ws` started so far; returns the first error they met (their
  // entries are forgotten, so a later Map names them as misses).
  Status Wait(SparseWorkingSet& ws);

 private:
  struct Job {
    uint32_t layer;
    std::vector<SparseWorkingSet::Miss> misses;
    SparseWorkingSet* ws;
  };
  void Run();

  FetchFn fetch_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;                 // guarded by mu_
  const SparseWorkingSet* running_ = nullptr;  // guarded by mu_
  std::vector<std::pair<const SparseWorkingSet*, Status>> errors_;  // guarded by mu_
  bool stop_ = false;                    // guarded by mu_
  std::thread thread_;
};

// A sparse record as the value of one block in sparsekvd, read entry by entry with GET_RANGES.
// The daemon keeps a value at byte 64 of its record (api/PROTOCOL.md), so the value is the
// sectors after kSparseValuePadBytes zero bytes: they then lie on 4 KiB sectors of the
// daemon's record, and an entry costs one sector read when the daemon reads it from its SSD
// tier. Entries are checked with the key {namespace 0, the block's hash}, whatever namespace
// the daemon files the value under.
inline constexpr uint64_t kSparseValuePadBytes = kSparseSectorBytes - 64;
BundleKey SparseValueKey(const WireBlockHash& hash);
// The value for `pages` (layout.pages_bytes() bytes) under `hash`. Errors: as PackSparseRecord.
Result<std::vector<std::byte>> MakeSparseValue(const SparseRecordLayout& layout, const WireBlockHash& hash,
                                               std::span<const std::byte> pages);

// Fetches entries of a sequence's sparse values from sparsekvd: one GET_RANGES per Fetch, two
// ranges per entry (its packed bytes and its checksum), each entry checked here, since the
// daemon does not check values it reads in part.
class DaemonEntryFetcher {
 public:
  DaemonEntryFetcher(Client& client, SparseRecordLayout layout, std::vector<WireBlockHash> blocks);

  // As HostEntryFetcher::Fetch. Errors: a broken connection (every miss forgotten), and per
  // entry NotFound, Corruption, InvalidArgument (a value too short for the layout, an entry
  // past the blocks), IOError, as the daemon answers.
  Status Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses, SparseWorkingSet& ws);

  uint64_t bytes_fetched() const { return bytes_fetched_; }
  // Bytes of ranges asked for (entries and their checksums).
  uint64_t bytes_requested() const { return bytes_requested_; }
  uint64_t requests() const { return requests_; }

 private:
  Client& client_;
  SparseRecordLayout layout_;
  std::vector<WireBlockHash> blocks_;
  uint64_t bytes_fetched_ = 0, bytes_requested_ = 0, requests_ = 0;
};

}  // namespace sparsekv
