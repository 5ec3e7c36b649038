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

}  // namespace
