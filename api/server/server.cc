#include "server/server.h"

#include "server/server_impl.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

namespace sparsekv::server {
namespace {

std::string SealNames(int seals) {
  static constexpr std::pair<int, const char*> kNames[] = {{F_SEAL_SEAL, "F_SEAL_SEAL"},
                                                           {F_SEAL_SHRINK, "F_SEAL_SHRINK"},
                                                           {F_SEAL_GROW, "F_SEAL_GROW"},
                                                           {F_SEAL_WRITE, "F_SEAL_WRITE"},
                                                           {F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"}};
  std::string out;
  for (const auto& [bit, name] : kNames) {
    if ((seals & bit) == 0) continue;
    if (!out.empty()) out += '|';
    out += name;
  }
  return out.empty() ? "none" : out;
}

// OK when memfd `fd` carries every seal of `required`, as F_GET_SEALS reports them now.
Status CheckSeals(int fd, int required, std::string_view what) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return Status::FailedPrecondition(fmt::format("{} is not a sealable memfd (F_GET_SEALS: {}); shared memory "
                                                  "needs a memfd created with MFD_ALLOW_SEALING",
                                                  what, std::strerror(errno)));
  }
  if ((seals & required) != required) {
    return Status::FailedPrecondition(fmt::format("{} is sealed with {}; shared memory needs at least {}", what,
                                                  SealNames(seals), SealNames(required)));
  }
  return Status::OK();
}

}  // namespace

// Adds the seals of `required` that memfd `fd` lacks, then F_SEAL_SEAL, and checks the outcome.
// Idempotent: a memfd sealed before (the store's arena, when a server starts again on the same
// store) passes as it is.
Status SealMemfd(int fd, int required, std::string_view what) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && (seals & F_SEAL_SEAL) == 0) {
    const int add = (required & ~seals) | F_SEAL_SEAL;
    if (::fcntl(fd, F_ADD_SEALS, add) != 0) {
      return Status::FailedPrecondition(
          fmt::format("cannot seal {} (F_ADD_SEALS {:#x}: {})", what, add, std::strerror(errno)));
    }
  }
  return CheckSeals(fd, required | F_SEAL_SEAL, what);
}

Status Server::Impl::Bind() {
  boost::system::error_code ec;
  pin_cap_ = store_->SharedArena().bytes / 4;
  if (options_.lend_from_arena && options_.namespaces.size() == 1) {
    const DaemonStore::Arena a = store_->SharedArena();
    if (a.fd >= 0) {
      // Clients get a read-only description of their own. Since anyone holding a memfd can
      // reopen it through /proc read-write, the memfd is also sealed against every write that
      // does not go through a mapping made before (the store's own): no client can write it,
      // nor shrink it under the store's mapping (kSizeSeals).
      // With write leases, clients write their values into it in place: it is sealed against
      // resizing only, and a writable description is passed to the sessions that ask.
      const int seals = options_.write_leases ? kSizeSeals : F_SEAL_FUTURE_WRITE | kSizeSeals;
      if (Status st = SealMemfd(a.fd, seals, "the host arena"); !st.ok()) {
        spdlog::warn("{}; shared-memory GETs will copy", st.message());
      } else {
        arena_ro_fd_ = ::open(fmt::format("/proc/self/fd/{}", a.fd).c_str(), O_RDONLY | O_CLOEXEC);
        if (arena_ro_fd_ >= 0) {
          arena_ = a;
        } else {
          spdlog::warn("cannot reopen the host arena read-only ({}); shared-memory GETs will copy",
                       std::strerror(errno));
        }
        // A memfd sealed against writes before (by an earlier server on the same store) cannot
        // take leases: PUTs go through the staging area then.
        const int now = ::fcntl(a.fd, F_GET_SEALS);
        if (arena_ro_fd_ >= 0 && options_.write_leases && now >= 0 && (now & (F_SEAL_FUTURE_WRITE | F_SEAL_WRITE)) == 0) {
          arena_rw_fd_ = ::open(fmt::format("/proc/self/fd/{}", a.fd).c_str(), O_RDWR | O_CLOEXEC);
        }
        // Local reads: the lend table, which only the store writes (through its own mapping),
        // sealed against every other write and against resizing as the arena is.
        const DaemonStore::Arena t = store_->LendTable();
        if (arena_ro_fd_ >= 0 && options_.local_reads && t.fd >= 0) {
          if (Status ts = SealMemfd(t.fd, F_SEAL_FUTURE_WRITE | kSizeSeals, "the lend table"); !ts.ok()) {
            spdlog::warn("{}; no local reads", ts.message());
          } else {
            table_ro_fd_ = ::open(fmt::format("/proc/self/fd/{}", t.fd).c_str(), O_RDONLY | O_CLOEXEC);
            if (table_ro_fd_ >= 0) table_ = t;
          }
        }
      }
    }
  }
  if (!options_.tcp_listen.empty()) {
    SPARSEKV_ASSIGN_OR_RETURN(tcp_, ListenTcp(io_, options_.tcp_listen, "listening on"));
    tcp_address_ = BoundAddress(*tcp_);
  }
  if (!options_.unix_path.empty()) SPARSEKV_RETURN_IF_ERROR(unix_.Listen(io_, options_.unix_path, "listening on"));
  SPARSEKV_RETURN_IF_ERROR(BindResp());
  if (!options_.metrics_listen.empty()) {
    SPARSEKV_ASSIGN_OR_RETURN(metrics_acceptor_,
                              ListenTcp(io_, options_.metrics_listen, "listening for metrics on", 64));
    metrics_port_ = metrics_acceptor_->local_endpoint().port();
  }
  return Status::OK();
}

