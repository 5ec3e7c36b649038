#include "daemon_stress.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "allocator/xxhash_dispatch.h"
#include "bench_util.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/bundle.h"

namespace sparsekv::bench {
namespace {

// splitmix64: the filler stream of one (key, version).
struct FillerStream {
  uint64_t x;
  uint64_t Next() {
    x += 0x9e3779b97f4a7c15ull;
    return MixBits(x);
  }
};

uint64_t Load64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t Load32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void SleepSeconds(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

std::string TailOfFile(const std::string& path, size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The checker.

DaemonStressChecker::DaemonStressChecker(uint64_t seed, uint32_t clients, uint32_t keys_per_client)
    : seed_(seed), keys_per_client_(keys_per_client), keys_(uint64_t{clients} * keys_per_client) {}

WireBlockHash DaemonStressChecker::Hash(uint32_t key) const {
  const uint64_t id[2] = {key / keys_per_client_, key % keys_per_client_};
  const XXH128_hash_t h = XXH3_128bits_withSeed(id, sizeof(id), seed_);
  WireBlockHash out;
  std::memcpy(out.data(), &h.low64, 8);
  std::memcpy(out.data() + 8, &h.high64, 8);
  return out;
}

uint64_t DaemonStressChecker::FillerSeed(uint32_t key, uint64_t version) const {
  return MixBits(seed_ ^ MixBits((uint64_t{key} << 40) ^ version));
}

uint64_t DaemonStressChecker::NextVersion(uint32_t key) {
  return ++keys_[key].issued;
}

void DaemonStressChecker::MakeValue(uint32_t key, uint64_t version, size_t bytes,
                                    std::vector<std::byte>& out) const {
  bytes = std::max(bytes, kHeaderBytes);
  out.resize(bytes);
  std::byte* p = out.data();
  FillerStream f{FillerSeed(key, version)};
  for (size_t i = kHeaderBytes; i < bytes; i += 8) {
    const uint64_t w = f.Next();
    std::memcpy(p + i, &w, std::min<size_t>(8, bytes - i));
  }
  const uint64_t magic = kMagic, length = bytes;
  const uint32_t client = key / keys_per_client_, index = key % keys_per_client_;
  const uint64_t sum = XXH3_64bits(p + kHeaderBytes, bytes - kHeaderBytes);
  std::memcpy(p + 0, &magic, 8);
  std::memcpy(p + 8, &seed_, 8);
  std::memcpy(p + 16, &client, 4);
  std::memcpy(p + 20, &index, 4);
  std::memcpy(p + 24, &version, 8);
  std::memcpy(p + 32, &length, 8);
  std::memcpy(p + 40, &sum, 8);
}

void DaemonStressChecker::OnPutAcked(uint32_t key, uint64_t version, uint64_t bytes) {
  KeyState& k = keys_[key];
  if (k.present) live_bytes_.fetch_sub(k.acked_bytes, std::memory_order_relaxed);
  live_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  k.present = true;
  k.acked = version;
  k.acked_bytes = bytes;
  k.unacked_puts.clear();
  k.unacked_delete = false;
}

void DaemonStressChecker::OnPutUnacked(uint32_t key, uint64_t version) {
  keys_[key].unacked_puts.push_back(version);
}

void DaemonStressChecker::OnDeleteAcked(uint32_t key) {
  KeyState& k = keys_[key];
  if (k.present) live_bytes_.fetch_sub(k.acked_bytes, std::memory_order_relaxed);
  k.present = false;
  k.acked_bytes = 0;
  k.unacked_puts.clear();
  k.unacked_delete = false;
}

void DaemonStressChecker::OnDeleteUnacked(uint32_t key) {
  keys_[key].unacked_delete = true;
}

DaemonStressChecker::Check DaemonStressChecker::CheckGet(
    uint32_t key, std::optional<std::span<const std::byte>> value, bool after_restart) const {
  const KeyState& k = keys_[key];
  if (!value) {
    if (!k.present || k.unacked_delete) return {Verdict::kAbsentExpected, 0};
    // A PUT whose outcome is unknown may have replaced the value and then been lost itself:
    // only a key with nothing pending is held to its acknowledged value.
    if (after_restart && k.unacked_puts.empty()) return {Verdict::kLost, 0};
    return {Verdict::kMiss, 0};
  }
  const std::span<const std::byte> v = *value;
  if (v.size() < kHeaderBytes) return {Verdict::kCorrupt, 0};
  const std::byte* p = v.data();
  const uint64_t version = Load64(p + 24);
  const uint64_t expect_key = uint64_t{Load32(p + 16)} * keys_per_client_ + Load32(p + 20);
  if (Load64(p) != kMagic || Load64(p + 8) != seed_ || Load32(p + 20) >= keys_per_client_ ||
      expect_key != key || Load64(p + 32) != v.size() ||
      Load64(p + 40) != XXH3_64bits(p + kHeaderBytes, v.size() - kHeaderBytes)) {
    return {Verdict::kCorrupt, version};
  }
  // The checksum travels with the bytes, so a value torn or damaged and its checksum
  // recomputed (or one whose header names another version) would still pass it: compare every
  // byte of the filler too.
  FillerStream f{FillerSeed(key, version)};
  for (size_t i = kHeaderBytes; i < v.size(); i += 8) {
    const uint64_t w = f.Next();
    if (std::memcmp(p + i, &w, std::min<size_t>(8, v.size() - i)) != 0)
      return {Verdict::kCorrupt, version};
  }
  if ((k.present && version == k.acked) ||
      std::find(k.unacked_puts.begin(), k.unacked_puts.end(), version) != k.unacked_puts.end()) {
    return {Verdict::kMatch, version};
  }
  if (version == 0 || version > k.issued) return {Verdict::kStale, version};  // never PUT
  if (!k.present) return {Verdict::kDeletedReturned, version};
  return {Verdict::kStale, version};
}

bool DaemonStressChecker::PresenceAllowed(uint32_t key) const {
  const KeyState& k = keys_[key];
  return k.present || !k.unacked_puts.empty();
}

std::string DaemonStressChecker::Describe(uint32_t key) const {
  const KeyState& k = keys_[key];
  std::string pending;
  for (uint64_t v : k.unacked_puts) pending += (pending.empty() ? "" : ",") + std::to_string(v);
  return fmt::format(
      "client {} key {}: last acknowledged {}, issued up to v{}, unacknowledged PUTs [{}]{}",
      key / keys_per_client_, key % keys_per_client_,
      k.present ? fmt::format("PUT v{} ({} bytes)", k.acked, k.acked_bytes) : std::string("DELETE"),
      k.issued, pending, k.unacked_delete ? ", a DELETE unacknowledged" : "");
}

std::string_view DaemonStressChecker::VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kMatch:
      return "match";
    case Verdict::kAbsentExpected:
      return "absent_expected";
    case Verdict::kMiss:
      return "miss";
    case Verdict::kLost:
      return "lost";
    case Verdict::kStale:
      return "stale_returned";
    case Verdict::kDeletedReturned:
      return "deleted_returned";
    case Verdict::kCorrupt:
      return "corrupt_returned";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// The daemon under test: a running one (shell commands kill and restart it), one in this
// process, or a sparsekvd child.

namespace {

class StressDaemon {
 public:
  virtual ~StressDaemon() = default;
  // (Re)starts it; returns once it was started, not once it answers.
  virtual Status Start() = 0;
  virtual Status Kill() = 0;
  // A clean stop at the end: the status says how it went.
  virtual Status Stop() = 0;
  // Not OK when it exited on its own (a crash), naming how.
  virtual Status Alive() { return Status::OK(); }
  // Its log's last lines, for error messages ("" when there is none).
  virtual std::string LogTail() { return ""; }
};

// A daemon someone else started: killed and restarted by shell commands.
class ExternalDaemon final : public StressDaemon {
 public:
  ExternalDaemon(std::string kill_command, std::string restart_command)
      : kill_(std::move(kill_command)), restart_(std::move(restart_command)) {}
  Status Start() override { return Shell(restart_, "--restart-cmd"); }
  Status Kill() override { return kill_.empty() ? Status::OK() : Shell(kill_, "--kill-cmd"); }
  Status Stop() override { return Status::OK(); }

 private:
  static Status Shell(const std::string& command, const char* what) {
    const int rc = std::system(command.c_str());
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
      return Status::Internal(fmt::format("{} '{}' failed (status {})", what, command, rc));
    }
    return Status::OK();
  }
  const std::string kill_, restart_;
};

// server::Server over server::TieredStore in this process (no kill cycles).
class InProcessDaemon final : public StressDaemon {
 public:
  InProcessDaemon(server::TieredStoreOptions store, server::ServerOptions server)
      : store_options_(std::move(store)), server_options_(std::move(server)) {}
  ~InProcessDaemon() override { Stop().IgnoreError(); }
  Status Start() override {
    SPARSEKV_ASSIGN_OR_RETURN(store_, server::TieredStore::Open(store_options_));
    SPARSEKV_ASSIGN_OR_RETURN(server_, server::Server::Start(server_options_, store_.get()));
    return Status::OK();
  }
  Status Kill() override { return Status::NotSupported("an in-process daemon cannot be killed"); }
  Status Stop() override {
    Status st;
    if (server_) {
      server_->Shutdown();
      st = server_->Wait();
      server_.reset();
    }
    store_.reset();
    return st;
  }
  std::string tcp_address() const { return server_ ? server_->tcp_address() : ""; }

 private:
  const server::TieredStoreOptions store_options_;
  const server::ServerOptions server_options_;
  std::unique_ptr<server::TieredStore> store_;
  std::unique_ptr<server::Server> server_;
};

// The sparsekvd binary as a child of this process, with a generated config file.
class ChildDaemon final : public StressDaemon {
 public:
  ChildDaemon(std::string binary, std::string config, std::string log)
      : binary_(std::move(binary)), config_(std::move(config)), log_(std::move(log)) {}
  ~ChildDaemon() override {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  Status Start() override {
    // Everything the child needs is made before fork: only async-signal-safe calls after it.
    std::vector<std::string> args = {binary_, "--config", config_};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int log_fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0)
      return Status::IOError(fmt::format("cannot open {}: {}", log_, std::strerror(errno)));
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(log_fd);
      return Status::IOError(fmt::format("fork: {}", std::strerror(errno)));
    }
    if (pid == 0) {
      ::dup2(log_fd, 1);
      ::dup2(log_fd, 2);
      // The clients' sockets must not live on in the daemon (they are CLOEXEC, but a library's
      // descriptor might not be).
      ::close_range(3, ~0u, 0);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    ::close(log_fd);
    pid_ = pid;
    return Status::OK();
  }

  Status Kill() override {
    if (pid_ <= 0) return Status::FailedPrecondition("sparsekvd is not running");
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);  // the RocksDB lock is released only once it is gone
    pid_ = -1;
    return Status::OK();
  }

  Status Stop() override {
    if (pid_ <= 0) return Status::OK();
    ::kill(pid_, SIGTERM);
    int status = 0;
    const double deadline = NowSeconds() + 30;
    pid_t r = 0;
    while ((r = ::waitpid(pid_, &status, WNOHANG)) == 0 && NowSeconds() < deadline)
      SleepSeconds(0.02);
    if (r == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
      return Status::Internal("sparsekvd did not stop within 30 s of SIGTERM");
    }
    pid_ = -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return Status::Internal(
          fmt::format("sparsekvd stopped with status {}; its log ends: {}", status, LogTail()));
    }
    return Status::OK();
  }

  Status Alive() override {
    if (pid_ <= 0) return Status::OK();
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return Status::OK();
    pid_ = -1;
    return Status::Internal(fmt::format(
        "sparsekvd exited on its own ({} {})", WIFSIGNALED(status) ? "signal" : "exit code",
        WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status)));
  }

