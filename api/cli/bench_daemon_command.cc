#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/registry.h"
#include "daemon_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(daemon) {
  struct Args {
    bench::DaemonBenchOptions options;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("daemon", "sparsekvd PUT/GET throughput and GET latency from N clients");
  auto& o = a->options;
  cmd->add_option("--addr", o.addr, "HOST:PORT (TCP) or unix:PATH (shared memory); with --spawn: tcp or unix")
      ->capture_default_str();
  cmd->add_option("--namespace", o.namespace_name, "Namespace")->capture_default_str();
  cmd->add_option("--token", o.token, "Namespace token");
  cmd->add_option("--clients", o.clients, "Clients, one connection and one request in flight each")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads,
                  "Threads driving the clients, each an event loop over its share (1, as redis-benchmark; "
                  "--clients gives every client a thread making blocking calls)")
      ->capture_default_str();
  cmd->add_option("--value-bytes", o.value_bytes, "Bytes per value")->capture_default_str();
  cmd->add_option("--seconds", o.seconds, "Seconds of the GET phase")->check(CLI::Range(0.05, 3600.0))->capture_default_str();
  cmd->add_option("--keys-per-client", o.keys_per_client, "Keys each client writes and reads")
      ->check(CLI::Range(1u, 1000000u))
      ->capture_default_str();
  cmd->add_flag("--spawn", o.spawn, "Start a daemon in this process (host tier only)");
  cmd->add_flag("--redis", o.redis, "Also measure redis-server with redis-benchmark, same value size and clients");
  cmd->add_flag("--json", a->json, "Print JSON");
  cmd->callback([a, &exit_code] {
    const auto r = bench::RunDaemonBench(a->options);
    const auto* report = ReportBench(r, a->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    std::printf("%s, %d clients on %d threads, %llu-byte values\n", j["transport"].get<std::string>().c_str(),
                a->options.clients, j["threads"].get<int>(), static_cast<unsigned long long>(a->options.value_bytes));
    std::printf("PUT %.0f ops/s   GET %.0f ops/s (%.2f GB/s)   p50 %.1f us   p99 %.1f us   errors %llu\n",
                j["put_ops_per_s"].get<double>(), j["get_ops_per_s"].get<double>(),
                j["get_bytes_per_s"].get<double>() / 1e9, j["get_p50_us"].get<double>(), j["get_p99_us"].get<double>(),
                static_cast<unsigned long long>(j["errors"].get<uint64_t>()));
    if (j.contains("redis_get_ops_per_s")) {
      std::printf("redis GET %.0f ops/s   ratio %.2fx\n", j["redis_get_ops_per_s"].get<double>(),
                  j["get_ratio_vs_redis"].get<double>());
    }
  });
}

}  // namespace sparsekv::cli
