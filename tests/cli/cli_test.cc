// The `sparsekv` and `sparsekvd` binaries end to end: exit codes, stderr and JSON.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace {

struct Outcome {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Outcome Exec(const std::string& binary, const std::string& args) {
  const auto dir = std::filesystem::temp_directory_path() / ("sparsekv_cli_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string cmd = binary + " " + args + " >" + (dir / "out").string() + " 2>" + (dir / "err").string();
  const int rc = std::system(cmd.c_str());
  Outcome r;
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = Slurp(dir / "out");
  r.err = Slurp(dir / "err");
  return r;
}

Outcome Cli(const std::string& args) { return Exec(SPARSEKV_CLI_PATH, args); }

TEST(Cli, HelpForEverySubcommand) {
  for (const char* sub : {"", "plan", "spec", "bench", "bench alloc", "spec show"}) {
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

TEST(Daemon, LogsEffectiveOptionsAndRejectsBadConfig) {
  const auto dir = std::filesystem::temp_directory_path() / ("sparsekvd_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  Outcome ok = Exec(SPARSEKVD_PATH, "--data-dir " + (dir / "var").string());
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE((ok.out + ok.err).find("effective options"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_directory(dir / "var"));
  std::ofstream(dir / "bad.json") << R"({"model": "deepseek-v3.2-exp", "l1_bytes": "lots"})";
  Outcome bad = Exec(SPARSEKVD_PATH, "--config " + (dir / "bad.json").string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("l1_bytes"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
