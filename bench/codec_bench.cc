#include "codec_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/storage_format.h"

namespace sparsekv::bench {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Buffer AllocBuffer(uint64_t bytes) {
  const uint64_t rounded = (bytes + 63) / 64 * 64;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
  if (p != nullptr) std::memset(p, 0, rounded);  // fault the pages in before timing
  return Buffer(p);
}

struct FormatCase {
  StorageFormat format;
  uint32_t dims;
};

// One realistic shape per format: the V3.2 MLA latent, V4's 512-dim entries, the 128-dim
// indexer keys, bf16 MLA rows, and fp32 rows as wide as V4's compressor state.
constexpr FormatCase kCases[] = {
    {StorageFormat::kBf16, layout::kMlaDims},
    {StorageFormat::kFp32, 512},
    {StorageFormat::kC8Mla, layout::kMlaDims},
    {StorageFormat::kFp8DsMla, layout::kMlaDims},
    {StorageFormat::kFp8V4, layout::kV4Dims},
    {StorageFormat::kIdxFp8, 128},
    {StorageFormat::kIdxC8, 128},
};
constexpr uint32_t kEntriesPerPage = 128;  // one token block of a ratio-1 kind

struct FormatRun {
  FormatCase c;
  PageCodec codec;
  uint32_t rows;
  uint32_t pages;
  uint64_t page_stride;
  Buffer page_buf;
};

}  // namespace

