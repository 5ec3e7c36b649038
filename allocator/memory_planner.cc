#include "sparsekv/memory_planner.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace sparsekv {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Blocks of one pool a sequence of `seq_blocks` blocks keeps resident.
uint64_t BlocksPerSequence(const PoolGeometry& p, const ModelSpec& spec, uint32_t block_tokens,
                           uint64_t seq_blocks) {
  if (seq_blocks == 0) return 0;
  switch (p.spec.kind) {
    case CacheKind::kSwaWindow: {
      // The last window_tokens tokens end anywhere in a block, so they can span one block more
      // than they fill.
      const uint64_t window_blocks = CeilDiv(spec.window_tokens - 1, block_tokens) + 1;
      return std::min(seq_blocks, window_blocks);
    }
    case CacheKind::kCompressorState:
      return 1;  // the live snapshot at the sequence's last block boundary
    default:
      return seq_blocks;
  }
}

MemoryPlan BuildPlan(const ModelSpec& spec, const BlockGeometry& g, uint64_t batch, uint64_t seq_blocks) {
  MemoryPlan plan;
  plan.model = spec.name;
  plan.block_tokens = g.block_tokens;
  plan.batch = batch;
  for (const PoolGeometry& p : g.pools) {
    PlanKindRow row;
    row.kind = p.spec.kind;
    row.format = p.spec.format;
    row.layers = static_cast<uint32_t>(p.layers.size());
    row.dims = p.spec.dims;
    row.ratio = p.spec.ratio;
    row.entries_per_block = p.entries_per_block;
    row.bytes_per_entry = p.bytes_per_entry;
    row.block_bytes = p.block_stride;
    row.blocks = batch * BlocksPerSequence(p, spec, g.block_tokens, seq_blocks);
    row.bytes = row.blocks * row.block_bytes;
    plan.total_bytes += row.bytes;
    plan.kinds.push_back(row);
  }
  return plan;
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace

Result<MemoryPlan> PlanForSequences(const ModelSpec& spec, uint32_t block_tokens, uint64_t batch,
                                    uint64_t seq_len) {
  if (batch == 0) return Status::InvalidArgument("batch is 0; expected at least 1 sequence");
  if (seq_len == 0) return Status::InvalidArgument("seq_len is 0; expected at least 1 token");
  if (batch > (1ull << 32) || seq_len > (1ull << 40)) {
    return Status::InvalidArgument(fmt::format("batch {} x seq_len {} is out of range", batch, seq_len));
  }
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry g, ComputeBlockGeometry(spec, block_tokens));
  MemoryPlan plan = BuildPlan(spec, g, batch, CeilDiv(seq_len, block_tokens));
  plan.seq_len = seq_len;
  plan.tokens = batch * seq_len;
  return plan;
}

Result<MemoryPlan> PlanForBudget(const ModelSpec& spec, uint32_t block_tokens, uint64_t budget_bytes,
                                 uint64_t batch) {
  if (batch == 0) return Status::InvalidArgument("batch is 0; expected at least 1 sequence");
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry g, ComputeBlockGeometry(spec, block_tokens));
  bool grows = false;
  for (const PoolGeometry& p : g.pools) grows = grows || IsFullHistoryKind(p.spec.kind);
  if (!grows) {
    return Status::InvalidArgument(fmt::format(
        "model {} keeps no full-history kind: its memory does not grow with length", spec.name));
  }
  auto fits = [&](uint64_t blocks) { return BuildPlan(spec, g, batch, blocks).total_bytes <= budget_bytes; };
  if (!fits(1)) {
    return Status::ResourceExhausted(fmt::format(
        "budget of {} bytes does not hold one block per sequence for {} sequences ({} bytes needed)",
        budget_bytes, batch, BuildPlan(spec, g, batch, 1).total_bytes));
  }
  uint64_t lo = 1, hi = 2;
  while (fits(hi) && hi < (1ull << 40)) hi *= 2;
  while (hi - lo > 1) {  // fits(lo), !fits(hi)
    const uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  MemoryPlan plan = BuildPlan(spec, g, batch, lo);
  plan.seq_len = lo * block_tokens;
  plan.tokens = batch * plan.seq_len;
  plan.budget_bytes = budget_bytes;
  return plan;
}

std::string MemoryPlanToJson(const MemoryPlan& plan, int indent) {
  nlohmann::json j;
  j["model"] = plan.model;
  j["block_tokens"] = plan.block_tokens;
  j["batch"] = plan.batch;
  j["seq_len"] = plan.seq_len;
  j["tokens"] = plan.tokens;
  j["total_bytes"] = plan.total_bytes;
  if (plan.budget_bytes) j["budget_bytes"] = plan.budget_bytes;
  nlohmann::json kinds = nlohmann::json::array();
  for (const PlanKindRow& r : plan.kinds) {
    kinds.push_back({{"kind", CacheKindName(r.kind)},
                     {"format", StorageFormatName(r.format)},
                     {"layers", r.layers},
                     {"dims", r.dims},
                     {"ratio", r.ratio},
                     {"entries_per_block", r.entries_per_block},
                     {"bytes_per_entry", r.bytes_per_entry},
                     {"block_bytes", r.block_bytes},
                     {"blocks", r.blocks},
                     {"bytes", r.bytes}});
  }
  j["kinds"] = std::move(kinds);
  return j.dump(indent);
}

std::string MemoryPlanToTable(const MemoryPlan& plan) {
  std::string out = fmt::format("model {}: {} sequence(s) x {} tokens = {} tokens, block_tokens {}\n",
                                plan.model, plan.batch, plan.seq_len, plan.tokens, plan.block_tokens);
  if (plan.budget_bytes) out += fmt::format("budget {} ({} bytes)\n", HumanBytes(plan.budget_bytes), plan.budget_bytes);
  out += fmt::format("{:<17} {:<11} {:>6} {:>5} {:>5} {:>9} {:>11} {:>10} {:>14}\n", "kind", "format",
                     "layers", "dims", "ratio", "B/entry", "block", "blocks", "bytes");
  for (const PlanKindRow& r : plan.kinds) {
    out += fmt::format("{:<17} {:<11} {:>6} {:>5} {:>5} {:>9} {:>11} {:>10} {:>14}\n", CacheKindName(r.kind),
                       StorageFormatName(r.format), r.layers, r.dims, r.ratio, r.bytes_per_entry,
                       HumanBytes(r.block_bytes), r.blocks, HumanBytes(r.bytes));
  }
  out += fmt::format("total {} ({} bytes)\n", HumanBytes(plan.total_bytes), plan.total_bytes);
  return out;
}

}  // namespace sparsekv
