#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/bench_report.h"
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
  cmd->add_flag("--batch", o.batch,
                "One client's batch GET into its own memory (GetInto) over TCP and shared memory, against "
                "memcpy and a loopback socket pair (a daemon started here)");
  cmd->add_option("--rounds", o.rounds, "--batch: interleaved rounds per method")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_option("--round-seconds", o.round_seconds, "--batch: seconds per round")
      ->check(CLI::Range(0.01, 60.0))
      ->capture_default_str();
  cmd->add_option_function<std::vector<std::string>>(
         "--batch-sizes",
         [a](const std::vector<std::string>& v) {
           a->options.batch_sizes.clear();
           for (const std::string& item : v) {
             const size_t x = item.find('x');
             uint64_t bytes = 0, values = 0;
             if (x == std::string::npos || !CLI::detail::lexical_cast(item.substr(0, x), bytes) ||
                 !CLI::detail::lexical_cast(item.substr(x + 1), values)) {
               throw CLI::ValidationError("--batch-sizes", "'" + item + "' is not BYTESxVALUES, e.g. 65536x64");
             }
             a->options.batch_sizes.emplace_back(bytes, values);
           }
         },
         "--batch: BYTESxVALUES of each batch (default 65536x64 1048576x16 6291456x16)")
      ->expected(1, 16);
  cmd->add_option("--spin-us", o.spin_us,
                  "--batch: microseconds a client polls for its reply before it sleeps (ClientOptions::spin)")
      ->capture_default_str();
  cmd->add_option("--restore-blocks", o.restore_blocks,
                  "--batch: also restore this many DeepSeek V3.2 fp8 blocks through the daemon, against the "
                  "in-process bench restore (1024: a 6.3 GB prefix)")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Print JSON");
  cmd->callback([a, &exit_code] {
    if (a->options.batch) {
      const auto r = bench::RunDaemonBatchBench(a->options);
      const auto* report = ReportBenchAfterProgress(r, a->json, exit_code);
      if (report == nullptr) return;
      const auto& j = *report;
      std::printf("%s; one client (spin %u us), GetInto warm buffers, medians of %d rounds (GB/s)\n",
                  j["cpu"].get<std::string>().c_str(), j["client_spin_us"].get<unsigned>(), j["rounds"].get<int>());
      std::printf("%12s %7s %8s %8s %8s %8s %10s %9s %9s\n", "value bytes", "values", "shm", "memcpy", "tcp",
                  "socket", "shm/memcpy", "tcp/sock", "faults/GB");
      for (const auto& b : j["batch"]) {
        std::printf("%12llu %7llu %8.2f %8.2f %8.2f %8.2f %10.2f %9.2f %9.1f\n",
                    static_cast<unsigned long long>(b["value_bytes"].get<uint64_t>()),
                    static_cast<unsigned long long>(b["values"].get<uint64_t>()),
                    b["shm_bytes_per_s"].get<double>() / 1e9, b["memcpy_bytes_per_s"].get<double>() / 1e9,
                    b["tcp_bytes_per_s"].get<double>() / 1e9, b["socket_bytes_per_s"].get<double>() / 1e9,
                    b["shm_vs_memcpy"].get<double>(), b["tcp_vs_socket"].get<double>(),
                    b["faults_per_gb"].get<double>());
      }
      if (j.contains("restore")) {
        const auto& r2 = j["restore"];
        std::printf("restore %u blocks (%.2f GB): in process %.2f s (rate of %u blocks), through the daemon %.2f s "
                    "shm (first %.2f s), %.2f s tcp\n",
                    r2["blocks"].get<unsigned>(), r2["bytes"].get<double>() / 1e9,
                    r2["in_process_seconds"].get<double>(), r2["in_process_blocks"].get<unsigned>(),
                    r2["daemon_shm_seconds"].get<double>(), r2["daemon_shm_first_seconds"].get<double>(),
                    r2["daemon_tcp_seconds"].get<double>());
      }
      return;
    }
    const auto r = bench::RunDaemonBench(a->options);
    const auto* report = ReportBenchAfterProgress(r, a->json, exit_code);
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
