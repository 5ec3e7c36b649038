#include "server/resp_session.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <climits>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "server/resp_commands.h"
#include "server/resp_keys.h"
#include "server/resp_keyspace.h"
#include "server/resp_protocol.h"

namespace sparsekv::server {

using namespace resp;  // NOLINT(google-build-using-namespace): the commands' table and helpers

namespace {

namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
using Clock = std::chrono::steady_clock;

// A socket's address as Redis's CLIENT LIST shows it: "ip:port", "[ipv6]:port", or for a Unix
// socket its path and ":0" (`is_unix` set then).
std::string AddressOf(int fd, bool peer, bool& is_unix) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return "?:0";
  char ip[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    return fmt::format("{}:{}", ip, ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    return fmt::format("[{}]:{}", ip, ntohs(a->sin6_port));
  }
  if (ss.ss_family == AF_UNIX) {
    is_unix = true;
    const auto* a = reinterpret_cast<const sockaddr_un*>(&ss);
    const size_t n = len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0;
    return fmt::format("{}:0", std::string_view(a->sun_path, strnlen(a->sun_path, n)));
  }
  return "?:0";
}

// The reply to one or more requests: text built here, and values sent from the store's memory
// in place (held by their keeps until written). Bytes are charged to the connection's account.
struct Piece {
  std::string text;
  std::span<const std::byte> ext;
  DaemonStore::Keep keep;
};

class Reply {
 public:
  // `first`: a buffer to build the first text in (a spare one keeps its capacity: no fresh
  // pages to fault in for every reply).
  explicit Reply(int protocol, std::string first = {}) : protocol_(protocol) {
    if (first.capacity() > 0) {
      pieces_.emplace_back();
      pieces_.back().text = std::move(first);
    }
  }
  resp::RespWriter W() { return resp::RespWriter(Text(), protocol_); }
  std::string& Text() {
    if (pieces_.empty() || pieces_.back().keep) pieces_.emplace_back();
    return pieces_.back().text;
  }
  void External(std::span<const std::byte> bytes, DaemonStore::Keep keep) {
    Piece p;
    p.ext = bytes;
    p.keep = std::move(keep);
    pieces_.push_back(std::move(p));
  }
  std::deque<Piece>& pieces() { return pieces_; }
  int protocol() const { return protocol_; }
  void set_protocol(int p) { protocol_ = p; }
  bool close_after = false;

 private:
  int protocol_;
  std::deque<Piece> pieces_;
};

}  // namespace

class RespConnection;

class RespFrontEnd::Impl {
 public:
  explicit Impl(RespHost host) : host_(std::move(host)), keyspace_(host_.store, host_.metrics), expiry_timer_(*host_.io) {
    const ServerOptions& o = *host_.options;
    // Redis's proto-max-bulk-len: a value no tier could take is refused from its length alone.
    limits_.max_bulk_bytes = std::min<uint64_t>(o.max_frame_bytes, host_.store->MaxValueBytes());
    max_bulk_.store(limits_.max_bulk_bytes);
    idle_timeout_ms_.store(o.idle_timeout_ms);
    unauth_limits_.max_args = 10;
    unauth_limits_.max_bulk_bytes = 16384;
    unauth_limits_.unauthenticated = true;
    const uint32_t shortest =
        std::min({o.handshake_timeout_ms, o.frame_timeout_ms, o.write_timeout_ms, o.idle_timeout_ms});
    tick_ = std::chrono::milliseconds(std::clamp<uint32_t>(shortest / 4, 10, 1000));
    for (size_t i = 0; i < o.namespaces.size(); ++i) {
      if (o.namespaces[i].name == "default") default_ns_ = static_cast<uint32_t>(i + 1);
    }
  }

  Status Bind(const std::string& tcp_listen, const std::string& unix_path);
  void Accept();
  void AcceptUnix();
  void Admit(GenericSocket socket, bool is_unix);
  void Closed(RespConnection* c);
  // The connections open in namespace `ns` (CLIENT LIST, CLIENT KILL).
  std::vector<std::shared_ptr<RespConnection>> Connections(uint32_t ns);

  // The namespace id a fresh connection starts in (0: it must AUTH first).
  uint32_t StartNamespace() const {
    if (default_ns_ != 0 && host_.options->namespaces[default_ns_ - 1].token.empty()) return default_ns_;
    return 0;
  }
  // The id of namespace `name` if `token` opens it, else 0.
  uint32_t Authenticate(std::string_view name, std::string_view token) const {
    const auto& nss = host_.options->namespaces;
    for (size_t i = 0; i < nss.size(); ++i) {
      if (nss[i].name != name) continue;
      if (nss[i].token.empty() || TokenEquals(nss[i].token, std::string(token))) return static_cast<uint32_t>(i + 1);
      return 0;
    }
    return 0;
  }
  std::mutex& Stripe(const wire::WireHash& h) { return keyspace_.Stripe(h); }

  Clock::time_point started_at() const { return started_; }
  uint16_t tcp_port() const { return tcp_port_; }
  // The parser's limits for an authenticated connection (CONFIG SET proto-max-bulk-len).
  resp::Limits limits() const {
    resp::Limits l = limits_;
    l.max_bulk_bytes = max_bulk_.load(std::memory_order_relaxed);
    return l;
  }

  // ---- active expiry ----
  // Every kExpiryPeriod (Redis's hz 10) the keys whose deadline has come are deleted on a worker;
  // after a start, the deadlines already in the records are learnt a part at a time.
  static constexpr std::chrono::milliseconds kExpiryPeriod{100};
  static constexpr size_t kExpiryBatch = 1000, kLearnPart = 1024;
  void StartExpiry();
  void ExpiryTick();
  void LearnNext();

  RespHost host_;
  const Clock::time_point started_ = Clock::now();
  uint16_t tcp_port_ = 0;
  resp::Limits limits_, unauth_limits_;
  std::chrono::milliseconds tick_{1000};
  uint32_t default_ns_ = 0;
  std::unique_ptr<asio::ip::tcp::acceptor> tcp_;
  UnixListener unix_;
  std::string tcp_address_;
  resp::Keyspace keyspace_;
  LogLimiter log_;
  // Run-time settings (CONFIG SET): the largest bulk string, the idle timeout.
  std::atomic<uint64_t> max_bulk_{0};
  std::atomic<uint32_t> idle_timeout_ms_{0};

  // Active expiry (ExpiryTick), on the io_context; its worker jobs run in turn as one session.
  asio::steady_timer expiry_timer_;
  uint64_t expiry_session_ = 0;
  std::atomic<bool> expiry_busy_{false}, expiry_stopped_{false};
  // What is left to learn after a start: namespace, and its hashes from `learn_at_` on.
  uint32_t learn_ns_ = 0;
  std::vector<wire::WireHash> learn_hashes_;
  size_t learn_at_ = 0;

  std::mutex mu_;
  std::set<std::shared_ptr<RespConnection>> conns_;
  bool draining_ = false;

  // Metrics.
  std::array<std::atomic<uint64_t>, kCmdCount> calls_{};
  std::array<std::atomic<uint64_t>, kCmdCount> errors_{};
  std::atomic<uint64_t> accepted_{0}, rejected_{0}, protocol_errors_{0}, auth_failures_{0}, timeouts_{0},
      slow_readers_{0}, commands_total_{0};
  std::atomic<int64_t> open_{0};
  std::atomic<uint64_t> keyspace_hits_{0}, keyspace_misses_{0};
};

// One RESP connection. Requests are parsed from a receive buffer that grows to hold the largest
// request under way (a value and its header are then stored straight from it); requests are
// served one at a time, in order, and replies queue until written.
class RespConnection : public std::enable_shared_from_this<RespConnection> {
 public:
  RespConnection(RespFrontEnd::Impl& fe, GenericSocket socket, uint64_t id)
      : fe_(fe),
        host_(fe.host_),
        socket_(std::move(socket)),
        strand_(asio::make_strand(*fe.host_.io)),
        tick_(*fe.host_.io),
        retry_(*fe.host_.io),
        id_(id),
        start_ns_(fe.StartNamespace()),
        account_(std::make_shared<Account>()),
        created_(Clock::now()),
        last_active_(Clock::now()) {
    fd_ = static_cast<int>(socket_.native_handle());
    bool peer_unix = false;
    laddr_ = AddressOf(fd_, /*peer=*/false, is_unix_);
    addr_ = is_unix_ ? laddr_ : AddressOf(fd_, /*peer=*/true, peer_unix);
    last_cmd_at_.store(created_.time_since_epoch().count(), std::memory_order_relaxed);
  }
  ~RespConnection() { std::free(buf_); }

  void Start() {
    std::weak_ptr<RespConnection> weak = shared_from_this();
    account_->wake = [weak] {
      if (auto self = weak.lock()) asio::post(self->strand_, [self] { self->Resume(); });
    };
    asio::post(strand_, [self = shared_from_this()] {
      const uint32_t start = self->start_ns_;
      if (start != 0 && !self->EnterNamespace(start)) {
        // The start namespace is at its quota: refused as at the server's limit.
        Reply r(2);
        r.W().Error(self->QuotaError(start));
        self->closing_ = true;
        self->Queue(std::move(r));
        return self->DoWrite();
      }
      self->ArmTick();
      self->MaybeRead();
    });
  }

  // Refused at the connection limit: Redis's words, then close.
  void Refuse() {
    asio::post(strand_, [self = shared_from_this()] {
      Reply r(2);
      r.W().Error("ERR max number of clients reached");  // (once per connection: no spare)
      self->closing_ = true;
      self->Queue(std::move(r));
      self->DoWrite();
    });
  }

  void BeginDrain() {
    asio::post(strand_, [self = shared_from_this()] {
      self->closing_ = true;
      boost::system::error_code ec;
      self->socket_.shutdown(GenericSocket::shutdown_receive, ec);
      self->MaybeClose();
    });
  }

  bool counted_ = false;  // holds a connection slot (RespFrontEnd::Impl::mu_)
  uint32_t shared_ns() const { return shared_ns_.load(std::memory_order_relaxed); }

