// Plain references for the attention kernels: dequantize every entry with the scalar codec,
// then compute densely in double precision. Slow on purpose and written for clarity; used only
// by the tests and the benchmarks to check the kernels (not part of libsparsekv).
#pragma once

#include <cstdint>
#include <vector>

#include "sparsekv/lightning_indexer.h"
#include "sparsekv/sparse_mla.h"
#include "sparsekv/status.h"

namespace sparsekv::attention {

// Entry `index` (FlashMLA convention) of `view`, dequantized to fp32 by the scalar codec.
Result<std::vector<float>> DequantizeEntry(const PagedCacheView& view, uint64_t index);

struct ReferenceIndexerResult {
  std::vector<std::vector<double>> logits;  // [token][key]: every visible key
  std::vector<int32_t> indices;             // [token][top_k], as LightningIndexer writes them
};

// What LightningIndexer::Run computes, the slow way: top-k by a full sort on (logit desc,
// key asc), NaN last, then the selection in key order.
Result<ReferenceIndexerResult> ReferenceIndexer(const PagedCacheView& keys,
                                                const IndexerBatch& batch, uint32_t top_k);

// What SparseMla::Run computes: out [tokens, heads, 512] and lse [tokens, heads].
Status ReferenceSparseMla(const SparseMlaBatch& batch, std::vector<float>* out,
                          std::vector<float>* lse);

// 1 - 2 Σxy / Σ(x² + y²): 0 for identical vectors, the measure DeepSeek's kernel tests use.
double CalcDiff(const float* x, const float* y, uint64_t n);
double CalcDiff(const std::vector<double>& x, const float* y, uint64_t n);

}  // namespace sparsekv::attention