  std::string LogTail() override { return TailOfFile(log_, 1500); }

 private:
  const std::string binary_, config_, log_;
  pid_t pid_ = -1;
};

// Connects and PINGs until the daemon answers, it dies, or `timeout_s` passes.
Status WaitUntilAnswering(const ClientOptions& co, double timeout_s, StressDaemon* daemon) {
  const double deadline = NowSeconds() + timeout_s;
  Status last;
  for (;;) {
    auto c = Client::Connect(co);
    if (c.ok()) {
      last = (*c)->Ping();
      if (last.ok()) return Status::OK();
    } else {
      last = c.status();
      if (last.Is(StatusCode::kPermissionDenied) || last.Is(StatusCode::kInvalidArgument))
        return last;
    }
    if (daemon != nullptr) SPARSEKV_RETURN_IF_ERROR(daemon->Alive());
    if (NowSeconds() > deadline) {
      return Status::Unavailable(fmt::format("the daemon at {} did not answer within {:.0f} s: {}",
                                             co.address, timeout_s, last.ToString()));
    }
    SleepSeconds(0.05);
  }
}

// ---------------------------------------------------------------------------------------------
// The run: shared state, the client threads and the coordinator (the caller's thread).

constexpr size_t kMaxExamples = 5;
constexpr double kReconnectSeconds = 10;

struct Counters {
  std::atomic<uint64_t> acknowledged{0}, puts{0}, gets{0}, hits{0}, misses{0}, absent_expected{0};
  std::atomic<uint64_t> lookups{0}, lookup_deleted_present{0}, deletes{0};
  // LOOKUP answers by tier (host, ssd, rocksdb, absent): whether values reached the lower tiers.
  std::atomic<uint64_t> lookup_host{0}, lookup_ssd{0}, lookup_rocksdb{0}, lookup_remote{0}, lookup_absent{0};
  std::atomic<uint64_t> stale{0}, deleted_returned{0}, corrupt{0}, corrupt_detected{0};
  std::atomic<uint64_t> refused{0}, errors{0}, reconnects{0};
  std::atomic<uint64_t> verified{0}, lost{0}, lost_not_counted{0}, ops{0};
};

struct Shared {
  Shared(const DaemonStressOptions& options, uint64_t seed)
      : o(options),
        checker(seed, static_cast<uint32_t>(options.clients), options.keys_per_client),
        cycle_counted(new std::atomic<bool>[static_cast<size_t>(options.kill_cycles) + 1]) {
    for (int i = 0; i <= options.kill_cycles; ++i) cycle_counted[i].store(false);
  }

