// The kernel bodies, written once over a vector type V and included by each path's .cc file,
// which then defines V and instantiates MakeKernels<V> (kernels_scalar.cc, kernels_avx2.cc, kernels_avx512.cc). Everything here
// is in an anonymous namespace: each path's copy is compiled with its own ISA flags and must
// not be merged with another's by the linker.
//
// V provides: R (the register type), kLanes, Zero, Set1, Load, Store, Fma(a, b, c) = a*b + c
// rounded once, Mul, Sub, Max(a, b) (b when either is NaN), Exp, ReduceAdd (a fixed order), and
// Pin(x), which keeps a loaded vector in a register: left alone, GCC folds the load into every
// FMA that uses it, and the loop then issues more loads than the load ports can take.
//
// Layout trick shared by both kernels: vectors run across heads, not dims. All heads of a
// token read the same entries, so a query block is transposed once (qt[d][h]) and each entry
// value is broadcast against a vector of heads. Scores, the softmax state and the output
// accumulators are then vectors over heads, and no horizontal reduction is needed until the
// indexer's final weighted sum.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention/kernels.h"
#include "sparsekv/bf16.h"

// Loops over a template's register blocks must unroll completely, or the accumulators live on
// the stack and every FMA waits on a store; -O2 does not always do it on its own.
#define SPARSEKV_UNROLL _Pragma("GCC unroll 16")

namespace sparsekv::attention {
namespace {

// exp(x) for x <= 88: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor
// polynomial (truncation error below 2^-24 relative there) and a scale by 2^n. x below
// -87.3 gives 0 (no denormal results), -inf gives 0, NaN gives NaN. The same constants and
// operation order on every path; the SIMD paths use fused multiply-adds, so results may differ
// from the scalar twin in the last bit.
inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2Hi = 0.693359375f;
inline constexpr float kExpLn2Lo = -2.12194440e-4f;
inline constexpr float kExpMin = -87.3365478515625f;
inline constexpr float kExpMax = 88.0f;
inline constexpr float kExpC[8] = {1.0f,           1.0f,          0.5f,          1.0f / 6,
                                   1.0f / 24,      1.0f / 120,    1.0f / 720,    1.0f / 5040};

// qt[d * hb + h] = q[token, h0 + h, d] for h < hb, d < dims.
inline void TransposeQueries(const void* q, RowType type, uint32_t heads, uint32_t dims,
                             uint32_t token, uint32_t h0, uint32_t hb, float* qt) {
  const uint64_t base = (uint64_t{token} * heads + h0) * dims;
  for (uint32_t h = 0; h < hb; ++h) {
    const uint64_t row = base + uint64_t{h} * dims;
    if (type == RowType::kFp32) {
      const float* src = static_cast<const float*>(q) + row;
      for (uint32_t d = 0; d < dims; ++d) qt[uint64_t{d} * hb + h] = src[d];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(q) + row;
      for (uint32_t d = 0; d < dims; ++d) qt[uint64_t{d} * hb + h] = Bf16ToFloat(src[d]);
    }
  }
}

// Row pointers of up to kChunkEntries entries, starting at position *next of a token's
// selection, skipping -1. Paged entries are dequantized into `tile`; dense rows are used where
// they lie. Returns the count.
inline uint32_t FillChunk(const MlaSourceWork& src, const int32_t* idx, uint32_t* next,
                          uint32_t dims, float* tile, const float** rows) {
  uint32_t n = 0;
  uint32_t j = *next;
  while (n < kChunkEntries && j < src.top_k) {
    const int32_t e = idx[j++];
    if (e < 0) continue;
    if (src.rows != nullptr) {
      rows[n++] = src.rows + uint64_t(e) * dims;
    } else {
      const PagedCacheView& v = *src.view;
      const uint32_t block = static_cast<uint32_t>(e) / v.block_entries;
      const uint32_t slot = static_cast<uint32_t>(e) % v.block_entries;
      float* out = tile + uint64_t{n} * kMaxMlaDims;
      src.codec->DecodeEntryFp32(v.Page(block), slot, out);
      rows[n++] = out;
    }
  }
  *next = j;
  return n;
}

// s[g][h] = scale * Σ_d qt[d][h] * rows[g][d] for G rows.
template <class V, int NHV, int G>
[[gnu::always_inline]] inline void ScoreGroup(const float* qt, const float* const* rows,
                                              uint32_t dims, float scale, float* s) {
  using R = typename V::R;
  constexpr uint32_t L = V::kLanes, HB = NHV * L;
  R acc[NHV][G];
  SPARSEKV_UNROLL
  for (int i = 0; i < NHV; ++i)
    SPARSEKV_UNROLL
    for (int g = 0; g < G; ++g) acc[i][g] = V::Zero();
  const float* r[G];
  SPARSEKV_UNROLL
  for (int g = 0; g < G; ++g) r[g] = rows[g];
  for (uint32_t d = 0; d < dims; ++d) {
    R qv[NHV];
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) qv[i] = V::Pin(V::Load(qt + d * HB + i * L));
    SPARSEKV_UNROLL
    for (int g = 0; g < G; ++g) {
      const R k = V::Set1(r[g][d]);
      SPARSEKV_UNROLL
      for (int i = 0; i < NHV; ++i) acc[i][g] = V::Fma(qv[i], k, acc[i][g]);
    }
  }
  const R sc = V::Set1(scale);
  SPARSEKV_UNROLL
  for (int g = 0; g < G; ++g)
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) V::Store(s + g * HB + i * L, V::Mul(acc[i][g], sc));
}

