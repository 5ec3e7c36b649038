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

// One manager under one eviction policy, warmed with the cached prompt.
struct PolicySetup {
  EvictionPolicyKind policy;
  std::unique_ptr<CacheManager> cache;
  std::vector<BlockDigest> digests;  // of the cached prompt
  std::vector<TokenId> fresh;
  uint64_t next_salt = 1000;
};

Result<nlohmann::json> BenchModel(const std::string& model, const CacheBenchOptions& o) {
  SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset(model, KvPrecision::kFp8));
  uint64_t failures = 0;
  const std::vector<TokenId> cached = Prompt(o.prompt_blocks, 1);
  PrefixQuery query;
  query.tokens = cached;
  auto run_request = [&](CacheManager& cache, std::span<const TokenId> tokens) -> bool {
    auto seq = cache.CreateSequence();
    if (!seq.ok()) return false;
    bool ok = cache.AppendTokens(*seq, tokens).ok() && cache.AcquireCachedPrefix(*seq).ok() &&
              cache.AllocateSlots(*seq, tokens.size()).ok() &&
              cache.CommitComputed(*seq, tokens.size()).ok();
    return cache.Free(*seq).ok() && ok;
  };

  // The default policy first (its figures are the model's top-level ones), then the others.
  std::vector<PolicySetup> setups;
  setups.push_back(PolicySetup{kDefaultEvictionPolicy, nullptr, {}, {}, 1000});
  for (EvictionPolicyKind k : AllEvictionPolicies()) {
    if (k != kDefaultEvictionPolicy) setups.push_back(PolicySetup{k, nullptr, {}, {}, 1000});
  }
  for (PolicySetup& p : setups) {
    CacheManagerOptions mo;
    mo.block_tokens = kBlockTokens;
    mo.capacity_blocks = o.capacity_blocks;
    mo.eviction = p.policy;
    // Pages of V4's compressor snapshots are megabytes each: the figures are the manager's
    // bookkeeping, which does not touch page bytes, so the pools carry no arena.
    mo.metadata_only = true;
    SPARSEKV_ASSIGN_OR_RETURN(p.cache, CacheManager::Create(spec, mo));
    if (!run_request(*p.cache, cached)) return Status::Internal("cache bench: warm-up request failed");
    p.cache->hasher().HashFullBlocks(p.cache->hasher().Root(""), cached, "", &p.digests);
    if (p.cache->LookupDigests(p.digests, cached.size()).blocks != o.prompt_blocks) {
      return Status::Internal(fmt::format("cache bench ({}): the warm-up prompt does not hit", model));
    }
    p.fresh = Prompt(o.prompt_blocks, 2);
  }
  CacheManager& cache = *setups[0].cache;
  const size_t pools = cache.num_pools();

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

  // Every policy's methods, interleaved with each other and the baselines, so that the ratios
  // between policies see the same machine noise.
  std::vector<Method> methods;
  auto name = [](const char* method, const PolicySetup& p) {
    return fmt::format("{}@{}", method, EvictionPolicyName(p.policy));
  };
  for (PolicySetup& p : setups) {
    CacheManager* c = p.cache.get();
    methods.emplace_back(name("lookup", p), [&, c](uint64_t n) {
      for (uint64_t i = 0; i < n; ++i) {
        auto m = c->LookupPrefix(query);
        if (!m.ok() || m->blocks != o.prompt_blocks) ++failures;
      }
    });
    methods.emplace_back(name("lookup_digests", p), [&, c](uint64_t n) {
      for (uint64_t i = 0; i < n; ++i) {
        if (c->LookupDigests(p.digests, cached.size()).blocks != o.prompt_blocks) ++failures;
      }
    });
    methods.emplace_back(name("alloc_register_free", p), [&, c](uint64_t n) {
      for (uint64_t i = 0; i < n; ++i) {
        p.fresh[0] = static_cast<TokenId>(p.next_salt++);
        if (!run_request(*c, p.fresh)) ++failures;
      }
    });
    methods.emplace_back(name("hit_cycle", p), [&, c](uint64_t n) {
      for (uint64_t i = 0; i < n; ++i) {
        if (!run_request(*c, cached)) ++failures;
      }
    });
  }
  std::vector<TokenId> fresh = Prompt(o.prompt_blocks, 2);
  methods.emplace_back("hash_only", [&](uint64_t n) {
    std::vector<BlockDigest> out;
    for (uint64_t i = 0; i < n; ++i) {
      out.clear();
      cache.hasher().HashFullBlocks(cache.hasher().Root(""), fresh, "", &out);
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
  for (const PolicySetup& p : setups) {
    const CacheStats st = p.cache->Stats();
    if (st.internal_errors) {
      return Status::Internal(fmt::format("cache bench ({}, {}): internal errors: {}", model,
                                          EvictionPolicyName(p.policy), st.first_internal_error));
    }
  }

  auto med = [&](const std::string& n) { return MedianOf(methods, n); };
  const double blocks = o.prompt_blocks;
  const char* kMethods[] = {"lookup", "lookup_digests", "alloc_register_free", "hit_cycle"};
  nlohmann::json j;
  j["pools"] = pools;
  const PolicySetup& def = setups[0];
  j["policy"] = EvictionPolicyName(def.policy);
  j["lookups_per_s"] = med(name("lookup", def));
  j["lookup_blocks_per_s"] = med(name("lookup", def)) * blocks;
  j["lookup_digests_per_s"] = med(name("lookup_digests", def));
  j["alloc_register_free_per_s"] = med(name("alloc_register_free", def));
  j["alloc_register_free_blocks_per_s"] = med(name("alloc_register_free", def)) * (blocks + 1);
  j["hit_cycle_per_s"] = med(name("hit_cycle", def));
  j["hash_only_per_s"] = med("hash_only");
  j["pool_only_per_s"] = med("pool_only");
  // How much of a new request's cycle the unavoidable work (hashing, pool calls) accounts for.
  j["alloc_register_free_vs_floor"] =
      med(name("alloc_register_free", def)) / (1.0 / (1.0 / med("hash_only") + 1.0 / med("pool_only")));
  j["evicted_blocks"] = def.cache->Stats().evicted_blocks;
  // Each policy's rates, and each rate relative to LRU's in the same run.
  const PolicySetup* lru = nullptr;
  for (const PolicySetup& p : setups) {
    if (p.policy == EvictionPolicyKind::kLru) lru = &p;
  }
  for (const PolicySetup& p : setups) {
    nlohmann::json pj;
    for (const char* m : kMethods) {
      pj[std::string(m) + "_per_s"] = med(name(m, p));
      if (lru != nullptr) pj[std::string(m) + "_vs_lru"] = med(name(m, p)) / med(name(m, *lru));
    }
    pj["evicted_blocks"] = p.cache->Stats().evicted_blocks;
    j["policies"][std::string(EvictionPolicyName(p.policy))] = pj;
  }
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
      "request is prompt_blocks full blocks plus one token; *_vs_floor is the rate relative to "
      "hashing plus bare pool calls alone; the model's top-level rates are the default eviction "
      "policy's, `policies` has every policy's, *_vs_lru relative to LRU in the same run";
  return out;
}

}  // namespace sparsekv::bench
