// Server::Impl: the state of one server, shared by server.cc (binding, the run loop, /metrics,
// the end of a shutdown) and native_session.cc (the native protocol's connections, their
// admission and draining). Private to api/server.
#pragma once

#include <fcntl.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>
#include <boost/asio.hpp>

#include "server/resp_session.h"
#include "server/server.h"
#include "server/transport.h"
#include "sparsekv/request_log.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv::server {

namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
using Clock = std::chrono::steady_clock;

// Every memfd a client can reach is sealed against size changes: a client that shrank one the
// daemon maps would make the daemon's next access to the lost pages die of SIGBUS, taking every
// other client's cache with it. F_SEAL_SEAL last, so that the seals the daemon checked are the
// ones the memfd keeps: no client can add others afterwards.
inline constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// Adds the seals of `required` that memfd `fd` lacks, then F_SEAL_SEAL, and checks the outcome.
// Idempotent: a memfd sealed before passes as it is.
Status SealMemfd(int fd, int required, std::string_view what);

class Session;

class Server::Impl {
 public:
  Impl(ServerOptions options, DaemonStore* store)
      : options_(std::move(options)),
        store_(store),
        work_(asio::make_work_guard(io_)),
        workers_(static_cast<size_t>(std::max(1, options_.worker_threads))),
        signals_(io_),
        control_(asio::make_strand(io_)),
        budget_(options_.max_buffered_bytes) {
    budget_.wake_ = [this] { WakeParked(); };
    namespace_conns_.assign(options_.namespaces.size() + 1, 0);
    const uint32_t shortest = std::min({options_.handshake_timeout_ms, options_.frame_timeout_ms,
                                        options_.write_timeout_ms, options_.idle_timeout_ms});
    tick_ = std::chrono::milliseconds(std::clamp<uint32_t>(shortest / 4, 10, 1000));
  }
  ~Impl() {
    if (arena_ro_fd_ >= 0) ::close(arena_ro_fd_);
    if (arena_rw_fd_ >= 0) ::close(arena_rw_fd_);
    if (table_ro_fd_ >= 0) ::close(table_ro_fd_);
  }

  Status Bind();
  void Run();
  void RunLoop();
  void Accept(asio::ip::tcp::acceptor& acceptor);
  void AcceptUnix();
  void AcceptMetrics();
  void Admit(GenericSocket socket, bool is_unix);
  // Called by a session whose HELLO checked out: counts it against the namespace's quota and
  // the server's limit, closing the longest-idle connection at either; an error refuses it.
  Status AdmitAuthenticated(Session* s, uint32_t ns);
  // The authenticated session (of namespace `ns`, or any with 0) idle the longest among those
  // that have made no call since HELLO, else among all; null if none is idle. Called with mu_
  // held.
  std::shared_ptr<Session> LongestIdle(uint32_t ns, const Session* except);
  // Forgets `victim` in the counts (mu_ held) and closes it with `why`.
  void Evict(const std::shared_ptr<Session>& victim, const Status& why);
  void Park(std::weak_ptr<Session> s, std::atomic<bool>& listed);
  // Runs `work` on a worker thread. Connections take turns: each worker takes the oldest
  // request of the next connection in a round, so a connection that pipelines many costly
  // requests delays another's by at most one of them per worker, not by its whole queue.
  template <typename Work>
  void SubmitWork(uint64_t session, Work&& work);
  void RunNextWork();
  void WakeParked();
  std::string ConnectionMetrics();
  void OnSignal(boost::system::error_code ec, int sig);
  void Shutdown();
  void OnSessionClosed(Session* s);
  void FinishIfDrained();
  Status Wait();

  // The request log of namespace `ns` (1-based), opened at the first call. Errors:
  // NotSupported without ServerOptions::request_log_dir, the log's own (Open).
  Result<RequestLog*> RequestLogFor(uint32_t ns);

  ServerOptions options_;
  DaemonStore* store_;
  Mutex logs_mu_;
  std::vector<std::unique_ptr<RequestLog>> logs_ SPARSEKV_GUARDED_BY(logs_mu_);  // by ns - 1
  Metrics metrics_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  asio::thread_pool workers_;
  asio::signal_set signals_;
  // Serializes the shutdown handlers (the drain deadline is touched by several of them).
  asio::strand<asio::io_context::executor_type> control_;
  std::unique_ptr<asio::ip::tcp::acceptor> tcp_;
  UnixListener unix_;
  std::unique_ptr<asio::ip::tcp::acceptor> metrics_acceptor_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> next_session_{1};
  std::string tcp_address_;
  uint16_t metrics_port_ = 0;
  DaemonStore::Arena arena_;  // the store's arena, when lent to clients
  int arena_ro_fd_ = -1;      // a read-only descriptor of it, passed at HELLO
  int arena_rw_fd_ = -1;      // a writable one, passed instead to sessions granted write leases
  DaemonStore::Arena table_;  // the host tier's lend table, when local reads are served
  int table_ro_fd_ = -1;      // a read-only descriptor of it, passed at HELLO after the arena's

