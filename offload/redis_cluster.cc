#include "redis_cluster.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <hiredis/read.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <new>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace sparsekv::offload {
namespace {

using Clock = std::chrono::steady_clock;

// CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, as in the specification.
constexpr std::array<uint16_t, 256> MakeCrc16Table() {
  std::array<uint16_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) crc = static_cast<uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    t[i] = crc;
  }
  return t;
}
constexpr std::array<uint16_t, 256> kCrc16Table = MakeCrc16Table();

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

Result<HostPort> SplitHostPort(std::string_view address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string_view::npos || colon == 0) {
    return Status::InvalidArgument(fmt::format("'{}' is not host:port", address));
  }
  const std::string_view p = address.substr(colon + 1);
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
  if (ec != std::errc() || end != p.data() + p.size() || port == 0 || port > 65535) {
    return Status::InvalidArgument(fmt::format("'{}' is not host:port (port 1-65535)", address));
  }
  return HostPort{std::string(address.substr(0, colon)), static_cast<uint16_t>(port)};
}

int RemainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381": the slot and the address.
bool ParseRedirect(std::string_view err, std::string_view word, uint32_t* slot, std::string* address) {
  if (err.substr(0, word.size()) != word || err.size() <= word.size() + 1) return false;
  std::string_view rest = err.substr(word.size() + 1);
  const size_t space = rest.find(' ');
  if (space == std::string_view::npos) return false;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + space, *slot);
  if (ec != std::errc() || *slot >= kRedisSlots) return false;
  *address = std::string(rest.substr(space + 1));
  if (!address->empty() && address->front() == ':') return false;  // an endpoint we cannot tell
  return true;
}

}  // namespace

uint16_t RedisCrc16(std::string_view bytes) {
  uint16_t crc = 0;
  for (char c : bytes) crc = static_cast<uint16_t>((crc << 8) ^ kCrc16Table[((crc >> 8) ^ static_cast<uint8_t>(c)) & 0xff]);
  return crc;
}

uint16_t RedisKeySlot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return static_cast<uint16_t>(RedisCrc16(key) % kRedisSlots);
}

// ---- replies ----

// What hiredis's reader builds through kReplyFunctions: the redisReply shape, with large
// strings in a RecordBuffer.
struct RedisReply::Node {
  int type = 0;  // REDIS_REPLY_*
  long long integer = 0;
  std::string small;   // strings under kBufferedBytes
  RecordBuffer big;    // strings of kBufferedBytes or more
  size_t len = 0;
  std::vector<Node*> elements;
  ~Node() {
    for (Node* e : elements) delete e;
  }
};

namespace {

constexpr size_t kBufferedBytes = 4096;

// A node of `type`, linked into its parent array (as hiredis's own functions do).
RedisReply::Node* NewNode(const redisReadTask* task, int type) {
  auto* n = new (std::nothrow) RedisReply::Node;
  if (n == nullptr) return nullptr;
  n->type = type;
  if (task->parent != nullptr) {
    auto* parent = static_cast<RedisReply::Node*>(task->parent->obj);
    parent->elements[static_cast<size_t>(task->idx)] = n;
  }
  return n;
}

void* CreateString(const redisReadTask* task, char* str, size_t len) {
  RedisReply::Node* n = NewNode(task, task->type);  // a string, a status or an error
  if (n == nullptr) return nullptr;
  n->len = len;
  if (len >= kBufferedBytes) {
    n->big = RecordBuffer::Allocate(len);
    std::memcpy(n->big.data(), str, len);
  } else {
    n->small.assign(str, len);
  }
  return n;
}

void* CreateArray(const redisReadTask* task, int elements) {
  RedisReply::Node* n = NewNode(task, REDIS_REPLY_ARRAY);
  if (n != nullptr) n->elements.assign(elements > 0 ? static_cast<size_t>(elements) : 0, nullptr);
  return n;
}

void* CreateInteger(const redisReadTask* task, long long value) {
  RedisReply::Node* n = NewNode(task, REDIS_REPLY_INTEGER);
  if (n != nullptr) n->integer = value;
  return n;
}

void* CreateNil(const redisReadTask* task) { return NewNode(task, REDIS_REPLY_NIL); }

// The reader frees a partial reply from its root only.
void FreeNode(void* n) { delete static_cast<RedisReply::Node*>(n); }

redisReplyObjectFunctions kReplyFunctions = {CreateString, CreateArray, CreateInteger, CreateNil, FreeNode};

}  // namespace

