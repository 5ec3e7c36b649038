#include "attention/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "sparsekv/bf16.h"

namespace sparsekv::attention {

namespace {

double Query(const void* q, RowType type, uint64_t i) {
  return type == RowType::kFp32 ? static_cast<const float*>(q)[i]
                                : Bf16ToFloat(static_cast<const uint16_t*>(q)[i]);
}

}  // namespace

Result<std::vector<float>> DequantizeEntry(const PagedCacheView& view, uint64_t index) {
  auto codec = PageCodec::Create(view.format, view.dims, view.block_entries,
                                 CodecOptions{SimdPath::kScalar});
  if (!codec.ok()) return codec.status();
  std::vector<float> row(view.dims);
  const uint32_t block = static_cast<uint32_t>(index / view.block_entries);
  const uint32_t slot = static_cast<uint32_t>(index % view.block_entries);
  if (Status s = codec->ReadTokens(view.Page(block), slot,
                                   MutableRowsView::Fp32(row.data(), 1, view.dims));
      !s.ok()) {
    return s;
  }
  return row;
}

Result<ReferenceIndexerResult> ReferenceIndexer(const PagedCacheView& keys,
                                                const IndexerBatch& batch, uint32_t top_k) {
  ReferenceIndexerResult r;
  r.logits.resize(batch.tokens);
  r.indices.assign(uint64_t{batch.tokens} * top_k, -1);
  const uint32_t dims = keys.dims;
  for (uint32_t t = 0; t < batch.tokens; ++t) {
    const uint32_t seq = batch.token_sequence ? batch.token_sequence[t] : 0;
    const IndexerSequence& s = batch.sequences[seq];
    const uint64_t visible = (batch.positions[t] + 1) / batch.key_ratio;
    std::vector<double>& logits = r.logits[t];
    logits.resize(visible);
    for (uint64_t k = 0; k < visible; ++k) {
      const uint64_t phys = uint64_t{s.key_blocks[k / keys.block_entries]} * keys.block_entries +
                            k % keys.block_entries;
      auto key = DequantizeEntry(keys, phys);
      if (!key.ok()) return key.status();
      double logit = 0;
      for (uint32_t h = 0; h < batch.heads; ++h) {
        double dot = 0;
        for (uint32_t d = 0; d < dims; ++d) {
          dot += Query(batch.q, batch.q_type, (uint64_t{t} * batch.heads + h) * dims + d) *
                 double{(*key)[d]};
        }
        const double relu = std::isnan(dot) ? dot : std::max(dot, 0.0);
        logit += double{batch.weights[uint64_t{t} * batch.heads + h]} * relu;
      }
      logits[k] = logit;
    }
    std::vector<uint64_t> order(visible);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
      const bool na = std::isnan(logits[a]), nb = std::isnan(logits[b]);
      if (na != nb) return nb;  // numbers before NaN
      if (na) return false;
      return logits[a] > logits[b];
    });
    order.resize(std::min<uint64_t>(top_k, visible));
    std::sort(order.begin(), order.end());
    const BlockTable target = s.target_blocks.empty() ? s.key_blocks : s.target_blocks;
    const uint32_t tbe = s.target_block_entries ? s.target_block_entries : keys.block_entries;
    for (uint64_t i = 0; i < order.size(); ++i) {
      r.indices[uint64_t{t} * top_k + i] = PhysicalIndex(target, tbe, order[i]);
    }
  }
  return r;
}

Status ReferenceSparseMla(const SparseMlaBatch& batch, std::vector<float>* out,
                          std::vector<float>* lse) {
  const uint32_t dims = batch.main.view.dims;
  out->assign(uint64_t{batch.tokens} * batch.heads * kMlaValueDims, 0.0f);
  lse->assign(uint64_t{batch.tokens} * batch.heads, 0.0f);
  for (uint32_t t = 0; t < batch.tokens; ++t) {
    // Every selected entry of both caches, dequantized.
    std::vector<std::vector<float>> entries;
    for (const SparseMlaSource* src : {&batch.main, batch.extra ? &*batch.extra : nullptr}) {
      if (src == nullptr) continue;
      const uint64_t stride = src->indices_stride ? src->indices_stride : src->top_k;
      for (uint32_t j = 0; j < src->top_k; ++j) {
        const int32_t e = src->indices[uint64_t{t} * stride + j];
        if (e < 0) continue;
        if (src->rows != nullptr) {
          entries.emplace_back(src->rows + uint64_t(e) * dims, src->rows + uint64_t(e + 1) * dims);
        } else {
          auto row = DequantizeEntry(src->view, uint64_t(e));
          if (!row.ok()) return row.status();
          entries.push_back(std::move(*row));
        }
      }
    }
    for (uint32_t h = 0; h < batch.heads; ++h) {
      const uint64_t row = uint64_t{t} * batch.heads + h;
      std::vector<double> scores(entries.size());
      double m = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < entries.size(); ++j) {
        double dot = 0;
        for (uint32_t d = 0; d < dims; ++d) {
          dot += Query(batch.q, batch.q_type, row * dims + d) * double{entries[j][d]};
        }
        scores[j] = dot * batch.softmax_scale;
        m = std::max(m, scores[j]);
      }
      const bool has_sink = batch.sink != nullptr;
      const double sink = has_sink ? batch.sink[h] : 0;
      if (has_sink) m = std::max(m, sink);
      if (entries.empty()) {
        (*lse)[row] = has_sink ? static_cast<float>(sink) : -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = has_sink ? std::exp(sink - m) : 0;
      std::vector<double> acc(kMlaValueDims, 0.0);
      for (size_t j = 0; j < entries.size(); ++j) {
        const double p = std::exp(scores[j] - m);
        sum += p;
        for (uint32_t d = 0; d < kMlaValueDims; ++d) acc[d] += p * entries[j][d];
      }
      for (uint32_t d = 0; d < kMlaValueDims; ++d) {
        (*out)[row * kMlaValueDims + d] = static_cast<float>(acc[d] / sum);
      }
      (*lse)[row] = static_cast<float>(m + std::log(sum));
    }
  }
  return Status::OK();
}

double CalcDiff(const float* x, const float* y, uint64_t n) {
  double xy = 0, xx = 0, yy = 0;
  for (uint64_t i = 0; i < n; ++i) {
    xy += double{x[i]} * y[i];
    xx += double{x[i]} * x[i];
    yy += double{y[i]} * y[i];
  }
  if (xx + yy == 0) return 0;
  return 1 - 2 * xy / (xx + yy);
}

double CalcDiff(const std::vector<double>& x, const float* y, uint64_t n) {
  double xy = 0, xx = 0, yy = 0;
  for (uint64_t i = 0; i < n; ++i) {
    xy += x[i] * y[i];
    xx += x[i] * x[i];
    yy += double{y[i]} * y[i];
  }
  if (xx + yy == 0) return 0;
  return 1 - 2 * xy / (xx + yy);
}

}  // namespace sparsekv::attention
