#include <algorithm>
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
    bool kv_vs_off = false;
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
  cmd->add_option("--rounds", o.rounds, "--batch: interleaved rounds per method; --kv-events-vs-off: pairs of runs")
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
  cmd->add_flag("--kv-events", o.kv_events,
                "With --spawn: the daemon publishes KV events on vLLM's wire and a subscriber here reads them");
  cmd->add_flag("--kv-events-vs-off", a->kv_vs_off,
                "With --spawn: --rounds pairs of runs with KV events off and on (the order alternating), and the "
                "median on/off ratios");
  cmd->add_flag("--json", a->json, "Print JSON");
  cmd->callback([a, &exit_code] {
    if (a->options.batch) {
      const auto r = bench::RunDaemonBatchBench(a->options);
      const auto* report = ReportBenchAfterProgress(r, a->json, exit_code);
      if (report == nullptr) return;
      const auto& j = *report;
      std::printf("%s; one client (spin %u us), GetInto warm buffers, medians of %d rounds (GB/s)\n",
                  j["cpu"].get<std::string>().c_str(), j["client_spin_us"].get<unsigned>(), j["rounds"].get<int>());
      std::printf("%12s %7s %8s %8s %8s %8s %10s %10s %9s %9s\n", "value bytes", "values", "shm", "memcpy", "tcp",
                  "socket", "shm/memcpy", "leases/mcp", "tcp/sock", "faults/GB");
      for (const auto& b : j["batch"]) {
        std::printf("%12llu %7llu %8.2f %8.2f %8.2f %8.2f %10.2f %10.2f %9.2f %9.1f\n",
                    static_cast<unsigned long long>(b["value_bytes"].get<uint64_t>()),
                    static_cast<unsigned long long>(b["values"].get<uint64_t>()),
                    b["shm_bytes_per_s"].get<double>() / 1e9, b["memcpy_bytes_per_s"].get<double>() / 1e9,
                    b["tcp_bytes_per_s"].get<double>() / 1e9, b["socket_bytes_per_s"].get<double>() / 1e9,
                    b["shm_vs_memcpy"].get<double>(), b["shm_leases_vs_memcpy"].get<double>(),
                    b["tcp_vs_socket"].get<double>(), b["faults_per_gb"].get<double>());
      }
      std::printf("(leases/mcp: over shared memory from a daemon with write_leases on, whose local reads are "
                  "checked)\n");
      std::printf("PUT (GB/s; baselines measured beside the PUTs):\n%12s %7s %8s %8s %8s %8s %8s %10s %10s %9s\n",
                  "value bytes", "values", "shm", "lease", "memcpy", "tcp", "socket", "shm/memcpy", "lease/mcpy",
                  "tcp/sock");
      for (const auto& b : j["batch"]) {
        std::printf("%12llu %7llu %8.2f %8.2f %8.2f %8.2f %8.2f %10.2f %10.2f %9.2f\n",
                    static_cast<unsigned long long>(b["value_bytes"].get<uint64_t>()),
                    static_cast<unsigned long long>(b["values"].get<uint64_t>()),
                    b["put_shm_bytes_per_s"].get<double>() / 1e9, b["put_lease_bytes_per_s"].get<double>() / 1e9,
                    b["put_memcpy_bytes_per_s"].get<double>() / 1e9, b["put_tcp_bytes_per_s"].get<double>() / 1e9,
                    b["put_socket_bytes_per_s"].get<double>() / 1e9, b["put_shm_vs_memcpy"].get<double>(),
                    b["put_lease_vs_memcpy"].get<double>(), b["put_tcp_vs_socket"].get<double>());
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
    if (a->kv_vs_off) {
      // --rounds pairs, the order alternating (off then on, on then off, ...): each pair gives a
      // ratio; the medians are reported with the spread.
      bench::DaemonBenchOptions off = a->options, on = a->options;
      off.kv_events = false;
      on.kv_events = true;
      std::vector<double> put_ratio, get_ratio, put_cpu_ratio, get_cpu_ratio;
      Result<nlohmann::json> last = Status::OK();
      nlohmann::json rounds = nlohmann::json::array();
      for (int i = 0; i < std::max(1, a->options.rounds); ++i) {
        const bool on_first = i % 2 == 1;
        auto first = bench::RunDaemonBench(on_first ? on : off);
        Result<nlohmann::json> second = first.ok() ? bench::RunDaemonBench(on_first ? off : on) : first;
        if (!second.ok()) {
          last = second.status();
          break;
        }
        const nlohmann::json& jon = on_first ? *first : *second;
        const nlohmann::json& joff = on_first ? *second : *first;
        put_ratio.push_back(jon["put_ops_per_s"].get<double>() / joff["put_ops_per_s"].get<double>());
        get_ratio.push_back(jon["get_ops_per_s"].get<double>() / joff["get_ops_per_s"].get<double>());
        // CPU per operation, off over on: below 1 when events cost CPU.
        put_cpu_ratio.push_back(joff["put_cpu_us_per_op"].get<double>() / jon["put_cpu_us_per_op"].get<double>());
        get_cpu_ratio.push_back(joff["get_cpu_us_per_op"].get<double>() / jon["get_cpu_us_per_op"].get<double>());
        rounds.push_back({{"put_ops_per_s_on", jon["put_ops_per_s"]}, {"put_ops_per_s_off", joff["put_ops_per_s"]},
                          {"get_ops_per_s_on", jon["get_ops_per_s"]}, {"get_ops_per_s_off", joff["get_ops_per_s"]},
                          {"put_cpu_us_per_op_on", jon["put_cpu_us_per_op"]},
                          {"put_cpu_us_per_op_off", joff["put_cpu_us_per_op"]},
                          {"get_cpu_us_per_op_on", jon["get_cpu_us_per_op"]},
                          {"get_cpu_us_per_op_off", joff["get_cpu_us_per_op"]},
                          {"events", jon["kv_events"]["events"]}, {"on_first", on_first}});
        last = jon;
      }
      if (last.ok()) {
        auto median = [](std::vector<double> v) {
          std::sort(v.begin(), v.end());
          return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
        };
        nlohmann::json& e = (*last)["kv_events"];
        e["rounds"] = rounds;
        e["put_on_vs_off"] = median(put_ratio);
        e["get_on_vs_off"] = median(get_ratio);
        e["put_on_vs_off_min"] = *std::min_element(put_ratio.begin(), put_ratio.end());
        e["put_on_vs_off_max"] = *std::max_element(put_ratio.begin(), put_ratio.end());
        e["get_on_vs_off_min"] = *std::min_element(get_ratio.begin(), get_ratio.end());
        e["get_on_vs_off_max"] = *std::max_element(get_ratio.begin(), get_ratio.end());
        e["put_cpu_off_vs_on"] = median(put_cpu_ratio);
        e["get_cpu_off_vs_on"] = median(get_cpu_ratio);
      }
      const auto* report = ReportBenchAfterProgress(last, a->json, exit_code);
      if (report == nullptr) return;
      const auto& e = (*report)["kv_events"];
      for (const auto& r : e["rounds"]) {
        std::printf("KV events on/off: PUT %.0f / %.0f ops/s (%.1f / %.1f CPU us/op)   GET %.0f / %.0f ops/s "
                    "(%.1f / %.1f CPU us/op)   (%llu events)\n",
                    r["put_ops_per_s_on"].get<double>(), r["put_ops_per_s_off"].get<double>(),
                    r["put_cpu_us_per_op_on"].get<double>(), r["put_cpu_us_per_op_off"].get<double>(),
                    r["get_ops_per_s_on"].get<double>(), r["get_ops_per_s_off"].get<double>(),
                    r["get_cpu_us_per_op_on"].get<double>(), r["get_cpu_us_per_op_off"].get<double>(),
                    static_cast<unsigned long long>(r["events"].get<uint64_t>()));
      }
      std::printf("on/off, median of %zu pairs (min-max): PUT %.3fx (%.3f-%.3f)   GET %.3fx (%.3f-%.3f)\n",
                  e["rounds"].size(), e["put_on_vs_off"].get<double>(), e["put_on_vs_off_min"].get<double>(),
                  e["put_on_vs_off_max"].get<double>(), e["get_on_vs_off"].get<double>(),
                  e["get_on_vs_off_min"].get<double>(), e["get_on_vs_off_max"].get<double>());
      std::printf("CPU per op, off/on, median: PUT %.3fx   GET %.3fx\n", e["put_cpu_off_vs_on"].get<double>(),
                  e["get_cpu_off_vs_on"].get<double>());
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
