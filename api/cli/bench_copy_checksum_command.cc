#include <cstdio>
#include <memory>

#include "cli/bench_report.h"
#include "cli/registry.h"
#include "copy_checksum_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(copy_checksum) {
  struct Args {
    bench::CopyChecksumBenchOptions options;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "copy-checksum", "A copy that computes a record's checksum as it goes, against copy-then-hash and memcpy");
  AddRoundOptions(cmd, args->options.rounds, args->options.round_seconds);
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    const auto r = bench::RunCopyChecksumBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    std::printf("%12s %12s %8s %10s %10s %10s %12s\n", "value bytes", "span bytes", "kernel", "fused", "two pass",
                "memcpy", "fused/2pass");
    for (const auto& row : (*report)["rows"]) {
      std::printf("%12llu %12llu %8s %10.2f %10.2f %10.2f %12.2f\n",
                  static_cast<unsigned long long>(row["value_bytes"].get<uint64_t>()),
                  static_cast<unsigned long long>(row["span_bytes"].get<uint64_t>()),
                  row["kernel"].get<std::string>().c_str(), row["fused_bytes_per_s"].get<double>() / 1e9,
                  row["two_pass_bytes_per_s"].get<double>() / 1e9, row["memcpy_bytes_per_s"].get<double>() / 1e9,
                  row["fused_vs_two_pass"].get<double>());
    }
    std::printf("(GB/s, medians of interleaved rounds)\n");
  });
}

}  // namespace sparsekv::cli
