#include "cluster_stress.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "bench_util.h"
#include "offload/redis_cluster.h"
#include "redis_cluster_harness.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"
#include "sparsekv/remote_tier.h"

namespace sparsekv::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A block's 16 wire bytes from its id (the stress's blocks stand for prefix-hashed KV blocks).
WireBlockHash HashOf(uint64_t seed, uint64_t id) {
  WireBlockHash h;
  const uint64_t lo = MixBits(seed ^ (id * 0x9e3779b97f4a7c15ull)), hi = MixBits(lo + id + 1);
  std::memcpy(h.data(), &lo, 8);
  std::memcpy(h.data() + 8, &hi, 8);
  return h;
}

// A block's bytes: a function of (seed, id), so every GET is checked whole.
void FillValue(uint64_t seed, uint64_t id, std::vector<std::byte>& out) {
  for (size_t i = 0; i < out.size(); i += 8) {
    const uint64_t v = MixBits(seed * 31 + id * 1000003 + i);
    std::memcpy(out.data() + i, &v, std::min<size_t>(8, out.size() - i));
  }
}

double Quantile(std::vector<float> v, double q) { return QuantileInPlace(v, q); }  // on a copy

struct Daemon {
  std::unique_ptr<server::TieredStore> store;
  std::unique_ptr<server::Server> server;
  RemoteTier* remote = nullptr;
  std::string address;
};

Result<Daemon> StartDaemon(const ClusterStressOptions& o, const std::vector<std::string>& seeds,
                           const std::string& dir, std::vector<std::string> namespaces) {
  server::TieredStoreOptions so;
  so.offload.chain.write_policy = WritePolicy::kWriteBack;
  so.offload.host.capacity_bytes = o.host_bytes;
  so.offload.ssd_enabled = true;
  so.offload.ssd.path = dir + "/ssd";
  so.offload.ssd.capacity_bytes = o.ssd_bytes;
  so.offload.ssd.durability = Durability::kNone;
  so.offload.remote_enabled = true;
  so.offload.remote.nodes = seeds;
  so.offload.remote.timeout_ms = o.remote_timeout_ms;
  so.offload.remote.namespace_labels = namespaces;
  Daemon d;
  SPARSEKV_ASSIGN_OR_RETURN(d.store, server::TieredStore::Open(so));
  server::ServerOptions sv;
  sv.tcp_listen = "127.0.0.1:0";
  sv.metrics_listen = "";
  sv.io_threads = 1;
  sv.worker_threads = 4;
  sv.namespaces.clear();
  for (const std::string& n : namespaces) sv.namespaces.push_back({n, ""});
  SPARSEKV_ASSIGN_OR_RETURN(d.server, server::Server::Start(sv, d.store.get()));
  d.address = d.server->tcp_address();
  TierChain& chain = d.store->chain();
  d.remote = dynamic_cast<RemoteTier*>(&chain.tier(chain.tier_count() - 1));
  if (d.remote == nullptr) return Status::Internal("the daemon's last tier is not the remote tier");
  if (!d.remote->WaitHealthy(std::chrono::seconds(10))) return Status::Unavailable("the remote tier sees no cluster");
  return d;
}

nlohmann::json RemoteJson(const RemoteTier& t) {
  const RemoteTierState s = t.State();
  const TierStats st = t.Stats();
  return {{"healthy", s.healthy},
          {"incidents", s.incidents},
          {"failed_commands", s.failed_commands},
          {"timeouts", s.timeouts},
          {"redirects", s.redirects},
          {"slot_map_refreshes", s.slot_map_refreshes},
          {"connections_opened", s.connections_opened},
          {"write_refusals", s.write_refusals},
          {"hits", st.hits},
          {"misses", st.misses},
          {"puts", st.puts},
          {"put_failures", st.put_failures},
          {"superseded", st.superseded},
          {"corrupt", st.corrupt}};
}

struct Written {
  uint64_t id = 0;
  int daemon = 0;     // written through
  uint32_t slot = 0;  // of its remote key
};

