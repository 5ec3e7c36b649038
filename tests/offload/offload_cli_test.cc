// `sparsekv stress offload` and `sparsekv bench tier` end to end through the binary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/offload/test_util.h"
#include "tests/support/run_command.h"

namespace {

using Outcome = sparsekv::testing::CommandOutcome;

Outcome Cli(const std::string& args) {
  return sparsekv::testing::RunCommand(std::string(SPARSEKV_CLI_PATH) + " " + args, "offload_cli");
}

TEST(StressOffload, ShortRunLosesNothingAndDetectsEveryFlip) {
  sparsekv::testing::TempDir dir("stress");
  Outcome r = Cli("stress offload --seconds 3 --kill-cycles 3 --flip-bundles 16 --dir " +
                  dir.path() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"acknowledged", "lost", "corrupt_returned", "detected_corrupt",
                        "stale_returned", "verified"}) {
    ASSERT_TRUE(j.contains(k)) << k;
  }
  EXPECT_GT(j["acknowledged"].get<uint64_t>(), 20u);
  EXPECT_EQ(j["lost"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["corrupt_returned"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["stale_returned"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["unknown_found"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["flip"]["injected"].get<uint64_t>(), 16u);
  EXPECT_EQ(j["flip"]["detected"].get<uint64_t>(), 16u);
  EXPECT_EQ(j["flip"]["returned"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["flip"]["lost_untouched"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["ok"].get<bool>());
  // Everything it made is gone.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BenchTier, SsdAndRocksDbJsonShape) {
  sparsekv::testing::TempDir dir("bench");
  for (const char* tier : {"ssd", "rocksdb"}) {
    Outcome r =
        Cli(std::string("bench tier --tier ") + tier +
            " --bundle-bytes 1048576 --queue-depth 16 --data-bytes 33554432 --rounds 1 --dir " +
            dir.path() + " --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out);
    for (const char* k : {"write_bytes_per_s", "read_bytes_per_s", "baseline_write_bytes_per_s",
                          "baseline_read_bytes_per_s", "read_vs_baseline", "write_vs_baseline"}) {
      ASSERT_TRUE(j.contains(k)) << tier << " " << k;
      EXPECT_GT(j[k].get<double>(), 0) << tier << " " << k;
    }
    EXPECT_EQ(j["tier"], tier);
    EXPECT_EQ(j["bundle_bytes"], 1048576);
    EXPECT_EQ(j["bundles"], 32);
    EXPECT_TRUE(j["samples"].contains("tier_read"));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BenchTier, BadArgumentsAreClearErrors) {
  Outcome no_dir = Cli("bench tier --tier ssd --json");
  EXPECT_NE(no_dir.exit_code, 0);
  EXPECT_NE(no_dir.err.find("--dir is required"), std::string::npos) << no_dir.err;
  Outcome bad_tier = Cli("bench tier --tier tape --dir /tmp");
  EXPECT_NE(bad_tier.exit_code, 0);
  EXPECT_NE(bad_tier.err.find("ssd, rocksdb or host"), std::string::npos) << bad_tier.err;
  Outcome bad_durability = Cli("stress offload --dir /tmp --durability maybe");
  EXPECT_NE(bad_durability.exit_code, 0);
  EXPECT_NE(bad_durability.err.find("unknown durability 'maybe'"), std::string::npos)
      << bad_durability.err;
}

// `sparsekv bench sparse-decode`, short: V3.2 and V4 from the host tier, every output identical
// to the resident path's, the working set a fraction of the resident layout, and its hits what
// the selections kept from one step to the next.
TEST(BenchSparseDecode, ShortRunsAreIdenticalAndLean) {
  for (const char* model : {"deepseek-v3.2-exp", "deepseek-v4-flash"}) {
    Outcome r = Cli(std::string("bench sparse-decode --model ") + model +
                    " --context 16384 --steps 6 --l1-fraction 0.25 --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out);
    for (const char* k : {"measured_overlap", "bytes_fetched_per_step", "working_set_hit_ratio", "step_seconds",
                          "resident_step_seconds", "full_restore_seconds", "l1_bytes_per_token",
                          "resident_l1_bytes_per_token"}) {
      ASSERT_TRUE(j.contains(k)) << model << " " << k;
      EXPECT_GT(j[k].get<double>(), 0) << model << " " << k;
    }
    EXPECT_TRUE(j["outputs_identical"].get<bool>()) << model;
    EXPECT_GT(j["measured_overlap"].get<double>(), 0.6) << model;
    EXPECT_LT(j["measured_overlap"].get<double>(), 1.0) << model;
    EXPECT_LT(j["l1_vs_resident"].get<double>(), 0.6) << model;
    // The working set holds more than a selection, so it keeps at least what the last kept.
    EXPECT_GE(j["working_set_hit_ratio"].get<double>(), j["measured_overlap"].get<double>() - 0.05) << model;
  }
  // Prefetching the next-ranked entries: the same selections (the ranked run's top-k is the
  // plain run's), the same outputs, fewer entries fetched on demand, some prefetched used.
  {
    const std::string common = "bench sparse-decode --context 16384 --steps 6 --l1-fraction 0.25 --json";
    Outcome plain = Cli(common);
    Outcome ahead = Cli(common + " --prefetch 256");
    ASSERT_EQ(plain.exit_code, 0) << plain.err;
    ASSERT_EQ(ahead.exit_code, 0) << ahead.err;
    auto p = nlohmann::json::parse(plain.out);
    auto a = nlohmann::json::parse(ahead.out);
    EXPECT_TRUE(a["outputs_identical"].get<bool>());
    EXPECT_EQ(a["selection_mismatches"].get<uint64_t>(), 0u);
    EXPECT_DOUBLE_EQ(a["measured_overlap"].get<double>(), p["measured_overlap"].get<double>());
    EXPECT_LT(a["bytes_fetched_per_step"].get<double>(), p["bytes_fetched_per_step"].get<double>());
    EXPECT_GT(a["prefetch_used_ratio"].get<double>(), 0);
    EXPECT_GT(a["bytes_prefetched_per_step"].get<double>(), 0);
  }
  // From the SSD tier: one sector per missing entry at most; the tier's files are removed.
  sparsekv::testing::TempDir dir("sparse_bench");
  Outcome ssd = Cli("bench sparse-decode --tier ssd --dir " + dir.path() + " --context 8192 --steps 6 --json");
  ASSERT_EQ(ssd.exit_code, 0) << ssd.err;
  auto j = nlohmann::json::parse(ssd.out);
  EXPECT_TRUE(j["outputs_identical"].get<bool>());
  EXPECT_GT(j["sectors_read_per_step"].get<double>(), 0);
  EXPECT_LE(j["sectors_read_per_step"].get<double>() * j["entry_bytes"].get<double>(),
            j["bytes_fetched_per_step"].get<double>() + 1e-6);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  // Through sparsekvd (GET_RANGES), its values mostly on its SSD tier: one request per layer
  // and step, at most a sector read by the daemon per entry, the same outputs.
  Outcome d = Cli("bench sparse-decode --tier daemon-ssd --dir " + dir.path() + " --context 8192 --steps 6 --json");
  ASSERT_EQ(d.exit_code, 0) << d.err;
  j = nlohmann::json::parse(d.out);
  EXPECT_TRUE(j["outputs_identical"].get<bool>());
  EXPECT_EQ(j["requests_per_step"].get<double>(), 2.0);
  EXPECT_GT(j["daemon_ssd_bytes_read_per_step"].get<double>(), 0);
  EXPECT_LE(j["daemon_ssd_bytes_read_per_step"].get<double>(),
            j["bytes_fetched_per_step"].get<double>() / j["entry_bytes"].get<double>() * 4096 + 1e-6);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  Outcome no_dir = Cli("bench sparse-decode --tier ssd --context 4096 --json");
  EXPECT_NE(no_dir.exit_code, 0);
  EXPECT_NE(no_dir.err.find("--tier ssd needs --dir"), std::string::npos) << no_dir.err;
  Outcome bad = Cli("bench sparse-decode --context 1000 --json");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("multiple of 128"), std::string::npos) << bad.err;
}

}  // namespace

namespace {

// `sparsekv stress suspend`, short: kills, torn log tails, resumes checked against a fresh run.
TEST(StressSuspend, ShortRunLosesNoTokenAndEveryResumeMatches) {
  sparsekv::testing::TempDir dir("stress_suspend");
  Outcome r = Cli("stress suspend --seconds 4 --kill-cycles 3 --requests 4 --max-request-tokens 300 --dir " +
                  dir.path() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["acknowledged_tokens"].get<uint64_t>(), 50u);
  EXPECT_EQ(j["lost_tokens"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["resurrected"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["child_mismatches"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["differing_requests"].get<uint64_t>(), 0u);
  EXPECT_GT(j["checked_tokens"].get<uint64_t>(), 0u);
  EXPECT_GT(j["resumes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["torn_tails_injected"].get<uint64_t>(), 2u);
  EXPECT_GE(j["torn_tails_cut"].get<uint64_t>(), 2u);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// Requests of eight tokens finish every few steps, and every other child stalls right after a
// durable finish record and is killed there: such a request is rightly gone from the log, never
// counted as lost (the CI failure of 2026-11-27 counted the 305 tokens of one as lost).
TEST(StressSuspend, KillsBetweenFinishAndItsAcknowledgementLoseNothing) {
  sparsekv::testing::TempDir dir("stress_suspend_finish");
  Outcome r = Cli("stress suspend --seconds 3 --kill-cycles 12 --requests 4 --max-request-tokens 8 --dir " +
                  dir.path() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out);
  // Six of the twelve children stall after their first durable finish and are killed there
  // (the parent waits for the stall, so this holds however slow the build).
  EXPECT_EQ(j["finish_stalls"].get<uint64_t>(), 6u);
  EXPECT_GE(j["requests_finished"].get<uint64_t>(), 6u);
  EXPECT_GE(j["finished_unacknowledged"].get<uint64_t>(), j["finish_stalls"].get<uint64_t>());
  EXPECT_EQ(j["lost_tokens"].get<uint64_t>(), 0u) << r.out;
  EXPECT_EQ(j["resurrected"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["differing_requests"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["ok"].get<bool>()) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// `sparsekv bench suspend`, small: every part runs, every resume is exact (the bench fails
// otherwise), and the figures it reports are there.
TEST(BenchSuspend, SmallRunJsonShape) {
  sparsekv::testing::TempDir dir("bench_suspend");
  Outcome r = Cli("bench suspend --v32-tokens 384 --v4-tokens 256 --turns 3 --turn-tokens 128 --concurrency 1 "
                  "--concurrency 16 --log-seconds 0.3 --no-fio --json --dir " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["sequences"].size(), 4u);
  for (const auto& s : j["sequences"]) {
    EXPECT_GT(s["suspend_bytes_per_s"].get<double>(), 0);
    EXPECT_GT(s["resume_bytes_per_s"].get<double>(), 0);
    EXPECT_EQ(s["state_tokens"].get<uint64_t>(), s["tokens"].get<uint64_t>() - 5);
  }
  EXPECT_GT(j["conversation"]["tier_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j["conversation"]["whole_snapshots_bytes"].get<uint64_t>(), 0u);
  // Suspend's own storage (write-back: history records and one live tail) is below the whole
  // snapshots' sum; write-through also keeps every block whole, a prefix hit at each edge.
  EXPECT_LT(j["conversation"]["ratio_vs_whole_snapshots"].get<double>(), 1.0);
  EXPECT_GT(j["conversation_write_through"]["tier_bytes"].get<uint64_t>(),
            j["conversation"]["tier_bytes"].get<uint64_t>());
  for (const auto& s : j["sequences"]) {
    if (s["model"] == "deepseek-v4-flash") {
      EXPECT_EQ(s["history_blocks"].get<uint64_t>(), s["state_tokens"].get<uint64_t>() / 128);
    }
  }
  ASSERT_EQ(j["log"].size(), 2u);
  EXPECT_GT(j["log"][1]["appends_per_sync"].get<double>(), 1.0);  // 16 appending: group commits
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_NE(Cli("bench suspend --dir " + dir.path() + " --v32-tokens 5").exit_code, 0);
}

}  // namespace
