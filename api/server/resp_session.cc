#include "server/resp_session.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "server/resp_keys.h"
#include "server/resp_protocol.h"

namespace sparsekv::server {
namespace {

namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
using Clock = std::chrono::steady_clock;

// The commands sparsekvd serves, with Redis's arity (n: exactly n words with the name; -n: at
// least n). kUnknown counts everything else in the metrics.
enum Cmd : int {
  kPing, kEcho, kHello, kAuth, kClient, kSelect, kQuit, kGet, kSet, kMget, kMset, kExists, kDel, kUnlink,
  kStrlen, kGetrange, kDbsize, kScan, kType, kTtl, kPttl, kInfo, kConfig, kCommand, kFlushdb, kReset,
  kKeys, kFlushall, kUnknown, kCmdCount
};
struct CmdSpec {
  const char* name;
  int arity;
  bool before_auth;  // allowed before AUTH
};
constexpr std::array<CmdSpec, kCmdCount> kSpecs = {{
    {"ping", -1, false},    {"echo", 2, false},     {"hello", -1, true},   {"auth", -2, true},
    {"client", -2, false},  {"select", 2, false},   {"quit", -1, true},    {"get", 2, false},
    {"set", -3, false},     {"mget", -2, false},    {"mset", -3, false},   {"exists", -2, false},
    {"del", -2, false},     {"unlink", -2, false},  {"strlen", 2, false},  {"getrange", 4, false},
    {"dbsize", 1, false},   {"scan", -2, false},    {"type", 2, false},    {"ttl", 2, false},
    {"pttl", 2, false},     {"info", -1, false},    {"config", -2, false}, {"command", -1, false},
    {"flushdb", -1, false}, {"reset", 1, true},     {"keys", 2, false},    {"flushall", -1, false},
    {"unknown", 0, true},
}};

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool EqualsNoCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

Cmd Lookup(std::string_view name) {
  if (name.size() > 16) return kUnknown;
  for (int i = 0; i < kUnknown; ++i) {
    if (EqualsNoCase(name, kSpecs[i].name)) return static_cast<Cmd>(i);
  }
  return kUnknown;
}

bool ParseI64(std::string_view s, int64_t& out) {
  if (s.empty() || s.size() > 20 || s[0] == '+') return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::string_view AsChars(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

std::string Printable(std::string_view s, size_t max) {
  std::string out(s.substr(0, max));
  for (char& c : out) {
    if (c == '\r' || c == '\n') c = ' ';
  }
  return out;
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
  explicit Impl(RespHost host) : host_(std::move(host)) {
    const ServerOptions& o = *host_.options;
    // Redis's proto-max-bulk-len: a value no tier could take is refused from its length alone.
    limits_.max_bulk_bytes = std::min<uint64_t>(o.max_frame_bytes, host_.store->MaxValueBytes());
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
  std::mutex& Stripe(const wire::WireHash& h) {
    uint64_t lo;
    std::memcpy(&lo, h.data(), 8);
    return stripes_[lo % stripes_.size()];
  }

  Clock::time_point started_at() const { return started_; }
  uint16_t tcp_port() const { return tcp_port_; }

  RespHost host_;
  const Clock::time_point started_ = Clock::now();
  uint16_t tcp_port_ = 0;
  resp::Limits limits_, unauth_limits_;
  std::chrono::milliseconds tick_{1000};
  uint32_t default_ns_ = 0;
  std::unique_ptr<asio::ip::tcp::acceptor> tcp_;
  UnixListener unix_;
  std::string tcp_address_;
  std::array<std::mutex, 64> stripes_;
  LogLimiter log_;

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
        last_active_(Clock::now()) {}
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
      resp::Parsed p = resp::ParseRequest(in, ns_ != 0 ? fe_.limits_ : fe_.unauth_limits_, args_, inline_);
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
    while (batch_keys_.size() < kMaxBatch && begin_ + total < end_) {
      const std::string_view rest(buf_ + begin_ + total, end_ - begin_ - total);
      const resp::Parsed p = resp::ParseRequest(rest, fe_.limits_, batch_args_, batch_storage_);
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
    GiveBudget(std::exchange(buf_charged_, 0));
  }

  // ---- serving one request ----

  void Serve() {
    const Cmd cmd = Lookup(args_[0]);
    cmd_ = cmd;
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
        (cmd == kMset && argc % 2 == 0)) {
      return Answer(std::move(r), fmt::format("ERR wrong number of arguments for '{}' command", spec.name));
    }
    if (ns_ == 0 && !spec.before_auth) return Answer(std::move(r), "NOAUTH Authentication required.");
    // Keys longer than kMaxKeyBytes are refused before anything is read or stored.
    {
      size_t first = 0, step = 1, last = 0;
      switch (cmd) {
        case kGet: case kSet: case kStrlen: case kGetrange: case kType: case kTtl: case kPttl:
          first = last = 1;
          break;
        case kMget: case kExists: case kDel: case kUnlink:
          first = 1;
          last = args_.size() - 1;
          break;
        case kMset:
          first = 1;
          step = 2;
          last = args_.size() - 1;
          break;
        default:
          break;
      }
      for (size_t i = first; first != 0 && i <= last; i += step) {
        if (args_[i].size() > resp::kMaxKeyBytes) {
          return Answer(std::move(r), fmt::format("ERR key too long: {} bytes, sparsekv takes at most {}",
                                                  args_[i].size(), resp::kMaxKeyBytes));
        }
      }
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
        name_.clear();
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
        return Mset(std::move(r));
      case kConfig:
        return Config(std::move(r));
      case kCommand:
        return CommandCmd(std::move(r));
      case kTtl:
      case kPttl:
      case kType:
      case kExists:
      case kDel:
      case kUnlink:
      case kStrlen:
      case kGetrange:
      case kDbsize:
      case kScan:
      case kInfo:
      case kFlushdb:
      case kFlushall:
      case kKeys:
        return OnWorker(std::move(r));
      default:
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
    DaemonStore& store = *host_.store;
    auto w = r.W();
    switch (cmd_) {
      case kTtl:
      case kPttl:
      case kType: {
        const bool present = Present(args_[1]);
        if (cmd_ == kType) {
          w.Simple(present ? "string" : "none");
        } else {
          w.Integer(present ? -1 : -2);
        }
        return;
      }
      case kExists: {
        int64_t n = 0;
        for (size_t i = 1; i < args_.size(); ++i) n += Present(args_[i]) ? 1 : 0;
        w.Integer(n);
        return;
      }
      case kDel:
      case kUnlink: {
        int64_t n = 0;
        for (size_t i = 1; i < args_.size(); ++i) {
          const wire::WireHash h = resp::KeyHash(args_[i]);
          std::lock_guard<std::mutex> l(fe_.Stripe(h));
          if (!Present(args_[i])) continue;
          auto st = store.Delete(ns_, std::span<const wire::WireHash>(&h, 1));
          if (st[0].code != StatusCode::kOk) {
            error = fmt::format("ERR deleting a key failed: {}", st[0].message);
            return;
          }
          ++n;
        }
        w.Integer(n);
        return;
      }
      case kStrlen: {
        std::optional<uint64_t> len;
        Status st = ValueLength(args_[1], len);
        if (!st.ok()) {
          error = fmt::format("ERR reading the key failed: {}", st.message());
          return;
        }
        w.Integer(static_cast<int64_t>(len.value_or(0)));
        return;
      }
      case kGetrange:
        return GetRange(r, error);
      case kDbsize:
        w.Integer(static_cast<int64_t>(store.ListHashes(ns_).size()));
        return;
      case kScan:
        return Scan(r, error);
      case kInfo:
        w.Verbatim(InfoText());
        return;
      case kKeys:
        return Keys(r);
      // FLUSHALL empties the caller's namespace, as FLUSHDB: a namespace is a client's whole
      // keyspace here, and no client empties another's.
      case kFlushall:
      case kFlushdb: {
        if (args_.size() > 2 || (args_.size() == 2 && !EqualsNoCase(args_[1], "sync") && !EqualsNoCase(args_[1], "async"))) {
          error = "ERR syntax error";
          return;
        }
        std::vector<wire::WireHash> all = store.ListHashes(ns_);
        for (size_t at = 0; at < all.size(); at += 4096) {
          const size_t n = std::min<size_t>(4096, all.size() - at);
          auto st = store.Delete(ns_, std::span<const wire::WireHash>(all.data() + at, n));
          for (const auto& s : st) {
            if (s.code != StatusCode::kOk) {
              error = fmt::format("ERR flushing failed: {}", s.message);
              return;
            }
          }
        }
        w.Simple("OK");
        return;
      }
      case kGet:
      case kMget:
        return GetOnWorker(r);
      case kSet:
        return SetOnWorker(r, error);
      case kMset:
        return MsetOnWorker(r, error);
      default:
        error = "ERR internal: no worker handler";
    }
  }

  // Whether `key` holds a value (its record is this key's, not a colliding one's).
  bool Present(std::string_view key) {
    std::optional<uint64_t> len;
    return ValueLength(key, len).ok() && len.has_value();
  }

  // The length of `key`'s value, read from its header alone (a bridge key: its whole value).
  Status ValueLength(std::string_view key, std::optional<uint64_t>& len) {
    len.reset();
    const wire::WireHash h = resp::KeyHash(key);
    DaemonStore& store = *host_.store;
    Status out;
    if (resp::IsBridgeKey(key)) {
      store.Get(ns_, std::span<const wire::WireHash>(&h, 1),
                [&](size_t, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep&) {
                  if (st.ok()) {
                    len = bytes.size();
                  } else if (!(st.code() == StatusCode::kNotFound) && !st.data_loss()) {
                    out = st;
                  }
                });
      return out;
    }
    const std::string header = ReadHeader(key, h, out);
    if (!header.empty()) {
      len = resp::ReadFixedHeader(std::as_bytes(std::span<const char>(header.data(), header.size())))->value_bytes;
    }
    return out;
  }

  // The header of `key`'s record (fixed part and key), or "" when the key holds no value of its
  // own. Reads only those bytes.
  std::string ReadHeader(std::string_view key, const wire::WireHash& h, Status& error) {
    const uint64_t bytes = resp::kFixedHeaderBytes + key.size();
    std::vector<wire::RangeItem> items(1);
    items[0].hash = h;
    items[0].ranges.push_back({0, static_cast<uint32_t>(bytes)});
    std::string header;
    host_.store->GetRanges(ns_, items, [&](size_t, const Status& st, std::span<const std::byte> b) {
      if (st.ok()) {
        const auto fixed = resp::ReadFixedHeader(b);
        if (fixed && fixed->key_bytes == key.size() &&
            std::memcmp(b.data() + resp::kFixedHeaderBytes, key.data(), key.size()) == 0) {
          header.assign(reinterpret_cast<const char*>(b.data()), b.size());
        }
      } else if (!(st.code() == StatusCode::kNotFound) && !st.data_loss() && st.code() != StatusCode::kInvalidArgument) {
        error = st;
      }
    });
    return header;
  }

  void GetRange(Reply& r, std::string& error) {
    int64_t start = 0, end = 0;
    if (!ParseI64(args_[2], start) || !ParseI64(args_[3], end)) {
      error = "ERR value is not an integer or out of range";
      return;
    }
    const std::string_view key = args_[1];
    const wire::WireHash h = resp::KeyHash(key);
    auto clamp = [&](uint64_t len, uint64_t& from, uint64_t& n) {
      const auto l = static_cast<int64_t>(len);
      int64_t s = start < 0 ? l + start : start;
      int64_t e = end < 0 ? l + end : end;
      if (s < 0) s = 0;
      if (e < 0) e = 0;
      if (e >= l) e = l - 1;
      if (l == 0 || s > e || (start < 0 && end < 0 && start > end)) {
        n = 0;
        return;
      }
      from = static_cast<uint64_t>(s);
      n = static_cast<uint64_t>(e - s + 1);
    };
    auto w = r.W();
    if (resp::IsBridgeKey(key)) {
      bool answered = false;
      host_.store->Get(ns_, std::span<const wire::WireHash>(&h, 1),
                       [&](size_t, const Status& st, std::span<const std::byte> b, const DaemonStore::Keep&) {
                         uint64_t from = 0, n = 0;
                         if (st.ok()) clamp(b.size(), from, n);
                         if (!st.ok() && !(st.code() == StatusCode::kNotFound) && !st.data_loss()) {
                           error = fmt::format("ERR reading the key failed: {}", st.message());
                           return;
                         }
                         w.Bulk(AsChars(b.subspan(from, n)));
                         answered = true;
                       });
      if (!answered && error.empty()) w.Bulk("");
      return;
    }
    // The header first (its length), then header and range in one read of one version: a SET
    // in between that changed the length is read again.
    for (int attempt = 0; attempt < 4; ++attempt) {
      Status st;
      const std::string header = ReadHeader(key, h, st);
      if (!st.ok()) {
        error = fmt::format("ERR reading the key failed: {}", st.message());
        return;
      }
      if (header.empty()) {
        w.Bulk("");
        return;
      }
      const uint64_t len = resp::ReadFixedHeader(std::as_bytes(std::span<const char>(header)))->value_bytes;
      uint64_t from = 0, n = 0;
      clamp(len, from, n);
      if (n == 0) {
        w.Bulk("");
        return;
      }
      if (n > fe_.limits_.max_bulk_bytes) {
        error = "ERR the range asked for is larger than the largest reply (max_frame_bytes)";
        return;
      }
      std::vector<wire::RangeItem> items(1);
      items[0].hash = h;
      items[0].ranges.push_back({0, static_cast<uint32_t>(header.size())});
      // Ranges are at most 4 GiB - 1 each: a longer one is split.
      for (uint64_t at = 0; at < n;) {
        const uint64_t part = std::min<uint64_t>(n - at, 1u << 30);
        items[0].ranges.push_back({header.size() + from + at, static_cast<uint32_t>(part)});
        at += part;
      }
      bool same = false, gone = false;
      host_.store->GetRanges(ns_, items, [&](size_t, const Status& s, std::span<const std::byte> b) {
        if (!s.ok()) {
          gone = true;
          if (!(s.code() == StatusCode::kNotFound) && !s.data_loss() && s.code() != StatusCode::kInvalidArgument) {
            error = fmt::format("ERR reading the key failed: {}", s.message());
          }
          return;
        }
        if (b.size() == header.size() + n && std::memcmp(b.data(), header.data(), header.size()) == 0) {
          same = true;
          w.Bulk(AsChars(b.subspan(header.size())));
        }
      });
      if (!error.empty() || same) return;
      if (gone) continue;  // deleted or replaced meanwhile: look again
    }
    if (error.empty()) w.Bulk("");
  }

  void Scan(Reply& r, std::string& error) {
    uint64_t cursor = 0;
    {
      const std::string_view c = args_[1];
      auto [p, ec] = std::from_chars(c.data(), c.data() + c.size(), cursor);
      if (ec != std::errc() || p != c.data() + c.size()) {
        error = "ERR invalid cursor";
        return;
      }
    }
    std::string_view match;
    bool have_match = false;
    int64_t count = 10;
    for (size_t i = 2; i < args_.size(); i += 2) {
      if (i + 1 >= args_.size()) {
        error = "ERR syntax error";
        return;
      }
      if (EqualsNoCase(args_[i], "match")) {
        match = args_[i + 1];
        have_match = !(match.size() == 1 && match[0] == '*');
      } else if (EqualsNoCase(args_[i], "count")) {
        if (!ParseI64(args_[i + 1], count)) {
          error = "ERR value is not an integer or out of range";
          return;
        }
        if (count < 1) {
          error = "ERR syntax error";
          return;
        }
      } else if (EqualsNoCase(args_[i], "type")) {
        if (!EqualsNoCase(args_[i + 1], "string")) count = -1;  // only strings here: nothing matches
      } else {
        error = "ERR syntax error";
        return;
      }
    }
    // The cursor is the high 64 bits of the hash to go on from: hashes are listed in order, so
    // a key present from the first call to the last is returned, whatever else changes.
    std::vector<wire::WireHash> all = host_.store->ListHashes(ns_);
    auto hi_of = [](const wire::WireHash& h) {
      uint64_t hi;
      std::memcpy(&hi, h.data() + 8, 8);
      return hi;
    };
    auto it = std::lower_bound(all.begin(), all.end(), cursor,
                               [&](const wire::WireHash& h, uint64_t c) { return hi_of(h) < c; });
    std::vector<wire::WireHash> batch;
    const size_t want = count < 0 ? 10 : static_cast<size_t>(std::min<int64_t>(count, 1 << 20));
    while (it != all.end() && (batch.size() < want || hi_of(*it) == hi_of(batch.back()))) batch.push_back(*it++);
    uint64_t next = 0;
    if (it != all.end()) next = hi_of(batch.back()) + 1;  // hi of the last < hi of *it, so no overflow
    std::vector<std::string> names = count < 0 ? std::vector<std::string>{} : KeyNames(batch);
    auto w = r.W();
    w.Array(2);
    w.Bulk(std::to_string(next));
    size_t shown = 0;
    for (const std::string& n : names) shown += (!have_match || resp::GlobMatch(match, n)) ? 1 : 0;
    w.Array(shown);
    for (const std::string& n : names) {
      if (!have_match || resp::GlobMatch(match, n)) w.Bulk(n);
    }
  }

  // KEYS pattern: every key of the caller's namespace that matches (Redis's glob), in no set order.
  // Like Redis's, one reply with the whole keyspace: SCAN is the way through a large one.
  void Keys(Reply& r) {
    const std::string_view pattern = args_[1];
    const bool every = pattern.size() == 1 && pattern[0] == '*';
    const std::vector<wire::WireHash> all = host_.store->ListHashes(ns_);
    std::vector<std::string> matched;
    constexpr size_t kPart = 1024;  // the records' headers are read a part at a time
    for (size_t at = 0; at < all.size(); at += kPart) {
      const std::vector<wire::WireHash> part(all.begin() + static_cast<std::ptrdiff_t>(at),
                                             all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), at + kPart)));
      for (std::string& n : KeyNames(part)) {
        if (every || resp::GlobMatch(pattern, n)) matched.push_back(std::move(n));
      }
    }
    auto w = r.W();
    w.Array(matched.size());
    for (const std::string& n : matched) w.Bulk(n);
  }

  // The key each hash is filed under: its record's key, or the bridge key that names it.
  std::vector<std::string> KeyNames(const std::vector<wire::WireHash>& hashes) {
    std::vector<std::string> out(hashes.size());
    std::vector<wire::RangeItem> items(hashes.size());
    for (size_t i = 0; i < hashes.size(); ++i) {
      out[i] = resp::BridgeKeyOf(hashes[i]);
      items[i].hash = hashes[i];
      items[i].ranges.push_back({0, static_cast<uint32_t>(resp::kFixedHeaderBytes)});
    }
    std::vector<uint32_t> key_bytes(hashes.size(), 0);
    std::vector<size_t> second;
    host_.store->GetRanges(ns_, items, [&](size_t i, const Status& st, std::span<const std::byte> b) {
      if (!st.ok()) return;
      if (auto h = resp::ReadFixedHeader(b)) {
        key_bytes[i] = h->key_bytes;
        second.push_back(i);
      }
    });
    if (second.empty()) return out;
    std::vector<wire::RangeItem> keys;
    for (size_t i : second) {
      wire::RangeItem item;
      item.hash = hashes[i];
      item.ranges.push_back({0, static_cast<uint32_t>(resp::kFixedHeaderBytes + key_bytes[i])});
      keys.push_back(std::move(item));
    }
    host_.store->GetRanges(ns_, keys, [&](size_t k, const Status& st, std::span<const std::byte> b) {
      if (!st.ok() || b.size() < resp::kFixedHeaderBytes) return;
      std::string_view key = AsChars(b.subspan(resp::kFixedHeaderBytes));
      // A record whose key does not hash to where it lies is a native block that starts like
      // one of ours: shown by its bridge key.
      if (!resp::IsBridgeKey(key) && resp::KeyHash(key) == hashes[second[k]]) out[second[k]] = std::string(key);
    });
    return out;
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
          "keyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:0\r\n\r\n",
          fe_.accepted_.load(), fe_.commands_total_.load(), fe_.rejected_.load(), fe_.keyspace_hits_.load(),
          fe_.keyspace_misses_.load(), evicted);
    }
    if (want("keyspace")) {
      const size_t keys = host_.store->ListHashes(ns_).size();
      out += "# Keyspace\r\n";
      if (keys > 0) out += fmt::format("db0:keys={},expires=0,avg_ttl=0\r\n", keys);
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
    if (st.ok()) value = resp::ValueOf(bytes, key);
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

  struct SetOptions {
    bool nx = false, xx = false, get = false;
  };

  // Parses SET's options; an error text when they are wrong.
  std::string ParseSetOptions(SetOptions& o) {
    for (size_t i = 3; i < args_.size(); ++i) {
      const std::string_view a = args_[i];
      if (EqualsNoCase(a, "nx") && !o.xx) {
        o.nx = true;
      } else if (EqualsNoCase(a, "xx") && !o.nx) {
        o.xx = true;
      } else if (EqualsNoCase(a, "get")) {
        o.get = true;
      } else if (EqualsNoCase(a, "ex") || EqualsNoCase(a, "px") || EqualsNoCase(a, "exat") ||
                 EqualsNoCase(a, "pxat") || EqualsNoCase(a, "keepttl")) {
        return fmt::format("ERR SET {}: sparsekv keeps no expiry (values leave by eviction); send SET without it",
                           Lower(a));
      } else {
        return "ERR syntax error";
      }
    }
    return {};
  }

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

  void Set(Reply r) {
    SetOptions o;
    if (std::string e = ParseSetOptions(o); !e.empty()) return Answer(std::move(r), e);
    if (std::string e = TooLarge(args_[1], args_[2]); !e.empty()) return Answer(std::move(r), e);
    if (o.nx || o.xx || o.get || !host_.store->PutsWithoutBlocking()) return OnWorker(std::move(r));
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

  void SetOnWorker(Reply& r, std::string& error) {
    SetOptions o;
    ParseSetOptions(o);
    DaemonStore& store = *host_.store;
    const wire::WireHash h = resp::KeyHash(args_[1]);
    std::lock_guard<std::mutex> stripe(fe_.Stripe(h));
    std::optional<std::string> old;
    bool present = false;
    if (o.get) {
      store.Get(ns_, std::span<const wire::WireHash>(&h, 1),
                [&](size_t, const Status& st, std::span<const std::byte> b, const DaemonStore::Keep&) {
                  if (!st.ok()) return;
                  if (auto v = resp::ValueOf(b, args_[1])) old = std::string(AsChars(*v));
                });
      present = old.has_value();
    } else if (o.nx || o.xx) {
      present = Present(args_[1]);
    }
    auto w = r.W();
    const bool store_it = !(o.nx && present) && !(o.xx && !present);
    if (store_it) {
      if (args_[1].data() != key_copy_.data()) key_copy_.assign(args_[1]);
      std::vector<std::byte> scratch;
      // On a worker the buffer is as it was parsed: the header may go in place too.
      const wire::PutItem item{h, Record(key_copy_, args_[2], inline_.empty(), scratch)};
      host_.metrics->BytesIn(item.bundle.size());
      auto st = store.Put(ns_, std::span<const wire::PutItem>(&item, 1));
      if (st[0].code != StatusCode::kOk) {
        error = PutError(st[0]);
        return;
      }
    }
    if (o.get) {
      if (old) {
        w.Bulk(*old);
      } else {
        w.Null();
      }
    } else if (store_it) {
      w.Simple("OK");
    } else {
      w.Null();
    }
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

  void MsetOnWorker(Reply& r, std::string& error) {
    const size_t n = (args_.size() - 1) / 2;
    std::vector<std::vector<std::byte>> scratch(n);
    std::vector<wire::PutItem> items(n);
    std::vector<std::mutex*> stripes;
    for (size_t k = 0; k < n; ++k) {
      const std::string_view key = args_[1 + 2 * k];
      items[k].hash = resp::KeyHash(key);
      items[k].bundle = Record(key, args_[2 + 2 * k], /*in_place=*/false, scratch[k]);
      stripes.push_back(&fe_.Stripe(items[k].hash));
    }
    // Stripes locked in address order, each once: no two MSETs deadlock.
    std::sort(stripes.begin(), stripes.end());
    stripes.erase(std::unique(stripes.begin(), stripes.end()), stripes.end());
    for (auto* m : stripes) m->lock();
    auto st = host_.store->Put(ns_, items);
    for (auto it = stripes.rbegin(); it != stripes.rend(); ++it) (*it)->unlock();
    for (const auto& s : st) {
      if (s.code != StatusCode::kOk) {
        error = PutError(s);
        return;
      }
    }
    r.W().Simple("OK");
  }

  // ---- namespaces ----

  // Moves the connection into namespace `ns`, holding one of its connections (its quota counts
  // native and RESP connections together); false, changing nothing, at the quota.
  bool EnterNamespace(uint32_t ns) {
    if (ns == ns_) return true;
    if (!host_.take_namespace(ns)) return false;
    LeaveNamespace();
    ns_ = ns;
    return true;
  }
  void LeaveNamespace() {
    if (ns_ != 0) host_.give_namespace(ns_);
    ns_ = 0;
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

  void ClientCmd(Reply r) {
    const std::string sub = Lower(args_[1]);
    auto w = r.W();
    if (sub == "setname" && args_.size() == 3) {
      for (char c : args_[2]) {
        if (c < '!' || c > '~') {
          return Answer(std::move(r), "ERR Client names cannot contain spaces, newlines or special characters.");
        }
      }
      name_ = std::string(args_[2]);
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
      w.Verbatim(fmt::format("id={} name={} db=0 resp={} sparsekv-namespace={}\n", id_, name_, protocol_,
                             ns_ ? host_.options->namespaces[ns_ - 1].name : ""));
    } else {
      return SubcommandError(std::move(r), "client", {{"setname", 3}, {"getname", 2}, {"id", 2}, {"setinfo", 4}, {"info", 2}});
    }
    Answer(std::move(r));
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
          {"proto-max-bulk-len", std::to_string(fe_.limits_.max_bulk_bytes)},
          {"timeout", std::to_string(o.idle_timeout_ms / 1000)},
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
    if (sub == "set" && args_.size() >= 4) {
      return Answer(std::move(r), "ERR CONFIG SET is not supported: sparsekvd is configured by its JSON file and "
                                  "command line");
    }
    return SubcommandError(std::move(r), "config", {{"get", -3}, {"set", -4}, {"resetstat", 2}});
  }

  void CommandCmd(Reply r) {
    auto w = r.W();
    auto info = [&](const CmdSpec& s) {
      // name, arity, flags, first key, last key, step, ACL categories, tips, key specs, subcommands
      const std::string_view n = s.name;
      const bool keyed = n == "get" || n == "set" || n == "strlen" || n == "getrange" || n == "type" ||
                         n == "ttl" || n == "pttl" || n == "mget" || n == "exists" || n == "del" || n == "unlink" ||
                         n == "mset";
      const bool many = n == "mget" || n == "exists" || n == "del" || n == "unlink" || n == "mset";
      w.Array(10);
      w.Bulk(s.name);
      w.Integer(s.arity);
      w.Set(0);
      w.Integer(keyed ? 1 : 0);
      w.Integer(keyed ? (many ? -1 : 1) : 0);
      w.Integer(keyed ? (n == "mset" ? 2 : 1) : 0);
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
        const std::string_view n = s->name;
        const bool conn = n == "ping" || n == "echo" || n == "hello" || n == "auth" || n == "client" ||
                          n == "select" || n == "quit" || n == "reset";
        const bool server = n == "dbsize" || n == "info" || n == "config" || n == "command" || n == "flushdb" ||
                            n == "flushall";
        w.Bulk(s->name);
        w.Map(3);
        w.Bulk("summary");
        w.Bulk(fmt::format("{} as Redis serves it, over sparsekv's tiers", Lower(s->name)));
        w.Bulk("since");
        w.Bulk("1.0.0");
        w.Bulk("group");
        w.Bulk(conn ? "connection" : server ? "server" : n == "scan" || n == "del" || n == "unlink" || n == "exists" ||
                                                                 n == "type" || n == "ttl" || n == "pttl" || n == "keys"
                                                             ? "generic"
                                                             : "string");
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
    if (end_ == begin_ && past(last_active_, o.idle_timeout_ms)) return CloseNow();
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

Result<std::unique_ptr<RespFrontEnd>> RespFrontEnd::Bind(RespHost host, const std::string& tcp_listen,
                                                         const std::string& unix_path) {
  auto impl = std::make_unique<Impl>(std::move(host));
  SPARSEKV_RETURN_IF_ERROR(impl->Bind(tcp_listen, unix_path));
  return std::unique_ptr<RespFrontEnd>(new RespFrontEnd(std::move(impl)));
}

RespFrontEnd::RespFrontEnd(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RespFrontEnd::~RespFrontEnd() = default;

void RespFrontEnd::Start() {
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
  asio::post(*impl_->host_.io, [impl = impl_.get()] {
    boost::system::error_code ignored;
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