RedisReply::RedisReply(Node* n) : node_(n) {}

void RedisReply::Free::operator()(Node* n) const { delete n; }

RedisReply::Type RedisReply::TypeOf(const Node* n) {
  if (n == nullptr) return Type::kNone;
  switch (n->type) {
    case REDIS_REPLY_STRING:
      return Type::kString;
    case REDIS_REPLY_NIL:
      return Type::kNil;
    case REDIS_REPLY_INTEGER:
      return Type::kInteger;
    case REDIS_REPLY_STATUS:
      return Type::kStatus;
    case REDIS_REPLY_ERROR:
      return Type::kError;
    case REDIS_REPLY_ARRAY:
      return Type::kArray;
    default:
      return Type::kNone;
  }
}

std::string_view RedisReply::StrOf(const Node* n) {
  if (n == nullptr) return {};
  if (n->big) return {reinterpret_cast<const char*>(n->big.data()), n->len};
  return n->small;
}

int64_t RedisReply::IntegerOf(const Node* n) { return n ? n->integer : 0; }
size_t RedisReply::SizeOf(const Node* n) { return n ? n->elements.size() : 0; }
const RedisReply::Node* RedisReply::ElementOf(const Node* n, size_t i) {
  return n != nullptr && i < n->elements.size() ? n->elements[i] : nullptr;
}

RedisReply::Type RedisReply::type() const { return TypeOf(node_.get()); }
std::string_view RedisReply::str() const { return StrOf(node_.get()); }
int64_t RedisReply::integer() const { return IntegerOf(node_.get()); }
size_t RedisReply::size() const { return SizeOf(node_.get()); }
const RedisReply::Node* RedisReply::element(size_t i) const { return ElementOf(node_.get(), i); }

RecordBuffer RedisReply::TakeBuffer() {
  if (!node_) return {};
  return std::move(node_->big);
}

// ---- nodes and connections ----

// A socket of our own (written with sendmsg and MSG_NOSIGNAL, values gathered in place) and
// hiredis's protocol reader for what comes back.
struct RedisCluster::Connection {
  int fd = -1;
  redisReader* reader = nullptr;
  ~Connection() {
    if (fd >= 0) close(fd);
    if (reader != nullptr) redisReaderFree(reader);
  }
};

struct RedisCluster::Node {
  std::string address;  // "host:port"
  HostPort hp;
  std::vector<std::unique_ptr<Connection>> idle;
  bool down = false;
  Clock::time_point down_since{};
  Clock::time_point next_probe{};
  uint32_t backoff_ms = 0;
  uint64_t failed_while_down = 0;
};

// A command of a batch on its way: where it goes, and whether ASKING goes first.
struct RedisCluster::Routed {
  size_t command = 0;
  int32_t node = -1;
  bool asking = false;
  uint32_t redirects = 0;
  bool done = false;
};