template <class V, int NHV, int G>
inline void ScoreRowsTail(const float* qt, const float* const* rows, uint32_t dims, float scale,
                          float* s, uint32_t n) {
  if constexpr (G > 0) {
    if (n == G) {
      ScoreGroup<V, NHV, G>(qt, rows, dims, scale, s);
    } else {
      ScoreRowsTail<V, NHV, G - 1>(qt, rows, dims, scale, s, n);
    }
  }
}

template <class V, int NHV>
inline void ScoreRows(const float* qt, const float* const* rows, uint32_t n, uint32_t dims,
                      float scale, float* s) {
  constexpr int G = 12 / NHV;
  constexpr uint32_t HB = NHV * V::kLanes;
  uint32_t g0 = 0;
  for (; g0 + G <= n; g0 += G) ScoreGroup<V, NHV, G>(qt, rows + g0, dims, scale, s + g0 * HB);
  if (g0 < n) ScoreRowsTail<V, NHV, G - 1>(qt, rows + g0, dims, scale, s + g0 * HB, n - g0);
}

// ot[d][h] = alpha[h] * ot[d][h] + Σ_c p[c][h] * rows[c][d], for DB dims from d0.
template <class V, int NHV, int DB>
[[gnu::always_inline]] inline void ValueBlock(float* ot, const float* alpha, const float* p,
                                              const float* const* rows, uint32_t n, uint32_t d0) {
  using R = typename V::R;
  constexpr uint32_t L = V::kLanes, HB = NHV * L;
  R a[NHV];
  SPARSEKV_UNROLL
  for (int i = 0; i < NHV; ++i) a[i] = V::Load(alpha + i * L);
  R acc[NHV][DB];
  SPARSEKV_UNROLL
  for (int k = 0; k < DB; ++k)
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) acc[i][k] = V::Mul(V::Load(ot + (d0 + k) * HB + i * L), a[i]);
  for (uint32_t c = 0; c < n; ++c) {
    R pv[NHV];
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) pv[i] = V::Pin(V::Load(p + c * HB + i * L));
    const float* row = rows[c] + d0;
    SPARSEKV_UNROLL
    for (int k = 0; k < DB; ++k) {
      const R v = V::Set1(row[k]);
      SPARSEKV_UNROLL
      for (int i = 0; i < NHV; ++i) acc[i][k] = V::Fma(pv[i], v, acc[i][k]);
    }
  }
  SPARSEKV_UNROLL
  for (int k = 0; k < DB; ++k)
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) V::Store(ot + (d0 + k) * HB + i * L, acc[i][k]);
}

