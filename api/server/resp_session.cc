// The RESP front end and a connection's handling (resp_connection.h says what lives where).
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
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "server/resp_connection.h"

namespace sparsekv::server {

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

// ---- the connection (parsing, buffers, limits, replies, deadlines) ----

void RespConnection::Start() {
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

void RespConnection::Refuse() {
  asio::post(strand_, [self = shared_from_this()] {
    Reply r(2);
    r.W().Error("ERR max number of clients reached");  // (once per connection: no spare)
    self->closing_ = true;
    self->Queue(std::move(r));
    self->DoWrite();
  });
}

void RespConnection::BeginDrain() {
  asio::post(strand_, [self = shared_from_this()] {
    self->closing_ = true;
    boost::system::error_code ec;
    self->socket_.shutdown(GenericSocket::shutdown_receive, ec);
    self->MaybeClose();
  });
}

void RespConnection::MaybeRead() {
  if (reading_ || closing_ || busy_ || closed_ || eof_ || parked_) return;
  if (out_bytes_ >= host_.options->max_inflight_bytes) return;  // DoWrite's completion reads again
  if (room_ && room_->got < room_->bytes) return ReadRoom();
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

void RespConnection::Park() {
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

void RespConnection::Resume() {
  if (!parked_) return;
  parked_ = false;
  account_->parked.store(false, std::memory_order_release);
  // The wait was the daemon's (its budget), not the client's: the request's clock stood still.
  if (request_started_ != Clock::time_point{}) request_started_ += Clock::now() - parked_at_;
  if (!busy_) Process();  // serves what is buffered, then reads
}

void RespConnection::Process() {
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
    if (room_) {
      if (room_->got < room_->bytes || end_ - begin_ < 2) {
        need_ = 2;
        if (eof_) {  // cut off by the peer's close: dropped, its room given back
          room_.reset();
          closing_ = true;
        }
        break;
      }
      FinishRoom();
      continue;
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
      if (eof_) {
        closing_ = true;  // a request cut off by the peer's close is dropped
      } else if (StartRoom(in)) {
        need_ = 0;
      }
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
    // CLIENT REPLY SKIP applies to the request after it (served on its own, not in a batch).
    skip_this_ = std::exchange(skip_next_, false);
    if (ns_ != 0 && inline_.empty() && !skip_this_ && !reply_off_ && ServeBatch()) continue;
    Serve();
  }
  DoWrite();
  MaybeRead();
}

void RespConnection::Done() {
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

bool RespConnection::ServeBatch() {
  static constexpr size_t kMaxBatch = 64;
  // A MONITOR sees every request on its own (Serve feeds it).
  if (fe_.monitors_n_.load(std::memory_order_relaxed) > 0) return false;
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

void RespConnection::Count(Cmd cmd, size_t n) {
  fe_.calls_[cmd].fetch_add(n, std::memory_order_relaxed);
  fe_.commands_total_.fetch_add(n, std::memory_order_relaxed);
}

void RespConnection::FreeBuffer() {
  std::free(buf_);
  buf_ = nullptr;
  cap_ = begin_ = end_ = 0;
  cap_shared_.store(0, std::memory_order_relaxed);
  GiveBudget(std::exchange(buf_charged_, 0));
}

void RespConnection::Serve() {
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
  if (fe_.monitors_n_.load(std::memory_order_relaxed) > 0 && cmd != kAuth && cmd != kHello && cmd != kConfig &&
      cmd != kMonitor) {
    fe_.FeedMonitors(*this);
  }
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
    case kFunction:
      return FunctionCmd(std::move(r));
    case kMonitor:
      if (!monitor_) {
        monitor_ = true;
        fe_.AddMonitor(shared_from_this());
      }
      w.Simple("OK");
      return Answer(std::move(r));
    case kTime: {
      // TIME: Unix seconds and microseconds, as two bulk strings.
      const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
      w.Array(2);
      w.Bulk(std::to_string(us / 1000000));
      w.Bulk(std::to_string(us % 1000000));
      return Answer(std::move(r));
    }
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

void RespConnection::Answer(Reply r, std::string_view error) {
  if (!error.empty()) {
    r.W().Error(error);
    fe_.errors_[cmd_].fetch_add(1, std::memory_order_relaxed);
  }
  const bool close = r.close_after;
  // CLIENT REPLY OFF, or SKIP for this one request: served, not answered.
  if (!reply_off_ && !skip_this_) Queue(std::move(r));
  Done();
  if (close) closing_ = true;
}

void RespConnection::OnWorker(Reply r) {
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

void RespConnection::RunOnWorker(Reply& r, std::string& error) {
  auto w = r.W();
  switch (cmd_) {
    case kGet:
    case kMget:
      return GetOnWorker(r);
    case kInfo:
      w.Verbatim(InfoText());
      return;
    case kSet:
      if (args_.size() == 3) return PlainSetOnWorker(r, error);
      break;
    default:
      break;
  }
  resp::Command c{cmd_, ns_, std::span<const std::string_view>(args_), w, error, fe_.keyspace_,
                  fe_.max_bulk_.load(std::memory_order_relaxed)};
  if (ServeStringCommand(c) || ServeGenericCommand(c)) return;
  error = "ERR internal: no worker handler";
}

void RespConnection::PlainSetOnWorker(Reply& r, std::string& error) {
  const wire::WireHash h = resp::KeyHash(args_[1]);
  std::lock_guard<std::mutex> stripe(fe_.Stripe(h));
  if (args_[1].data() != key_copy_.data()) key_copy_.assign(args_[1]);
  std::vector<std::byte> scratch;
  // On a worker the buffer is as it was parsed: the header may go in place, as on the network
  // thread (no copy of the value before the store's own).
  const wire::PutItem item{h, Record(key_copy_, args_[2], inline_.empty(), scratch)};
  host_.metrics->BytesIn(item.bundle.size());
  const auto st = host_.store->Put(ns_, std::span<const wire::PutItem>(&item, 1));
  if (st[0].code != StatusCode::kOk) {
    error = PutError(st[0]);
    return;
  }
  fe_.keyspace_.NoteDeadline(ns_, key_copy_, 0);  // a plain SET drops any deadline
  r.W().Simple("OK");
}

void RespConnection::Get(Reply r, bool multi) {
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

void RespConnection::GetOnWorker(Reply& r) {
  host_.store->Get(ns_, hashes_,
                   [&](size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
                     AppendValue(r, batch_keys_[i], st, bytes, keep);
                   });
}

void RespConnection::AppendValue(Reply& r, std::string_view key, const Status& st, std::span<const std::byte> bytes,
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

std::span<const std::byte> RespConnection::Record(std::string_view key, std::string_view value, bool in_place,
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

void RespConnection::Set(Reply r) {
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

void RespConnection::StorePut(Reply r, std::span<const wire::PutItem> items, bool per_item) {
  uint64_t bytes = 0;
  for (const auto& it : items) bytes += it.bundle.size();
  StoreWith(std::move(r), items.size(), per_item, bytes, [&](DaemonStore::PutDone done) {
    return host_.store->TryPutWithoutBlocking(ns_, items, std::move(done));
  });
}

void RespConnection::StoreWith(Reply r, size_t count, bool per_item, uint64_t bytes,
                               const std::function<bool(DaemonStore::PutDone)>& start) {
  put_per_item_ = per_item;
  struct Wait {
    std::vector<wire::ItemStatus> result;
    std::atomic<bool> claimed{false};
  };
  auto wait = std::make_shared<Wait>();
  host_.metrics->BytesIn(bytes);
  auto self = shared_from_this();
  host_.begin_async();
  const bool taken = start([wait, self](std::vector<wire::ItemStatus> st) {
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
    std::vector<wire::ItemStatus> busy(count, {StatusCode::kUnavailable, "the store cannot take a batch now"});
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

bool RespConnection::StartRoom(std::string_view in) {
  if (ns_ == 0 || fe_.monitors_n_.load(std::memory_order_relaxed) > 0) return false;
  // `*3\r\n$3\r\nSET\r\n`, the key's bulk string, then `$<len>\r\n` of the value.
  static constexpr std::string_view kHead = "*3\r\n$3\r\n";
  size_t pos = kHead.size() + 5;
  if (in.size() < pos || in.substr(0, kHead.size()) != kHead || in.substr(kHead.size() + 3, 2) != "\r\n") return false;
  for (size_t i = 0; i < 3; ++i) {
    if (std::tolower(static_cast<unsigned char>(in[kHead.size() + i])) != "set"[i]) return false;
  }
  auto bulk_length = [&](uint64_t& len) {
    if (pos >= in.size() || in[pos] != '$') return false;
    const size_t eol = in.find("\r\n", pos);
    if (eol == std::string_view::npos || eol - pos > 21) return false;
    const auto [end, ec] = std::from_chars(in.data() + pos + 1, in.data() + eol, len);
    if (ec != std::errc() || end != in.data() + eol) return false;
    pos = eol + 2;
    return true;
  };
  uint64_t key_bytes = 0, bytes = 0;
  if (!bulk_length(key_bytes) || key_bytes > resp::kMaxKeyBytes || in.size() < pos + key_bytes + 2) return false;
  const std::string_view key = in.substr(pos, key_bytes);
  if (in.substr(pos + key_bytes, 2) != "\r\n") return false;
  pos += key_bytes + 2;
  const uint64_t in_place = host_.options->put_in_place_bytes;
  if (!bulk_length(bytes) || in_place == 0 || bytes < in_place || bytes > fe_.limits().max_bulk_bytes) return false;
  const uint64_t buffered = in.size() - pos;
  if (buffered >= bytes) return false;  // the value is all here (its CRLF is not): the parser's to judge
  // Anything the store would refuse, or cannot take from this thread, goes the usual way and is
  // answered as it would be.
  const uint64_t header = resp::HeaderBytes(key);
  if (header + bytes > host_.store->MaxValueBytes() || !host_.store->PutsWithoutBlocking()) return false;
  const DaemonStore::Arena arena = host_.store->SharedArena();
  if (arena.base == nullptr || !host_.pins_below_cap(bytes)) return false;
  auto reserved = host_.store->ReservePut(ns_, resp::KeyHash(key), header + bytes, /*shared=*/false);
  if (!reserved.ok()) return false;
  const uint64_t at = (*reserved)->value_offset();
  if ((*reserved)->value_bytes() != header + bytes || at > arena.bytes || arena.bytes - at < header + bytes) {
    return false;  // (not this store's arena: the reservation is given back)
  }
  auto room = std::make_unique<Room>();
  room->pins = host_.charge_pins(bytes);
  room->reservation = std::move(*reserved);
  // The daemon's own memory, mapped read-only by shared-memory clients unless write leases are
  // on; nothing of it is published until the commit has checked the header and hashed it.
  std::byte* record = const_cast<std::byte*>(arena.base) + at;
  if (header > 0) resp::WriteHeader(key, bytes, record);
  room->value = record + header;
  room->bytes = bytes;
  room->record = header + bytes;
  room->key.assign(key);
  std::memcpy(room->value, in.data() + pos, buffered);
  room->got = buffered;
  room_ = std::move(room);
  host_.metrics->PutInPlace();
  begin_ = end_ = 0;  // all of it was the request's, and is in the room now
  return true;
}

void RespConnection::ReadRoom() {
  Room& room = *room_;
  const auto n = static_cast<size_t>(std::min<uint64_t>(room.bytes - room.got, 4u << 20));
  reading_ = true;
  // Read straight into the record. The room outlives the read: it goes only in this handler, or
  // with the connection (whose handlers hold it), never while the kernel may still write it.
  socket_.async_read_some(
      asio::buffer(room.value + room.got, n),
      asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec, size_t k) {
        self->reading_ = false;
        self->room_->got += k;
        if (ec == asio::error::operation_aborted && self->shrinking_ && !self->closed_) {
          self->shrinking_ = false;
          return self->MaybeRead();
        }
        if (ec) {
          // The value never came whole: the room goes back unpublished, and the request with it.
          self->room_.reset();
          self->eof_ = true;
          self->closing_ = true;
          self->Process();
          return self->MaybeClose();
        }
        self->shrinking_ = false;
        self->last_active_ = Clock::now();
        if (self->room_->got == self->room_->bytes) return self->Process();
        self->MaybeRead();
      }));
}

void RespConnection::FinishRoom() {
  if (buf_[begin_] != '\r' || buf_[begin_ + 1] != '\n') {
    // As the parser answers a bulk string not followed by CRLF.
    room_.reset();
    fe_.protocol_errors_.fetch_add(1, std::memory_order_relaxed);
    host_.metrics->BadFrame();
    Reply r(protocol_, TakeSpare());
    r.W().Error("ERR Protocol error: expected CRLF after a bulk string");
    closing_ = true;
    Queue(std::move(r));
    return;
  }
  std::shared_ptr<Room> room(std::move(room_));
  request_begin_ = begin_;
  consumed_ = 2;
  // Served as Serve serves a SET.
  skip_this_ = std::exchange(skip_next_, false);
  cmd_ = kSet;
  last_cmd_at_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  last_cmd_.store(kSet, std::memory_order_relaxed);
  Count(kSet, 1);
  if (fe_.monitors_n_.load(std::memory_order_relaxed) > 0) {
    args_.assign({"SET", room->key, {reinterpret_cast<const char*>(room->value), room->bytes}});
    fe_.FeedMonitors(*this);
    args_.clear();  // (views into the room, which the store owns once committed)
  }
  Reply r(protocol_, TakeSpare());
  const wire::WireHash h = resp::KeyHash(room->key);
  std::unique_lock<std::mutex> stripe(fe_.Stripe(h), std::try_to_lock);
  if (stripe.owns_lock()) {
    StoreWith(std::move(r), 1, /*per_item=*/false, room->record, [&](DaemonStore::PutDone done) {
      host_.store->CommitWritten(ns_, std::move(room->reservation), std::move(done));
      return true;
    });
    return;
  }
  // Another thread holds the key's stripe (a read-modify-write of the key): committed on a worker,
  // once it is free.
  busy_ = true;
  auto reply = std::make_shared<Reply>(std::move(r));
  host_.submit(id_, [self = shared_from_this(), reply, room, h] {
    std::vector<wire::ItemStatus> st;
    {
      std::lock_guard<std::mutex> l(self->fe_.Stripe(h));
      auto answered = std::make_shared<std::promise<std::vector<wire::ItemStatus>>>();
      auto got = answered->get_future();
      self->host_.store->CommitWritten(self->ns_, std::move(room->reservation),
                                       [answered](std::vector<wire::ItemStatus> s) { answered->set_value(std::move(s)); });
      st = got.get();
    }
    self->host_.metrics->BytesIn(room->record);
    asio::post(self->strand_, [self, reply, st = std::move(st)] {
      self->busy_ = false;
      self->put_per_item_ = false;
      self->FinishPut(std::move(*reply), st);
      self->Process();
    });
  });
}

void RespConnection::FinishPut(Reply r, const std::vector<wire::ItemStatus>& st) {
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

std::string RespConnection::PutError(const wire::ItemStatus& s) {
  if (s.code == StatusCode::kInvalidArgument) {
    return fmt::format("ERR value too large for sparsekvd's tiers ({}); nothing was stored", s.message);
  }
  if (s.code == StatusCode::kResourceExhausted) return fmt::format("OOM {}", s.message);
  return fmt::format("ERR storing the value failed: {}", s.message);
}

std::string RespConnection::TooLarge(std::string_view key, std::string_view value) const {
  const uint64_t record = resp::HeaderBytes(key) + value.size();
  const uint64_t max = host_.store->MaxValueBytes();
  if (record <= max) return {};
  return fmt::format("ERR value too large: {} bytes with its key, sparsekvd's tiers take at most {}; nothing was "
                     "stored",
                     record, max);
}

void RespConnection::Mset(Reply r) {
  for (size_t i = 1; i + 1 < args_.size(); i += 2) {
    if (std::string e = TooLarge(args_[i], args_[i + 1]); !e.empty()) return Answer(std::move(r), e);
  }
  OnWorker(std::move(r));
}

bool RespConnection::EnterNamespace(uint32_t ns) {
  if (ns == ns_) return true;
  if (!host_.take_namespace(ns)) return false;
  LeaveNamespace();
  ns_ = ns;
  shared_ns_.store(ns, std::memory_order_relaxed);
  return true;
}

void RespConnection::LeaveNamespace() {
  if (ns_ != 0) host_.give_namespace(ns_);
  ns_ = 0;
  shared_ns_.store(0, std::memory_order_relaxed);
}

std::string RespConnection::QuotaError(uint32_t ns) const {
  const NamespaceConfig& nc = host_.options->namespaces[ns - 1];
  return fmt::format("ERR max number of clients reached for namespace '{}' ({})", nc.name, nc.max_connections);
}

void RespConnection::Kill() {
  asio::post(strand_, [self = shared_from_this()] { self->CloseNow(); });
}

void RespConnection::Queue(Reply r) {
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

std::string RespConnection::TakeSpare() {
  if (spare_.empty()) return {};
  std::string s = std::move(spare_.back());
  spare_.pop_back();
  s.clear();
  return s;
}

void RespConnection::KeepSpare(std::string&& s) {
  if (s.capacity() >= 4096 && s.capacity() <= kSpareBytes && spare_.size() < kSpares) spare_.push_back(std::move(s));
}

void RespConnection::TakeBudget(uint64_t n) {
  if (n == 0) return;
  account_->held.fetch_add(n, std::memory_order_relaxed);
  host_.budget->Take(n);
}

void RespConnection::GiveBudget(uint64_t n) {
  if (n == 0) return;
  account_->held.fetch_sub(n, std::memory_order_relaxed);
  host_.budget->Give(n);
}

void RespConnection::DoWrite() {
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

void RespConnection::ArmTick() {
  tick_.expires_after(fe_.tick_);
  tick_.async_wait(asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
    if (ec || self->closed_) return;
    self->OnTick();
    if (!self->closed_) self->ArmTick();
  }));
}

void RespConnection::OnTick() {
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
  if (!parked_ && (end_ > begin_ || room_) && past(request_started_, o.frame_timeout_ms)) {
    // A request that does not finish arriving (slowloris) holds its buffer: closed. Time parked
    // on the daemon's budget does not count (Resume moves the start by it).
    fe_.timeouts_.fetch_add(1, std::memory_order_relaxed);
    host_.metrics->FrameTimedOut();
    return CloseNow();
  }
  const uint32_t idle = fe_.idle_timeout_ms_.load(std::memory_order_relaxed);  // 0: none (CONFIG SET timeout 0)
  if (end_ == begin_ && !room_ && idle != 0 && past(last_active_, idle)) return CloseNow();
  if (end_ == begin_ && !room_ && cap_ > kSmall && reading_ && !shrinking_ && past(last_active_, 2 * fe_.tick_.count())) {
    shrinking_ = true;
    boost::system::error_code ec;
    socket_.cancel(ec);
  }
  if (parked_) Resume();
}

void RespConnection::MaybeClose() {
  if (closed_ || !closing_ || busy_ || writing_ || !out_.empty()) return;  // DoWrite finishes, then closes
  CloseNow();
}

std::string RespConnection::MonitorLine() const {
  // Redis's replicationFeedMonitors: "+<s>.<us> [0 <addr>] "word" ...", each word as sdscatrepr
  // quotes it.
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  std::string out = fmt::format("+{}.{:06d} [0 {}{}]", us / 1000000, us % 1000000, is_unix_ ? "unix:" : "",
                                is_unix_ ? laddr_.substr(0, laddr_.size() - 2) : addr_);
  for (std::string_view a : args_) {
    out += " \"";
    for (char ch : a) {
      const auto u = static_cast<unsigned char>(ch);
      switch (ch) {
        case '\\': out += "\\\\"; break;
        case '"': out += "\\\""; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\a': out += "\\a"; break;
        case '\b': out += "\\b"; break;
        default:
          if (std::isprint(u)) {
            out += ch;
          } else {
            out += fmt::format("\\x{:02x}", u);
          }
      }
    }
    out += '"';
  }
  out += "\r\n";
  return out;
}

void RespConnection::Feed(std::string line) {
  asio::post(strand_, [self = shared_from_this(), line = std::move(line)]() mutable {
    // A monitor that does not read its lines loses them past its share of replies in flight
    // (as Redis's client-output-buffer-limit would close it).
    if (self->closed_ || self->out_bytes_ >= self->host_.options->max_inflight_bytes) return;
    Reply r(2);
    r.Text() = std::move(line);
    self->Queue(std::move(r));
    self->DoWrite();
  });
}

void RespConnection::CloseNow() {
  if (closed_) return;
  closed_ = true;
  if (monitor_) fe_.RemoveMonitor(this);
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

void RespFrontEnd::Impl::AddMonitor(std::shared_ptr<RespConnection> c) {
  std::lock_guard<std::mutex> l(monitors_mu_);
  monitors_.push_back(std::move(c));
  monitors_n_.store(static_cast<int>(monitors_.size()), std::memory_order_relaxed);
}

void RespFrontEnd::Impl::RemoveMonitor(RespConnection* c) {
  std::lock_guard<std::mutex> l(monitors_mu_);
  std::erase_if(monitors_, [c](const std::shared_ptr<RespConnection>& m) { return m.get() == c; });
  monitors_n_.store(static_cast<int>(monitors_.size()), std::memory_order_relaxed);
}

void RespFrontEnd::Impl::FeedMonitors(const RespConnection& from) {
  std::vector<std::shared_ptr<RespConnection>> to;
  {
    std::lock_guard<std::mutex> l(monitors_mu_);
    for (const auto& m : monitors_) {
      if (m->shared_ns() == from.shared_ns()) to.push_back(m);
    }
  }
  if (to.empty()) return;
  const std::string line = from.MonitorLine();
  for (auto& m : to) m->Feed(line);
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