 private:
  static constexpr size_t kSmall = 16u << 10;
  static constexpr size_t kReadChunk = 256u << 10;
  static constexpr size_t kCopyBelow = 16u << 10;  // values smaller are copied into the reply
  static constexpr int kRequestsPerTurn = 64;

  // ---- reading and parsing ----

  void MaybeRead() {
    if (reading_ || closing_ || busy_ || closed_ || eof_ || parked_) return;
    if (out_bytes_ >= host_.options->max_inflight_bytes) return;  // DoWrite's completion reads again
    // Room for what the request under way needs, but grown as its bytes arrive (at most doubling
    // what is held, plus a chunk), never at the size a header claims: `*1048576` or `$60000000`
    // followed by nothing costs the daemon a chunk, not 4 or 60 MiB.
    const size_t held = end_ - begin_;
    size_t want = std::max(held + 4096, std::min(need_, 2 * held + kReadChunk));
    // A client that fills every read (a deep pipeline) gets a larger buffer, up to kReadChunk:
    // its whole pipeline is then read, served as one batch and answered with one send.
    if (last_read_full_ && cap_ < kReadChunk) want = std::max(want, std::min(2 * std::max(cap_, kSmall), kReadChunk));
    if (begin_ > 0 && (end_ == cap_ || want > cap_ - begin_)) {
      std::memmove(buf_, buf_ + begin_, held);
      begin_ = 0;
      end_ = held;
    }
    if (want > cap_ || end_ == cap_) {
      size_t cap = std::max<size_t>(kSmall, cap_);
      while (cap < want) cap *= 2;
      if (cap == cap_) cap *= 2;
      // Bytes past the first kSmall are charged to the budget.
      const uint64_t more = cap - std::max<size_t>(cap_, kSmall);
      // A request under way may take the budget's pass (BufferBudget::TakePass) to finish.
      if (more > 0 && !host_.budget->Allows(account_->held.load(std::memory_order_relaxed), more) &&
          !(end_ > begin_ && host_.budget->TakePass(this))) {
        host_.metrics->BackpressurePause();
        Park();
        return;
      }
      auto* grown = static_cast<char*>(std::realloc(buf_, cap));
      if (grown == nullptr) {
        Park();
        return;
      }
      buf_ = grown;
      TakeBudget(more);
      buf_charged_ += more;
      cap_ = cap;
      cap_shared_.store(cap, std::memory_order_relaxed);
    }
    const size_t room = std::min(cap_ - end_, std::max(kReadChunk, need_ > end_ ? need_ - end_ : 0));
    reading_ = true;
    socket_.async_read_some(
        asio::buffer(buf_ + end_, room),
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec, size_t n) {
          self->reading_ = false;
          if (ec == asio::error::operation_aborted && self->shrinking_ && !self->closed_) {
            // OnTick cancelled the read of an idle connection to give its grown buffer back.
            self->shrinking_ = false;
            self->end_ += n;
            if (self->end_ == self->begin_) self->FreeBuffer();
            return self->MaybeRead();
          }
          if (ec) {
            // The peer sends no more (it may still read: a client that half-closes after its
            // requests gets every reply, as from Redis). What is buffered is served first.
            self->eof_ = true;
            self->Process();
            return self->MaybeClose();
          }
          self->shrinking_ = false;
          self->last_read_full_ = self->end_ + n == self->cap_;
          self->end_ += n;
          self->last_active_ = Clock::now();
          if (self->request_started_ == Clock::time_point{}) self->request_started_ = self->last_active_;
          self->Process();
        }));
  }

  // Stops reading until the budget has room. Unlike a native connection, which the server wakes
  // when bytes come back, a parked RESP connection looks again every kParkedRetry (and at its
  // tick): cheap for the few that park, and soon enough that a held-back large SET follows the
  // one finishing before it within milliseconds, not a tick later.
  static constexpr std::chrono::milliseconds kParkedRetry{5};
  void Park() {
    if (!parked_) parked_at_ = Clock::now();
    parked_ = true;
    account_->parked.store(true, std::memory_order_release);
    if (retry_armed_ || closed_) return;
    retry_armed_ = true;
    retry_.expires_after(kParkedRetry);
    retry_.async_wait(asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
      self->retry_armed_ = false;
      if (!ec && !self->closed_ && self->parked_) self->Resume();
    }));
  }

  void Resume() {
    if (!parked_) return;
    parked_ = false;
    account_->parked.store(false, std::memory_order_release);
    // The wait was the daemon's (its budget), not the client's: the request's clock stood still.
    if (request_started_ != Clock::time_point{}) request_started_ += Clock::now() - parked_at_;
    if (!busy_) Process();  // serves what is buffered, then reads
  }

  // Serves the buffered requests, in order, until one has to wait (a worker, a tier) or the
  // buffer holds no whole request.
  void Process() {
    if (closed_) return;
    int served = 0;
    while (!busy_ && !closing_) {
      if (out_bytes_ >= host_.options->max_inflight_bytes) break;  // resumed once written
      // An empty grown buffer is not kept while the budget is spent (as it is otherwise, for the
      // client's next large value): held by every connection a large value went through, such
      // buffers would keep the budget spent, and every connection parked, for good.
      if (begin_ == end_ && buf_charged_ > 0 && !reading_ &&
          !host_.budget->Allows(account_->held.load(std::memory_order_relaxed), 0))
        FreeBuffer();
      if (!host_.budget->Allows(account_->held.load(std::memory_order_relaxed), 0) && !host_.budget->HoldsPass(this)) {
        // The daemon's budget is spent: replies wait until some are written (or the tick).
        host_.metrics->BackpressurePause();
        Park();
        break;
      }
      if (++served > kRequestsPerTurn) {
        // Let other connections have the thread; go on afterwards.
        asio::post(strand_, [self = shared_from_this()] { self->Process(); });
        DoWrite();
        return;
      }
      const std::string_view in(buf_ + begin_, end_ - begin_);
      if (in.empty()) {
        begin_ = end_ = 0;
        request_started_ = {};
        need_ = 0;
        if (eof_) closing_ = true;
        break;
      }
      resp::Parsed p = resp::ParseRequest(in, ns_ != 0 ? fe_.limits() : fe_.unauth_limits_, args_, inline_);
      if (p.outcome == resp::Outcome::kNeedMore) {
        need_ = p.need;
        if (eof_) closing_ = true;  // a request cut off by the peer's close is dropped
        break;
      }
      if (p.outcome == resp::Outcome::kError) {
        fe_.protocol_errors_.fetch_add(1, std::memory_order_relaxed);
        host_.metrics->BadFrame();
        Reply r(protocol_, TakeSpare());
        r.W().Error(p.error);
        closing_ = true;
        Queue(std::move(r));
        if (const uint64_t held_back = fe_.log_.Allow(); held_back != kLogSuppressed) {
          spdlog::info("RESP connection {}: {}; closed{}", id_, p.error,
                       held_back ? fmt::format(" ({} more such lines held back)", held_back) : "");
        }
        break;
      }
      need_ = 0;
      consumed_ = p.consumed;
      request_begin_ = begin_;
      if (args_.empty()) {
        Done();
        continue;
      }
      if (ns_ != 0 && inline_.empty() && ServeBatch()) continue;
      Serve();
    }
    DoWrite();
    MaybeRead();
  }

  // The request just served is done: its bytes are released.
  void Done() {
    begin_ = request_begin_ + consumed_;
    consumed_ = 0;
    host_.budget->ReturnPass(this);  // the request is served: the next held-back one may finish
    request_started_ = begin_ < end_ ? Clock::now() : Clock::time_point{};
    if (begin_ == end_) {
      begin_ = end_ = 0;
      // A grown buffer is kept while the client is busy (a 6 MiB SET after another reuses it,
      // faulting in no new pages) and given back after a quiet tick (OnTick).
    }
  }

  // ---- pipelined GETs and SETs, served together ----

  // Serves the request just parsed together with the plain GETs (or plain SETs) pipelined right
  // behind it, in one store call: what a client with a pipeline (redis-benchmark -P, redis-py's
  // pipeline, LMCache's batched puts) sends. False, having done nothing, when there is no such
  // run or the store cannot serve it at once; the request is then served on its own.
  bool ServeBatch() {
    static constexpr size_t kMaxBatch = 64;
    const size_t words = args_.size();
    const Cmd cmd = words == 2 ? kGet : words == 3 ? kSet : kUnknown;
    if (cmd == kUnknown || Lookup(args_[0]) != cmd || args_[1].size() > resp::kMaxKeyBytes) return false;
    if (cmd == kSet && (!TooLarge(args_[1], args_[2]).empty() || !host_.store->PutsWithoutBlocking())) return false;
    batch_keys_.assign(1, args_[1]);
    batch_values_.clear();
    if (cmd == kSet) batch_values_.push_back(args_[2]);
    size_t total = consumed_;
    const resp::Limits batch_limits = fe_.limits();
    while (batch_keys_.size() < kMaxBatch && begin_ + total < end_) {
      const std::string_view rest(buf_ + begin_ + total, end_ - begin_ - total);
      const resp::Parsed p = resp::ParseRequest(rest, batch_limits, batch_args_, batch_storage_);
      if (p.outcome != resp::Outcome::kCommand || batch_args_.size() != words || !batch_storage_.empty() ||
          Lookup(batch_args_[0]) != cmd || batch_args_[1].size() > resp::kMaxKeyBytes) {
        break;
      }
      if (cmd == kSet && !TooLarge(batch_args_[1], batch_args_[2]).empty()) break;
      batch_keys_.push_back(batch_args_[1]);
      if (cmd == kSet) batch_values_.push_back(batch_args_[2]);
      total += p.consumed;
    }
    if (batch_keys_.size() < 2) return false;
    const size_t n = batch_keys_.size();
    cmd_ = cmd;
    hashes_.clear();
    for (std::string_view k : batch_keys_) hashes_.push_back(resp::KeyHash(k));
    Reply r(protocol_, TakeSpare());
    if (cmd == kGet) {
      const bool fast = host_.store->TryGetWithoutBlocking(
          ns_, hashes_,
          [&](size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
            AppendValue(r, batch_keys_[i], st, bytes, keep);
          },
          /*check=*/true);
      Count(kGet, n);
      consumed_ = total;
      if (fast) {
        Answer(std::move(r));
      } else {
        // Some are below host memory: the whole run goes to a worker as one store call, so an
        // SSD tier reads them together (one io_uring batch), not one request at a time.
        cmd_ = kGet;
        OnWorker(std::move(r));
      }
      return true;
    }
    // SETs: every key's stripe, each taken once, without waiting (a stripe another thread holds
    // sends the run back to the one-by-one path).
    std::vector<std::mutex*> stripes;
    for (const auto& h : hashes_) stripes.push_back(&fe_.Stripe(h));
    std::sort(stripes.begin(), stripes.end());
    stripes.erase(std::unique(stripes.begin(), stripes.end()), stripes.end());
    size_t locked = 0;
    for (; locked < stripes.size(); ++locked) {
      if (!stripes[locked]->try_lock()) break;
    }
    if (locked < stripes.size()) {
      for (size_t i = 0; i < locked; ++i) stripes[i]->unlock();
      return false;
    }
    // Each value's header is written in place, in the bytes of its own request before it.
    batch_key_copies_.assign(batch_keys_.begin(), batch_keys_.end());
    std::vector<std::vector<std::byte>> scratch(n);
    std::vector<wire::PutItem> items(n);
    for (size_t i = 0; i < n; ++i) {
      items[i].hash = hashes_[i];
      items[i].bundle = Record(batch_key_copies_[i], batch_values_[i], /*in_place=*/true, scratch[i]);
    }
    Count(kSet, n);
    consumed_ = total;
    StorePut(std::move(r), items, /*per_item=*/true);
    for (auto* m : stripes) m->unlock();
    return true;
  }

  void Count(Cmd cmd, size_t n) {
    fe_.calls_[cmd].fetch_add(n, std::memory_order_relaxed);
    fe_.commands_total_.fetch_add(n, std::memory_order_relaxed);
  }

  void FreeBuffer() {
    std::free(buf_);
    buf_ = nullptr;
    cap_ = begin_ = end_ = 0;
    cap_shared_.store(0, std::memory_order_relaxed);
    GiveBudget(std::exchange(buf_charged_, 0));
  }

  // ---- serving one request ----

  void Serve() {
    const Cmd cmd = Lookup(args_[0]);
    cmd_ = cmd;
    last_cmd_at_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    if ((cmd == kClient || cmd == kConfig || cmd == kCommand) && args_.size() > 1) {
      // Shown with its subcommand, as Redis's fullname ("client|list").
      std::lock_guard<std::mutex> l(info_mu_);
      shared_fullname_ = fmt::format("{}|{}", kSpecs[cmd].name, Lower(args_[1].substr(0, 32)));
    }
    last_cmd_.store(cmd, std::memory_order_relaxed);
    fe_.calls_[cmd].fetch_add(1, std::memory_order_relaxed);
    fe_.commands_total_.fetch_add(1, std::memory_order_relaxed);
    Reply r(protocol_, TakeSpare());
    auto w = r.W();
    const CmdSpec& spec = kSpecs[cmd];
    if (cmd == kUnknown) {
      // As Redis words it: the arguments quoted, until they fill 128 bytes.
      std::string list;
      for (size_t i = 1; i < args_.size() && list.size() < 128; ++i) {
        list += fmt::format("'{}' ", Printable(args_[i], 128 - list.size()));
      }
      const std::string msg =
          fmt::format("ERR unknown command '{}', with args beginning with: {}", Printable(args_[0], 128), list);
      return Answer(std::move(r), msg);
    }
    const auto argc = static_cast<int>(args_.size());
    if ((spec.arity > 0 && argc != spec.arity) || (spec.arity < 0 && argc < -spec.arity) ||
        ((cmd == kMset || cmd == kMsetnx) && argc % 2 == 0)) {
      return Answer(std::move(r), fmt::format("ERR wrong number of arguments for '{}' command", spec.name));
    }
    if (ns_ == 0 && !spec.before_auth) return Answer(std::move(r), "NOAUTH Authentication required.");
    // Keys longer than kMaxKeyBytes are refused before anything is read or stored.
    size_t long_key = 0;
    ForEachKey(cmd, args_.size(), [&](size_t i) {
      if (long_key == 0 && args_[i].size() > resp::kMaxKeyBytes) long_key = i;
    });
    if (long_key != 0) {
      return Answer(std::move(r), fmt::format("ERR key too long: {} bytes, sparsekv takes at most {}",
                                              args_[long_key].size(), resp::kMaxKeyBytes));
    }
    switch (cmd) {
      case kPing:
        if (argc > 2) return Answer(std::move(r), "ERR wrong number of arguments for 'ping' command");
        if (argc == 2) {
          w.Bulk(args_[1]);
        } else {
          w.Simple("PONG");
        }
        return Answer(std::move(r));
      case kEcho:
        w.Bulk(args_[1]);
        return Answer(std::move(r));
      case kHello:
        return Hello(std::move(r));
      case kAuth:
        return Auth(std::move(r));
      case kClient:
        return ClientCmd(std::move(r));
      case kSelect: {
        int64_t db = 0;
        if (!ParseI64(args_[1], db)) return Answer(std::move(r), "ERR value is not an integer or out of range");
        if (db != 0) return Answer(std::move(r), "ERR DB index is out of range");
        w.Simple("OK");
        return Answer(std::move(r));
      }
      case kQuit:
        w.Simple("OK");
        r.close_after = true;
        return Answer(std::move(r));
      case kReset:
        protocol_ = 2;
        shared_protocol_.store(2, std::memory_order_relaxed);
        SetName({});
        if (const uint32_t start = fe_.StartNamespace(); start == 0 || !EnterNamespace(start)) LeaveNamespace();
        r.set_protocol(2);
        r.W().Simple("RESET");
        return Answer(std::move(r));
      case kGet:
        return Get(std::move(r), /*multi=*/false);
      case kMget:
        return Get(std::move(r), /*multi=*/true);
      case kSet:
        return Set(std::move(r));
      case kMset:
      case kMsetnx:
        return Mset(std::move(r));
      case kConfig:
        return Config(std::move(r));
      case kCommand:
        return CommandCmd(std::move(r));
      case kInfo:
        return OnWorker(std::move(r));
      default:
        // The keyspace's commands (resp_string_family.cc, resp_generic_family.cc) may block on
        // tier I/O: served on a worker.
        if (kSpecs[cmd].group == Group::kString || kSpecs[cmd].group == Group::kGeneric || cmd == kDbsize ||
            cmd == kFlushdb || cmd == kFlushall) {
          return OnWorker(std::move(r));
        }
        return Answer(std::move(r), "ERR internal: command without a handler");
    }
  }

  // Answers the request at once (with `error` as an error reply when given).
  void Answer(Reply r, std::string_view error = {}) {
    if (!error.empty()) {
      r.W().Error(error);
      fe_.errors_[cmd_].fetch_add(1, std::memory_order_relaxed);
    }
    const bool close = r.close_after;
    Queue(std::move(r));
    Done();
    if (close) closing_ = true;
  }

  // Hands the request to a worker; the connection reads and serves nothing else meanwhile (the
  // request's arguments stay in the receive buffer, untouched, until it is answered).
  void OnWorker(Reply r) {
    busy_ = true;
    auto reply = std::make_shared<Reply>(std::move(r));
    host_.submit(id_, [self = shared_from_this(), reply] {
      std::string error;
      try {
        self->RunOnWorker(*reply, error);
      } catch (const std::exception& e) {
        error = fmt::format("ERR internal error: {}", e.what());
      }
      asio::post(self->strand_, [self, reply, error = std::move(error)] {
        self->busy_ = false;
        self->Answer(std::move(*reply), error);
        self->Process();
      });
    });
  }

  // Runs on a worker thread: a store call that may block on tier I/O.
  void RunOnWorker(Reply& r, std::string& error) {
    auto w = r.W();
    switch (cmd_) {
      case kGet:
      case kMget:
        return GetOnWorker(r);
      case kInfo:
        w.Verbatim(InfoText());
        return;
      default:
        break;
    }
    resp::Command c{cmd_, ns_, std::span<const std::string_view>(args_), w, error, fe_.keyspace_,
                    fe_.max_bulk_.load(std::memory_order_relaxed)};
    if (ServeStringCommand(c) || ServeGenericCommand(c)) return;
    error = "ERR internal: no worker handler";
  }

  std::string InfoText() {
    const std::string_view section = args_.size() > 1 ? args_[1] : std::string_view("default");
    const bool all = EqualsNoCase(section, "all") || EqualsNoCase(section, "everything") ||
                     EqualsNoCase(section, "default");
    auto want = [&](std::string_view s) {
      if (all) return true;
      for (size_t i = 1; i < args_.size(); ++i) {
        if (EqualsNoCase(args_[i], s)) return true;
      }
      return false;
    };
    std::string out;
    const ServerOptions& o = *host_.options;
    const std::vector<DaemonStore::TierInfo> tiers = host_.store->Tiers();
    uint64_t host_bytes = 0, host_capacity = 0;
    for (const auto& t : tiers) {
      if (t.name == "host") {
        host_bytes = t.bytes;
        host_capacity = t.capacity_bytes;
      }
    }
    if (want("server")) {
      const auto up = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - fe_.started_at());
      out += fmt::format(
          "# Server\r\nredis_version:7.0.0\r\nsparsekv_version:{}\r\nredis_mode:standalone\r\nos:Linux\r\n"
          "arch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\nuptime_in_days:{}\r\n\r\n",
          SPARSEKV_SERVER_VERSION, ::getpid(), fe_.tcp_port(), up.count(), up.count() / 86400);
    }
    if (want("clients")) {
      out += fmt::format("# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
                         fe_.open_.load(std::memory_order_relaxed), o.max_connections);
    }
    if (want("memory")) {
      out += fmt::format(
          "# Memory\r\nused_memory:{0}\r\nused_memory_human:{1:.2f}M\r\nmaxmemory:{2}\r\nmaxmemory_human:{3:.2f}M\r\n"
          "maxmemory_policy:sparsekv-tiered\r\n\r\n",
          host_bytes, host_bytes / 1048576.0, host_capacity, host_capacity / 1048576.0);
    }
    if (want("stats")) {
      uint64_t evicted = 0;
      for (const auto& t : tiers) evicted += t.remote ? 0 : t.evictions;
      out += fmt::format(
          "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\nrejected_connections:{}\r\n"
          "keyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\n\r\n",
          fe_.accepted_.load(), fe_.commands_total_.load(), fe_.rejected_.load(), fe_.keyspace_hits_.load(),
          fe_.keyspace_misses_.load(), evicted, fe_.keyspace_.expired_keys());
    }
    if (want("keyspace")) {
      const size_t keys = host_.store->ListHashes(ns_).size();
      out += "# Keyspace\r\n";
      const auto [expires, avg_ttl] = fe_.keyspace_.Expiring(ns_, NowMs());
      if (keys > 0) out += fmt::format("db0:keys={},expires={},avg_ttl={}\r\n", keys, expires, avg_ttl);
      out += "\r\n";
    }
    if (want("sparsekv")) {
      out += fmt::format("# Sparsekv\r\nnamespace:{}\r\ntiers:{}\r\n", o.namespaces[ns_ - 1].name, tiers.size());
      for (size_t i = 0; i < tiers.size(); ++i) {
        const auto& t = tiers[i];
        out += fmt::format(
            "tier{}:name={},capacity_bytes={},bytes={},items={},hits={},misses={},evictions={},corrupt={},remote={}\r\n",
            i, t.name, t.capacity_bytes, t.bytes, t.items, t.hits, t.misses, t.evictions, t.corrupt, t.remote ? 1 : 0);
      }
      out += "\r\n";
    }
    if (out.size() >= 4 && out.compare(out.size() - 4, 4, "\r\n\r\n") == 0) out.resize(out.size() - 2);
    return out;
  }

  // ---- GET and MGET ----

  void Get(Reply r, bool multi) {
    std::vector<wire::WireHash>& hashes = hashes_;
    hashes.clear();
    batch_keys_.assign(args_.begin() + 1, args_.end());
    for (size_t i = 1; i < args_.size(); ++i) hashes.push_back(resp::KeyHash(args_[i]));
    if (multi) r.W().Array(hashes.size());
    // Host memory answers most GETs on this thread.
    const bool fast = host_.store->TryGetWithoutBlocking(
        ns_, hashes,
        [&](size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
          AppendValue(r, batch_keys_[i], st, bytes, keep);
        },
        /*check=*/true);
    if (fast) return Answer(std::move(r));
    OnWorker(std::move(r));
  }

  // GET, MGET, or a run of pipelined GETs (ServeBatch): hashes_ and batch_keys_ name them.
  void GetOnWorker(Reply& r) {
    host_.store->Get(ns_, hashes_,
                     [&](size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
                       AppendValue(r, batch_keys_[i], st, bytes, keep);
                     });
  }

  // A GET's answer for `key`: its value, or nil (absent, another key's record, damaged).
  void AppendValue(Reply& r, std::string_view key, const Status& st, std::span<const std::byte> bytes,
                   const DaemonStore::Keep& keep) {
    std::optional<std::span<const std::byte>> value;
    if (st.ok()) {
      if (auto stored = resp::Parse(bytes, key)) {
        // A key is never returned after its deadline; it is queued to be deleted.
        if (stored->deadline_ms != 0 && Expired(stored->deadline_ms, NowMs())) {
          fe_.keyspace_.QueueExpired(ns_, key, stored->deadline_ms);
        } else {
          value = stored->value;
        }
      }
    }
    if (!value) {
      fe_.keyspace_misses_.fetch_add(1, std::memory_order_relaxed);
      host_.metrics->Misses(1);
      r.W().Null();
      return;
    }
    fe_.keyspace_hits_.fetch_add(1, std::memory_order_relaxed);
    host_.metrics->Hits(1);
    host_.metrics->BytesOut(value->size());
    auto w = r.W();
    w.BulkHeader(value->size());
    if (value->size() < kCopyBelow || !keep || !host_.pins_below_cap(value->size())) {
      r.Text().append(AsChars(*value));
    } else {
      // Sent from the store's memory in place; the pin budget counts it until written.
      auto both = std::make_shared<std::pair<DaemonStore::Keep, DaemonStore::Keep>>(
          keep, host_.charge_pins(value->size()));
      r.External(*value, DaemonStore::Keep(both, both.get()));
    }
    r.W().Crlf();
  }

  // ---- SET and MSET ----

  // The bytes stored for `key` = `value`: its header, then the value. When the value lies in
  // the receive buffer with room before it that the request no longer needs (SET: the command
  // name and key before it), the header is written there and the record stored from the buffer
  // as it is; otherwise it is assembled in `scratch`.
  std::span<const std::byte> Record(std::string_view key, std::string_view value, bool in_place,
                                    std::vector<std::byte>& scratch) {
    const size_t header = resp::HeaderBytes(key);
    if (header == 0) return std::as_bytes(std::span<const char>(value.data(), value.size()));
    const char* v = value.data();
    const auto addr = reinterpret_cast<uintptr_t>(v), base = reinterpret_cast<uintptr_t>(buf_);
    if (in_place && buf_ != nullptr && addr >= base + request_begin_ + header && addr <= base + end_) {
      char* at = const_cast<char*>(v) - header;
      // The key may lie where the header goes: move it first (memmove), then the fixed part.
      std::memmove(at + resp::kFixedHeaderBytes, key.data(), key.size());
      std::string_view moved(at + resp::kFixedHeaderBytes, key.size());
      std::byte fixed[resp::kFixedHeaderBytes];
      resp::WriteHeader(std::string_view{}, value.size(), fixed);  // an empty key: fixed part only
      const auto key_bytes = static_cast<uint32_t>(key.size());
      std::memcpy(fixed + 4, &key_bytes, 4);
      std::memcpy(at, fixed, resp::kFixedHeaderBytes);
      (void)moved;
      return std::as_bytes(std::span<const char>(at, header + value.size()));
    }
    scratch.resize(header + value.size());
    resp::WriteHeader(key, value.size(), scratch.data());
    if (!value.empty()) std::memcpy(scratch.data() + header, value.data(), value.size());
    return scratch;
  }

  // A plain SET is stored from this thread when the store takes it at once; SET with options
  // (and the rest) goes to a worker (resp_string_family.cc).
  void Set(Reply r) {
    if (std::string e = TooLarge(args_[1], args_[2]); !e.empty()) return Answer(std::move(r), e);
    if (args_.size() > 3 || !host_.store->PutsWithoutBlocking()) return OnWorker(std::move(r));
    const wire::WireHash h = resp::KeyHash(args_[1]);
    std::unique_lock<std::mutex> stripe(fe_.Stripe(h), std::try_to_lock);
    if (!stripe.owns_lock()) return OnWorker(std::move(r));
    // The key is copied: writing the header in place moves it.
    key_copy_.assign(args_[1]);
    args_[1] = key_copy_;
    std::vector<std::byte> scratch;
    const wire::PutItem item{h, Record(key_copy_, args_[2], /*in_place=*/inline_.empty(), scratch)};
    StorePut(std::move(r), std::span<const wire::PutItem>(&item, 1), /*per_item=*/false);
  }

  // Stores `items` from the network thread; answers OK (or `count` replies for MSET) once the
  // store has, at once when it answers on this thread.
  void StorePut(Reply r, std::span<const wire::PutItem> items, bool per_item) {
    put_per_item_ = per_item;
    struct Wait {
      std::vector<wire::ItemStatus> result;
      std::atomic<bool> claimed{false};
    };
    auto wait = std::make_shared<Wait>();
    uint64_t bytes = 0;
    for (const auto& it : items) bytes += it.bundle.size();
    host_.metrics->BytesIn(bytes);
    auto self = shared_from_this();
    host_.begin_async();
    const bool taken = host_.store->TryPutWithoutBlocking(ns_, items, [wait, self](std::vector<wire::ItemStatus> st) {
      wait->result = std::move(st);
      if (wait->claimed.exchange(true, std::memory_order_acq_rel)) {
        // Answered later, on the connection's strand. The server may stop once end_async has
        // run: the handler then never runs, and the connection goes with the io_context.
        asio::post(self->strand_, [self, wait] {
          self->busy_ = false;
          self->FinishPut(std::move(*self->pending_put_), wait->result);
          self->pending_put_.reset();
          self->Process();
        });
        self->host_.end_async();
      }
    });
    if (!taken) {
      host_.end_async();
      if (!per_item) return OnWorker(std::move(r));
      // (ServeBatch checked PutsWithoutBlocking: a store that changed its mind answers errors.)
      std::vector<wire::ItemStatus> busy(items.size(), {StatusCode::kUnavailable, "the store cannot take a batch now"});
      return FinishPut(std::move(r), busy);
    }
    if (wait->claimed.exchange(true, std::memory_order_acq_rel)) {
      host_.end_async();
      FinishPut(std::move(r), wait->result);  // answered on this thread
      return;
    }
    // (end_async runs in the callback, which has not run yet.)
    busy_ = true;
    pending_put_ = std::make_unique<Reply>(std::move(r));
  }

  void FinishPut(Reply r, const std::vector<wire::ItemStatus>& st) {
    if (put_per_item_) {
      // A batch of pipelined SETs: one answer each.
      for (const auto& s : st) {
        if (s.code == StatusCode::kOk) {
          r.W().Simple("OK");
        } else {
          r.W().Error(PutError(s));
          fe_.errors_[kSet].fetch_add(1, std::memory_order_relaxed);
        }
      }
      return Answer(std::move(r));
    }
    for (const auto& s : st) {
      if (s.code != StatusCode::kOk) return Answer(std::move(r), PutError(s));
    }
    r.W().Simple("OK");
    Answer(std::move(r));
  }

  static std::string PutError(const wire::ItemStatus& s) {
    if (s.code == StatusCode::kInvalidArgument) {
      return fmt::format("ERR value too large for sparsekvd's tiers ({}); nothing was stored", s.message);
    }
    if (s.code == StatusCode::kResourceExhausted) return fmt::format("OOM {}", s.message);
    return fmt::format("ERR storing the value failed: {}", s.message);
  }

  // An error when `key` = `value` is larger than the store can take: refused before anything
  // stored changes (a PUT the tiers refuse would still drop the key's older version).
  std::string TooLarge(std::string_view key, std::string_view value) const {
    const uint64_t record = resp::HeaderBytes(key) + value.size();
    const uint64_t max = host_.store->MaxValueBytes();
    if (record <= max) return {};
    return fmt::format("ERR value too large: {} bytes with its key, sparsekvd's tiers take at most {}; nothing was "
                       "stored",
                       record, max);
  }

  void Mset(Reply r) {
    for (size_t i = 1; i + 1 < args_.size(); i += 2) {
      if (std::string e = TooLarge(args_[i], args_[i + 1]); !e.empty()) return Answer(std::move(r), e);
    }
    OnWorker(std::move(r));
  }

  // ---- namespaces ----

  // Moves the connection into namespace `ns`, holding one of its connections (its quota counts
  // native and RESP connections together); false, changing nothing, at the quota.
  bool EnterNamespace(uint32_t ns) {
    if (ns == ns_) return true;
    if (!host_.take_namespace(ns)) return false;
    LeaveNamespace();
    ns_ = ns;
    shared_ns_.store(ns, std::memory_order_relaxed);
    return true;
  }
  void LeaveNamespace() {
    if (ns_ != 0) host_.give_namespace(ns_);
    ns_ = 0;
    shared_ns_.store(0, std::memory_order_relaxed);
  }
  std::string QuotaError(uint32_t ns) const {
    const NamespaceConfig& nc = host_.options->namespaces[ns - 1];
    return fmt::format("ERR max number of clients reached for namespace '{}' ({})", nc.name, nc.max_connections);
  }

  // ---- connection-level commands ----

  void Hello(Reply r) {
    size_t i = 1;
    int proto = protocol_;
    if (args_.size() > 1) {
      int64_t v = 0;
      if (!ParseI64(args_[1], v)) return Answer(std::move(r), "ERR Protocol version is not an integer or out of range");
      if (v < 2 || v > 3) return Answer(std::move(r), "NOPROTO unsupported protocol version");
      proto = static_cast<int>(v);
      i = 2;
    }
    std::string name = name_;
    uint32_t ns = ns_;
    for (; i < args_.size(); ++i) {
      if (EqualsNoCase(args_[i], "auth") && i + 2 < args_.size()) {
        ns = fe_.Authenticate(args_[i + 1], args_[i + 2]);
        if (ns == 0) {
          fe_.auth_failures_.fetch_add(1, std::memory_order_relaxed);
          host_.metrics->AuthFailure();
          return Answer(std::move(r), "WRONGPASS invalid username-password pair or user is disabled.");
        }
        i += 2;
      } else if (EqualsNoCase(args_[i], "setname") && i + 1 < args_.size()) {
        name = std::string(args_[i + 1]);
        ++i;
      } else {
        return Answer(std::move(r), fmt::format("ERR Syntax error in HELLO option '{}'", Printable(args_[i], 64)));
      }
    }
    if (ns == 0) return Answer(std::move(r), "NOAUTH HELLO must be called with the client already authenticated, "
                                             "otherwise the HELLO <proto> AUTH <user> <pass> option can be used to "
                                             "authenticate the client and select the RESP protocol version at the same "
                                             "time");
    if (!EnterNamespace(ns)) return Answer(std::move(r), QuotaError(ns));
    name_ = std::move(name);
    protocol_ = proto;
    shared_protocol_.store(proto, std::memory_order_relaxed);
    r.set_protocol(proto);
    auto w = r.W();
    w.Map(7);
    w.Bulk("server");
    w.Bulk("sparsekv");
    w.Bulk("version");
    w.Bulk("7.0.0");
    w.Bulk("proto");
    w.Integer(proto);
    w.Bulk("id");
    w.Integer(static_cast<int64_t>(id_));
    w.Bulk("mode");
    w.Bulk("standalone");
    w.Bulk("role");
    w.Bulk("master");
    w.Bulk("modules");
    w.Array(0);
    Answer(std::move(r));
  }

  void Auth(Reply r) {
    if (args_.size() > 3) return Answer(std::move(r), "ERR syntax error");
    std::string_view user = "default", pass = args_[1];
    if (args_.size() == 3) {
      user = args_[1];
      pass = args_[2];
    } else if (fe_.default_ns_ != 0 && host_.options->namespaces[fe_.default_ns_ - 1].token.empty()) {
      return Answer(std::move(r),
                    "ERR AUTH <password> called without any password configured for the default user. Are you sure "
                    "your configuration is correct?");
    }
    const uint32_t ns = fe_.Authenticate(user, pass);
    if (ns == 0) {
      fe_.auth_failures_.fetch_add(1, std::memory_order_relaxed);
      host_.metrics->AuthFailure();
      return Answer(std::move(r), "WRONGPASS invalid username-password pair or user is disabled.");
    }
    if (!EnterNamespace(ns)) return Answer(std::move(r), QuotaError(ns));
    r.W().Simple("OK");
    Answer(std::move(r));
  }

  // Redis's answer to a known subcommand with the wrong number of arguments, or to an unknown one.
  void SubcommandError(Reply r, std::string_view cmd, const std::vector<std::pair<const char*, int>>& subs) {
    const std::string sub = Lower(args_[1]);
    for (const auto& [name, arity] : subs) {
      if (sub == name) {
        return Answer(std::move(r), fmt::format("ERR wrong number of arguments for '{}|{}' command", cmd, name));
      }
    }
    std::string upper(cmd);
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    Answer(std::move(r), fmt::format("ERR unknown subcommand '{}'. Try {} HELP.", Printable(args_[1], 128), upper));
  }

  // CLIENT SETNAME, GETNAME, ID, SETINFO, INFO, LIST, KILL. LIST and KILL see only the caller's
  // namespace's connections: no client learns of, or closes, another namespace's.
  void ClientCmd(Reply r) {
    const std::string sub = Lower(args_[1]);
    auto w = r.W();
    if (sub == "setname" && args_.size() == 3) {
      for (char c : args_[2]) {
        if (c < '!' || c > '~') {
          return Answer(std::move(r), "ERR Client names cannot contain spaces, newlines or special characters.");
        }
      }
      SetName(std::string(args_[2]));
      w.Simple("OK");
    } else if (sub == "getname" && args_.size() == 2) {
      if (name_.empty()) {
        w.Null();
      } else {
        w.Bulk(name_);
      }
    } else if (sub == "id" && args_.size() == 2) {
      w.Integer(static_cast<int64_t>(id_));
    } else if (sub == "setinfo" && args_.size() == 4) {
      const std::string attr = Lower(args_[2]);
      if (attr != "lib-name" && attr != "lib-ver") {
        return Answer(std::move(r), fmt::format("ERR Unrecognized option '{}'", Printable(args_[2], 64)));
      }
      w.Simple("OK");
    } else if (sub == "info" && args_.size() == 2) {
      w.Verbatim(InfoLine(/*caller=*/true, "client|info") + "\n");
    } else if (sub == "list") {
      return ClientList(std::move(r));
    } else if (sub == "kill" && args_.size() >= 3) {
      return ClientKill(std::move(r));
    } else {
      return SubcommandError(std::move(r), "client",
                             {{"setname", 3}, {"getname", 2}, {"id", 2}, {"setinfo", 4}, {"info", 2}, {"kill", -3}});
    }
    Answer(std::move(r));
  }

  // Redis's client types: every RESP connection here is "normal".
  static bool KnownClientType(std::string_view t, bool& normal) {
    normal = EqualsNoCase(t, "normal");
    return normal || EqualsNoCase(t, "master") || EqualsNoCase(t, "replica") || EqualsNoCase(t, "slave") ||
           EqualsNoCase(t, "pubsub");
  }

  void ClientList(Reply r) {
    std::optional<std::vector<uint64_t>> ids;
    bool all = true;
    if (args_.size() == 4 && EqualsNoCase(args_[2], "type")) {
      if (!KnownClientType(args_[3], all)) {
        return Answer(std::move(r), fmt::format("ERR Unknown client type '{}'", Printable(args_[3], 128)));
      }
    } else if (args_.size() > 3 && EqualsNoCase(args_[2], "id")) {
      ids.emplace();
      for (size_t i = 3; i < args_.size(); ++i) {
        int64_t id = 0;
        if (!ParseI64(args_[i], id)) return Answer(std::move(r), "ERR Invalid client ID");
        ids->push_back(static_cast<uint64_t>(id));
      }
    } else if (args_.size() != 2) {
      return Answer(std::move(r), kSyntaxError);
    }
    std::string out;
    if (all) {
      for (const auto& c : fe_.Connections(ns_)) {
        if (ids && std::find(ids->begin(), ids->end(), c->id_) == ids->end()) continue;
        out += c.get() == this ? InfoLine(true, "client|list") : c->InfoLine(false, {});
        out += '\n';
      }
    }
    r.W().Verbatim(out);
    Answer(std::move(r));
  }

  // CLIENT KILL addr:port, or CLIENT KILL [ID id] [TYPE type] [ADDR a] [LADDR a] [USER u]
  // [SKIPME yes|no] (USER: a namespace's name).
  void ClientKill(Reply r) {
    std::optional<std::string_view> addr, laddr, user;
    uint64_t id = 0;
    bool skipme = true, any_type = true;
    const bool old_form = args_.size() == 3;
    if (old_form) {
      addr = args_[2];
      skipme = false;  // the old form may close the caller itself
    } else {
      for (size_t i = 2; i < args_.size(); i += 2) {
        const bool more = i + 1 < args_.size();
        const std::string_view opt = args_[i];
        if (!more) return Answer(std::move(r), kSyntaxError);
        const std::string_view v = args_[i + 1];
        if (EqualsNoCase(opt, "id")) {
          int64_t n = 0;
          if (!ParseI64(v, n) || n < 1) return Answer(std::move(r), "ERR client-id should be greater than 0");
          id = static_cast<uint64_t>(n);
        } else if (EqualsNoCase(opt, "type")) {
          if (!KnownClientType(v, any_type)) {
            return Answer(std::move(r), fmt::format("ERR Unknown client type '{}'", Printable(v, 128)));
          }
        } else if (EqualsNoCase(opt, "addr")) {
          addr = v;
        } else if (EqualsNoCase(opt, "laddr")) {
          laddr = v;
        } else if (EqualsNoCase(opt, "user")) {
          bool known = false;
          for (const auto& n : host_.options->namespaces) known = known || n.name == v;
          if (!known) return Answer(std::move(r), fmt::format("ERR No such user '{}'", Printable(v, 128)));
          user = v;
        } else if (EqualsNoCase(opt, "skipme")) {
          if (EqualsNoCase(v, "yes")) {
            skipme = true;
          } else if (EqualsNoCase(v, "no")) {
            skipme = false;
          } else {
            return Answer(std::move(r), kSyntaxError);
          }
        } else {
          return Answer(std::move(r), kSyntaxError);
        }
      }
    }
    int64_t killed = 0;
    if (any_type) {
      const std::string my_ns = host_.options->namespaces[ns_ - 1].name;
      for (const auto& c : fe_.Connections(ns_)) {
        if (addr && c->addr_ != *addr) continue;
        if (laddr && c->laddr_ != *laddr) continue;
        if (id != 0 && c->id_ != id) continue;
        if (user && *user != my_ns) continue;
        if (c.get() == this) {
          if (skipme) continue;
          r.close_after = true;  // after this reply
        } else {
          c->Kill();
        }
        ++killed;
      }
    }
    if (old_form) {
      if (killed == 0) return Answer(std::move(r), "ERR No such client");
      r.W().Simple("OK");
    } else {
      r.W().Integer(killed);
    }
    Answer(std::move(r));
  }

  // The connection as CLIENT LIST shows it, in Redis 7.0's fields (networking.c,
  // catClientInfoString); `user` is its namespace. Read from other connections' threads: only
  // what is constant or shared (info_mu_, atomics).
  std::string InfoLine(bool caller, std::string_view current) const {
    const auto now = Clock::now();
    const auto secs = [&](Clock::time_point t) {
      return std::chrono::duration_cast<std::chrono::seconds>(now - t).count();
    };
    const int last = last_cmd_.load(std::memory_order_relaxed);
    std::string name, cmd;
    {
      std::lock_guard<std::mutex> l(info_mu_);
      name = shared_name_;
      if (last == kClient || last == kConfig || last == kCommand) cmd = shared_fullname_;
    }
    const uint32_t ns = shared_ns_.load(std::memory_order_relaxed);
    if (caller) {
      cmd = current;
    } else if (cmd.empty()) {
      cmd = last < 0 ? "NULL" : kSpecs[last].name;
    }
    const Clock::time_point active{Clock::duration(last_cmd_at_.load(std::memory_order_relaxed))};
    return fmt::format(
        "id={} addr={} laddr={} fd={} name={} age={} idle={} flags={} db=0 sub=0 psub=0 ssub=0 multi=-1 qbuf=0 "
        "qbuf-free=0 argv-mem=0 multi-mem=0 rbs={} rbp=0 obl=0 oll=0 omem=0 tot-mem={} events=r cmd={} user={} "
        "redir=-1 resp={}",
        id_, addr_, laddr_, fd_, name, secs(created_), secs(active), is_unix_ ? "U" : "N",
        cap_shared_.load(std::memory_order_relaxed), cap_shared_.load(std::memory_order_relaxed) + 1024, cmd,
        ns == 0 ? "(none)" : host_.options->namespaces[ns - 1].name, shared_protocol_.load(std::memory_order_relaxed));
  }

  // CLIENT KILL from another connection: closed on its own thread.
  void Kill() {
    asio::post(strand_, [self = shared_from_this()] { self->CloseNow(); });
  }

  void SetName(std::string name) {
    name_ = name;
    std::lock_guard<std::mutex> l(info_mu_);
    shared_name_ = std::move(name);
  }

  void Config(Reply r) {
    const std::string sub = Lower(args_[1]);
    if (sub == "get" && args_.size() >= 3) {
      const ServerOptions& o = *host_.options;
      uint64_t host_capacity = 0;
      for (const auto& t : host_.store->Tiers()) {
        if (t.name == "host") host_capacity = t.capacity_bytes;
      }
      const std::vector<std::pair<std::string, std::string>> params = {
          {"save", ""},
          {"appendonly", "no"},
          {"databases", "1"},
          {"maxclients", std::to_string(o.max_connections)},
          {"maxmemory", std::to_string(host_capacity)},
          {"maxmemory-policy", "allkeys-lru"},
          {"proto-max-bulk-len", std::to_string(fe_.max_bulk_.load(std::memory_order_relaxed))},
          {"timeout", std::to_string(fe_.idle_timeout_ms_.load(std::memory_order_relaxed) / 1000)},
          {"port", std::to_string(fe_.tcp_port())},
      };
      std::vector<const std::pair<std::string, std::string>*> hits;
      for (const auto& p : params) {
        for (size_t i = 2; i < args_.size(); ++i) {
          if (resp::GlobMatch(args_[i], p.first, /*nocase=*/true)) {
            hits.push_back(&p);
            break;
          }
        }
      }
      auto w = r.W();
      w.Map(hits.size());
      for (const auto* p : hits) {
        w.Bulk(p->first);
        w.Bulk(p->second);
      }
      return Answer(std::move(r));
    }
    if (sub == "resetstat" && args_.size() == 2) {
      r.W().Simple("OK");
      return Answer(std::move(r));
    }
    if (sub == "set" && args_.size() >= 4) return ConfigSet(std::move(r));
    return SubcommandError(std::move(r), "config", {{"get", -3}, {"set", -4}, {"resetstat", 2}});
  }

  // CONFIG SET name value [name value ...], all or nothing, as Redis 7.0 (config.c). What can
  // change while sparsekvd runs: timeout (the RESP idle timeout, 0: none) and proto-max-bulk-len
  // (at most what the tiers take). save and appendonly take only what sparsekvd does (no RDB, no
  // AOF: its tiers persist); the other parameters CONFIG GET shows are set in its configuration
  // file and refused by name.
  void ConfigSet(Reply r) {
    if (args_.size() % 2 == 1) return Answer(std::move(r), kSyntaxError);
    const uint64_t most = fe_.limits_.max_bulk_bytes;
    std::optional<uint32_t> timeout;
    std::optional<uint64_t> bulk;
    std::vector<std::string> seen;
    auto failed = [&](std::string_view name, std::string_view why) {
      return fmt::format("ERR CONFIG SET failed (possibly related to argument '{}') - {}", Printable(name, 128), why);
    };
    std::string error;
    for (size_t i = 2; i + 1 < args_.size() && error.empty(); i += 2) {
      const std::string name = Lower(args_[i]);
      const std::string_view v = args_[i + 1];
      if (std::find(seen.begin(), seen.end(), name) != seen.end()) {
        error = failed(args_[i], "duplicate parameter");
        break;
      }
      seen.push_back(name);
      int64_t n = 0;
      if (name == "timeout") {
        if (!ParseI64(v, n) || n < 0 || n > INT32_MAX / 1000) {
          error = failed(args_[i], "argument couldn't be parsed into an integer");
        } else {
          timeout = static_cast<uint32_t>(n * 1000);
        }
      } else if (name == "proto-max-bulk-len") {
        if (!ParseI64(v, n) || n < (1 << 20)) {
          error = failed(args_[i], "argument must be a memory value of at least 1mb");
        } else if (static_cast<uint64_t>(n) > most) {
          error = failed(args_[i], fmt::format("sparsekvd's tiers and max_frame_bytes take at most {}", most));
        } else {
          bulk = static_cast<uint64_t>(n);
        }
      } else if (name == "save") {
        if (!v.empty()) error = failed(args_[i], "sparsekvd writes no RDB snapshots: its tiers persist values");
      } else if (name == "appendonly") {
        if (!EqualsNoCase(v, "no")) error = failed(args_[i], "sparsekvd keeps no append-only file: its tiers persist values");
      } else if (name == "maxclients" || name == "maxmemory" || name == "maxmemory-policy" || name == "databases" ||
                 name == "port") {
        error = failed(args_[i], "sparsekvd sets it in its configuration file, not at run time");
      } else {
        error = fmt::format("ERR Unknown option or number of arguments for CONFIG SET - '{}'", Printable(args_[i], 128));
      }
    }
    if (!error.empty()) return Answer(std::move(r), error);
    if (timeout) fe_.idle_timeout_ms_.store(*timeout, std::memory_order_relaxed);
    if (bulk) fe_.max_bulk_.store(*bulk, std::memory_order_relaxed);
    r.W().Simple("OK");
    Answer(std::move(r));
  }

  void CommandCmd(Reply r) {
    auto w = r.W();
    auto info = [&](const CmdSpec& s) {
      // name, arity, flags, first key, last key, step, ACL categories, tips, key specs, subcommands
      w.Array(10);
      w.Bulk(s.name);
      w.Integer(s.arity);
      w.Set(0);
      w.Integer(s.first_key);
      w.Integer(s.last_key);
      w.Integer(s.key_step);
      w.Set(0);
      w.Array(0);
      w.Array(0);
      w.Array(0);
    };
    const size_t known = kUnknown;
    if (args_.size() == 1) {
      w.Array(known);
      for (size_t i = 0; i < known; ++i) info(kSpecs[i]);
      return Answer(std::move(r));
    }
    const std::string sub = Lower(args_[1]);
    if (sub == "count") {
      w.Integer(static_cast<int64_t>(known));
    } else if (sub == "docs") {
      // A summary and group per command (redis-cli takes its hints from these).
      std::vector<const CmdSpec*> asked;
      if (args_.size() == 2) {
        for (size_t i = 0; i < known; ++i) asked.push_back(&kSpecs[i]);
      } else {
        for (size_t i = 2; i < args_.size(); ++i) {
          const Cmd c = Lookup(args_[i]);
          if (c != kUnknown) asked.push_back(&kSpecs[c]);
        }
      }
      w.Map(asked.size());
      for (const CmdSpec* s : asked) {
        static constexpr const char* kGroups[] = {"connection", "server", "generic", "string"};
        w.Bulk(s->name);
        w.Map(3);
        w.Bulk("summary");
        w.Bulk(fmt::format("{} as Redis serves it, over sparsekv's tiers", Lower(s->name)));
        w.Bulk("since");
        w.Bulk("1.0.0");
        w.Bulk("group");
        w.Bulk(kGroups[static_cast<int>(s->group)]);
      }
    } else if (sub == "info") {
      w.Array(args_.size() - 2);
      for (size_t i = 2; i < args_.size(); ++i) {
        const Cmd c = Lookup(args_[i]);
        if (c == kUnknown) {
          w.NullArray();
        } else {
          info(kSpecs[c]);
        }
      }
    } else if (sub == "list") {
      w.Array(known);
      for (size_t i = 0; i < known; ++i) w.Bulk(kSpecs[i].name);
    } else {
      return SubcommandError(std::move(r), "command", {});
    }
    Answer(std::move(r));
  }

  // ---- writing ----

  void Queue(Reply r) {
    if (closed_) return;
    for (Piece& p : r.pieces()) {
      const uint64_t n = p.keep ? p.ext.size() : p.text.size();
      if (n == 0) continue;
      out_bytes_ += n;
      if (!p.keep) {
        // Text is charged to the budget; values sent in place are counted by the pin budget.
        TakeBudget(n);
        out_charged_ += n;
        // Small replies share a piece (not one being written): a client that pipelines a
        // million PINGs costs a few bytes per reply, not a string each.
        if (!out_.empty() && out_.size() > writing_n_ && !out_.back().keep && out_.back().text.size() < (64u << 10)) {
          out_.back().text += p.text;
          KeepSpare(std::move(p.text));
          continue;
        }
      }
      out_.push_back(std::move(p));
    }
  }

  // Reply buffers written out are kept (up to kSpares, each at most kSpareBytes) and built in
  // again, cleared: a reply of 64 KiB of values then costs no allocation and no page faults.
  static constexpr size_t kSpares = 4;
  static constexpr size_t kSpareBytes = 1u << 20;
  std::string TakeSpare() {
    if (spare_.empty()) return {};
    std::string s = std::move(spare_.back());
    spare_.pop_back();
    s.clear();
    return s;
  }
  void KeepSpare(std::string&& s) {
    if (s.capacity() >= 4096 && s.capacity() <= kSpareBytes && spare_.size() < kSpares) spare_.push_back(std::move(s));
  }

  // The connection's share of the daemon-wide budget, taken and given back here (not by
  // objects that could outlive the server's budget): everything is given back at close.
  void TakeBudget(uint64_t n) {
    if (n == 0) return;
    account_->held.fetch_add(n, std::memory_order_relaxed);
    host_.budget->Take(n);
  }
  void GiveBudget(uint64_t n) {
    if (n == 0) return;
    account_->held.fetch_sub(n, std::memory_order_relaxed);
    host_.budget->Give(n);
  }

  void DoWrite() {
    if (writing_ || out_.empty() || closed_) {
      MaybeClose();
      return;
    }
    writing_ = true;
    write_started_ = Clock::now();
    std::vector<asio::const_buffer> bufs;
    size_t n = 0;
    uint64_t bytes = 0, text = 0;
    for (const Piece& p : out_) {
      if (n == 64 || bytes >= (4u << 20)) break;
      if (p.keep) {
        bufs.emplace_back(p.ext.data(), p.ext.size());
        bytes += p.ext.size();
      } else {
        bufs.emplace_back(p.text.data(), p.text.size());
        bytes += p.text.size();
        text += p.text.size();
      }
      ++n;
    }
    writing_n_ = n;
    // Everything gathered in one sendmsg, as far as the socket takes it (SendWhole).
    asio::async_write(socket_, bufs, SendWhole(),
                      asio::bind_executor(strand_, [self = shared_from_this(), n, bytes, text](boost::system::error_code ec, size_t) {
                        self->writing_ = false;
                        self->writing_n_ = 0;
                        for (size_t i = 0; i < n; ++i) {
                          if (!self->out_.front().keep) self->KeepSpare(std::move(self->out_.front().text));
                          self->out_.pop_front();
                        }
                        self->out_bytes_ -= bytes;
                        if (!self->closed_) {
                          self->out_charged_ -= text;
                          self->GiveBudget(text);
                        }
                        if (ec) {
                          self->closing_ = true;
                          return self->CloseNow();
                        }
                        self->last_active_ = Clock::now();
                        self->DoWrite();
                        if (!self->busy_) self->Process();
                      }));
  }

  // ---- deadlines and closing ----

  void ArmTick() {
    tick_.expires_after(fe_.tick_);
    tick_.async_wait(asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_) return;
      self->OnTick();
      if (!self->closed_) self->ArmTick();
    }));
  }

  void OnTick() {
    const ServerOptions& o = *host_.options;
    const auto now = Clock::now();
    auto past = [&](Clock::time_point since, uint32_t ms) {
      return since != Clock::time_point{} && now - since > std::chrono::milliseconds(ms);
    };
    if (writing_ && past(write_started_, o.write_timeout_ms)) {
      fe_.slow_readers_.fetch_add(1, std::memory_order_relaxed);
      host_.metrics->SlowClientDropped();
      return CloseNow();
    }
    if (busy_ || writing_) return;
    if (ns_ == 0 && past(created_, o.handshake_timeout_ms)) {
      fe_.timeouts_.fetch_add(1, std::memory_order_relaxed);
      host_.metrics->HandshakeTimedOut();
      return CloseNow();
    }
    if (!parked_ && end_ > begin_ && past(request_started_, o.frame_timeout_ms)) {
      // A request that does not finish arriving (slowloris) holds its buffer: closed. Time parked
      // on the daemon's budget does not count (Resume moves the start by it).
      fe_.timeouts_.fetch_add(1, std::memory_order_relaxed);
      host_.metrics->FrameTimedOut();
      return CloseNow();
    }
    const uint32_t idle = fe_.idle_timeout_ms_.load(std::memory_order_relaxed);  // 0: none (CONFIG SET timeout 0)
    if (end_ == begin_ && idle != 0 && past(last_active_, idle)) return CloseNow();
    if (end_ == begin_ && cap_ > kSmall && reading_ && !shrinking_ && past(last_active_, 2 * fe_.tick_.count())) {
      shrinking_ = true;
      boost::system::error_code ec;
      socket_.cancel(ec);
    }
    if (parked_) Resume();
  }

  void MaybeClose() {
    if (closed_ || !closing_ || busy_ || writing_ || !out_.empty()) return;  // DoWrite finishes, then closes
    CloseNow();
  }

  void CloseNow() {
    if (closed_) return;
    closed_ = true;
    host_.budget->ReturnPass(this);
    boost::system::error_code ec;
    tick_.cancel();
    retry_.cancel();
    socket_.shutdown(GenericSocket::shutdown_both, ec);
    socket_.close(ec);
    closing_ = true;
    // A worker's or a write's completion may still run on this strand: it finds closed_. The
    // budget is given back now, whatever is still queued.
    GiveBudget(std::exchange(buf_charged_, 0) + std::exchange(out_charged_, 0));
    LeaveNamespace();
    if (!writing_) {
      out_.clear();
      out_bytes_ = 0;
    }
    fe_.Closed(this);
  }

  RespFrontEnd::Impl& fe_;
  const RespHost& host_;
  GenericSocket socket_;
  asio::strand<asio::io_context::executor_type> strand_;
  asio::steady_timer tick_;
  asio::steady_timer retry_;  // a parked connection looks at the budget again (Park)
  bool retry_armed_ = false;
  const uint64_t id_;
  const uint32_t start_ns_;  // the namespace a connection starts in (0: it must AUTH)
  uint32_t ns_ = 0;          // 0 until in a namespace (holding one of its connections)
  int protocol_ = 2;
  std::string name_;
  std::shared_ptr<Account> account_;

  char* buf_ = nullptr;
  size_t cap_ = 0, begin_ = 0, end_ = 0, need_ = 0;
  size_t request_begin_ = 0, consumed_ = 0;
  uint64_t buf_charged_ = 0, out_charged_ = 0;  // bytes taken from the budget
  std::vector<std::string_view> args_;
  std::vector<std::string> inline_;
  std::vector<wire::WireHash> hashes_;
  std::string key_copy_;
  Cmd cmd_ = kUnknown;
  std::unique_ptr<Reply> pending_put_;
  bool put_per_item_ = false;
  bool last_read_full_ = false;
  bool shrinking_ = false;  // a read cancelled to give the grown buffer back
  std::vector<std::string_view> batch_keys_, batch_values_, batch_args_;
  std::vector<std::string> batch_storage_, batch_key_copies_;

  std::deque<Piece> out_;
  std::vector<std::string> spare_;  // reply buffers to build in again (TakeSpare)
  uint64_t out_bytes_ = 0;
  size_t writing_n_ = 0;  // pieces at the front of out_ being written (not to be appended to)

  bool reading_ = false, writing_ = false, busy_ = false, closing_ = false, closed_ = false, parked_ = false,
       eof_ = false;
  const Clock::time_point created_;
  Clock::time_point last_active_, request_started_{}, write_started_{};
  // What CLIENT LIST shows of the connection to others (set once, or shared).
  std::string addr_, laddr_;
  int fd_ = -1;
  bool is_unix_ = false;
  mutable std::mutex info_mu_;
  std::string shared_name_, shared_fullname_;  // guarded by info_mu_
  std::atomic<uint32_t> shared_ns_{0};
  std::atomic<int> shared_protocol_{2}, last_cmd_{-1};
  std::atomic<Clock::rep> last_cmd_at_{0};
  std::atomic<uint64_t> cap_shared_{0};
  Clock::time_point parked_at_{};  // when it last parked on the budget
};