namespace {

// One node's part of a round: the pipeline written, the replies read.
struct Pipeline {
  size_t node = 0;
  std::unique_ptr<RedisCluster::Connection> conn;
  int fd = -1;  // the socket written to (conn's, when the pipeline owns one)
  std::vector<size_t> routed;       // indices into the round's Routed, in the order sent
  std::vector<int32_t> reply_item;  // per reply expected: its index in `routed`, -1 for ASKING's
  std::string headers;              // RESP framing; the iovecs point into it and at the values
  std::vector<iovec> iov;
  size_t iov_at = 0;                // first iovec not fully written
  size_t replies = 0;               // replies expected in all (ASKING's included)
  size_t got = 0;                   // replies read
  Clock::time_point last_progress{};
  std::vector<uint64_t> request_bytes;  // per routed command: its argument bytes
  uint64_t unanswered_bytes = 0;         // of the commands not answered yet
  bool failed = false;
  bool finished = false;
  Status why;
  bool timed_out = false;
};

void AppendArgHeader(std::string& h, size_t len) { fmt::format_to(std::back_inserter(h), "${}\r\n", len); }

// Lays out the RESP frames of `cmds`: headers first (so that the string no longer moves),
// then the iovecs over them and the arguments' own bytes.
void Frame(Pipeline& p, const std::vector<std::pair<const RedisCommand*, bool>>& cmds) {
  struct Piece {
    size_t header_at, header_len;
    std::string_view arg;
    bool is_arg;  // the header is followed by an argument's bytes and CRLF
  };
  std::vector<Piece> pieces;
  static constexpr std::string_view kCrlf = "\r\n";
  for (const auto& [cmd, asking] : cmds) {
    if (asking) {
      const size_t at = p.headers.size();
      p.headers += "*1\r\n$6\r\nASKING\r\n";
      pieces.push_back({at, p.headers.size() - at, {}, false});
    }
    size_t at = p.headers.size();
    fmt::format_to(std::back_inserter(p.headers), "*{}\r\n", cmd->args.size());
    for (std::string_view a : cmd->args) {
      AppendArgHeader(p.headers, a.size());
      pieces.push_back({at, p.headers.size() - at, a, true});
      at = p.headers.size();
    }
  }
  for (const Piece& piece : pieces) {
    p.iov.push_back({p.headers.data() + piece.header_at, piece.header_len});
    if (piece.is_arg) {
      if (!piece.arg.empty()) p.iov.push_back({const_cast<char*>(piece.arg.data()), piece.arg.size()});
      p.iov.push_back({const_cast<char*>(kCrlf.data()), 2});
    }
  }
}

// Writes what the socket takes; false on an error.
bool WriteSome(Pipeline& p, bool* progressed) {
  while (p.iov_at < p.iov.size()) {
    msghdr msg{};
    msg.msg_iov = p.iov.data() + p.iov_at;
    msg.msg_iovlen = std::min<size_t>(p.iov.size() - p.iov_at, 1024);
    const ssize_t n = sendmsg(p.fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      p.why = Status::Unavailable(fmt::format("write: {}", std::strerror(errno)));
      return false;
    }
    *progressed = true;
    size_t left = static_cast<size_t>(n);
    while (left > 0 && p.iov_at < p.iov.size()) {
      iovec& v = p.iov[p.iov_at];
      if (left >= v.iov_len) {
        left -= v.iov_len;
        ++p.iov_at;
      } else {
        v.iov_base = static_cast<char*>(v.iov_base) + left;
        v.iov_len -= left;
        left = 0;
      }
    }
  }
  return true;
}


// One command on one connection, nothing else in flight on it: its reply, or why none came.
RedisReply RoundTrip(RedisCluster::Connection& c, const RedisCommand& cmd, Clock::time_point deadline) {
  Pipeline p;
  p.fd = c.fd;
  Frame(p, {{&cmd, false}});
  bool progressed = false;
  void* got = nullptr;
  Status why;
  char buf[16384];
  while (got == nullptr) {
    pollfd pf{c.fd, static_cast<short>(POLLIN | (p.iov_at < p.iov.size() ? POLLOUT : 0)), 0};
    const int ready = poll(&pf, 1, RemainingMs(deadline));
    if (ready <= 0) {
      why = Status::Unavailable(ready == 0 ? "timed out" : std::strerror(errno));
      break;
    }
    if (!WriteSome(p, &progressed)) {
      why = p.why;
      break;
    }
    const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      why = Status::Unavailable("connection closed by the node");
      break;
    }
    if (n > 0) redisReaderFeed(c.reader, buf, static_cast<size_t>(n));
    if (redisReaderGetReply(c.reader, &got) != REDIS_OK) {
      why = Status::Unavailable("protocol error");
      break;
    }
  }
  if (got == nullptr) return RedisReply(why);
  return RedisReply(static_cast<RedisReply::Node*>(got));
}
}  // namespace

Result<std::unique_ptr<RedisCluster>> RedisCluster::Open(const RedisClusterOptions& options) {
  if (options.seeds.empty()) return Status::InvalidArgument("redis cluster: no seed node");
  for (const std::string& s : options.seeds) {
    if (Result<HostPort> hp = SplitHostPort(s); !hp.ok()) return hp.status().WithContext("redis cluster seed");
  }
  if (options.timeout_ms == 0) return Status::InvalidArgument("redis cluster: timeout_ms must be at least 1");
  std::unique_ptr<RedisCluster> c(new RedisCluster(options));
  {
    MutexLock l(c->mu_);
    for (const std::string& s : options.seeds) c->NodeIndex(s);
  }
  c->maintainer_ = std::thread([p = c.get()] { p->Maintain(); });
  return c;
}

