#include "attention_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "attention/kernels.h"
#include "bench_util.h"
#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/lightning_indexer.h"
#include "sparsekv/sparse_mla.h"

namespace sparsekv::bench {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
using Buffer = std::unique_ptr<T, FreeDeleter>;

template <class T>
Buffer<T> Alloc(uint64_t count) {
  const uint64_t bytes = (count * sizeof(T) + 63) / 64 * 64;
  auto* p = static_cast<T*>(std::aligned_alloc(64, bytes));
  if (p != nullptr) std::memset(p, 0, bytes);  // fault the pages in before timing
  return Buffer<T>(p);
}

// A paged cache of one sequence: `blocks` pages in shuffled physical order, Gaussian content.
struct Cache {
  Buffer<std::byte> arena;
  PagedCacheView view;
  std::vector<uint32_t> table;
};

Result<Cache> MakeCache(StorageFormat format, uint32_t dims, uint32_t block_entries,
                        uint32_t blocks, uint32_t seed) {
  Cache c;
  c.view.format = format;
  c.view.dims = dims;
  c.view.block_entries = block_entries;
  c.view.num_blocks = blocks;
  c.view.block_stride = (FormatPageBytes(format, dims, block_entries) + 63) / 64 * 64;
  c.arena = Alloc<std::byte>(c.view.block_stride * blocks);
  if (!c.arena) return Status::ResourceExhausted("bench attention: cannot allocate the cache");
  c.view.base = c.arena.get();
  auto codec = PageCodec::Create(format, dims, block_entries);
  if (!codec.ok()) return codec.status();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(uint64_t{block_entries} * dims);
  for (uint32_t b = 0; b < blocks; ++b) {
    for (float& x : rows) x = normal(rng);
    if (Status s = codec->WriteTokens(c.arena.get() + b * c.view.block_stride, 0,
                                      RowsView::Fp32(rows.data(), block_entries, dims));
        !s.ok()) {
      return s;
    }
  }
  c.table.resize(blocks);
  std::iota(c.table.begin(), c.table.end(), 0u);
  std::shuffle(c.table.begin(), c.table.end(), rng);
  return c;
}

std::vector<uint16_t> RandomBf16(uint64_t n, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = Bf16FromFloat(normal(rng));
  return v;
}

// Copies entry `index` of `view` into slot `slot` of a dense page of `entries` entries of the
// same format: what a gather kernel does before it can dequantize.
void GatherEntry(const PagedCacheView& view, int32_t index, std::byte* dense, uint32_t entries,
                 uint32_t slot) {
  const std::byte* page = view.Page(static_cast<uint32_t>(index) / view.block_entries);
  const uint32_t s = static_cast<uint32_t>(index) % view.block_entries;
  if (view.format == StorageFormat::kFp8V4) {
    std::memcpy(dense + layout::Fp8V4DataOffset(slot), page + layout::Fp8V4DataOffset(s),
                layout::kV4DataBytes);
    std::memcpy(dense + layout::Fp8V4ScaleOffset(entries, slot),
                page + layout::Fp8V4ScaleOffset(view.block_entries, s), layout::kV4ScaleBytes);
    return;
  }
  const uint64_t bytes = FormatEntryBytes(view.format, view.dims);
  std::memcpy(dense + uint64_t{slot} * bytes, page + uint64_t{s} * bytes, bytes);
}

}  // namespace

