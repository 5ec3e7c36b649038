// RocksDbTier: bundles stored as RocksDB values, for simple persistent setups.
//
// Records larger than `min_blob_size` go to blob files (BlobDB, with garbage collection), so
// compaction does not rewrite them. Reads skip RocksDB's own checksums (Debian's build verifies
// blob reads in software, slowly) and check the record's XXH3 instead. A small metadata column
// family (key -> record bytes) lets the tier rebuild its LRU at open without reading values.
// Capacity counts record bytes; the least recently used bundles are evicted beyond it.
//
// Ownership: the tier owns its database and worker threads. Thread safety: every method is
// thread-safe; callbacks run on the worker threads (contains and erases complete inline).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "sparsekv/tier.h"

namespace sparsekv {

struct RocksDbTierOptions {
  // Name used in messages and statistics. Default: "rocksdb".
  std::string name = "rocksdb";
  // Database directory; created if missing. Default: "" (must be set).
  std::string path;
  // Record bytes held before LRU eviction. Default: 16 GiB.
  uint64_t capacity_bytes = 16ull << 30;
  // Values at least this large go to blob files. Default: 4096.
  uint64_t min_blob_size = 4096;
  // Size at which a blob file is closed. Default: 256 MiB.
  uint64_t blob_file_size = 256ull << 20;
  // Largest record accepted. Default: 64 MiB.
  uint64_t max_record_bytes = 64ull << 20;
  // kNone writes without syncing the WAL; the others sync it on every batch. Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // Read (and compact) with O_DIRECT, bypassing the page cache. Default: false.
  bool use_direct_io = false;
  // Worker threads running batches; a large get batch is split across them (RocksDB reads the
  // blobs of one MultiGet one after another). Default: 4.
  uint32_t worker_threads = 4;
};

class RocksDbTier : public Tier {
 public:
  static Result<std::unique_ptr<RocksDbTier>> Open(const RocksDbTierOptions& options);

  // Test hook: stores `record` as the value of `key`, bypassing every check.
  virtual Status PutRawForTesting(const BundleKey& key, std::span<const std::byte> record) = 0;
};

}  // namespace sparsekv