  const DaemonStressOptions& o;
  DaemonStressChecker checker;
  ClientOptions client_options;
  Counters c;

  std::atomic<bool> go{false}, stop{false};
  // Set before a kill and cleared once the restarted daemon answers; `epoch` counts kills.
  // A connection made in epoch e that breaks once the epoch moved on broke because of a kill.
  std::atomic<bool> kill_in_progress{false};
  std::atomic<uint64_t> epoch{0};
  // Per kill (1-based): whether its acknowledged-live bytes fit, so misses after it are lost.
  std::unique_ptr<std::atomic<bool>[]> cycle_counted;
  std::atomic<int> ready{0};

  std::mutex mu;
  std::vector<std::string> refused_examples, error_examples, violation_examples;  // guarded by mu

  void Example(std::vector<std::string>& list, std::string text) {
    std::lock_guard<std::mutex> l(mu);
    if (list.size() < kMaxExamples) list.push_back(std::move(text));
  }
  void Error(std::string text) {
    c.errors.fetch_add(1);
    Example(error_examples, std::move(text));
  }
};

class StressClient {
 public:
  StressClient(Shared& s, int id, uint64_t seed)
      : s_(s),
        id_(id),
        first_key_(static_cast<uint32_t>(id) * s.o.keys_per_client),
        rng_(MixBits(seed + static_cast<uint64_t>(id) + 1)) {}

  void Run() {
    const bool set_up = Connect() && DeleteOwnKeys();
    s_.ready.fetch_add(1);
    if (!set_up) return;
    while (!s_.go.load() && !s_.stop.load()) SleepSeconds(0.001);
    uint64_t ops = 0;
    while (!s_.stop.load() && ops < s_.o.max_ops_per_client) {
      if (!conn_ && !Connect()) return;
      if (verified_epoch_ < conn_epoch_) {
        if (Verify()) verified_epoch_ = conn_epoch_;
        continue;
      }
      const uint32_t dice = static_cast<uint32_t>(rng_() % 100);
      if (dice < 40) {
        Put();
      } else if (dice < 80) {
        Get();
      } else if (dice < 90) {
        Lookup();
      } else {
        Delete();
      }
      ++ops;
      s_.c.ops.fetch_add(1, std::memory_order_relaxed);
    }
    // A kill near the end that this client has not verified yet.
    for (int attempt = 0; attempt < 5 && verified_epoch_ < s_.epoch.load(); ++attempt) {
      if (!conn_ && !Connect()) return;
      if (Verify()) verified_epoch_ = conn_epoch_;
    }
  }

