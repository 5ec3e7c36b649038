// `sparsekv bench tier`: bundle write and read throughput of one offload tier, against a plain
// synchronous pwrite/pread loop over the same 4 KiB-aligned buffers and (optionally) fio with
// io_uring at the same block size and queue depth, all on the same file system in the same run.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "sparsekv/status.h"
#include "sparsekv/tier.h"

namespace sparsekv::bench {

struct TierBenchOptions {
  // "ssd", "rocksdb" or "host". Default: "ssd".
  std::string tier = "ssd";
  // Directory for the tier's files, the baseline file and fio's file; must be set for ssd and
  // rocksdb. Everything the bench creates there is removed. Default: "".
  std::string dir;
  // Record bytes per bundle (header included), so each bundle is one I/O of this size. Default: 1
  // MiB.
  uint64_t bundle_bytes = 1ull << 20;
  // The SSD tier's and fio's queue depth. Default: 16.
  uint32_t queue_depth = 16;
  // Bytes written and read back per round. Default: 1 GiB.
  uint64_t data_bytes = 1ull << 30;
  // Bundles per tier call; 0 for 4 x queue_depth. Two calls are kept in flight. Default: 0.
  uint32_t batch = 0;
  // Rounds of every method, interleaved; medians are reported. Default: 3.
  int rounds = 3;
  // The tier's durability; the baseline syncs as often (once per batch). Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // Also run fio (io_uring, O_DIRECT, same block size and depth) each round. Default: false.
  bool with_fio = false;
};

// Keys: write_bytes_per_s, read_bytes_per_s, baseline_write_bytes_per_s,
// baseline_read_bytes_per_s, read_vs_baseline, write_vs_baseline, (with fio:)
// fio_write_bytes_per_s, fio_read_bytes_per_s, write_vs_fio, read_vs_fio, fio_command; and
// the setup (tier, bundle_bytes, queue_depth, data_bytes, durability, ...) and per-method
// samples (median, min, max).
Result<nlohmann::json> RunTierBench(const TierBenchOptions& options);

}  // namespace sparsekv::bench