// ---- the front end ----

Status RespFrontEnd::Impl::Bind(const std::string& tcp_listen, const std::string& unix_path) {
  if (!tcp_listen.empty()) {
    SPARSEKV_ASSIGN_OR_RETURN(tcp_, ListenTcp(*host_.io, tcp_listen, "RESP: listening on"));
    tcp_address_ = BoundAddress(*tcp_);
    tcp_port_ = tcp_->local_endpoint().port();
  }
  if (!unix_path.empty()) SPARSEKV_RETURN_IF_ERROR(unix_.Listen(*host_.io, unix_path, "RESP: listening on"));
  return Status::OK();
}

void RespFrontEnd::Impl::Accept() {
  tcp_->async_accept([this](boost::system::error_code ec, asio::ip::tcp::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted) Accept();
      return;
    }
    boost::system::error_code ignored;
    s.set_option(asio::ip::tcp::no_delay(true), ignored);
    Admit(GenericSocket(std::move(s)), false);
    Accept();
  });
}

void RespFrontEnd::Impl::AcceptUnix() {
  unix_.acceptor()->async_accept([this](boost::system::error_code ec, asio::local::stream_protocol::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted) AcceptUnix();
      return;
    }
    Admit(GenericSocket(std::move(s)), true);
    AcceptUnix();
  });
}

