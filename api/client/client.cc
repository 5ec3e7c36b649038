#include "sparsekv/client.h"

#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>

#include "allocator/copy_checksum.h"
#include "allocator/stream_copy.h"
#include "allocator/xxhash_dispatch.h"
#include "protocol/wire.h"

namespace sparsekv {
namespace {

namespace w = wire;
using Clock = std::chrono::steady_clock;

// Where a GET reply's bundles go as they arrive, instead of buffers of the reply's own: the
// caller's destinations (GetInto) or its reused results (Get into results). Owned by the
// waiting caller; `busy` (guarded by Impl::mu_) is set while a reader writes into it, and the
// caller does not leave while it is.
struct IntoTarget {
  std::span<const std::span<std::byte>> dests;    // GetInto: one per item of the request
  std::vector<GetIntoResult>* results = nullptr;  // GetInto: sized like `dests`
  std::vector<GetResult>* reuse = nullptr;        // Get into results: sized like the request
  bool busy = false;
  size_t size() const { return results ? results->size() : reuse->size(); }
};

struct Frame {
  w::FrameHeader header;
  IntoTarget* into = nullptr;  // a GET reply read into the caller's memory (see IntoTarget)
  std::vector<std::byte> payload;
  // A GET reply read straight into its results (see ReadGetPayload); `payload` is then empty.
  std::shared_ptr<std::vector<GetResult>> get_items;
  std::vector<size_t> get_deferred;  // its items the daemon deferred (api/PROTOCOL.md)
};

// A GET reply's answers, and the items it deferred, to be asked for again.
struct GetPart {
  std::vector<GetResult> items;
  std::vector<size_t> deferred;
};

// Takes the answers of a follow-up GET (for part.deferred, in that order) into `part`. A reply
// that answers none of them is an error: the daemon always answers a reply's first item.
Status MergeGetPart(GetPart& part, GetPart more) {
  if (more.items.size() != part.deferred.size()) return Status::Internal("a follow-up GET answered the wrong count");
  std::vector<bool> again(more.items.size(), false);
  for (size_t k : more.deferred) again[k] = true;
  std::vector<size_t> still;
  for (size_t k = 0; k < more.items.size(); ++k) {
    if (again[k]) {
      still.push_back(part.deferred[k]);
    } else {
      part.items[part.deferred[k]] = std::move(more.items[k]);
    }
  }
  if (!still.empty() && still.size() == part.deferred.size()) {
    return Status::Internal("sparsekvd deferred every item of a GET");
  }
  part.deferred = std::move(still);
  return Status::OK();
}

Status Errno(const std::string& what) {
  return Status::Unavailable(fmt::format("{}: {}", what, std::strerror(errno)));
}

Status WriteAll(int fd, const std::byte* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return Errno("sending to sparsekvd");
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return Status::OK();
}

// Sends the iovecs' bytes, all of them (sendmsg may take fewer than asked).
Status WriteAllV(int fd, iovec* iov, size_t count) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
    ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return Errno("sending to sparsekvd");
    }
    while (count > 0 && static_cast<size_t>(k) >= iov->iov_len) {
      k -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + k;
      iov->iov_len -= static_cast<size_t>(k);
    }
  }
  return Status::OK();
}

Status ReadAll(int fd, std::byte* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k == 0) return Status::Unavailable("sparsekvd closed the connection");
    if (k < 0) {
      if (errno == EINTR) continue;
      return Errno("reading from sparsekvd");
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return Status::OK();
}

// Bounds every blocking connect, send and receive on `fd` by `timeout` (0: no bound).
void SetSocketTimeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

// connect(2) on a blocking socket, as if no signal came: one that interrupts it (EINTR) leaves
// the attempt going on in the kernel, so this waits for it (poll, then SO_ERROR) within
// `timeout`, as the blocking call would have, instead of failing a connection that may yet be
// made (a test process's signals did that once: "Interrupted system call").
int ConnectBlocking(int fd, const sockaddr* addr, socklen_t len, std::chrono::milliseconds timeout) {
  if (::connect(fd, addr, len) == 0) return 0;
  if (errno != EINTR) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLOUT, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (r > 0) break;
    if (r == 0) {
      errno = EINPROGRESS;  // what a blocking connect reports when SO_SNDTIMEO runs out
      return -1;
    }
    if (errno != EINTR) return -1;
  }
  int err = 0;
  socklen_t err_len = sizeof err;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) return -1;
  if (err != 0) {
    errno = err;
    return -1;
  }
  return 0;
}

// Connects within `timeout` (a daemon whose backlog is full, or a host that drops SYNs, fails
// with Unavailable instead of blocking for good). The socket keeps the timeouts; Open clears
// them after HELLO.
Result<int> ConnectTo(const std::string& address, bool* is_unix, std::chrono::milliseconds timeout) {
  if (address.rfind("unix:", 0) == 0) {
    *is_unix = true;
    const std::string path = address.substr(5);
    sockaddr_un sa{};
    if (path.empty() || path.size() >= sizeof(sa.sun_path)) {
      return Status::InvalidArgument(fmt::format("unix socket path '{}' is empty or too long", path));
    }
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("socket");
    SetSocketTimeouts(fd, timeout);
    if (ConnectBlocking(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa), timeout) != 0) {
      Status st = errno == EAGAIN || errno == EINPROGRESS
                      ? Status::Unavailable(fmt::format("connecting to unix:{}: no room in its backlog within {} ms",
                                                        path, timeout.count()))
                      : Errno(fmt::format("connecting to unix:{}", path));
      ::close(fd);
      return st;
    }
    return fd;
  }
  *is_unix = false;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return Status::InvalidArgument(fmt::format("address '{}' is not HOST:PORT or unix:PATH", address));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::InvalidArgument(fmt::format("cannot resolve '{}': {}", address, gai_strerror(rc)));
  }
  Status last = Status::Unavailable(fmt::format("no address for '{}'", address));
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    SetSocketTimeouts(fd, timeout);
    if (ConnectBlocking(fd, ai->ai_addr, ai->ai_addrlen, timeout) == 0) {
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::freeaddrinfo(res);
      return fd;
    }
    last = errno == EINPROGRESS
               ? Status::Unavailable(fmt::format("connecting to {}: no answer within {} ms", address, timeout.count()))
               : Errno(fmt::format("connecting to {}", address));
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return last;
}

Status FromItem(const w::ItemStatus& s) {
  if (s.code == StatusCode::kCorruption) return Status::Corruption(s.message);
  return s.code == StatusCode::kOk ? Status::OK() : Status(s.code, s.message);
}

std::vector<Status> FromItems(const std::vector<w::ItemStatus>& items) {
  std::vector<Status> out;
  out.reserve(items.size());
  for (const auto& s : items) out.push_back(FromItem(s));
  return out;
}

}  // namespace

class Client::Impl {
 public:
  ~Impl() { Close(); }

  // A record lent before, as local reads know it (api/PROTOCOL.md, "Local reads").
  struct LocalEntry {
    uint64_t record_off = 0;  // the record's header, in the arena
    uint64_t value_off = 0;   // its value
    uint32_t bytes = 0;
    uint32_t token = 0;
    uint64_t checksum = 0;
  };
  struct WireHashHasher {
    size_t operator()(const WireBlockHash& h) const {
      uint64_t x;
      std::memcpy(&x, h.data(), sizeof(x));  // block hashes are uniform already
      return static_cast<size_t>(x);
    }
  };

  void Close() {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
    stopping_.store(true);
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (reader_.joinable()) reader_.join();
    {
      // What is still outstanding is answered now, on this thread: a future completes with
      // this error instead of breaking its promise, a callback runs with it.
      std::unique_lock<std::mutex> l(mu_);
      Break(l, Status::Unavailable("the sparsekv client was closed with the request outstanding"));
    }
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (wake_fd_ >= 0) ::close(wake_fd_);
    wake_fd_ = -1;
    if (staging_) ::munmap(staging_, staging_bytes_);
    staging_ = nullptr;
    if (arena_) ::munmap(const_cast<std::byte*>(arena_), arena_bytes_);
    arena_ = nullptr;
    if (table_) ::munmap(const_cast<uint32_t*>(table_), table_entries_ * sizeof(uint32_t));
    table_ = nullptr;
  }

  Status Open(const ClientOptions& o) {
    timeout_ = o.timeout;
    spin_ = o.spin;
    SPARSEKV_ASSIGN_OR_RETURN(fd_, ConnectTo(o.address, &is_unix_, timeout_));
    // The handshake is bounded by the timeout too: a daemon that never answers HELLO fails the
    // Connect instead of hanging it. Later calls keep their own deadlines (poll).
    const auto t0 = Clock::now();
    ask_leases_ = is_unix_ && o.shared_memory && o.write_leases;
    ask_lend_table_ = is_unix_ && o.shared_memory && o.local_reads;
    Status st = Hello(o);
    // A daemon from before local reads (or write leases) refuses the flag bit: HELLO again
    // without the newest thing asked for.
    while (!st.ok() && (ask_lend_table_ || ask_leases_) && st.code() == StatusCode::kInvalidArgument &&
           st.message().find("shared-memory flag") != std::string_view::npos) {
      ::close(fd_);
      if (ask_lend_table_) {
        ask_lend_table_ = false;
      } else {
        ask_leases_ = false;
      }
      SPARSEKV_ASSIGN_OR_RETURN(fd_, ConnectTo(o.address, &is_unix_, timeout_));
      st = Hello(o);
    }
    if (st.ok()) {
      SetSocketTimeouts(fd_, std::chrono::milliseconds(0));
    } else if (st.code() == StatusCode::kUnavailable && Clock::now() - t0 >= timeout_) {
      st = Status::Unavailable(fmt::format("{}: no HELLO reply from sparsekvd within {} ms ({})", o.address,
                                           timeout_.count(), st.message()));
    }
    return st;
  }

  Status Hello(const ClientOptions& o) {
    w::HelloRequest hello;
    hello.namespace_name = o.namespace_name;
    hello.token = o.token;
    hello.client_name = o.client_name;
    hello.want_shared_memory = is_unix_ && o.shared_memory;
    hello.want_write_leases = ask_leases_;
    hello.want_lend_table = ask_lend_table_;
    const auto frame = w::EncodeFrame(w::Opcode::kHello, 0, 0, w::Encode(hello));
    SPARSEKV_RETURN_IF_ERROR(WriteAll(fd_, frame.data(), frame.size()));
    // The reply's first bytes may carry the arena and staging fds (SCM_RIGHTS).
    std::array<std::byte, w::kHeaderBytes> hb;
    int staging_fd = -1, arena_fd = -1, table_fd = -1;
    size_t got = 0;
    {
      std::vector<int> got_fds;
      ssize_t k;
      do {
        k = w::RecvWithFds(fd_, hb.data(), hb.size(), 0, &got_fds);
      } while (k < 0 && errno == EINTR);
      if (k <= 0) {
        for (int f : got_fds) ::close(f);
        return k == 0 ? Status::Unavailable("sparsekvd closed the connection during HELLO") : Errno("HELLO");
      }
      got = static_cast<size_t>(k);
      for (size_t i = 0; i < got_fds.size(); ++i) {
        if (i == 0) {
          staging_fd = got_fds[i];
        } else if (i == 1) {
          arena_fd = got_fds[i];
        } else if (i == 2) {
          table_fd = got_fds[i];
        } else {
          ::close(got_fds[i]);  // more than the protocol passes: not ours to keep
        }
      }
    }
    // Whatever was passed is closed unless mapped, on every way out (a failed read included).
    struct CloseFds {
      int* a;
      int* b;
      int* c;
      ~CloseFds() {
        if (*a >= 0) ::close(*a);
        if (*b >= 0) ::close(*b);
        if (*c >= 0) ::close(*c);
      }
    } close_fds{&staging_fd, &arena_fd, &table_fd};
    SPARSEKV_RETURN_IF_ERROR(ReadAll(fd_, hb.data() + got, hb.size() - got));
    auto reply = ReadFrameAfterHeader(hb);
    if (!reply.ok()) return reply.status();
    if (reply->header.opcode == w::Opcode::kError) return ErrorStatus(reply->payload);
    auto hello_reply = w::DecodeHelloReply(reply->payload);
    if (!hello_reply.ok()) return hello_reply.status();
    hello_ = *hello_reply;
    if (staging_fd >= 0) {
      SPARSEKV_RETURN_IF_ERROR(MapStaging(std::exchange(staging_fd, -1), hello_.shm_staging_bytes));
      if (arena_fd >= 0 && hello_.shm_arena_bytes > 0) {
        SPARSEKV_RETURN_IF_ERROR(MapArena(std::exchange(arena_fd, -1), hello_.shm_arena_bytes));
        // Without it, every GET asks the daemon, as before local reads.
        if (table_fd >= 0 && hello_.lend_table.value_or(0) != 0) MapLendTable(std::exchange(table_fd, -1));
      }
    }
    return Status::OK();
  }

  // The daemon's lend table (api/PROTOCOL.md, "Local reads"), read-only: one u32 per 4 KiB of
  // the arena. A table of the wrong size is not used.
  void MapLendTable(int fd) {
    const uint64_t entries = arena_bytes_ / kLendUnit;
    struct stat st{};
    if (entries > 0 && ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= entries * sizeof(uint32_t)) {
      void* m = ::mmap(nullptr, entries * sizeof(uint32_t), PROT_READ, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        table_ = static_cast<const uint32_t*>(m);
        table_entries_ = entries;
        check_local_ = *hello_.lend_table == 2;
      }
    }
    ::close(fd);
  }