Result<nlohmann::json> RunAttentionBench(const AttentionBenchOptions& o) {
  const uint32_t dims = o.format == StorageFormat::kFp8V4 ? layout::kV4Dims : layout::kMlaDims;
  if (o.format != StorageFormat::kC8Mla && o.format != StorageFormat::kFp8DsMla &&
      o.format != StorageFormat::kBf16 && o.format != StorageFormat::kFp8V4) {
    return Status::InvalidArgument(fmt::format(
        "bench attention: --format must be c8_mla, fp8_ds_mla, bf16 or fp8_v4 (got {})",
        StorageFormatName(o.format)));
  }
  if (o.tokens == 0 || o.heads == 0 || o.top_k == 0 || o.threads == 0 || o.block_tokens == 0 ||
      o.indexer_heads == 0) {
    return Status::InvalidArgument("bench attention: counts must be at least 1");
  }
  if (o.cache_tokens < o.top_k || o.cache_tokens % o.block_tokens != 0) {
    return Status::InvalidArgument(fmt::format(
        "bench attention: --cache-tokens {} must be at least --top-k {} and a multiple of "
        "--block-tokens {}",
        o.cache_tokens, o.top_k, o.block_tokens));
  }
  const SimdPath path = o.path.value_or(ActiveSimdPath());
  const attention::PathKernels* kernels = attention::KernelsFor(path);
  if (kernels == nullptr) {
    return Status::NotSupported(fmt::format("SIMD path {} is not supported on this CPU",
                                            SimdPathName(path)));
  }
  const uint32_t blocks = o.cache_tokens / o.block_tokens;

  // The caches: latent entries and indexer keys of one 64K-token sequence, same block table.
  auto latent = MakeCache(o.format, dims, o.block_tokens, blocks, 1);
  if (!latent.ok()) return latent.status();
  auto keys = MakeCache(o.indexer_format, 128, o.block_tokens, blocks, 2);
  if (!keys.ok()) return keys.status();
  keys->table = latent->table;  // one block table, as the cache manager hands out per pool

  // Indexer: the last token of the cache selects its top-k, which the MLA then reads.
  auto iq = RandomBf16(uint64_t{o.tokens} * o.indexer_heads * 128, 3, 1.0f);
  std::vector<float> iw(uint64_t{o.tokens} * o.indexer_heads, 1.0f / o.indexer_heads);
  std::vector<uint64_t> positions(o.tokens, o.cache_tokens - 1);
  std::vector<IndexerSequence> seqs = {{keys->table, latent->table, o.block_tokens}};
  IndexerBatch ib;
  ib.q = iq.data();
  ib.weights = iw.data();
  ib.tokens = o.tokens;
  ib.heads = o.indexer_heads;
  ib.sequences = seqs;
  ib.positions = positions.data();
  LightningIndexerOptions io;
  io.top_k = o.top_k;
  io.threads = o.threads;
  io.simd_path = path;
  auto indexer = LightningIndexer::Create(io);
  if (!indexer.ok()) return indexer.status();
  std::vector<int32_t> indices(uint64_t{o.tokens} * o.top_k);
  if (Status s = (*indexer)->Run(keys->view, ib, {indices.data()}); !s.ok()) return s;

  SparseMlaOptions mo;
  mo.threads = o.threads;
  mo.simd_path = path;
  auto mla = SparseMla::Create(mo);
  if (!mla.ok()) return mla.status();
  auto q = RandomBf16(uint64_t{o.tokens} * o.heads * dims, 4, 0.3f);
  SparseMlaBatch batch;
  batch.q = q.data();
  batch.tokens = o.tokens;
  batch.heads = o.heads;
  batch.softmax_scale = 1.0f / std::sqrt(192.0f);
  batch.main.view = latent->view;
  batch.main.indices = indices.data();
  batch.main.top_k = o.top_k;
  std::vector<float> out(uint64_t{o.tokens} * o.heads * kMlaValueDims);
  std::vector<float> lse(uint64_t{o.tokens} * o.heads);

  // Gather baseline buffers: one dense page of the selected entries per token, then fp32 rows.
  const uint64_t selected = uint64_t{o.tokens} * o.top_k;
  auto dense_page = Alloc<std::byte>(FormatPageBytes(o.format, dims, static_cast<uint32_t>(selected)));
  auto dense_rows = Alloc<float>(selected * dims);
  auto dense_codec =
      PageCodec::Create(o.format, dims, static_cast<uint32_t>(selected), CodecOptions{path});
  if (!dense_page || !dense_rows || !dense_codec.ok()) {
    return Status::ResourceExhausted("bench attention: cannot set up the gather baseline");
  }
  std::vector<int32_t> dense_indices(selected);
  SparseMlaBatch dense_batch = batch;
  dense_batch.main.rows = dense_rows.get();
  dense_batch.main.num_rows = selected;
  dense_batch.main.indices = dense_indices.data();
  std::vector<float> dense_out(out.size()), dense_lse(lse.size());
  uint64_t valid = 0;
  auto gather_run = [&]() -> Status {
    uint32_t n = 0;
    for (uint64_t i = 0; i < selected; ++i) {
      if (indices[i] < 0) {
        dense_indices[i] = -1;
        continue;
      }
      GatherEntry(latent->view, indices[i], dense_page.get(), static_cast<uint32_t>(selected), n);
      dense_indices[i] = static_cast<int32_t>(n++);
    }
    if (Status s = dense_codec->ReadTokens(dense_page.get(), 0,
                                           MutableRowsView::Fp32(dense_rows.get(), n, dims));
        !s.ok()) {
      return s;
    }
    valid = n;
    return (*mla)->Run(dense_batch, {dense_out.data(), dense_lse.data()});
  };

  // Both paths once, untimed: they must agree to the bit (same decode, same compute).
  if (Status s = (*mla)->Run(batch, {out.data(), lse.data()}); !s.ok()) return s;
  if (Status s = gather_run(); !s.ok()) return s;
  const bool identical = std::memcmp(out.data(), dense_out.data(), out.size() * 4) == 0 &&
                         std::memcmp(lse.data(), dense_lse.data(), lse.size() * 4) == 0;

  // The dot-product loop: the scores micro-kernel over L1-resident data, on every thread.
  auto peak_data = Alloc<float>(attention::kPeakDataFloats);
  for (uint32_t i = 0; i < attention::kPeakDataFloats; ++i) peak_data.get()[i] = 1e-3f * (i % 97);
  float peak_sink = 0;
  auto peak_body = [&](uint64_t n) {
    std::vector<std::thread> extra;
    std::vector<float> sums(o.threads, 0.0f);
    for (uint32_t t = 1; t < o.threads; ++t) {
      extra.emplace_back([&, t] { sums[t] = kernels->peak_loop(peak_data.get(), n); });
    }
    sums[0] = kernels->peak_loop(peak_data.get(), n);
    for (auto& th : extra) th.join();
    for (float s : sums) peak_sink += s;
  };

  Status run_status;
  std::vector<Method> methods;
  methods.emplace_back("sparse_mla", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      Status s = (*mla)->Run(batch, {out.data(), lse.data()});
      if (!s.ok()) run_status = s;
    }
  });
  methods.emplace_back("gather_baseline", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      Status s = gather_run();
      if (!s.ok()) run_status = s;
    }
  });
  methods.emplace_back("indexer", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      Status s = (*indexer)->Run(keys->view, ib, {indices.data()});
      if (!s.ok()) run_status = s;
    }
  });
  // 1M iterations per operation, so the loop's rate is comparable in size to the others.
  constexpr uint64_t kPeakIterations = 1 << 20;
  methods.emplace_back("peak", [&](uint64_t n) { peak_body(n * kPeakIterations); });
  RunInterleaved(methods, o.round_seconds, o.rounds);
  if (!run_status.ok()) return run_status;
  DoNotOptimize(peak_sink);

  const double mla_flops = double(o.heads) * double(valid) * 2.0 * (dims + kMlaValueDims);
  const double indexer_flops =
      double(o.tokens) * double(o.cache_tokens) * o.indexer_heads * 128 * 2.0;
  const double peak_flops =
      double(kPeakIterations) * double(kernels->peak_flops_per_iteration) * o.threads;
  const double mla_g = MedianOf(methods, "sparse_mla") * mla_flops / 1e9;
  const double gather = MedianOf(methods, "gather_baseline") * mla_flops / 1e9;
  const double idx = MedianOf(methods, "indexer") * indexer_flops / 1e9;
  const double peak = MedianOf(methods, "peak") * peak_flops / 1e9;
  double max_spread = 0;
  for (const Method& m : methods) max_spread = std::max(max_spread, m.samples.Spread());

  nlohmann::json j;
  j["sparse_mla_gflops"] = mla_g;
  j["gather_baseline_gflops"] = gather;
  j["indexer_gflops"] = idx;
  j["peak_gflops"] = peak;
  j["sparse_mla_vs_peak"] = peak > 0 ? mla_g / peak : 0;
  j["sparse_mla_vs_gather"] = gather > 0 ? mla_g / gather : 0;
  j["indexer_vs_peak"] = peak > 0 ? idx / peak : 0;
  j["outputs_identical"] = identical;
  j["path"] = std::string(SimdPathName(path));
  j["threads"] = o.threads;
  j["tokens"] = o.tokens;
  j["heads"] = o.heads;
  j["top_k"] = o.top_k;
  j["selected_entries"] = valid;
  j["cache_tokens"] = o.cache_tokens;
  j["format"] = std::string(StorageFormatName(o.format));
  j["dims"] = dims;
  j["indexer_heads"] = o.indexer_heads;
  j["indexer_format"] = std::string(StorageFormatName(o.indexer_format));
  j["sparse_mla_ms_per_call"] = 1e3 / MedianOf(methods, "sparse_mla");
  j["gather_baseline_ms_per_call"] = 1e3 / MedianOf(methods, "gather_baseline");
  j["indexer_ms_per_call"] = 1e3 / MedianOf(methods, "indexer");
  j["samples"] = SamplesJson(methods);
  j["max_spread"] = max_spread;
  return j;
}

}  // namespace sparsekv::bench
