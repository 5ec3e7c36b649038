// An offline model of a prefix cache replaying a trace, for the eviction policies of issue 34:
// Belady's MIN (evict the block whose next use as a hit lies farthest ahead; no online policy can
// keep more hits) beside the LRU that CacheManager runs and candidate policies, under the
// replay's semantics (RunReplay):
//   - capacity C pages of one block each; a request of L tokens looks up its longest cached
//     prefix of at most (L - 1) / block_tokens blocks (one token is always computed), pins it,
//     and needs ceil(L / block_tokens) pages in all: a request needing more than C fails (no hit,
//     nothing cached; the manager frees the sequence), else the missing pages are taken from free
//     ones, then by evicting cached blocks nobody pins;
//   - its floor(L / block_tokens) full blocks are then cached, the partial one's page freed;
//   - LRU evicts the least recently released block first, and of one release the deepest block
//     first (CacheManager releases a sequence's blocks tail first).
// A block is the chain of trace hash ids up to it (block_tokens must equal the trace's).
//
// Hints (`lookahead`): the blocks that the next N requests (by position in the trace) will read
// as hits are protected from eviction, as an engine that knows its waiting queue could ask, while
// at most `hint_bound` of the capacity is protected; past it, or when nothing unprotected is
// left, the policy's own choice stands. This is a model for choosing a policy: CacheManager does
// not run ARC or hints (yet).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "replay.h"
#include "sparsekv/status.h"

namespace sparsekv::bench {

enum class SimPolicy {
  kLru,     // CacheManager's: least recently released, tail first
  kArc,     // ARC (Megiddo and Modha): blocks never hit (T1) and hit (T2), ghosts adapt the split
  kBelady,  // the offline optimum: the farthest next use goes
};

struct PrefixSimOptions {
  // Pages, one block each; 0: unlimited (nothing is ever evicted). Default: 0.
  uint64_t capacity_blocks = 0;
  SimPolicy policy = SimPolicy::kLru;
  // Tokens per block, the trace's. Default: 512.
  uint32_t block_tokens = 512;
  // Requests ahead whose blocks are hinted (protected). Default: 0 (no hints).
  uint32_t lookahead = 0;
  // The most of the capacity hints may protect. Default: 0.5.
  double hint_bound = 0.5;
};

struct PrefixSimResult {
  uint64_t requests = 0;         // with input
  uint64_t failed_requests = 0;  // needed more pages than the capacity
  uint64_t blocks = 0;           // sum of ceil(input_length / block_tokens)
  uint64_t hit_blocks = 0;
  uint64_t evicted_blocks = 0;
  double seconds = 0;
};

// Errors: a request whose hash ids do not match its length; block_tokens 0; hint_bound outside
// [0, 1].
Result<PrefixSimResult> SimulatePrefixCache(std::span<const TraceRequest> trace, const PrefixSimOptions& options);
inline Result<PrefixSimResult> SimulatePrefixCache(std::span<const TraceRequest> trace, uint64_t capacity_blocks,
                                                   SimPolicy policy, uint32_t block_tokens = 512) {
  PrefixSimOptions o;
  o.capacity_blocks = capacity_blocks;
  o.policy = policy;
  o.block_tokens = block_tokens;
  return SimulatePrefixCache(trace, o);
}

// "lru", "arc", "belady"; InvalidArgument otherwise.
Result<SimPolicy> ParseSimPolicy(const std::string& name);

}  // namespace sparsekv::bench
