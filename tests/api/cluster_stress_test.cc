// Two sparsekvd children configured with the same cluster (their config files' "offload.remote"
// section); then `stress cluster` and `bench remote`, short runs through their library calls: two daemons
// sharing a real loopback Redis Cluster, a prefix stored through A restored byte-identical
// through B, 8 clients on both daemons while a primary is SIGKILLed (0 client errors, GET p99
// during the failover within the remote timeout + local p99, hits back after it), and the
// remote tier's GET throughput measured beside redis-benchmark.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cluster_stress.h"
#include "redis_cluster_harness.h"
#include "remote_bench.h"
#include "sparsekv/bundle.h"
#include "sparsekv/client.h"
#include "tests/offload/test_util.h"
#include "tests/support/metrics_scrape.h"
#include "tests/support/process_reaper.h"

namespace sparsekv {
namespace {

uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

Result<std::unique_ptr<Client>> ConnectWithin(const std::string& address, const std::string& ns, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    ClientOptions o;
    o.address = address;
    o.namespace_name = ns;
    auto c = Client::Connect(o);
    if (c.ok() || std::chrono::steady_clock::now() > until) return c;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TEST(ClusterDaemons, TwoSparsekvdsShareAPrefixThroughTheClusterInTheirConfig) {
  auto cluster = bench::RedisClusterHarness::Start({});
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  const std::filesystem::path dir = (*cluster)->dir();
  std::string nodes;
  for (const std::string& s : (*cluster)->Seeds()) nodes += (nodes.empty() ? "\"" : ", \"") + s + "\"";
  testing::ProcessReaper reaper;
  struct Spawned {
    pid_t pid;
    std::string socket;
    uint16_t metrics;
  };
  auto spawn = [&](const std::string& name, const std::string& namespaces) {
    const auto data = dir / name;
    std::filesystem::create_directories(data);
    const uint16_t metrics = FreePort();
    const auto config = dir / (name + ".json");
    std::ofstream(config) << R"({"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:)" << metrics
                          << R"(", "unix_socket": "sock", "data_dir": ")" << data.string()
                          << R"(", "namespaces": )" << namespaces << R"(,
      "offload": {"host": {"capacity_bytes": "64MiB"},
                  "ssd": {"enabled": true, "capacity_bytes": "256MiB", "durability": "none"},
                  "remote": {"enabled": true, "nodes": [)" << nodes << R"(], "timeout_ms": 50}}})";
    const pid_t pid = fork();
    if (pid == 0) {
      FILE* f = std::freopen((dir / (name + ".log")).c_str(), "w", stderr);
      (void)f;
      execl(SPARSEKVD_PATH, SPARSEKVD_PATH, "--config", config.c_str(), nullptr);
      _exit(127);
    }
    reaper.pids.push_back(pid);
    return Spawned{pid, "unix:" + (data / "sock").string(), metrics};
  };
  // B numbers "default" 2: the cluster files blocks under the namespace's name.
  const Spawned a = spawn("a", R"([{"name": "default", "token": ""}])");
  const Spawned b = spawn("b", R"([{"name": "tenant-x", "token": ""}, {"name": "default", "token": ""}])");
  auto ca = ConnectWithin(a.socket, "default", 20);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  auto cb = ConnectWithin(b.socket, "default", 20);
  ASSERT_TRUE(cb.ok()) << cb.status().ToString();
  auto cx = ConnectWithin(b.socket, "tenant-x", 20);
  ASSERT_TRUE(cx.ok()) << cx.status().ToString();