template <class V, int NHV>
inline void ValueRows(float* ot, const float* alpha, const float* p, const float* const* rows,
                      uint32_t n) {
  constexpr int DB = 12 / NHV;
  uint32_t d0 = 0;
  for (; d0 + DB <= kValueDims; d0 += DB) ValueBlock<V, NHV, DB>(ot, alpha, p, rows, n, d0);
  for (; d0 + 2 <= kValueDims; d0 += 2) ValueBlock<V, NHV, 2>(ot, alpha, p, rows, n, d0);
  for (; d0 < kValueDims; ++d0) ValueBlock<V, NHV, 1>(ot, alpha, p, rows, n, d0);
}

// One chunk's online-softmax step: turns scores s into exp(s - m_new) in place, sets
// alpha = exp(m_old - m_new), l = l * alpha + Σ p, m = m_new.
template <class V, int NHV>
inline void SoftmaxStep(float* s, uint32_t n, float* m, float* l, float* alpha) {
  using R = typename V::R;
  constexpr uint32_t L = V::kLanes, HB = NHV * L;
  SPARSEKV_UNROLL
  for (int i = 0; i < NHV; ++i) {
    R mx = V::Set1(-std::numeric_limits<float>::infinity());
    for (uint32_t c = 0; c < n; ++c) mx = V::Max(mx, V::Load(s + c * HB + i * L));
    const R m_old = V::Load(m + i * L);
    // Scores of -inf everywhere would make m_new -inf and exp(-inf - -inf) NaN; -FLT_MAX as the
    // reference keeps every exp at 0 instead. Finite maxima are unchanged.
    const R m_new = V::Max(V::Max(m_old, mx), V::Set1(-std::numeric_limits<float>::max()));
    const R a = V::Exp(V::Sub(m_old, m_new));
    R sum = V::Zero();
    for (uint32_t c = 0; c < n; ++c) {
      const R pv = V::Exp(V::Sub(V::Load(s + c * HB + i * L), m_new));
      V::Store(s + c * HB + i * L, pv);
      sum = V::Add(sum, pv);
    }
    V::Store(l + i * L, V::Fma(V::Load(l + i * L), a, sum));
    V::Store(m + i * L, m_new);
    V::Store(alpha + i * L, a);
  }
}

// Heads h0 .. h0 + blocks * HB - 1 of one token. Each chunk of the selection is dequantized once
// and then used by every head block of the item; a head block's operations are the same
// whatever the item holds, so grouping does not change a bit of the result.
template <class V, int NHV>
void MlaItem(const MlaWork& w, uint32_t token, uint32_t h0, uint32_t blocks,
             const MlaScratch& sc) {
  constexpr uint32_t HB = NHV * V::kLanes;
  const uint32_t dims = w.dims;
  const uint32_t heads = blocks * HB;
  for (uint32_t b = 0; b < blocks; ++b) {
    TransposeQueries(w.q, w.q_type, w.heads, dims, token, h0 + b * HB, HB,
                     sc.qt + uint64_t{b} * kMaxMlaDims * HB);
  }
  for (uint32_t h = 0; h < heads; ++h) {
    sc.m[h] = -std::numeric_limits<float>::infinity();
    sc.l[h] = 0.0f;
  }
  std::memset(sc.ot, 0, sizeof(float) * kValueDims * heads);
  const float* rows[kChunkEntries];
  for (uint32_t si = 0; si < w.num_sources; ++si) {
    const MlaSourceWork& src = w.sources[si];
    const int32_t* idx = src.indices + uint64_t{token} * src.indices_stride;
    uint32_t next = 0;
    while (next < src.top_k) {
      const uint32_t n = FillChunk(src, idx, &next, dims, sc.tile, rows);
      if (n == 0) break;
      for (uint32_t b = 0; b < blocks; ++b) {
        float* ot = sc.ot + uint64_t{b} * kValueDims * HB;
        ScoreRows<V, NHV>(sc.qt + uint64_t{b} * kMaxMlaDims * HB, rows, n, dims,
                          w.softmax_scale, sc.s);
        SoftmaxStep<V, NHV>(sc.s, n, sc.m + b * HB, sc.l + b * HB, sc.alpha + b * HB);
        ValueRows<V, NHV>(ot, sc.alpha + b * HB, sc.s, rows, n);
      }
    }
  }
  // Normalize, add the sink, write out[token, h, :] and lse.
  for (uint32_t hi = 0; hi < heads; ++hi) {
    const uint32_t b = hi / HB, h = hi % HB;
    const uint32_t head = h0 + hi;
    const uint64_t row = uint64_t{token} * w.heads + head;
    float* out = w.out + row * kValueDims;
    const float* ot = sc.ot + uint64_t{b} * kValueDims * HB;
    const float m = sc.m[hi];
    const float l = sc.l[hi];
    float lse;
    float factor;
    if (l == 0.0f) {  // nothing selected (or every weight underflowed to 0)
      lse = w.sink ? w.sink[head] : -std::numeric_limits<float>::infinity();
      factor = 0.0f;
    } else if (w.sink) {
      const float s = w.sink[head];
      const float mt = std::fmax(m, s);
      const float lt = l * std::exp(m - mt) + std::exp(s - mt);
      lse = mt + std::log(lt);
      factor = std::exp(m - mt) / lt;
    } else {
      lse = m + std::log(l);
      factor = 1.0f / l;
    }
    w.lse[row] = lse;
    for (uint32_t d = 0; d < kValueDims; ++d) out[d] = ot[d * HB + h] * factor;
  }
}

