#include "remote_bench.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "bench_util.h"
#include "redis_cluster_harness.h"
#include "sparsekv/remote_tier.h"

namespace sparsekv::bench {
namespace {

using Clock = std::chrono::steady_clock;

BundleKey BenchKey(uint64_t size, uint64_t i) {
  BundleKey k;
  k.namespace_id = 1;
  k.hash.lo = MixBits(size * 1000003 + i);
  k.hash.hi = MixBits(k.hash.lo + i);
  return k;
}

// keyspace_hits and keyspace_misses summed over the primaries.
std::pair<uint64_t, uint64_t> KeyspaceCounts(RedisClusterHarness& c) {
  uint64_t hits = 0, misses = 0;
  for (size_t i = 0; i < c.nodes().size(); ++i) {
    if (!c.nodes()[i].alive || !c.nodes()[i].primary) continue;
    Result<std::string> info = c.Command(i, {"INFO", "stats"});
    if (!info.ok()) continue;
    auto field = [&](const std::string& name) -> uint64_t {
      const size_t at = info->find(name + ":");
      return at == std::string::npos ? 0 : std::stoull(info->substr(at + name.size() + 1));
    };
    hits += field("keyspace_hits");
    misses += field("keyspace_misses");
  }
  return {hits, misses};
}

// Runs redis-benchmark and returns the rps of its one test (from --csv).
Result<double> RedisBenchmark(const std::string& binary, uint16_t port, const std::string& test, int clients,
                              uint32_t pipeline, uint64_t size, uint64_t keyspace, uint64_t requests) {
  const std::string cmd =
      fmt::format("{} -h 127.0.0.1 -p {} --cluster -t {} -c {} -P {} -d {} -r {} -n {} --csv 2>/dev/null", binary,
                  port, test, clients, pipeline, size, keyspace, requests);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return Status::Unavailable("redis-benchmark: popen failed");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = pclose(p);
  // "GET","26631.16",... after the header line.
  const std::string tag = "\"" + std::string(test == "get" ? "GET" : "SET") + "\",\"";
  const size_t at = out.find(tag);
  if (rc != 0 || at == std::string::npos) {
    return Status::Unavailable(fmt::format("redis-benchmark failed (exit {}): {}", rc, out.substr(0, 300)));
  }
  return std::stod(out.substr(at + tag.size()));
}

}  // namespace

Result<nlohmann::json> RunRemoteBench(const RemoteBenchOptions& o) {
  if (o.concurrency < 1 || o.pipeline < 1 || o.rounds < 1 || o.round_seconds <= 0) {
    return Status::InvalidArgument("bench remote: concurrency, pipeline and rounds >= 1, round_seconds > 0");
  }
  RedisClusterHarnessOptions ho;
  ho.dir = o.dir;
  ho.keep = o.keep;
  ho.maxmemory_bytes = 2ull << 30;  // no evictions during the run
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RedisClusterHarness> cluster, RedisClusterHarness::Start(ho));
  RemoteTierOptions to;
  to.nodes = cluster->Seeds();
  to.timeout_ms = 1000;  // throughput, not failure handling, is measured here
  to.connections_per_node = static_cast<uint32_t>(o.concurrency);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RemoteTier> tier, RemoteTier::Open(to));
  if (!tier->WaitHealthy(std::chrono::seconds(10))) return Status::Unavailable("bench remote: no cluster");
  const uint16_t port = cluster->nodes()[0].port;

  nlohmann::json sizes = nlohmann::json::array();
  for (uint64_t size : o.value_bytes) {
    const uint64_t header = BundleHeaderBytes(1);
    if (size <= header) return Status::InvalidArgument(fmt::format("bench remote: a value of {} bytes", size));
    const uint64_t records = std::max<uint64_t>(8, o.data_bytes / size);
    // Ours: records of exactly `size` bytes, stored in batches of up to 64 MiB.
    std::vector<BundleKey> keys;
    for (uint64_t i = 0; i < records;) {
      std::vector<BundlePtr> batch;
      uint64_t bytes = 0;
      for (; i < records && (batch.empty() || bytes + size <= (64ull << 20)); ++i) {
        const uint64_t payload = size - header;
        SPARSEKV_ASSIGN_OR_RETURN(
            BundlePtr b, Bundle::MakeWith(BenchKey(size, i), std::span<const uint64_t>(&payload, 1),
                                          [&](uint32_t, std::span<std::byte> out) {
                                            for (size_t j = 0; j < out.size(); j += 64) out[j] = std::byte(j + i);
                                          },
                                          i + 1));
        batch.push_back(std::move(b));
        keys.push_back(BenchKey(size, i));
        bytes += size;
      }
      for (const Status& s : tier->Put(batch).get()) {
        if (!s.ok()) return s.WithContext("bench remote: storing the records");
      }
    }
    // redis-benchmark's own keys: about as many, over the nodes' tags.
    const uint64_t keyspace = std::max<uint64_t>(4, records / 3);
    SPARSEKV_RETURN_IF_ERROR(
        RedisBenchmark(o.redis_benchmark, port, "set", 4, 1, size, keyspace, keyspace * 12).status());

    RateSamples ours_gets, ours_bytes, rb_gets, rb_raw;
    uint64_t ours_asked = 0, ours_hits = 0, rb_hits = 0, rb_misses = 0;
    // A calibration run of redis-benchmark (not counted) sizes its rounds; ours warms up in
    // round -1, likewise not counted.
    SPARSEKV_ASSIGN_OR_RETURN(const double calib, RedisBenchmark(o.redis_benchmark, port, "get", o.concurrency,
                                                                 o.pipeline, size, keyspace,
                                                                 static_cast<uint64_t>(o.concurrency) * o.pipeline * 50));
    uint64_t rb_requests = std::max<uint64_t>(static_cast<uint64_t>(o.concurrency) * o.pipeline * 4,
                                              static_cast<uint64_t>(calib * o.round_seconds));
    for (int round = -1; round < o.rounds; ++round) {
      // Ours.
      std::atomic<uint64_t> gets{0}, bytes{0}, asked{0};
      std::atomic<bool> stop{false};
      std::vector<std::thread> threads;
      const auto t0 = Clock::now();
      for (int c = 0; c < o.concurrency; ++c) {
        threads.emplace_back([&, c] {
          std::mt19937_64 rng(static_cast<uint64_t>(round * 1000 + c + 1));
          while (!stop.load(std::memory_order_relaxed)) {
            std::vector<BundleKey> ask;
            for (uint32_t k = 0; k < o.pipeline; ++k) ask.push_back(keys[rng() % keys.size()]);
            const auto got = tier->Get(std::move(ask)).get();
            asked += got.size();
            for (const auto& r : got) {
              if (!r.ok()) continue;
              ++gets;
              bytes += (*r)->record_bytes();
            }
          }
        });
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(round < 0 ? std::min(0.3, o.round_seconds) : o.round_seconds));
      stop = true;
      for (auto& t : threads) t.join();
      if (round < 0) continue;
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      ours_gets.rates.push_back(static_cast<double>(gets.load()) / secs);
      ours_bytes.rates.push_back(static_cast<double>(bytes.load()) / secs);
      ours_asked += asked.load();
      ours_hits += gets.load();

      // redis-benchmark, sized to about a round from the last one's rate.
      const auto before = KeyspaceCounts(*cluster);
      const auto r0 = Clock::now();
      SPARSEKV_ASSIGN_OR_RETURN(double rps, RedisBenchmark(o.redis_benchmark, port, "get", o.concurrency, o.pipeline,
                                                           size, keyspace, rb_requests));
      const double rb_secs = std::chrono::duration<double>(Clock::now() - r0).count();
      const auto after = KeyspaceCounts(*cluster);
      const uint64_t h = after.first - before.first, m = after.second - before.second;
      rb_hits += h;
      rb_misses += m;
      const double ratio = h + m > 0 ? static_cast<double>(h) / static_cast<double>(h + m) : 0;
      rb_raw.rates.push_back(rps);
      rb_gets.rates.push_back(rps * ratio);
      rb_requests = std::max<uint64_t>(static_cast<uint64_t>(o.concurrency) * o.pipeline * 4,
                                       static_cast<uint64_t>(static_cast<double>(rb_requests) * o.round_seconds /
                                                             std::max(rb_secs, 1e-3)));
    }
    const double ours_median = ours_gets.Median(), rb_median = rb_gets.Median();
    sizes.push_back(
        {{"value_bytes", size},
         {"records", records},
         {"ours",
          {{"gets_per_s", ours_median},
           {"bytes_per_s", ours_bytes.Median()},
           {"spread", ours_gets.Spread()},
           {"hit_ratio", ours_asked ? static_cast<double>(ours_hits) / static_cast<double>(ours_asked) : 0.0}}},
         {"redis_benchmark",
          {{"gets_per_s", rb_median},
           {"raw_rps", rb_raw.Median()},
           {"bytes_per_s", rb_median * static_cast<double>(size)},
           {"spread", rb_gets.Spread()},
           {"hit_ratio",
            rb_hits + rb_misses ? static_cast<double>(rb_hits) / static_cast<double>(rb_hits + rb_misses) : 0.0}}},
         {"ours_vs_redis_benchmark", rb_median > 0 ? ours_median / rb_median : 0.0}});
  }
  return nlohmann::json{{"sizes", sizes},
                        {"concurrency", o.concurrency},
                        {"pipeline", o.pipeline},
                        {"rounds", o.rounds},
                        {"round_seconds", o.round_seconds},
                        {"cluster", "3 primaries + 3 replicas on loopback"}};
}

}  // namespace sparsekv::bench