  std::vector<float> put_us, get_us;

 private:
  uint32_t PickKey() { return first_key_ + static_cast<uint32_t>(rng_() % s_.o.keys_per_client); }

  // 1 key mostly, sometimes 2-4 distinct ones, to exercise batches.
  std::vector<uint32_t> PickKeys() {
    uint32_t n = rng_() % 10 < 7 ? 1 : 2 + static_cast<uint32_t>(rng_() % 3);
    n = std::min(n, s_.o.keys_per_client);
    std::vector<uint32_t> keys;
    while (keys.size() < n) {
      const uint32_t k = PickKey();
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    return keys;
  }

  uint64_t ValueBytes() {
    const double lo = std::log(static_cast<double>(s_.o.min_value_bytes));
    const double hi = std::log(static_cast<double>(s_.o.max_value_bytes));
    const double u = std::uniform_real_distribution<double>(0, 1)(rng_);
    return std::clamp<uint64_t>(static_cast<uint64_t>(std::exp(lo + u * (hi - lo))),
                                s_.o.min_value_bytes, s_.o.max_value_bytes);
  }

  // Connects (again), retrying while a kill is in progress and for kReconnectSeconds after.
  // False when it gave up (an error was counted).
  bool Connect() {
    conn_.reset();
    ClientOptions co = s_.client_options;
    co.client_name = fmt::format("stress-{}", id_);
    double deadline = NowSeconds() + kReconnectSeconds;
    double backoff = 0.01;
    Status last;
    for (;;) {
      if (s_.kill_in_progress.load()) {
        SleepSeconds(0.02);
        deadline = NowSeconds() + kReconnectSeconds;
        continue;
      }
      // A connection is only trusted to the daemon of this epoch when no kill began meanwhile
      // (kill_in_progress is set before the kill, the epoch moved on before it).
      const uint64_t epoch = s_.epoch.load();
      auto c = Client::Connect(co);
      if (c.ok() && !s_.kill_in_progress.load() && s_.epoch.load() == epoch) {
        conn_ = std::move(c).value();
        conn_epoch_ = epoch;
        return true;
      }
      if (!c.ok()) {
        last = c.status();
        if (last.Is(StatusCode::kPermissionDenied) || last.Is(StatusCode::kInvalidArgument)) break;
      }
      if (NowSeconds() > deadline) break;
      SleepSeconds(backoff);
      backoff = std::min(backoff * 2, 0.5);
    }
    s_.Error(fmt::format("client {}: cannot connect to {}: {}", id_, s_.client_options.address,
                         last.ToString()));
    return false;
  }

  // A request failed as a whole (the connection broke, timed out or answered nonsense).
  void Failed(const Status& st, std::string_view what) {
    if (s_.kill_in_progress.load() || s_.epoch.load() != conn_epoch_) {
      s_.c.reconnects.fetch_add(1);
    } else {
      s_.Error(fmt::format("client {}: {}: {}", id_, what, st.ToString()));
    }
    conn_.reset();
  }

  // A daemon with values of an earlier run under the same seed would otherwise look stale.
  bool DeleteOwnKeys() {
    for (uint32_t k = 0; k < s_.o.keys_per_client; k += 64) {
      std::vector<WireBlockHash> hashes;
      for (uint32_t i = k; i < std::min(k + 64, s_.o.keys_per_client); ++i)
        hashes.push_back(s_.checker.Hash(first_key_ + i));
      auto r = conn_->Delete(hashes);
      if (!r.ok()) {
        s_.Error(fmt::format("client {}: initial DELETE: {}", id_, r.status().ToString()));
        return false;
      }
      for (size_t i = 0; i < r->size(); ++i) {
        const Status& st = (*r)[i];
        if (!st.ok() && !st.Is(StatusCode::kNotFound)) {
          s_.Error(fmt::format("client {}: initial DELETE: {}", id_, st.ToString()));
          return false;
        }
        s_.checker.OnDeleteAcked(first_key_ + k + static_cast<uint32_t>(i));
      }
    }
    return true;
  }

  void Put() {
    const uint32_t key = PickKey();
    const uint64_t bytes = ValueBytes();
    const uint64_t version = s_.checker.NextVersion(key);
    s_.checker.MakeValue(key, version, bytes, value_);
    const BundleRef ref{s_.checker.Hash(key), value_};
    s_.c.puts.fetch_add(1, std::memory_order_relaxed);
    const double t0 = NowSeconds();
    auto r = conn_->Put(std::span<const BundleRef>(&ref, 1));
    const double t1 = NowSeconds();
    if (!r.ok() || r->size() != 1) {
      s_.checker.OnPutUnacked(key, version);
      Failed(r.ok() ? Status::Internal("PUT answered the wrong number of items") : r.status(),
             "PUT");
      return;
    }
    const Status& st = (*r)[0];
    if (st.ok()) {
      s_.checker.OnPutAcked(key, version, bytes);
      s_.c.acknowledged.fetch_add(1, std::memory_order_relaxed);
      put_us.push_back(static_cast<float>((t1 - t0) * 1e6));
    } else {
      // Refused as a whole or in part (write-through: one tier may hold it): unknown outcome.
      s_.checker.OnPutUnacked(key, version);
      s_.c.refused.fetch_add(1);
      s_.Example(s_.refused_examples, fmt::format("{} bytes: {}", bytes, st.ToString()));
    }
  }

  void Judge(uint32_t key, std::optional<std::span<const std::byte>> value, bool after_restart) {
    using V = DaemonStressChecker::Verdict;
    const DaemonStressChecker::Check c = s_.checker.CheckGet(key, value, after_restart);
    switch (c.verdict) {
      case V::kMatch:
        if (!after_restart) s_.c.hits.fetch_add(1, std::memory_order_relaxed);
        return;
      case V::kAbsentExpected:
        if (!after_restart) s_.c.absent_expected.fetch_add(1, std::memory_order_relaxed);
        return;
      case V::kMiss:
        s_.c.misses.fetch_add(1, std::memory_order_relaxed);
        return;
      case V::kLost:
        (CycleCounted() ? s_.c.lost : s_.c.lost_not_counted).fetch_add(1);
        return;
      case V::kStale:
        s_.c.stale.fetch_add(1);
        break;
      case V::kDeletedReturned:
        s_.c.deleted_returned.fetch_add(1);
        break;
      case V::kCorrupt:
        s_.c.corrupt.fetch_add(1);
        break;
    }
    s_.Example(s_.violation_examples,
               fmt::format("{}{}: got {} bytes claiming v{}; {}",
                           DaemonStressChecker::VerdictName(c.verdict),
                           after_restart ? " (after restart)" : "", value ? value->size() : 0,
                           c.version, s_.checker.Describe(key)));
  }

  // Whether every kill since this client last verified left a live set that fit.
  bool CycleCounted() const {
    for (uint64_t e = verified_epoch_ + 1; e <= conn_epoch_; ++e) {
      if (!s_.cycle_counted[e].load()) return false;
    }
    return true;
  }

  // GETs answered per item: bytes, NotFound, or a daemon-side error (an error here).
  bool JudgeGetReply(const std::vector<uint32_t>& keys, const Result<std::vector<GetResult>>& r,
                     bool after_restart) {
    if (!r.ok() || r->size() != keys.size()) {
      Failed(r.ok() ? Status::Internal("GET answered the wrong number of items") : r.status(),
             "GET");
      return false;
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const GetResult& g = (*r)[i];
      if (after_restart) {
        s_.c.verified.fetch_add(1, std::memory_order_relaxed);
      } else {
        s_.c.gets.fetch_add(1, std::memory_order_relaxed);
      }
      if (g.status.ok()) {
        Judge(keys[i], std::span<const std::byte>(g.bytes), after_restart);
      } else if (g.status.Is(StatusCode::kNotFound)) {
        Judge(keys[i], std::nullopt, after_restart);
      } else {
        if (g.status.Is(StatusCode::kCorruption)) s_.c.corrupt_detected.fetch_add(1);
        s_.Error(fmt::format("client {}: GET item: {} ({})", id_, g.status.ToString(),
                             s_.checker.Describe(keys[i])));
      }
    }
    return true;
  }

  void Get() {
    const std::vector<uint32_t> keys = PickKeys();
    std::vector<WireBlockHash> hashes;
    for (uint32_t k : keys) hashes.push_back(s_.checker.Hash(k));
    const double t0 = NowSeconds();
    auto r = conn_->Get(hashes);
    const double t1 = NowSeconds();
    if (JudgeGetReply(keys, r, false)) get_us.push_back(static_cast<float>((t1 - t0) * 1e6));
  }

  // After a kill: every key once, before anything else on the new connection.
  bool Verify() {
    for (uint32_t k = 0; k < s_.o.keys_per_client; k += 4) {
      std::vector<uint32_t> keys;
      std::vector<WireBlockHash> hashes;
      for (uint32_t i = k; i < std::min(k + 4, s_.o.keys_per_client); ++i) {
        keys.push_back(first_key_ + i);
        hashes.push_back(s_.checker.Hash(first_key_ + i));
      }
      if (!JudgeGetReply(keys, conn_->Get(hashes), true)) return false;
    }
    return true;
  }

  void Lookup() {
    const std::vector<uint32_t> keys = PickKeys();
    std::vector<WireBlockHash> hashes;
    for (uint32_t k : keys) hashes.push_back(s_.checker.Hash(k));
    auto r = conn_->Lookup(hashes);
    if (!r.ok() || r->tiers.size() != keys.size()) {
      Failed(r.ok() ? Status::Internal("LOOKUP answered the wrong number of items") : r.status(),
             "LOOKUP");
      return;
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      s_.c.lookups.fetch_add(1, std::memory_order_relaxed);
      switch (r->tiers[i]) {
        case BlockTier::kHost:
          s_.c.lookup_host.fetch_add(1, std::memory_order_relaxed);
          break;
        case BlockTier::kSsd:
          s_.c.lookup_ssd.fetch_add(1, std::memory_order_relaxed);
          break;
        case BlockTier::kRocksDb:
          s_.c.lookup_rocksdb.fetch_add(1, std::memory_order_relaxed);
          break;
        case BlockTier::kRemote:
          s_.c.lookup_remote.fetch_add(1, std::memory_order_relaxed);
          break;
        default:
          s_.c.lookup_absent.fetch_add(1, std::memory_order_relaxed);
          break;
      }
      if (r->tiers[i] != BlockTier::kAbsent && !s_.checker.PresenceAllowed(keys[i])) {
        s_.c.lookup_deleted_present.fetch_add(1);
        s_.Example(s_.violation_examples,
                   fmt::format("lookup_deleted_present: tier {}; {}", static_cast<int>(r->tiers[i]),
                               s_.checker.Describe(keys[i])));
      }
    }
  }

  void Delete() {
    const uint32_t key = PickKey();
    const WireBlockHash h = s_.checker.Hash(key);
    auto r = conn_->Delete(std::span<const WireBlockHash>(&h, 1));
    if (!r.ok() || r->size() != 1) {
      s_.checker.OnDeleteUnacked(key);
      Failed(r.ok() ? Status::Internal("DELETE answered the wrong number of items") : r.status(),
             "DELETE");
      return;
    }
    const Status& st = (*r)[0];
    if (st.ok() || st.Is(StatusCode::kNotFound)) {  // NotFound: evicted already, absent either way
      s_.checker.OnDeleteAcked(key);
      s_.c.deletes.fetch_add(1, std::memory_order_relaxed);
    } else {
      s_.checker.OnDeleteUnacked(key);
      s_.Error(fmt::format("client {}: DELETE item: {}", id_, st.ToString()));
    }
  }

  Shared& s_;
  const int id_;
  const uint32_t first_key_;
  std::mt19937_64 rng_;
  std::unique_ptr<Client> conn_;
  uint64_t conn_epoch_ = 0;
  uint64_t verified_epoch_ = 0;
  std::vector<std::byte> value_;
};

Status ValidateOptions(const DaemonStressOptions& o) {
  if (o.clients < 1 || o.clients > 1024)
    return Status::InvalidArgument("--clients must be 1..1024");
  if (o.keys_per_client < 1 || o.keys_per_client > 1000000) {
    return Status::InvalidArgument("--keys-per-client must be 1..1000000");
  }
  if (!(o.seconds > 0)) return Status::InvalidArgument("--seconds must be positive");
  if (o.min_value_bytes < 64)
    return Status::InvalidArgument(
        "--min-value-bytes must be at least 64 (the value header is 48)");
  if (o.max_value_bytes < o.min_value_bytes) {
    return Status::InvalidArgument("--max-value-bytes must be at least --min-value-bytes");
  }
  if (o.max_value_bytes > (32u << 20))
    return Status::InvalidArgument("--max-value-bytes must be at most 32 MiB");
  if (o.kill_cycles < 0 || o.kill_cycles > 10000)
    return Status::InvalidArgument("--kill-cycles must be 0..10000");
  if (o.kill_cycles > 0 && !o.spawn && o.restart_command.empty()) {
    return Status::InvalidArgument(
        "--kill-cycles needs --spawn or --restart-cmd (and usually --kill-cmd)");
  }
  if (o.spawn && (!o.kill_command.empty() || !o.restart_command.empty())) {
    return Status::InvalidArgument(
        "--kill-cmd and --restart-cmd are for an external daemon, not --spawn");
  }
  if (o.spawn) {
    if (!o.addr.empty() && o.addr != "tcp" && o.addr != "unix") {
      return Status::InvalidArgument("with --spawn, --addr is tcp or unix");
    }
    if (o.host_bytes < (4u << 20))
      return Status::InvalidArgument("--host-bytes must be at least 4 MiB");
    if (o.ssd_bytes < (16u << 20))
      return Status::InvalidArgument("--ssd-bytes must be at least 16 MiB");
    if (o.host_bytes < o.max_value_bytes + (64u << 10)) {
      return Status::InvalidArgument(
          "--host-bytes must hold the largest value (--max-value-bytes) with room to spare");
    }
  }
  return Status::OK();
}

// The "offload" section of a spawned daemon's config and of the in-process store.
nlohmann::json OffloadJson(const DaemonStressOptions& o) {
  // A data file that grows in steps of an eighth of the tier keeps preallocation modest.
  const uint64_t grow =
      std::clamp<uint64_t>((o.ssd_bytes / 8) & ~uint64_t{4095}, 4096, 64ull << 20);
  return {{"write_policy", std::string(WritePolicyName(o.write_policy))},
          {"host", {{"enabled", true}, {"capacity_bytes", o.host_bytes}}},
          {"ssd",
           {{"enabled", true},
            {"path", "ssd"},
            {"capacity_bytes", o.ssd_bytes},
            {"slab_grow_bytes", grow},
            {"durability", std::string(DurabilityName(o.durability))},
            {"read_arena_bytes", 64ull << 20}}}};
}

// The durable capacity the daemon reports: its tiers other than host memory.
uint64_t DurableCapacity(const ClientOptions& co) {
  auto c = Client::Connect(co);
  if (!c.ok()) return 0;
  auto text = (*c)->Stats();
  if (!text.ok()) return 0;
  const auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.contains("tiers") || !j["tiers"].is_array()) return 0;
  uint64_t bytes = 0;
  for (const auto& t : j["tiers"]) {
    const std::string name = t.value("name", "");
    if (name.find("host") == std::string::npos) bytes += t.value("capacity_bytes", uint64_t{0});
  }
  return bytes;
}

}  // namespace