Status Server::Impl::BindResp() {
  if (options_.resp_listen.empty() && options_.resp_unix_path.empty()) return Status::OK();
  RespHost h;
  h.io = &io_;
  h.store = store_;
  h.options = &options_;
  h.budget = &budget_;
  h.metrics = &metrics_;
  h.submit = [this](uint64_t id, std::function<void()> work) { SubmitWork(id, std::move(work)); };
  h.take_slot = [this] {
    std::lock_guard<std::mutex> l(mu_);
    if (authenticated_ + resp_conns_ >= options_.max_connections) return false;
    ++resp_conns_;
    return true;
  };
  h.give_slot = [this] {
    std::lock_guard<std::mutex> l(mu_);
    --resp_conns_;
  };
  h.take_namespace = [this](uint32_t ns) {
    std::lock_guard<std::mutex> l(mu_);
    const NamespaceConfig& nc = options_.namespaces[ns - 1];
    if (nc.max_connections > 0 && namespace_conns_[ns] >= nc.max_connections) return false;
    ++namespace_conns_[ns];
    return true;
  };
  h.give_namespace = [this](uint32_t ns) {
    std::lock_guard<std::mutex> l(mu_);
    --namespace_conns_[ns];
  };
  h.pins_below_cap = [this](uint64_t n) { return PinsBelowCap(n); };
  h.charge_pins = [this](uint64_t n) { return ChargePins(n); };
  h.begin_async = [this] { BeginAsyncCall(); };
  h.end_async = [this] { EndAsyncCall(); };
  h.on_drained = [this] {
    std::lock_guard<std::mutex> l(mu_);
    FinishIfDrained();
  };
  h.next_id = [this] { return next_session_.fetch_add(1); };
  SPARSEKV_ASSIGN_OR_RETURN(resp_, RespFrontEnd::Bind(std::move(h), options_.resp_listen, options_.resp_unix_path));
  return Status::OK();
}

void Server::Impl::Run() {
  if (resp_) resp_->Start();
  if (tcp_) Accept(*tcp_);
  if (unix_.acceptor()) AcceptUnix();
  if (metrics_acceptor_) AcceptMetrics();
  if (options_.handle_signals) {
    signals_.add(SIGINT);
    signals_.add(SIGTERM);
    signals_.add(SIGHUP);
    signals_.async_wait([this](boost::system::error_code e, int s) { OnSignal(e, s); });
  }
  const int n = std::max(1, options_.io_threads);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { RunLoop(); });
}

