// `sparsekv bench daemon --batch`: one client's batch GET into its own memory (GetInto) through
// a daemon started here, over TCP and over the Unix socket's shared memory, beside the two
// baselines of the same bytes into the same destination in the same run: memcpy, and a raw
// loopback TCP socket pair. Then, with restore_blocks, a model's prefix restored through the
// daemon into caller pages against the in-process `bench restore` of the same blocks.
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "allocator/xxhash_dispatch.h"
#include "bench_util.h"
#include "daemon_bench.h"
#include "restore_bench.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"

namespace sparsekv::bench {
namespace {

WireBlockHash BatchKey(uint64_t size_index, uint64_t i) {
  const uint64_t id = (size_index << 40) | i;
  const XXH128_hash_t h = XXH3_128bits_withSeed(&id, sizeof(id), 0xba7c4);
  WireBlockHash out;
  std::memcpy(out.data(), &h.low64, 8);
  std::memcpy(out.data() + 8, &h.high64, 8);
  return out;
}

// Page-aligned memory, every page written once (warm): what an engine's own pages are.
struct WarmBuffer {
  explicit WarmBuffer(uint64_t n) : bytes(n) {
    void* p = nullptr;
    if (n > 0 && posix_memalign(&p, 4096, n) != 0) p = nullptr;
    data = static_cast<std::byte*>(p);
    if (data != nullptr) {
      for (uint64_t i = 0; i < n; i += 4096) data[i] = std::byte{0};
    }
  }
  ~WarmBuffer() { std::free(data); }
  WarmBuffer(const WarmBuffer&) = delete;
  WarmBuffer& operator=(const WarmBuffer&) = delete;
  std::byte* data = nullptr;
  uint64_t bytes = 0;
};

// Value i's bytes: a xorshift stream seeded with (size, i), so any misplaced byte shows.
void FillValue(std::byte* p, uint64_t n, uint64_t seed) {
  uint64_t x = MixBits(seed) | 1;
  for (uint64_t k = 0; k + 8 <= n; k += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + k, &x, 8);
  }
  for (uint64_t k = n & ~uint64_t{7}; k < n; ++k) p[k] = std::byte(k);
}

// MemAvailable from /proc/meminfo, in bytes (0 when unknown).
uint64_t AvailableMemory() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  }
  return 0;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