  // The session's staging area: the first half carries PUT bundles to the daemon, the second
  // half GET bundles back.
  Status MapStaging(int fd, uint64_t announced) {
    struct stat st{};
    const bool sized = ::fstat(fd, &st) == 0 && st.st_size > 0 && static_cast<uint64_t>(st.st_size) == announced;
    if (sized) {
      void* m = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        staging_ = static_cast<std::byte*>(m);
        staging_bytes_ = static_cast<size_t>(st.st_size);
      }
    }
    ::close(fd);
    if (staging_ == nullptr) return Status::Unavailable("could not map the staging area sparsekvd passed");
    return Status::OK();
  }

  // Reads one frame's payload after its header (HELLO only: before any reply is pipelined).
  // The daemon's host arena, read-only: SHM_GET may name bundles in it (lent in place).
  Status MapArena(int fd, uint64_t announced) {
    struct stat st{};
    const bool sized = ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= announced;
    if (sized) {
      // Writable under write leases: values are written into the room each lease names.
      bool leases = hello_.write_leases.value_or(false);
      void* m = ::mmap(nullptr, announced, leases ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
      if (m == MAP_FAILED && leases) {
        m = ::mmap(nullptr, announced, PROT_READ, MAP_SHARED, fd, 0);  // lends still work; PUTs use staging
        leases = false;
      }
      if (m != MAP_FAILED) {
        arena_ = static_cast<const std::byte*>(m);
        arena_bytes_ = announced;
        if (leases) arena_rw_ = static_cast<std::byte*>(m);
      }
    }
    ::close(fd);
    if (arena_ == nullptr) return Status::Unavailable("could not map the host arena sparsekvd passed");
    return Status::OK();
  }

  Result<Frame> ReadFrameAfterHeader(const std::array<std::byte, w::kHeaderBytes>& hb) {
    SPARSEKV_ASSIGN_OR_RETURN(w::FrameHeader h, w::DecodeHeader(hb, w::kMaxPayloadBytes));
    Frame f;
    f.header = h;
    f.payload.resize(h.payload_bytes);
    SPARSEKV_RETURN_IF_ERROR(ReadAll(fd_, f.payload.data(), f.payload.size()));
    SPARSEKV_RETURN_IF_ERROR(w::VerifyPayload(h, f.payload));
    return f;
  }

  static Status ErrorStatus(std::span<const std::byte> payload) {
    auto e = w::DecodeErrorReply(payload);
    if (!e.ok()) return e.status().WithContext("undecodable ERROR frame from sparsekvd");
    return Status(e->code, e->message);
  }

  // ---- reading replies ----
  //
  // Whoever needs a reply reads the socket: a synchronous caller takes the reader role, reads
  // frames until its own reply arrives (handing other callers' replies to them) and gives the
  // role back. That saves a thread handoff per call, which on a small machine costs more than
  // the call itself. Asynchronous calls and event subscriptions start a reader thread, which
  // then keeps the role; synchronous callers wait for it to hand them their reply.

  // The outcome of reading one frame.
  enum class ReadOutcome { kFrame, kIdle, kBroken };

  // Copies `n` bytes from the socket, through the read-ahead buffer. When `deadline` passes
  // before a frame's first byte (`at_boundary`) the answer is kIdle. Once a frame has begun it
  // is read to its end within the call timeout, or the connection is broken (its framing would
  // be lost). Waits are cut into slices of at most 500 ms so that Close is noticed.
  ReadOutcome ReadExact(std::byte* dst, size_t n, bool& at_boundary, Clock::time_point deadline, Status* why) {
    Clock::time_point frame_deadline = at_boundary ? Clock::time_point::max() : Clock::now() + timeout_;
    auto begun = [&] {
      if (at_boundary) {
        at_boundary = false;
        frame_deadline = Clock::now() + timeout_;
      }
    };
    while (n > 0) {
      if (rpos_ < rend_) {
        const size_t k = std::min(n, rend_ - rpos_);
        std::memcpy(dst, rbuf_.data() + rpos_, k);
        rpos_ += k;
        dst += k;
        n -= k;
        begun();
        continue;
      }
      // Within a frame, or when not waiting at all, the bytes are likely there: try first.
      const Clock::time_point until = at_boundary ? deadline : frame_deadline;
      if (!at_boundary || until <= Clock::now()) {
        const int got = RecvSome(dst, n, begun, why);
        if (got > 0) continue;
        if (got < 0) return ReadOutcome::kBroken;
        if (at_boundary && until <= Clock::now()) return ReadOutcome::kIdle;
      }
      // A synchronous caller may spin for its reply a while first (ClientOptions::spin).
      if (at_boundary && spin_.count() > 0 && deadline != Clock::time_point::max() && Clock::now() < deadline) {
        const Clock::time_point spin_end = std::min(deadline, Clock::now() + spin_);
        int got = 0;
        while (got == 0 && Clock::now() < spin_end && !stopping_.load(std::memory_order_relaxed)) {
          got = RecvSome(dst, n, begun, why);
        }
        if (got < 0) return ReadOutcome::kBroken;
        if (got > 0) continue;
      }
      // Wait with poll, never asleep inside recv: on a Unix socket the daemon's reading of our
      // request wakes every task asleep on the socket (a write-space wakeup, which recv's wait
      // does not filter), which costs a context switch per call; poll waits for input only.
      // Between frames the wait also ends when another thread changes what the reader may be
      // waiting for without a frame arriving (a staging area released: Wake).
      pollfd pfd[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      const nfds_t nfds = at_boundary && wake_fd_ >= 0 ? 2 : 1;
      const auto now = Clock::now();
      int64_t wait_ms = 500;
      if (until != Clock::time_point::max()) {
        wait_ms = std::min<int64_t>(
            wait_ms, std::chrono::ceil<std::chrono::milliseconds>(std::max(until - now, Clock::duration{})).count());
      }
      const int pr = ::poll(pfd, nfds, static_cast<int>(wait_ms));
      if (pr > 0 && nfds == 2 && (pfd[1].revents & POLLIN)) {
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof(v));  // drained; the caller looks again
        if (!(pfd[0].revents & POLLIN)) return ReadOutcome::kIdle;
      }
      if (pr < 0 && errno != EINTR) {
        *why = Errno("waiting for sparsekvd");
        return ReadOutcome::kBroken;
      }
      if (pr <= 0) {
        if (stopping_.load(std::memory_order_relaxed)) {
          *why = Status::Unavailable("client closed");
          return ReadOutcome::kBroken;
        }
        if (Clock::now() < until) continue;
        if (at_boundary) return ReadOutcome::kIdle;
        *why = Status::Unavailable("sparsekvd stopped sending in the middle of a frame");
        return ReadOutcome::kBroken;
      }
      if (RecvSome(dst, n, begun, why) < 0) return ReadOutcome::kBroken;
    }
    return ReadOutcome::kFrame;
  }

  // One non-blocking receive: a large remainder goes straight to `dst` (advancing it and `n`),
  // a small one refills the read-ahead buffer, which also picks up the start of the next
  // frame. Returns 1 when bytes came, 0 when none were there, -1 when the connection failed.
  template <typename Begun>
  int RecvSome(std::byte*& dst, size_t& n, Begun& begun, Status* why) {
    const bool direct = n >= rbuf_.size() / 2;
    const ssize_t k = direct ? ::recv(fd_, dst, n, MSG_DONTWAIT) : ::recv(fd_, rbuf_.data(), rbuf_.size(), MSG_DONTWAIT);
    if (k > 0) {
      if (direct) {
        dst += k;
        n -= static_cast<size_t>(k);
        begun();
      } else {
        rpos_ = 0;
        rend_ = static_cast<size_t>(k);
      }
      return 1;
    }
    if (k == 0) {
      *why = Status::Unavailable("sparsekvd closed the connection");
      return -1;
    }
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *why = Errno("reading from sparsekvd");
    return -1;
  }

  ReadOutcome ReadFrame(Clock::time_point deadline, Frame* f, Status* why) {
    std::array<std::byte, w::kHeaderBytes> hb;
    bool at_boundary = true;
    ReadOutcome o = ReadExact(hb.data(), hb.size(), at_boundary, deadline, why);
    if (o != ReadOutcome::kFrame) return o;
    auto h = w::DecodeHeader(hb, w::kMaxPayloadBytes);
    if (!h.ok()) {
      *why = h.status().WithContext("bad frame from sparsekvd");
      return ReadOutcome::kBroken;
    }
    f->header = *h;
    if (h->opcode == w::Opcode::kGet && !(h->flags & w::kFlagPayloadChecksum)) {
      f->into = ClaimInto(h->request_id);
      return ReadGetPayload(h->payload_bytes, at_boundary, deadline, f, why);
    }
    f->payload.resize(h->payload_bytes);
    o = ReadExact(f->payload.data(), f->payload.size(), at_boundary, deadline, why);
    if (o != ReadOutcome::kFrame) return o;
    if (Status st = w::VerifyPayload(*h, f->payload); !st.ok()) {
      *why = st.WithContext("bad frame from sparsekvd");
      return ReadOutcome::kBroken;
    }
    return ReadOutcome::kFrame;
  }

  // The caller's memory a GET reply with this id is read into, if its caller gave any; marked
  // busy until the frame is read (ReadOnce clears it).
  IntoTarget* ClaimInto(uint64_t request_id) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = pending_.find(request_id);
    if (it == pending_.end()) return nullptr;
    Waiter** waiter = std::get_if<Waiter*>(&it->second);
    if (waiter == nullptr || (*waiter)->into == nullptr) return nullptr;
    (*waiter)->into->busy = true;
    return (*waiter)->into;
  }

  // A GET reply without a payload checksum (as sparsekvd sends them): each bundle is read from
  // the socket straight into its result's own buffer, or the caller's (f->into), sparing a copy
  // of every byte. The layout is checked as DecodeGetReply checks it; anything amiss breaks the
  // connection.
  ReadOutcome ReadGetPayload(uint32_t payload_bytes, bool& at_boundary, Clock::time_point deadline, Frame* f,
                             Status* why) {
    uint64_t left = payload_bytes;
    auto bad = [&](const std::string& what) {
      *why = Status::Corruption("bad GET reply from sparsekvd: " + what);
      return ReadOutcome::kBroken;
    };
    auto take = [&](void* dst, size_t n) {
      if (n > left) return bad("an item runs past the end of the frame");
      left -= n;
      return ReadExact(static_cast<std::byte*>(dst), n, at_boundary, deadline, why);
    };
    auto take_u32 = [&](uint32_t* v) {
      std::array<std::byte, 4> b;
      const ReadOutcome o = take(b.data(), 4);
      *v = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
      return o;
    };
    // Bytes of a value that does not fit its destination: read and dropped.
    auto skip = [&](uint64_t n) {
      std::array<std::byte, 16384> scratch;
      while (n > 0) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, scratch.size()));
        if (ReadOutcome o = take(scratch.data(), k); o != ReadOutcome::kFrame) return o;
        n -= k;
      }
      return ReadOutcome::kFrame;
    };
    uint32_t count = 0;
    if (ReadOutcome o = take_u32(&count); o != ReadOutcome::kFrame) return o;
    if (count > w::kMaxBatchItems || 2ull * count > left) return bad("item count " + std::to_string(count));
    IntoTarget* into = f->into;
    if (into != nullptr && into->size() != count) return bad("an item count unlike the request's");
    std::shared_ptr<std::vector<GetResult>> items;
    if (into == nullptr) items = std::make_shared<std::vector<GetResult>>(count);
    std::vector<size_t> deferred;
    GetResult unused;
    for (size_t i = 0; i < count; ++i) {
      GetResult& g = items ? (*items)[i] : into->reuse ? (*into->reuse)[i] : unused;
      uint8_t code = 0;
      if (ReadOutcome o = take(&code, 1); o != ReadOutcome::kFrame) return o;
      if (code == w::kDeferredCode) {  // not answered here: asked for again
        deferred.push_back(i);
        continue;
      }
      if (code > static_cast<uint8_t>(StatusCode::kInternal)) return bad("unknown status code");
      uint32_t n = 0;
      if (ReadOutcome o = take_u32(&n); o != ReadOutcome::kFrame) return o;
      if (n > left || (code != 0 && n > 4096)) return bad("a length past the end of the frame");
      if (code == 0 && into != nullptr && into->results != nullptr) {
        GetIntoResult& r = (*into->results)[i];
        const std::span<std::byte> dst = into->dests[i];
        r.bytes = n;
        if (n <= dst.size()) {
          r.status = Status::OK();
          if (ReadOutcome o = take(dst.data(), n); o != ReadOutcome::kFrame) return o;
        } else {
          r.status = Status::OutOfRange(
              fmt::format("a value of {} bytes does not fit its destination of {} bytes", n, dst.size()));
          if (ReadOutcome o = skip(n); o != ReadOutcome::kFrame) return o;
        }
      } else if (code == 0) {
        g.status = Status::OK();
        g.bytes.resize(n);  // a reused buffer of this size: no allocation, pages already touched
        if (ReadOutcome o = take(g.bytes.data(), n); o != ReadOutcome::kFrame) return o;
      } else {
        std::string message(n, '\0');
        if (ReadOutcome o = take(message.data(), n); o != ReadOutcome::kFrame) return o;
        Status st = FromItem(w::ItemStatus{static_cast<StatusCode>(code), std::move(message)});
        if (into != nullptr && into->results != nullptr) {
          (*into->results)[i] = {std::move(st), 0};
        } else {
          g.status = std::move(st);
          g.bytes.clear();
        }
      }
    }
    // The verdict bytes: an item whose bytes failed their check as the daemon sent them is
    // Corruption, its bytes dropped.
    std::vector<bool> is_deferred(count, false);
    for (size_t d : deferred) is_deferred[d] = true;
    for (size_t i = 0; i < count; ++i) {
      uint8_t verdict = 0;
      if (ReadOutcome o = take(&verdict, 1); o != ReadOutcome::kFrame) return o;
      if (verdict > 1) return bad("unknown verdict");
      if (verdict != 0 && is_deferred[i]) return bad("a deferred item has a verdict");
      if (verdict == 0) continue;
      const Status damaged = Status::Corruption("the bundle failed its checksum as sparsekvd sent it");
      if (into != nullptr && into->results != nullptr) {
        if ((*into->results)[i].status.ok()) (*into->results)[i].status = damaged;
        continue;
      }
      GetResult& g = items ? (*items)[i] : (*into->reuse)[i];
      if (g.status.ok()) {
        g.status = damaged;
        g.bytes.clear();
        if (items) g.bytes.shrink_to_fit();
      }
    }
    if (left != 0) return bad("bytes left over");
    f->get_items = std::move(items);
    f->get_deferred = std::move(deferred);
    return ReadOutcome::kFrame;
  }

  // A synchronous caller's slot for its reply.
  struct Waiter {
    std::optional<Result<Frame>> result;
    IntoTarget* into = nullptr;  // a GET reply goes there (see IntoTarget)
    // SHM_GET_OVERLAP: a SHM_VERDICTS frame follows the reply; the waiter stays registered for it.
    bool verdicts_expected = false;
    std::optional<std::vector<uint8_t>> verdicts;
  };
  using FrameCallback = std::function<void(Result<Frame>)>;
  using Pending = std::variant<Waiter*, FrameCallback>;

  // Hands a frame to whoever waits for it. Called with mu_ held (`l`); may unlock it to run
  // event and reply callbacks (the futures' promises are kept by callbacks).
  void Deliver(std::unique_lock<std::mutex>& l, Frame f) {
    if (f.header.opcode == w::Opcode::kEvent) {
      l.unlock();
      DeliverEvents(f.payload);
      l.lock();
      return;
    }
    if (f.header.opcode == w::Opcode::kError && f.header.request_id == 0) {
      // About the connection, not a request: the daemon closes it and says why (a deadline,
      // a connection limit). Every caller learns that reason.
      return Break(l, ErrorStatus(f.payload).WithContext("sparsekvd closed the connection"));
    }
    auto it = pending_.find(f.header.request_id);
    if (it == pending_.end()) return;  // a reply nobody waits for (the caller timed out)
    if (Waiter** w = std::get_if<Waiter*>(&it->second); w != nullptr && f.header.opcode == w::Opcode::kShmVerdicts) {
      auto v = w::DecodeVerdicts(f.payload);
      if (!(*w)->verdicts_expected || !(*w)->result.has_value() || !v.ok()) {
        return Break(l, v.ok() ? Status::Internal("SHM_VERDICTS nobody asked for") : v.status());
      }
      (*w)->verdicts.emplace(std::move(*v));
      pending_.erase(it);
      cv_.notify_all();
      return;
    }
    const bool error = f.header.opcode == w::Opcode::kError;
    Result<Frame> r = error ? Result<Frame>(ErrorStatus(f.payload)) : Result<Frame>(std::move(f));
    if (Waiter** w = std::get_if<Waiter*>(&it->second)) {
      const bool more = (*w)->verdicts_expected && !error && !(*w)->result.has_value();
      (*w)->result.emplace(std::move(r));
      if (!more) pending_.erase(it);
      cv_.notify_all();
      return;
    }
    Pending p = std::move(it->second);
    pending_.erase(it);
    l.unlock();
    std::get<FrameCallback>(p)(std::move(r));
    l.lock();
  }

  // The connection is unusable: every waiter gets `why`. Called with mu_ held.
  void Break(std::unique_lock<std::mutex>& l, const Status& why) {
    if (broken_.ok()) broken_ = why;
    std::vector<Pending> others;
    for (auto& [id, p] : pending_) {
      if (Waiter** w = std::get_if<Waiter*>(&p)) {
        if (!(*w)->result.has_value() || !(*w)->verdicts_expected) (*w)->result.emplace(broken_);
      } else {
        others.push_back(std::move(p));
      }
    }
    pending_.clear();
    cv_.notify_all();
    const Status why_copy = broken_;
    l.unlock();
    for (auto& p : others) std::get<FrameCallback>(p)(why_copy);
    l.lock();
  }

  // Reads frames while the role is ours. Returns with mu_ held and the role given back.
  ReadOutcome ReadOnce(std::unique_lock<std::mutex>& l, Clock::time_point deadline) {
    role_taken_ = true;
    l.unlock();
    Frame f;
    Status why;
    const ReadOutcome o = ReadFrame(deadline, &f, &why);
    l.lock();
    role_taken_ = false;
    if (f.into != nullptr) f.into->busy = false;  // its caller may leave now
    if (o == ReadOutcome::kFrame) {
      Deliver(l, std::move(f));
    } else if (o == ReadOutcome::kBroken) {
      Break(l, why);
    }
    cv_.notify_all();  // someone else may need the role now
    return o;
  }

  // The reader thread of asynchronous calls and events: once started it keeps the role.
  void ReaderLoop() {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_ && broken_.ok()) {
      if (role_taken_) {
        cv_.wait(l);
        continue;
      }
      ReadOnce(l, Clock::time_point::max());
    }
  }

  void EnsureReaderThread() {
    std::lock_guard<std::mutex> l(mu_);
    if (reader_started_) return;
    reader_started_ = true;
    reader_ = std::thread([this] { ReaderLoop(); });
  }

  void DeliverEvents(std::span<const std::byte> payload) {
    auto batch = w::DecodeEventBatch(payload);
    EventCallback cb;
    {
      std::lock_guard<std::mutex> l(cb_mu_);
      cb = on_event_;
    }
    if (!batch.ok() || !cb) return;
    uint64_t seq = batch->sequence;
    for (const auto& e : batch->events) {
      EventNotice n;
      n.type = e.type;
      n.tier = static_cast<BlockTier>(e.tier);
      n.sequence = seq++;
      n.hashes = e.hashes;
      cb(n);
    }
  }

  // Registers the request, then sends it. Returns the request id, or why it was not sent (the
  // registration is then undone).
  using Pieces = std::span<const std::span<const std::byte>>;
  // The payload is the concatenation of `pieces`, sent from where they lie.
  Result<uint64_t> SendFrame(w::Opcode op, std::span<const std::span<const std::byte>> pieces, Pending pending) {
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!broken_.ok()) return broken_;
      pending_.emplace(id, std::move(pending));
    }
    auto header = w::EncodeFrameHeader(op, 0, id, pieces);
    std::vector<iovec> iov;
    iov.reserve(pieces.size() + 1);
    iov.push_back({header.data(), header.size()});
    for (const auto& piece : pieces) {
      if (!piece.empty()) iov.push_back({const_cast<std::byte*>(piece.data()), piece.size()});
    }
    Status st;
    {
      std::lock_guard<std::mutex> l(write_mu_);
      st = WriteAllV(fd_, iov.data(), iov.size());
    }
    if (!st.ok()) {
      std::unique_lock<std::mutex> l(mu_);
      pending_.erase(id);
      return st;
    }
    return id;
  }

  Result<uint64_t> SendFrame(w::Opcode op, std::span<const std::byte> payload, Pending pending) {
    return SendFrame(op, Pieces(&payload, 1), std::move(pending));
  }

  // Waits with mu_ held (`l`) until `done()`, reading replies meanwhile whenever nobody else
  // is. False when the deadline passed or the connection broke first.
  template <typename Done>
  bool WaitReading(std::unique_lock<std::mutex>& l, Clock::time_point deadline, Done&& done) {
    while (!done()) {
      if (!broken_.ok()) return false;
      const bool idle = role_taken_ ? cv_.wait_until(l, deadline) == std::cv_status::timeout
                                    : ReadOnce(l, deadline) == ReadOutcome::kIdle;
      if (idle && !done() && Clock::now() >= deadline) return false;
    }
    return true;
  }

  Status TimedOut() const {
    return Status::Unavailable(fmt::format("no reply from sparsekvd within {} ms", timeout_.count()));
  }

  // A synchronous request: the calling thread reads its own reply when nobody else is reading.
  Result<Frame> Call(w::Opcode op, std::span<const std::byte> payload) { return Call(op, Pieces(&payload, 1)); }
  Result<Frame> Call(w::Opcode op, Pieces pieces) {
    Waiter waiter;
    SPARSEKV_ASSIGN_OR_RETURN(const uint64_t id, SendFrame(op, pieces, &waiter));
    std::unique_lock<std::mutex> l(mu_);
    if (!WaitReading(l, Clock::now() + timeout_, [&] { return waiter.result.has_value(); })) {
      if (waiter.result) return std::move(*waiter.result);  // broken: the reason is there
      pending_.erase(id);
      return TimedOut();
    }
    DrainBuffered(l);
    return std::move(*waiter.result);
  }

  // Frames already in the read-ahead buffer are invisible to an event loop polling the socket:
  // before a synchronous caller leaves, it hands them to their callbacks and futures.
  void DrainBuffered(std::unique_lock<std::mutex>& l) {
    while (!role_taken_ && broken_.ok() && rpos_ < rend_ && pending_.size() > 0) {
      if (ReadOnce(l, Clock::now()) != ReadOutcome::kFrame) break;
    }
  }

  // Reads every reply that has arrived and hands each to its waiter; for event loops.
  Result<size_t> ProcessReplies() {
    std::unique_lock<std::mutex> l(mu_);
    size_t n = 0;
    while (!role_taken_ && broken_.ok()) {
      if (ReadOnce(l, Clock::now()) != ReadOutcome::kFrame) break;
      ++n;
    }
    if (n == 0 && !broken_.ok()) return broken_;
    return n;
  }

  // A shared-memory call failed (timed out, say) with its request perhaps still being served:
  // the daemon may yet write the GET area or read the PUT area, so neither can be reused. The
  // connection is closed; later calls fail and the daemon drops the session.
  void AbandonAreas() {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

  // The staging area's halves: one PUT and one GET at a time use each.
  enum Area { kPutArea = 0, kGetArea = 1 };
  bool TryAcquire(Area a) {
    std::lock_guard<std::mutex> l(mu_);
    if (area_busy_[a]) return false;
    area_busy_[a] = true;
    return true;
  }
  Status Acquire(Area a) {
    std::unique_lock<std::mutex> l(mu_);
    // The holder may be a callback request whose reply only a reader delivers: read meanwhile.
    if (!WaitReading(l, Clock::now() + timeout_, [&] { return !area_busy_[a]; })) {
      return broken_.ok() ? TimedOut() : broken_;
    }
    area_busy_[a] = true;
    return Status::OK();
  }
  void Release(Area a) {
    std::lock_guard<std::mutex> l(mu_);
    area_busy_[a] = false;
    cv_.notify_all();  // threads waiting for the role
    Wake();            // and the one holding it, asleep in poll, may be waiting for this area
  }
  void Wake() {
    if (wake_fd_ < 0) return;
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }

  static Result<LookupResult> ParseLookup(Result<Frame> f) {
    if (!f.ok()) return f.status();
    SPARSEKV_ASSIGN_OR_RETURN(w::LookupReply r, w::DecodeLookupReply(f->payload));
    LookupResult out;
    out.prefix_blocks = r.prefix_blocks;
    for (uint8_t t : r.tiers) out.tiers.push_back(static_cast<BlockTier>(std::min<uint8_t>(t, 4)));
    return out;
  }

  static Result<std::vector<Status>> ParseStatusList(Result<Frame> f, size_t expected) {
    if (!f.ok()) return f.status();
    SPARSEKV_ASSIGN_OR_RETURN(w::StatusListReply r, w::DecodeStatusListReply(f->payload));
    if (r.items.size() != expected) {
      return Status::Internal(fmt::format("sparsekvd answered {} items for {}", r.items.size(), expected));
    }
    return FromItems(r.items);
  }

  static Result<GetPart> ParseGetPart(Result<Frame> f, size_t expected) {
    if (!f.ok()) return f.status();
    GetPart part;
    if (f->get_items) {
      if (f->get_items->size() != expected) {
        return Status::Internal(fmt::format("sparsekvd answered {} items for {}", f->get_items->size(), expected));
      }
      part.items = std::move(*f->get_items);
      part.deferred = std::move(f->get_deferred);
      return part;
    }
    SPARSEKV_ASSIGN_OR_RETURN(w::GetReply r, w::DecodeGetReply(f->payload, w::kMaxPayloadBytes));
    if (r.items.size() != expected) {
      return Status::Internal(fmt::format("sparsekvd answered {} items for {}", r.items.size(), expected));
    }
    part.items.resize(r.items.size());
    for (size_t i = 0; i < r.items.size(); ++i) {
      if (r.items[i].deferred) {
        part.deferred.push_back(i);
        continue;
      }
      part.items[i].status = FromItem(r.items[i].status);
      part.items[i].bytes.assign(r.items[i].bundle.begin(), r.items[i].bundle.end());
    }
    return part;
  }

  // A GET over the socket into fresh results; what a reply deferred is asked for again (a reply
  // never exceeds the announced maximum frame, api/PROTOCOL.md).
  Result<std::vector<GetResult>> GetSocket(std::span<const WireBlockHash> hashes) {
    std::vector<GetResult> out(hashes.size());
    SPARSEKV_RETURN_IF_ERROR(GetReusingSocket(hashes, out));
    return out;
  }

  // FinishGet for callbacks: the follow-up GETs go out from the thread that read the reply.
  void FinishGetWithCallback(std::shared_ptr<const std::vector<WireBlockHash>> hashes, GetPart part,
                             std::function<void(Result<std::vector<GetResult>>)> done) {
    if (part.deferred.empty()) return done(std::move(part.items));
    w::HashList req;
    for (size_t i : part.deferred) req.hashes.push_back((*hashes)[i]);
    auto state = std::make_shared<GetPart>(std::move(part));
    SendWithCallback(w::Opcode::kGet, w::Encode(req),
                     [this, hashes, state, done = std::move(done)](Result<Frame> f) mutable {
                       auto more = ParseGetPart(std::move(f), state->deferred.size());
                       if (!more.ok()) return done(more.status());
                       if (Status st = MergeGetPart(*state, std::move(*more)); !st.ok()) return done(st);
                       FinishGetWithCallback(hashes, std::move(*state), std::move(done));
                     });
  }

  // A value to store, whole (BundleRef) or in pieces (PiecesRef): its size, and its bytes
  // written out in order.
  static uint64_t SizeOf(const BundleRef& b) { return b.bytes.size(); }
  static uint64_t SizeOf(const PiecesRef& v) {
    uint64_t n = 0;
    for (const auto& p : v.pieces) n += p.size();
    return n;
  }
  // A value's copy to `dst` (with streaming stores when `stream`: CopyBytes).
  static void CopyValue(const BundleRef& b, std::byte* dst, bool stream = false) {
    CopyBytes(dst, b.bytes.data(), b.bytes.size(), stream);
  }
  static void CopyValue(const PiecesRef& v, std::byte* dst, bool stream = false) {
    for (const auto& p : v.pieces) {
      CopyBytes(dst, p.data(), p.size(), stream);
      dst += p.size();
    }
  }
  // The value as one span: a whole one as it is, one in several pieces gathered into `scratch`
  // (kept by the caller until the bytes are sent).
  static std::span<const std::byte> ValueSpan(const BundleRef& b, std::vector<std::vector<std::byte>>&) {
    return b.bytes;
  }
  static std::span<const std::byte> ValueSpan(const PiecesRef& v, std::vector<std::vector<std::byte>>& scratch) {
    if (v.pieces.size() == 1) return v.pieces[0];
    scratch.emplace_back(SizeOf(v));
    CopyValue(v, scratch.back().data());
    return scratch.back();
  }

  // A PUT batch goes in parts of about kPutPartBytes, each its own request, sent without
  // waiting for the one before: the daemon stores one part (a copy into the host tier, hashed)
  // while this thread copies or sends the next, so that the two copies of a PUT run on two
  // cores at once instead of one after the other. Pipelined requests may be served in any
  // order (api/PROTOCOL.md), so a batch that names a key twice goes one part at a time, its
  // later item stored last as in one request.
  static constexpr uint64_t kPutPartBytes = 1u << 20;
  static constexpr uint64_t kPutSocketWindowBytes = 64u << 20;  // sent and not yet answered
  struct PutCall {
    Waiter waiter;
    uint64_t id = 0;
    std::vector<size_t> items;    // of the batch
    uint64_t begin = 0, end = 0;  // PUT-area bytes it uses (shared memory), or bytes sent (socket)
  };

  template <typename Value>
  static bool NamesAKeyTwice(std::span<const Value> bundles) {
    if (bundles.size() < 2) return false;
    std::vector<WireBlockHash> keys;
    keys.reserve(bundles.size());
    for (const Value& b : bundles) keys.push_back(b.hash);
    std::sort(keys.begin(), keys.end());
    return std::adjacent_find(keys.begin(), keys.end()) != keys.end();
  }

  // The answer of the oldest part in flight, into `out`. On a timeout or a broken connection the
  // parts still in flight are forgotten and the reason returned.
  Status FinishOldestPut(std::deque<std::unique_ptr<PutCall>>& flight, std::vector<Status>& out) {
    std::unique_ptr<PutCall> call = std::move(flight.front());
    flight.pop_front();
    if (Status st = WaitAll(std::span(&call, 1)); !st.ok()) {
      WaitAll(flight).IgnoreError();
      flight.clear();
      return st;
    }
    SPARSEKV_ASSIGN_OR_RETURN(auto part, ParseStatusList(std::move(*call->waiter.result), call->items.size()));
    for (size_t k = 0; k < part.size(); ++k) out[call->items[k]] = std::move(part[k]);
    return Status::OK();
  }

  // Sends one part of a PUT batch and adds it to those in flight.
  Status SendPart(w::Opcode op, Pieces pieces, std::unique_ptr<PutCall> call,
                  std::deque<std::unique_ptr<PutCall>>& flight) {
    SPARSEKV_ASSIGN_OR_RETURN(call->id, SendFrame(op, pieces, &call->waiter));
    flight.push_back(std::move(call));
    return Status::OK();
  }

  // Waits for every part still in flight, even after a failure (no reply may land in a call
  // gone); the first failure is kept in `failed`.
  void FinishAllPuts(std::deque<std::unique_ptr<PutCall>>& flight, std::vector<Status>& out, Status& failed) {
    while (!flight.empty()) {
      Status st = FinishOldestPut(flight, out);
      if (failed.ok()) failed = st;
    }
  }

  template <typename Value>
  Result<std::vector<Status>> PutShared(std::span<const Value> bundles) {
    std::vector<Status> out(bundles.size());
    SPARSEKV_RETURN_IF_ERROR(Acquire(kPutArea));
    struct ReleaseAtEnd {
      Impl* impl;
      ~ReleaseAtEnd() { impl->Release(kPutArea); }
    } release{this};
    const uint64_t area = staging_bytes_ / 2;
    const bool one_at_a_time = NamesAKeyTwice(bundles);
    auto padded = [](uint64_t n) { return (n + 63) & ~uint64_t{63}; };
    std::deque<std::unique_ptr<PutCall>> flight;
    Status failed;
    uint64_t cursor = 0;  // where the next part goes in the PUT area (a ring)
    size_t i = 0;
    while (i < bundles.size() && failed.ok()) {
      if (SizeOf(bundles[i]) > area) {  // larger than the PUT area: the socket carries it
        FinishAllPuts(flight, out, failed);  // in order, should the batch name its key again
        if (!failed.ok()) break;
        auto one = PutSocket(bundles.subspan(i, 1));
        if (!one.ok()) {
          failed = one.status();
          break;
        }
        out[i++] = std::move((*one)[0]);
        continue;
      }
      auto call = std::make_unique<PutCall>();
      uint64_t bytes = 0;
      const size_t first = i;
      while (i < bundles.size() && SizeOf(bundles[i]) <= area && call->items.size() < w::kMaxBatchItems &&
             (i == first || (bytes + padded(SizeOf(bundles[i])) <= kPutPartBytes &&
                             bytes + padded(SizeOf(bundles[i])) <= area))) {
        bytes += padded(SizeOf(bundles[i]));
        call->items.push_back(i++);
      }
      if (cursor + bytes > area) cursor = 0;
      call->begin = cursor;
      call->end = cursor + bytes;
      // The room must be free: no part in flight may still be read from it.
      auto overlaps = [&] {
        if (one_at_a_time) return !flight.empty();
        return std::any_of(flight.begin(), flight.end(),
                           [&](const auto& f) { return f->begin < call->end && call->begin < f->end; });
      };
      while (overlaps() && failed.ok()) failed = FinishOldestPut(flight, out);
      if (!failed.ok()) break;
      w::ShmPutRequest req;
      uint64_t off = call->begin;
      for (size_t k : call->items) {
        const uint64_t n = SizeOf(bundles[k]);
        CopyValue(bundles[k], staging_ + off);
        req.slots.push_back({bundles[k].hash, off, static_cast<uint32_t>(n)});
        off += padded(n);
      }
      cursor = call->end;
      const std::vector<std::byte> encoded = w::Encode(req);
      const std::span<const std::byte> payload(encoded);
      failed = SendPart(w::Opcode::kShmPut, Pieces(&payload, 1), std::move(call), flight);
    }
    FinishAllPuts(flight, out, failed);
    if (!failed.ok()) {
      // The daemon may still be reading the PUT area for a part whose answer never came: no
      // later PUT may write there on this connection.
      AbandonAreas();
      return failed;
    }
    return out;
  }

  // PUTs written into the host arena under write leases (api/PROTOCOL.md). The batch goes in
  // groups of at most kLeaseBytes, each under its own PUT_LEASE, the next group's asked for
  // before this one is written so that its round trip overlaps the copy. Each value is copied
  // into its room, and PUT_COMMITs go out every kCommitBytes without waiting: the daemon checks
  // each record's header and computes its checksum (the commit's checksum 0) while this thread
  // writes the next part. Items the daemon would not lease (its quota, no room) go through the
  // staging area.
  static constexpr uint64_t kCommitBytes = 1u << 20;
  static constexpr uint64_t kLeaseBytes = 16u << 20;
  // A group of at least this many bytes is copied into its rooms with streaming stores
  // (StreamingCopy): the rooms are cold, and a group this large would only push the cache's
  // lines out to make room for lines nobody here reads again. A smaller one stays in the cache,
  // where the daemon's hash finds it. Measured with `sparsekv bench daemon --batch` on a
  // 2-vCPU EPYC (Zen 4) VM, PUT under leases over memcpy, plain then streaming: 64 KiB x 64
  // (4 MiB) 0.28-0.32 then 0.22; 256 KiB x 16 (4 MiB) 0.30-0.36 then 0.26-0.28; 64 KiB x 256
  // (16 MiB) 0.30-0.37 then 0.42; 1 MiB x 16 0.42-0.58 then 0.60-0.66; 6 MiB x 16 0.70-0.79
  // then 0.82-0.92.
  static constexpr uint64_t kStreamGroupBytes = 8u << 20;
  bool leases() const { return arena_rw_ != nullptr; }

  struct LeaseCall {
    Waiter waiter;
    uint64_t id = 0;
    size_t first = 0, count = 0;  // items of the batch
    uint64_t bytes = 0;           // theirs
  };
  struct CommitCall {
    Waiter waiter;
    uint64_t id = 0;
    std::vector<size_t> items;  // of the batch
  };

  // Waits until every call in `calls` has its reply; on a timeout or a broken connection, the
  // ones still waiting are forgotten and the reason returned.
  template <typename Calls>
  Status WaitAll(Calls&& calls) {
    std::unique_lock<std::mutex> l(mu_);
    const bool all = WaitReading(l, Clock::now() + timeout_, [&] {
      // A call never sent (id 0: the batch failed before it) waits for nothing.
      return std::all_of(calls.begin(), calls.end(),
                         [](const auto& x) { return !x || x->id == 0 || x->waiter.result.has_value(); });
    });
    if (!all) {
      for (const auto& x : calls) {
        if (x && !x->waiter.result) pending_.erase(x->id);
      }
      return broken_.ok() ? TimedOut() : broken_;
    }
    DrainBuffered(l);
    return Status::OK();
  }

  template <typename Value>
  Result<std::vector<Status>> PutLeased(std::span<const Value> bundles) {
    std::vector<Status> out(bundles.size());
    std::vector<size_t> fallback;
    // The groups, each asked for with one PUT_LEASE.
    std::vector<std::unique_ptr<LeaseCall>> leases;
    for (size_t i = 0; i < bundles.size();) {
      if (SizeOf(bundles[i]) > UINT32_MAX) {  // the daemon refuses it its own way
        fallback.push_back(i++);
        continue;
      }
      auto call = std::make_unique<LeaseCall>();
      call->first = i;
      uint64_t asked = 0;
      while (i < bundles.size() && call->count < w::kMaxBatchItems && SizeOf(bundles[i]) <= UINT32_MAX &&
             (call->count == 0 || asked + SizeOf(bundles[i]) <= kLeaseBytes)) {
        asked += SizeOf(bundles[i]);
        ++call->count;
        ++i;
      }
      call->bytes = asked;
      leases.push_back(std::move(call));
    }
    auto ask = [&](LeaseCall& call) -> Status {
      w::PutLeaseRequest req;
      for (size_t i = call.first; i < call.first + call.count; ++i) {
        req.items.push_back({bundles[i].hash, static_cast<uint32_t>(SizeOf(bundles[i]))});
      }
      SPARSEKV_ASSIGN_OR_RETURN(call.id, SendFrame(w::Opcode::kPutLease, w::Encode(req), &call.waiter));
      return Status::OK();
    };
    std::vector<std::unique_ptr<CommitCall>> commits;
    Status failed;
    for (size_t g = 0; g < leases.size() && failed.ok(); ++g) {
      if (g == 0) failed = ask(*leases[0]);
      if (failed.ok()) failed = WaitAll(std::span(&leases[g], 1));
      if (failed.ok() && g + 1 < leases.size()) failed = ask(*leases[g + 1]);  // overlaps this group's copy
      if (!failed.ok()) break;
      LeaseCall& call = *leases[g];
      Result<Frame> f = std::move(*call.waiter.result);
      if (!f.ok()) {
        failed = f.status();
        break;
      }
      Result<w::ShmViewReply> r = w::DecodeShmViewReply(f->payload);
      if (!r.ok() || r->items.status.size() != call.count) {
        failed = r.ok() ? Status::Internal("PUT_LEASE answered the wrong number of items") : r.status();
        break;
      }
      w::PutCommitRequest c;
      c.lease = r->lease;
      auto current = std::make_unique<CommitCall>();
      uint64_t since = 0;
      auto flush = [&](uint32_t next_first) {
        if (!c.checksums.empty() && failed.ok()) {
          auto id = SendFrame(w::Opcode::kPutCommit, w::Encode(c), &current->waiter);
          if (!id.ok()) {
            failed = id.status();
          } else {
            current->id = *id;
            commits.push_back(std::move(current));
            current = std::make_unique<CommitCall>();
          }
        }
        c.checksums.clear();
        current->items.clear();
        c.first = next_first;
        since = 0;
      };
      size_t slot = 0;
      uint64_t left = 0;  // bytes of the group not yet written
      for (size_t k = 0; k < call.count; ++k) left += SizeOf(bundles[call.first + k]);
      for (size_t k = 0; k < call.count && failed.ok(); ++k) {
        const size_t i = call.first + k;
        const w::ItemStatus& st = r->items.status[k];
        if (st.code != StatusCode::kOk) {
          left -= SizeOf(bundles[i]);
          flush(static_cast<uint32_t>(k + 1));
          if (st.code == StatusCode::kResourceExhausted || st.code == StatusCode::kFailedPrecondition) {
            fallback.push_back(i);  // no room leased: the staging area carries it
          } else {
            out[i] = FromItem(st);
          }
          continue;
        }
        if (slot >= r->items.slots.size()) {
          failed = Status::Internal("PUT_LEASE named fewer rooms than OK items");
          break;
        }
        const w::ShmSlot& room = r->items.slots[slot++];
        const uint64_t n = SizeOf(bundles[i]);
        constexpr uint64_t kHeaderTail = 48;  // the record's header bytes before the value
        if (room.bytes != n || room.offset < kHeaderTail || room.offset > arena_bytes_ ||
            n > arena_bytes_ - room.offset) {
          failed = Status::Internal("PUT_LEASE named room outside the host arena");
          break;
        }
        // Checksum 0: the daemon computes the record's checksum over the bytes as they lie when
        // it takes the commit, on its own core, while this thread writes the next part (measured
        // on a 2-vCPU EPYC VM, 6 MiB x 16: 0.71-0.74x memcpy with the hash computed here as the
        // bytes land, 0.74-0.90x without).
        CopyValue(bundles[i], arena_rw_ + room.offset, call.bytes >= kStreamGroupBytes);
        c.checksums.push_back(0);
        current->items.push_back(i);
        since += n;
        left -= n;
        // Smaller commits toward the group's end: the daemon's check of the last one is what
        // this thread waits for.
        if (since >= (left < kCommitBytes ? kCommitBytes / 4 : kCommitBytes)) flush(static_cast<uint32_t>(k + 1));
      }
      flush(0);
    }
    // Every reply is waited for, even after a failure: no reply may land in a frame gone.
    Status waited = WaitAll(leases);
    if (Status st = WaitAll(commits); waited.ok()) waited = st;
    SPARSEKV_RETURN_IF_ERROR(failed);
    SPARSEKV_RETURN_IF_ERROR(waited);
    for (auto& x : commits) {
      SPARSEKV_ASSIGN_OR_RETURN(auto part, ParseStatusList(std::move(*x->waiter.result), x->items.size()));
      for (size_t j = 0; j < part.size(); ++j) out[x->items[j]] = std::move(part[j]);
    }
    if (!fallback.empty()) {
      std::vector<Value> rest;
      for (size_t i : fallback) rest.push_back(bundles[i]);
      SPARSEKV_ASSIGN_OR_RETURN(auto got, PutShared(std::span<const Value>(rest)));
      for (size_t k = 0; k < fallback.size(); ++k) out[fallback[k]] = std::move(got[k]);
    }
    return out;
  }

  // PUTs over the socket, as many frames as the daemon's maximum payload needs. A bundle too
  // large for any frame is answered ResourceExhausted here, without sending it: the daemon
  // would close the connection on a frame past its maximum.
  template <typename Value>
  Result<std::vector<Status>> PutSocket(std::span<const Value> bundles) {
    const uint64_t limit = hello_.max_payload_bytes;
    auto alone = [&](size_t i) { return 4 + 16 + 4 + SizeOf(bundles[i]); };
    std::vector<Status> out(bundles.size());
    // Parts of about kPutPartBytes sent while the daemon stores the ones before (PutShared's
    // comment), at most kPutSocketWindowBytes unanswered.
    const uint64_t part_limit = std::min<uint64_t>(limit, kPutPartBytes);
    const bool one_at_a_time = NamesAKeyTwice(bundles);
    std::deque<std::unique_ptr<PutCall>> flight;
    uint64_t sent = 0;  // bytes of the batch sent so far
    Status failed;
    size_t i = 0;
    while (i < bundles.size() && failed.ok()) {
      if (alone(i) > limit) {
        out[i] = Status::ResourceExhausted(fmt::format(
            "a value of {} bytes does not fit sparsekvd's largest frame of {} bytes", SizeOf(bundles[i]), limit));
        ++i;
        continue;
      }
      w::PutRequest req;
      std::vector<std::vector<std::byte>> scratch;  // values of several pieces, gathered
      auto call = std::make_unique<PutCall>();
      uint64_t size = 4;
      while (i < bundles.size() && req.items.size() < w::kMaxBatchItems && alone(i) <= limit) {
        const uint64_t item = 16 + 4 + SizeOf(bundles[i]);
        if (!req.items.empty() && size + item > part_limit) break;
        req.items.push_back({bundles[i].hash, ValueSpan(bundles[i], scratch)});
        call->items.push_back(i++);
        size += item;
      }
      call->begin = sent;
      call->end = sent += size;
      while (!flight.empty() && failed.ok() &&
             (one_at_a_time || call->end - flight.front()->begin > kPutSocketWindowBytes)) {
        failed = FinishOldestPut(flight, out);
      }
      if (!failed.ok()) break;
      std::vector<std::byte> framing;
      failed = SendPart(w::Opcode::kPut, w::EncodePieces(req, framing), std::move(call), flight);
    }
    FinishAllPuts(flight, out, failed);
    SPARSEKV_RETURN_IF_ERROR(failed);
    return out;
  }

  // Copies the bundles an SHM_GET reply names out of the GET area into `out`; the indexes of
  // items too large for the area, to be fetched with GET, go to `too_big`.
  Status CopyOutShmGet(const Frame& f, size_t n, std::vector<GetResult>* out, std::vector<size_t>* too_big) const {
    SPARSEKV_ASSIGN_OR_RETURN(w::ShmGetReply r, w::DecodeShmGetReply(f.payload));
    if (r.status.size() != n) return Status::Internal("SHM_GET answered the wrong number of items");
    out->resize(n);
    size_t slot = 0;
    for (size_t i = 0; i < n; ++i) {
      if (r.status[i].code == StatusCode::kResourceExhausted) {  // larger than the GET area
        too_big->push_back(i);
        continue;
      }
      GetResult& g = (*out)[i];
      g.status = FromItem(r.status[i]);
      if (!g.status.ok()) {
        g.bytes.clear();
        continue;
      }
      if (slot >= r.slots.size()) return Status::Internal("SHM_GET named fewer slots than OK items");
      const w::ShmSlot& s = r.slots[slot++];
      const std::byte* src = SlotBytes(s);
      if (src == nullptr) {
        g.status = Status::Internal("SHM_GET named bytes outside the shared areas");
        continue;
      }
      g.bytes.assign(src, src + s.bytes);
    }
    return Status::OK();
  }

  Result<std::vector<GetResult>> GetShared(std::span<const WireBlockHash> hashes) {
    std::vector<GetResult> out;
    SPARSEKV_RETURN_IF_ERROR(GetShared(hashes, out));
    return out;
  }

  // SHM_GET into `out`, each item's bytes copied into its buffer there (reused when large
  // enough); what does not fit the GET area goes over the socket, into the same buffers.
  Status GetShared(std::span<const WireBlockHash> hashes, std::vector<GetResult>& out) {
    std::vector<size_t> too_big;
    {
      // The daemon writes into the GET half; nothing else may ask for it until we copied out.
      SPARSEKV_RETURN_IF_ERROR(Acquire(kGetArea));
      auto verdicts = ShmGetOverlap(hashes, [&](const Frame& f) { return CopyOutShmGet(f, hashes.size(), &out, &too_big); });
      Release(kGetArea);
      SPARSEKV_RETURN_IF_ERROR(verdicts.status());
      for (size_t i = 0; i < hashes.size(); ++i) {
        if ((*verdicts)[i] != 0 && out[i].status.ok()) {
          out[i].status = Status::Corruption("the bundle failed its checksum as sparsekvd lent it");
          out[i].bytes.clear();
        }
      }
    }
    if (!too_big.empty()) {
      std::vector<WireBlockHash> subset;
      std::vector<GetResult> rest(too_big.size());
      for (size_t k = 0; k < too_big.size(); ++k) {
        subset.push_back(hashes[too_big[k]]);
        rest[k] = std::move(out[too_big[k]]);
      }
      Status st = GetReusingSocket(subset, rest);
      for (size_t k = 0; k < rest.size(); ++k) out[too_big[k]] = std::move(rest[k]);
      SPARSEKV_RETURN_IF_ERROR(st);
    }
    return Status::OK();
  }

  // SHM_GET_OVERLAP (api/PROTOCOL.md): the reply names where each bundle lies, and the daemon
  // checks the ones it lent while the caller copies them; `copy` runs on the reply, then the
  // verdicts come. Returns them, one per hash (1: that item's bytes failed their check).
  template <typename Copy>
  Result<std::vector<uint8_t>> ShmGetOverlap(std::span<const WireBlockHash> hashes, Copy&& copy) {
    Waiter waiter;
    waiter.verdicts_expected = true;
    w::HashList req{{hashes.begin(), hashes.end()}};
    auto id = SendFrame(w::Opcode::kShmGetOverlap, w::Encode(req), &waiter);
    if (!id.ok()) {
      AbandonAreas();
      return id.status();
    }
    auto fail = [&](std::unique_lock<std::mutex>&, Status st) {
      pending_.erase(*id);  // nothing more is delivered to this stack frame
      AbandonAreas();  // the daemon may still write the GET area: it cannot be reused
      return st;
    };
    Result<Frame> reply = Status::OK();
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!WaitReading(l, Clock::now() + timeout_, [&] { return waiter.result.has_value(); })) {
        return fail(l, waiter.result && !waiter.result->ok() ? waiter.result->status()
                                                             : broken_.ok() ? TimedOut() : broken_);
      }
      reply = std::move(*waiter.result);
      if (!reply.ok()) {
        pending_.erase(*id);
        return fail(l, reply.status());
      }
    }
    Status copied = copy(*reply);
    std::unique_lock<std::mutex> l(mu_);
    if (!WaitReading(l, Clock::now() + timeout_, [&] { return waiter.verdicts.has_value(); })) {
      return fail(l, broken_.ok() ? TimedOut() : broken_);
    }
    DrainBuffered(l);
    if (!copied.ok()) return copied;
    if (waiter.verdicts->size() != hashes.size()) {
      return Status::Internal("SHM_VERDICTS answered the wrong number of items");
    }
    return std::move(*waiter.verdicts);
  }

  // ---- GET into the caller's memory ----

  // GETs over the socket whose replies are read into targets (IntoTarget), `targets[k]` for
  // items `index[k]` of `hashes`: every request is sent, then every reply read (pipelined), each
  // within the largest frame. Returns per request the items the daemon deferred (indexes into
  // `hashes`). On a failure the connection is given up, and this returns only once no reader
  // writes into the targets any more.
  struct IntoRequest {
    std::vector<size_t> index;  // items of `hashes`
    IntoTarget target;
    Waiter waiter;
    uint64_t id = 0;
    bool sent = false;
  };
  Status RunIntoRequests(std::span<const WireBlockHash> hashes, std::vector<std::unique_ptr<IntoRequest>>& reqs,
                         std::vector<size_t>* deferred) {
    Status failed;
    for (auto& r : reqs) {
      r->waiter.into = &r->target;
      w::HashList list;
      list.hashes.reserve(r->index.size());
      for (size_t i : r->index) list.hashes.push_back(hashes[i]);
      auto id = SendFrame(w::Opcode::kGet, w::Encode(list), &r->waiter);
      if (!id.ok()) {
        failed = id.status();
        break;
      }
      r->id = *id;
      r->sent = true;
    }
    std::unique_lock<std::mutex> l(mu_);
    auto all_answered = [&] {
      for (auto& r : reqs) {
        if (r->sent && !r->waiter.result.has_value()) return false;
      }
      return true;
    };
    if (failed.ok() && !WaitReading(l, Clock::now() + timeout_, all_answered)) {
      failed = broken_.ok() ? TimedOut() : broken_;
    }
    if (!failed.ok()) {
      // Nothing may be written into the caller's memory once we return: forget the requests,
      // and wait for a reader in the middle of one of their replies (the shutdown ends it).
      for (auto& r : reqs) {
        if (r->sent) pending_.erase(r->id);
      }
      l.unlock();
      AbandonAreas();
      l.lock();
      cv_.wait(l, [&] {
        for (auto& r : reqs) {
          if (r->target.busy) return false;
        }
        return true;
      });
      return failed;
    }
    DrainBuffered(l);
    l.unlock();
    for (auto& r : reqs) {
      Result<Frame>& f = *r->waiter.result;
      if (!f.ok()) return f.status();
      if (f->into == nullptr) return Status::Internal("a GET reply was not read into its destinations");
      for (size_t k : f->get_deferred) deferred->push_back(r->index[k]);
    }
    return Status::OK();
  }

  // GetInto over the socket, for items `todo` of `hashes`.
  Status GetIntoSocket(std::span<const WireBlockHash> hashes, std::span<const std::span<std::byte>> dests,
                       std::vector<size_t> todo, std::vector<GetIntoResult>& out) {
    const uint64_t limit = hello_.max_payload_bytes;
    while (!todo.empty()) {
      // Requests whose replies fit one frame by the destinations' sizes (at least one item each).
      std::vector<std::unique_ptr<IntoRequest>> reqs;
      uint64_t size = 0;
      for (size_t i : todo) {
        const uint64_t item = 6 + dests[i].size();  // status, length, bytes, verdict
        if (reqs.empty() || reqs.back()->index.size() == w::kMaxBatchItems || size + item > limit) {
          reqs.push_back(std::make_unique<IntoRequest>());
          size = 4;
        }
        reqs.back()->index.push_back(i);
        size += item;
      }
      std::vector<std::vector<std::span<std::byte>>> spans(reqs.size());
      std::vector<std::vector<GetIntoResult>> results(reqs.size());
      for (size_t k = 0; k < reqs.size(); ++k) {
        for (size_t i : reqs[k]->index) spans[k].push_back(dests[i]);
        results[k].resize(reqs[k]->index.size());
        reqs[k]->target.dests = spans[k];
        reqs[k]->target.results = &results[k];
      }
      std::vector<size_t> deferred;
      SPARSEKV_RETURN_IF_ERROR(RunIntoRequests(hashes, reqs, &deferred));
      std::vector<bool> again(hashes.size(), false);
      for (size_t i : deferred) again[i] = true;
      for (size_t k = 0; k < reqs.size(); ++k) {
        for (size_t j = 0; j < reqs[k]->index.size(); ++j) {
          const size_t i = reqs[k]->index[j];
          if (!again[i]) out[i] = std::move(results[k][j]);
        }
      }
      if (deferred.size() == todo.size()) return Status::Internal("sparsekvd deferred every item of a GET");
      todo = std::move(deferred);
    }
    return Status::OK();
  }

  // Where an SHM_GET slot's bytes lie in this process: the GET area or the arena; null when
  // the slot names bytes outside both.
  const std::byte* SlotBytes(const w::ShmSlot& s) const {
    if (s.offset >= staging_bytes_) {  // lent in place from the host arena
      const uint64_t at = s.offset - staging_bytes_;
      if (arena_ == nullptr || at > arena_bytes_ || s.bytes > arena_bytes_ - at) return nullptr;
      return arena_ + at;
    }
    if (s.offset < staging_bytes_ / 2 || s.bytes > staging_bytes_ - s.offset) return nullptr;
    return staging_ + s.offset;
  }

  // GetInto over shared memory: SHM_GETs of as many items as their destinations let fit the GET
  // area (and the most the daemon lends at a time), each copied from where the daemon put or lent
  // it straight into its destination. What does not fit goes over the socket.
  Status GetIntoShared(std::span<const WireBlockHash> hashes, std::span<const std::span<std::byte>> dests,
                       std::vector<GetIntoResult>& out) {
    uint64_t all = 0;
    for (const auto& d : dests) all += d.size();
    const bool stream = all >= kStreamReadBytes;
    // Local reads first: what this client may read again without asking.
    std::vector<size_t> todo;
    todo.reserve(hashes.size());
    // Not once the connection broke: the daemon may be gone (its arena and table, still mapped
    // here, then never change again), and the daemon path reports the error.
    if (table_ != nullptr && Connected()) {
      std::vector<WireBlockHash> read;
      ReadLocally(hashes, dests, stream, out, todo, read);
      if (!read.empty()) NoteLocalReads(read);
      if (todo.empty()) return Status::OK();
    } else {
      for (size_t i = 0; i < hashes.size(); ++i) todo.push_back(i);
    }
    std::vector<size_t> by_socket;
    SPARSEKV_RETURN_IF_ERROR(Acquire(kGetArea));
    const uint64_t half = staging_bytes_ / 2;
    bool lent = false;
    Status st;
    size_t t = 0;
    while (st.ok() && t < todo.size()) {
      w::HashList req;
      std::vector<size_t> index;
      uint64_t sum = 0;
      while (t < todo.size() && index.size() < w::kMaxBatchItems) {
        const size_t i = todo[t];
        const uint64_t need = (dests[i].size() + 63) & ~uint64_t{63};
        if (need > half) {
          by_socket.push_back(i);
          ++t;
          continue;
        }
        if (sum + need > half) break;
        sum += need;
        req.hashes.push_back(hashes[i]);
        index.push_back(i);
        ++t;
      }
      if (index.empty()) continue;
      std::vector<std::pair<size_t, LocalEntry>> learned;  // (item of `index`, its entry)
      auto verdicts = ShmGetOverlap(req.hashes, [&](const Frame& f) -> Status {
        auto r = w::DecodeShmGetReply(f.payload);
        if (!r.ok() || r->status.size() != index.size()) {
          return r.ok() ? Status::Internal("SHM_GET answered the wrong number of items") : r.status();
        }
        return CopyInto(*r, index, dests, out, by_socket, lent, stream, &learned);
      });
      if (!verdicts.ok()) {
        st = verdicts.status();
        break;
      }
      for (size_t k = 0; k < index.size(); ++k) {
        GetIntoResult& g = out[index[k]];
        if ((*verdicts)[k] != 0 && g.status.ok()) {
          g.status = Status::Corruption("the bundle failed its checksum as sparsekvd lent it");
        }
      }
      // Only what passed the daemon's check is read again locally.
      for (const auto& [k, e] : learned) {
        if ((*verdicts)[k] == 0 && out[index[k]].status.ok()) LearnLocal(req.hashes[k], e);
      }
    }
    // The pins go back now rather than at the next SHM_GET; the answer is not waited for.
    if (lent && st.ok()) SendWithCallback(w::Opcode::kShmRelease, w::Encode(w::HashList{}), [](Result<Frame>) {});
    Release(kGetArea);
    SPARSEKV_RETURN_IF_ERROR(st);
    if (by_socket.empty()) return Status::OK();
    std::sort(by_socket.begin(), by_socket.end());
    return GetIntoSocket(hashes, dests, std::move(by_socket), out);
  }

  // Copies the bundles an SHM_GET reply for items `index` names into their destinations.
  // With `stream`, with streaming stores (CopyBytes).
  // Slots lent with a token go to `learned` (local reads), once copied.
  Status CopyInto(const w::ShmGetReply& r, const std::vector<size_t>& index,
                  std::span<const std::span<std::byte>> dests, std::vector<GetIntoResult>& out,
                  std::vector<size_t>& by_socket, bool& lent, bool stream,
                  std::vector<std::pair<size_t, LocalEntry>>* learned) const {
    const bool with_lend = !r.lend.empty() && r.lend.size() == r.slots.size();
    size_t slot = 0;
    for (size_t k = 0; k < index.size(); ++k) {
      GetIntoResult& g = out[index[k]];
      if (r.status[k].code == StatusCode::kResourceExhausted) {  // no room in the GET area
        by_socket.push_back(index[k]);
        continue;
      }
      g.status = FromItem(r.status[k]);
      if (!g.status.ok()) continue;
      if (slot >= r.slots.size()) return Status::Internal("SHM_GET named fewer slots than OK items");
      const w::ShmSlot& s = r.slots[slot++];
      const std::byte* src = SlotBytes(s);
      g.bytes = s.bytes;
      if (src == nullptr) {
        g.status = Status::Internal("SHM_GET named bytes outside the shared areas");
      } else if (s.bytes > dests[index[k]].size()) {
        g.status = Status::OutOfRange(fmt::format("a value of {} bytes does not fit its destination of {} bytes",
                                                  s.bytes, dests[index[k]].size()));
      } else {
        CopyBytes(dests[index[k]].data(), src, s.bytes, stream);
        LocalEntry e;
        if (with_lend && learned != nullptr && LocalEntryOf(s, r.lend[slot - 1], &e)) learned->push_back({k, e});
      }
      lent |= s.offset >= staging_bytes_;
    }
    return Status::OK();
  }

  // Get into reused results over the socket: as GetSocket, each reply read into `results`.
  Status GetReusingSocket(std::span<const WireBlockHash> hashes, std::vector<GetResult>& results) {
    std::vector<size_t> todo(hashes.size());
    for (size_t i = 0; i < todo.size(); ++i) todo[i] = i;
    while (!todo.empty()) {
      std::vector<std::unique_ptr<IntoRequest>> reqs(1);
      reqs[0] = std::make_unique<IntoRequest>();
      reqs[0]->index = todo;
      std::vector<GetResult> part(todo.size());
      for (size_t k = 0; k < todo.size(); ++k) part[k] = std::move(results[todo[k]]);
      reqs[0]->target.reuse = &part;
      std::vector<size_t> deferred;
      Status st = RunIntoRequests(hashes, reqs, &deferred);
      for (size_t k = 0; k < todo.size(); ++k) results[todo[k]] = std::move(part[k]);
      SPARSEKV_RETURN_IF_ERROR(st);
      if (deferred.size() == todo.size()) return Status::Internal("sparsekvd deferred every item of a GET");
      todo = std::move(deferred);
    }
    return Status::OK();
  }

  // ---- callback forms ----

  void SendWithCallback(w::Opcode op, std::span<const std::byte> payload, FrameCallback cb) {
    SendWithCallback(op, Pieces(&payload, 1), std::move(cb));
  }
  void SendWithCallback(w::Opcode op, Pieces pieces, FrameCallback cb) {
    auto shared_cb = std::make_shared<FrameCallback>(std::move(cb));
    auto id = SendFrame(op, pieces, FrameCallback([shared_cb](Result<Frame> f) { (*shared_cb)(std::move(f)); }));
    if (!id.ok()) (*shared_cb)(id.status());
  }

  void GetWithCallback(std::vector<WireBlockHash> hashes, GetCallback done) {
    if (!shared() || !TryAcquire(kGetArea)) {  // the GET area is in use: the socket carries it
      GetSocketWithCallback(std::move(hashes), std::move(done));
      return;
    }
    auto keep = std::make_shared<std::vector<WireBlockHash>>(std::move(hashes));
    SendWithCallback(w::Opcode::kShmGet, w::Encode(w::HashList{*keep}),
                     [this, keep, done = std::move(done)](Result<Frame> f) mutable {
                       std::vector<GetResult> out;
                       std::vector<size_t> too_big;
                       Status st = f.ok() ? CopyOutShmGet(*f, keep->size(), &out, &too_big) : f.status();
                       Release(kGetArea);
                       if (!st.ok()) return done(st);
                       if (too_big.empty()) return done(std::move(out));
                       std::vector<WireBlockHash> rest;
                       for (size_t i : too_big) rest.push_back((*keep)[i]);
                       GetSocketWithCallback(
                           std::move(rest),
                           [out = std::move(out), too_big, done = std::move(done)](Result<std::vector<GetResult>> r) mutable {
                             if (!r.ok()) return done(r.status());
                             for (size_t k = 0; k < r->size(); ++k) out[too_big[k]] = std::move((*r)[k]);
                             done(std::move(out));
                           });
                     });
  }

  void GetSocketWithCallback(std::vector<WireBlockHash> hashes, GetCallback done) {
    auto keep = std::make_shared<const std::vector<WireBlockHash>>(std::move(hashes));
    SendWithCallback(w::Opcode::kGet, w::Encode(w::HashList{*keep}),
                     [this, keep, done = std::move(done)](Result<Frame> f) mutable {
                       auto part = ParseGetPart(std::move(f), keep->size());
                       if (!part.ok()) return done(part.status());
                       FinishGetWithCallback(keep, std::move(*part), std::move(done));
                     });
  }

  void PutWithCallback(std::span<const BundleRef> bundles, StatusesCallback done) {
    uint64_t total = 0;
    for (const BundleRef& b : bundles) total += (b.bytes.size() + 63) & ~uint64_t{63};
    const size_t n = bundles.size();
    if (shared() && total <= staging_bytes_ / 2 && n <= w::kMaxBatchItems && TryAcquire(kPutArea)) {
      w::ShmPutRequest req;
      size_t off = 0;
      for (const BundleRef& b : bundles) {
        std::memcpy(staging_ + off, b.bytes.data(), b.bytes.size());
        req.slots.push_back({b.hash, off, static_cast<uint32_t>(b.bytes.size())});
        off += (b.bytes.size() + 63) & ~size_t{63};
      }
      SendWithCallback(w::Opcode::kShmPut, w::Encode(req), [this, n, done = std::move(done)](Result<Frame> f) {
        Release(kPutArea);
        done(ParseStatusList(std::move(f), n));
      });
      return;
    }
    w::PutRequest req;
    for (const BundleRef& b : bundles) req.items.push_back({b.hash, b.bytes});
    std::vector<std::byte> framing;
    SendWithCallback(w::Opcode::kPut, w::EncodePieces(req, framing),
                     [n, done = std::move(done)](Result<Frame> f) { done(ParseStatusList(std::move(f), n)); });
  }

  bool shared() const { return staging_ != nullptr; }
  uint64_t local_reads() const { return local_reads_.load(std::memory_order_relaxed); }

  // ---- local reads (api/PROTOCOL.md) ----

  // Local reads of a GetInto: item i's value is copied into dests[i] straight from the arena
  // when this client holds a token for it and the record's lend-table entry still has the
  // value the token names before and after the copy (the record was its key's copy throughout:
  // erasing, replacing or evicting it changes the entry before its room can be written again).
  // With check_local_, the bytes copied are also checked against the record's checksum. The
  // items not read so go to `todo`, for the daemon (entries gone stale are forgotten); the
  // hashes read, to `read`.
  void ReadLocally(std::span<const WireBlockHash> hashes, std::span<const std::span<std::byte>> dests, bool stream,
                   std::vector<GetIntoResult>& out, std::vector<size_t>& todo, std::vector<WireBlockHash>& read) {
    const size_t n = hashes.size();
    std::vector<LocalEntry> entries(n);
    std::vector<uint8_t> known(n, 0);
    {
      std::lock_guard<std::mutex> l(local_mu_);
      if (local_.empty()) {
        for (size_t i = 0; i < n; ++i) todo.push_back(i);
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        auto it = local_.find(hashes[i]);
        if (it == local_.end()) continue;
        entries[i] = it->second;
        known[i] = 1;
      }
    }
    std::vector<size_t> stale;
    for (size_t i = 0; i < n; ++i) {
      const LocalEntry& e = entries[i];
      // Unknown, or a destination too small (the daemon answers OutOfRange): ask.
      if (!known[i] || e.bytes > dests[i].size()) {
        todo.push_back(i);
        continue;
      }
      const uint32_t* slot = table_ + e.record_off / kLendUnit;
      const uint32_t before = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
      bool good = before + 1 == e.token;
      if (good && check_local_) {
        // The record's checksum (bundle.h): its header from byte 16, then the value, over the
        // bytes as they are copied (one pass; a record of one segment has 48 such header bytes).
        // (LocalEntryOf keeps only records whose covered header is those 48 bytes.)
        const std::byte* header = arena_ + e.record_off + 16;
        good = CopyWithRecordChecksum(dests[i].data(), arena_ + e.value_off, e.bytes, header) == e.checksum;
      } else if (good) {
        CopyBytes(dests[i].data(), arena_ + e.value_off, e.bytes, stream);
      }
      if (good) {
        // Every byte copied was read before the entry is read again.
        std::atomic_thread_fence(std::memory_order_acquire);
        good = good && __atomic_load_n(slot, __ATOMIC_RELAXED) == before;
      }
      if (!good) {
        stale.push_back(i);
        todo.push_back(i);
        continue;
      }
      out[i].status = Status::OK();
      out[i].bytes = e.bytes;
      read.push_back(hashes[i]);
    }
    if (stale.empty()) return;
    std::lock_guard<std::mutex> l(local_mu_);
    for (size_t i : stale) {
      auto it = local_.find(hashes[i]);
      if (it != local_.end() && it->second.token == entries[i].token && it->second.record_off == entries[i].record_off) {
        local_.erase(it);
      }
    }
  }

  // What an SHM_GET reply says of a slot lent in place, as a local entry; false when it may not
  // be read again (no token) or names bytes outside the arena or the table.
  bool LocalEntryOf(const w::ShmSlot& s, const w::LendInfo& lend, LocalEntry* e) const {
    if (table_ == nullptr || lend.token == 0 || s.offset < staging_bytes_) return false;
    const uint64_t value = s.offset - staging_bytes_;
    const uint64_t rec = lend.record_offset;
    // A one-value record: its header is 64 bytes, 48 of them covered by its checksum.
    if (rec % kLendUnit != 0 || value < rec || value - rec != 16 + kRecordChecksumPrefixBytes ||
        rec / kLendUnit >= table_entries_ ||
        value > arena_bytes_ || s.bytes > arena_bytes_ - value) {
      return false;
    }
    *e = {rec, value, s.bytes, lend.token, lend.checksum};
    return true;
  }

  void LearnLocal(const WireBlockHash& hash, const LocalEntry& e) {
    std::lock_guard<std::mutex> l(local_mu_);
    if (local_.size() >= kMaxLocalEntries) local_.clear();  // bounded: the next reads ask again
    local_[hash] = e;
  }

  // Tells the daemon about local reads (TOUCH, no reply), so that its eviction order and
  // statistics see them: at most one frame per millisecond, the reads since in it.
  void NoteLocalReads(std::span<const WireBlockHash> hashes) {
    local_reads_.fetch_add(hashes.size(), std::memory_order_relaxed);
    std::vector<WireBlockHash> send;
    {
      std::lock_guard<std::mutex> l(local_mu_);
      for (const WireBlockHash& h : hashes) {
        if (touched_.size() < w::kMaxBatchItems) touched_.push_back(h);
      }
      const auto now = Clock::now();
      if (now - last_touch_ < std::chrono::milliseconds(1)) return;
      last_touch_ = now;
      send.swap(touched_);
    }
    SendOneWay(w::Opcode::kTouch, w::Encode(w::HashList{std::move(send)})).IgnoreError();
  }

  // A frame no reply answers (TOUCH). A failure breaks the connection (a daemon gone: the
  // next call reports it, and no local read is made on a broken connection).
  Status SendOneWay(w::Opcode op, std::span<const std::byte> payload) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!broken_.ok()) return broken_;
    }
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
    auto header = w::EncodeFrameHeader(op, 0, id, Pieces(&payload, 1));
    iovec iov[2] = {{header.data(), header.size()}, {const_cast<std::byte*>(payload.data()), payload.size()}};
    Status st;
    {
      std::lock_guard<std::mutex> l(write_mu_);
      st = WriteAllV(fd_, iov, payload.empty() ? 1 : 2);
    }
    if (!st.ok()) {
      std::unique_lock<std::mutex> l(mu_);
      Break(l, st);
    }
    return st;
  }

  // Whether the connection still stands (as far as this client knows).
  bool Connected() {
    std::lock_guard<std::mutex> l(mu_);
    return broken_.ok();
  }

  // Ends a SHM_VIEW lease, without waiting for the answer (read by whoever reads next).
  void EndView(uint64_t lease) {
    std::vector<std::byte> payload = w::EncodeLease(lease);
    SendWithCallback(w::Opcode::kShmViewEnd, payload, [](Result<Frame>) {});
  }

  int fd_ = -1;
  int wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // -1 if none: waits then end at their deadline
  bool is_unix_ = false;
  std::chrono::milliseconds timeout_{30000};
  std::chrono::microseconds spin_{0};
  w::HelloReply hello_;
  std::byte* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  const std::byte* arena_ = nullptr;  // the daemon's host arena, read-only (one-namespace daemons)
  std::byte* arena_rw_ = nullptr;     // the same mapping, when write leases were granted
  bool ask_leases_ = false;
  uint64_t arena_bytes_ = 0;
  // Local reads (api/PROTOCOL.md): the lend table, read-only, and what this client learned of
  // the records lent to it. An entry stays usable while the record's table entry keeps the
  // value its token names.
  static constexpr uint64_t kLendUnit = 4096;
  static constexpr size_t kMaxLocalEntries = size_t{1} << 20;
  bool ask_lend_table_ = false;
  const uint32_t* table_ = nullptr;
  uint64_t table_entries_ = 0;
  bool check_local_ = false;  // clients can write the arena (write leases): check what is read
  std::mutex local_mu_;  // guards what follows
  std::unordered_map<WireBlockHash, LocalEntry, WireHashHasher> local_;
  std::vector<WireBlockHash> touched_;  // read locally, not yet told (TOUCH)
  Clock::time_point last_touch_{};
  std::atomic<uint64_t> local_reads_{0};
  std::mutex write_mu_;    // one frame at a time on the socket
  std::mutex mu_;          // guards what follows, to the read-ahead buffer
  std::condition_variable cv_;
  std::map<uint64_t, Pending> pending_;
  bool role_taken_ = false;  // a thread is reading the socket
  bool area_busy_[2] = {false, false};  // the staging area's PUT and GET halves are in use
  bool reader_started_ = false;
  bool stop_ = false;
  Status broken_;
  std::atomic<bool> stopping_{false};
  // Read-ahead: touched by the thread holding the reader role, or under mu_ while none does.
  std::array<std::byte, 16384> rbuf_{};
  size_t rpos_ = 0, rend_ = 0;
  std::mutex cb_mu_;
  EventCallback on_event_;
  std::atomic<uint64_t> next_id_{1};
  std::thread reader_;
};

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_shared<Impl>();
  SPARSEKV_RETURN_IF_ERROR(impl->Open(options));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<LookupResult> Client::Lookup(std::span<const WireBlockHash> hashes) {
  w::HashList req{{hashes.begin(), hashes.end()}};
  return Impl::ParseLookup(impl_->Call(w::Opcode::kLookup, w::Encode(req)));
}

