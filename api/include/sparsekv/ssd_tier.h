// SsdTier: the local-SSD offload tier (L3): slab files written and read with io_uring and
// O_DIRECT, indexed in RocksDB.
//
// Storage. Records are stored in slots of slab files, one file per size class
// ("slab-<class bytes>.dat", classes are multiples of 4 KiB with at most 1/8 waste), grown in
// preallocated steps (fallocate) while the tier is under capacity. Freed slots (erase,
// eviction, replacement) are reused lowest first; when a class has no free slot and the tier
// is full, the least recently used bundle of that class is evicted.
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
// Durability and recovery. The index (RocksDB, in "<path>/index": key -> class, slot, length,
// checksum, kind sizes) is written only after the batch's data is durable (Durability): a
// committer thread takes every batch whose data is written, syncs each slab file they touched
// once, writes all their index entries in one RocksDB batch and then acknowledges them (group
// commit), while the I/O threads go on with the next batches. An index entry is deleted before
// its slot is rewritten, so after a crash every acknowledged bundle is found and no entry points
// at another bundle's bytes. At open, entries that point
// outside the slab files are dropped; entries whose bytes turn out damaged are detected on read
// (checksum, key and length in the record), reported as Corruption, counted and erased.
//
// Ownership: the tier owns its files, index and threads; one process may open a directory at a
// time (RocksDB's lock enforces it). Thread safety: every method is thread-safe; callbacks run
// on the I/O threads and, for puts, on the committer thread (contains completes inline).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsekv/file_system.h"
#include "sparsekv/tier.h"

namespace sparsekv {

struct SsdTierOptions {
  // Name used in messages and statistics. Default: "ssd".
  std::string name = "ssd";
  // Directory of the slab files and the index; created if missing. Default: "" (must be set).
  std::string path;
  // Bytes of slab space (whole slots). Default: 16 GiB.
  uint64_t capacity_bytes = 16ull << 30;
  // I/Os in flight per I/O thread. Default: 16.
  uint32_t queue_depth = 16;
  // I/O threads, each with its own ring and buffers. Default: 1.
  uint32_t io_threads = 1;
  // The largest single I/O; larger records take several. A multiple of 4 KiB. Default: 1 MiB.
  uint64_t io_bytes = 1ull << 20;
  // Bytes of the registered read arena that returned bundles live in (pinned memory); it must
  // hold the bundles of the batches in flight and those callers keep. Default: 256 MiB.
  uint64_t read_arena_bytes = 256ull << 20;
  // Largest record accepted. Default: 64 MiB.
  uint64_t max_record_bytes = 64ull << 20;
  // Bytes a slab file grows by at a time (preallocated). Default: 256 MiB.
  uint64_t slab_grow_bytes = 256ull << 20;
  // Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // Register the read arena with the rings (pinned memory; falls back to plain I/O, with a
  // warning, when the kernel refuses, e.g. for RLIMIT_MEMLOCK). Default: true.
  bool register_buffers = true;
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
  uint64_t slab_files = 0;
  uint64_t allocated_bytes = 0;  // slot space in the slab files
  uint64_t free_slots = 0;
  uint64_t recovered = 0;          // index entries loaded at open
  uint64_t dropped_at_open = 0;    // index entries that pointed outside the slab files
  uint64_t quarantined_slots = 0;  // slots held back after a failed index update, until restart
  bool buffers_registered = false;
  uint64_t fixed_ios = 0;           // submissions into the registered arena
  uint64_t plain_ios = 0;           // submissions from or into other memory (writes, arena full)
  uint64_t arena_bytes_in_use = 0;  // read arena held by returned bundles and reads in flight
};

class SsdTier : public Tier {
 public:
  // Opens or creates the tier in options.path. `fs` defaults to FileSystem::Default() and must
  // outlive the tier. Errors: bad options, io_uring unavailable, an unreadable index.
  static Result<std::unique_ptr<SsdTier>> Open(const SsdTierOptions& options,
                                               FileSystem* fs = nullptr);

  virtual Result<SsdRecordLocation> Locate(const BundleKey& key) const = 0;
  // Every key held, in no particular order.
  virtual std::vector<BundleKey> Keys() const = 0;
  virtual SsdTierDetails Details() const = 0;
};

// The slab class (slot bytes) of a record: a multiple of 4 KiB with at most 1/8 waste.
uint64_t SsdSlabClassBytes(uint64_t record_bytes);

}  // namespace sparsekv