  constexpr int kBlocks = 12;
  std::vector<WireBlockHash> hashes(kBlocks);
  std::vector<std::vector<std::byte>> values(kBlocks);
  std::vector<BundleRef> refs;
  for (int i = 0; i < kBlocks; ++i) {
    for (int k = 0; k < 16; ++k) hashes[i][k] = std::byte(i * 31 + k * 7 + 1);
    values[i].resize(100000 + i);
    for (size_t k = 0; k < values[i].size(); ++k) values[i][k] = std::byte((k * 13 + i) & 0xff);
    refs.push_back({hashes[i], values[i]});
  }
  auto put = (*ca)->Put(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  for (const Status& s : *put) ASSERT_TRUE(s.ok()) << s.ToString();
  // Written behind A's acknowledgement: B finds the prefix within a moment, in the cluster.
  LookupResult look;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    auto l = (*cb)->Lookup(hashes);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    look = *l;
  } while (look.prefix_blocks < kBlocks && std::chrono::steady_clock::now() < until);
  ASSERT_EQ(look.prefix_blocks, static_cast<uint32_t>(kBlocks));
  for (BlockTier t : look.tiers) EXPECT_EQ(t, BlockTier::kRemote);
  auto got = (*cb)->Get(hashes);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE((*got)[i].status.ok()) << (*got)[i].status.ToString();
    EXPECT_EQ((*got)[i].bytes, values[i]) << i;
  }
  // Another namespace of B sees none of them.
  auto other = (*cx)->Lookup(hashes);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->prefix_blocks, 0u);
  const std::string metrics = testing::ScrapeMetrics(b.metrics);
  EXPECT_NE(metrics.find("sparsekv_remote_healthy{tier=\"remote\"} 1"), std::string::npos) << metrics.substr(0, 3000);
  EXPECT_NE(metrics.find("sparsekv_tier_hits_total{tier=\"remote\"} 12"), std::string::npos);
  const std::string ma = testing::ScrapeMetrics(a.metrics);
  EXPECT_NE(ma.find("sparsekv_chain_written_behind_total 12"), std::string::npos) << ma.substr(0, 3000);
  ca->reset();
  cb->reset();
  cx->reset();
  for (pid_t p : {a.pid, b.pid}) {
    kill(p, SIGTERM);
    int status = 0;
    waitpid(p, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  reaper.pids.clear();
}

// A sparsekvd child over `data` with the given "offload" section, its stderr in <data>.log;
// `args` are extra command-line arguments. Stopped with Stop (SIGTERM, exit 0 expected).
struct Daemon {
  pid_t pid = -1;
  std::string socket;
};

Daemon SpawnDaemon(testing::ProcessReaper& reaper, const std::filesystem::path& data, const std::string& offload,
                   std::vector<std::string> args = {}) {
  std::filesystem::create_directories(data);
  const auto config = data / "config.json";
  std::ofstream(config) << R"({"listen": "127.0.0.1:0", "metrics_listen": "", "unix_socket": "sock", "data_dir": ")"
                        << data.string() << R"(", "namespaces": [{"name": "default", "token": ""}], "offload": )"
                        << offload << "}";
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::freopen((data.string() + ".log").c_str(), "a", stderr);
    (void)f;
    std::vector<char*> argv = {const_cast<char*>(SPARSEKVD_PATH), const_cast<char*>("--config"),
                               const_cast<char*>(config.c_str())};
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(SPARSEKVD_PATH, argv.data());
    _exit(127);
  }
  reaper.pids.push_back(pid);
  return Daemon{pid, "unix:" + (data / "sock").string()};
}

void Stop(testing::ProcessReaper& reaper, const Daemon& d) {
  kill(d.pid, SIGTERM);
  int status = 0;
  waitpid(d.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::erase(reaper.pids, d.pid);
}

struct Blocks {
  std::vector<WireBlockHash> hashes;
  std::vector<std::vector<std::byte>> values;
};

Blocks MakeBlocks(int first, int n) {
  Blocks b;
  b.hashes.resize(n);
  b.values.resize(n);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 16; ++k) b.hashes[i][k] = std::byte((first + i) * 29 + k * 11 + 3);
    b.values[i].resize(70000 + first + i);
    for (size_t k = 0; k < b.values[i].size(); ++k) b.values[i][k] = std::byte((k * 7 + first + i) & 0xff);
  }
  return b;
}