RedisCluster::RedisCluster(RedisClusterOptions options) : options_(std::move(options)) { slots_.fill(-1); }

RedisCluster::~RedisCluster() {
  {
    MutexLock l(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (maintainer_.joinable()) maintainer_.join();
}

size_t RedisCluster::NodeIndex(const std::string& address) {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i]->address == address) return i;
  }
  auto n = std::make_unique<Node>();
  n->address = address;
  if (Result<HostPort> hp = SplitHostPort(address); hp.ok()) n->hp = *hp;
  nodes_.push_back(std::move(n));
  return nodes_.size() - 1;
}

void RedisCluster::RequestRefresh() {
  {
    MutexLock l(mu_);
    refresh_asked_ = true;
  }
  wake_.notify_all();
}

RedisClusterStats RedisCluster::Stats() const {
  MutexLock l(mu_);
  RedisClusterStats s = stats_;
  std::vector<bool> primary(nodes_.size(), false);
  s.slots_uncovered = 0;
  for (int32_t n : slots_) {
    if (n < 0 || nodes_[static_cast<size_t>(n)]->down) {
      ++s.slots_uncovered;
    } else {
      primary[static_cast<size_t>(n)] = true;
    }
  }
  s.nodes = static_cast<uint64_t>(std::count(primary.begin(), primary.end(), true));
  s.nodes_down = 0;
  for (const auto& n : nodes_) s.nodes_down += n->down;
  return s;
}

bool RedisCluster::WaitCovered(std::chrono::milliseconds within) {
  const auto deadline = Clock::now() + within;
  MutexLock l(mu_);
  auto covered = [&]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
    return std::all_of(slots_.begin(), slots_.end(),
                       [&](int32_t n) { return n >= 0 && !nodes_[static_cast<size_t>(n)]->down; });
  };
  while (!covered()) {
    refresh_asked_ = true;
    wake_.notify_all();
    if (covered_.wait_until(mu_, std::min(deadline, Clock::now() + std::chrono::milliseconds(50))) ==
            std::cv_status::timeout &&
        Clock::now() >= deadline) {
      return covered();
    }
  }
  return true;
}

