#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"
#include "remote_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(remote) {
  struct Args {
    bench::RemoteBenchOptions options;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  auto& o = args->options;
  CLI::App* cmd = bench.add_subcommand(
      "remote",
      "Remote tier (Redis Cluster) GET throughput against redis-benchmark on the same loopback "
      "cluster (3 primaries, 3 replicas), in one run");
  cmd->add_option("--value-bytes", o.value_bytes, "Value sizes")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cmd->add_option("--concurrency", o.concurrency, "Threads (ours) and redis-benchmark -c")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--pipeline", o.pipeline, "Keys per GET call (ours) and redis-benchmark -P")
      ->check(CLI::Range(1u, 1024u))
      ->capture_default_str();
  cmd->add_option("--data-bytes", o.data_bytes, "Bytes stored per size")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cmd->add_option("--round-seconds", o.round_seconds, "Length of a round")
      ->check(CLI::Range(0.05, 600.0))
      ->capture_default_str();
  cmd->add_option("--rounds", o.rounds, "Interleaved rounds of each")->check(CLI::Range(1, 100))->capture_default_str();
  cmd->add_option("--dir", o.dir, "Where the cluster's temporary directory goes");
  cmd->add_flag("--keep", o.keep, "Keep that directory");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    const auto r = bench::RunRemoteBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    std::printf("remote tier GET vs redis-benchmark, %d clients, pipeline %u (3+3 loopback cluster)\n",
                args->options.concurrency, args->options.pipeline);
    for (const auto& s : (*report)["sizes"]) {
      const auto& ours = s["ours"];
      const auto& rb = s["redis_benchmark"];
      std::printf(
          "%9llu B  ours %9.0f GET/s %8.1f MiB/s (spread %.2f)   redis-benchmark %9.0f GET/s %8.1f MiB/s "
          "(hits %.2f, spread %.2f)   ours/redis-benchmark %.2fx\n",
          static_cast<unsigned long long>(s["value_bytes"].get<uint64_t>()), ours["gets_per_s"].get<double>(),
          ours["bytes_per_s"].get<double>() / 1048576.0, ours["spread"].get<double>(), rb["gets_per_s"].get<double>(),
          rb["bytes_per_s"].get<double>() / 1048576.0, rb["hit_ratio"].get<double>(), rb["spread"].get<double>(),
          s["ours_vs_redis_benchmark"].get<double>());
    }
  });
}

}  // namespace sparsekv::cli
