// `sparsekv bench restore` as a library call: a small V3.2 prompt stored into and restored from
// the host tier and the SSD tier, and its option errors.
#include "restore_bench.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "tests/offload/test_util.h"

namespace sparsekv::bench {
namespace {

RestoreBenchOptions Small() {
  RestoreBenchOptions o;
  o.model = "deepseek-v3.2-exp";
  o.blocks = 4;
  o.rounds = 1;
  return o;
}

void ExpectShape(const nlohmann::json& j, const std::string& tier) {
  for (const char* k : {"restore_bytes_per_s", "store_bytes_per_s", "memcpy_bytes_per_s",
                        "restore_vs_memcpy", "store_time_vs_memcpy", "restore_cpu_s_per_gb",
                        "store_cpu_s_per_gb", "block_bytes", "blocks", "tier", "model", "rounds",
                        "faults_per_block", "pread_bytes_per_s", "samples"}) {
    ASSERT_TRUE(j.contains(k)) << tier << " " << k;
  }
  for (const char* k : {"restore_bytes_per_s", "store_bytes_per_s", "memcpy_bytes_per_s",
                        "restore_vs_memcpy", "store_time_vs_memcpy"}) {
    EXPECT_GT(j[k].get<double>(), 0) << tier << " " << k;
  }
  const double faults = j["faults_per_block"].get<double>();
  EXPECT_TRUE(std::isfinite(faults)) << tier;
  EXPECT_GE(faults, 0) << tier;
  EXPECT_GE(j["restore_cpu_s_per_gb"].get<double>(), 0) << tier;
  EXPECT_EQ(j["tier"], tier);
  EXPECT_EQ(j["model"], "deepseek-v3.2-exp");
  EXPECT_EQ(j["blocks"], 4);
  EXPECT_EQ(j["rounds"], 1);
  EXPECT_GT(j["block_bytes"].get<uint64_t>(), 1u << 20);  // a bf16 V3.2 block: about 11 MB
  for (const char* m : {"store", "restore", "memcpy"}) {
    ASSERT_TRUE(j["samples"].contains(m)) << tier << " " << m;
    EXPECT_GT(j["samples"][m]["median"].get<double>(), 0) << tier << " " << m;
  }
}

TEST(BenchRestore, HostTier) {
  RestoreBenchOptions o = Small();
  o.tier = "host";
  auto r = RunRestoreBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectShape(*r, "host");
  EXPECT_TRUE((*r)["pread_bytes_per_s"].is_null());
  // The write-back eviction phase: 23 blocks evicted each way; the hook's way none ahead, the
  // other most (how many depends on the machine's load, so only "some" is asserted).
  const nlohmann::json& e = (*r)["write_back_eviction"];
  ASSERT_TRUE(e.is_object()) << r->dump(2);
  EXPECT_EQ(e["hook"]["evicted_blocks"], 23);
  EXPECT_EQ(e["hook"]["evicted_ahead"], 0);
  EXPECT_EQ(e["evict_ahead"]["evicted_blocks"], 23);
  EXPECT_GT(e["evict_ahead"]["evicted_ahead"].get<uint64_t>(), 0u);
  for (const char* m : {"hook", "evict_ahead"}) {
    const double ratio = e[m]["lock_time_vs_memcpy"].get<double>();
    EXPECT_TRUE(std::isfinite(ratio) && ratio > 0) << m << " " << ratio;
  }
  EXPECT_EQ((*r)["evict_lock_time_vs_memcpy"], e["evict_ahead"]["lock_time_vs_memcpy"]);
}

TEST(BenchRestore, SsdTierRemovesWhatItMade) {
  testing::TempDir dir("restore_bench");
  RestoreBenchOptions o = Small();
  o.tier = "ssd";
  o.dir = dir.path();
  o.ssd_read_arena_bytes = 64ull << 20;
  o.eviction_blocks = 0;  // the host test covers it

  auto r = RunRestoreBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectShape(*r, "ssd");
  EXPECT_GT((*r)["pread_bytes_per_s"].get<double>(), 0);
  EXPECT_GT((*r)["restore_vs_pread"].get<double>(), 0);
  EXPECT_EQ((*r)["durability"], "none");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BenchRestore, BadOptionsAreInvalidArgument) {
  RestoreBenchOptions zero = Small();
  zero.blocks = 0;
  auto r = RunRestoreBench(zero);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("--blocks 0"), std::string::npos) << r.status().ToString();

  RestoreBenchOptions no_dir = Small();
  no_dir.tier = "ssd";
  r = RunRestoreBench(no_dir);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("--dir is required"), std::string::npos)
      << r.status().ToString();

  RestoreBenchOptions tape = Small();
  tape.tier = "tape";
  r = RunRestoreBench(tape);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("host or ssd"), std::string::npos) << r.status().ToString();

  RestoreBenchOptions rounds = Small();
  rounds.rounds = 0;
  r = RunRestoreBench(rounds);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();

  RestoreBenchOptions model = Small();
  model.model = "no-such-model";
  r = RunRestoreBench(model);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("unknown model preset"), std::string::npos)
      << r.status().ToString();
  RestoreBenchOptions few = Small();
  few.eviction_blocks = 2;
  r = RunRestoreBench(few);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument)) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("--eviction-blocks 2"), std::string::npos) << r.status().ToString();
  RestoreBenchOptions slow = Small();
  slow.eviction_compute_us = -1;
  r = RunRestoreBench(slow);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("--eviction-compute-us"), std::string::npos) << r.status().ToString();
}

}  // namespace
}  // namespace sparsekv::bench
