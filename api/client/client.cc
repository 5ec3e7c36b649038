#include "sparsekv/client.h"

#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "protocol/wire.h"

namespace sparsekv {
namespace {

namespace w = wire;

struct Frame {
  w::FrameHeader header;
  std::vector<std::byte> payload;
};

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

Result<int> ConnectTo(const std::string& address, bool* is_unix) {
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
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      Status st = Errno(fmt::format("connecting to unix:{}", path));
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
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::freeaddrinfo(res);
      return fd;
    }
    last = Errno(fmt::format("connecting to {}", address));
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return last;
}

Status FromItem(const w::ItemStatus& s) {
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

  void Close() {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (staging_) ::munmap(staging_, staging_bytes_);
    staging_ = nullptr;
  }

  Status Open(const ClientOptions& o) {
    timeout_ = o.timeout;
    SPARSEKV_ASSIGN_OR_RETURN(fd_, ConnectTo(o.address, &is_unix_));
    w::HelloRequest hello;
    hello.namespace_name = o.namespace_name;
    hello.token = o.token;
    hello.client_name = o.client_name;
    hello.want_shared_memory = is_unix_ && o.shared_memory;
    const auto frame = w::EncodeFrame(w::Opcode::kHello, 0, 0, w::Encode(hello));
    SPARSEKV_RETURN_IF_ERROR(WriteAll(fd_, frame.data(), frame.size()));
    // The reply's first bytes may carry the arena and staging fds (SCM_RIGHTS).
    std::array<std::byte, w::kHeaderBytes> hb;
    int staging_fd = -1;
    size_t got = 0;
    {
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      iovec iov{hb.data(), hb.size()};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ssize_t k;
      do {
        k = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      } while (k < 0 && errno == EINTR);
      if (k <= 0) return k == 0 ? Status::Unavailable("sparsekvd closed the connection during HELLO") : Errno("HELLO");
      got = static_cast<size_t>(k);
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          std::vector<int> got_fds(n);
          std::memcpy(got_fds.data(), CMSG_DATA(c), n * sizeof(int));
          for (size_t i = 0; i < n; ++i) {
            if (i == 0 && staging_fd < 0) {
              staging_fd = got_fds[i];
            } else {
              ::close(got_fds[i]);  // more than the protocol passes: not ours to keep
            }
          }
        }
      }
    }
    SPARSEKV_RETURN_IF_ERROR(ReadAll(fd_, hb.data() + got, hb.size() - got));
    auto reply = ReadFrameAfterHeader(hb);
    if (!reply.ok()) return reply.status();
    if (reply->header.opcode == w::Opcode::kError) {
      if (staging_fd >= 0) ::close(staging_fd);
      return ErrorStatus(reply->payload);
    }
    auto hello_reply = w::DecodeHelloReply(reply->payload);
    if (!hello_reply.ok()) {
      if (staging_fd >= 0) ::close(staging_fd);
      return hello_reply.status();
    }
    hello_ = *hello_reply;
    if (staging_fd >= 0) SPARSEKV_RETURN_IF_ERROR(MapStaging(staging_fd, hello_.shm_staging_bytes));
    reader_ = std::thread([this] { ReaderLoop(); });
    return Status::OK();
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

  void ReaderLoop() {
    Status why;
    for (;;) {
      std::array<std::byte, w::kHeaderBytes> hb;
      why = ReadAll(fd_, hb.data(), hb.size());
      if (!why.ok()) break;
      auto f = ReadFrameAfterHeader(hb);
      if (!f.ok()) {
        why = f.status().WithContext("bad frame from sparsekvd");
        break;
      }
      if (f->header.opcode == w::Opcode::kEvent) {
        DeliverEvents(f->payload);
        continue;
      }
      std::promise<Result<Frame>> p;
      {
        std::lock_guard<std::mutex> l(mu_);
        auto it = pending_.find(f->header.request_id);
        if (it == pending_.end()) continue;  // a reply nobody waits for (fire-and-forget)
        p = std::move(it->second);
        pending_.erase(it);
      }
      if (f->header.opcode == w::Opcode::kError) {
        p.set_value(ErrorStatus(f->payload));
      } else {
        p.set_value(std::move(f).value());
      }
    }
    std::map<uint64_t, std::promise<Result<Frame>>> orphans;
    {
      std::lock_guard<std::mutex> l(mu_);
      broken_ = why.ok() ? Status::Unavailable("connection closed") : why;
      orphans.swap(pending_);
    }
    for (auto& [id, p] : orphans) p.set_value(broken_);
  }

