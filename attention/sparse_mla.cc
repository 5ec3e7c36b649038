#include "sparsekv/sparse_mla.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "attention/kernels.h"
#include "attention/thread_team.h"

namespace sparsekv {

namespace {

bool MlaFormat(StorageFormat f) {
  return f == StorageFormat::kC8Mla || f == StorageFormat::kFp8DsMla ||
         f == StorageFormat::kBf16 || f == StorageFormat::kFp8V4;
}

Status CheckSource(const SparseMlaSource& src, const char* name, uint32_t tokens) {
  const uint32_t dims = src.view.dims;
  if (dims < kMlaValueDims || dims > attention::kMaxMlaDims) {
    return Status::InvalidArgument(fmt::format(
        "{} cache: entries of {} dims; sparse MLA reads 512 to 576 (512 values, then rope)", name,
        dims));
  }
  uint64_t limit = 0;
  if (src.rows != nullptr) {
    limit = src.num_rows;
  } else {
    if (Status s = src.view.Validate(); !s.ok()) return s.WithContext(fmt::format("{} cache", name));
    if (!MlaFormat(src.view.format)) {
      return Status::InvalidArgument(
          fmt::format("{} cache: format {} is not one sparse MLA reads (c8_mla, fp8_ds_mla, "
                      "bf16, fp8_v4)",
                      name, StorageFormatName(src.view.format)));
    }
    limit = src.view.num_entries();
  }
  if (src.top_k == 0) return Status::OK();
  if (src.indices == nullptr) {
    return Status::InvalidArgument(fmt::format("{} cache: top_k {} but no indices", name, src.top_k));
  }
  const uint64_t stride = src.indices_stride ? src.indices_stride : src.top_k;
  if (stride < src.top_k) {
    return Status::InvalidArgument(fmt::format("{} cache: indices_stride {} is less than top_k {}",
                                               name, stride, src.top_k));
  }
  for (uint32_t t = 0; t < tokens; ++t) {
    const int32_t* idx = src.indices + uint64_t{t} * stride;
    for (uint32_t j = 0; j < src.top_k; ++j) {
      const int32_t e = idx[j];
      if (e < -1 || (e >= 0 && uint64_t(e) >= limit)) {
        return Status::InvalidArgument(fmt::format(
            "{} cache: token {} index {} is {}, outside -1 .. {} (blocks x entries per block)",
            name, t, j, e, limit - 1));
      }
    }
  }
  return Status::OK();
}

}  // namespace

struct SparseMla::State {
  explicit State(uint32_t threads) : team(threads) {
    const uint64_t floats = uint64_t{attention::kMaxMlaDims} * attention::kMaxItemHeads +
                            uint64_t{attention::kValueDims} * attention::kMaxItemHeads +
                            uint64_t{attention::kChunkEntries} * attention::kMaxMlaDims +
                            uint64_t{attention::kChunkEntries} * attention::kMaxHeadBlock +
                            3 * attention::kMaxItemHeads;
    for (uint32_t t = 0; t < threads; ++t) {
      memory.push_back(attention::AllocFloats(floats));
      float* base = memory.back().get();
      attention::MlaScratch sc;
      sc.qt = base;
      sc.ot = sc.qt + attention::kMaxMlaDims * attention::kMaxItemHeads;
      sc.tile = sc.ot + attention::kValueDims * attention::kMaxItemHeads;
      sc.s = sc.tile + attention::kChunkEntries * attention::kMaxMlaDims;
      sc.m = sc.s + attention::kChunkEntries * attention::kMaxHeadBlock;
      sc.l = sc.m + attention::kMaxItemHeads;
      sc.alpha = sc.l + attention::kMaxItemHeads;
      scratch.push_back(sc);
    }
  }

  attention::ThreadTeam team;
  std::vector<attention::AlignedFloats> memory;
  std::vector<attention::MlaScratch> scratch;

  // Per run.
  attention::MlaWork work;
  void (*item_fn)(const attention::MlaWork&, uint32_t, uint32_t, uint32_t,
                  const attention::MlaScratch&) = nullptr;
  uint32_t head_block = 0;
  uint32_t blocks_per_token = 0;  // head blocks of a token
  uint32_t blocks_per_item = 0;   // head blocks sharing one dequantized chunk
  uint32_t items_per_token = 0;
};

SparseMla::SparseMla(const SparseMlaOptions& options, SimdPath path)
    : options_(options), path_(path), state_(std::make_unique<State>(options.threads)) {}

SparseMla::~SparseMla() = default;

Result<std::unique_ptr<SparseMla>> SparseMla::Create(const SparseMlaOptions& options) {
  if (options.threads == 0 || options.threads > 1024) {
    return Status::InvalidArgument(
        fmt::format("sparse MLA threads must be 1 to 1024 (got {})", options.threads));
  }
  const SimdPath path = options.simd_path.value_or(ActiveSimdPath());
  if (attention::KernelsFor(path) == nullptr) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported on this CPU", SimdPathName(path)));
  }
  return std::unique_ptr<SparseMla>(new SparseMla(options, path));
}

