#include <cstdio>
#include <memory>

#include "alloc_bench.h"
#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(alloc) {
  struct Args {
    bench::AllocBenchOptions options;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("alloc", "Page-pool allocate+free pairs against malloc/free");
  AddRoundOptions(cmd, args->options.rounds, args->options.round_seconds);
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    const auto r = bench::RunAllocBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    std::printf("page of %llu bytes (one V3.2 bf16 MLA block)\n",
                static_cast<unsigned long long>(j["page_bytes"].get<uint64_t>()));
    std::printf("pool (thread cache) %.1f M pairs/s   malloc %.1f M pairs/s   ratio %.2fx\n",
                j["pool_pairs_per_s"].get<double>() / 1e6, j["malloc_pairs_per_s"].get<double>() / 1e6,
                j["ratio"].get<double>());
    std::printf("pool (locked) %.1f M/s   pool (batch 32) %.1f M/s\n",
                j["pool_locked_pairs_per_s"].get<double>() / 1e6, j["pool_batch_pairs_per_s"].get<double>() / 1e6);
    std::printf("burst of 64: pool %.1f M/s   malloc %.1f M/s   ratio %.2fx\n",
                j["pool_burst_pairs_per_s"].get<double>() / 1e6, j["malloc_burst_pairs_per_s"].get<double>() / 1e6,
                j["burst_ratio"].get<double>());
  });
}

}  // namespace sparsekv::cli