std::unique_ptr<RedisCluster::Connection> RedisCluster::TakeConnection(size_t node, Clock::time_point deadline,
                                                                       Status* why) {
  HostPort hp;
  {
    MutexLock l(mu_);
    Node& n = *nodes_[node];
    if (!n.idle.empty()) {
      std::unique_ptr<Connection> c = std::move(n.idle.back());
      n.idle.pop_back();
      return c;
    }
    hp = n.hp;
    ++stats_.connections_opened;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  if (const int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    *why = Status::Unavailable(fmt::format("resolving {}: {}", hp.host, gai_strerror(rc)));
    return nullptr;
  }
  auto c = std::make_unique<Connection>();
  c->fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    freeaddrinfo(res);
    *why = Status::Unavailable(fmt::format("socket: {}", std::strerror(errno)));
    return nullptr;
  }
  const int one = 1;
  setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const int rc = connect(c->fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    *why = Status::Unavailable(fmt::format("connect: {}", std::strerror(errno)));
    return nullptr;
  }
  if (rc != 0) {
    pollfd p{c->fd, POLLOUT, 0};
    const int ready = poll(&p, 1, RemainingMs(deadline));
    if (ready == 0) {
      *why = Status::Unavailable("connect: timed out");
      return nullptr;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (ready < 0 || getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      *why = Status::Unavailable(fmt::format("connect: {}", std::strerror(err != 0 ? err : errno)));
      return nullptr;
    }
  }
  c->reader = redisReaderCreateWithFunctions(&kReplyFunctions);
  if (c->reader == nullptr) {
    *why = Status::Unavailable("out of memory for a reply reader");
    return nullptr;
  }
  // Keep up to 8 MiB of read buffer between replies, so that large values do not regrow it.
  c->reader->maxbuf = 8u << 20;
  if (!options_.password.empty()) {
    const RedisReply reply = RoundTrip(*c, RedisCommand{{"AUTH", options_.password}, 1}, deadline);
    if (!reply.ok() || reply.type() == RedisReply::Type::kError) {
      *why = Status::Unavailable(fmt::format("AUTH: {}", reply.ok() ? reply.str() : reply.status().message()));
      return nullptr;
    }
  }
  return c;
}

void RedisCluster::ReturnConnection(size_t node, std::unique_ptr<Connection> c) {
  MutexLock l(mu_);
  Node& n = *nodes_[node];
  if (!n.down && n.idle.size() < options_.max_idle_connections) n.idle.push_back(std::move(c));
}

void RedisCluster::NodeFailed(size_t node, const Status& why, bool timeout) {
  bool incident = false;
  {
    MutexLock l(mu_);
    Node& n = *nodes_[node];
    if (timeout) ++stats_.timeouts;
    n.idle.clear();  // their peer is gone, or in an unknown state
    if (!n.down) {
      n.down = true;
      incident = true;
      n.down_since = Clock::now();
      n.backoff_ms = options_.backoff_min_ms;
      n.next_probe = n.down_since + std::chrono::milliseconds(n.backoff_ms);
      n.failed_while_down = 0;
      ++stats_.incidents;
      refresh_asked_ = true;
    }
  }
  if (incident) {
    spdlog::warn("remote tier: redis node {} failed ({}); its slots miss until it answers again or a replica "
                 "takes over",
                 NodeAddress(node), why.message());
    wake_.notify_all();
  }
}

std::string RedisCluster::NodeAddress(size_t node) const {
  MutexLock l(mu_);
  return nodes_[node]->address;
}

void RedisCluster::NodeReached(size_t node) {
  std::string address;
  uint64_t failed = 0;
  double down_ms = 0;
  {
    MutexLock l(mu_);
    Node& n = *nodes_[node];
    if (!n.down) return;
    n.down = false;
    address = n.address;
    failed = n.failed_while_down;
    down_ms = std::chrono::duration<double, std::milli>(Clock::now() - n.down_since).count();
  }
  covered_.notify_all();
  spdlog::info("remote tier: redis node {} answers again after {:.0f} ms ({} commands missed meanwhile)", address,
               down_ms, failed);
}

void RedisCluster::RunRound(std::span<const RedisCommand> commands, std::vector<Routed>& routed,
                            std::vector<RedisReply>& out) {
  // Group the commands still open by node; those without a usable node fail now.
  std::vector<Pipeline> pipes;
  std::vector<std::vector<std::pair<const RedisCommand*, bool>>> framed;
  {
    std::vector<int32_t> pipe_of;
    MutexLock l(mu_);
    pipe_of.assign(nodes_.size(), -1);
    for (size_t i = 0; i < routed.size(); ++i) {
      Routed& r = routed[i];
      if (r.done) continue;
      if (r.node < 0) {
        r.node = slots_[RedisKeySlot(commands[r.command].args[commands[r.command].key_index])];
      }
      if (r.node < 0 || nodes_[static_cast<size_t>(r.node)]->down) {
        out[r.command] = RedisReply(Status::Unavailable(
            r.node < 0 ? std::string("remote tier: no redis node serves this key's slot")
                       : fmt::format("remote tier: redis node {} is down", nodes_[static_cast<size_t>(r.node)]->address)));
        if (r.node >= 0) {
          ++nodes_[static_cast<size_t>(r.node)]->failed_while_down;
        } else {
          refresh_asked_ = true;  // perhaps the map is only old
        }
        ++stats_.failed_commands;
        r.done = true;
        continue;
      }
      const auto n = static_cast<size_t>(r.node);
      if (pipe_of.size() < nodes_.size()) pipe_of.resize(nodes_.size(), -1);
      if (pipe_of[n] < 0) {
        pipe_of[n] = static_cast<int32_t>(pipes.size());
        pipes.emplace_back();
        pipes.back().node = n;
        framed.emplace_back();
      }
      const auto p = static_cast<size_t>(pipe_of[n]);
      if (r.asking) pipes[p].reply_item.push_back(-1);
      pipes[p].reply_item.push_back(static_cast<int32_t>(pipes[p].routed.size()));
      pipes[p].routed.push_back(i);
      pipes[p].replies = pipes[p].reply_item.size();
      uint64_t bytes = 0;
      for (std::string_view a : commands[r.command].args) bytes += a.size();
      pipes[p].request_bytes.push_back(bytes);
      pipes[p].unanswered_bytes += bytes;
      framed[p].push_back({&commands[r.command], r.asking});
    }
  }
  if (pipes.empty()) return;
  const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
  // A node answers a pipeline after it has run it: it may be silent for the timeout plus 1 ms
  // per 64 KiB of requests it holds unanswered (a busy node storing 48 MiB is not a dead one).
  auto allowed = [&](const Pipeline& pl) {
    return timeout + std::chrono::milliseconds(pl.unanswered_bytes >> 16);
  };
  auto fail = [&](Pipeline& p, Status why, bool timed_out) {
    p.failed = true;
    p.finished = true;
    p.why = std::move(why);
    p.timed_out = timed_out;
  };
  for (size_t p = 0; p < pipes.size(); ++p) {
    Status why;
    pipes[p].conn = TakeConnection(pipes[p].node, Clock::now() + timeout, &why);
    if (!pipes[p].conn) {
      fail(pipes[p], std::move(why), why.message().find("timed out") != std::string::npos);
      continue;
    }
    pipes[p].fd = pipes[p].conn->fd;
    Frame(pipes[p], framed[p]);
    pipes[p].last_progress = Clock::now();
  }
  // Write and read every node's pipeline together until each is answered or fails.
  std::vector<char> buf(64 << 10);
  std::vector<pollfd> fds;
  std::vector<size_t> at;
  for (;;) {
    fds.clear();
    at.clear();
    Clock::time_point next_deadline = Clock::time_point::max();
    const Clock::time_point now = Clock::now();
    for (size_t p = 0; p < pipes.size(); ++p) {
      Pipeline& pl = pipes[p];
      if (pl.finished) continue;
      if (now - pl.last_progress >= allowed(pl)) {
        fail(pl,
             Status::Unavailable(fmt::format("no answer for {} ms",
                                             std::chrono::duration_cast<std::chrono::milliseconds>(allowed(pl)).count())),
             true);
        continue;
      }
      next_deadline = std::min(next_deadline, pl.last_progress + allowed(pl));
      fds.push_back({pl.conn->fd, static_cast<short>(POLLIN | (pl.iov_at < pl.iov.size() ? POLLOUT : 0)), 0});
      at.push_back(p);
    }
    if (fds.empty()) break;
    const int ready = poll(fds.data(), fds.size(), std::max(1, RemainingMs(next_deadline)));
    if (ready < 0 && errno != EINTR) {
      for (size_t p : at) fail(pipes[p], Status::Unavailable(fmt::format("poll: {}", std::strerror(errno))), false);
      break;
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      Pipeline& pl = pipes[at[k]];
      bool progressed = false;
      if ((fds[k].revents & POLLOUT) && !WriteSome(pl, &progressed)) {
        fail(pl, pl.why, false);
        continue;
      }
      if (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) {
        bool closed = false;
        for (int reads = 0; reads < 64; ++reads) {
          const ssize_t n = recv(pl.conn->fd, buf.data(), buf.size(), 0);
          if (n > 0) {
            progressed = true;
            if (redisReaderFeed(pl.conn->reader, buf.data(), static_cast<size_t>(n)) != REDIS_OK) {
              closed = true;
              break;
            }
            if (static_cast<size_t>(n) < buf.size()) break;
            continue;
          }
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (n < 0 && errno == EINTR) continue;
          closed = true;
          break;
        }
        // Every complete reply, in the order sent.
        for (;;) {
          void* got = nullptr;
          if (redisReaderGetReply(pl.conn->reader, &got) != REDIS_OK) {
            closed = true;
            break;
          }
          if (got == nullptr) break;
          RedisReply reply(static_cast<RedisReply::Node*>(got));
          if (pl.got >= pl.replies) {  // more replies than commands: the stream is not ours
            closed = true;
            break;
          }
          const int32_t item = pl.reply_item[pl.got++];
          if (item < 0) continue;  // ASKING's +OK
          pl.unanswered_bytes -= pl.request_bytes[static_cast<size_t>(item)];
          Routed& r = routed[pl.routed[static_cast<size_t>(item)]];
          if (reply.type() == RedisReply::Type::kError) {
            uint32_t slot = 0;
            std::string address;
            const std::string_view e = reply.str();
            const bool moved = ParseRedirect(e, "MOVED", &slot, &address);
            const bool ask = !moved && ParseRedirect(e, "ASK", &slot, &address);
            if ((moved || ask) && r.redirects < options_.max_redirects) {
              MutexLock l(mu_);
              const auto target = static_cast<int32_t>(NodeIndex(address));
              if (moved) {
                slots_[slot] = target;
                refresh_asked_ = true;
              }
              ++stats_.redirects;
              r.node = target;
              r.asking = ask;
              ++r.redirects;
              continue;  // sent again next round
            }
            if (e.substr(0, 8) == "TRYAGAIN" || e.substr(0, 11) == "CLUSTERDOWN" || moved || ask) {
              out[r.command] = RedisReply(Status::Unavailable(fmt::format("remote tier: {}", e)));
              r.done = true;
              continue;
            }
          }
          out[r.command] = std::move(reply);
          r.done = true;
        }
        if (closed) {
          fail(pl, Status::Unavailable("connection closed by the node"), false);
          continue;
        }
      }
      if (progressed) pl.last_progress = Clock::now();
      if (pl.got == pl.replies && pl.iov_at == pl.iov.size()) pl.finished = true;
    }
  }
  for (Pipeline& pl : pipes) {
    if (pl.failed) {
      uint64_t lost = 0;
      for (size_t j : pl.routed) {
        Routed& r = routed[j];
        if (r.done) continue;
        out[r.command] = RedisReply(pl.why.WithContext("remote tier: redis node"));
        r.done = true;
        ++lost;
      }
      NodeFailed(pl.node, pl.why, pl.timed_out);
      MutexLock l(mu_);
      stats_.failed_commands += lost;
      nodes_[pl.node]->failed_while_down += lost;
    } else if (pl.conn) {
      ReturnConnection(pl.node, std::move(pl.conn));
    }
  }
}

std::vector<RedisReply> RedisCluster::Execute(std::span<const RedisCommand> commands) {
  std::vector<RedisReply> out(commands.size());
  std::vector<Routed> routed(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) routed[i].command = i;
  for (uint32_t round = 0; round <= options_.max_redirects + 1; ++round) {
    RunRound(commands, routed, out);
    if (std::all_of(routed.begin(), routed.end(), [](const Routed& r) { return r.done; })) break;
  }
  for (const Routed& r : routed) {
    if (!r.done) out[r.command] = RedisReply(Status::Unavailable("remote tier: too many redirects"));
  }
  bool refresh = false;
  {
    MutexLock l(mu_);
    refresh = refresh_asked_;
  }
  if (refresh) wake_.notify_all();
  return out;
}

// Reads CLUSTER SLOTS from the first node that answers (nodes that are up first): each entry
// is [start, end, [host, port, id, ...], replicas...]; the primary serves the range.
bool RedisCluster::RefreshSlots() {
  std::vector<size_t> order;
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (!nodes_[i]->down) order.push_back(i);
    }
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i]->down) order.push_back(i);
    }
  }
  for (size_t node : order) {
    Status why;
    std::unique_ptr<Connection> c = TakeConnection(node, Clock::now() + std::chrono::milliseconds(options_.timeout_ms), &why);
    if (!c) continue;
    const RedisReply reply =
        RoundTrip(*c, RedisCommand{{"CLUSTER", "SLOTS"}, 0},
                  Clock::now() + std::chrono::milliseconds(std::max<uint32_t>(options_.timeout_ms, 200)));
    if (reply.type() != RedisReply::Type::kArray) continue;
    std::array<int32_t, kRedisSlots> map;
    map.fill(-1);
    MutexLock l(mu_);
    using R = RedisReply;
    for (size_t e = 0; e < reply.size(); ++e) {
      const R::Node* entry = reply.element(e);
      const R::Node* node_r = R::ElementOf(entry, 2);
      if (R::TypeOf(entry) != R::Type::kArray || R::SizeOf(entry) < 3 ||
          R::TypeOf(R::ElementOf(entry, 0)) != R::Type::kInteger ||
          R::TypeOf(R::ElementOf(entry, 1)) != R::Type::kInteger || R::TypeOf(node_r) != R::Type::kArray ||
          R::SizeOf(node_r) < 2 || R::TypeOf(R::ElementOf(node_r, 0)) != R::Type::kString ||
          R::TypeOf(R::ElementOf(node_r, 1)) != R::Type::kInteger) {
        continue;
      }
      std::string host(R::StrOf(R::ElementOf(node_r, 0)));
      if (host.empty() || host == "?") host = nodes_[node]->hp.host;  // "the node you asked"
      const auto target =
          static_cast<int32_t>(NodeIndex(fmt::format("{}:{}", host, R::IntegerOf(R::ElementOf(node_r, 1)))));
      const int64_t lo = std::max<int64_t>(0, R::IntegerOf(R::ElementOf(entry, 0)));
      const int64_t hi = std::min<int64_t>(kRedisSlots - 1, R::IntegerOf(R::ElementOf(entry, 1)));
      for (int64_t slot = lo; slot <= hi; ++slot) map[static_cast<size_t>(slot)] = target;
    }
    slots_ = map;
    ++stats_.refreshes;
    return true;
  }
  return false;
}