// logits[g] for G keys: Σ over head vectors of w * relu(qt · key), one horizontal sum at the end.
template <class V, int NHV, int G>
[[gnu::always_inline]] inline void IndexerGroup(const float* qt, const float* weights,
                                                uint32_t heads, const float* const* rows,
                                                uint32_t dims, float* logits) {
  using R = typename V::R;
  constexpr uint32_t L = V::kLanes, HB = NHV * L;
  R tot[G];
  SPARSEKV_UNROLL
  for (int g = 0; g < G; ++g) tot[g] = V::Zero();
  for (uint32_t hb = 0; hb < heads; hb += HB) {
    R acc[NHV][G];
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i)
      SPARSEKV_UNROLL
      for (int g = 0; g < G; ++g) acc[i][g] = V::Zero();
    for (uint32_t d = 0; d < dims; ++d) {
      R qv[NHV];
      SPARSEKV_UNROLL
      for (int i = 0; i < NHV; ++i) qv[i] = V::Pin(V::Load(qt + uint64_t{d} * heads + hb + i * L));
      SPARSEKV_UNROLL
      for (int g = 0; g < G; ++g) {
        const R k = V::Set1(rows[g][d]);
        SPARSEKV_UNROLL
        for (int i = 0; i < NHV; ++i) acc[i][g] = V::Fma(qv[i], k, acc[i][g]);
      }
    }
    SPARSEKV_UNROLL
    for (int i = 0; i < NHV; ++i) {
      const R wv = V::Load(weights + hb + i * L);
      // Max(0, x) keeps a NaN dot product NaN, so a poisoned key cannot pass as a zero logit.
      SPARSEKV_UNROLL
      for (int g = 0; g < G; ++g) tot[g] = V::Fma(wv, V::Max(V::Zero(), acc[i][g]), tot[g]);
    }
  }
  SPARSEKV_UNROLL
  for (int g = 0; g < G; ++g) logits[g] = V::ReduceAdd(tot[g]);
}

template <class V, int NHV, int G>
inline void IndexerTail(const float* qt, const float* weights, uint32_t heads,
                        const float* const* rows, uint32_t dims, float* logits, uint32_t n) {
  if constexpr (G > 0) {
    if (n == G) {
      IndexerGroup<V, NHV, G>(qt, weights, heads, rows, dims, logits);
    } else {
      IndexerTail<V, NHV, G - 1>(qt, weights, heads, rows, dims, logits, n);
    }
  }
}

