// Transport pieces both of sparsekvd's protocols share (server.cc speaks api/PROTOCOL.md,
// resp_session.cc speaks RESP): listen addresses, the Unix socket path's claim, the daemon-wide
// budget of buffered bytes and each connection's account in it, token comparison, rate-limited
// logging. Nothing here knows a protocol.
#pragma once

#include <atomic>
#include <utility>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <utility>

#include "server/server.h"
#include "sparsekv/status.h"

namespace sparsekv::server {

using TransportClock = std::chrono::steady_clock;

// A completion condition for asio::async_write that hands the socket everything gathered in one
// call: asio's own transfer_all sends at most 64 KiB per call, so a reply of 64 KiB and a header
// would take two sendmsg calls and wake the peer twice.
struct SendWhole {
  size_t operator()(const boost::system::error_code& ec, size_t) const { return ec ? 0 : (size_t{1} << 30); }
};

// "HOST:PORT" (IPv4, [IPv6] or localhost) as an endpoint; errors name the address.
Result<boost::asio::ip::tcp::endpoint> ParseTcp(const std::string& address);

// A TCP acceptor listening on `address` (HOST:PORT; port 0: the kernel picks), SO_REUSEADDR set.
// An error reads "<what> <address>: <reason>".
Result<std::unique_ptr<boost::asio::ip::tcp::acceptor>> ListenTcp(
    boost::asio::io_context& io, const std::string& address, std::string_view what,
    int backlog = boost::asio::socket_base::max_listen_connections);
// "IP:PORT" an acceptor is bound to.
std::string BoundAddress(const boost::asio::ip::tcp::acceptor& acceptor);

// A listening Unix socket. One daemon per socket path: a live socket there refuses the listen
// (ClaimUnixPath). The probe, the removal of a stale file and the bind run under the directory's
// lock, and the socket listens before the lock is released, so a daemon starting at the same
// moment finds it alive. The socket file is removed (Release, or destruction) only while the path
// still names the socket bound here: another daemon's socket there is never ours to remove.
// Not thread-safe.
class UnixListener {
 public:
  UnixListener() = default;
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  ~UnixListener() { Release(); }

  // An error reads "<what> unix:<path>: <reason>".
  Status Listen(boost::asio::io_context& io, const std::string& path, std::string_view what);
  // Removes the socket file if the path still names it (else logs and leaves it). Call while
  // still listening: until then no other daemon takes the file for stale. Idempotent.
  void Release();
  // Null until Listen succeeded.
  boost::asio::local::stream_protocol::acceptor* acceptor() const { return acceptor_.get(); }

 private:
  std::unique_ptr<boost::asio::local::stream_protocol::acceptor> acceptor_;
  std::string path_;
  std::optional<std::pair<dev_t, ino_t>> bound_;
};

// Claims `path` for a listening Unix socket. Nothing there, or a stale socket file (nobody
// accepts on it: ECONNREFUSED) is fine, and the stale file is removed; a socket a process still
// accepts on is never removed, since that would cut its clients off for good. The probe connects
// without blocking, so a listener whose backlog is full (EAGAIN) counts as alive too.
Status ClaimUnixPath(const std::string& path);

// Constant-time comparison, so a token cannot be guessed byte by byte from reply timing.
bool TokenEquals(const std::string& a, const std::string& b);

// Holds an flock on a directory for one scope. Two daemons that start at once on the same
// socket path both see a stale file; without this, the later one's unlink could remove the
// socket the other has just bound. The wait is bounded: a directory someone else keeps locked
// costs the protection against that race, not the start.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& dir);
  ~DirectoryLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// The daemon-wide budget of buffered bytes (ServerOptions::max_buffered_bytes): request payloads
// received and not yet served, replies built and not yet sent. Taking from it never blocks and
// never fails; a connection asks Allows() before it reads more, and stops reading (parks) when
// told no. `wake` runs when bytes come back while connections are parked.
class BufferBudget {
 public:
  explicit BufferBudget(uint64_t limit) : limit_(limit) {}
  // True when a connection that holds `held` bytes may take `more`: within its allowance, or
  // while the daemon has room.
  bool Allows(uint64_t held, uint64_t more) const {
    return held + more <= kConnectionAllowance || used_.load(std::memory_order_relaxed) + more <= limit_;
  }
  void Take(uint64_t n) { used_.fetch_add(n, std::memory_order_relaxed); }
  // Parked connections are woken once there is room for a read of kWakeRoom: waking them for
  // less would only have them park again, at every reply written.
  static constexpr uint64_t kWakeRoom = 256u << 10;
  void Give(uint64_t n) {
    const uint64_t after = used_.fetch_sub(n, std::memory_order_acq_rel) - n;
    if (waiters_.load(std::memory_order_acquire) > 0 && after + kWakeRoom <= limit_ && wake_) wake_();
  }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }

