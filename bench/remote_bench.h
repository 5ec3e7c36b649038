// `sparsekv bench remote`: GET throughput of the remote tier against redis-benchmark on the
// same loopback Redis Cluster (3 primaries, 3 replicas, RedisClusterHarness), in one run.
//
// For each value size, the tier stores `data_bytes` of records of exactly that size (bundle
// header included) and redis-benchmark fills its own keyspace with values of that size (about
// as many keys). Then, in interleaved rounds of about `round_seconds` each:
// - ours: `concurrency` threads, each calling RemoteTier::GetAsync with `pipeline` random keys
//   at a time (one pipeline per node, all nodes at once), every record's checksum checked;
// - redis-benchmark: `redis-benchmark --cluster -t get -c concurrency -P pipeline -d size`.
// redis-benchmark draws keys of which some were never SET (its fill is random too); a GET of
// such a key answers nil at once, so its rate is scaled by its hit ratio, read from the
// primaries' keyspace_hits and keyspace_misses. Ours only asks for keys it stored.
//
// Reported per size: medians (and spread) of GETs per second and bytes per second, hit ratios,
// and ours / redis-benchmark.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct RemoteBenchOptions {
  // Value sizes. Default: 64 KiB and 6 MiB.
  std::vector<uint64_t> value_bytes = {64ull << 10, 6ull << 20};
  // Threads (ours) and connections (redis-benchmark -c). Default: 8.
  int concurrency = 8;
  // Keys per GET call (ours) and requests pipelined (redis-benchmark -P). Default: 1.
  uint32_t pipeline = 1;
  // Bytes stored per size (at least 8 records). Default: 128 MiB.
  uint64_t data_bytes = 128ull << 20;
  // Length of each round, and rounds of each method. Defaults: 2 s and 3.
  double round_seconds = 2.0;
  int rounds = 3;
  // Where the cluster's temporary directory goes, and whether to keep it.
  std::string dir;
  bool keep = false;
  // The binary. Default: redis-benchmark on PATH.
  std::string redis_benchmark = "redis-benchmark";
};

// {"sizes": [{value_bytes, records, ours {gets_per_s, bytes_per_s, spread, hit_ratio},
// redis_benchmark {gets_per_s (scaled by hits), raw_rps, bytes_per_s, spread, hit_ratio},
// ours_vs_redis_benchmark}], concurrency, pipeline, rounds}.
Result<nlohmann::json> RunRemoteBench(const RemoteBenchOptions& options);

}  // namespace sparsekv::bench
