// `sparsekv bench suspend`: what suspending and resuming a long sequence costs, what a
// conversation suspended after every turn keeps on disk, and how fast the request log
// acknowledges appends (issue 35). Every baseline runs in the same process, on the same data.
//
//   1. Suspend and resume a DeepSeek-V3.2 and a V4 sequence (fp8, the full presets) through the
//      host tier and through the SSD tier alone: Suspend writes every block and the tail
//      (write-back, so nothing was written before), Resume restores them into another L1 (its
//      pages touched first, as a serving engine's are; the host tier's arena too). Rates
//      are bytes of records per second, set against memcpy of the same bytes (host) and fio's
//      O_DIRECT sequential write of as many bytes in 1 MiB I/Os, depth 16, and read at fio's
//      best block size and depth, alternating with the resumes in the same run (SSD). A
//      sequence larger than `max_bytes` allows (L1 plus the tier hold it twice) is cut to what
//      fits, and the output says so.
//   2. A conversation of `turns` turns of `turn_tokens` tokens (V4), resumed and suspended every
//      turn, the old tail dropped: the SSD tier's bytes, against the sum of whole snapshots
//      taken after each turn (the full-history kinds of every token, plus one window and one
//      compressor state: ds4's way, the least a whole snapshot holds).
//   3. RequestLog appends of one token under fdatasync with 1, 64 and 1,024 requests appending
//      at once (each waits for its acknowledgement before its next): appends per second and
//      p50/p99 acknowledgement latency, against fio's write rate with --fdatasync=1 (4 KiB
//      writes) on the same file system.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct SuspendBenchOptions {
  // Directory for the SSD tier, the log and fio's file; required. A subdirectory is made and
  // removed.
  std::string dir;
  uint64_t v32_tokens = 128 * 1024;
  uint64_t v4_tokens = 1024 * 1024;
  // Bytes the sequences may take in memory (L1 and the host tier together); 0: 60% of
  // MemAvailable.
  uint64_t max_bytes = 0;
  bool host = true;
  bool ssd = true;
  // Leave the host tier's arena unpopulated, so a suspend pays the kernel's zeroing of every
  // fresh page it fills (a tier's first pass). Default: false (populated at open, as warm).
  bool cold_host_tier = false;
  bool with_fio = true;
  // SSD: fio's read at this block size and depth (0: the best of a sweep of 128 KiB to 4 MiB at
  // depths 1 to 32, made before the suspend); the SSD tier does its I/O in blocks of that size,
  // with at least as many bytes in flight. Resumes then alternate with fio reads of as many
  // bytes (fio, resume, fio, ..., fio), `rounds` resumes, each into a fresh L1.
  uint64_t fio_block_bytes = 0;
  uint32_t fio_depth = 0;
  int rounds = 3;
  uint32_t turns = 20;
  uint32_t turn_tokens = 256;
  std::vector<uint32_t> concurrency = {1, 64, 1024};
  double log_seconds = 2;
};

Result<nlohmann::json> RunSuspendBench(const SuspendBenchOptions& options);

}  // namespace sparsekv::bench
