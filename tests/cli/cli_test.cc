// The `sparsekv` and `sparsekvd` binaries end to end: exit codes, stderr and JSON.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/run_command.h"

namespace {

using Outcome = sparsekv::testing::CommandOutcome;
using sparsekv::testing::ReadWholeFile;

Outcome Exec(const std::string& binary, const std::string& args) {
  return sparsekv::testing::RunCommand(binary + " " + args, "cli");
}

Outcome Cli(const std::string& args) { return Exec(SPARSEKV_CLI_PATH, args); }

TEST(Cli, HelpForEverySubcommand) {
  for (const char* sub : {"", "plan", "spec", "bench", "bench alloc", "bench daemon", "spec show", "put", "get",
                          "lookup", "stats", "events"}) {
    Outcome r = Cli(std::string(sub) + " --help");
    EXPECT_EQ(r.exit_code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub;
  }
}

TEST(Cli, PlanJsonForV32) {
  Outcome r = Cli("plan --model deepseek-v3.2-exp --batch 4 --seq-len 65536 --kv-format bf16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"], "deepseek-v3.2-exp");
  EXPECT_EQ(j["tokens"], 4 * 65536);
  EXPECT_EQ(j["block_tokens"], 128);
  uint64_t sum = 0;
  bool found = false;
  for (const auto& k : j["kinds"]) {
    sum += k["bytes"].get<uint64_t>();
    if (k["kind"] == "indexer_key") {
      found = true;
      EXPECT_EQ(k["bytes"].get<uint64_t>(), 4ull * 65536 * 61 * 128 * 2);
      EXPECT_EQ(k["format"], "bf16");
      EXPECT_EQ(k["layers"], 61);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(j["total_bytes"].get<uint64_t>(), sum);

  Outcome c8 = Cli("plan --model deepseek-v3.2-exp --batch 4 --seq-len 65536 --kv-format c8 --json");
  ASSERT_EQ(c8.exit_code, 0) << c8.err;
  const auto c8_json = nlohmann::json::parse(c8.out);
  for (const auto& k : c8_json["kinds"]) {
    if (k["kind"] == "indexer_key") {
      EXPECT_EQ(k["bytes"].get<uint64_t>(), 4ull * 65536 * 61 * 132);
      EXPECT_EQ(k["format"], "idx_c8");
    }
  }
}

TEST(Cli, PlanTableAndBudget) {
  Outcome t = Cli("plan --model deepseek-v4-flash --kv-format fp8 --seq-len 100000");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("hca_compressed"), std::string::npos);
  EXPECT_NE(t.out.find("total"), std::string::npos);
  Outcome b = Cli("plan --model deepseek-v3.2-exp --kv-format fp8 --budget-bytes 8589934592 --json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  auto j = nlohmann::json::parse(b.out);
  EXPECT_LE(j["total_bytes"].get<uint64_t>(), 8589934592ull);
  EXPECT_GT(j["tokens"].get<uint64_t>(), 100000u);
}

TEST(Cli, ErrorsGoToStderrWithNonZeroExit) {
  Outcome bad_model = Cli("plan --model gpt --seq-len 10");
  EXPECT_NE(bad_model.exit_code, 0);
  EXPECT_NE(bad_model.err.find("unknown model preset 'gpt'"), std::string::npos) << bad_model.err;
  EXPECT_TRUE(bad_model.out.empty());
  Outcome misaligned = Cli("plan --model deepseek-v4-flash --block-tokens 64 --seq-len 10");
  EXPECT_NE(misaligned.exit_code, 0);
  EXPECT_NE(misaligned.err.find("compression ratio 128"), std::string::npos) << misaligned.err;
  Outcome missing = Cli("plan --model deepseek-v3.2-exp");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("--seq-len"), std::string::npos);
  Outcome both = Cli("plan --seq-len 5 --budget-bytes 5");
  EXPECT_NE(both.exit_code, 0);
  Outcome unknown = Cli("frobnicate");
  EXPECT_NE(unknown.exit_code, 0);
}

TEST(Cli, SpecFileRoundTripAndErrors) {
  const auto dir = std::filesystem::temp_directory_path() / ("sparsekv_spec_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  Outcome show = Cli("spec show --model deepseek-v4-flash --kv-format fp8");
  ASSERT_EQ(show.exit_code, 0) << show.err;
  std::ofstream(dir / "v4.json") << show.out;
  Outcome plan_file = Cli("plan --spec " + (dir / "v4.json").string() + " --seq-len 4096 --json");
  Outcome plan_preset = Cli("plan --model deepseek-v4-flash --kv-format fp8 --seq-len 4096 --json");
  ASSERT_EQ(plan_file.exit_code, 0) << plan_file.err;
  EXPECT_EQ(nlohmann::json::parse(plan_file.out)["total_bytes"],
            nlohmann::json::parse(plan_preset.out)["total_bytes"]);
  std::ofstream(dir / "bad.json") << R"({"name":"x","layers":[{"kinds":[{"kind":"mla_latent","format":"bf16","dims":576,"ratio":6}]}]})";
  Outcome bad = Cli("spec check --spec " + (dir / "bad.json").string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("ratio 6 is not a power of two"), std::string::npos) << bad.err;
  Outcome both = Cli("plan --spec " + (dir / "v4.json").string() + " --kv-format c8 --seq-len 10");
  EXPECT_NE(both.exit_code, 0);
  std::filesystem::remove_all(dir);
}

// The short version of `sparsekv bench copy-checksum`: every row measured, each kernel's
// checksum checked against XXH3_64bits before timing (the command fails otherwise).
TEST(Cli, BenchCopyChecksumShortRun) {
  Outcome r = Cli("bench copy-checksum --json --rounds 1 --round-seconds 0.01");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["rows"].size(), 6u);
  for (const auto& row : j["rows"]) {
    for (const char* k : {"fused_bytes_per_s", "two_pass_bytes_per_s", "memcpy_bytes_per_s", "fused_vs_two_pass"}) {
      EXPECT_GT(row[k].get<double>(), 0) << k;
    }
  }
}

TEST(Cli, BenchAllocShortRun) {
  Outcome r = Cli("bench alloc --json --rounds 2 --round-seconds 0.05");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"pool_pairs_per_s", "malloc_pairs_per_s", "ratio", "pool_locked_pairs_per_s"}) {
    ASSERT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j[k].get<double>(), 0) << k;
  }
  EXPECT_NEAR(j["ratio"].get<double>(),
              j["pool_pairs_per_s"].get<double>() / j["malloc_pairs_per_s"].get<double>(), 1e-6);
  if (!SPARSEKV_SANITIZED) {
    // The lock-free thread-cache path must beat malloc clearly even on a noisy machine.
    EXPECT_GT(j["ratio"].get<double>(), 1.5);
  }
}