Result<std::vector<Status>> Client::Put(std::span<const BundleRef> bundles) {
  if (impl_->leases()) return impl_->PutLeased(bundles);
  return impl_->shared() ? impl_->PutShared(bundles) : impl_->PutSocket(bundles);
}

Result<std::vector<Status>> Client::PutPieces(std::span<const PiecesRef> values) {
  if (impl_->leases()) return impl_->PutLeased(values);
  return impl_->shared() ? impl_->PutShared(values) : impl_->PutSocket(values);
}

Result<std::vector<GetResult>> Client::Get(std::span<const WireBlockHash> hashes) {
  if (impl_->shared()) return impl_->GetShared(hashes);
  return impl_->GetSocket(hashes);
}

Status Client::Get(std::span<const WireBlockHash> hashes, std::vector<GetResult>& results) {
  results.resize(hashes.size());
  if (impl_->shared()) return impl_->GetShared(hashes, results);
  return impl_->GetReusingSocket(hashes, results);
}

Result<std::vector<GetIntoResult>> Client::GetInto(std::span<const WireBlockHash> hashes,
                                                   std::span<const std::span<std::byte>> destinations) {
  if (hashes.size() != destinations.size()) {
    return Status::InvalidArgument(
        fmt::format("GetInto: {} hashes and {} destinations", hashes.size(), destinations.size()));
  }
  std::vector<GetIntoResult> out(hashes.size());
  if (impl_->shared()) {
    SPARSEKV_RETURN_IF_ERROR(impl_->GetIntoShared(hashes, destinations, out));
  } else {
    std::vector<size_t> all(hashes.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    SPARSEKV_RETURN_IF_ERROR(impl_->GetIntoSocket(hashes, destinations, std::move(all), out));
  }
  return out;
}

struct ValueViews::State {
  std::shared_ptr<Client::Impl> owner;  // keeps the connection (and the arena's mapping) alive
  std::vector<uint64_t> leases;
  std::vector<Status> status;
  std::vector<std::span<const std::byte>> bytes;
  std::vector<bool> lent;
  std::vector<GetResult> copies;  // items read with GET
  uint64_t lent_bytes = 0;
};

ValueViews::ValueViews() = default;
ValueViews::~ValueViews() { Release(); }
ValueViews::ValueViews(ValueViews&&) noexcept = default;
ValueViews& ValueViews::operator=(ValueViews&& other) noexcept {
  if (this != &other) {
    Release();
    state_ = std::move(other.state_);
  }
  return *this;
}
size_t ValueViews::size() const { return state_ ? state_->status.size() : 0; }
const Status& ValueViews::status(size_t i) const { return state_->status.at(i); }
std::span<const std::byte> ValueViews::bytes(size_t i) const { return state_->bytes.at(i); }
bool ValueViews::lent(size_t i) const { return state_->lent.at(i); }
uint64_t ValueViews::lent_bytes() const { return state_ ? state_->lent_bytes : 0; }
void ValueViews::Release() {
  if (!state_) return;
  if (state_->owner) {
    for (uint64_t lease : state_->leases) state_->owner->EndView(lease);
  }
  state_.reset();
}

Result<ValueViews> Client::GetViews(std::span<const WireBlockHash> hashes) {
  ValueViews views;
  views.state_ = std::make_unique<ValueViews::State>();
  ValueViews::State& s = *views.state_;
  s.owner = impl_;
  s.status.resize(hashes.size());
  s.bytes.resize(hashes.size());
  s.lent.assign(hashes.size(), false);
  std::vector<size_t> copy;  // items to read with GET
  for (size_t first = 0; first < hashes.size(); first += w::kMaxBatchItems) {
    const size_t n = std::min<size_t>(w::kMaxBatchItems, hashes.size() - first);
    if (!shared_arena()) {
      for (size_t i = first; i < first + n; ++i) copy.push_back(i);
      continue;
    }
    w::HashList req{{hashes.begin() + first, hashes.begin() + first + n}};
    auto f = impl_->Call(w::Opcode::kShmView, w::Encode(req));
    if (!f.ok()) return f.status();  // views.state_ ends the leases taken so far
    SPARSEKV_ASSIGN_OR_RETURN(w::ShmViewReply r, w::DecodeShmViewReply(f->payload));
    if (r.lease != 0) s.leases.push_back(r.lease);
    if (r.items.status.size() != n) return Status::Internal("SHM_VIEW answered the wrong number of items");
    size_t slot = 0;
    for (size_t k = 0; k < n; ++k) {
      const size_t i = first + k;
      const StatusCode code = r.items.status[k].code;
      if (code == StatusCode::kFailedPrecondition || code == StatusCode::kResourceExhausted) {
        copy.push_back(i);  // not lendable: read with GET
        continue;
      }
      s.status[i] = FromItem(r.items.status[k]);
      if (code != StatusCode::kOk) continue;
      if (slot >= r.items.slots.size()) return Status::Internal("SHM_VIEW named fewer slots than OK items");
      const w::ShmSlot& sl = r.items.slots[slot++];
      const std::byte* src = sl.offset >= impl_->staging_bytes_ ? impl_->SlotBytes(sl) : nullptr;
      if (src == nullptr) return Status::Internal("SHM_VIEW named bytes outside the host arena");
      s.bytes[i] = {src, sl.bytes};
      s.lent[i] = true;
      s.lent_bytes += sl.bytes;
    }
  }
  if (!copy.empty()) {
    std::vector<WireBlockHash> subset;
    for (size_t i : copy) subset.push_back(hashes[i]);
    SPARSEKV_RETURN_IF_ERROR(Get(subset, s.copies));
    for (size_t k = 0; k < copy.size(); ++k) {
      s.status[copy[k]] = s.copies[k].status;
      s.bytes[copy[k]] = s.copies[k].bytes;
    }
  }
  return views;
}

Result<std::vector<GetResult>> Client::GetRanges(std::span<const RangesRequest> items) {
  std::vector<GetResult> out(items.size());
  const uint64_t max_reply = max_payload_bytes();
  size_t next = 0;
  while (next < items.size()) {
    // One request: as many items as keep both it and its reply within the maximum payload
    // (the daemon closes the connection on a request it must refuse whole, so every such case
    // is answered here, per item).
    w::GetRangesRequest req;
    std::vector<size_t> index;
    uint64_t bound = 4, request_bytes = 4, ranges = 0;
    for (; next < items.size(); ++next) {
      const RangesRequest& it = items[next];
      uint64_t bytes = 0;
      bool bad_range = it.ranges.empty();
      for (const ValueRange& r : it.ranges) {
        bytes += r.bytes;
        bad_range |= r.bytes == 0 || r.offset > UINT64_MAX - r.bytes;
      }
      const uint64_t cost = 5 + std::max<uint64_t>(bytes, w::kMaxRangesMessageBytes);
      const uint64_t item_bytes = 20 + 12 * uint64_t{it.ranges.size()};
      if (bad_range) {
        out[next].status =
            Status::InvalidArgument("GET_RANGES: an item with no range, a range of 0 bytes or one past 2^64");
        continue;
      }
      if (4 + cost > max_reply || 4 + item_bytes > max_reply || it.ranges.size() > w::kMaxRangesPerRequest) {
        out[next].status = Status::InvalidArgument(
            fmt::format("GET_RANGES: {} ranges of {} bytes in all do not fit one request and its reply within {} "
                        "bytes, or exceed {} ranges",
                        it.ranges.size(), bytes, max_reply, w::kMaxRangesPerRequest));
        continue;
      }
      if (!req.items.empty() &&
          (bound + cost > max_reply || request_bytes + item_bytes > max_reply ||
           ranges + it.ranges.size() > w::kMaxRangesPerRequest || req.items.size() == w::kMaxBatchItems)) {
        break;
      }
      bound += cost;
      request_bytes += item_bytes;
      ranges += it.ranges.size();
      w::RangeItem ri;
      ri.hash = it.hash;
      ri.ranges.reserve(it.ranges.size());
      for (const ValueRange& r : it.ranges) ri.ranges.push_back({r.offset, r.bytes});
      req.items.push_back(std::move(ri));
      index.push_back(next);
    }
    if (req.items.empty()) continue;
    auto f = impl_->Call(w::Opcode::kGetRanges, w::Encode(req));
    if (!f.ok()) return f.status();
    SPARSEKV_ASSIGN_OR_RETURN(w::GetRangesReply r, w::DecodeGetRangesReply(f->payload));
    if (r.items.size() != req.items.size()) {
      return Status::Internal(fmt::format("sparsekvd answered {} items for {}", r.items.size(), req.items.size()));
    }
    for (size_t k = 0; k < r.items.size(); ++k) {
      GetResult& g = out[index[k]];
      g.status = FromItem(r.items[k].status);
      if (!g.status.ok()) continue;
      uint64_t want = 0;
      for (const w::ByteRange& br : req.items[k].ranges) want += br.bytes;
      if (r.items[k].bytes.size() != want) {
        return Status::Internal(
            fmt::format("sparsekvd answered {} bytes for ranges of {}", r.items[k].bytes.size(), want));
      }
      g.bytes.assign(r.items[k].bytes.begin(), r.items[k].bytes.end());
    }
  }
  return out;
}

Result<std::vector<Status>> Client::Pin(std::span<const WireBlockHash> hashes, uint8_t priority) {
  w::PinRequest req{{hashes.begin(), hashes.end()}, priority};
  return Impl::ParseStatusList(impl_->Call(w::Opcode::kPin, w::Encode(req)), hashes.size());
}

Result<std::vector<Status>> Client::Unpin(std::span<const WireBlockHash> hashes) {
  w::HashList req{{hashes.begin(), hashes.end()}};
  return Impl::ParseStatusList(impl_->Call(w::Opcode::kUnpin, w::Encode(req)), hashes.size());
}

Result<std::vector<Status>> Client::Delete(std::span<const WireBlockHash> hashes) {
  w::HashList req{{hashes.begin(), hashes.end()}};
  return Impl::ParseStatusList(impl_->Call(w::Opcode::kDelete, w::Encode(req)), hashes.size());
}

Result<Client::HintResult> Client::Hint(std::span<const WireBlockHash> hashes, std::chrono::milliseconds ttl) {
  if (ttl.count() < 1 || ttl.count() > UINT32_MAX) {
    return Status::InvalidArgument(fmt::format("hint time to live {} ms: must be from 1 ms to 2^32 - 1 ms", ttl.count()));
  }
  w::HintRequest req{static_cast<uint32_t>(ttl.count()), {hashes.begin(), hashes.end()}};
  auto f = impl_->Call(w::Opcode::kHint, w::Encode(req));
  if (!f.ok()) return f.status();
  SPARSEKV_ASSIGN_OR_RETURN(w::HintReply r, w::DecodeHintReply(f->payload));
  if (r.found > hashes.size()) return Status::Corruption("HINT reply counts more blocks found than were hinted");
  return HintResult{r.hint, r.found, r.in_memory, r.prefetching};
}

Status Client::DropHint(uint64_t hint) {
  SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> st,
                            Impl::ParseStatusList(impl_->Call(w::Opcode::kHintDrop, w::EncodeHintDrop(hint)), 1));
  return st[0];
}