  // The pass: one connection at a time may read past the limit to finish the frame (or RESP
  // request) it has started. Without it, connections held back in the middle of large frames
  // could all wait on each other, each holding part of the budget, until their frame deadlines
  // cut them off; with it, the holder's frame always completes, its bytes go back when it is
  // served, and the next one takes the pass. So the time a connection waits on the budget is
  // the daemon's, not the client's, and does not count against its frame deadline, while a
  // client that stops sending (holding the pass or not) still meets it. The bytes past the limit
  // are at most one frame's. `who` is the connection (any pointer unique to it).
  // True when `who` holds the pass, now or already.
  bool TakePass(const void* who) {
    const void* held = nullptr;
    if (pass_.compare_exchange_strong(held, who, std::memory_order_acq_rel)) {
      passes_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    return held == who;
  }
  bool HoldsPass(const void* who) const { return pass_.load(std::memory_order_acquire) == who; }
  // Gives the pass back if `who` holds it (its frame is whole, or it closed), and wakes the parked.
  void ReturnPass(const void* who) {
    // Called at the end of every frame and RESP request: a plain load answers the usual case
    // (not the holder) without a read-modify-write on the shared word.
    if (pass_.load(std::memory_order_acquire) != who) return;
    const void* held = who;
    if (pass_.compare_exchange_strong(held, nullptr, std::memory_order_acq_rel) &&
        waiters_.load(std::memory_order_acquire) > 0 && wake_)
      wake_();
  }
  // Passes taken since start (sparsekv_budget_passes_total).
  uint64_t passes() const { return passes_.load(std::memory_order_relaxed); }

  std::atomic<int> waiters_{0};  // connections parked on the budget (set by the server)
  std::function<void()> wake_;   // set before any connection runs

 private:
  std::atomic<uint64_t> used_{0};
  std::atomic<const void*> pass_{nullptr};
  std::atomic<uint64_t> passes_{0};
  const uint64_t limit_;
};

// What one connection holds of the budget. `wake` (set when the connection starts) resumes it
// when it is parked and its own holding falls back within its allowance.
struct Account {
  std::atomic<uint64_t> held{0};
  std::atomic<bool> parked{false};
  std::function<void()> wake;
};

// Bytes charged to the budget and to a connection's account until this is destroyed (or
// released). Move-only.
class Charge {
 public:
  Charge() = default;
  Charge(BufferBudget* budget, std::shared_ptr<Account> account) : budget_(budget), account_(std::move(account)) {}
  Charge(Charge&& o) noexcept
      : budget_(std::exchange(o.budget_, nullptr)), account_(std::move(o.account_)), bytes_(std::exchange(o.bytes_, 0)) {}
  Charge& operator=(Charge&& o) noexcept {
    if (this != &o) {
      Release();
      budget_ = std::exchange(o.budget_, nullptr);
      account_ = std::move(o.account_);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;
  ~Charge() { Release(); }

  void Add(uint64_t n) {
    if (budget_ == nullptr || n == 0) return;
    bytes_ += n;
    account_->held.fetch_add(n, std::memory_order_relaxed);
    budget_->Take(n);
  }
  void Release() {
    if (budget_ == nullptr || bytes_ == 0) return;
    const uint64_t n = std::exchange(bytes_, 0);
    const uint64_t held = account_->held.fetch_sub(n, std::memory_order_acq_rel) - n;
    budget_->Give(n);
    if (held <= kConnectionAllowance && account_->parked.load(std::memory_order_acquire) && account_->wake) {
      account_->wake();
    }
  }
  uint64_t bytes() const { return bytes_; }

 private:
  BufferBudget* budget_ = nullptr;
  std::shared_ptr<Account> account_;
  uint64_t bytes_ = 0;
};


// Lets at most kPerSecond log lines through per second; Allow() returns how many were held back
// since the last one let through, or kLogSuppressed when this one is held back too.
inline constexpr uint64_t kLogSuppressed = ~uint64_t{0};
class LogLimiter {
 public:
  static constexpr uint64_t kPerSecond = 10;
  uint64_t Allow() {
    std::lock_guard<std::mutex> l(mu_);
    const auto now = TransportClock::now();
    if (now - window_ >= std::chrono::seconds(1)) {
      window_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= kPerSecond) {
      ++held_back_;
      return kLogSuppressed;
    }
    ++in_window_;
    return std::exchange(held_back_, 0);
  }

 private:
  std::mutex mu_;
  TransportClock::time_point window_{};
  uint64_t in_window_ = 0, held_back_ = 0;
};

}  // namespace sparsekv::server