void RespFrontEnd::Impl::Admit(GenericSocket socket, bool) {
  auto c = std::make_shared<RespConnection>(*this, std::move(socket), host_.next_id());
  // The slot is taken outside mu_: the server's lock comes before this one (Closed).
  const bool slot = host_.take_slot();
  bool refuse = !slot, dropped = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Past twice the limit (connections still closing), sockets are dropped without a word.
    dropped = draining_ || conns_.size() >= 2ull * host_.options->max_connections + 16;
    if (!dropped) {
      c->counted_ = slot;
      conns_.insert(c);
    }
  }
  if (dropped) {
    if (slot) host_.give_slot();
    return;
  }
  host_.metrics->ConnectionOpened();
  accepted_.fetch_add(1, std::memory_order_relaxed);
  open_.fetch_add(1, std::memory_order_relaxed);
  if (refuse) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    host_.metrics->ConnectionRejected();
    c->Refuse();
    return;
  }
  c->Start();
}

void RespFrontEnd::Impl::Closed(RespConnection* c) {
  host_.metrics->ConnectionClosed();
  open_.fetch_sub(1, std::memory_order_relaxed);
  bool drained = false, slot = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (it->get() != c) continue;
      slot = c->counted_;
      c->counted_ = false;
      // The connection may be running its last handler: released after it returns.
      asio::post(*host_.io, [keep = *it] {});
      conns_.erase(it);
      break;
    }
    drained = draining_ && conns_.empty();
  }
  if (slot) host_.give_slot();
  if (drained) host_.on_drained();
}

