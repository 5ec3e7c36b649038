// An offline model of a prefix cache replaying a trace, for the eviction policies of issue 34:
// Belady's MIN (evict the block whose next use as a hit lies farthest ahead; no online policy can
// keep more hits) beside the LRU that CacheManager runs, under the replay's semantics (RunReplay):
//   - capacity C pages of one block each; a request of L tokens looks up its longest cached
//     prefix of at most (L - 1) / block_tokens blocks (one token is always computed), pins it,
//     and needs ceil(L / block_tokens) pages in all: a request needing more than C fails (no hit,
//     nothing cached; the manager frees the sequence), else the missing pages are taken from free
//     ones, then by evicting cached blocks nobody pins;
//   - its floor(L / block_tokens) full blocks are then cached, the partial one's page freed;
//   - LRU evicts the least recently released block first, and of one release the deepest block
//     first (CacheManager releases a sequence's blocks tail first).
// A block is the chain of trace hash ids up to it (block_tokens must equal the trace's).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "replay.h"
#include "sparsekv/status.h"

namespace sparsekv::bench {

enum class SimPolicy { kLru, kBelady };

struct PrefixSimResult {
  uint64_t requests = 0;         // with input
  uint64_t failed_requests = 0;  // needed more pages than the capacity
  uint64_t blocks = 0;           // sum of ceil(input_length / block_tokens)
  uint64_t hit_blocks = 0;
  uint64_t evicted_blocks = 0;
  double seconds = 0;
};

// Replays `trace` through the model with `capacity_blocks` pages (0: unlimited). Errors: a
// request whose hash ids do not match its length.
Result<PrefixSimResult> SimulatePrefixCache(std::span<const TraceRequest> trace, uint64_t capacity_blocks,
                                            SimPolicy policy, uint32_t block_tokens = 512);

}  // namespace sparsekv::bench
