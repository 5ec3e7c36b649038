// SsdTier: the local-SSD offload tier (L3): one data file written and read with io_uring and
// O_DIRECT, indexed in RocksDB.
//
// Storage. Each record takes a contiguous extent of 4 KiB units of one data file
// ("data.dat"): space is allocated by the byte (rounded to 4 KiB), not by slot or size class,
// so any mix of record sizes fills the tier to its capacity before the first eviction (a tier
// that kept one slab file per size class refused puts as "full" with most of its space
// preallocated to classes nobody used). The file grows in preallocated steps (fallocate,
// `slab_grow_bytes`) up to `capacity_bytes`; past that, a put evicts the eviction policy's
// victims (never one being read; hinted ones last) until a free extent holds it, best fit, freed neighbours
// coalescing. A put never replaces a copy with a larger sequence (tier.h).
//
// I/O. Each I/O thread owns one io_uring; a batch's records are cut into I/Os of at most
// `io_bytes` and kept `queue_depth` deep, with O_DIRECT. Nothing is copied on the way: a write
// goes out of the bundle's own 4 KiB-aligned memory (bundle.h), and a read lands in a run of the
// tier's read arena, a pre-faulted region registered with every ring
// (io_uring_register_buffers), which the returned bundle keeps until its last owner lets go;
// when the arena is full, reads land in fresh heap memory instead. Every submission passes
// through the RandomRWFile hooks of the FileSystem (file_system.h), so faults can be injected
// into the io_uring path.
//
// Durability and recovery. The index (RocksDB, in "<path>/index": key -> extent, length,
// checksum, sequence, kind sizes) is written only after the batch's data is durable
// (Durability): a committer thread takes every batch whose data is written, syncs the data file
// once, writes all their index entries in one RocksDB batch and then acknowledges them (group
// commit), while the I/O threads go on with the next batches. An index entry is deleted before
// its extent is written again, and an erase is acknowledged only once its delete is written, so
// after a crash every acknowledged bundle is found, no erased one comes back, and no entry
// points at another bundle's bytes. At open, entries that point outside the data file or
// overlap another are dropped; entries whose bytes turn out damaged are detected on read
// (checksum, key and length in the record), reported as Corruption, counted and erased.
//
// Ownership: the tier owns its files, index and threads; one process may open a directory at a
// time (RocksDB's lock enforces it). Thread safety: every method is thread-safe; callbacks run
// on the I/O threads and, for puts, on the committer thread (contains and erases complete
// inline).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsekv/eviction_policy.h"
#include "sparsekv/file_system.h"
#include "sparsekv/tier.h"