Status Client::LogAppend(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens) {
  w::LogAppendRequest m{request, first_token, {tokens.begin(), tokens.end()}};
  SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> st,
                            Impl::ParseStatusList(impl_->Call(w::Opcode::kLogAppend, w::Encode(m)), 1));
  return st[0];
}

Status Client::LogSuspended(uint64_t request, uint64_t state_tokens, const WireBlockHash& tail, uint64_t tag) {
  w::LogSuspendedRequest m{request, state_tokens, tail, tag};
  SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> st,
                            Impl::ParseStatusList(impl_->Call(w::Opcode::kLogSuspended, w::Encode(m)), 1));
  return st[0];
}

Status Client::LogFinish(uint64_t request) {
  SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> st, Impl::ParseStatusList(
                                                        impl_->Call(w::Opcode::kLogFinish, w::EncodeLogFinish(request)), 1));
  return st[0];
}

Result<std::vector<Client::LoggedRequest>> Client::LogRecover() {
  auto f = impl_->Call(w::Opcode::kLogRecover, std::span<const std::byte>{});
  if (!f.ok()) return f.status();
  SPARSEKV_ASSIGN_OR_RETURN(w::LogRecoverReply r, w::DecodeLogRecoverReply(f->payload));
  std::vector<LoggedRequest> out;
  for (w::LogRequestState& q : r.requests) {
    out.push_back(LoggedRequest{q.request, std::move(q.tokens), q.suspended, q.state_tokens, q.tail, q.tag});
  }
  return out;
}