  void DeliverEvents(std::span<const std::byte> payload) {
    auto batch = w::DecodeEventBatch(payload);
    EventCallback cb;
    {
      std::lock_guard<std::mutex> l(mu_);
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

  std::future<Result<Frame>> Send(w::Opcode op, std::span<const std::byte> payload) {
    std::promise<Result<Frame>> p;
    auto fut = p.get_future();
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!broken_.ok()) {
        p.set_value(broken_);
        return fut;
      }
      pending_.emplace(id, std::move(p));
    }
    const auto frame = w::EncodeFrame(op, 0, id, payload);
    Status st;
    {
      std::lock_guard<std::mutex> l(write_mu_);
      st = WriteAll(fd_, frame.data(), frame.size());
    }
    if (!st.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      auto it = pending_.find(id);
      if (it != pending_.end()) {
        it->second.set_value(st);
        pending_.erase(it);
      }
    }
    return fut;
  }

  Result<Frame> Wait(std::future<Result<Frame>> fut) {
    if (fut.wait_for(timeout_) != std::future_status::ready) {
      return Status::Unavailable(fmt::format("no reply from sparsekvd within {} ms", timeout_.count()));
    }
    return fut.get();
  }

  Result<Frame> Call(w::Opcode op, std::span<const std::byte> payload) { return Wait(Send(op, payload)); }

