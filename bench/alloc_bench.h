// `sparsekv bench alloc`: page-pool allocate+free pairs against malloc/free of the same size.
#pragma once

#include <nlohmann/json.hpp>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct AllocBenchOptions {
  // Seconds per measured round of each method. Default: 0.2.
  double round_seconds = 0.2;
  // Rounds per method, interleaved so every method sees the same machine noise. Default: 5.
  int rounds = 5;
};

// Keys: pool_pairs_per_s (our pool through its per-thread cache, single thread),
// malloc_pairs_per_s, ratio, page_bytes, plus the pool's locked and batched paths, a
// burst pattern (64 allocations, then 64 frees tail first) for both, and per-method spread.
Result<nlohmann::json> RunAllocBench(const AllocBenchOptions& options);

}  // namespace sparsekv::bench
