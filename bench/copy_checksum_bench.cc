#include "copy_checksum_bench.h"

#include <fmt/format.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "allocator/copy_checksum.h"
#include "allocator/xxhash_dispatch.h"
#include "bench_util.h"

namespace sparsekv::bench {
namespace {

// What Bundle::WriteRecord did before: copy a 64 KiB chunk, then hash it while it is in cache.
uint64_t TwoPass(unsigned char* dst, const unsigned char* src, size_t n, const unsigned char* prefix) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  XXH3_64bits_update(&st, prefix, kRecordChecksumPrefixBytes);
  for (size_t k = 0; k < n; k += 65536) {
    const size_t len = std::min<size_t>(65536, n - k);
    std::memcpy(dst + k, src + k, len);
    XXH3_64bits_update(&st, dst + k, len);
  }
  return XXH3_64bits_digest(&st);
}

}  // namespace

Result<nlohmann::json> RunCopyChecksumBench(const CopyChecksumBenchOptions& o) {
  nlohmann::json rows = nlohmann::json::array();
  std::mt19937_64 rng(3);
  for (const size_t n : {size_t{64} << 10, size_t{1} << 20, size_t{6} << 20}) {
    std::vector<unsigned char> src(n), prefix(kRecordChecksumPrefixBytes), joined(kRecordChecksumPrefixBytes + n);
    for (auto& c : src) c = static_cast<unsigned char>(rng());
    for (auto& c : prefix) c = static_cast<unsigned char>(rng());
    std::memcpy(joined.data(), prefix.data(), prefix.size());
    std::memcpy(joined.data() + prefix.size(), src.data(), n);
    const uint64_t want = XXH3_64bits(joined.data(), joined.size());
    for (const size_t span : {size_t{4} << 20, size_t{256} << 20}) {
      const size_t slots = std::max<size_t>(1, span / n);
      std::vector<unsigned char> dst(slots * n, 1);  // written once: no first touch in the rounds
      size_t next = 0;
      auto slot = [&] {
        unsigned char* d = dst.data() + (next % slots) * n;
        ++next;
        return d;
      };
      std::vector<std::pair<std::string, CopyChecksumKernel>> kernels;
      for (CopyChecksumKernel k : {CopyChecksumKernel::kScalar, CopyChecksumKernel::kAvx2, CopyChecksumKernel::kAvx512}) {
        if (!CopyChecksumKernelAvailable(k)) continue;
        if (CopyWithRecordChecksumOn(k, dst.data(), src.data(), n, prefix.data()) != want) {
          return Status::Internal(fmt::format("the {} kernel's checksum differs from XXH3_64bits",
                                             CopyChecksumKernelName(k)));
        }
        kernels.emplace_back(std::string(CopyChecksumKernelName(k)), k);
      }
      if (TwoPass(dst.data(), src.data(), n, prefix.data()) != want) return Status::Internal("two passes differ");
      std::vector<Method> methods;
      methods.emplace_back("fused", [&](uint64_t reps) {
        for (uint64_t r = 0; r < reps; ++r) DoNotOptimize(CopyWithRecordChecksum(slot(), src.data(), n, prefix.data()));
      });
      methods.emplace_back("two_pass", [&](uint64_t reps) {
        for (uint64_t r = 0; r < reps; ++r) DoNotOptimize(TwoPass(slot(), src.data(), n, prefix.data()));
      });
      methods.emplace_back("memcpy", [&](uint64_t reps) {
        for (uint64_t r = 0; r < reps; ++r) {
          unsigned char* d = slot();
          std::memcpy(d, src.data(), n);
          DoNotOptimize(d[0]);
        }
      });
      for (const auto& [name, k] : kernels) {
        if (k == ChosenCopyChecksumKernel()) continue;  // that is "fused"
        methods.emplace_back(name, [&, k = k](uint64_t reps) {
          for (uint64_t r = 0; r < reps; ++r) {
            DoNotOptimize(CopyWithRecordChecksumOn(k, slot(), src.data(), n, prefix.data()));
          }
        });
      }
      RunInterleaved(methods, o.round_seconds, o.rounds);
      nlohmann::json row;
      row["value_bytes"] = n;
      row["span_bytes"] = slots * n;
      row["kernel"] = CopyChecksumKernelName(ChosenCopyChecksumKernel());
      for (const Method& m : methods) row[m.name + "_bytes_per_s"] = MedianOf(methods, m.name) * static_cast<double>(n);
      row["fused_vs_two_pass"] = MedianOf(methods, "fused") / MedianOf(methods, "two_pass");
      row["fused_vs_memcpy"] = MedianOf(methods, "fused") / MedianOf(methods, "memcpy");
      row["samples"] = SamplesJson(methods);
      rows.push_back(std::move(row));
    }
  }
  nlohmann::json j;
  j["rows"] = std::move(rows);
  j["rounds"] = o.rounds;
  j["what"] = "copy a value into one of the destination span's slots (in turn) while computing XXH3-64 of a "
              "48-byte prefix and the value; two_pass: memcpy then XXH3 of each 64 KiB chunk; bytes per second, "
              "medians of interleaved rounds";
  return j;
}

}  // namespace sparsekv::bench
