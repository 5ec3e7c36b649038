// `sparsekv bench cache`: the prefix cache manager's lookups and allocate+register+free cycles
// for a V3.2 and a V4 spec, against the hashing and page-pool work they cannot avoid.
#pragma once

#include <nlohmann/json.hpp>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct CacheBenchOptions {
  // Seconds per measured round of each method. Default: 0.2.
  double round_seconds = 0.2;
  // Rounds per method, interleaved so every method sees the same machine noise. Default: 5.
  int rounds = 5;
  // Full blocks per request (a 2,048-token prompt at 128 tokens per block, plus one token).
  // Default: 16.
  uint32_t prompt_blocks = 16;
  // Pages per pool; requests cycle through more distinct blocks than this, so the
  // allocate+register+free figure includes evictions. Default: 4096.
  uint32_t capacity_blocks = 4096;
};

// Per model ("deepseek-v3.2-exp", "deepseek-v4-flash"): lookups_per_s (a cached prompt: hashing
// and a resumable-prefix walk), lookup_digests_per_s (the walk alone), alloc_register_free_per_s
// (a new prompt: create, append and hash, look up, allocate, commit, free, with evictions),
// hit_cycle_per_s (the same prompt again: its blocks revived), and the baselines hash_only_per_s
// (hashing the prompt) and pool_only_per_s (batch allocate and release of the same pages in the
// bare pools); per-block rates; per-method spread.
Result<nlohmann::json> RunCacheBench(const CacheBenchOptions& options);

}  // namespace sparsekv::bench