// The network loop. With busy_poll_us, a thread that runs out of work keeps polling (a
// non-blocking epoll each time) for that long before it sleeps: a request arriving meanwhile
// is served without the wakeup of a sleeping thread, which on a small VM costs more than
// serving it.
void Server::Impl::RunLoop() {
  if (options_.busy_poll_us == 0) {
    io_.run();
    return;
  }
  const auto spin = std::chrono::microseconds(options_.busy_poll_us);
  while (!io_.stopped()) {
    if (io_.poll() > 0) continue;
    const auto until = Clock::now() + spin;
    bool ran = false;
    while (!ran && Clock::now() < until && !io_.stopped()) ran = io_.poll() > 0;
    if (!ran) io_.run_one();
  }
}

void Server::Impl::OnSignal(boost::system::error_code ec, int sig) {
  if (ec) return;
  if (sig == SIGHUP) {
    spdlog::info("SIGHUP: reopening logs");
    if (options_.on_sighup) options_.on_sighup();
    signals_.async_wait([this](boost::system::error_code e, int s) { OnSignal(e, s); });
    return;
  }
  spdlog::info("signal {}: draining in-flight requests, then flushing", sig);
  Shutdown();
}







// One call per SubmitWork: runs the oldest request of the connection whose turn it is.
void Server::Impl::RunNextWork() {
  std::function<void()> work;
  {
    std::lock_guard<std::mutex> l(work_mu_);
    if (work_turns_.empty()) return;
    const uint64_t session = work_turns_.front();
    work_turns_.pop_front();
    auto it = work_queues_.find(session);
    work = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) {
      work_queues_.erase(it);
    } else {
      work_turns_.push_back(session);
    }
  }
  work();
}



std::string Server::Impl::ConnectionMetrics() {
  uint32_t handshaking, authenticated;
  {
    std::lock_guard<std::mutex> l(mu_);
    handshaking = handshaking_;
    authenticated = authenticated_;
  }
  std::string out;
  auto gauge = [&](const char* name, const char* help, uint64_t v) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n{0} {2}\n", name, help, v);
  };
  gauge("sparsekv_buffered_bytes", "Request bytes received and not yet served, plus reply bytes not yet sent.",
        budget_.used());
  gauge("sparsekv_buffered_bytes_limit", "The daemon-wide budget for them (max_buffered_bytes).", budget_.limit());
  gauge("sparsekv_parked_connections", "Connections waiting for room in that budget.",
        static_cast<uint64_t>(std::max(0, budget_.waiters_.load())));
  out += fmt::format(
      "# HELP sparsekv_budget_passes_total Frames read past that budget, one at a time, to finish (BufferBudget::TakePass).\n"
      "# TYPE sparsekv_budget_passes_total counter\nsparsekv_budget_passes_total {}\n",
      budget_.passes());
  gauge("sparsekv_handshaking_connections", "Connections that have not finished HELLO.", handshaking);
  gauge("sparsekv_authenticated_connections", "Connections after HELLO.", authenticated);
  gauge("sparsekv_connections_limit", "max_connections.", options_.max_connections);
  gauge("sparsekv_receive_buffer_bytes",
        "Bytes of connections' receive buffers grown to take whole PUTs (given back after a quiet tick).",
        grown_rbuf_total_.load(std::memory_order_relaxed));
  gauge("sparsekv_shared_staging_bytes", "Bytes of every session's shared-memory staging area.",
        staging_total_.load(std::memory_order_relaxed));
  return out;
}

