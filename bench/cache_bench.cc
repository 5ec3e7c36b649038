#include "cache_bench.h"

#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "sparsekv/block_geometry.h"
#include "sparsekv/cache_manager.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/page_pool.h"

namespace sparsekv::bench {
namespace {

constexpr uint32_t kBlockTokens = 128;

std::vector<TokenId> Prompt(uint32_t blocks, uint64_t salt) {
  std::vector<TokenId> t(uint64_t{blocks} * kBlockTokens + 1);
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<TokenId>((i * 2654435761u) ^ (salt * 40503u));
  t[0] = static_cast<TokenId>(salt);  // a new first token: every block of the chain is new
  return t;
}

Result<nlohmann::json> BenchModel(const std::string& model, const CacheBenchOptions& o) {
  SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset(model, KvPrecision::kFp8));
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = o.capacity_blocks;
  // Pages of V4's compressor snapshots are megabytes each: the figures are the manager's
  // bookkeeping, which does not touch page bytes, so the pools carry no arena.
  mo.metadata_only = true;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> cache, CacheManager::Create(spec, mo));
  const size_t pools = cache->num_pools();
  uint64_t failures = 0;

  // A cached prompt for the lookups.
  const std::vector<TokenId> cached = Prompt(o.prompt_blocks, 1);
  auto run_request = [&](std::span<const TokenId> tokens) -> bool {
    auto seq = cache->CreateSequence();
    if (!seq.ok()) return false;
    bool ok = cache->AppendTokens(*seq, tokens).ok() && cache->AcquireCachedPrefix(*seq).ok() &&
              cache->AllocateSlots(*seq, tokens.size()).ok() &&
              cache->CommitComputed(*seq, tokens.size()).ok();
    return cache->Free(*seq).ok() && ok;
  };
  if (!run_request(cached)) return Status::Internal("cache bench: warm-up request failed");
  std::vector<BlockDigest> digests;
  cache->hasher().HashFullBlocks(cache->hasher().Root(""), cached, "", &digests);
  PrefixQuery query;
  query.tokens = cached;
  if (cache->LookupDigests(digests, cached.size()).blocks != o.prompt_blocks) {
    return Status::Internal(
        fmt::format("cache bench ({}): the warm-up prompt does not hit", model));
  }

  // Bare pools of the same shape for the baseline.
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geo, ComputeBlockGeometry(spec, kBlockTokens));
  std::vector<std::unique_ptr<PagePool>> bare;
  for (size_t q = 0; q < geo.pools.size(); ++q) {
    PagePoolOptions po;
    po.capacity = o.capacity_blocks;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> p, PagePool::Create(po));
    bare.push_back(std::move(p));
  }
  std::vector<PageId> ids(o.prompt_blocks + 1);

  std::vector<TokenId> fresh = Prompt(o.prompt_blocks, 2);
  uint64_t next_salt = 1000;
  std::vector<Method> methods;
  methods.emplace_back("lookup", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      auto m = cache->LookupPrefix(query);
      if (!m.ok() || m->blocks != o.prompt_blocks) ++failures;
    }
  });
  methods.emplace_back("lookup_digests", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      if (cache->LookupDigests(digests, cached.size()).blocks != o.prompt_blocks) ++failures;
    }
  });
  methods.emplace_back("alloc_register_free", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      fresh[0] = static_cast<TokenId>(next_salt++);
      if (!run_request(fresh)) ++failures;
    }
  });
  methods.emplace_back("hit_cycle", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      if (!run_request(cached)) ++failures;
    }
  });
  methods.emplace_back("hash_only", [&](uint64_t n) {
    std::vector<BlockDigest> out;
    for (uint64_t i = 0; i < n; ++i) {
      out.clear();
      cache->hasher().HashFullBlocks(cache->hasher().Root(""), fresh, "", &out);
      DoNotOptimize(out.back());
    }
  });
  methods.emplace_back("pool_only", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      for (auto& p : bare) {
        if (!p->AllocateBatch(ids).ok() || !p->ReleaseBatch(ids, /*keep_cached=*/false).ok())
          ++failures;
      }
    }
  });
  RunInterleaved(methods, o.round_seconds, o.rounds);
  if (failures)
    return Status::Internal(fmt::format("cache bench ({}): {} operations failed", model, failures));
  const CacheStats st = cache->Stats();
  if (st.internal_errors)
    return Status::Internal(fmt::format("cache bench ({}): internal errors", model));

  auto med = [&](const char* name) { return MedianOf(methods, name); };
  const double blocks = o.prompt_blocks;
  nlohmann::json j;
  j["pools"] = pools;
  j["lookups_per_s"] = med("lookup");
  j["lookup_blocks_per_s"] = med("lookup") * blocks;
  j["lookup_digests_per_s"] = med("lookup_digests");
  j["alloc_register_free_per_s"] = med("alloc_register_free");
  j["alloc_register_free_blocks_per_s"] = med("alloc_register_free") * (blocks + 1);
  j["hit_cycle_per_s"] = med("hit_cycle");
  j["hash_only_per_s"] = med("hash_only");
  j["pool_only_per_s"] = med("pool_only");
  // How much of a new request's cycle the unavoidable work (hashing, pool calls) accounts for.
  j["alloc_register_free_vs_floor"] =
      med("alloc_register_free") / (1.0 / (1.0 / med("hash_only") + 1.0 / med("pool_only")));
  j["evicted_blocks"] = st.evicted_blocks;
  j["samples"] = SamplesJson(methods);
  return j;
}

}  // namespace

Result<nlohmann::json> RunCacheBench(const CacheBenchOptions& options) {
  if (options.prompt_blocks == 0 || options.capacity_blocks < 2 * (options.prompt_blocks + 1)) {
    return Status::InvalidArgument(
        fmt::format("cache bench: prompt_blocks {} and capacity_blocks {}: expected prompt_blocks "
                    ">= 1 and a capacity "
                    "of at least twice a request's blocks",
                    options.prompt_blocks, options.capacity_blocks));
  }
  nlohmann::json out;
  for (const char* model : {"deepseek-v3.2-exp", "deepseek-v4-flash"}) {
    SPARSEKV_ASSIGN_OR_RETURN(out[model], BenchModel(model, options));
  }
  out["block_tokens"] = kBlockTokens;
  out["prompt_blocks"] = options.prompt_blocks;
  out["capacity_blocks"] = options.capacity_blocks;
  out["rounds"] = options.rounds;
  out["note"] =
      "requests per second, medians of interleaved rounds, single thread, metadata-only pools; a "
      "request is "
      "prompt_blocks full blocks plus one token; *_vs_floor is the rate relative to hashing plus "
      "bare pool "
      "calls alone";
  return out;
}

}  // namespace sparsekv::bench
