// `sparsekv bench restore`: a model's prompt of N blocks stored into one offload tier by an
// OffloadedCache (write-through, every kind of every block) and restored from it into fresh L1
// pages after the manager forgot them, against a single-threaded memcpy of the same bytes
// between prefaulted buffers and, for the SSD tier, a plain O_DIRECT pread loop over the tier's
// data file (and optionally fio), all in the same run, interleaved.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "sparsekv/model_spec.h"
#include "sparsekv/status.h"
#include "sparsekv/tier.h"

namespace sparsekv::bench {

struct RestoreBenchOptions {
  // Model preset, used when `spec` is unset. Default: "deepseek-v3.2-exp".
  std::string model = "deepseek-v3.2-exp";
  // The preset's storage precision: bf16, c8 or fp8. Default: "bf16".
  std::string kv_format = "bf16";
  // A spec to use instead of the preset (the CLI's --spec / --model). Default: unset.
  std::optional<ModelSpec> spec;
  // Tokens per block. Default: 128.
  uint32_t block_tokens = 128;
  // Full blocks of the prompt (it has blocks * block_tokens + 1 tokens). Default: 120.
  uint32_t blocks = 120;
  // The one tier under L1: "host" (a HostTier, huge pages) or "ssd" (an SsdTier). Default: "host".
  std::string tier = "host";
  // Directory for the SSD tier's files and fio's file; required for ssd. Everything the bench
  // creates there is removed. Default: "".
  std::string dir;
  // Rounds of every method, interleaved; medians are reported. Default: 3.
  int rounds = 3;
  // Run one more round first, not counted, so that the first touch of the tier's memory and
  // files is not part of a measured store. Default: true.
  bool warmup_round = true;
  // The SSD tier's durability (part of the store time). Default: kNone.
  Durability durability = Durability::kNone;
  // The SSD tier's registered read arena; reads past it land in heap memory. 0: the tier's
  // default (256 MiB). Default: 0.
  uint64_t ssd_read_arena_bytes = 0;
  // SSD only: also run fio (io_uring, O_DIRECT, sequential reads) over a file of the restored
  // size in `dir`: first its best block size and depth (a sweep of short runs, unless both are
  // given below), which the tier then uses for its I/O (at least as many bytes in flight), then
  // one read at that setting before each counted restore and one after the last (fio, restore,
  // fio, ..., fio). Default: false.
  bool with_fio = false;
  // fio's block size in bytes and depth; 0: the sweep's best. Default: 0, 0.
  uint64_t fio_block_bytes = 0;
  uint32_t fio_depth = 0;
  // The interleaved fio runs read the tier's own data file (read-only), the bytes the restore
  // reads, just stored as the restore's are, instead of fio's file laid out at the start: on a
  // virtual disk whose host caches recent writes, both then read equally fresh bytes.
  // Default: false.
  bool fio_on_tier_file = false;
  // L1 blocks of the write-back eviction phase (MeasureWriteBackEviction): time under the cache
  // manager's lock per evicted block, with and without evicting ahead. 0: skipped. Default: 24.
  uint32_t eviction_blocks = 24;
  // ... and the time the engine takes to compute one block there, this thread idle (it writes
  // the block's pages, then sleeps out the rest): the demote thread's time to get ahead. The
  // default, 2 ms per block of 128 tokens, is a prefill of 64K tokens/s. Default: 2000.
  double eviction_compute_us = 2000;
};

// Keys: restore_bytes_per_s, store_bytes_per_s, memcpy_bytes_per_s, pread_bytes_per_s (null for
// the host tier), restore_vs_memcpy (restore rate / memcpy rate), restore_time_vs_memcpy and
// store_time_vs_memcpy (seconds per block / memcpy's: lower is better), restore_vs_pread (ssd),
// faults_per_block (minor + major page faults of the process during a restore, per block),
// store_faults_per_block, restore_cpu_s_per_gb and store_cpu_s_per_gb (user + system CPU of every
// thread of the process per 1e9 bytes), (with fio:) fio_best_bs, fio_best_iodepth, fio_sweep,
// fio_read_bytes_per_s (median), restore_vs_fio (per-round rates and ratios against the fio runs
// around each restore, InterleavedFioRatios), restore_vs_fio_best (their median), fio_command
// (or fio_error); tier_io_bytes, tier_queue_depth, tier_coalesced_records (ssd); the setup (model,
// kv_format, block_tokens, blocks, block_bytes = the sum of the pools' block strides, record_bytes,
// tier, durability, rounds, ...) and per-method samples (median, min, max). Rates are
// blocks * block_bytes per second. Every restore is checked byte for byte (outside the timing).
Result<nlohmann::json> RunRestoreBench(const RestoreBenchOptions& options);

}  // namespace sparsekv::bench
