// `sparsekv bench codec --json`, a short run: exit code, JSON shape, path selection, errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/run_command.h"

namespace {

using Outcome = sparsekv::testing::CommandOutcome;

Outcome Cli(const std::string& env, const std::string& args) {
  return sparsekv::testing::RunCommand(env + " " + SPARSEKV_CLI_PATH + " " + args, "codec_cli");
}

constexpr const char* kShort = "bench codec --json --rounds 1 --round-seconds 0.002";
constexpr const char* kFormats[] = {"bf16",   "fp32",    "c8_mla", "fp8_ds_mla",
                                    "fp8_v4", "idx_fp8", "idx_c8"};

TEST(BenchCodec, ShortRunHasTheDocumentedShape) {
  Outcome r = Cli("", kShort);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_TRUE(j.contains("formats"));
  for (const char* f : kFormats) {
    ASSERT_TRUE(j["formats"].contains(f)) << f;
    for (const char* k : {"encode_bytes_per_s", "decode_bytes_per_s", "decode_fp32_bytes_per_s"}) {
      ASSERT_TRUE(j["formats"][f].contains(k)) << f << " " << k;
      EXPECT_GT(j["formats"][f][k].get<double>(), 0) << f << " " << k;
    }
    EXPECT_NEAR(
        j["formats"][f]["encode_vs_memcpy"].get<double>(),
        j["formats"][f]["encode_bytes_per_s"].get<double>() / j["memcpy_bytes_per_s"].get<double>(),
        1e-9);
  }
  EXPECT_GT(j["memcpy_bytes_per_s"].get<double>(), 0);
  EXPECT_EQ(j["working_set_bytes"].get<uint64_t>(), 147456u);
  EXPECT_TRUE(j["path"].is_string());
  EXPECT_TRUE(j.contains("max_spread"));
  EXPECT_TRUE(j["samples"].contains("memcpy"));
  EXPECT_TRUE(j["samples"]["c8_mla.encode"].contains("spread"));
}

TEST(BenchCodec, PathComesFromTheFlagOrTheEnvironment) {
  Outcome flag = Cli("", std::string(kShort) + " --path scalar --working-set-bytes 9216");
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  EXPECT_EQ(nlohmann::json::parse(flag.out)["path"], "scalar");
  EXPECT_EQ(nlohmann::json::parse(flag.out)["working_set_bytes"], 9216);
  Outcome env = Cli("SPARSEKV_SIMD=scalar", kShort);
  ASSERT_EQ(env.exit_code, 0) << env.err;
  EXPECT_EQ(nlohmann::json::parse(env.out)["path"], "scalar");
}

TEST(BenchCodec, BadArgumentsFailWithAMessage) {
  Outcome path = Cli("", std::string(kShort) + " --path sse9");
  EXPECT_NE(path.exit_code, 0);
  EXPECT_NE(path.err.find("unknown SIMD path 'sse9'"), std::string::npos) << path.err;
  Outcome env = Cli("SPARSEKV_SIMD=sse9", kShort);
  EXPECT_NE(env.exit_code, 0);
  EXPECT_NE(env.err.find("SPARSEKV_SIMD"), std::string::npos) << env.err;
  Outcome size = Cli("", std::string(kShort) + " --working-set-bytes 1000");
  EXPECT_NE(size.exit_code, 0);
  EXPECT_NE(size.err.find("multiple of 9216"), std::string::npos) << size.err;
  EXPECT_TRUE(size.out.empty());
}

}  // namespace
