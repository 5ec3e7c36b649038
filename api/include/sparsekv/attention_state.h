// Partial attention results and how they merge: (output, log-sum-exp) per head.
//
// A kernel that attends over a set of entries returns, per query token and head, the softmax-
// weighted output o = Σ_j p_j v_j / Σ_j p_j and lse = log Σ_j exp(s_j) (natural log, scores
// already scaled). Two partial results over disjoint sets merge exactly into the result over
// their union: lse = logaddexp(lse_a, lse_b) and o = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse).
// An empty set has o = 0 and lse = −inf and is the identity of the merge. SparseMla runs this
// merge itself, chunk by chunk and across its two caches, through a running (output, max,
// sum) state; these functions are for engines that split the work further (across ranks,
// or a prefix part and a fresh part).
//
// Thread safety: pure functions over caller memory.
#pragma once

#include <cstdint>

namespace sparsekv {

// Merges `rows` partial results of `dims` values each: out_a/lse_a (updated in place) with
// out_b/lse_b. Rows are consecutive (row r at out + r * dims). NaN in an input gives NaN in
// that row's output, never in another row.
void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          uint64_t rows, uint32_t dims);

// Adds an attention sink (a logit with no value) to `rows` finished results: the sink joins the
// softmax denominator, so each output shrinks by exp(lse − lse') with lse' = logaddexp(lse, sink).
// `sink[r % sink_count]` is row r's sink (rows are heads, fastest varying).
void ApplyAttentionSink(float* out, float* lse, const float* sink, uint32_t sink_count,
                        uint64_t rows, uint32_t dims);

}  // namespace sparsekv