// A loopback TCP connection with a sender thread: each round trip, the receiver sends one byte
// and the sender answers with `bytes` bytes from its buffer, received into the destination; the
// least any GET over loopback TCP can cost.
class SocketPair {
 public:
  static Result<std::unique_ptr<SocketPair>> Open(const std::byte* source, uint64_t bytes) {
    auto p = std::unique_ptr<SocketPair>(new SocketPair);
    const int ls = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    if (ls < 0 || ::bind(ls, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || ::listen(ls, 1) != 0 ||
        ::getsockname(ls, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      if (ls >= 0) ::close(ls);
      return Status::IOError(fmt::format("socket pair: {}", std::strerror(errno)));
    }
    p->rx_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (p->rx_ < 0 || ::connect(p->rx_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      ::close(ls);
      return Status::IOError(fmt::format("socket pair connect: {}", std::strerror(errno)));
    }
    p->tx_ = ::accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(ls);
    if (p->tx_ < 0) return Status::IOError(fmt::format("socket pair accept: {}", std::strerror(errno)));
    const int one = 1;
    ::setsockopt(p->rx_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(p->tx_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    p->sender_ = std::thread([raw = p.get(), source, bytes] { raw->Serve(source, bytes); });
    return p;
  }
  ~SocketPair() {
    if (rx_ >= 0) ::shutdown(rx_, SHUT_RDWR);
    if (sender_.joinable()) sender_.join();
    if (rx_ >= 0) ::close(rx_);
    if (tx_ >= 0) ::close(tx_);
  }
  // One round trip into `dst` (`bytes` long).
  bool Fetch(std::byte* dst, uint64_t bytes) {
    const char go = 1;
    if (::send(rx_, &go, 1, MSG_NOSIGNAL) != 1) return false;
    while (bytes > 0) {
      const ssize_t k = ::recv(rx_, dst, bytes, 0);
      if (k <= 0) return false;
      dst += k;
      bytes -= static_cast<uint64_t>(k);
    }
    return true;
  }

 private:
  SocketPair() = default;
  void Serve(const std::byte* source, uint64_t bytes) {
    char go;
    while (::recv(tx_, &go, 1, 0) == 1) {
      const std::byte* p = source;
      uint64_t left = bytes;
      while (left > 0) {
        const ssize_t k = ::send(tx_, p, left, MSG_NOSIGNAL);
        if (k <= 0) return;
        p += k;
        left -= static_cast<uint64_t>(k);
      }
    }
  }
  int rx_ = -1, tx_ = -1;
  std::thread sender_;
};

struct Spawned {
  std::filesystem::path dir;
  std::unique_ptr<server::TieredStore> store;
  std::unique_ptr<server::Server> srv;
  std::string tcp, unix_path;
  ~Spawned() {
    if (srv) {
      srv->Shutdown();
      srv->Wait().IgnoreError();
    }
    srv.reset();
    store.reset();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};

// A daemon in this process, host tier only, its arena a memfd (lent to shared-memory clients)
// and faulted in at start (host.populate): a serving daemon's arena pages were zeroed long ago,
// and the first-touch cost of a fresh one is not what a steady state pays. Two are started: one
// as configured by default (write leases off: the arena is read-only to clients, and local
// reads need no check), for the GET rows and the PUTs over TCP and the staging area; and one
// with write leases on, for the one-copy PUT row and the GET row a client of such a daemon
// gets (its local reads check each value's checksum, as clients can write the arena).
Result<std::unique_ptr<Spawned>> Spawn(uint64_t capacity, uint64_t max_value, bool write_leases) {
  auto s = std::make_unique<Spawned>();
  s->dir = std::filesystem::temp_directory_path() /
           fmt::format("sparsekv-batch-{}{}", getpid(), write_leases ? "-leases" : "");
  std::filesystem::create_directories(s->dir);
  server::TieredStoreOptions so;
  so.offload.host.capacity_bytes = capacity;
  so.offload.host.max_record_bytes = BundleHeaderBytes(1) + ((max_value + 4095) & ~uint64_t{4095});
  so.offload.host.backing = ArenaBacking::kMemfd;
  so.offload.host.populate = true;
  SPARSEKV_ASSIGN_OR_RETURN(s->store, server::TieredStore::Open(so));
  server::ServerOptions opts;
  opts.tcp_listen = "127.0.0.1:0";
  opts.unix_path = (s->dir / "batch.sock").string();
  opts.metrics_listen = "";
  opts.write_leases = write_leases;
  SPARSEKV_ASSIGN_OR_RETURN(s->srv, server::Server::Start(opts, s->store.get()));
  s->tcp = s->srv->tcp_address();
  s->unix_path = "unix:" + opts.unix_path;
  return s;
}

Result<std::unique_ptr<Client>> ConnectTo(const std::string& addr, const std::string& name, uint32_t spin_us,
                                          bool write_leases = false) {
  ClientOptions co;
  co.write_leases = write_leases;
  co.spin = std::chrono::microseconds(spin_us);
  co.address = addr;
  co.client_name = name;
  co.timeout = std::chrono::milliseconds(120000);
  return Client::Connect(co);
}

// Stores `n` values of `bytes` each (value i from FillValue(seed_base + i)) through `c`.
Status PutValues(Client& c, uint64_t size_index, uint64_t n, uint64_t bytes, uint64_t seed_base) {
  std::vector<std::byte> v(bytes);
  for (uint64_t i = 0; i < n; ++i) {
    FillValue(v.data(), bytes, seed_base + i);
    BundleRef ref{BatchKey(size_index, i), v};
    SPARSEKV_ASSIGN_OR_RETURN(auto st, c.Put(std::span<const BundleRef>(&ref, 1)));
    if (!st[0].ok()) return st[0].WithContext(fmt::format("PUT of value {} ({} bytes)", i, bytes));
  }
  return Status::OK();
}

// GetInto of `hashes` into `dests`; every item must come back whole.
Status GetAll(Client& c, std::span<const WireBlockHash> hashes, std::span<const std::span<std::byte>> dests,
              uint64_t bytes) {
  SPARSEKV_ASSIGN_OR_RETURN(auto got, c.GetInto(hashes, dests));
  for (const GetIntoResult& g : got) {
    if (!g.status.ok()) return g.status;
    if (g.bytes != bytes) return Status::Internal(fmt::format("a value of {} bytes came back as {}", bytes, g.bytes));
  }
  return Status::OK();
}

// Every byte of `dst` against the values it should hold.
Status Check(const std::byte* dst, uint64_t n, uint64_t bytes, uint64_t seed_base, const char* what) {
  std::vector<std::byte> want(bytes);
  for (uint64_t i = 0; i < n; ++i) {
    FillValue(want.data(), bytes, seed_base + i);
    if (std::memcmp(dst + i * bytes, want.data(), bytes) != 0) {
      return Status::Internal(fmt::format("{}: value {} of {} bytes came back wrong", what, i, bytes));
    }
  }
  return Status::OK();
}

}  // namespace

Result<nlohmann::json> RunDaemonBatchBench(const DaemonBenchOptions& o) {
  if (o.batch_sizes.empty()) return Status::InvalidArgument("--batch needs at least one size");
  uint64_t capacity = 0, max_value = 0;
  for (const auto& [bytes, values] : o.batch_sizes) {
    if (bytes == 0 || bytes > (32u << 20) || values == 0 || values > 4096) {
      return Status::InvalidArgument("batch sizes: values of 1 byte to 32 MiB, 1 to 4096 of them");
    }
    capacity += 2 * bytes * values;  // room for a PUT phase's new versions beside the old
    max_value = std::max(max_value, bytes);
  }
  nlohmann::json restore;
  uint64_t block_bytes = 0;
  if (o.restore_blocks > 0) {
    // The in-process restore first, so that its memory is gone before the daemon's is taken.
    // `bench restore` holds four copies of the prefix (its source pattern, memcpy's destination,
    // the tier and the engine's pages): as many blocks as fit 80% of the memory available are
    // restored in process, and its rate stands for all of them.
    RestoreBenchOptions ro;
    ro.model = "deepseek-v3.2-exp";
    ro.kv_format = "fp8";
    ro.blocks = 1;
    ro.tier = "host";
    ro.rounds = 1;
    ro.eviction_blocks = 0;
    SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json probe, RunRestoreBench(ro));
    block_bytes = probe["block_bytes"].get<uint64_t>();
    const uint64_t fit = static_cast<uint64_t>(0.8 * static_cast<double>(AvailableMemory())) / (4 * block_bytes);
    ro.blocks = static_cast<uint32_t>(std::clamp<uint64_t>(fit, 1, o.restore_blocks));
    SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json r, RunRestoreBench(ro));
    const double total = static_cast<double>(block_bytes) * o.restore_blocks;
    restore["model"] = "deepseek-v3.2-exp";
    restore["kv_format"] = "fp8";
    restore["blocks"] = o.restore_blocks;
    restore["block_bytes"] = block_bytes;
    restore["bytes"] = total;
    restore["in_process_blocks"] = ro.blocks;
    restore["in_process_bytes_per_s"] = r["restore_bytes_per_s"];
    restore["in_process_seconds"] = total / r["restore_bytes_per_s"].get<double>();
    restore["memcpy_bytes_per_s"] = r["memcpy_bytes_per_s"];
    capacity += block_bytes * o.restore_blocks + (block_bytes + 8192) * 4;
    max_value = std::max(max_value, block_bytes);
  }
  capacity = std::max<uint64_t>(capacity, 256ull << 20);
  SPARSEKV_ASSIGN_OR_RETURN(auto d, Spawn(capacity, max_value, /*write_leases=*/false));
  uint64_t lease_capacity = 0;
  for (const auto& [bytes, values] : o.batch_sizes) lease_capacity += 2 * bytes * values;
  lease_capacity = std::max<uint64_t>(lease_capacity, 256ull << 20);
  SPARSEKV_ASSIGN_OR_RETURN(auto dl, Spawn(lease_capacity, max_value, /*write_leases=*/true));
  SPARSEKV_ASSIGN_OR_RETURN(auto tcp, ConnectTo(d->tcp, "batch-tcp", o.spin_us));
  SPARSEKV_ASSIGN_OR_RETURN(auto shm, ConnectTo(d->unix_path, "batch-shm", o.spin_us));
  if (!shm->shared_memory() || !shm->shared_arena()) {
    return Status::Internal("the Unix-socket client got no shared memory or no arena");
  }
  SPARSEKV_ASSIGN_OR_RETURN(auto leased, ConnectTo(dl->unix_path, "batch-lease", o.spin_us, true));
  if (!leased->write_leases()) return Status::Internal("the write-lease client got no write leases");

  nlohmann::json batches = nlohmann::json::array();
  WarmBuffer fresh(lease_capacity);  // memcpy_fresh's destinations (written once here: no first touch)
  if (fresh.data == nullptr) return Status::ResourceExhausted("no memory for the buffers");
  uint64_t fresh_at = 0;
  for (size_t si = 0; si < o.batch_sizes.size(); ++si) {
    const auto [bytes, values] = o.batch_sizes[si];
    const uint64_t total = bytes * values;
    const uint64_t seed_base = (si + 1) << 32;
    SPARSEKV_RETURN_IF_ERROR(PutValues(*tcp, si, values, bytes, seed_base));
    SPARSEKV_RETURN_IF_ERROR(PutValues(*leased, si, values, bytes, seed_base));
    std::vector<WireBlockHash> hashes;
    for (uint64_t i = 0; i < values; ++i) hashes.push_back(BatchKey(si, i));
    WarmBuffer dst(total), src(total);
    if (dst.data == nullptr || src.data == nullptr) return Status::ResourceExhausted("no memory for the buffers");
    for (uint64_t i = 0; i < values; ++i) FillValue(src.data + i * bytes, bytes, seed_base + i);
    std::vector<std::span<std::byte>> dests;
    for (uint64_t i = 0; i < values; ++i) dests.push_back({dst.data + i * bytes, bytes});
    SPARSEKV_ASSIGN_OR_RETURN(auto pair, SocketPair::Open(src.data, total));

    // Each method once before timing, every byte checked (the destination wiped in between).
    std::memset(dst.data, 0, total);
    SPARSEKV_RETURN_IF_ERROR(GetAll(*tcp, hashes, dests, bytes));
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "TCP GetInto"));
    std::memset(dst.data, 0, total);
    SPARSEKV_RETURN_IF_ERROR(GetAll(*shm, hashes, dests, bytes));
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "shared-memory GetInto"));
    std::memset(dst.data, 0, total);
    SPARSEKV_RETURN_IF_ERROR(GetAll(*leased, hashes, dests, bytes));
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "shared-memory GetInto (write leases on)"));
    std::memset(dst.data, 0, total);
    if (!pair->Fetch(dst.data, total)) return Status::IOError("the socket pair failed");
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "socket pair"));

    Status failed;
    auto fail_once = [&](const Status& st) {
      if (!st.ok() && failed.ok()) failed = st;
    };
    // The two baselines, measured beside the GETs and again beside the PUTs.
    auto baselines = [&] {
      std::vector<Method> m;
      m.emplace_back("memcpy", [&](uint64_t n) {
        for (uint64_t k = 0; k < n; ++k) {
          for (uint64_t i = 0; i < values; ++i) std::memcpy(dst.data + i * bytes, src.data + i * bytes, bytes);
          DoNotOptimize(dst.data[0]);
        }
      });
      m.emplace_back("socket", [&](uint64_t n) {
        for (uint64_t k = 0; k < n; ++k) {
          if (!pair->Fetch(dst.data, total)) fail_once(Status::IOError("the socket pair failed"));
        }
      });
      return m;
    };
    std::vector<Method> methods = baselines();
    methods.emplace_back("tcp", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(GetAll(*tcp, hashes, dests, bytes));
    });
    methods.emplace_back("shm", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(GetAll(*shm, hashes, dests, bytes));
    });
    methods.emplace_back("shm_leases", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(GetAll(*leased, hashes, dests, bytes));
    });
    RunInterleaved(methods, o.round_seconds, o.rounds);
    SPARSEKV_RETURN_IF_ERROR(failed);
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "after the rounds"));

    // Page faults of the whole process (daemon threads included) per GB received, buffers warm.
    auto faults_per_gb = [&](Client& c) -> Result<double> {
      const int reps = static_cast<int>(std::clamp<uint64_t>((1ull << 30) / total, 2, 64));
      const uint64_t f0 = ProcessPageFaults();
      for (int k = 0; k < reps; ++k) SPARSEKV_RETURN_IF_ERROR(GetAll(c, hashes, dests, bytes));
      return static_cast<double>(ProcessPageFaults() - f0) / (static_cast<double>(total) * reps / 1e9);
    };
    SPARSEKV_ASSIGN_OR_RETURN(const double tcp_faults, faults_per_gb(*tcp));
    SPARSEKV_ASSIGN_OR_RETURN(const double shm_faults, faults_per_gb(*shm));

    // PUT from the same memory, each value from where it lies (new versions of the same keys,
    // the same bytes), interleaved with the GET methods and the baselines above. Before timing,
    // the lease client writes the whole arena once: a long-lived client's mapping of it has
    // every page mapped, and the first touch of one costs more than the copy.
    std::vector<BundleRef> refs;
    for (uint64_t i = 0; i < values; ++i) refs.push_back({hashes[i], {src.data + i * bytes, bytes}});
    auto put_all = [&](Client& c) -> Status {
      SPARSEKV_ASSIGN_OR_RETURN(auto st, c.Put(refs));
      for (const Status& x : st) SPARSEKV_RETURN_IF_ERROR(x);
      return Status::OK();
    };
    for (uint64_t w = 0; w <= lease_capacity / total + 1; ++w) SPARSEKV_RETURN_IF_ERROR(put_all(*leased));
    SPARSEKV_RETURN_IF_ERROR(put_all(*tcp));
    SPARSEKV_RETURN_IF_ERROR(put_all(*shm));
    std::vector<Method> puts = baselines();
    // A third baseline for the PUTs: memcpy into memory not written lately, each time the next
    // `total` bytes of a buffer the size of the write-lease daemon's host tier (256 MiB or
    // more), as a store's copies go into its tier's next rooms. (memcpy's destination above is
    // the same every round, and a batch that fits the cache stays there.)
    puts.emplace_back("memcpy_fresh", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) {
        if (fresh_at + total > fresh.bytes) fresh_at = 0;
        for (uint64_t i = 0; i < values; ++i) {
          std::memcpy(fresh.data + fresh_at + i * bytes, src.data + i * bytes, bytes);
        }
        DoNotOptimize(fresh.data[fresh_at]);
        fresh_at += total;
      }
    });
    puts.emplace_back("put_tcp", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(put_all(*tcp));
    });
    puts.emplace_back("put_shm", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(put_all(*shm));
    });
    puts.emplace_back("put_lease", [&](uint64_t n) {
      for (uint64_t k = 0; k < n; ++k) fail_once(put_all(*leased));
    });
    RunInterleaved(puts, o.round_seconds, o.rounds);
    SPARSEKV_RETURN_IF_ERROR(failed);
    std::memset(dst.data, 0, total);
    SPARSEKV_RETURN_IF_ERROR(GetAll(*shm, hashes, dests, bytes));
    SPARSEKV_RETURN_IF_ERROR(Check(dst.data, values, bytes, seed_base, "GetInto after the PUT rounds"));

    const double mem = MedianOf(methods, "memcpy") * static_cast<double>(total);
    const double sock = MedianOf(methods, "socket") * static_cast<double>(total);
    const double t = MedianOf(methods, "tcp") * static_cast<double>(total);
    const double s = MedianOf(methods, "shm") * static_cast<double>(total);
    nlohmann::json b;
    b["value_bytes"] = bytes;
    b["values"] = values;
    b["shm_bytes_per_s"] = s;
    b["tcp_bytes_per_s"] = t;
    b["memcpy_bytes_per_s"] = mem;
    b["socket_bytes_per_s"] = sock;
    b["faults_per_gb"] = std::max(tcp_faults, shm_faults);
    b["tcp_faults_per_gb"] = tcp_faults;
    b["shm_faults_per_gb"] = shm_faults;
    b["shm_vs_memcpy"] = s / mem;
    // Over shared memory from the daemon with write leases on (local reads checked).
    b["shm_leases_bytes_per_s"] = MedianOf(methods, "shm_leases") * static_cast<double>(total);
    b["shm_leases_vs_memcpy"] = b["shm_leases_bytes_per_s"].get<double>() / mem;
    b["shm_local_reads"] = shm->local_reads();
    b["tcp_vs_socket"] = t / sock;
    // The PUT rows against their own interleaved baselines (measured beside the PUTs).
    const double put_mem = MedianOf(puts, "memcpy") * static_cast<double>(total);
    const double put_sock = MedianOf(puts, "socket") * static_cast<double>(total);
    b["put_shm_bytes_per_s"] = MedianOf(puts, "put_shm") * static_cast<double>(total);
    b["put_tcp_bytes_per_s"] = MedianOf(puts, "put_tcp") * static_cast<double>(total);
    b["put_lease_bytes_per_s"] = MedianOf(puts, "put_lease") * static_cast<double>(total);
    b["put_memcpy_bytes_per_s"] = put_mem;
    b["put_socket_bytes_per_s"] = put_sock;
    b["put_shm_vs_memcpy"] = b["put_shm_bytes_per_s"].get<double>() / put_mem;
    b["put_lease_vs_memcpy"] = b["put_lease_bytes_per_s"].get<double>() / put_mem;
    b["put_tcp_vs_socket"] = b["put_tcp_bytes_per_s"].get<double>() / put_sock;
    const double put_fresh = MedianOf(puts, "memcpy_fresh") * static_cast<double>(total);
    b["put_memcpy_fresh_bytes_per_s"] = put_fresh;
    b["put_shm_vs_memcpy_fresh"] = b["put_shm_bytes_per_s"].get<double>() / put_fresh;
    b["put_lease_vs_memcpy_fresh"] = b["put_lease_bytes_per_s"].get<double>() / put_fresh;
    b["samples"] = SamplesJson(methods);
    b["put_samples"] = SamplesJson(puts);
    batches.push_back(std::move(b));
    // This size's values go, so that the next size and the restore have the room.
    std::vector<Status> gone = *tcp->Delete(hashes);
    gone = *leased->Delete(hashes);
    (void)gone;
  }

  nlohmann::json j;
  j["cpu"] = CpuModel();
  j["rounds"] = o.rounds;
  j["client_spin_us"] = o.spin_us;
  j["round_seconds"] = o.round_seconds;
  j["batch"] = std::move(batches);
  j["what"] =
      "one client, batch GET into its own warm buffers (Client::GetInto), values just PUT (host memory); "
      "rates in bytes per second, medians of interleaved rounds; memcpy: the same bytes from a warm buffer "
      "into the same destination (memcpy_fresh, PUT rows only: into the next bytes of a buffer the size of the "
      "write-lease daemon's host tier); socket: one loopback TCP round trip carrying the batch; faults: minor + "
      "major faults of the whole process (daemon included) per 1e9 bytes received, after warm-up";

  if (o.restore_blocks > 0) {
    // The prefix, block by block, through the daemon into caller pages: PUT, then GetInto.
    const uint64_t n = o.restore_blocks;
    const uint64_t seed_base = 0xfe11ull << 32;
    const uint64_t si = o.batch_sizes.size() + 1;
    SPARSEKV_RETURN_IF_ERROR(PutValues(*shm, si, n, block_bytes, seed_base));
    std::vector<WireBlockHash> hashes;
    for (uint64_t i = 0; i < n; ++i) hashes.push_back(BatchKey(si, i));
    WarmBuffer pages(n * block_bytes);
    if (pages.data == nullptr) return Status::ResourceExhausted("no memory for the restore's pages");
    std::vector<std::span<std::byte>> dests;
    for (uint64_t i = 0; i < n; ++i) dests.push_back({pages.data + i * block_bytes, block_bytes});
    auto timed = [&](Client& c) -> Result<double> {
      const double t0 = NowSeconds();
      SPARSEKV_RETURN_IF_ERROR(GetAll(c, hashes, dests, block_bytes));
      return NowSeconds() - t0;
    };
    // The first through shared memory maps the arena's pages into this process (first touch).
    SPARSEKV_ASSIGN_OR_RETURN(const double shm_first, timed(*shm));
    SPARSEKV_RETURN_IF_ERROR(Check(pages.data, n, block_bytes, seed_base, "restore through the daemon"));
    std::vector<double> shm_s, tcp_s;
    for (int r = 0; r < 3; ++r) {
      SPARSEKV_ASSIGN_OR_RETURN(double a, timed(*shm));
      SPARSEKV_ASSIGN_OR_RETURN(double b, timed(*tcp));
      shm_s.push_back(a);
      tcp_s.push_back(b);
    }
    SPARSEKV_RETURN_IF_ERROR(Check(pages.data, n, block_bytes, seed_base, "restore through the daemon (TCP)"));
    restore["daemon_shm_first_seconds"] = shm_first;
    restore["daemon_shm_seconds"] = QuantileInPlace(shm_s, 0.5);
    restore["daemon_tcp_seconds"] = QuantileInPlace(tcp_s, 0.5);
    restore["daemon_shm_bytes_per_s"] = static_cast<double>(n * block_bytes) / restore["daemon_shm_seconds"].get<double>();
    restore["daemon_tcp_bytes_per_s"] = static_cast<double>(n * block_bytes) / restore["daemon_tcp_seconds"].get<double>();
    restore["daemon_shm_vs_in_process"] =
        restore["in_process_seconds"].get<double>() / restore["daemon_shm_seconds"].get<double>();
    j["restore"] = std::move(restore);
  }
  return j;
}

}  // namespace sparsekv::bench