void PutAll(Client& c, const Blocks& b) {
  std::vector<BundleRef> refs;
  for (size_t i = 0; i < b.hashes.size(); ++i) refs.push_back({b.hashes[i], b.values[i]});
  auto put = c.Put(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  for (const Status& s : *put) ASSERT_TRUE(s.ok()) << s.ToString();
}

// Hits (byte for byte) of `b` through `c`; a miss must be NotFound, never another error.
size_t Hits(Client& c, const Blocks& b) {
  auto got = c.Get(b.hashes);
  EXPECT_TRUE(got.ok()) << got.status().ToString();
  if (!got.ok()) return 0;
  size_t hits = 0;
  for (size_t i = 0; i < b.hashes.size(); ++i) {
    const auto& g = (*got)[i];
    if (g.status.ok()) {
      EXPECT_EQ(g.bytes, b.values[i]) << i;
      ++hits;
    } else {
      EXPECT_TRUE(g.status.Is(StatusCode::kNotFound)) << g.status.ToString();
    }
  }
  return hits;
}

uint64_t ClusterKeys(bench::RedisClusterHarness& h) {
  uint64_t keys = 0;
  for (size_t i = 0; i < h.nodes().size(); ++i) {
    if (!h.nodes()[i].primary) continue;
    auto r = h.Command(i, {"DBSIZE"});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok() && !r->empty() && (*r)[0] == ':') keys += std::stoull(r->substr(1));
  }
  return keys;
}

// Daemons of two bundle formats (B plays the next format, --testing-bundle-format) share one
// cluster key prefix: each writes its blocks and reads the other's; every record of both stays
// in the cluster, and each still reads its own.
TEST(ClusterDaemons, DaemonsOfTwoBundleFormatsSharingAPrefixDeleteNoneOfEachOthersRecords) {
  auto cluster = bench::RedisClusterHarness::Start({});
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  const std::filesystem::path dir = (*cluster)->dir();
  std::string nodes;
  for (const std::string& s : (*cluster)->Seeds()) nodes += (nodes.empty() ? "\"" : ", \"") + s + "\"";
  const std::string offload = R"({"host": {"capacity_bytes": "64MiB"}, "remote": {"enabled": true, "nodes": [)" +
                              nodes + R"(], "timeout_ms": 1000}})";
  testing::ProcessReaper reaper;
  const std::string next = std::to_string(kBundleFormatVersion + 1);
  const Daemon a = SpawnDaemon(reaper, dir / "a", offload);
  const Daemon b = SpawnDaemon(reaper, dir / "b", offload, {"--testing-bundle-format", next});
  auto ca = ConnectWithin(a.socket, "default", 20);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  auto cb = ConnectWithin(b.socket, "default", 20);
  ASSERT_TRUE(cb.ok()) << cb.status().ToString();
  const Blocks of_a = MakeBlocks(0, 8), of_b = MakeBlocks(100, 8);
  // The same blocks too: both formats keep a copy of their own under the same block hash.
  const Blocks shared = MakeBlocks(200, 4);
  PutAll(**ca, of_a);
  PutAll(**cb, of_b);
  PutAll(**ca, shared);
  PutAll(**cb, shared);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ClusterKeys(**cluster) < 24 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(ClusterKeys(**cluster), 24u) << "each format's writes behind reached the cluster";
  // Each reads the other's: misses (its own local tier never held them).
  EXPECT_EQ(Hits(**cb, of_a), 0u);
  EXPECT_EQ(Hits(**ca, of_b), 0u);
  EXPECT_EQ(ClusterKeys(**cluster), 24u);
  EXPECT_EQ(Hits(**ca, of_a), of_a.hashes.size());
  EXPECT_EQ(Hits(**cb, of_b), of_b.hashes.size());
  EXPECT_EQ(Hits(**ca, shared), shared.hashes.size());
  EXPECT_EQ(Hits(**cb, shared), shared.hashes.size());
  ca->reset();
  cb->reset();
  Stop(reaper, a);
  Stop(reaper, b);
  // Restarted, their host tiers empty: everything comes from the cluster, still all there.
  const Daemon a2 = SpawnDaemon(reaper, dir / "a", offload);
  const Daemon b2 = SpawnDaemon(reaper, dir / "b", offload, {"--testing-bundle-format", next});
  auto ca2 = ConnectWithin(a2.socket, "default", 20);
  ASSERT_TRUE(ca2.ok()) << ca2.status().ToString();
  auto cb2 = ConnectWithin(b2.socket, "default", 20);
  ASSERT_TRUE(cb2.ok()) << cb2.status().ToString();
  EXPECT_EQ(Hits(**cb2, of_a), 0u);
  EXPECT_EQ(Hits(**ca2, of_b), 0u);
  EXPECT_EQ(Hits(**ca2, of_a), of_a.hashes.size());
  EXPECT_EQ(Hits(**cb2, of_b), of_b.hashes.size());
  EXPECT_EQ(Hits(**cb2, shared), shared.hashes.size());
  EXPECT_EQ(Hits(**ca2, shared), shared.hashes.size());
  EXPECT_EQ(ClusterKeys(**cluster), 24u);
  ca2->reset();
  cb2->reset();
  Stop(reaper, a2);
  Stop(reaper, b2);
}