namespace sparsekv {

struct SsdTierOptions {
  // Name used in messages and statistics. Default: "ssd".
  std::string name = "ssd";
  // Directory of the data file ("data.dat") and the index; created if missing. Default: ""
  // (must be set).
  std::string path;
  // Bytes of the data file (rounded down to 4 KiB). Default: 16 GiB.
  uint64_t capacity_bytes = 16ull << 30;
  // I/Os in flight per I/O thread. Default: 16.
  uint32_t queue_depth = 16;
  // I/O threads, each with its own ring and buffers. Default: 1.
  uint32_t io_threads = 1;
  // The largest single I/O; larger records take several. A multiple of 4 KiB. Default: 1 MiB.
  uint64_t io_bytes = 1ull << 20;
  // Reads of records whose extents lie next to each other (in one Get batch) are coalesced:
  // one contiguous range of the file, up to this many bytes, read in I/Os of io_bytes into one
  // buffer that the records share. At most one 4 KiB unit: no coalescing. Default: 8 MiB.
  uint64_t read_coalesce_bytes = 8ull << 20;
  // ... also across a gap of at most this many bytes between two extents (read and thrown
  // away; kept below io_bytes). A multiple of 4 KiB. Default: 32 KiB.
  uint64_t read_gap_bytes = 32ull << 10;
  // Bytes of the registered read arena that returned bundles live in (pinned memory); it must
  // hold the bundles of the batches in flight and those callers keep. Default: 256 MiB.
  uint64_t read_arena_bytes = 256ull << 20;
  // Largest record accepted. Default: 64 MiB.
  uint64_t max_record_bytes = 64ull << 20;
  // Bytes the data file grows by at a time (preallocated with fallocate). Default: 256 MiB.
  uint64_t slab_grow_bytes = 256ull << 20;
  // Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // Register the read arena with the rings (pinned memory; falls back to plain I/O, with a
  // warning, when the kernel refuses, e.g. for RLIMIT_MEMLOCK). Default: true.
  bool register_buffers = true;
  // Which bundle a full tier evicts first (eviction_policy.h); after a restart every recovered
  // bundle starts as new, oldest written first. Default: kDefaultEvictionPolicy.
  EvictionPolicyKind eviction = kDefaultEvictionPolicy;
  // At most this share of the capacity, in record bytes, is protected by hints (Tier::Hint).
  // From 0 to 1. Default: 0.5.
  double hint_bound = 0.5;
};

// Where a bundle's record lies (for tools and tests).
struct SsdRecordLocation {
  std::string file;
  uint64_t offset = 0;
  uint64_t record_bytes = 0;
  uint64_t checksum = 0;
  std::vector<uint32_t> segment_bytes;
};

struct SsdTierDetails {
  uint64_t allocated_bytes = 0;     // size of the data file
  uint64_t free_bytes = 0;          // free space inside it
  uint64_t free_extents = 0;        // free runs it is cut into
  uint64_t largest_free_bytes = 0;  // the largest record that fits without growing or evicting
  uint64_t recovered = 0;           // index entries loaded at open
  uint64_t dropped_at_open = 0;     // index entries that pointed outside the file or overlapped
  uint64_t quarantined_bytes = 0;   // space held back after a failed index update, until restart
  bool buffers_registered = false;
  uint64_t fixed_ios = 0;           // submissions into the registered arena
  uint64_t plain_ios = 0;           // submissions from or into other memory (writes, arena full)
  uint64_t arena_bytes_in_use = 0;  // read arena held by returned bundles and reads in flight
  uint64_t read_groups = 0;         // contiguous ranges Get read (each in I/Os of io_bytes)
  uint64_t coalesced_records = 0;   // records Get read in a range shared with others
};

class SsdTier : public Tier {
 public:
  // Opens or creates the tier in options.path. `fs` defaults to FileSystem::Default() and must
  // outlive the tier. Errors: bad options, io_uring unavailable, an unreadable index.
  static Result<std::unique_ptr<SsdTier>> Open(const SsdTierOptions& options,
                                               FileSystem* fs = nullptr);

  virtual Result<SsdRecordLocation> Locate(const BundleKey& key) const = 0;

  // One 4 KiB sector of a stored record: `sector` bytes from the record's start (a multiple of
  // 4 KiB), read into `out` (4 KiB-aligned, 4 KiB).
  struct SectorRead {
    BundleKey key;
    uint64_t sector = 0;
    std::byte* out = nullptr;
  };
  // Reads chosen sectors of stored records, with O_DIRECT at the tier's queue depth, on one of
  // its I/O threads (the caller waits): what an entry-granular reader needs, where a record is
  // far larger than what it wants of it. Nothing is checked here; the caller checks what it
  // reads (sparse records carry a checksum per entry). A record's space is not reused while
  // its sectors are read. Must not be called from the tier's own I/O threads (from a
  // callback of its async calls), which it waits for. One status per read: NotFound (no such
  // record), InvalidArgument (a sector past the record, an unaligned buffer), IOError. With
  // `records`, it gets one SectorRecord per read: the size and sequence of the record the
  // sector was read from (zeros for NotFound), so a caller can tell the bytes of the record
  // from the padding after it and a stale copy from the newest.
  struct SectorRecord {
    uint64_t record_bytes = 0;
    uint64_t sequence = 0;
  };
  virtual std::vector<Status> ReadSectors(std::span<const SectorRead> reads,
                                          std::vector<SectorRecord>* records = nullptr) = 0;
  // Every key held, in no particular order.
  virtual std::vector<BundleKey> Keys() const = 0;
  // The eviction order's own check (the policy's lists, the protected bytes, the parked
  // entries): for tests.
  virtual Status CheckEviction() const = 0;
  virtual SsdTierDetails Details() const = 0;
};

}  // namespace sparsekv