// The real daemon binary: serves the CLI's put/get/lookup/stats over its Unix socket and TCP,
// then drains and exits 0 on SIGTERM; a bad config is refused with the key named.
TEST(Daemon, ServesTheCliAndStopsCleanlyOnSigterm) {
  const auto dir = std::filesystem::temp_directory_path() / ("sparsekvd_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // Port 0: the daemon binds what the kernel gives and logs it (a port of our choosing could be
  // in use: one drawn from the pid collided with a connection's ephemeral port).
  std::ofstream(dir / "config.json") << R"({"listen": "127.0.0.1:0", "metrics_listen": "",
    "busy_poll_us": 50,
    "unix_socket": "d.sock", "data_dir": ")" << (dir / "var").string() << R"(",
    "offload": {"host": {"capacity_bytes": "256MiB"},
                "ssd": {"enabled": true, "capacity_bytes": "256MiB", "slab_grow_bytes": "16MiB"}}})";
  const std::string log = (dir / "log").string();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    execl(SPARSEKVD_PATH, SPARSEKVD_PATH, "--config", (dir / "config.json").c_str(), nullptr);
    _exit(127);
  }
  const auto sock = dir / "var" / "d.sock";
  for (int i = 0; i < 200 && !std::filesystem::exists(sock); ++i) usleep(50000);
  ASSERT_TRUE(std::filesystem::exists(sock)) << ReadWholeFile(log);
  std::string port;  // from "listening on 127.0.0.1:<port> and unix:..."
  for (int i = 0; i < 100 && port.empty(); ++i) {
    const std::string text = ReadWholeFile(log);
    const size_t at = text.find("listening on 127.0.0.1:");
    if (at != std::string::npos) {
      const size_t from = at + std::strlen("listening on 127.0.0.1:");
      const size_t to = text.find_first_not_of("0123456789", from);
      if (to != std::string::npos && to > from) port = text.substr(from, to - from);
    }
    if (port.empty()) usleep(50000);
  }
  ASSERT_FALSE(port.empty()) << ReadWholeFile(log);
  ASSERT_NE(port, "0");
  const std::string unix_addr = "--addr unix:" + sock.string();
  const std::string tcp_addr = "--addr 127.0.0.1:" + port;
  Outcome put = Cli("put " + unix_addr + " --key system-prompt --value hello-sparsekv");
  EXPECT_EQ(put.exit_code, 0) << put.err;
  Outcome get = Cli("get " + tcp_addr + " --key system-prompt");
  EXPECT_EQ(get.exit_code, 0) << get.err;
  EXPECT_EQ(get.out, "hello-sparsekv");
  Outcome get_shm = Cli("get " + unix_addr + " --key system-prompt");  // lent from the host arena
  EXPECT_EQ(get_shm.exit_code, 0) << get_shm.err;
  EXPECT_EQ(get_shm.out, "hello-sparsekv");
  Outcome lookup = Cli("lookup " + unix_addr + " --key system-prompt --key unknown");
  ASSERT_EQ(lookup.exit_code, 0) << lookup.err;
  auto j = nlohmann::json::parse(lookup.out);
  EXPECT_EQ(j["prefix_blocks"], 1);
  EXPECT_EQ(j["blocks"][0]["tier"], "host");
  EXPECT_EQ(j["blocks"][1]["tier"], "absent");
  Outcome stats = Cli("stats " + tcp_addr);
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_EQ(nlohmann::json::parse(stats.out)["puts"], 1);
  Outcome missing = Cli("get " + tcp_addr + " --key nothing");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("NotFound"), std::string::npos) << missing.err;
  Outcome wrong_ns = Cli("get " + tcp_addr + " --namespace other --key system-prompt");
  EXPECT_NE(wrong_ns.exit_code, 0);
  EXPECT_NE(wrong_ns.err.find("PermissionDenied"), std::string::npos) << wrong_ns.err;

  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << ReadWholeFile(log);
  EXPECT_EQ(WEXITSTATUS(status), 0) << ReadWholeFile(log);
  const std::string text = ReadWholeFile(log);
  EXPECT_NE(text.find("effective options"), std::string::npos);
  EXPECT_NE(text.find("stopped cleanly"), std::string::npos) << text;
  EXPECT_NE(text.find("with shared memory and the host arena"), std::string::npos) << text;

  std::ofstream(dir / "bad.json") << R"({"model": "deepseek-v3.2-exp", "max_connections": "lots"})";
  Outcome bad = Exec(SPARSEKVD_PATH, "--config " + (dir / "bad.json").string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("max_connections"), std::string::npos);
  std::ofstream(dir / "bad2.json") << R"({"busy_poll_us": 1000000})";
  Outcome bad2 = Exec(SPARSEKVD_PATH, "--config " + (dir / "bad2.json").string());
  EXPECT_NE(bad2.exit_code, 0);
  EXPECT_NE((bad2.out + bad2.err).find("busy_poll_us"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Cli, BenchDaemonShortRunOverBothTransports) {
  for (const char* addr : {"tcp", "unix"}) {
    Outcome r = Cli(std::string("bench daemon --spawn --addr ") + addr +
                    " --clients 4 --value-bytes 65536 --seconds 0.5 --keys-per-client 8 --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out);
    for (const char* k : {"put_ops_per_s", "get_ops_per_s", "get_bytes_per_s", "get_p50_us", "get_p99_us"}) {
      ASSERT_TRUE(j.contains(k)) << k;
      EXPECT_GT(j[k].get<double>(), 0) << k;
    }
    EXPECT_EQ(j["errors"], 0);
    EXPECT_EQ(j["transport"], std::string(addr) == "tcp" ? "tcp" : "shared_memory");
    EXPECT_LE(j["get_p50_us"].get<double>(), j["get_p99_us"].get<double>());
  }
  // A thread per client, making blocking calls, instead of one event loop.
  Outcome r = Cli("bench daemon --spawn --addr unix --clients 3 --threads 3 --value-bytes 10000 --seconds 0.3 "
                  "--keys-per-client 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["threads"], 3);
  EXPECT_EQ(j["errors"], 0);
  EXPECT_GT(j["get_ops_per_s"].get<double>(), 0);
  EXPECT_EQ(Cli("bench daemon --spawn --addr unix --threads 0").exit_code == 0, false);
}

TEST(Cli, BenchDaemonBatchShortRun) {
  // The short version of `sparsekv bench daemon --batch`: two small batches, one round each.
  Outcome r = Cli("bench daemon --batch --batch-sizes 65536x8 1048576x2 --rounds 1 --round-seconds 0.02 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["batch"].size(), 2u);
  EXPECT_EQ(j["batch"][0]["value_bytes"], 65536);
  EXPECT_EQ(j["batch"][0]["values"], 8);
  EXPECT_EQ(j["batch"][1]["value_bytes"], 1048576);
  for (const auto& b : j["batch"]) {
    for (const char* k : {"shm_bytes_per_s", "tcp_bytes_per_s", "memcpy_bytes_per_s", "socket_bytes_per_s",
                          "put_shm_bytes_per_s", "put_tcp_bytes_per_s", "put_lease_bytes_per_s",
                          "put_memcpy_bytes_per_s", "put_socket_bytes_per_s", "put_shm_vs_memcpy",
                          "put_lease_vs_memcpy", "put_tcp_vs_socket", "shm_leases_bytes_per_s",
                          "put_memcpy_fresh_bytes_per_s", "put_shm_vs_memcpy_fresh", "put_lease_vs_memcpy_fresh"}) {
      EXPECT_GT(b[k].get<double>(), 0) << k;
    }
    // The timed rounds read locally (the values were lent to the client before them).
    EXPECT_GT(b["shm_local_reads"].get<double>(), 0);
    EXPECT_GE(b["faults_per_gb"].get<double>(), 0);
  }
  EXPECT_FALSE(j["cpu"].get<std::string>().empty());
  for (const char* bad : {"64x", "x3", "65536", "0x3", "65536x0", "-1x3"}) {
    Outcome b = Cli(std::string("bench daemon --batch --batch-sizes ") + bad);
    EXPECT_EQ(b.exit_code == 0, false) << bad;
    EXPECT_NE(b.err.find("batch"), std::string::npos) << bad << ": " << b.err;  // a message, not an abort
  }
}

}  // namespace
