// `sparsekv stress cluster`: two daemons sharing a Redis Cluster, one of its primaries killed
// (SIGKILL) while clients read and write through both.
//
// Set-up: a loopback cluster of 3 primaries and 3 replicas (RedisClusterHarness), and daemons A
// and B in this process (server::Server over server::TieredStore), each with its own host and
// SSD tiers and the cluster as its remote tier. B lists another namespace before "default", so
// the two number "default" differently and share it by name.
//
// Phase 1, the prefix: a client PUTs `prefix_blocks` blocks through A; once A has written them
// behind, a client on B LOOKUPs the prefix (every block must be found, in the remote tier) and
// GETs it (every block byte-identical), and LOOKUPs again (now in B's host tier).
//
// Phase 2, the load: `clients` threads, each with a connection to A and to B, for `seconds`.
// Each operation picks a daemon at random: 30% PUT a new block (immutable, as KV blocks keyed by
// their prefix hash are; its bytes are a function of its id), 70% GET one: half of them a block
// recently written through the other daemon (so that it is read from the cluster), half any
// block written so far. Every GET is checked byte for byte. After `kill_after` of the run a
// primary is SIGKILLed; the run notes when the cluster has failed it over and when both
// daemons' remote tiers see every slot served again.
//
// Phases of the GETs: before the kill, during the failover (until both tiers are healthy), and
// after. `local_p99` is the p99 of GETs before the kill of blocks written through the same
// daemon (served from its own tiers); the bound is the remote timeout plus local_p99.
//
// ok: every prefix block found and identical through B, no client error (any status but OK,
// and NotFound for a GET), no GET returning wrong bytes, and with a kill: GET p99 during the
// failover within the bound, and the remote tiers serving hits again after it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct ClusterStressOptions {
  // Client threads, each with a connection to both daemons. Default: 8.
  int clients = 8;
  // Seconds of load (phase 2). Default: 20.
  double seconds = 20;
  // The primary is killed after this fraction of the load; 0 or less: no kill. Default: 1/3.
  double kill_after = 1.0 / 3;
  // Bytes of each block. Default: 64 KiB.
  uint64_t value_bytes = 64 << 10;
  // Blocks of the shared prefix (phase 1). Default: 64.
  uint32_t prefix_blocks = 64;
  // The daemons' remote tier timeout. Default: 50 ms.
  uint32_t remote_timeout_ms = 50;
  // Each daemon's host and SSD tiers. Defaults: 64 MiB and 1 GiB.
  uint64_t host_bytes = 64ull << 20;
  uint64_t ssd_bytes = 1ull << 30;
  // cluster-node-timeout of the Redis nodes. Default: 1000 ms.
  uint32_t node_timeout_ms = 1000;
  // Where the temporary directory goes ("" : the system's), and whether to keep it.
  std::string dir;
  bool keep = false;
  // Seed of ids and choices; 0 draws one. Default: 0.
  uint64_t seed = 0;
};

// Keys: ok, prefix {blocks, found_through_b, in_remote_tier, identical_through_b,
// in_host_after}, puts, put_errors, gets, hits, misses, errors, wrong_bytes, error_examples,
// phases {before, during, after: {gets, hits, misses, errors, p50_us, p99_us, max_us}},
// local_p99_us, p99_bound_us, kill {node, killed_at_s, cluster_failed_over_s,
// tiers_healthy_s}, victim_gets {before, during, after: {gets, hits}} (GETs of blocks in the
// killed primary's slots written through the other daemon), remote {a, b: tier state and
// statistics}, timeline [{t_s, remote_hits, remote_misses, healthy}], options.
// Errors of the set-up (no redis-server, a daemon that does not start) are returned as Status.
Result<nlohmann::json> RunClusterStress(const ClusterStressOptions& options);

}  // namespace sparsekv::bench
