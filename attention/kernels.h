// The attention kernels of one SIMD path: what a work item computes, and the table of
// functions each path provides. Private to attention/; LightningIndexer and SparseMla
// (lightning_indexer.h, sparse_mla.h) are the public faces.
//
// Every path computes the same items with the same loop structure; only the vector width
// differs. An item's arithmetic depends on nothing but its own inputs, which is what makes
// the results independent of the thread count and of the batch.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "sparsekv/codec.h"
#include "sparsekv/paged_cache_view.h"

namespace sparsekv::attention {

inline constexpr uint32_t kMaxMlaDims = 576;
inline constexpr uint32_t kValueDims = 512;
// Entries dequantized into one tile: 64 x 576 fp32 = 144 KiB, which stays in L2 while every
// head of a block attends over it.
inline constexpr uint32_t kChunkEntries = 64;
// Heads of one head block: two vectors on every path (32 on AVX-512).
inline constexpr uint32_t kMaxHeadBlock = 32;
// Heads of one SparseMla item: the head blocks that share each dequantized chunk.
inline constexpr uint32_t kMaxItemHeads = 128;

struct MlaSourceWork {
  const PagedCacheView* view = nullptr;
  const PageCodec* codec = nullptr;  // null when rows are given
  const float* rows = nullptr;       // dense fp32 entries, or null
  const int32_t* indices = nullptr;
  uint32_t top_k = 0;
  uint64_t indices_stride = 0;
};

struct MlaWork {
  const void* q = nullptr;
  RowType q_type = RowType::kBf16;
  uint32_t heads = 0;
  uint32_t dims = 0;  // D: query and entry dims
  float softmax_scale = 0;
  const float* sink = nullptr;
  MlaSourceWork sources[2];
  uint32_t num_sources = 0;
  float* out = nullptr;
  float* lse = nullptr;
};

// Per-thread scratch of SparseMla, 64-byte aligned, sized for kMaxItemHeads heads.
struct MlaScratch {
  float* qt;     // [head blocks][kMaxMlaDims][head block]: queries, transposed per block
  float* ot;     // [head blocks][kValueDims][head block]: unnormalized output, transposed
  float* tile;   // [kChunkEntries][kMaxMlaDims]: dequantized entries of one chunk
  float* s;      // [kChunkEntries][head block]: scores, then probabilities
  float* m;      // [kMaxItemHeads]: running max
  float* l;      // [kMaxItemHeads]: running sum
  float* alpha;  // [kMaxItemHeads]: rescale of the chunk
};

struct IndexerWork {
  const PagedCacheView* view = nullptr;
  const PageCodec* codec = nullptr;
  const void* q = nullptr;
  RowType q_type = RowType::kBf16;
  const float* weights = nullptr;
  uint32_t heads = 0;
  uint32_t dims = 0;
};

// Per-thread scratch of LightningIndexer.
struct IndexerScratch {
  float* qt;    // [dims][heads]
  float* tile;  // [kChunkEntries][dims]
};

struct PathKernels {
  uint32_t lanes;
  // Heads h0 .. h0 + blocks * head_block - 1 of query token `token`, at most kMaxItemHeads.
  // head_block is 2 * lanes (mla_item_2) when that divides the head count, else lanes
  // (mla_item_1; the caller checks lanes divides it).
  void (*mla_item_2)(const MlaWork& work, uint32_t token, uint32_t h0, uint32_t blocks,
                     const MlaScratch& scratch);
  void (*mla_item_1)(const MlaWork& work, uint32_t token, uint32_t h0, uint32_t blocks,
                     const MlaScratch& scratch);
  // Logits of keys [begin, end) of a token whose key pages are `table`, into logits[begin..end).
  // Precondition: lanes divides heads.
  void (*indexer_range)(const IndexerWork& work, uint32_t token, BlockTable table, uint64_t begin,
                        uint64_t end, float* logits, const IndexerScratch& scratch);
  // The dot-product loop behind peak_gflops: `iterations` steps over L1-resident data of the
  // same micro-kernel shape as the scores; returns a sum so the work is not elided.
  float (*peak_loop)(const float* data, uint64_t iterations);
  uint64_t peak_flops_per_iteration;
};

// Floats `data` must hold for peak_loop.
inline constexpr uint32_t kPeakDataFloats = 64 * kMaxHeadBlock + 6 * 64;

// 64-byte-aligned fp32 scratch, for the kernels' per-thread buffers.
struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using AlignedFloats = std::unique_ptr<float[], AlignedFree>;
inline AlignedFloats AllocFloats(uint64_t n) {
  return AlignedFloats(
      static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64)));
}

// Each path's table, or nullptr where this build has no code for it.
const PathKernels* ScalarKernels();
const PathKernels* Avx2Kernels();
const PathKernels* Avx512Kernels();
// The table the kernels use for `path` (avx512_bf16 runs the avx512 table, neon the scalar one).
const PathKernels* KernelsFor(SimdPath path);

}  // namespace sparsekv::attention