void Server::Impl::AcceptMetrics() {
  metrics_acceptor_->async_accept([this](boost::system::error_code ec, asio::ip::tcp::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted) AcceptMetrics();
      return;
    }
    auto sock = std::make_shared<asio::ip::tcp::socket>(std::move(s));
    auto buf = std::make_shared<asio::streambuf>(8192);
    asio::async_read_until(*sock, *buf, "\r\n\r\n", [this, sock, buf](boost::system::error_code e, size_t) {
      std::string body, status = "200 OK";
      if (e) return;
      std::istream in(buf.get());
      std::string method, path;
      in >> method >> path;
      if (method == "GET" && (path == "/metrics" || path.rfind("/metrics?", 0) == 0)) {
        body = metrics_.Render([this](std::string& out) {
          store_->RenderMetrics(out);
          out += fmt::format(
              "# HELP sparsekv_pinned_reply_bytes Host-tier bytes pinned by replies in flight and lent bundles.\n"
              "# TYPE sparsekv_pinned_reply_bytes gauge\nsparsekv_pinned_reply_bytes {}\n"
              "# HELP sparsekv_pinned_reply_bytes_limit The most they may pin before GETs copy.\n"
              "# TYPE sparsekv_pinned_reply_bytes_limit gauge\nsparsekv_pinned_reply_bytes_limit {}\n",
              pinned_bytes_->load(), pin_cap_);
          out += ConnectionMetrics();
          if (resp_) resp_->RenderMetrics(out);
          if (options_.render_metrics) options_.render_metrics(out);
        });
      } else {
        status = "404 Not Found";
        body = "not found; try /metrics\n";
      }
      auto reply = std::make_shared<std::string>(fmt::format(
          "HTTP/1.1 {}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
          status, body.size(), body));
      asio::async_write(*sock, asio::buffer(*reply), [sock, reply](boost::system::error_code, size_t) {
        boost::system::error_code ignored;
        sock->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
      });
    });
    AcceptMetrics();
  });
}



// Called with mu_ held.
void Server::Impl::FinishIfDrained() {
  if (!draining_ || stopped_ || !sessions_.empty()) return;
  if (resp_ && !resp_->Drained()) return;
  stopped_ = true;
  asio::post(control_, [this] {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (drain_deadline_) drain_deadline_->cancel();
    }
    workers_.join();  // every store call has returned
    {
      std::unique_lock<std::mutex> l(async_mu_);
      async_cv_.wait(l, [this] { return async_calls_ == 0; });  // and answered
    }
    Status st = store_->Flush();
    if (!st.ok()) spdlog::error("flushing the store: {}", st.ToString());
    work_.reset();
    io_.stop();
    std::lock_guard<std::mutex> l(mu_);
    flush_status_ = st;
    stopped_cv_.notify_all();
  });
}

Status Server::Impl::Wait() {
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::lock_guard<std::mutex> l(mu_);
  return flush_status_;
}

Result<std::unique_ptr<Server>> Server::Start(ServerOptions options, DaemonStore* store) {
  if (store == nullptr) return Status::InvalidArgument("server needs a store");
  if (options.namespaces.empty()) return Status::InvalidArgument("server needs at least one namespace");
  if (options.staging_bytes < 2 * 4096) return Status::InvalidArgument("staging_bytes must be at least 8 KiB");
  auto impl = std::make_unique<Impl>(std::move(options), store);
  SPARSEKV_RETURN_IF_ERROR(impl->Bind());
  impl->Run();
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  Shutdown();
  Wait().IgnoreError();
}

void Server::Shutdown() { impl_->Shutdown(); }
Status Server::Wait() { return impl_->Wait(); }
Metrics& Server::metrics() { return impl_->metrics_; }

std::string Server::tcp_address() const { return impl_->tcp_address_; }
std::string Server::resp_address() const { return impl_->resp_ ? impl_->resp_->tcp_address() : std::string(); }
uint16_t Server::metrics_port() const { return impl_->metrics_port_; }

Result<RequestLog*> Server::Impl::RequestLogFor(uint32_t ns) {
  if (options_.request_log_dir.empty()) {
    return Status::NotSupported("this daemon keeps no request log (request_log_dir is not set)");
  }
  if (ns == 0 || ns > options_.namespaces.size()) return Status::Internal("request log of no namespace");
  MutexLock l(logs_mu_);
  if (logs_.size() < options_.namespaces.size()) logs_.resize(options_.namespaces.size());
  std::unique_ptr<RequestLog>& log = logs_[ns - 1];
  if (!log) {
    // One directory per namespace, named by its name in hex: no name reaches another's log.
    std::string dir;
    for (unsigned char c : options_.namespaces[ns - 1].name) dir += fmt::format("{:02x}", c);
    RequestLogOptions o;
    o.path = (std::filesystem::path(options_.request_log_dir) / (dir.empty() ? "-" : dir)).string();
    o.durability = options_.request_log_durability;
    SPARSEKV_ASSIGN_OR_RETURN(log, RequestLog::Open(o));
  }
  return log.get();
}

}  // namespace sparsekv::server