Result<std::string> Client::Stats() {
  auto f = impl_->Call(w::Opcode::kStats, std::span<const std::byte>{});
  if (!f.ok()) return f.status();
  w::PayloadReader r(f->payload);
  SPARSEKV_ASSIGN_OR_RETURN(std::string json, r.String("STATS reply", w::kMaxPayloadBytes));
  return json;
}

Status Client::Ping() {
  const std::byte probe[4] = {std::byte{'p'}, std::byte{'i'}, std::byte{'n'}, std::byte{'g'}};
  auto f = impl_->Call(w::Opcode::kPing, probe);
  if (!f.ok()) return f.status();
  if (f->payload.size() != 4 || std::memcmp(f->payload.data(), probe, 4) != 0) {
    return Status::Internal("PING reply does not echo the request");
  }
  return Status::OK();
}

Status Client::Subscribe(EventCallback callback) {
  {
    std::lock_guard<std::mutex> l(impl_->cb_mu_);
    impl_->on_event_ = std::move(callback);
  }
  impl_->EnsureReaderThread();  // events arrive between calls too
  auto f = impl_->Call(w::Opcode::kSubscribe, std::span<const std::byte>{});
  return f.ok() ? Status::OK() : f.status();
}

std::future<Result<LookupResult>> Client::LookupAsync(std::vector<WireBlockHash> hashes) {
  impl_->EnsureReaderThread();
  auto done = std::make_shared<std::promise<Result<LookupResult>>>();
  auto fut = done->get_future();
  impl_->SendWithCallback(w::Opcode::kLookup, w::Encode(w::HashList{std::move(hashes)}),
                          [done](Result<Frame> f) { done->set_value(Impl::ParseLookup(std::move(f))); });
  return fut;
}

