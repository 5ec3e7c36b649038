// `stress cluster` and `bench remote`, short runs through their library calls: two daemons
// sharing a real loopback Redis Cluster, a prefix stored through A restored byte-identical
// through B, 8 clients on both daemons while a primary is SIGKILLed (0 client errors, GET p99
// during the failover within the remote timeout + local p99, hits back after it), and the
// remote tier's GET throughput measured beside redis-benchmark.
#include <gtest/gtest.h>

#include "cluster_stress.h"
#include "remote_bench.h"

namespace sparsekv {
namespace {

TEST(ClusterStress, APrimaryKilledUnderEightClientsCostsNoErrorAndHitsComeBack) {
  bench::ClusterStressOptions o;
  o.clients = 8;
  o.seconds = 6;
  o.kill_after = 0.3;
  o.value_bytes = 32 << 10;
  o.prefix_blocks = 32;
  o.seed = 11;
  auto r = bench::RunClusterStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& j = *r;
  SCOPED_TRACE(j.dump(1).substr(0, 6000));
  EXPECT_EQ(j["prefix"]["found_through_b"].get<uint64_t>(), 32u);
  EXPECT_EQ(j["prefix"]["in_remote_tier"].get<uint64_t>(), 32u);
  EXPECT_EQ(j["prefix"]["identical_through_b"].get<uint64_t>(), 32u);
  EXPECT_EQ(j["prefix"]["in_host_after"].get<uint64_t>(), 32u);
  EXPECT_EQ(j["errors"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["wrong_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j["phases"]["during"]["gets"].get<uint64_t>(), 0u);
  EXPECT_LE(j["phases"]["during"]["p99_us"].get<double>(), j["p99_bound_us"].get<double>());
  EXPECT_GT(j["kill"]["tiers_healthy_s"].get<double>(), j["kill"]["killed_at_s"].get<double>());
  EXPECT_GT(j["remote_hits_after_failover"].get<uint64_t>(), 0u);
  EXPECT_GT(j["victim_gets"]["after"]["hits"].get<uint64_t>(), 0u);
  EXPECT_GE(j["remote"]["a"]["incidents"].get<uint64_t>(), 1u);
  EXPECT_EQ(j["remote"]["a"]["corrupt"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["ok"].get<bool>());
}

TEST(RemoteBench, MeasuresTheTierBesideRedisBenchmark) {
  bench::RemoteBenchOptions o;
  o.value_bytes = {64 << 10, 6 << 20};
  o.data_bytes = 16 << 20;
  o.round_seconds = 0.3;
  o.rounds = 1;
  o.concurrency = 4;
  auto r = bench::RunRemoteBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ((*r)["sizes"].size(), 2u);
  for (const auto& s : (*r)["sizes"]) {
    EXPECT_EQ(s["ours"]["hit_ratio"].get<double>(), 1.0) << s.dump();
    EXPECT_GT(s["ours"]["gets_per_s"].get<double>(), 0) << s.dump();
    EXPECT_GT(s["redis_benchmark"]["gets_per_s"].get<double>(), 0) << s.dump();
    EXPECT_GT(s["ours_vs_redis_benchmark"].get<double>(), 0) << s.dump();
  }
}

}  // namespace
}  // namespace sparsekv
