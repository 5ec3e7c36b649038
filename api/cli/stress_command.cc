// `sparsekv stress offload`: SIGKILL the SSD tier's writer at random moments and check that
// nothing acknowledged is lost or returned corrupt (bench/offload_stress.h). The hidden
// `stress offload-child` is the process being killed.
// `sparsekv stress daemon`: N clients against sparsekvd, every GET checked against the last
// acknowledged PUT or DELETE, optionally killing and restarting the daemon
// (bench/daemon_stress.h).
// `sparsekv stress suspend`: SIGKILL an engine that logs, suspends and resumes requests; check
// no acknowledged token is lost and every resumed request matches an uninterrupted run
// (bench/suspend_stress.h). The hidden `stress suspend-child` is the process being killed.
// `sparsekv stress hostile`: attacks on a running sparsekvd over raw sockets while a
// well-behaved client measures what they cost it (bench/hostile_stress.h).
// `sparsekv stress cluster`: two daemons sharing a Redis Cluster, a primary killed under load
// (bench/cluster_stress.h).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/model_options.h"
#include "cli/registry.h"
#include "cluster_stress.h"
#include "daemon_stress.h"
#include "hostile_stress.h"
#include "offload_stress.h"
#include "progress.h"
#include "suspend_stress.h"

namespace sparsekv::cli {

SPARSEKV_CLI_COMMAND(stress) {
  CLI::App* stress = app.add_subcommand("stress", "Crash and fault stress tests");
  stress->require_subcommand(1);

  struct Args {
    bench::OffloadStressOptions options;
    std::string durability = "fdatasync";
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = stress->add_subcommand("offload",
                                         "Kill a writer of the SSD tier K times, then verify every "
                                         "acknowledged bundle and bit-flip detection");
  cmd->add_option("--dir", args->options.dir,
                  "Working directory (a subdirectory is created and removed)")
      ->required();
  cmd->add_option("--seconds", args->options.seconds, "Total run time of the writer")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  cmd->add_option("--kill-cycles", args->options.kill_cycles, "SIGKILLs and restarts")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  AddDurabilityOption(cmd, args->durability);
  cmd->add_option("--flip-bundles", args->options.flip_bundles,
                  "Bundles damaged in the bit-flip phase")
      ->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "Seed (0: random)")->capture_default_str();
  cmd->add_flag("--keep", args->options.keep, "Keep the working directory");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    if (!ParseDurabilityOption(args->durability, args->options.durability, exit_code)) return;
    auto r = bench::RunOffloadStress(args->options);
    bench::ProgressStop();  // results follow on the same terminal
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    if (args->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf(
          "acknowledged %llu  lost %llu  corrupt_returned %llu  stale_returned %llu  "
          "detected_corrupt %llu  "
          "(%d kills, %.1f s)\nbit flips: %llu injected, %llu detected, %llu returned\n%s\n",
          static_cast<unsigned long long>(j["acknowledged"].get<uint64_t>()),
          static_cast<unsigned long long>(j["lost"].get<uint64_t>()),
          static_cast<unsigned long long>(j["corrupt_returned"].get<uint64_t>()),
          static_cast<unsigned long long>(j["stale_returned"].get<uint64_t>()),
          static_cast<unsigned long long>(j["detected_corrupt"].get<uint64_t>()),
          args->options.kill_cycles, j["seconds"].get<double>(),
          static_cast<unsigned long long>(j["flip"]["injected"].get<uint64_t>()),
          static_cast<unsigned long long>(j["flip"]["detected"].get<uint64_t>()),
          static_cast<unsigned long long>(j["flip"]["returned"].get<uint64_t>()),
          j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });

  struct DaemonArgs {
    bench::DaemonStressOptions options;
    std::string durability = "fdatasync";
    std::string write_policy = "write-back";
    bool no_shared_memory = false;
    bool json = false;
  };
  auto d = std::make_shared<DaemonArgs>();
  auto& o = d->options;
  CLI::App* dc = stress->add_subcommand(
      "daemon",
      "N clients PUT/GET/LOOKUP/DELETE self-checking values against sparsekvd; every GET must "
      "return the last acknowledged value; optionally kill and restart the daemon K times");
  dc->add_option(
      "--addr", o.addr,
      "HOST:PORT or unix:PATH of a running daemon (default 127.0.0.1:7420); with --spawn: "
      "tcp or unix (default unix)");
  dc->add_option("--namespace", o.namespace_name, "Namespace")->capture_default_str();
  dc->add_option("--token", o.token, "Namespace token");
  dc->add_flag("--no-shared-memory", d->no_shared_memory,
               "Unix socket: send values over the socket");
  dc->add_option("--clients", o.clients, "Clients, one thread and connection each")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  dc->add_option("--seconds", o.seconds, "Seconds of load (restarts add to it)")
      ->check(CLI::Range(0.05, 86400.0))
      ->capture_default_str();
  dc->add_option("--max-ops", o.max_ops_per_client, "Operations per client at most")
      ->capture_default_str();
  dc->add_option("--keys-per-client", o.keys_per_client, "Keys each client owns")
      ->check(CLI::Range(1u, 1000000u))
      ->capture_default_str();
  dc->add_option("--min-value-bytes", o.min_value_bytes, "Smallest value (log-uniform sizes)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  dc->add_option("--max-value-bytes", o.max_value_bytes, "Largest value")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  dc->add_option("--seed", o.seed, "Seed (0: random)")->capture_default_str();
  dc->add_option("--kill-cycles", o.kill_cycles,
                 "SIGKILLs and restarts of the daemon during the run")
      ->check(CLI::Range(0, 10000))
      ->capture_default_str();
  dc->add_option("--kill-cmd", o.kill_command, "External daemon: shell command that kills it");
  dc->add_option("--restart-cmd", o.restart_command,
                 "External daemon: shell command that starts it again (returns once started)");
  dc->add_option("--restart-timeout", o.restart_timeout_seconds,
                 "Seconds a restarted daemon may take to answer")
      ->check(CLI::Range(1.0, 3600.0))
      ->capture_default_str();
  dc->add_flag("--expect-durable", o.expect_durable,
               "Require lost == 0 after kills (write-through with a durable SSD tier)");
  dc->add_flag("--spawn", o.spawn,
               "Start the daemon here: in this process, or with --kill-cycles the sparsekvd binary "
               "as a child");
  dc->add_option("--dir", o.dir,
                 "With --spawn: where its temporary directory goes (default: the system's)");
  dc->add_flag("--keep", o.keep, "With --spawn: keep the directory (data, config, log)");
  dc->add_option("--host-bytes", o.host_bytes, "With --spawn: host memory tier")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  dc->add_option("--ssd-bytes", o.ssd_bytes, "With --spawn: SSD tier")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  dc->add_option("--write-policy", d->write_policy, "With --spawn: write-back or write-through")
      ->capture_default_str();
  AddDurabilityOption(dc, d->durability);
  dc->add_option("--daemon-binary", o.daemon_binary,
                 "With --spawn and --kill-cycles: sparsekvd (default: beside this executable)");
  dc->add_flag("--json", d->json, "Print JSON");
  dc->callback([d, &exit_code] {
    if (!ParseDurabilityOption(d->durability, d->options.durability, exit_code)) return;
    auto policy = ParseWritePolicy(d->write_policy);
    if (!policy.ok()) {
      exit_code = Fail(policy.status().WithContext("--write-policy"));
      return;
    }
    d->options.write_policy = *policy;
    d->options.shared_memory = !d->no_shared_memory;
    auto r = bench::RunDaemonStress(d->options);
    bench::ProgressStop();  // results follow on the same terminal
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    auto n = [&j](const char* key) {
      return static_cast<unsigned long long>(j[key].get<uint64_t>());
    };
    if (d->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf(
          "acknowledged %llu  gets %llu (hits %llu, misses %llu)  stale_returned %llu  "
          "deleted_returned %llu  "
          "corrupt_returned %llu  refused %llu  errors %llu  lost %llu  reconnects %llu  "
          "(%d clients, %d kills, %.1f s, %.0f ops/s)\n%s\n",
          n("acknowledged"), n("gets"), n("hits"), n("misses"), n("stale_returned"),
          n("deleted_returned"), n("corrupt_returned"), n("refused"), n("errors"), n("lost"),
          n("reconnects"), d->options.clients, d->options.kill_cycles, j["seconds"].get<double>(),
          j["ops_per_s"].get<double>(), j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });

  struct ClusterArgs {
    bench::ClusterStressOptions options;
    bool json = false;
  };
  auto cl = std::make_shared<ClusterArgs>();
  auto& co = cl->options;
  CLI::App* cc = stress->add_subcommand(
      "cluster",
      "Two daemons sharing a loopback Redis Cluster (3 primaries, 3 replicas): a prefix stored "
      "through A is restored through B, then clients read and write through both while a "
      "primary is SIGKILLed; checks 0 errors, GET p99 within the remote timeout + local p99, "
      "and hits back after the failover");
  cc->add_option("--clients", co.clients, "Client threads, each connected to both daemons")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cc->add_option("--seconds", co.seconds, "Seconds of load")->check(CLI::Range(1.0, 86400.0))->capture_default_str();
  cc->add_option("--kill-after", co.kill_after, "Fraction of the load after which a primary is killed (0: none)")
      ->check(CLI::Range(0.0, 0.95))
      ->capture_default_str();
  cc->add_option("--value-bytes", co.value_bytes, "Bytes of each block")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cc->add_option("--prefix-blocks", co.prefix_blocks, "Blocks of the prefix shared from A to B")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  cc->add_option("--remote-timeout-ms", co.remote_timeout_ms, "The daemons' remote tier timeout")
      ->check(CLI::Range(1u, 60000u))
      ->capture_default_str();
  cc->add_option("--host-bytes", co.host_bytes, "Each daemon's host tier")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cc->add_option("--ssd-bytes", co.ssd_bytes, "Each daemon's SSD tier")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cc->add_option("--node-timeout-ms", co.node_timeout_ms, "cluster-node-timeout of the Redis nodes")
      ->check(CLI::Range(100u, 60000u))
      ->capture_default_str();
  cc->add_option("--dir", co.dir, "Where the temporary directory goes (default: the system's)");
  cc->add_flag("--keep", co.keep, "Keep the directory (node logs, tier data)");
  cc->add_option("--seed", co.seed, "Seed (0: random)")->capture_default_str();
  cc->add_flag("--json", cl->json, "Print JSON");
  cc->callback([cl, &exit_code] {
    auto r = bench::RunClusterStress(cl->options);
    bench::ProgressStop();  // results follow on the same terminal
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    if (cl->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      const auto& ph = j["phases"];
      std::printf(
          "prefix: %llu of %llu blocks found through B, %llu identical\n"
          "gets %llu (hits %llu, misses %llu)  puts %llu  errors %llu  wrong bytes %llu\n"
          "GET p99 before %.0f us, during the failover %.0f us (bound %.0f us), after %.0f us\n"
          "killed %s at %.1f s; failed over at %.1f s; tiers healthy at %.1f s\n%s\n",
          static_cast<unsigned long long>(j["prefix"]["found_through_b"].get<uint64_t>()),
          static_cast<unsigned long long>(j["prefix"]["blocks"].get<uint64_t>()),
          static_cast<unsigned long long>(j["prefix"]["identical_through_b"].get<uint64_t>()),
          static_cast<unsigned long long>(j["gets"].get<uint64_t>()),
          static_cast<unsigned long long>(j["hits"].get<uint64_t>()),
          static_cast<unsigned long long>(j["misses"].get<uint64_t>()),
          static_cast<unsigned long long>(j["puts"].get<uint64_t>()),
          static_cast<unsigned long long>(j["errors"].get<uint64_t>()),
          static_cast<unsigned long long>(j["wrong_bytes"].get<uint64_t>()), ph["before"]["p99_us"].get<double>(),
          ph["during"]["p99_us"].get<double>(), j["p99_bound_us"].get<double>(), ph["after"]["p99_us"].get<double>(),
          j["kill"]["node"].get<std::string>().c_str(), j["kill"]["killed_at_s"].get<double>(),
          j["kill"]["cluster_failed_over_s"].get<double>(), j["kill"]["tiers_healthy_s"].get<double>(),
          j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });

  struct HostileArgs {
    bench::HostileStressOptions options;
    bool json = false;
  };
  auto h = std::make_shared<HostileArgs>();
  auto& ho = h->options;
  CLI::App* hc = stress->add_subcommand(
      "hostile",
      "Attack a running sparsekvd (garbage frames, floods, slow and non-reading clients, "
      "oversized claims, shared-memory resizing) while a good client measures latency and "
      "errors; exit code 0 only with no daemon death, no good-client error and no finding");
  hc->add_option("--addr", ho.addr, "HOST:PORT or unix:PATH of the daemon")->capture_default_str();
  hc->add_option("--namespace", ho.namespace_name, "Namespace")->capture_default_str();
  hc->add_option("--token", ho.token, "Namespace token");
  hc->add_option("--seconds", ho.seconds,
                 "Total seconds: a baseline and each attack get an equal share")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  hc->add_option("--pid", ho.pid,
                 "The daemon's pid, for its RSS (0: found over a Unix socket; over TCP the RSS "
                 "is then not reported)")
      ->capture_default_str();
  std::string names;
  for (const auto& n : bench::HostileAttackNames()) names += (names.empty() ? "" : ", ") + n;
  hc->add_option("--attacks", ho.attacks,
                 "Attacks to run, comma-separated (default: all of " + names +
                     "; shrink-memfd on unix: only)")
      ->delimiter(',');
  hc->add_option("--seed", ho.seed, "Seed (0: random)")->capture_default_str();
  hc->add_option("--garbage-connections", ho.garbage_connections, "garbage: connections")
      ->capture_default_str();
  hc->add_option("--big-claim-connections", ho.big_claim_connections, "big-claim: connections")
      ->capture_default_str();
  hc->add_option("--slowloris-connections", ho.slowloris_connections, "slowloris: connections")
      ->capture_default_str();
  hc->add_option("--non-reader-connections", ho.non_reader_connections, "non-reader: connections")
      ->capture_default_str();
  hc->add_option("--oversized-get-hashes", ho.oversized_get_hashes, "oversized-get: hashes in each GET")
      ->check(CLI::Range(1u, 65536u))
      ->capture_default_str();
  hc->add_option("--idle-connections", ho.idle_connections, "idle-flood: connections at most")
      ->capture_default_str();
  hc->add_option("--big-frame-connections", ho.big_frame_connections, "big-frames: connections")
      ->capture_default_str();
  hc->add_option("--hello-flood-connections", ho.hello_flood_connections,
                 "hello-flood: connections")
      ->capture_default_str();
  hc->add_option("--settle", ho.settle_seconds, "Seconds the daemon gets after each phase")
      ->check(CLI::Range(0.0, 60.0))
      ->capture_default_str();
  hc->add_option("--recover", ho.recover_seconds,
                 "Seconds a daemon that stopped answering is waited for before the next attack")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  hc->add_option("--call-timeout", ho.call_timeout_seconds,
                 "Seconds each good-client call and connection attempt may take")
      ->check(CLI::Range(0.1, 600.0))
      ->capture_default_str();
  hc->add_flag("--json", h->json, "Print JSON");
  hc->callback([h, &exit_code] {
    auto r = bench::RunHostileStress(h->options);
    bench::ProgressStop();  // results follow on the same terminal
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    if (h->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      auto num = [](const nlohmann::json& v, const char* format) {
        if (!v.is_number()) return std::string("-");
        char buf[64];
        std::snprintf(buf, sizeof(buf), format, v.get<double>());
        return std::string(buf);
      };
      std::printf("%-14s %6s %7s %9s %9s %9s %6s %6s %6s %8s %10s %5s\n", "phase", "secs", "ops",
                  "p50_us", "p99_us", "max_us", "ratio", "errors", "misses", "newconn!", "peak_MiB",
                  "alive");
      auto row = [&](const nlohmann::json& p) {
        const nlohmann::json peak =
            p["daemon_peak_rss_bytes"].is_number()
                ? nlohmann::json(p["daemon_peak_rss_bytes"].get<double>() / (1 << 20))
                : nlohmann::json(nullptr);
        std::printf("%-14s %6.1f %7llu %9s %9s %9s %6s %6llu %6llu %8llu %10s %5s\n",
                    p["name"].get<std::string>().c_str(), p["seconds"].get<double>(),
                    static_cast<unsigned long long>(p["good_ops"].get<uint64_t>()),
                    num(p["good_p50_us"], "%.0f").c_str(), num(p["good_p99_us"], "%.0f").c_str(),
                    num(p["good_max_us"], "%.0f").c_str(),
                    num(p.value("p99_ratio", nlohmann::json()), "%.2f").c_str(),
                    static_cast<unsigned long long>(p["good_errors"].get<uint64_t>()),
                    static_cast<unsigned long long>(p["good_misses"].get<uint64_t>()),
                    static_cast<unsigned long long>(p["new_connection_failures"].get<uint64_t>()),
                    num(peak, "%.0f").c_str(), p["daemon_alive"].get<bool>() ? "yes" : "NO");
      };
      row(j["baseline"]);
      for (const auto& p : j["attacks"]) row(p);
      for (const auto& p : j["attacks"]) {
        std::printf("%s: %s\n", p["name"].get<std::string>().c_str(), p["details"].dump().c_str());
      }
      for (const auto& s : j["skipped"]) {
        std::printf("skipped %s: %s\n", s["name"].get<std::string>().c_str(),
                    s["why"].get<std::string>().c_str());
      }
      std::printf(
          "daemon_deaths %llu  good_client_errors %llu  findings %llu %s  worst_p99_ratio %s  "
          "target %s\n%s\n",
          static_cast<unsigned long long>(j["daemon_deaths"].get<uint64_t>()),
          static_cast<unsigned long long>(j["good_client_errors"].get<uint64_t>()),
          static_cast<unsigned long long>(j["findings"].get<uint64_t>()),
          j["finding_counters"].dump().c_str(), num(j["worst_p99_ratio"], "%.2f").c_str(),
          j["target_met"].get<bool>() ? "met" : "NOT met", j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });

  struct SuspendArgs {
    bench::SuspendStressOptions options;
    bool json = false;
  };
  auto sa = std::make_shared<SuspendArgs>();
  CLI::App* sc = stress->add_subcommand(
      "suspend", "Kill an engine that logs, suspends and resumes requests K times; verify every "
                 "acknowledged token and every resumed request against an uninterrupted run");
  sc->add_option("--dir", sa->options.dir, "Working directory (a subdirectory is created and removed)")->required();
  sc->add_option("--seconds", sa->options.seconds, "Total run time of the engine")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  sc->add_option("--kill-cycles", sa->options.kill_cycles, "SIGKILLs and restarts")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  sc->add_option("--requests", sa->options.requests, "Requests decoded at once")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  sc->add_option("--threads", sa->options.threads, "Threads decoding them")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  sc->add_option("--max-request-tokens", sa->options.max_request_tokens, "A request is finished at this length")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  sc->add_option("--seed", sa->options.seed, "Seed (0: random)")->capture_default_str();
  sc->add_flag("--keep", sa->options.keep, "Keep the working directory");
  sc->add_flag("--json", sa->json, "Print JSON");
  sc->callback([sa, &exit_code] {
    auto r = bench::RunSuspendStress(sa->options);
    bench::ProgressStop();  // results follow on the same terminal
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    if (sa->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf(
          "acknowledged tokens %llu  lost %llu  resurrected %llu  (%d kills, %.1f s)\n"
          "suspends %llu  resumes %llu (%llu exact)  recomputed tokens %llu  mismatches %llu\n"
          "requests checked against an uninterrupted run %llu (%llu tokens): %llu differ\n"
          "torn log tails injected %llu, cut %llu (%llu bytes)\n"
          "children stalled after a durable finish %llu; finished requests the parent never heard of %llu\n%s\n",
          static_cast<unsigned long long>(j["acknowledged_tokens"].get<uint64_t>()),
          static_cast<unsigned long long>(j["lost_tokens"].get<uint64_t>()),
          static_cast<unsigned long long>(j["resurrected"].get<uint64_t>()), sa->options.kill_cycles,
          j["seconds"].get<double>(), static_cast<unsigned long long>(j["suspends"].get<uint64_t>()),
          static_cast<unsigned long long>(j["resumes"].get<uint64_t>()),
          static_cast<unsigned long long>(j["resumed_exact"].get<uint64_t>()),
          static_cast<unsigned long long>(j["recomputed_tokens"].get<uint64_t>()),
          static_cast<unsigned long long>(j["child_mismatches"].get<uint64_t>()),
          static_cast<unsigned long long>(j["checked_requests"].get<uint64_t>()),
          static_cast<unsigned long long>(j["checked_tokens"].get<uint64_t>()),
          static_cast<unsigned long long>(j["differing_requests"].get<uint64_t>()),
          static_cast<unsigned long long>(j["torn_tails_injected"].get<uint64_t>()),
          static_cast<unsigned long long>(j["torn_tails_cut"].get<uint64_t>()),
          static_cast<unsigned long long>(j["torn_bytes_cut"].get<uint64_t>()),
          static_cast<unsigned long long>(j["finish_stalls"].get<uint64_t>()),
          static_cast<unsigned long long>(j["finished_unacknowledged"].get<uint64_t>()),
          j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });
  auto sc_child = std::make_shared<bench::SuspendStressChildOptions>();
  CLI::App* scc = stress->add_subcommand("suspend-child", "The process `stress suspend` kills");
  scc->group("");
  scc->add_option("--dir", sc_child->dir)->required();
  scc->add_option("--ack-fd", sc_child->ack_fd)->required();
  scc->add_option("--incarnation", sc_child->incarnation)->required();
  scc->add_option("--seed", sc_child->seed);
  scc->add_option("--requests", sc_child->requests);
  scc->add_option("--threads", sc_child->threads);
  scc->add_option("--max-request-tokens", sc_child->max_request_tokens);
  scc->add_flag("--stall-after-finish", sc_child->stall_after_finish);
  scc->callback([sc_child, &exit_code] {
    const Status s = bench::RunSuspendStressChild(*sc_child);
    if (!s.ok()) exit_code = Fail(s.WithContext("stress suspend-child"));
  });

  struct ChildArgs {
    bench::OffloadStressChildOptions options;
    std::string durability = "fdatasync";
  };
  auto child = std::make_shared<ChildArgs>();
  CLI::App* c = stress->add_subcommand("offload-child", "The process `stress offload` kills");
  c->group("");  // hidden: started by `stress offload` only
  c->add_option("--dir", child->options.dir)->required();
  c->add_option("--ack-fd", child->options.ack_fd)->required();
  c->add_option("--incarnation", child->options.incarnation)->required();
  c->add_option("--seed", child->options.seed);
  AddDurabilityOption(c, child->durability);
  c->callback([child, &exit_code] {
    if (!ParseDurabilityOption(child->durability, child->options.durability, exit_code)) return;
    const Status s = bench::RunOffloadStressChild(child->options);
    if (!s.ok()) exit_code = Fail(s.WithContext("stress offload-child"));
  });
}

}  // namespace sparsekv::cli