std::vector<std::shared_ptr<RespConnection>> RespFrontEnd::Impl::Connections(uint32_t ns) {
  std::vector<std::shared_ptr<RespConnection>> out;
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& c : conns_) {
    if (ns != 0 && c->shared_ns() == ns) out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.get() < b.get(); });
  return out;
}

void RespFrontEnd::Impl::StartExpiry() {
  expiry_session_ = host_.next_id();
  // Deadlines written before this start: learnt from the records, namespace by namespace.
  learn_ns_ = 1;
  ExpiryTick();
}

void RespFrontEnd::Impl::ExpiryTick() {
  if (expiry_stopped_.load()) return;
  if (!expiry_busy_.exchange(true)) {
    std::vector<resp::Keyspace::Due> due = keyspace_.TakeDue(resp::NowMs(), kExpiryBatch);
    const bool learn = learn_ns_ != 0;
    if (due.empty() && !learn) {
      expiry_busy_.store(false);
    } else {
      host_.begin_async();
      host_.submit(expiry_session_, [this, due = std::move(due), learn] {
        if (!due.empty()) keyspace_.ExpireDue(due);
        if (learn) LearnNext();
        expiry_busy_.store(false);
        host_.end_async();
      });
    }
  }
  expiry_timer_.expires_after(kExpiryPeriod);
  expiry_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec) ExpiryTick();
  });
}