std::future<Result<std::vector<Status>>> Client::PutAsync(std::vector<BundleRef> bundles) {
  w::PutRequest req;
  uint64_t size = 4;
  for (const BundleRef& b : bundles) {
    req.items.push_back({b.hash, b.bytes});
    size += 16 + 4 + b.bytes.size();
  }
  if (size > max_payload_bytes()) {  // one frame: the daemon would close the connection on it
    std::promise<Result<std::vector<Status>>> refused;
    refused.set_value(Status::ResourceExhausted(fmt::format(
        "an asynchronous PUT of {} bytes exceeds sparsekvd's largest frame of {} bytes (Put splits; PutAsync "
        "sends one frame)",
        size, max_payload_bytes())));
    return refused.get_future();
  }
  std::vector<std::byte> framing;
  impl_->EnsureReaderThread();
  auto done = std::make_shared<std::promise<Result<std::vector<Status>>>>();
  auto fut = done->get_future();
  const size_t n = bundles.size();
  impl_->SendWithCallback(w::Opcode::kPut, w::EncodePieces(req, framing), [done, n](Result<Frame> f) {
    done->set_value(Impl::ParseStatusList(std::move(f), n));
  });
  return fut;
}

std::future<Result<std::vector<GetResult>>> Client::GetAsync(std::vector<WireBlockHash> hashes) {
  // The reader thread completes the future, asking for what the reply deferred on its way.
  impl_->EnsureReaderThread();
  auto done = std::make_shared<std::promise<Result<std::vector<GetResult>>>>();
  auto fut = done->get_future();
  impl_->GetSocketWithCallback(std::move(hashes),
                               [done](Result<std::vector<GetResult>> r) { done->set_value(std::move(r)); });
  return fut;
}

void Client::GetAsync(std::vector<WireBlockHash> hashes, GetCallback done) {
  impl_->GetWithCallback(std::move(hashes), std::move(done));
}

void Client::PutAsync(std::span<const BundleRef> bundles, StatusesCallback done) {
  impl_->PutWithCallback(bundles, std::move(done));
}

int Client::native_handle() const { return impl_->fd_; }
Result<size_t> Client::ProcessReplies() { return impl_->ProcessReplies(); }

bool Client::shared_memory() const { return impl_->shared(); }
bool Client::shared_arena() const { return impl_->arena_ != nullptr; }
bool Client::write_leases() const { return impl_->leases(); }
uint64_t Client::local_reads() const { return impl_->local_reads(); }
uint64_t Client::session_id() const { return impl_->hello_.session_id; }
uint32_t Client::block_tokens() const { return impl_->hello_.block_tokens; }
uint32_t Client::max_payload_bytes() const { return impl_->hello_.max_payload_bytes; }

}  // namespace sparsekv
