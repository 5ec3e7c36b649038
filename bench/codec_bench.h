// `sparsekv bench codec`: encode and decode throughput of every storage format, single thread,
// against memcpy of the same number of bytes measured in the same run.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "sparsekv/cpu_features.h"
#include "sparsekv/status.h"

namespace sparsekv::bench {

// bf16 bytes of one row of each benchmarked format (1,152 for the MLA formats, 1,024 for
// fp8_v4 and fp32, 256 for the indexer formats) all divide this.
inline constexpr uint64_t kCodecBenchRowGranule = 9216;

struct CodecBenchOptions {
  // Seconds per measured round of each method. Default: 0.1.
  double round_seconds = 0.1;
  // Rounds per method, interleaved so every method sees the same machine noise. Default: 5.
  int rounds = 5;
  // bf16 bytes encoded, decoded and copied per operation; a multiple of kCodecBenchRowGranule.
  // Default: 147,456, one V3.2 MLA block (128 tokens x 576 dims) of one layer in bf16: with its
  // pages it stays in a core's L2, where memcpy is fastest and the comparison is strictest.
  uint64_t working_set_bytes = 147456;
  // SIMD path to measure. Default: unset, meaning ActiveSimdPath().
  std::optional<SimdPath> path;
};

// {"formats": {"c8_mla": {"encode_bytes_per_s", "decode_bytes_per_s",
// "decode_fp32_bytes_per_s", "encode_vs_memcpy", "decode_vs_memcpy", "rows", "dims",
// "entries_per_page", "pages"}, ... every format}, "memcpy_bytes_per_s", "path",
// "working_set_bytes", "samples" (per method median/min/max/spread), "max_spread", ...}.
// Bytes are bf16 row bytes: what encode reads and decode writes (decode_fp32 writes twice as
// many, counted the same way so the figures compare).
Result<nlohmann::json> RunCodecBench(const CodecBenchOptions& options);

}  // namespace sparsekv::bench