// On a worker: one part of the keyspace's headers read for their deadlines.
void RespFrontEnd::Impl::LearnNext() {
  const size_t namespaces = host_.options->namespaces.size();
  while (learn_ns_ != 0 && learn_ns_ <= namespaces) {
    if (learn_at_ == 0 && learn_hashes_.empty()) learn_hashes_ = host_.store->ListHashes(learn_ns_);
    if (learn_at_ < learn_hashes_.size()) {
      const size_t end = std::min(learn_hashes_.size(), learn_at_ + kLearnPart);
      keyspace_.LearnDeadlines(learn_ns_, std::vector<wire::WireHash>(learn_hashes_.begin() + static_cast<std::ptrdiff_t>(learn_at_),
                                                                      learn_hashes_.begin() + static_cast<std::ptrdiff_t>(end)));
      learn_at_ = end;
      return;
    }
    learn_hashes_.clear();
    learn_at_ = 0;
    ++learn_ns_;
  }
  learn_ns_ = 0;  // done
}

Result<std::unique_ptr<RespFrontEnd>> RespFrontEnd::Bind(RespHost host, const std::string& tcp_listen,
                                                         const std::string& unix_path) {
  auto impl = std::make_unique<Impl>(std::move(host));
  SPARSEKV_RETURN_IF_ERROR(impl->Bind(tcp_listen, unix_path));
  return std::unique_ptr<RespFrontEnd>(new RespFrontEnd(std::move(impl)));
}

