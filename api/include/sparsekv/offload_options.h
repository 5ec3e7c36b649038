// OffloadOptions: which offload tiers to build and how, as library options and as the
// "offload" section of the daemon's JSON config.
//
// JSON shape (every key optional; sizes are integers of bytes or strings such as "64GiB"):
//   {"write_policy": "write-back", "promote_into_first_tier": true, "prefetch_blocks": 4,
//    "host":    {"enabled": true, "capacity_bytes": "4GiB", "max_record_bytes": 0, "huge_pages": true,
//                "populate": false, "eviction": "arc", "hint_bound": 0.5},
//    "ssd":     {"enabled": false, "path": "ssd", "capacity_bytes": "64GiB", "queue_depth": 16,
//                "io_threads": 1, "io_bytes": "1MiB", "max_record_bytes": "64MiB",
//                "slab_grow_bytes": "256MiB", "durability": "fdatasync", "register_buffers": true,
//                "read_arena_bytes": "256MiB", "read_coalesce_bytes": "8MiB", "read_gap_bytes": "32KiB",
//                "eviction": "arc", "hint_bound": 0.5},
//    "rocksdb": {"enabled": false, "path": "rocksdb", "capacity_bytes": "64GiB",
//                "min_blob_size": 4096, "blob_file_size": "256MiB", "max_record_bytes": "64MiB",
//                "durability": "fdatasync", "use_direct_io": false, "worker_threads": 4},
//    "remote":  {"enabled": false, "nodes": ["10.0.0.5:7000", "10.0.0.6:7000"], "password": "",
//                "key_prefix": "skv", "timeout_ms": 50, "connections_per_node": 8,
//                "max_record_bytes": "64MiB", "max_pending_write_bytes": "256MiB",
//                "writer_threads": 2, "capacity_bytes": 0}}
// Unknown keys, wrong types and out-of-range values are errors that name the key path
// ("offload.ssd.queue_depth: expected an integer from 1 to 4096, got \"deep\"").
// Relative paths are resolved against the daemon's data directory by ResolvePaths.
//
// Thread safety: plain values and free functions.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "sparsekv/file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/remote_tier.h"
#include "sparsekv/rocksdb_tier.h"
#include "sparsekv/ssd_tier.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv {

struct OffloadOptions {
  // The host DRAM tier (L2). Default: enabled.
  bool host_enabled = true;
  HostTierOptions host;
  // The SSD tier (L3). Default: disabled.
  bool ssd_enabled = false;
  SsdTierOptions ssd;
  // The RocksDB tier (after the SSD tier when both are on). Default: disabled.
  bool rocksdb_enabled = false;
  RocksDbTierOptions rocksdb;
  // A Redis Cluster shared with other machines, last in the chain (remote_tier.h). Its
  // namespace_labels are set by the daemon from its namespaces. Default: disabled.
  bool remote_enabled = false;
  RemoteTierOptions remote;
  // How the tiers are stacked. Default: see TierChainOptions.
  TierChainOptions chain;
};

// Parses the "offload" section (the JSON object's text); `context` prefixes key paths in errors.
Result<OffloadOptions> ParseOffloadOptionsJson(std::string_view json_text,
                                               std::string_view context = "offload");
// The options as a JSON object (every key, so logs show the effective options).
std::string OffloadOptionsToJson(const OffloadOptions& options);
// Makes relative tier paths relative to `data_dir`; empty paths get "ssd" and "rocksdb".
void ResolveOffloadPaths(OffloadOptions& options, const std::string& data_dir);
// Opens the enabled tiers, fastest first, and stacks them. Error: no tier enabled, or a tier's.
Result<std::unique_ptr<TierChain>> OpenTierChain(const OffloadOptions& options,
                                                 FileSystem* fs = nullptr);

}  // namespace sparsekv
