#include "sparsekv/lightning_indexer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <vector>

#include "attention/kernels.h"
#include "attention/thread_team.h"
#include "attention/top_k.h"

namespace sparsekv {

namespace {

// Keys per logits item: small enough that one token's 64K keys spread over every thread,
// large enough that the transposed queries are reused a few thousand times.
constexpr uint64_t kKeysPerItem = 4096;

}  // namespace

struct LightningIndexer::State {
  explicit State(uint32_t threads) : team(threads), scratch(threads) {}

  struct ThreadScratch {
    attention::AlignedFloats qt, tile;
    uint64_t qt_floats = 0, tile_floats = 0;
    std::vector<uint32_t> selected;
  };
  struct Item {
    uint32_t token;
    uint64_t begin, end;
  };
  struct TokenPlan {
    uint32_t sequence;
    uint64_t visible;
  };

  attention::ThreadTeam team;
  std::vector<ThreadScratch> scratch;
  std::vector<float> logits;  // used when the caller does not ask for logits
  std::vector<Item> items;
  std::vector<TokenPlan> plans;

  // Per run.
  const attention::PathKernels* kernels = nullptr;
  attention::IndexerWork work;
  const IndexerBatch* batch = nullptr;
  const IndexerOutput* out = nullptr;
  float* logits_base = nullptr;
  uint64_t logits_stride = 0;
  uint32_t top_k = 0;
};

LightningIndexer::LightningIndexer(const LightningIndexerOptions& options, SimdPath path)
    : options_(options), path_(path), state_(std::make_unique<State>(options.threads)) {}

LightningIndexer::~LightningIndexer() = default;

Result<std::unique_ptr<LightningIndexer>> LightningIndexer::Create(
    const LightningIndexerOptions& options) {
  if (options.top_k == 0) return Status::InvalidArgument("indexer top_k must be at least 1");
  if (options.threads == 0 || options.threads > 1024) {
    return Status::InvalidArgument(
        fmt::format("indexer threads must be 1 to 1024 (got {})", options.threads));
  }
  const SimdPath path = options.simd_path.value_or(ActiveSimdPath());
  if (attention::KernelsFor(path) == nullptr) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported on this CPU", SimdPathName(path)));
  }
  return std::unique_ptr<LightningIndexer>(new LightningIndexer(options, path));
}