Result<nlohmann::json> RunDaemonStress(const DaemonStressOptions& o) {
  SPARSEKV_RETURN_IF_ERROR(ValidateOptions(o));
  const uint64_t seed =
      o.seed != 0 ? o.seed : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  std::mt19937_64 rng(seed);

  // The daemon.
  std::unique_ptr<StressDaemon> daemon;
  std::filesystem::path dir;
  // Stops the daemon and removes the directory however the run ends.
  struct Cleanup {
    std::unique_ptr<StressDaemon>& daemon;
    std::filesystem::path& dir;
    bool keep;
    ~Cleanup() {
      if (daemon) daemon->Stop().IgnoreError();  // error paths only: a finished run stopped it
      std::error_code ec;
      if (!dir.empty() && !keep) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{daemon, dir, o.keep};
  std::string addr = o.addr.empty() ? (o.spawn ? "unix" : "127.0.0.1:7420") : o.addr;
  if (o.spawn) {
    std::filesystem::path base =
        o.dir.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(o.dir);
    std::error_code ec;
    std::filesystem::create_directories(base, ec);
    std::string tmpl = (base / "sparsekv-daemon-stress-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status::IOError(
          fmt::format("cannot make a directory under {}: {}", base.string(), std::strerror(errno)));
    }
    dir = tmpl;
    const std::string sock = (dir / "d.sock").string();
    if (o.kill_cycles == 0) {
      server::TieredStoreOptions so;
      SPARSEKV_ASSIGN_OR_RETURN(so.offload, ParseOffloadOptionsJson(OffloadJson(o).dump()));
      ResolveOffloadPaths(so.offload, dir.string());
      // One namespace: as sparsekvd does, lend GETs from a memfd host arena (server.h).
      so.offload.host.backing = ArenaBacking::kMemfd;
      server::ServerOptions opts;
      opts.tcp_listen = "127.0.0.1:0";
      opts.unix_path = sock;
      opts.metrics_listen = "";
      opts.namespaces = {{o.namespace_name, o.token}};
      auto d = std::make_unique<InProcessDaemon>(so, opts);
      SPARSEKV_RETURN_IF_ERROR(d->Start());
      addr = addr == "tcp" ? d->tcp_address() : "unix:" + sock;
      daemon = std::move(d);
    } else {
      std::string binary = o.daemon_binary;
      if (binary.empty()) {
        std::error_code e2;
        const auto self = std::filesystem::read_symlink("/proc/self/exe", e2);
        binary = (self.parent_path() / "sparsekvd").string();
      }
      if (::access(binary.c_str(), X_OK) != 0) {
        return Status::NotFound(fmt::format("no sparsekvd at '{}': pass --daemon-binary", binary));
      }
      std::string listen;
      if (addr == "tcp") {
        SPARSEKV_ASSIGN_OR_RETURN(const uint16_t port, FreeLoopbackPort());
        listen = fmt::format("127.0.0.1:{}", port);
      }
      const nlohmann::json config = {
          {"listen", listen},
          {"unix_socket", sock},
          {"metrics_listen", ""},
          {"data_dir", (dir / "var").string()},
          {"log_level", "info"},
          {"namespaces", {{{"name", o.namespace_name}, {"token", o.token}}}},
          {"offload", OffloadJson(o)}};
      const std::string config_path = (dir / "sparsekvd.json").string();
      std::ofstream(config_path) << config.dump(2);
      // Its log goes to stderr, which every incarnation appends to one file.
      daemon = std::make_unique<ChildDaemon>(binary, config_path, (dir / "sparsekvd.log").string());
      SPARSEKV_RETURN_IF_ERROR(daemon->Start());
      addr = addr == "tcp" ? listen : "unix:" + sock;
    }
  } else if (o.kill_cycles > 0) {
    daemon = std::make_unique<ExternalDaemon>(o.kill_command, o.restart_command);
  }

  Shared s(o, seed);
  s.client_options.address = addr;
  s.client_options.namespace_name = o.namespace_name;
  s.client_options.token = o.token;
  s.client_options.shared_memory = o.shared_memory;
  s.client_options.timeout = std::chrono::milliseconds(20000);
  s.client_options.client_name = "stress-probe";  // the clients name themselves stress-<i>
  if (Status up = WaitUntilAnswering(s.client_options, o.restart_timeout_seconds, daemon.get());
      !up.ok()) {
    const std::string tail = daemon ? daemon->LogTail() : "";
    return tail.empty() ? up
                        : Status(up.code(),
                                 fmt::format("{}; the daemon's log ends:\n{}", up.message(), tail));
  }
  const uint64_t durable_capacity = DurableCapacity(s.client_options);
  std::string transport = addr.rfind("unix:", 0) == 0 ? "unix_socket" : "tcp";
  if (auto probe = Client::Connect(s.client_options); probe.ok() && (*probe)->shared_memory()) {
    transport = "shared_memory";
  }

  std::vector<std::unique_ptr<StressClient>> clients;
  std::vector<std::thread> threads;
  for (int i = 0; i < o.clients; ++i) {
    clients.push_back(std::make_unique<StressClient>(s, i, seed));
  }
  for (int i = 0; i < o.clients; ++i) threads.emplace_back([&, i] { clients[i]->Run(); });
  while (s.ready.load() < o.clients) SleepSeconds(0.001);

  // The coordinator: load for `seconds`, with the kills spread over it at random.
  Status fatal;
  nlohmann::json cycles = nlohmann::json::array();
  const double t0 = NowSeconds();
  s.go.store(true);
  auto load_for = [&](double seconds) {
    const double end = NowSeconds() + seconds;
    while (NowSeconds() < end && fatal.ok()) {
      if (daemon) {
        Status alive = daemon->Alive();
        if (!alive.ok()) fatal = alive;
      }
      SleepSeconds(std::min(0.05, std::max(0.0, end - NowSeconds())));
    }
  };
  // Kill i falls at a random moment of the i-th of kill_cycles equal spans of load time (the
  // time the daemon is down does not count).
  const double span = o.seconds / std::max(1, o.kill_cycles);
  double loaded = 0;
  for (int i = 1; i <= o.kill_cycles && fatal.ok(); ++i) {
    const double at = span * (i - 1 + std::uniform_real_distribution<double>(0.25, 0.75)(rng));
    load_for(at - loaded);
    loaded = at;
    if (!fatal.ok()) break;
    const uint64_t live = s.checker.live_bytes();
    const bool counted = durable_capacity > 0 && live * 2 <= durable_capacity;
    s.cycle_counted[i].store(counted);
    cycles.push_back({{"live_bytes", live}, {"lost_counted", counted}});
    s.kill_in_progress.store(true);
    s.epoch.store(static_cast<uint64_t>(i));
    Status st = daemon->Kill();
    if (st.ok()) st = daemon->Start();
    if (st.ok()) st = WaitUntilAnswering(s.client_options, o.restart_timeout_seconds, daemon.get());
    if (!st.ok()) fatal = st.WithContext(fmt::format("restart {}", i));
    s.kill_in_progress.store(false);
  }
  if (fatal.ok()) load_for(o.seconds - loaded);
  s.stop.store(true);
  for (auto& t : threads) t.join();
  const double elapsed = NowSeconds() - t0;

  nlohmann::json j;
  if (!fatal.ok()) {  // the daemon died on its own or did not come back: the run failed
    s.Error(fatal.ToString());
    if (daemon) j["daemon_log_tail"] = daemon->LogTail();
  }
  if (daemon) {
    const Status stopped = daemon->Stop();
    if (!stopped.ok()) s.Error(fmt::format("stopping the daemon: {}", stopped.ToString()));
    daemon.reset();
  }

  std::vector<float> put_us, get_us;
  for (auto& c : clients) {
    put_us.insert(put_us.end(), c->put_us.begin(), c->put_us.end());
    get_us.insert(get_us.end(), c->get_us.begin(), c->get_us.end());
  }
  const Counters& c = s.c;
  const double lo = static_cast<double>(o.min_value_bytes),
               hi = static_cast<double>(o.max_value_bytes);
  const double mean_value = hi > lo ? (hi - lo) / std::log(hi / lo) : lo;
  j["acknowledged"] = c.acknowledged.load();
  j["puts"] = c.puts.load();
  j["gets"] = c.gets.load();
  j["hits"] = c.hits.load();
  j["misses"] = c.misses.load();
  j["absent_expected"] = c.absent_expected.load();
  j["lookups"] = c.lookups.load();
  j["lookup_deleted_present"] = c.lookup_deleted_present.load();
  j["lookup_tiers"] = {{"host", c.lookup_host.load()},
                       {"ssd", c.lookup_ssd.load()},
                       {"rocksdb", c.lookup_rocksdb.load()},
                       {"remote", c.lookup_remote.load()},
                       {"absent", c.lookup_absent.load()}};
  j["deletes"] = c.deletes.load();
  j["stale_returned"] = c.stale.load();
  j["deleted_returned"] = c.deleted_returned.load();
  j["corrupt_returned"] = c.corrupt.load();
  j["corrupt_detected"] = c.corrupt_detected.load();
  j["refused"] = c.refused.load();
  j["errors"] = c.errors.load();
  j["reconnects"] = c.reconnects.load();
  j["verified"] = c.verified.load();
  j["lost"] = c.lost.load();
  j["lost_not_counted"] = c.lost_not_counted.load();
  {
    std::lock_guard<std::mutex> l(s.mu);
    j["refused_examples"] = s.refused_examples;
    j["error_examples"] = s.error_examples;
    j["violation_examples"] = s.violation_examples;
  }
  j["cycles"] = cycles;
  j["working_set_bytes"] = static_cast<uint64_t>(mean_value * o.clients * o.keys_per_client);
  j["durable_capacity_bytes"] = durable_capacity;
  j["ops"] = c.ops.load();
  j["ops_per_s"] = static_cast<double>(c.ops.load()) / elapsed;
  j["put_p50_us"] = QuantileInPlace(put_us, 0.50);
  j["put_p99_us"] = QuantileInPlace(put_us, 0.99);
  j["put_p999_us"] = QuantileInPlace(put_us, 0.999);
  j["get_p50_us"] = QuantileInPlace(get_us, 0.50);
  j["get_p99_us"] = QuantileInPlace(get_us, 0.99);
  j["get_p999_us"] = QuantileInPlace(get_us, 0.999);
  j["seconds"] = elapsed;
  j["clients"] = o.clients;
  j["keys_per_client"] = o.keys_per_client;
  j["min_value_bytes"] = o.min_value_bytes;
  j["max_value_bytes"] = o.max_value_bytes;
  j["kill_cycles"] = o.kill_cycles;
  j["durable_policy"] = o.expect_durable;
  if (o.spawn) {
    j["write_policy"] = std::string(WritePolicyName(o.write_policy));
    j["durability"] = std::string(DurabilityName(o.durability));
    j["host_bytes"] = o.host_bytes;
    j["ssd_bytes"] = o.ssd_bytes;
    j["daemon"] = o.kill_cycles > 0 ? "sparsekvd child" : "in-process";
    if (o.keep) j["dir"] = dir.string();
  }
  j["addr"] = addr;
  j["transport"] = transport;
  j["seed"] = seed;
  j["errors"] = c.errors.load();  // again: stopping the daemon may have added one
  j["ok"] = c.stale.load() == 0 && c.deleted_returned.load() == 0 && c.corrupt.load() == 0 &&
            c.lookup_deleted_present.load() == 0 && c.refused.load() == 0 && c.errors.load() == 0 &&
            (!o.expect_durable || c.lost.load() == 0);
  return j;
}

}  // namespace sparsekv::bench
