#include <cstdio>
#include <memory>

#include "cache_bench.h"
#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(cache) {
  struct Args {
    bench::CacheBenchOptions options;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "cache", "Prefix-cache lookups and allocate+register+free cycles for a V3.2 and a V4 spec");
  AddRoundOptions(cmd, args->options.rounds, args->options.round_seconds);
  cmd->add_option("--prompt-blocks", args->options.prompt_blocks,
                  "Full 128-token blocks per request")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--capacity-blocks", args->options.capacity_blocks, "Pages per pool")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    const auto r = bench::RunCacheBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    std::printf("requests of %u blocks + 1 token, 128 tokens per block (medians, single thread)\n",
                args->options.prompt_blocks);
    for (const char* model : {"deepseek-v3.2-exp", "deepseek-v4-flash"}) {
      const auto& m = j[model];
      std::printf(
          "%-18s %u pools  lookup %.0f k/s (walk only %.0f k/s)  alloc+register+free %.0f k/s  "
          "hit cycle %.0f k/s  [hash only %.0f k/s, pools only %.0f k/s]\n",
          model, m["pools"].get<unsigned>(), m["lookups_per_s"].get<double>() / 1e3,
          m["lookup_digests_per_s"].get<double>() / 1e3,
          m["alloc_register_free_per_s"].get<double>() / 1e3,
          m["hit_cycle_per_s"].get<double>() / 1e3, m["hash_only_per_s"].get<double>() / 1e3,
          m["pool_only_per_s"].get<double>() / 1e3);
      for (const auto& [policy, p] : m["policies"].items()) {
        std::printf("%-18s   %-4s lookup %.0f k/s (%.2fx LRU)  walk %.2fx  alloc+register+free %.0f k/s (%.2fx LRU)  hit cycle %.2fx\n",
                    "", policy.c_str(), p["lookup_per_s"].get<double>() / 1e3, p.value("lookup_vs_lru", 1.0),
                    p.value("lookup_digests_vs_lru", 1.0), p["alloc_register_free_per_s"].get<double>() / 1e3,
                    p.value("alloc_register_free_vs_lru", 1.0), p.value("hit_cycle_vs_lru", 1.0));
      }
    }
  });
}

}  // namespace sparsekv::cli