  // Write leases: bytes each namespace (by id) holds leased, against its max_leased_bytes.
  std::mutex lease_mu_;
  std::vector<uint64_t> leased_bytes_;  // guarded by lease_mu_
  // Charges `bytes` of leases to namespace `ns`; false (nothing charged) past its quota.
  bool ChargeLease(uint32_t ns, uint64_t bytes) {
    const NamespaceConfig& c = options_.namespaces[ns - 1];
    const uint64_t quota = c.max_leased_bytes > 0 ? c.max_leased_bytes : arena_.bytes / 4;
    std::lock_guard<std::mutex> l(lease_mu_);
    if (leased_bytes_.size() <= ns) leased_bytes_.resize(ns + 1, 0);
    if (leased_bytes_[ns] + bytes > quota) return false;
    leased_bytes_[ns] += bytes;
    return true;
  }
  void ReleaseLease(uint32_t ns, uint64_t bytes) {
    std::lock_guard<std::mutex> l(lease_mu_);
    leased_bytes_[ns] -= bytes;
  }
  uint64_t LeasedBytes(uint32_t ns) {
    std::lock_guard<std::mutex> l(lease_mu_);
    return ns < leased_bytes_.size() ? leased_bytes_[ns] : 0;
  }
  // Host-tier pages that replies in flight and lent bundles hold pinned, and the most they may:
  // a quarter of the host tier, so that slow or idle clients cannot leave PUTs without pages.
  std::shared_ptr<std::atomic<uint64_t>> pinned_bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t pin_cap_ = 0;

  // True when `more` pinned bytes keep within the budget.
  bool PinsBelowCap(uint64_t more) const { return pinned_bytes_->load(std::memory_order_relaxed) + more <= pin_cap_; }
  // Counts `bytes` as pinned until the returned handle's last copy is gone.
  DaemonStore::Keep ChargePins(uint64_t bytes) {
    pinned_bytes_->fetch_add(bytes, std::memory_order_relaxed);
    return DaemonStore::Keep(nullptr, [counter = pinned_bytes_, bytes](const void*) {
      counter->fetch_sub(bytes, std::memory_order_relaxed);
    });
  }

  BufferBudget budget_;
  LogLimiter bad_frame_log_;
  std::chrono::milliseconds tick_{1000};  // how often a session checks its deadlines
  std::mutex park_mu_;
  std::vector<std::pair<std::weak_ptr<Session>, std::atomic<bool>*>> parked_;  // waiting for budget
  std::atomic<uint64_t> staging_total_{0};  // bytes of every session's staging area
  std::atomic<uint64_t> grown_rbuf_total_{0};  // bytes of every session's grown receive buffer
  // Store calls started on a network thread that answer later, from a tier's thread: the
  // shutdown waits for them after the workers (their answers use the sessions and metrics).
  std::mutex async_mu_;
  std::condition_variable async_cv_;
  uint64_t async_calls_ = 0;  // guarded by async_mu_
  void BeginAsyncCall() {
    std::lock_guard<std::mutex> l(async_mu_);
    ++async_calls_;
  }
  void EndAsyncCall() {
    std::lock_guard<std::mutex> l(async_mu_);
    if (--async_calls_ == 0) async_cv_.notify_all();
  }
  std::mutex work_mu_;
  std::unordered_map<uint64_t, std::deque<std::function<void()>>> work_queues_;  // per session, in order
  std::deque<uint64_t> work_turns_;  // sessions with work waiting, in turn order

  std::mutex mu_;
  std::set<std::shared_ptr<Session>> sessions_;
  // Counted under mu_: connections before HELLO, after it (in all and per namespace id).
  uint32_t handshaking_ = 0, authenticated_ = 0;
  std::vector<uint32_t> namespace_conns_;
  bool draining_ = false;
  bool stopped_ = false;
  Status flush_status_;
  std::condition_variable stopped_cv_;
  std::unique_ptr<asio::steady_timer> drain_deadline_;
  uint32_t resp_conns_ = 0;  // RESP connections holding a slot of max_connections (mu_)
  // The RESP front end (resp_session.h); declared last, so destroyed before what it borrows.
  std::unique_ptr<RespFrontEnd> resp_;
  Status BindResp();
};

template <typename Work>
void Server::Impl::SubmitWork(uint64_t session, Work&& work) {
  // std::function needs a copyable callable; the work owns move-only buffers.
  auto shared = std::make_shared<std::decay_t<Work>>(std::forward<Work>(work));
  {
    std::lock_guard<std::mutex> l(work_mu_);
    auto& queue = work_queues_[session];
    if (queue.empty()) work_turns_.push_back(session);
    queue.emplace_back([shared] { (*shared)(); });
  }
  asio::post(workers_, [this] { RunNextWork(); });
}

}  // namespace sparsekv::server
