// SparseMla: DeepSeek sparse attention in MLA's absorbed form, reading the selected latent
// entries where they lie in the cache pages.
//
// Per query token t and head h (all heads share the token's selection, as in MQA):
//   s_j = softmax_scale · q[t, h, :D] · k_j[:D]          over the selected entries j
//   out[t, h, :] = Σ_j softmax(s)_j · k_j[:512],  lse[t, h] = log Σ_j exp(s_j)  (natural log)
// with D the cache's entry dims (576 for V3.2's latent: 512 + 64 rope; 512 for V4: 448 + 64)
// and the value the first 512 of them. Formats: c8_mla, fp8_ds_mla, bf16 (V3.2) and fp8_v4
// (V4). Entries are dequantized from the pages in small tiles of a chunk of the selection at
// a time, never gathered: no buffer grows with top_k × D.
//
// Indices follow FlashMLA: physical_block * block_entries + offset, -1 for none (skipped). A
// token whose selection is empty gets out = 0 and lse = −inf. V4 adds a second cache (the
// sliding window, or the other compressed kind) with its own view and indices; it continues
// the same running (output, max, sum) state, so the result is attention over the union. An
// optional per-head attention sink then joins the denominator (attention_state.h), and lse
// includes it.
//
// Work is split over (token, block of heads) on `threads` threads. Each output element is
// produced by one fixed sequence of operations whatever the split, so the bytes of a token's
// output do not depend on the thread count or on the other tokens of the batch.
//
// Ownership: the kernel owns its threads and per-thread scratch, sized at Create (a few hundred
// KiB a thread, independent of top_k); caller buffers and pages stay the caller's. Thread
// safety: Run is not reentrant; use one SparseMla per calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/paged_cache_view.h"
#include "sparsekv/status.h"

namespace sparsekv {

inline constexpr uint32_t kMlaValueDims = 512;

struct SparseMlaOptions {
  // Threads, the caller's included. Default: 1.
  uint32_t threads = 1;
  // SIMD path; unset means ActiveSimdPath(). Default: unset.
  std::optional<SimdPath> simd_path;
};

// One source of entries: either a paged cache or dense fp32 rows (entries already decoded,
// e.g. a prefill's fresh KV, or a gathered copy), with a token's selection as indices.
struct SparseMlaSource {
  PagedCacheView view;            // used when rows == nullptr
  const float* rows = nullptr;    // [num_rows, view.dims] fp32; indices are row numbers
  uint64_t num_rows = 0;
  const int32_t* indices = nullptr;  // [tokens, indices_stride]; the first top_k are read
  uint32_t top_k = 0;
  uint64_t indices_stride = 0;       // 0: top_k
};

struct SparseMlaBatch {
  const void* q = nullptr;  // [tokens, heads, D], fp32 or bf16
  RowType q_type = RowType::kBf16;
  uint32_t tokens = 0;
  uint32_t heads = 0;
  float softmax_scale = 0;
  const float* sink = nullptr;  // optional [heads]
  SparseMlaSource main;
  std::optional<SparseMlaSource> extra;  // V4's second cache; same D as main
};

struct SparseMlaOutput {
  float* out = nullptr;  // [tokens, heads, 512]
  float* lse = nullptr;  // [tokens, heads]
};

class SparseMla {
 public:
  // Errors: threads of 0, a SIMD path this CPU lacks.
  static Result<std::unique_ptr<SparseMla>> Create(const SparseMlaOptions& options);
  ~SparseMla();
  SparseMla(const SparseMla&) = delete;
  SparseMla& operator=(const SparseMla&) = delete;

  // Errors, before anything is computed or written: a view that fails Validate, holds a
  // format other than c8_mla / fp8_ds_mla / bf16 / fp8_v4, or has fewer than 512 or more than
  // 576 dims; caches of different dims; null buffers; an index below -1 or past the cache (the
  // message names the token and position); a non-finite or non-positive softmax scale.
  Status Run(const SparseMlaBatch& batch, const SparseMlaOutput& out);

  const SparseMlaOptions& options() const { return options_; }
  SimdPath simd_path() const { return path_; }

 private:
  struct State;
  SparseMla(const SparseMlaOptions& options, SimdPath path);
  SparseMlaOptions options_;
  SimdPath path_;
  std::unique_ptr<State> state_;
};

}  // namespace sparsekv