Status LightningIndexer::Run(const PagedCacheView& keys, const IndexerBatch& batch,
                             const IndexerOutput& out) {
  if (keys.format != StorageFormat::kIdxFp8 && keys.format != StorageFormat::kIdxC8 &&
      keys.format != StorageFormat::kBf16) {
    return Status::InvalidArgument(fmt::format(
        "indexer keys must be idx_fp8, idx_c8 or bf16 (got {})", StorageFormatName(keys.format)));
  }
  if (Status s = keys.Validate(); !s.ok()) return s.WithContext("indexer keys");
  if (batch.tokens == 0) return Status::OK();
  if (batch.q == nullptr || batch.weights == nullptr || batch.positions == nullptr ||
      out.indices == nullptr) {
    return Status::InvalidArgument("indexer needs q, weights, positions and an indices buffer");
  }
  if (batch.heads == 0) return Status::InvalidArgument("indexer heads must be at least 1");
  if (batch.key_ratio == 0) return Status::InvalidArgument("indexer key_ratio must be at least 1");
  if (batch.sequences.empty()) return Status::InvalidArgument("indexer batch has no sequences");

  State& st = *state_;
  st.plans.resize(batch.tokens);
  uint64_t max_visible = 0;
  for (uint32_t t = 0; t < batch.tokens; ++t) {
    const uint32_t seq = batch.token_sequence ? batch.token_sequence[t] : 0;
    if (seq >= batch.sequences.size()) {
      return Status::InvalidArgument(fmt::format("token {} names sequence {} of a batch of {}", t,
                                                 seq, batch.sequences.size()));
    }
    const uint64_t pos = batch.positions[t];
    if (pos >= uint64_t{std::numeric_limits<int32_t>::max()}) {
      return Status::InvalidArgument(
          fmt::format("token {} has position {}, past what a 32-bit index reaches", t, pos));
    }
    const uint64_t visible = (pos + 1) / batch.key_ratio;
    const IndexerSequence& s = batch.sequences[seq];
    const uint64_t need_blocks = (visible + keys.block_entries - 1) / keys.block_entries;
    if (s.key_blocks.size() < need_blocks) {
      return Status::InvalidArgument(fmt::format(
          "token {} at position {} sees {} keys but sequence {} has {} key blocks of {}", t, pos,
          visible, seq, s.key_blocks.size(), keys.block_entries));
    }
    for (uint64_t b = 0; b < need_blocks; ++b) {
      if (s.key_blocks[b] >= keys.num_blocks) {
        return Status::InvalidArgument(fmt::format("sequence {} key block {} is page {}, past the "
                                                   "{} pages of the view",
                                                   seq, b, s.key_blocks[b], keys.num_blocks));
      }
    }
    const BlockTable target = s.target_blocks.empty() ? s.key_blocks : s.target_blocks;
    const uint32_t tbe = s.target_block_entries ? s.target_block_entries : keys.block_entries;
    if (uint64_t{target.size()} * tbe < visible) {
      return Status::InvalidArgument(fmt::format(
          "sequence {}: its target block table ({} blocks of {}) cannot address the {} keys token "
          "{} sees",
          seq, target.size(), tbe, visible, t));
    }
    const uint64_t target_blocks = (visible + tbe - 1) / tbe;
    for (uint64_t b = 0; b < target_blocks; ++b) {
      if (uint64_t{target[b]} * tbe + tbe - 1 > uint64_t{std::numeric_limits<int32_t>::max()}) {
        return Status::InvalidArgument(fmt::format(
            "sequence {}: target block {} is page {}, past what a 32-bit index reaches", seq, b,
            target[b]));
      }
    }
    st.plans[t] = {seq, visible};
    max_visible = std::max(max_visible, visible);
  }

  const SimdPath path = path_;
  const attention::PathKernels* kernels = attention::KernelsFor(path);
  if (batch.heads % kernels->lanes != 0) kernels = attention::ScalarKernels();
  auto codec = PageCodec::Create(keys.format, keys.dims, keys.block_entries,
                                 CodecOptions{path});
  if (!codec.ok()) return codec.status().WithContext("indexer keys");

  if (out.logits != nullptr) {
    if (out.logits_stride < max_visible) {
      return Status::InvalidArgument(fmt::format(
          "indexer logits_stride {} is less than the {} keys a token sees", out.logits_stride,
          max_visible));
    }
    st.logits_base = out.logits;
    st.logits_stride = out.logits_stride;
  } else {
    const uint64_t need = uint64_t{batch.tokens} * std::max<uint64_t>(max_visible, 1);
    if (st.logits.size() < need) st.logits.resize(need);
    st.logits_base = st.logits.data();
    st.logits_stride = std::max<uint64_t>(max_visible, 1);
  }
  for (auto& sc : st.scratch) {
    const uint64_t qt = uint64_t{keys.dims} * batch.heads;
    const uint64_t tile = uint64_t{attention::kChunkEntries} * keys.dims;
    if (sc.qt_floats < qt) sc.qt = attention::AllocFloats(sc.qt_floats = qt);
    if (sc.tile_floats < tile) sc.tile = attention::AllocFloats(sc.tile_floats = tile);
    if (sc.selected.size() < options_.top_k) sc.selected.resize(options_.top_k);
  }

  st.items.clear();
  for (uint32_t t = 0; t < batch.tokens; ++t) {
    for (uint64_t b = 0; b < st.plans[t].visible; b += kKeysPerItem) {
      st.items.push_back({t, b, std::min(st.plans[t].visible, b + kKeysPerItem)});
    }
  }
  st.kernels = kernels;
  st.work.view = &keys;
  st.work.codec = &*codec;
  st.work.q = batch.q;
  st.work.q_type = batch.q_type;
  st.work.weights = batch.weights;
  st.work.heads = batch.heads;
  st.work.dims = keys.dims;
  st.batch = &batch;
  st.out = &out;
  st.top_k = options_.top_k;

  st.team.Run(
      static_cast<uint32_t>(st.items.size()),
      [](void* ctx, uint32_t i, uint32_t thread) {
        State& s = *static_cast<State*>(ctx);
        const State::Item& item = s.items[i];
        const uint32_t seq = s.plans[item.token].sequence;
        auto& sc = s.scratch[thread];
        s.kernels->indexer_range(s.work, item.token, s.batch->sequences[seq].key_blocks,
                                 item.begin, item.end,
                                 s.logits_base + uint64_t{item.token} * s.logits_stride,
                                 attention::IndexerScratch{sc.qt.get(), sc.tile.get()});
      },
      &st);

  st.team.Run(
      batch.tokens,
      [](void* ctx, uint32_t t, uint32_t thread) {
        State& s = *static_cast<State*>(ctx);
        const uint64_t visible = s.plans[t].visible;
        const IndexerSequence& seq = s.batch->sequences[s.plans[t].sequence];
        const BlockTable target = seq.target_blocks.empty() ? seq.key_blocks : seq.target_blocks;
        const uint32_t tbe =
            seq.target_block_entries ? seq.target_block_entries : s.work.view->block_entries;
        const float* logits = s.logits_base + uint64_t{t} * s.logits_stride;
        uint32_t* selected = s.scratch[thread].selected.data();
        const uint32_t n =
            attention::SelectTopK(logits, static_cast<uint32_t>(visible), s.top_k, selected);
        int32_t* idx = s.out->indices + uint64_t{t} * s.top_k;
        float* top = s.out->top_logits ? s.out->top_logits + uint64_t{t} * s.top_k : nullptr;
        for (uint32_t i = 0; i < n; ++i) {
          idx[i] = PhysicalIndex(target, tbe, selected[i]);
          if (top) top[i] = logits[selected[i]];
        }
        for (uint32_t i = n; i < s.top_k; ++i) {
          idx[i] = -1;
          if (top) top[i] = -std::numeric_limits<float>::infinity();
        }
      },
      &st);
  return Status::OK();
}

}  // namespace sparsekv
