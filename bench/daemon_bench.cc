#include "daemon_bench.h"

#include <fmt/format.h>
#include <signal.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <random>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "allocator/xxhash_dispatch.h"
#include "bench_util.h"
#include "server/kv_event_tracker.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"

extern char** environ;

namespace sparsekv::bench {
namespace {

WireBlockHash KeyHash(int client, uint32_t key) {
  const uint64_t id = (uint64_t(client) << 32) | key;
  const XXH128_hash_t h = XXH3_128bits_withSeed(&id, sizeof(id), 0x5eed);
  WireBlockHash out;
  std::memcpy(out.data(), &h.low64, 8);
  std::memcpy(out.data() + 8, &h.high64, 8);
  return out;
}

// A value's bytes: the client's pattern (xorshift, written once per buffer by Pattern), with
// the first 8 bytes of every 4 KiB page stamped with (client, key, page) by Stamp. A reply
// carrying another key's value, or some of its pages, differs from the expected bytes; and
// making a value costs the client a few stores, not a pass over it (redis-benchmark sends one
// fixed buffer, so a full pass per PUT would slow our side of the comparison only).
void Pattern(std::vector<std::byte>& v, int client) {
  uint64_t x = (uint64_t(client) << 32) ^ 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i + 8 <= v.size(); i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(&v[i], &x, 8);
  }
}

void Stamp(std::vector<std::byte>& v, int client, uint32_t key) {
  for (size_t at = 0, page = 0; at < v.size(); at += 4096, ++page) {
    const uint64_t stamp = (uint64_t(client) << 40) ^ (uint64_t(key) << 16) ^ page ^ 0x5bd1e9955bd1e995ull;
    std::memcpy(&v[at], &stamp, std::min<size_t>(8, v.size() - at));
  }
}

// Runs a program with arguments; returns its exit code and (optionally) stdout.
Result<int> RunProgram(const std::vector<std::string>& argv, std::string* out) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return Status::IOError("pipe failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_addclose(&fa, pipefd[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    return Status::NotFound(fmt::format("cannot run {}: {}", argv[0], std::strerror(rc)));
  }
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof(buf))) > 0) {
    if (out) out->append(buf, static_cast<size_t>(n));
  }
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Starts redis-server on a free loopback port and waits until that very process answers (its
// INFO names its pid: another server that held the port would be benchmarked otherwise).
Result<std::pair<pid_t, uint16_t>> StartRedis() {
  Status last = Status::Unavailable("redis-server did not start");
  for (int attempt = 0; attempt < 5; ++attempt) {
    SPARSEKV_ASSIGN_OR_RETURN(const uint16_t port, FreeLoopbackPort());  // checked below
    std::vector<std::string> server = {"redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--protected-mode", "yes"};
    std::vector<char*> args;
    for (auto& a : server) args.push_back(a.data());
    args.push_back(nullptr);
    pid_t pid;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    const int rc = posix_spawnp(&pid, "redis-server", &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return Status::NotFound("redis-server is not installed (apt-get install redis-server)");
    const std::string mine = fmt::format("process_id:{}\r", pid);
    for (int i = 0; i < 100; ++i) {  // 5 s
      if (waitpid(pid, nullptr, WNOHANG) == pid) {  // it exited: the port was taken meanwhile
        pid = -1;
        last = Status::Unavailable(fmt::format("redis-server exited at start on port {}", port));
        break;
      }
      std::string out;
      auto info = RunProgram({"redis-cli", "-p", std::to_string(port), "info", "server"}, &out);
      if (info.ok() && *info == 0 && out.find(mine) != std::string::npos) return std::make_pair(pid, port);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      last = Status::Unavailable(fmt::format("redis-server on port {} did not answer within 5 s", port));
    }
  }
  return last;
}

// redis-server on a loopback port, then redis-benchmark SET (to create the values) and GET.
Result<nlohmann::json> RedisBaseline(const DaemonBenchOptions& o, double target_seconds, double our_get_rate) {
  SPARSEKV_ASSIGN_OR_RETURN(const auto started, StartRedis());
  const auto [pid, port] = started;
  nlohmann::json j;
  // Size the request count from our own rate so both runs take about as long.
  const uint64_t n = std::max<uint64_t>(10000, static_cast<uint64_t>(our_get_rate * target_seconds));
  std::string csv;
  auto bench = RunProgram({"redis-benchmark", "-p", std::to_string(port), "-t", "set,get", "-d",
                           std::to_string(o.value_bytes), "-c", std::to_string(o.clients), "-n", std::to_string(n),
                           "--csv"},
                          &csv);
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  if (!bench.ok()) return bench.status();
  if (*bench != 0) return Status::Internal("redis-benchmark failed");
  // Lines: "test","rps",...  e.g. "GET","12345.67",...
  for (const std::string name : {"SET", "GET"}) {
    const std::string tag = "\"" + name + "\",\"";
    const size_t at = csv.find(tag);
    if (at == std::string::npos) return Status::Internal("cannot read redis-benchmark's CSV: " + csv.substr(0, 200));
    j[name == "GET" ? "redis_get_ops_per_s" : "redis_set_ops_per_s"] = std::stod(csv.substr(at + tag.size()));
  }
  j["redis_requests"] = n;
  j["redis_command"] = fmt::format("redis-benchmark -t set,get -d {} -c {} -n {} (redis-server on 127.0.0.1)",
                                   o.value_bytes, o.clients, n);
  return j;
}

}  // namespace

// CPU time of every thread of this process (clients, the spawned daemon, its KV-event threads).
static double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

Result<nlohmann::json> RunDaemonBench(const DaemonBenchOptions& o) {
  if (o.clients < 1 || o.clients > 1024) return Status::InvalidArgument("--clients must be 1..1024");
  if (o.threads < 1) return Status::InvalidArgument("--threads must be at least 1");
  if (o.value_bytes == 0 || o.value_bytes > (32u << 20)) return Status::InvalidArgument("--value-bytes must be 1..32 MiB");
  std::string addr = o.addr;
  std::unique_ptr<server::TieredStore> store;
  std::unique_ptr<server::Server> srv;
  std::unique_ptr<server::TierEventTracker> kv_tracker;
  std::thread kv_sub_thread;
  std::atomic<bool> kv_sub_stop{false};
  std::atomic<uint64_t> kv_received{0};
  struct JoinSubscriber {  // on every return path
    std::thread& t;
    std::atomic<bool>& stop;
    ~JoinSubscriber() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } join_subscriber{kv_sub_thread, kv_sub_stop};
  if (o.kv_events && !o.spawn) return Status::InvalidArgument("--kv-events needs --spawn");
  std::filesystem::path dir;
  if (o.spawn) {
    dir = std::filesystem::temp_directory_path() / fmt::format("sparsekv-bench-{}", getpid());
    std::filesystem::create_directories(dir);
    server::TieredStoreOptions so;
    so.offload.host.capacity_bytes = std::max<uint64_t>(256ull << 20, 2 * o.value_bytes * o.clients * o.keys_per_client);
    so.offload.host.max_record_bytes = BundleHeaderBytes(1) + ((o.value_bytes + 4095) & ~uint64_t{4095});
    SPARSEKV_ASSIGN_OR_RETURN(store, server::TieredStore::Open(so));
    server::ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir / "bench.sock").string();
    opts.metrics_listen = "";
    if (o.kv_events) {
      server::TierEventTrackerOptions to;
      to.publisher.endpoint = "ipc://" + (dir / "kv-events.sock").string();
      to.publisher.topic = "kv@bench@bench";
      SPARSEKV_ASSIGN_OR_RETURN(kv_tracker, server::TierEventTracker::Start(to, *store));
      // A subscriber that reads every batch, as a router would (its cost is in the run).
      kv_sub_thread = std::thread([&, endpoint = to.publisher.endpoint] {
        zmq::context_t ctx(1);
        zmq::socket_t sub(ctx, zmq::socket_type::sub);
        sub.set(zmq::sockopt::subscribe, "");
        sub.set(zmq::sockopt::rcvtimeo, 50);
        sub.connect(endpoint);
        while (!kv_sub_stop.load()) {
          std::vector<zmq::message_t> frames;
          if (!zmq::recv_multipart(sub, std::back_inserter(frames))) continue;
          if (frames.size() == 3) kv_received.fetch_add(1);
        }
      });
    }
    SPARSEKV_ASSIGN_OR_RETURN(srv, server::Server::Start(opts, store.get()));
    if (o.addr == "tcp") {
      addr = srv->tcp_address();
    } else if (o.addr == "unix") {
      addr = "unix:" + opts.unix_path;
    } else {
      return Status::InvalidArgument("with --spawn, --addr is tcp or unix");
    }
  }

  std::vector<std::unique_ptr<Client>> clients;
  for (int c = 0; c < o.clients; ++c) {
    ClientOptions co;
    co.address = addr;
    co.namespace_name = o.namespace_name;
    co.token = o.token;
    co.client_name = fmt::format("bench-{}", c);
    SPARSEKV_ASSIGN_OR_RETURN(auto cl, Client::Connect(co));
    clients.push_back(std::move(cl));
  }
  const bool shm = clients[0]->shared_memory();

  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> puts{0}, gets{0}, get_bytes{0};
  std::vector<std::vector<double>> lat(o.clients);
  const int threads = std::min(o.threads, o.clients);

  // One client's loop state: the next key and when its request in flight began.
  struct Slot {
    int client = 0;
    uint32_t k = 0;
    uint32_t key = 0;
    double started = 0;
    bool busy = false;
    std::mt19937 rng;
    std::vector<std::byte> value;   // PUT source
    std::vector<std::byte> expect;  // spot checks
  };

  // Runs one phase: every client of this thread issues requests back to back until `t_end`
  // (and, for PUT, until each key was written once). With one client per thread the calls
  // are synchronous; otherwise each thread is an event loop over its clients' sockets.
  auto run_phase = [&](bool put, double t_end) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::vector<Slot> slots;
        for (int c = t; c < o.clients; c += threads) {
          Slot s;
          s.client = c;
          s.rng.seed(static_cast<uint32_t>(c + 1));
          s.value.resize(put ? o.value_bytes : 0);
          s.expect.resize(put ? 0 : o.value_bytes);
          Pattern(put ? s.value : s.expect, c);
          lat[c].reserve(1 << 16);
          slots.push_back(std::move(s));
        }
        auto more = [&](const Slot& s) { return NowSeconds() < t_end || (put && s.k < o.keys_per_client); };
        auto next_key = [&](Slot& s) {
          s.key = put ? s.k % o.keys_per_client : s.rng() % o.keys_per_client;
          ++s.k;
          if (put) Stamp(s.value, s.client, s.key);
        };
        auto check_get = [&](Slot& s, const Result<std::vector<GetResult>>& r, double end) {
          if (!r.ok() || r->size() != 1 || !(*r)[0].status.ok() || (*r)[0].bytes.size() != o.value_bytes) {
            errors.fetch_add(1);
            return;
          }
          lat[s.client].push_back((end - s.started) * 1e6);
          const uint64_t n = gets.fetch_add(1, std::memory_order_relaxed);
          get_bytes.fetch_add(o.value_bytes, std::memory_order_relaxed);
          if ((n & 63) == 0) {  // spot-check content
            Stamp(s.expect, s.client, s.key);
            if (std::memcmp(s.expect.data(), (*r)[0].bytes.data(), o.value_bytes) != 0) errors.fetch_add(1);
          }
        };
        auto check_put = [&](const Result<std::vector<Status>>& r) {
          if (!r.ok() || r->size() != 1 || !(*r)[0].ok()) {
            errors.fetch_add(1);
          } else {
            puts.fetch_add(1, std::memory_order_relaxed);
          }
        };
        if (slots.size() == 1) {  // a thread of its own: blocking calls
          Slot& s = slots[0];
          Client& cl = *clients[s.client];
          while (more(s)) {
            next_key(s);
            const WireBlockHash h = KeyHash(s.client, s.key);
            s.started = NowSeconds();
            if (put) {
              BundleRef ref{h, s.value};
              check_put(cl.Put(std::span<const BundleRef>(&ref, 1)));
            } else {
              auto r = cl.Get(std::span<const WireBlockHash>(&h, 1));
              check_get(s, r, NowSeconds());
            }
          }
          return;
        }
        std::vector<pollfd> fds(slots.size());
        for (;;) {
          size_t busy = 0;
          for (Slot& s : slots) {
            if (!s.busy && more(s)) {
              next_key(s);
              const WireBlockHash h = KeyHash(s.client, s.key);
              s.busy = true;
              s.started = NowSeconds();
              if (put) {
                BundleRef ref{h, s.value};
                clients[s.client]->PutAsync(std::span<const BundleRef>(&ref, 1), [&, sp = &s](auto r) {
                  check_put(r);
                  sp->busy = false;
                });
              } else {
                clients[s.client]->GetAsync({h}, [&, sp = &s](Result<std::vector<GetResult>> r) {
                  check_get(*sp, r, NowSeconds());
                  sp->busy = false;
                });
              }
            }
            busy += s.busy ? 1 : 0;
          }
          if (busy == 0) break;
          for (size_t i = 0; i < slots.size(); ++i) {
            fds[i] = {slots[i].busy ? clients[slots[i].client]->native_handle() : -1, POLLIN, 0};
          }
          if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) {
            errors.fetch_add(1);
            break;
          }
          for (size_t i = 0; i < slots.size(); ++i) {
            if (fds[i].fd < 0 || fds[i].revents == 0) continue;
            auto r = clients[slots[i].client]->ProcessReplies();
            if (!r.ok()) {  // the callback saw the failure already
              slots[i].busy = false;
            }
          }
        }
      });
    }
    for (auto& th : pool) th.join();
  };

  // PUT phase: every client writes its keys over and over for a third of the time.
  const double put_seconds = std::max(0.2, o.seconds / 3);
  const double put_t0 = NowSeconds();
  const double put_cpu0 = ProcessCpuSeconds();
  run_phase(true, put_t0 + put_seconds);
  const double put_elapsed = NowSeconds() - put_t0;
  const double put_cpu = ProcessCpuSeconds() - put_cpu0;
  // GET phase: random own keys; each value is copied into the client's own buffer and checked.
  for (auto& v : lat) v.clear();
  const double t0 = NowSeconds();
  const double get_cpu0 = ProcessCpuSeconds();
  run_phase(false, t0 + o.seconds);
  const double get_elapsed = NowSeconds() - t0;
  const double get_cpu = ProcessCpuSeconds() - get_cpu0;
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());

  nlohmann::json j;
  j["transport"] = shm ? "shared_memory" : (addr.rfind("unix:", 0) == 0 ? "unix_socket" : "tcp");
  j["addr"] = addr;
  j["clients"] = o.clients;
  j["threads"] = threads;
  j["value_bytes"] = o.value_bytes;
  j["put_ops_per_s"] = static_cast<double>(puts.load()) / put_elapsed;
  j["get_ops_per_s"] = static_cast<double>(gets.load()) / get_elapsed;
  j["get_bytes_per_s"] = static_cast<double>(get_bytes.load()) / get_elapsed;
  j["get_p50_us"] = QuantileInPlace(all, 0.50);
  j["get_p99_us"] = QuantileInPlace(all, 0.99);
  j["errors"] = errors.load();
  // With --spawn: CPU of the whole process (clients and daemon) per operation, which a busy
  // machine disturbs less than the rates.
  j["put_cpu_us_per_op"] = puts.load() ? put_cpu * 1e6 / static_cast<double>(puts.load()) : 0.0;
  j["get_cpu_us_per_op"] = gets.load() ? get_cpu * 1e6 / static_cast<double>(gets.load()) : 0.0;
  clients.clear();
  if (kv_tracker) {
    kv_tracker->Tick();
    const VllmKvEventStats st = kv_tracker->Stats();
    j["kv_events"] = {{"batches", st.published_batches}, {"events", st.published_events},
                      {"dropped", st.dropped_events}, {"received_batches", kv_received.load()}};
  }
  if (srv) {
    srv->Shutdown();
    srv->Wait().IgnoreError();
    srv.reset();
    kv_tracker.reset();
    store.reset();
    std::filesystem::remove_all(dir);
  }
  if (o.redis) {
    SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json r, RedisBaseline(o, std::max(1.0, o.seconds), j["get_ops_per_s"].get<double>()));
    j.update(r);
    j["get_ratio_vs_redis"] = j["get_ops_per_s"].get<double>() / r["redis_get_ops_per_s"].get<double>();
  }
  return j;
}

}  // namespace sparsekv::bench