Result<nlohmann::json> RunCodecBench(const CodecBenchOptions& options) {
  const uint64_t ws = options.working_set_bytes;
  if (ws == 0 || ws % kCodecBenchRowGranule != 0) {
    return Status::InvalidArgument(fmt::format(
        "working set of {} bytes: expected a positive multiple of {} (whole rows of every format)",
        ws, kCodecBenchRowGranule));
  }
  if (options.rounds < 1) return Status::InvalidArgument("rounds must be at least 1");
  const SimdPath path = options.path.value_or(ActiveSimdPath());
  if (!SimdPathSupported(path)) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported by this CPU", SimdPathName(path)));
  }

  // Gaussian values whose magnitude changes every 64 values, as activations vary; fixed seed.
  const uint64_t n_values = ws / 2;
  Buffer bf16_rows = AllocBuffer(ws);
  Buffer bf16_out = AllocBuffer(ws);
  Buffer fp32_out = AllocBuffer(2 * ws);
  Buffer copy_dst = AllocBuffer(ws);
  if (!bf16_rows || !bf16_out || !fp32_out || !copy_dst)
    return Status::ResourceExhausted("bench buffers");
  {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> magnitude(0.25f, 4.0f);
    auto* v = reinterpret_cast<uint16_t*>(bf16_rows.get());
    float mag = 1.0f;
    for (uint64_t i = 0; i < n_values; ++i) {
      if (i % 64 == 0) mag = magnitude(rng);
      v[i] = Bf16FromFloat(normal(rng) * mag);
    }
  }

  std::vector<FormatRun> runs;
  for (const FormatCase& c : kCases) {
    CodecOptions co;
    co.simd_path = path;
    SPARSEKV_ASSIGN_OR_RETURN(PageCodec codec,
                              PageCodec::Create(c.format, c.dims, kEntriesPerPage, co));
    const uint32_t rows = static_cast<uint32_t>(ws / (uint64_t{c.dims} * 2));
    const uint32_t pages = (rows + kEntriesPerPage - 1) / kEntriesPerPage;
    // Pages 64-byte aligned, as a pool's layer stride keeps them.
    const uint64_t stride = (codec.page_bytes() + 63) / 64 * 64;
    Buffer buf = AllocBuffer(stride * pages);
    if (!buf) return Status::ResourceExhausted("bench pages");
    runs.push_back(FormatRun{c, codec, rows, pages, stride, std::move(buf)});
  }

  uint64_t failures = 0;
  std::vector<Method> methods;
  methods.emplace_back("memcpy", [&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(copy_dst.get(), bf16_rows.get(), ws);
      DoNotOptimize(copy_dst.get());
    }
  });
  for (FormatRun& r : runs) {
    const std::string name(StorageFormatName(r.c.format));
    auto for_pages = [&r](auto&& fn) {
      for (uint32_t p = 0; p < r.pages; ++p) {
        const uint32_t first = p * kEntriesPerPage;
        const uint32_t count = std::min(kEntriesPerPage, r.rows - first);
        fn(r.page_buf.get() + p * r.page_stride, first, count);
      }
    };
    const uint32_t dims = r.c.dims;
    methods.emplace_back(name + ".encode", [&, for_pages, dims](uint64_t n) {
      const auto* src = reinterpret_cast<const uint16_t*>(bf16_rows.get());
      for (uint64_t i = 0; i < n; ++i) {
        for_pages([&](uint8_t* page, uint32_t first, uint32_t count) {
          if (!r.codec
                   .WriteTokens(page, 0, RowsView::Bf16(src + uint64_t{first} * dims, count, dims))
                   .ok()) {
            ++failures;
          }
        });
        DoNotOptimize(r.page_buf.get());
      }
    });
    methods.emplace_back(name + ".decode", [&, for_pages, dims](uint64_t n) {
      auto* dst = reinterpret_cast<uint16_t*>(bf16_out.get());
      for (uint64_t i = 0; i < n; ++i) {
        for_pages([&](uint8_t* page, uint32_t first, uint32_t count) {
          if (!r.codec
                   .ReadTokens(page, 0,
                               MutableRowsView::Bf16(dst + uint64_t{first} * dims, count, dims))
                   .ok()) {
            ++failures;
          }
        });
        DoNotOptimize(bf16_out.get());
      }
    });
    methods.emplace_back(name + ".decode_fp32", [&, for_pages, dims](uint64_t n) {
      auto* dst = reinterpret_cast<float*>(fp32_out.get());
      for (uint64_t i = 0; i < n; ++i) {
        for_pages([&](uint8_t* page, uint32_t first, uint32_t count) {
          if (!r.codec
                   .ReadTokens(page, 0,
                               MutableRowsView::Fp32(dst + uint64_t{first} * dims, count, dims))
                   .ok()) {
            ++failures;
          }
        });
        DoNotOptimize(fp32_out.get());
      }
    });
  }
  // Encode once first so the decode methods read real pages even if they are calibrated first.
  for (size_t i = 1; i < methods.size(); i += 3) methods[i].body(1);

  RunInterleaved(methods, options.round_seconds, options.rounds);
  if (failures) return Status::Internal(fmt::format("codec bench: {} calls failed", failures));

  const double bytes = static_cast<double>(ws);
  const double memcpy_bps = MedianOf(methods, "memcpy") * bytes;
  nlohmann::json formats = nlohmann::json::object();
  for (const FormatRun& r : runs) {
    const std::string name(StorageFormatName(r.c.format));
    const double enc = MedianOf(methods, name + ".encode") * bytes;
    const double dec = MedianOf(methods, name + ".decode") * bytes;
    formats[name] = {{"encode_bytes_per_s", enc},
                     {"decode_bytes_per_s", dec},
                     {"decode_fp32_bytes_per_s", MedianOf(methods, name + ".decode_fp32") * bytes},
                     {"encode_vs_memcpy", memcpy_bps > 0 ? enc / memcpy_bps : 0},
                     {"decode_vs_memcpy", memcpy_bps > 0 ? dec / memcpy_bps : 0},
                     {"rows", r.rows},
                     {"dims", r.c.dims},
                     {"entries_per_page", kEntriesPerPage},
                     {"pages", r.pages}};
  }
  nlohmann::json samples = nlohmann::json::object();
  double max_spread = 0;
  for (const Method& m : methods) {
    nlohmann::json s = m.samples.ToJson();
    s["spread"] = m.samples.Spread();
    max_spread = std::max(max_spread, m.samples.Spread());
    samples[m.name] = s;
  }
  nlohmann::json out;
  out["formats"] = formats;
  out["memcpy_bytes_per_s"] = memcpy_bps;
  out["path"] = SimdPathName(path);
  out["working_set_bytes"] = ws;
  out["samples"] = samples;
  out["max_spread"] = max_spread;
  out["rounds"] = options.rounds;
  out["round_seconds"] = options.round_seconds;
  out["note"] =
      "single thread; bytes are bf16 row bytes (encode input, decode output; decode_fp32 counted "
      "the same); "
      "medians of interleaved rounds; spread = (max - min) / median per method";
  return out;
}

}  // namespace sparsekv::bench