RespFrontEnd::RespFrontEnd(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RespFrontEnd::~RespFrontEnd() = default;

void RespFrontEnd::Start() {
  impl_->StartExpiry();
  if (impl_->tcp_) impl_->Accept();
  if (impl_->unix_.acceptor()) impl_->AcceptUnix();
}

void RespFrontEnd::BeginDrain() {
  std::vector<std::shared_ptr<RespConnection>> conns;
  {
    std::lock_guard<std::mutex> l(impl_->mu_);
    impl_->draining_ = true;
    conns.assign(impl_->conns_.begin(), impl_->conns_.end());
  }
  impl_->expiry_stopped_.store(true);
  asio::post(*impl_->host_.io, [impl = impl_.get()] {
    boost::system::error_code ignored;
    impl->expiry_timer_.cancel();
    if (impl->tcp_) impl->tcp_->close(ignored);
    impl->unix_.Release();
    if (impl->unix_.acceptor()) impl->unix_.acceptor()->close(ignored);
  });
  for (auto& c : conns) c->BeginDrain();
}

bool RespFrontEnd::Drained() {
  std::lock_guard<std::mutex> l(impl_->mu_);
  return impl_->conns_.empty();
}

void RespFrontEnd::CloseAll() {
  // Called with the server's lock held: slots are not given back (the server is stopping).
  std::lock_guard<std::mutex> l(impl_->mu_);
  for (const auto& c : impl_->conns_) c->counted_ = false;
  impl_->conns_.clear();
}

std::string RespFrontEnd::tcp_address() const { return impl_->tcp_address_; }

void RespFrontEnd::RenderMetrics(std::string& out) const {
  out += "# HELP sparsekv_resp_commands_total RESP commands served, by command (unknown: any other name).\n"
         "# TYPE sparsekv_resp_commands_total counter\n";
  for (int i = 0; i < kCmdCount; ++i) {
    out += fmt::format("sparsekv_resp_commands_total{{command=\"{}\"}} {}\n", kSpecs[i].name,
                       impl_->calls_[i].load(std::memory_order_relaxed));
  }
  out += "# HELP sparsekv_resp_command_errors_total RESP commands answered with an error, by command.\n"
         "# TYPE sparsekv_resp_command_errors_total counter\n";
  for (int i = 0; i < kCmdCount; ++i) {
    out += fmt::format("sparsekv_resp_command_errors_total{{command=\"{}\"}} {}\n", kSpecs[i].name,
                       impl_->errors_[i].load(std::memory_order_relaxed));
  }
  auto one = [&](const char* name, const char* type, const char* help, uint64_t v) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, v);
  };
  one("sparsekv_resp_connections", "gauge", "RESP connections open.",
      static_cast<uint64_t>(std::max<int64_t>(0, impl_->open_.load())));
  one("sparsekv_resp_connections_total", "counter", "RESP connections accepted.", impl_->accepted_.load());
  one("sparsekv_resp_rejected_total", "counter", "RESP connections refused at max_connections.",
      impl_->rejected_.load());
  one("sparsekv_resp_protocol_errors_total", "counter", "RESP connections closed for a malformed request.",
      impl_->protocol_errors_.load());
  one("sparsekv_resp_auth_failures_total", "counter", "RESP AUTH and HELLO AUTH refused.",
      impl_->auth_failures_.load());
  one("sparsekv_resp_timeouts_total", "counter",
      "RESP connections closed for a request that did not finish arriving or an AUTH that did not come.",
      impl_->timeouts_.load());
  one("sparsekv_resp_slow_readers_total", "counter", "RESP connections closed for not taking their replies.",
      impl_->slow_readers_.load());
}

}  // namespace sparsekv::server