Status SparseMla::Run(const SparseMlaBatch& batch, const SparseMlaOutput& out) {
  if (batch.tokens == 0) return Status::OK();
  if (batch.q == nullptr || out.out == nullptr || out.lse == nullptr) {
    return Status::InvalidArgument("sparse MLA needs q, out and lse buffers");
  }
  if (batch.heads == 0) return Status::InvalidArgument("sparse MLA heads must be at least 1");
  if (!(std::isfinite(batch.softmax_scale) && batch.softmax_scale > 0)) {
    return Status::InvalidArgument(fmt::format(
        "sparse MLA softmax_scale must be finite and positive (got {})", batch.softmax_scale));
  }
  if (Status s = CheckSource(batch.main, "main", batch.tokens); !s.ok()) return s;
  if (batch.extra) {
    if (Status s = CheckSource(*batch.extra, "extra", batch.tokens); !s.ok()) return s;
    if (batch.extra->view.dims != batch.main.view.dims) {
      return Status::InvalidArgument(fmt::format(
          "extra cache has {} dims, main has {}; both must match the query", batch.extra->view.dims,
          batch.main.view.dims));
    }
  }

  State& st = *state_;
  const attention::PathKernels* kernels = attention::KernelsFor(path_);
  if (batch.heads % kernels->lanes != 0) kernels = attention::ScalarKernels();
  const uint32_t lanes = kernels->lanes;
  if (batch.heads % (2 * lanes) == 0) {
    st.item_fn = kernels->mla_item_2;
    st.head_block = 2 * lanes;
  } else {
    st.item_fn = kernels->mla_item_1;
    st.head_block = lanes;
  }
  st.blocks_per_token = batch.heads / st.head_block;
  // As many head blocks per item as fit (each chunk is dequantized once per item), but enough
  // items to keep every thread busy when there are few tokens. Any grouping gives the same bits.
  const uint32_t max_blocks = attention::kMaxItemHeads / st.head_block;
  const uint32_t threads = st.team.size();
  const uint32_t splits = batch.tokens >= threads ? 1 : (threads + batch.tokens - 1) / batch.tokens;
  st.blocks_per_item = std::max<uint32_t>(
      1, std::min(max_blocks, (st.blocks_per_token + splits - 1) / splits));
  st.items_per_token = (st.blocks_per_token + st.blocks_per_item - 1) / st.blocks_per_item;

  std::optional<PageCodec> codecs[2];
  const SparseMlaSource* sources[2] = {&batch.main, batch.extra ? &*batch.extra : nullptr};
  attention::MlaWork& w = st.work;
  w = attention::MlaWork{};
  w.q = batch.q;
  w.q_type = batch.q_type;
  w.heads = batch.heads;
  w.dims = batch.main.view.dims;
  w.softmax_scale = batch.softmax_scale;
  w.sink = batch.sink;
  w.out = out.out;
  w.lse = out.lse;
  for (int i = 0; i < 2; ++i) {
    const SparseMlaSource* src = sources[i];
    if (src == nullptr) continue;
    attention::MlaSourceWork& sw = w.sources[w.num_sources++];
    sw.view = &src->view;
    sw.rows = src->rows;
    sw.indices = src->indices;
    sw.top_k = src->top_k;
    sw.indices_stride = src->indices_stride ? src->indices_stride : src->top_k;
    if (src->rows == nullptr) {
      auto c = PageCodec::Create(src->view.format, src->view.dims, src->view.block_entries,
                                 CodecOptions{path_});
      if (!c.ok()) return c.status().WithContext(i == 0 ? "main cache" : "extra cache");
      codecs[i].emplace(*c);
      sw.codec = &*codecs[i];
    }
  }

  st.team.Run(
      batch.tokens * st.items_per_token,
      [](void* ctx, uint32_t item, uint32_t thread) {
        State& s = *static_cast<State*>(ctx);
        const uint32_t token = item / s.items_per_token;
        const uint32_t first = item % s.items_per_token * s.blocks_per_item;
        const uint32_t blocks = std::min(s.blocks_per_item, s.blocks_per_token - first);
        s.item_fn(s.work, token, first * s.head_block, blocks, s.scratch[thread]);
      },
      &st);
  return Status::OK();
}

}  // namespace sparsekv