// One GET as recorded: when (since the load began), how long, what came back.
struct GetSample {
  float at_s = 0;
  float us = 0;
  uint8_t result = 0;  // 0 hit, 1 miss, 2 error, 3 wrong bytes
  bool cross = false;  // written through the other daemon
  uint32_t slot = 0;
};

}  // namespace

Result<nlohmann::json> RunClusterStress(const ClusterStressOptions& o) {
  if (o.clients < 1 || o.seconds <= 0 || o.value_bytes < 16) {
    return Status::InvalidArgument("stress cluster: clients >= 1, seconds > 0 and value bytes >= 16");
  }
  const uint64_t seed = o.seed != 0 ? o.seed : std::random_device{}() | 1;
  RedisClusterHarnessOptions ho;
  ho.dir = o.dir;
  ho.keep = o.keep;
  ho.node_timeout_ms = o.node_timeout_ms;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RedisClusterHarness> cluster, RedisClusterHarness::Start(ho));
  const std::string dir = cluster->dir();
  SPARSEKV_ASSIGN_OR_RETURN(Daemon a, StartDaemon(o, cluster->Seeds(), dir + "/a", {"default"}));
  SPARSEKV_ASSIGN_OR_RETURN(Daemon b, StartDaemon(o, cluster->Seeds(), dir + "/b", {"other", "default"}));
  Daemon* daemons[2] = {&a, &b};
  auto connect = [&](int d) {
    ClientOptions co;
    co.address = daemons[d]->address;
    co.client_name = fmt::format("stress-cluster-{}", d);
    return Client::Connect(co);
  };
  auto slot_of = [&](uint64_t id) {
    BlockHash h;
    const WireBlockHash w = HashOf(seed, id);
    std::memcpy(&h.lo, w.data(), 8);
    std::memcpy(&h.hi, w.data() + 8, 8);
    return offload::RedisKeySlot(a.remote->RedisKey({1, h}));
  };
  nlohmann::json out;
  bool ok = true;

  // ---- phase 1: a prefix through A, found and restored through B ----
  {
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<Client> ca, connect(0));
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<Client> cb, connect(1));
    std::vector<WireBlockHash> hashes;
    std::vector<std::vector<std::byte>> values(o.prefix_blocks, std::vector<std::byte>(o.value_bytes));
    std::vector<BundleRef> refs;
    for (uint32_t i = 0; i < o.prefix_blocks; ++i) {
      const uint64_t id = (1ull << 40) + i;
      hashes.push_back(HashOf(seed, id));
      FillValue(seed, id, values[i]);
      refs.push_back({hashes.back(), values[i]});
    }
    SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> put, ca->Put(refs));
    for (const Status& s : put) {
      if (!s.ok()) return s.WithContext("stress cluster: the prefix PUT through A");
    }
    a.store->chain().WaitIdle();  // written behind
    SPARSEKV_ASSIGN_OR_RETURN(LookupResult look, cb->Lookup(hashes));
    SPARSEKV_ASSIGN_OR_RETURN(std::vector<GetResult> got, cb->Get(hashes));
    uint64_t identical = 0;
    for (uint32_t i = 0; i < o.prefix_blocks; ++i) {
      identical += got[i].status.ok() && got[i].bytes.size() == values[i].size() &&
                   std::memcmp(got[i].bytes.data(), values[i].data(), values[i].size()) == 0;
    }
    b.store->chain().WaitIdle();  // the onloads into B's host tier
    SPARSEKV_ASSIGN_OR_RETURN(LookupResult after, cb->Lookup(hashes));
    const auto count = [](const LookupResult& l, BlockTier t) {
      return static_cast<uint64_t>(std::count(l.tiers.begin(), l.tiers.end(), t));
    };
    out["prefix"] = {{"blocks", o.prefix_blocks},
                     {"found_through_b", look.prefix_blocks},
                     {"in_remote_tier", count(look, BlockTier::kRemote)},
                     {"identical_through_b", identical},
                     {"in_host_after", count(after, BlockTier::kHost)}};
    ok = ok && look.prefix_blocks == o.prefix_blocks && identical == o.prefix_blocks;
  }

  // ---- phase 2: load through both, a primary killed ----
  std::mutex mu;
  std::vector<Written> written;  // guarded by mu
  std::vector<std::vector<GetSample>> samples(static_cast<size_t>(o.clients));
  std::vector<std::string> error_examples;  // guarded by mu
  std::atomic<uint64_t> next_id{1}, puts{0}, put_errors{0};
  std::atomic<bool> stop{false};
  const auto t0 = Clock::now();
  auto since = [&](Clock::time_point t) { return std::chrono::duration<double>(t - t0).count(); };
  auto note_error = [&](const std::string& e) {
    std::lock_guard<std::mutex> l(mu);
    if (error_examples.size() < 10) error_examples.push_back(e);
  };
  std::vector<std::thread> threads;
  std::atomic<int> setup_failures{0};
  for (int c = 0; c < o.clients; ++c) {
    threads.emplace_back([&, c] {
      std::unique_ptr<Client> conn[2];
      for (int d = 0; d < 2; ++d) {
        auto r = connect(d);
        if (!r.ok()) {
          ++setup_failures;
          note_error(r.status().ToString());
          return;
        }
        conn[d] = std::move(*r);
      }
      std::mt19937_64 rng(seed + static_cast<uint64_t>(c) * 7919);
      std::vector<std::byte> value(o.value_bytes), expect(o.value_bytes);
      auto& mine = samples[static_cast<size_t>(c)];
      while (!stop.load(std::memory_order_relaxed)) {
        const int d = static_cast<int>(rng() % 2);
        if (rng() % 100 < 30) {
          const uint64_t id = next_id++;
          FillValue(seed, id, value);
          const BundleRef ref{HashOf(seed, id), value};
          auto r = conn[d]->Put(std::span(&ref, 1));
          ++puts;
          const Status st = r.ok() ? (*r)[0] : r.status();
          if (!st.ok()) {
            ++put_errors;
            note_error(fmt::format("PUT through {}: {}", d ? "B" : "A", st.ToString()));
            continue;
          }
          std::lock_guard<std::mutex> l(mu);
          written.push_back({id, d, slot_of(id)});
          continue;
        }
        Written w;
        {
          std::lock_guard<std::mutex> l(mu);
          if (written.empty()) continue;
          if (rng() % 2 == 0) {
            // A recent block written through the other daemon: likely read from the cluster.
            size_t seen = 0;
            bool found = false;
            for (size_t i = written.size(); i-- > 0 && seen < 256;) {
              if (written[i].daemon == d) continue;
              ++seen;
              if (!found || rng() % seen == 0) {
                w = written[i];
                found = true;
              }
            }
            if (!found) w = written[rng() % written.size()];
          } else {
            w = written[rng() % written.size()];
          }
        }
        const WireBlockHash h = HashOf(seed, w.id);
        const auto start = Clock::now();
        auto r = conn[d]->Get(std::span(&h, 1));
        const auto end = Clock::now();
        GetSample s;
        s.at_s = static_cast<float>(since(start));
        s.us = static_cast<float>(std::chrono::duration<double, std::micro>(end - start).count());
        s.cross = w.daemon != d;
        s.slot = w.slot;
        if (!r.ok()) {
          s.result = 2;
          note_error(fmt::format("GET through {}: {}", d ? "B" : "A", r.status().ToString()));
        } else if ((*r)[0].status.Is(StatusCode::kNotFound)) {
          s.result = 1;
        } else if (!(*r)[0].status.ok()) {
          s.result = 2;
          note_error(fmt::format("GET through {}: {}", d ? "B" : "A", (*r)[0].status.ToString()));
        } else {
          FillValue(seed, w.id, expect);
          const auto& got = (*r)[0].bytes;
          s.result = got.size() == expect.size() && std::memcmp(got.data(), expect.data(), expect.size()) == 0 ? 0 : 3;
          if (s.result == 3) note_error(fmt::format("GET through {} of block {}: wrong bytes", d ? "B" : "A", w.id));
        }
        mine.push_back(s);
      }
    });
  }

  // The kill, and a timeline of the remote tiers' hits sampled every 250 ms.
  int victim = -1;
  std::vector<int> owners;
  double killed_at = -1, failed_over_at = -1, healthy_at = -1;
  nlohmann::json timeline = nlohmann::json::array();
  uint64_t last_hits = 0, last_misses = 0;
  auto sample = [&]() {
    const uint64_t hits = a.remote->Stats().hits + b.remote->Stats().hits;
    const uint64_t misses = a.remote->Stats().misses + b.remote->Stats().misses;
    timeline.push_back({{"t_s", since(Clock::now())},
                        {"remote_hits", hits - last_hits},
                        {"remote_misses", misses - last_misses},
                        {"healthy", a.remote->State().healthy && b.remote->State().healthy}});
    last_hits = hits;
    last_misses = misses;
  };
  const auto end_at = t0 + std::chrono::duration<double>(o.seconds);
  const auto kill_at = t0 + std::chrono::duration<double>(o.seconds * o.kill_after);
  std::thread killer;
  if (o.kill_after > 0) {
    killer = std::thread([&] {
      std::this_thread::sleep_until(kill_at);
      auto own = cluster->SlotOwners();
      if (!own.ok()) return;
      owners = *own;
      for (size_t i = 0; i < cluster->nodes().size() && victim < 0; ++i) {
        if (cluster->nodes()[i].primary && cluster->nodes()[i].alive) victim = static_cast<int>(i);
      }
      if (victim < 0 || !cluster->Kill(static_cast<size_t>(victim)).ok()) return;
      killed_at = since(Clock::now());
      if (cluster->WaitHealthy(std::chrono::seconds(60)).ok()) failed_over_at = since(Clock::now());
      if (a.remote->WaitHealthy(std::chrono::seconds(30)) && b.remote->WaitHealthy(std::chrono::seconds(30))) {
        healthy_at = since(Clock::now());
      }
    });
  }
  while (Clock::now() < end_at) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    sample();
  }
  if (killer.joinable()) killer.join();  // the run ends once the failover is over
  while (o.kill_after > 0 && healthy_at >= 0 && since(Clock::now()) < healthy_at + 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));  // some load after it, too
    sample();
  }
  stop = true;
  for (std::thread& t : threads) t.join();
  const double load_seconds = since(Clock::now());

  // Writes behind that failed during the outage left keys whose older copies the cluster may
  // still hold (reads skip them): once it is healthy, each chain's repair erases those copies
  // and forgets the keys. Any read asks for it; this waits for it (15 s at most).
  nlohmann::json chains;
  for (Daemon* d : {&a, &b}) {
    TierChain& chain = d->store->chain();
    const TierChainStats at_end = chain.Stats();
    const auto r0 = Clock::now();
    while (chain.Stats().stale_keys > 0 && Clock::now() - r0 < std::chrono::seconds(15)) {
      chain.Promote({BundleKey{}}).get();
      chain.WaitIdle();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const TierChainStats after = chain.Stats();
    chains[d == &a ? "a" : "b"] = {{"write_behind_failures", after.write_behind_failures},
                                   {"invalidate_failures", after.invalidate_failures},
                                   {"stale_keys_at_end_of_load", at_end.stale_keys},
                                   {"stale_keys_after_repair", after.stale_keys},
                                   {"repaired", after.repaired},
                                   {"repair_s", std::chrono::duration<double>(Clock::now() - r0).count()}};
    ok = ok && after.stale_keys == 0;
  }

  // ---- figures ----
  struct Phase {
    std::vector<float> us;
    uint64_t gets = 0, hits = 0, misses = 0, errors = 0;
  };
  Phase phases[3];
  std::vector<float> local_before;
  uint64_t victim_gets[3] = {0, 0, 0}, victim_hits[3] = {0, 0, 0};
  uint64_t gets = 0, hits = 0, misses = 0, errors = 0, wrong = 0;
  for (const auto& per_client : samples) {
    for (const GetSample& s : per_client) {
      int p = 0;
      if (killed_at >= 0 && s.at_s >= killed_at) p = (healthy_at >= 0 && s.at_s >= healthy_at) ? 2 : 1;
      Phase& ph = phases[p];
      ph.us.push_back(s.us);
      ++ph.gets;
      ++gets;
      if (s.result == 0) ++ph.hits, ++hits;
      if (s.result == 1) ++ph.misses, ++misses;
      if (s.result == 2) ++ph.errors, ++errors;
      if (s.result == 3) ++wrong;
      if (p == 0 && !s.cross) local_before.push_back(s.us);
      if (victim >= 0 && s.cross && !owners.empty() && owners[s.slot] == victim) {
        ++victim_gets[p];
        victim_hits[p] += s.result == 0;
      }
    }
  }
  const char* names[3] = {"before", "during", "after"};
  nlohmann::json pj;
  for (int p = 0; p < 3; ++p) {
    pj[names[p]] = {{"gets", phases[p].gets},
                    {"hits", phases[p].hits},
                    {"misses", phases[p].misses},
                    {"errors", phases[p].errors},
                    {"p50_us", Quantile(phases[p].us, 0.50)},
                    {"p99_us", Quantile(phases[p].us, 0.99)},
                    {"max_us", phases[p].us.empty() ? 0.0f : *std::max_element(phases[p].us.begin(), phases[p].us.end())}};
  }
  const double local_p99 = Quantile(local_before, 0.99);
  const double bound = o.remote_timeout_ms * 1000.0 + local_p99;
  nlohmann::json vj;
  for (int p = 0; p < 3; ++p) vj[names[p]] = {{"gets", victim_gets[p]}, {"hits", victim_hits[p]}};
  uint64_t remote_hits_after = 0;
  for (const auto& t : timeline) {
    if (healthy_at >= 0 && t["t_s"].get<double>() > healthy_at) remote_hits_after += t["remote_hits"].get<uint64_t>();
  }
  out["puts"] = puts.load();
  out["put_errors"] = put_errors.load();
  out["gets"] = gets;
  out["hits"] = hits;
  out["misses"] = misses;
  out["errors"] = errors + put_errors.load() + static_cast<uint64_t>(setup_failures.load());
  out["wrong_bytes"] = wrong;
  out["error_examples"] = error_examples;
  out["phases"] = pj;
  out["local_p99_us"] = local_p99;
  out["p99_bound_us"] = bound;
  out["kill"] = {{"node", victim >= 0 ? cluster->nodes()[static_cast<size_t>(victim)].address() : ""},
                 {"killed_at_s", killed_at},
                 {"cluster_failed_over_s", failed_over_at},
                 {"tiers_healthy_s", healthy_at}};
  out["victim_gets"] = vj;
  out["remote"] = {{"a", RemoteJson(*a.remote)}, {"b", RemoteJson(*b.remote)}};
  out["chains"] = chains;
  out["remote_hits_after_failover"] = remote_hits_after;
  out["timeline"] = timeline;
  out["seconds"] = load_seconds;
  out["options"] = {{"clients", o.clients},          {"seconds", o.seconds},
                    {"kill_after", o.kill_after},    {"value_bytes", o.value_bytes},
                    {"prefix_blocks", o.prefix_blocks}, {"remote_timeout_ms", o.remote_timeout_ms},
                    {"host_bytes", o.host_bytes},    {"ssd_bytes", o.ssd_bytes},
                    {"node_timeout_ms", o.node_timeout_ms}, {"seed", seed}};
  ok = ok && out["errors"].get<uint64_t>() == 0 && wrong == 0;
  if (o.kill_after > 0) {
    ok = ok && victim >= 0 && healthy_at >= 0 && phases[1].gets > 0 &&
         Quantile(phases[1].us, 0.99) <= bound && remote_hits_after > 0 && victim_hits[2] > 0;
  }
  out["ok"] = ok;
  b.server.reset();
  a.server.reset();
  return out;
}

}  // namespace sparsekv::bench
