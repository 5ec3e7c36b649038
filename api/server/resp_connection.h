// The RESP front end's connection (internal to api/server): RespFrontEnd::Impl, which accepts and
// keeps the connections and runs active expiry, and RespConnection, one client's connection.
//
// What lives where:
//   resp_session.cc         the front end, and a connection's handling: reading and parsing,
//                           buffers and the daemon's budget, serving requests in order (the
//                           pipelined GET and SET runs, GET and plain SET from host memory on the
//                           network thread), replies and writing, deadlines and closing
//   resp_server_family.cc   the commands on the connection and the server: HELLO, AUTH, CLIENT,
//                           CONFIG, COMMAND, INFO
//   resp_string_family.cc,  the commands on keys and values, on a worker thread
//   resp_generic_family.cc  (resp_commands.h), over resp_keyspace.h
//
// Thread safety: a connection's members are used on its strand, but for what CLIENT LIST reads
// from other connections' threads (info_mu_ and the atomics named shared_*).
#pragma once

#include <utility>  // (before Boost.Asio, which needs std::exchange)
#include <boost/asio.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "server/resp_commands.h"
#include "server/resp_keys.h"
#include "server/resp_keyspace.h"
#include "server/resp_protocol.h"
#include "server/resp_session.h"

namespace sparsekv::server {

// The commands' table and helpers are used unqualified in the front end's files (the only ones
// that include this header).
using namespace resp;  // NOLINT(google-build-using-namespace)

namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
using Clock = std::chrono::steady_clock;

// A socket's address as Redis's CLIENT LIST shows it: "ip:port", "[ipv6]:port", or for a Unix
// socket its path and ":0" (`is_unix` set then).
std::string AddressOf(int fd, bool peer, bool& is_unix);

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

class RespConnection;

class RespFrontEnd::Impl {
 public:
  explicit Impl(RespHost host)
      : host_(std::move(host)), keyspace_(host_.store, host_.metrics), expiry_timer_(*host_.io) {
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
  // MONITOR: connections that see every request of their namespace as it is served.
  void AddMonitor(std::shared_ptr<RespConnection> c);
  void RemoveMonitor(RespConnection* c);
  void FeedMonitors(const RespConnection& from);

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
  std::mutex monitors_mu_;
  std::vector<std::shared_ptr<RespConnection>> monitors_;  // guarded by monitors_mu_
  std::atomic<int> monitors_n_{0};

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

  void Start();

  // Refused at the connection limit: Redis's words, then close.
  void Refuse();

  void BeginDrain();

  bool counted_ = false;  // holds a connection slot (RespFrontEnd::Impl::mu_)
  uint32_t shared_ns() const { return shared_ns_.load(std::memory_order_relaxed); }
  // MONITOR: the line showing the request being served (on this connection's thread), and a
  // line handed to this monitoring connection (from any thread).
  std::string MonitorLine() const;
  void Feed(std::string line);

 private:
  static constexpr size_t kSmall = 16u << 10;
  static constexpr size_t kReadChunk = 256u << 10;
  static constexpr size_t kCopyBelow = 16u << 10;  // values smaller are copied into the reply
  static constexpr int kRequestsPerTurn = 64;

  // ---- reading and parsing ----

  void MaybeRead();

  // Stops reading until the budget has room. Unlike a native connection, which the server wakes
  // when bytes come back, a parked RESP connection looks again every kParkedRetry (and at its
  // tick): cheap for the few that park, and soon enough that a held-back large SET follows the
  // one finishing before it within milliseconds, not a tick later.
  static constexpr std::chrono::milliseconds kParkedRetry{5};
  void Park();

  void Resume();

  // Serves the buffered requests, in order, until one has to wait (a worker, a tier) or the
  // buffer holds no whole request.
  void Process();

  // The request just served is done: its bytes are released.
  void Done();

  // ---- pipelined GETs and SETs, served together ----

  // Serves the request just parsed together with the plain GETs (or plain SETs) pipelined right
  // behind it, in one store call: what a client with a pipeline (redis-benchmark -P, redis-py's
  // pipeline, LMCache's batched puts) sends. False, having done nothing, when there is no such
  // run or the store cannot serve it at once; the request is then served on its own.
  bool ServeBatch();

  void Count(Cmd cmd, size_t n);

  void FreeBuffer();

  // ---- serving one request ----

  void Serve();

  // Answers the request at once (with `error` as an error reply when given).
  void Answer(Reply r, std::string_view error = {});

  // Hands the request to a worker; the connection reads and serves nothing else meanwhile (the
  // request's arguments stay in the receive buffer, untouched, until it is answered).
  void OnWorker(Reply r);

  // Runs on a worker thread: a store call that may block on tier I/O.
  void RunOnWorker(Reply& r, std::string& error);
  // SET key value on a worker (a store that cannot take it at once): stored from the receive
  // buffer, its header written in place, as on the network thread.
  void PlainSetOnWorker(Reply& r, std::string& error);

  std::string InfoText();

  // ---- GET and MGET ----

  void Get(Reply r, bool multi);

  // GET, MGET, or a run of pipelined GETs (ServeBatch): hashes_ and batch_keys_ name them.
  void GetOnWorker(Reply& r);

  // A GET's answer for `key`: its value, or nil (absent, another key's record, damaged).
  void AppendValue(Reply& r, std::string_view key, const Status& st, std::span<const std::byte> bytes,
                   const DaemonStore::Keep& keep);

  // ---- SET and MSET ----

  // The bytes stored for `key` = `value`: its header, then the value. When the value lies in
  // the receive buffer with room before it that the request no longer needs (SET: the command
  // name and key before it), the header is written there and the record stored from the buffer
  // as it is; otherwise it is assembled in `scratch`.
  std::span<const std::byte> Record(std::string_view key, std::string_view value, bool in_place,
                                    std::vector<std::byte>& scratch);

  // A plain SET is stored from this thread when the store takes it at once; SET with options
  // (and the rest) goes to a worker (resp_string_family.cc).
  void Set(Reply r);

  // Stores `items` from the network thread; answers OK (or `count` replies for MSET) once the
  // store has, at once when it answers on this thread.
  void StorePut(Reply r, std::span<const wire::PutItem> items, bool per_item);

  void FinishPut(Reply r, const std::vector<wire::ItemStatus>& st);

  // ---- a large SET received straight into host memory ----

  // A plain `SET key value` whose value is at least put_in_place_bytes (ServerOptions; 0: never):
  // once its `$<len>` line has come, room for its record is reserved in the store's host memory
  // (DaemonStore::ReservePut), the record's header written there, and the value's bytes are
  // read from the socket into it, not
  // into the receive buffer: one copy (the kernel's) instead of two. The record is hashed and
  // published at its commit, ordered as of then (DaemonStore::CommitWritten). The room counts
  // against the budget of lent host pages (the server's pin_cap_) while it fills; the request's
  // deadline runs as for any request, and a connection that closes or times out mid-value gives
  // the room back unpublished.
  struct Room {
    std::unique_ptr<DaemonStore::PutReservation> reservation;
    DaemonStore::Keep pins;
    std::byte* value = nullptr;  // where the value's bytes go
    uint64_t bytes = 0, got = 0;
    uint64_t record = 0;  // header and value
    std::string key;
  };
  // Starts a room for the partial request `in` (the buffer from begin_) when it is such a SET;
  // its buffered value bytes are moved into the room and the buffer emptied. False: nothing done.
  bool StartRoom(std::string_view in);
  void ReadRoom();
  // The value is in: with the CRLF after it (buffered), the SET is committed and answered.
  void FinishRoom();
  // Stores through `start` (which hands the store its answer callback, false when the store did
  // not take the request); as StorePut.
  void StoreWith(Reply r, size_t count, bool per_item, uint64_t bytes,
                 const std::function<bool(DaemonStore::PutDone)>& start);

  static std::string PutError(const wire::ItemStatus& s);

  // An error when `key` = `value` is larger than the store can take: refused before anything
  // stored changes (a PUT the tiers refuse would still drop the key's older version).
  std::string TooLarge(std::string_view key, std::string_view value) const;

  void Mset(Reply r);

  // ---- namespaces ----

  // Moves the connection into namespace `ns`, holding one of its connections (its quota counts
  // native and RESP connections together); false, changing nothing, at the quota.
  bool EnterNamespace(uint32_t ns);
  void LeaveNamespace();
  std::string QuotaError(uint32_t ns) const;

  // ---- connection-level commands ----

  void Hello(Reply r);

  void Auth(Reply r);

  // Redis's answer to a known subcommand with the wrong number of arguments, or to an unknown one.
  void SubcommandError(Reply r, std::string_view cmd, const std::vector<std::pair<const char*, int>>& subs);

  // CLIENT SETNAME, GETNAME, ID, SETINFO, INFO, LIST, KILL. LIST and KILL see only the caller's
  // namespace's connections: no client learns of, or closes, another namespace's.
  void ClientCmd(Reply r);

  // Redis's client types: every RESP connection here is "normal".
  static bool KnownClientType(std::string_view t, bool& normal);

  void ClientList(Reply r);

  // CLIENT KILL addr:port, or CLIENT KILL [ID id] [TYPE type] [ADDR a] [LADDR a] [USER u]
  // [SKIPME yes|no] (USER: a namespace's name).
  void ClientKill(Reply r);

  // The connection as CLIENT LIST shows it, in Redis 7.0's fields (networking.c,
  // catClientInfoString); `user` is its namespace. Read from other connections' threads: only
  // what is constant or shared (info_mu_, atomics).
  std::string InfoLine(bool caller, std::string_view current) const;

  // CLIENT KILL from another connection: closed on its own thread.
  void Kill();

  void SetName(std::string name);

  void Config(Reply r);

  // CONFIG SET name value [name value ...], all or nothing, as Redis 7.0 (config.c). What can
  // change while sparsekvd runs: timeout (the RESP idle timeout, 0: none) and proto-max-bulk-len
  // (at most what the tiers take). save and appendonly take only what sparsekvd does (no RDB, no
  // AOF: its tiers persist); the other parameters CONFIG GET shows are set in its configuration
  // file and refused by name.
  void ConfigSet(Reply r);

  void CommandCmd(Reply r);

  // FUNCTION FLUSH [ASYNC|SYNC], FUNCTION LIST: sparsekvd has no functions (no scripting), so
  // there is never one to flush or list (Redis's test suite flushes them before every file).
  void FunctionCmd(Reply r);

  // ---- writing ----

  void Queue(Reply r);

  // Reply buffers written out are kept (up to kSpares, each at most kSpareBytes) and built in
  // again, cleared: a reply of 64 KiB of values then costs no allocation and no page faults.
  static constexpr size_t kSpares = 4;
  static constexpr size_t kSpareBytes = 1u << 20;
  std::string TakeSpare();
  void KeepSpare(std::string&& s);

  // The connection's share of the daemon-wide budget, taken and given back here (not by
  // objects that could outlive the server's budget): everything is given back at close.
  void TakeBudget(uint64_t n);
  void GiveBudget(uint64_t n);

  void DoWrite();

  // ---- deadlines and closing ----

  void ArmTick();

  void OnTick();

  void MaybeClose();

  void CloseNow();

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
  std::unique_ptr<Room> room_;
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
  // CLIENT REPLY: every reply dropped (OFF), or the next request's (SKIP), and this request's.
  bool reply_off_ = false, skip_next_ = false, skip_this_ = false;
  bool monitor_ = false;  // MONITOR: registered with the front end
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

}  // namespace sparsekv::server