  static Result<LookupResult> ParseLookup(Result<Frame> f) {
    if (!f.ok()) return f.status();
    SPARSEKV_ASSIGN_OR_RETURN(w::LookupReply r, w::DecodeLookupReply(f->payload));
    LookupResult out;
    out.prefix_blocks = r.prefix_blocks;
    for (uint8_t t : r.tiers) out.tiers.push_back(static_cast<BlockTier>(std::min<uint8_t>(t, 3)));
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

  static Result<std::vector<GetResult>> ParseGet(Result<Frame> f, size_t expected) {
    if (!f.ok()) return f.status();
    SPARSEKV_ASSIGN_OR_RETURN(w::GetReply r, w::DecodeGetReply(f->payload, w::kMaxPayloadBytes));
    if (r.items.size() != expected) {
      return Status::Internal(fmt::format("sparsekvd answered {} items for {}", r.items.size(), expected));
    }
    std::vector<GetResult> out(r.items.size());
    for (size_t i = 0; i < r.items.size(); ++i) {
      out[i].status = FromItem(r.items[i].status);
      out[i].bytes.assign(r.items[i].bundle.begin(), r.items[i].bundle.end());
    }
    return out;
  }

  Result<std::vector<Status>> PutShared(std::span<const BundleRef> bundles) {
    std::vector<Status> out;
    out.reserve(bundles.size());
    std::lock_guard<std::mutex> l(staging_mu_);
    size_t i = 0;
    while (i < bundles.size()) {
      w::ShmPutRequest req;
      size_t off = 0;
      const size_t first = i;
      while (i < bundles.size() && off + bundles[i].bytes.size() <= staging_bytes_ / 2 &&
             req.slots.size() < w::kMaxBatchItems) {
        std::memcpy(staging_ + off, bundles[i].bytes.data(), bundles[i].bytes.size());
        req.slots.push_back({bundles[i].hash, off, static_cast<uint32_t>(bundles[i].bytes.size())});
        off += (bundles[i].bytes.size() + 63) & ~size_t{63};
        ++i;
      }
      if (i == first) {  // larger than the staging area: the socket carries it
        SPARSEKV_ASSIGN_OR_RETURN(auto one, PutSocket(bundles.subspan(i, 1)));
        out.push_back(one[0]);
        ++i;
        continue;
      }
      SPARSEKV_ASSIGN_OR_RETURN(auto part, ParseStatusList(Call(w::Opcode::kShmPut, w::Encode(req)), req.slots.size()));
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }

  Result<std::vector<Status>> PutSocket(std::span<const BundleRef> bundles) {
    w::PutRequest req;
    for (const BundleRef& b : bundles) req.items.push_back({b.hash, b.bytes});
    return ParseStatusList(Call(w::Opcode::kPut, w::Encode(req)), bundles.size());
  }

  Result<std::vector<GetResult>> GetShared(std::span<const WireBlockHash> hashes) {
    std::vector<GetResult> out(hashes.size());
    std::vector<WireBlockHash> too_big;
    std::vector<size_t> too_big_index;
    {
      // The daemon writes into the GET half; nothing else may ask for it until we copied out.
      std::lock_guard<std::mutex> l(staging_mu_);
      w::HashList req{{hashes.begin(), hashes.end()}};
      auto f = Call(w::Opcode::kShmGet, w::Encode(req));
      if (!f.ok()) return f.status();
      SPARSEKV_ASSIGN_OR_RETURN(w::ShmGetReply r, w::DecodeShmGetReply(f->payload));
      if (r.status.size() != hashes.size()) return Status::Internal("SHM_GET answered the wrong number of items");
      size_t slot = 0;
      const uint64_t half = staging_bytes_ / 2;
      for (size_t i = 0; i < hashes.size(); ++i) {
        if (r.status[i].code == StatusCode::kResourceExhausted) {  // larger than the GET area
          too_big.push_back(hashes[i]);
          too_big_index.push_back(i);
          continue;
        }
        out[i].status = FromItem(r.status[i]);
        if (!out[i].status.ok()) continue;
        const w::ShmSlot& s = r.slots[slot++];
        if (s.offset < half || s.offset > staging_bytes_ || s.bytes > staging_bytes_ - s.offset) {
          out[i].status = Status::Internal("SHM_GET named bytes outside the GET area");
          continue;
        }
        out[i].bytes.assign(staging_ + s.offset, staging_ + s.offset + s.bytes);
      }
    }
    if (!too_big.empty()) {
      w::HashList req{std::move(too_big)};
      SPARSEKV_ASSIGN_OR_RETURN(auto rest, ParseGet(Call(w::Opcode::kGet, w::Encode(req)), too_big_index.size()));
      for (size_t k = 0; k < rest.size(); ++k) out[too_big_index[k]] = std::move(rest[k]);
    }
    return out;
  }

  bool shared() const { return staging_ != nullptr; }

  int fd_ = -1;
  bool is_unix_ = false;
  std::chrono::milliseconds timeout_{30000};
  w::HelloReply hello_;
  std::byte* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::mutex staging_mu_;  // one shared-memory PUT or GET at a time owns the staging area
  std::mutex write_mu_;    // one frame at a time on the socket
  std::mutex mu_;
  std::map<uint64_t, std::promise<Result<Frame>>> pending_;
  Status broken_;
  EventCallback on_event_;
  std::atomic<uint64_t> next_id_{1};
  std::thread reader_;
};

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  SPARSEKV_RETURN_IF_ERROR(impl->Open(options));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<LookupResult> Client::Lookup(std::span<const WireBlockHash> hashes) {
  w::HashList req{{hashes.begin(), hashes.end()}};
  return Impl::ParseLookup(impl_->Call(w::Opcode::kLookup, w::Encode(req)));
}

Result<std::vector<Status>> Client::Put(std::span<const BundleRef> bundles) {
  return impl_->shared() ? impl_->PutShared(bundles) : impl_->PutSocket(bundles);
}

Result<std::vector<GetResult>> Client::Get(std::span<const WireBlockHash> hashes) {
  if (impl_->shared()) return impl_->GetShared(hashes);
  w::HashList req{{hashes.begin(), hashes.end()}};
  return Impl::ParseGet(impl_->Call(w::Opcode::kGet, w::Encode(req)), hashes.size());
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

Result<std::string> Client::Stats() {
  auto f = impl_->Call(w::Opcode::kStats, {});
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
    std::lock_guard<std::mutex> l(impl_->mu_);
    impl_->on_event_ = std::move(callback);
  }
  auto f = impl_->Call(w::Opcode::kSubscribe, {});
  return f.ok() ? Status::OK() : f.status();
}

std::future<Result<LookupResult>> Client::LookupAsync(std::vector<WireBlockHash> hashes) {
  auto fut = impl_->Send(w::Opcode::kLookup, w::Encode(w::HashList{std::move(hashes)}));
  return std::async(std::launch::deferred, [f = std::move(fut)]() mutable { return Impl::ParseLookup(f.get()); });
}

std::future<Result<std::vector<Status>>> Client::PutAsync(std::vector<BundleRef> bundles) {
  w::PutRequest req;
  for (const BundleRef& b : bundles) req.items.push_back({b.hash, b.bytes});
  auto fut = impl_->Send(w::Opcode::kPut, w::Encode(req));
  const size_t n = bundles.size();
  return std::async(std::launch::deferred,
                    [f = std::move(fut), n]() mutable { return Impl::ParseStatusList(f.get(), n); });
}

std::future<Result<std::vector<GetResult>>> Client::GetAsync(std::vector<WireBlockHash> hashes) {
  const size_t n = hashes.size();
  auto fut = impl_->Send(w::Opcode::kGet, w::Encode(w::HashList{std::move(hashes)}));
  return std::async(std::launch::deferred, [f = std::move(fut), n]() mutable { return Impl::ParseGet(f.get(), n); });
}

bool Client::shared_memory() const { return impl_->shared(); }
uint64_t Client::session_id() const { return impl_->hello_.session_id; }
uint32_t Client::block_tokens() const { return impl_->hello_.block_tokens; }
uint32_t Client::max_payload_bytes() const { return impl_->hello_.max_payload_bytes; }

}  // namespace sparsekv