template <class V, int NHV>
void IndexerRangeImpl(const IndexerWork& w, uint32_t token, BlockTable table, uint64_t begin,
                      uint64_t end, float* logits, const IndexerScratch& sc) {
  constexpr int G = 12 / NHV;
  const uint32_t heads = w.heads, dims = w.dims;
  TransposeQueries(w.q, w.q_type, heads, dims, token, 0, heads, sc.qt);
  const float* weights = w.weights + uint64_t{token} * heads;
  const PagedCacheView& v = *w.view;
  const float* rows[kChunkEntries];
  for (uint64_t k0 = begin; k0 < end; k0 += kChunkEntries) {
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(kChunkEntries, end - k0));
    // Keys of one page are consecutive slots: decode each page's run with one call.
    for (uint32_t c = 0; c < n;) {
      const uint64_t k = k0 + c;
      const uint32_t slot = static_cast<uint32_t>(k % v.block_entries);
      const uint32_t run = std::min(n - c, v.block_entries - slot);
      w.codec->DecodeEntriesFp32(v.Page(table[k / v.block_entries]), slot, run,
                                 sc.tile + uint64_t{c} * dims);
      for (uint32_t i = 0; i < run; ++i) rows[c + i] = sc.tile + uint64_t{c + i} * dims;
      c += run;
    }
    uint32_t g0 = 0;
    for (; g0 + G <= n; g0 += G)
      IndexerGroup<V, NHV, G>(sc.qt, weights, heads, rows + g0, dims, logits + k0 + g0);
    if (g0 < n)
      IndexerTail<V, NHV, G - 1>(sc.qt, weights, heads, rows + g0, dims, logits + k0 + g0,
                                 n - g0);
  }
}

template <class V>
void IndexerRange(const IndexerWork& w, uint32_t token, BlockTable table, uint64_t begin,
                  uint64_t end, float* logits, const IndexerScratch& sc) {
  const uint32_t vecs = w.heads / V::kLanes;
  if (vecs % 4 == 0) {
    IndexerRangeImpl<V, 4>(w, token, table, begin, end, logits, sc);
  } else if (vecs % 2 == 0) {
    IndexerRangeImpl<V, 2>(w, token, table, begin, end, logits, sc);
  } else {
    IndexerRangeImpl<V, 1>(w, token, table, begin, end, logits, sc);
  }
}

// The scores micro-kernel's shape (2 head vectors x 6 entries) over 64 dims of L1-resident data.
template <class V>
float PeakLoop(const float* data, uint64_t iterations) {
  using R = typename V::R;
  constexpr uint32_t L = V::kLanes, HB = 2 * L;
  const float* qt = data;
  const float* rows[6];
  SPARSEKV_UNROLL
  for (int g = 0; g < 6; ++g) rows[g] = data + 64 * kMaxHeadBlock + g * 64;
  R acc[2][6];
  SPARSEKV_UNROLL
  for (int i = 0; i < 2; ++i)
    SPARSEKV_UNROLL
    for (int g = 0; g < 6; ++g) acc[i][g] = V::Zero();
  for (uint64_t it = 0; it < iterations; ++it) {
    const uint32_t d = static_cast<uint32_t>(it & 63);
    const R q0 = V::Pin(V::Load(qt + d * HB)), q1 = V::Pin(V::Load(qt + d * HB + L));
    SPARSEKV_UNROLL
    for (int g = 0; g < 6; ++g) {
      const R k = V::Set1(rows[g][d]);
      acc[0][g] = V::Fma(q0, k, acc[0][g]);
      acc[1][g] = V::Fma(q1, k, acc[1][g]);
    }
  }
  R sum = V::Zero();
  SPARSEKV_UNROLL
  for (int i = 0; i < 2; ++i)
    SPARSEKV_UNROLL
    for (int g = 0; g < 6; ++g) sum = V::Add(sum, acc[i][g]);
  return V::ReduceAdd(sum);
}

template <class V>
PathKernels MakeKernels() {
  return PathKernels{V::kLanes,
                     &MlaItem<V, 2>,
                     &MlaItem<V, 1>,
                     &IndexerRange<V>,
                     &PeakLoop<V>,
                     uint64_t{2} * 12 * V::kLanes};
}

}  // namespace
}  // namespace sparsekv::attention
