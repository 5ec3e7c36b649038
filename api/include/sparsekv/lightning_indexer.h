// LightningIndexer: DeepSeek-V3.2's (and V4 CSA's) indexer over a paged key cache, then exact
// top-k, producing the indices the sparse MLA kernel reads.
//
// For query token t (queries q[t, h, :], head weights w[t, h]) and each key s its sequence may
// see, logits[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]), with k[s] the key dequantized by its
// scale (formats idx_fp8, idx_c8, bf16). Keys are read where they lie in the pages. A token at
// position p sees keys 0 .. (p + 1) / key_ratio − 1 of its sequence (causal; key_ratio is 4 for
// V4's CSA indexer, whose key j covers tokens 4j .. 4j + 3).
//
// Top-k is exact: the k largest logits, ties broken by the lower key index, NaN ranked below
// every number. The selection is written in ascending key order (so the attention kernel walks
// pages forward) in FlashMLA's convention, physical_block * block_entries + offset of the
// *target* cache (the latent or compressed cache the indices are for, whose pages may differ
// from the key pages), padded with -1 when the token sees fewer than k keys.
//
// Work is split over (token, range of keys) for the logits and over tokens for the selection,
// on `threads` threads; every logit is computed by one fixed sequence of operations whatever
// the split, so results are bit-identical for any thread count and batch composition.
//
// Ownership: the indexer owns its threads and scratch (grown to the largest batch seen, never
// freed between runs); caller buffers and pages stay the caller's. Thread safety: Run is not
// reentrant; use one indexer per calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/paged_cache_view.h"
#include "sparsekv/status.h"

namespace sparsekv {

struct LightningIndexerOptions {
  // Entries selected per query token. 2048 for V3.2, 512 for V4. Default: 2048.
  uint32_t top_k = 2048;
  // Threads, the caller's included. Default: 1.
  uint32_t threads = 1;
  // SIMD path; unset means ActiveSimdPath(). Default: unset.
  std::optional<SimdPath> simd_path;
};

// One sequence of the batch.
struct IndexerSequence {
  BlockTable key_blocks;      // pages of the key cache, logical order
  BlockTable target_blocks;   // pages of the cache the indices address; empty: key_blocks
  uint32_t target_block_entries = 0;  // entries per target page; 0: the key view's
};

struct IndexerBatch {
  const void* q = nullptr;     // [tokens, heads, key dims], fp32 or bf16
  RowType q_type = RowType::kBf16;
  const float* weights = nullptr;  // [tokens, heads]
  uint32_t tokens = 0;
  uint32_t heads = 0;
  std::span<const IndexerSequence> sequences;
  const uint32_t* token_sequence = nullptr;  // [tokens]: sequence of each token; nullptr: all 0
  const uint64_t* positions = nullptr;       // [tokens]: position of each token in its sequence
  uint32_t key_ratio = 1;                    // tokens per key
};

struct IndexerOutput {
  int32_t* indices = nullptr;       // [tokens, top_k]
  float* top_logits = nullptr;      // optional [tokens, top_k]: the selected logits (-inf pads)
  float* logits = nullptr;          // optional [tokens, logits_stride]: every visible logit
  uint64_t logits_stride = 0;       // at least the most keys a token sees
};

class LightningIndexer {
 public:
  // Errors: top_k or threads of 0, a SIMD path this CPU lacks.
  static Result<std::unique_ptr<LightningIndexer>> Create(const LightningIndexerOptions& options);
  ~LightningIndexer();
  LightningIndexer(const LightningIndexer&) = delete;
  LightningIndexer& operator=(const LightningIndexer&) = delete;

  // Errors, before anything is computed or written: a view that fails Validate or holds
  // another format than idx_fp8 / idx_c8 / bf16; null buffers; a token whose sequence or
  // position is out of range; a sequence's block table too short for what a token sees, or a
  // block id past the view; logits_stride too small.
  Status Run(const PagedCacheView& keys, const IndexerBatch& batch, const IndexerOutput& out);

  const LightningIndexerOptions& options() const { return options_; }
  SimdPath simd_path() const { return path_; }

 private:
  struct State;
  LightningIndexer(const LightningIndexerOptions& options, SimdPath path);
  LightningIndexerOptions options_;
  SimdPath path_;
  std::unique_ptr<State> state_;
};

}  // namespace sparsekv
