// Memory planner: how many bytes a cache needs for a workload, or how many tokens fit a budget.
//
// The plan counts what a running batch must keep resident to decode: every block of the
// full-history kinds, the blocks of the sliding window that cover its last window_tokens
// tokens, and one compressor snapshot per sequence. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsekv/block_geometry.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/status.h"

namespace sparsekv {

struct PlanKindRow {
  CacheKind kind = CacheKind::kMlaLatent;
  StorageFormat format = StorageFormat::kBf16;
  uint32_t layers = 0;
  uint32_t dims = 0;
  uint32_t ratio = 1;
  uint32_t entries_per_block = 0;
  uint64_t bytes_per_entry = 0;
  uint64_t block_bytes = 0;  // one pool page: every layer of one block
  uint64_t blocks = 0;
  uint64_t bytes = 0;        // blocks * block_bytes
};

struct MemoryPlan {
  std::string model;
  uint32_t block_tokens = 0;
  uint64_t batch = 0;
  uint64_t seq_len = 0;       // tokens per sequence
  uint64_t tokens = 0;        // batch * seq_len
  uint64_t total_bytes = 0;
  uint64_t budget_bytes = 0;  // set when the plan answered a budget
  std::vector<PlanKindRow> kinds;
};

// The memory for `batch` sequences of `seq_len` tokens each.
Result<MemoryPlan> PlanForSequences(const ModelSpec& spec, uint32_t block_tokens, uint64_t batch,
                                    uint64_t seq_len);

// The longest seq_len (a whole number of blocks) such that `batch` sequences fit in
// `budget_bytes`. Error when not even one block per sequence fits.
Result<MemoryPlan> PlanForBudget(const ModelSpec& spec, uint32_t block_tokens, uint64_t budget_bytes,
                                 uint64_t batch = 1);

std::string MemoryPlanToJson(const MemoryPlan& plan, int indent = 2);
std::string MemoryPlanToTable(const MemoryPlan& plan);

}  // namespace sparsekv
