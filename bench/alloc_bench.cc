#include "alloc_bench.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "sparsekv/block_geometry.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/page_pool.h"

namespace sparsekv::bench {

Result<nlohmann::json> RunAllocBench(const AllocBenchOptions& options) {
  // One V3.2 block of the MLA latent kind: 128 tokens x 61 layers in bf16.
  SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset("deepseek-v3.2-exp", KvPrecision::kBf16));
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geo, ComputeBlockGeometry(spec, kDefaultBlockTokens));
  const uint64_t page_bytes = geo.pools[geo.PoolIndex(0, CacheKind::kMlaLatent)].block_stride;

  PagePoolOptions po;
  po.name = "bench";
  po.capacity = 256;
  po.page_bytes = page_bytes;  // a real (untouched) arena, as an engine would have
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> pool, PagePool::Create(po));
  PagePool::LocalCache local(*pool);
  uint64_t failures = 0;
  constexpr int kBurst = 64;
  constexpr int kBatch = 32;

  std::vector<Method> methods;
  methods.emplace_back("pool_local", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      auto p = local.Allocate();
      if (!p.ok() || !local.Release(*p).ok()) ++failures;
    }
  });
  methods.emplace_back("malloc", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      void* p = std::malloc(page_bytes);
      DoNotOptimize(p);
      if (p == nullptr) ++failures;
      std::free(p);
    }
  });
  methods.emplace_back("pool_locked", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      auto p = pool->Allocate();
      if (!p.ok() || !pool->Release(*p).ok()) ++failures;
    }
  });
  methods.emplace_back("pool_batch", [&](uint64_t n) {
    PageId ids[kBatch];
    for (uint64_t i = 0; i < n; i += kBatch) {
      if (!pool->AllocateBatch(ids).ok() || !pool->ReleaseBatch(ids, false).ok()) ++failures;
    }
  });
  methods.emplace_back("pool_local_burst", [&](uint64_t n) {
    PageId ids[kBurst];
    for (uint64_t i = 0; i < n; i += kBurst) {
      for (int k = 0; k < kBurst; ++k) {
        auto p = local.Allocate();
        if (!p.ok()) ++failures;
        ids[k] = p.ok() ? *p : kInvalidPage;
      }
      for (int k = kBurst; k-- > 0;) {
        if (!local.Release(ids[k]).ok()) ++failures;
      }
    }
  });
  methods.emplace_back("malloc_burst", [&](uint64_t n) {
    void* ptrs[kBurst];
    for (uint64_t i = 0; i < n; i += kBurst) {
      for (int k = 0; k < kBurst; ++k) {
        ptrs[k] = std::malloc(page_bytes);
        DoNotOptimize(ptrs[k]);
        if (ptrs[k] == nullptr) ++failures;
      }
      for (int k = kBurst; k-- > 0;) std::free(ptrs[k]);
    }
  });

  RunInterleaved(methods, options.round_seconds, options.rounds);
  if (failures) return Status::Internal("allocation bench: " + std::to_string(failures) + " operations failed");

  auto med = [&](const char* name) { return MedianOf(methods, name); };
  nlohmann::json out;
  out["page_bytes"] = page_bytes;
  out["pool_pairs_per_s"] = med("pool_local");
  out["malloc_pairs_per_s"] = med("malloc");
  out["ratio"] = med("pool_local") / med("malloc");
  out["pool_locked_pairs_per_s"] = med("pool_locked");
  out["pool_batch_pairs_per_s"] = med("pool_batch");
  out["pool_burst_pairs_per_s"] = med("pool_local_burst");
  out["malloc_burst_pairs_per_s"] = med("malloc_burst");
  out["burst_ratio"] = med("pool_local_burst") / med("malloc_burst");
  out["samples"] = SamplesJson(methods);
  out["rounds"] = options.rounds;
  out["note"] = "median of interleaved rounds; pool_pairs_per_s goes through PagePool::LocalCache";
  return out;
}

}  // namespace sparsekv::bench