// One data directory handed between daemons of two bundle formats, with its SSD tier, then with
// a RocksDB tier: each writes its blocks and reads the other's (misses), and after both have, the
// first still reads every block it wrote, and so does the second.
TEST(FormatHandover, ADataDirectoryHandedBetweenDaemonsOfTwoBundleFormatsLosesNoRecordOfEither) {
  testing::TempDir tmp("handover");
  const std::string next = std::to_string(kBundleFormatVersion + 1);
  for (const char* tier : {"ssd", "rocksdb"}) {
    SCOPED_TRACE(tier);
    const std::filesystem::path data = std::filesystem::path(tmp.path()) / tier;
    // Write-through: every put reaches the persistent tier at once; the host tier is small.
    const std::string offload = std::string(R"({"write_policy": "write-through", "host": {"capacity_bytes": "1MiB"}, ")") +
                                tier + R"(": {"enabled": true, "capacity_bytes": "64MiB", "durability": "none"})" +
                                (std::string(tier) == "rocksdb" ? R"(, "ssd": {"enabled": false}})" : "}");
    testing::ProcessReaper reaper;
    const Blocks of_a = MakeBlocks(0, 6), of_b = MakeBlocks(50, 6);
    auto round = [&](bool as_b, const Blocks* put, const Blocks& mine, const Blocks& theirs, size_t mine_hits) {
      const Daemon d = as_b ? SpawnDaemon(reaper, data, offload, {"--testing-bundle-format", next})
                            : SpawnDaemon(reaper, data, offload);
      auto c = ConnectWithin(d.socket, "default", 20);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_EQ(Hits(**c, theirs), 0u) << (as_b ? "B" : "A") << " read the other format's records";
      if (put != nullptr) PutAll(**c, *put);
      EXPECT_EQ(Hits(**c, mine), mine_hits) << (as_b ? "B" : "A");
      c->reset();
      Stop(reaper, d);
    };
    round(false, &of_a, of_a, of_b, of_a.hashes.size());
    round(true, &of_b, of_b, of_a, of_b.hashes.size());
    round(false, nullptr, of_a, of_b, of_a.hashes.size());
    round(true, nullptr, of_b, of_a, of_b.hashes.size());
  }
}

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
  // Writes behind that failed in the outage are repaired once the cluster is back: no key is
  // left remembered, and each one remembered at the end of the load was erased.
  uint64_t failures = 0;
  for (const char* d : {"a", "b"}) {
    const auto& c = j["chains"][d];
    EXPECT_EQ(c["stale_keys_after_repair"].get<uint64_t>(), 0u) << c.dump();
    EXPECT_GE(c["repaired"].get<uint64_t>(), c["stale_keys_at_end_of_load"].get<uint64_t>()) << c.dump();
    failures += c["write_behind_failures"].get<uint64_t>();
  }
  EXPECT_GT(failures, 0u) << "the outage failed some writes behind";
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
