#include <cstdio>
#include <memory>
#include <string>

#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"
#include "codec_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(codec) {
  struct Args {
    bench::CodecBenchOptions options;
    std::string path;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "codec", "Encode/decode throughput of every storage format against memcpy of the same bytes");
  AddRoundOptions(cmd, args->options.rounds, args->options.round_seconds);
  cmd->add_option("--working-set-bytes", args->options.working_set_bytes,
                  "bf16 bytes per operation (a multiple of 9216)")
      ->capture_default_str();
  cmd->add_option(
      "--path", args->path,
      "SIMD path: scalar, avx2, avx512, avx512_bf16 or neon (default: SPARSEKV_SIMD or the best)");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    if (!ParseSimdPathOption(args->path, args->options.path, exit_code)) return;
    const auto r = bench::RunCodecBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    const double mc = j["memcpy_bytes_per_s"].get<double>();
    std::printf("path %s, %llu bf16 bytes per operation, single thread\n",
                j["path"].get<std::string>().c_str(),
                static_cast<unsigned long long>(j["working_set_bytes"].get<uint64_t>()));
    std::printf("memcpy %.1f GB/s\n", mc / 1e9);
    std::printf("%-12s %12s %12s %12s %9s %9s\n", "format", "encode GB/s", "decode GB/s",
                "dec fp32", "enc/mc", "dec/mc");
    for (const auto& [name, f] : j["formats"].items()) {
      std::printf(
          "%-12s %12.1f %12.1f %12.1f %8.0f%% %8.0f%%\n", name.c_str(),
          f["encode_bytes_per_s"].get<double>() / 1e9, f["decode_bytes_per_s"].get<double>() / 1e9,
          f["decode_fp32_bytes_per_s"].get<double>() / 1e9,
          100 * f["encode_vs_memcpy"].get<double>(), 100 * f["decode_vs_memcpy"].get<double>());
    }
    std::printf("largest spread of a method across rounds: %.0f%%\n",
                100 * j["max_spread"].get<double>());
  });
}

}  // namespace sparsekv::cli