// The background thread: slot map refreshes (asked for, and periodic while a node is down) and
// probes of down nodes with backoff.
void RedisCluster::Maintain() {
  auto last_refresh = Clock::time_point{};
  bool unreachable = false;
  for (;;) {
    std::vector<size_t> probe;
    bool refresh = false;
    {
      MutexLock l(mu_);
      if (stop_) return;
      const Clock::time_point now = Clock::now();
      // The map is read again periodically only while a node it names is down or a slot has no
      // node (a dead node whose slots went to its replica is probed, with backoff, but costs no
      // refreshes).
      std::vector<bool> serving(nodes_.size(), false);
      bool any_down = false;  // or a slot without a node: the map is read again periodically
      for (int32_t n : slots_) {
        if (n >= 0) {
          serving[static_cast<size_t>(n)] = true;
        } else {
          any_down = true;
        }
      }
      Clock::time_point wake = now + std::chrono::seconds(1);
      for (size_t i = 0; i < nodes_.size(); ++i) {
        Node& n = *nodes_[i];
        if (!n.down) continue;
        any_down = any_down || serving[i];
        if (n.next_probe <= now) {
          probe.push_back(i);
        } else {
          wake = std::min(wake, n.next_probe);
        }
      }
      const auto interval = std::chrono::milliseconds(options_.refresh_interval_ms);
      const bool periodic = any_down && now - last_refresh >= interval;
      // Refreshes asked for are at least 20 ms apart, so that a storm of MOVED replies reads
      // the map once.
      constexpr auto kMinGap = std::chrono::milliseconds(20);
      refresh = (refresh_asked_ || periodic) && now - last_refresh >= kMinGap;
      if (refresh) refresh_asked_ = false;
      if (refresh_asked_) wake = std::min(wake, last_refresh + kMinGap);
      if (any_down) wake = std::min(wake, last_refresh + interval);
      if (!refresh && probe.empty()) {
        wake_.wait_until(mu_, std::max(wake, now + std::chrono::milliseconds(1)));
        continue;
      }
    }
    for (size_t i : probe) {
      Status why;
      std::unique_ptr<Connection> c =
          TakeConnection(i, Clock::now() + std::chrono::milliseconds(options_.timeout_ms), &why);
      bool ok = false;
      if (c) {
        const RedisReply reply =
            RoundTrip(*c, RedisCommand{{"PING"}, 0}, Clock::now() + std::chrono::milliseconds(options_.timeout_ms));
        // LOADING (a restarted node reading its data) is not an answer yet.
        ok = reply.ok() && reply.type() == RedisReply::Type::kStatus;
        if (ok) {
          NodeReached(i);
          ReturnConnection(i, std::move(c));
          RequestRefresh();
        }
      }
      if (!ok) {
        MutexLock l(mu_);
        Node& n = *nodes_[i];
        n.backoff_ms = std::min(options_.backoff_max_ms, std::max(options_.backoff_min_ms, n.backoff_ms * 2));
        n.next_probe = Clock::now() + std::chrono::milliseconds(n.backoff_ms);
      }
    }
    if (refresh) {
      const bool read = RefreshSlots();
      last_refresh = Clock::now();
      if (read) covered_.notify_all();
      // No node answering CLUSTER SLOTS at all is an incident of its own (logged once): every
      // key misses until one does.
      if (!read && !unreachable) {
        unreachable = true;
        spdlog::warn("remote tier: no node of the redis cluster answers ({}); every key misses until one does",
                     fmt::join(options_.seeds, ", "));
      } else if (read && unreachable) {
        unreachable = false;
        spdlog::info("remote tier: the redis cluster answers again");
      }
    }
  }
}

}  // namespace sparsekv::offload
