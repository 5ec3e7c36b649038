// `sparsekv bench attention`: the sparse MLA kernel reading pages in place, against a gather
// baseline (copy the selected entries to a dense buffer, dequantize them all, then the same
// compute on dense rows) and against a dot-product loop on the same SIMD path; and the
// Lightning Indexer over the whole key cache. All measured in one run, interleaved.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "sparsekv/cpu_features.h"
#include "sparsekv/status.h"
#include "sparsekv/storage_format.h"

namespace sparsekv::bench {

struct AttentionBenchOptions {
  // Query tokens per call (1: one decode step). Default: 1.
  uint32_t tokens = 1;
  // MLA heads. Default: 128 (V3.2).
  uint32_t heads = 128;
  // Entries selected per token. Default: 2048 (V3.2).
  uint32_t top_k = 2048;
  // Tokens in the cache (one sequence). Default: 65,536.
  uint32_t cache_tokens = 65536;
  // Entries per page. Default: 128.
  uint32_t block_tokens = 128;
  // Latent cache format: c8_mla, fp8_ds_mla, bf16 (576 dims) or fp8_v4 (512). Default: c8_mla.
  StorageFormat format = StorageFormat::kC8Mla;
  // Indexer heads and key format. Default: 64, idx_fp8 (V3.2).
  uint32_t indexer_heads = 64;
  StorageFormat indexer_format = StorageFormat::kIdxFp8;
  // Threads of every kernel and of the peak loop. Default: 1.
  uint32_t threads = 1;
  // Rounds per method, interleaved. Default: 5.
  int rounds = 5;
  // Seconds per round of each method. Default: 0.2.
  double round_seconds = 0.2;
  // SIMD path; unset means ActiveSimdPath(). Default: unset.
  std::optional<SimdPath> path;
};

// {"sparse_mla_gflops", "gather_baseline_gflops", "indexer_gflops", "peak_gflops",
//  "sparse_mla_vs_peak", "sparse_mla_vs_gather", "indexer_vs_peak", "outputs_identical",
//  "path", "threads", shape fields, "samples", "max_spread"}.
Result<nlohmann::json> RunAttentionBench(const AttentionBenchOptions& options);

}  // namespace sparsekv::bench
