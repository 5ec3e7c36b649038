// The native protocol's connections (api/PROTOCOL.md): reading and checking frames, the
// shared-memory staging areas and lent arena, serving each request from the store, writing
// replies; and the server's admission, limits, parking and draining of them.
#include "server/server_impl.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

#include "allocator/xxhash_dispatch.h"

namespace sparsekv::server {
namespace {

// A connection's receive buffer: kSmall bytes in place, or a mapping grown to hold a whole PUT
// (Session::StartDirect), so that one receive brings a PUT and the next request's header.
// Bytes in it are [from, to); Grow and Shrink move them to the front. Not thread-safe: the
// connection's strand uses it, and never while a read into it is under way.
class ReadBuffer {
 public:
  static constexpr size_t kSmall = 16u << 10;
  // `grown_total` counts the bytes of every grown buffer (a /metrics gauge).
  explicit ReadBuffer(std::atomic<uint64_t>* grown_total) : grown_total_(grown_total) {}
  ReadBuffer(const ReadBuffer&) = delete;
  ReadBuffer& operator=(const ReadBuffer&) = delete;
  ~ReadBuffer() { Unmap(); }

  std::byte* data() { return big_ != nullptr ? big_ : small_.data(); }
  size_t capacity() const { return big_ != nullptr ? cap_ : kSmall; }
  bool grown() const { return big_ != nullptr; }

  // Room for `need` bytes from the front, the bytes held moved there. False (nothing changed)
  // when no memory can be mapped.
  bool Grow(size_t need, size_t& from, size_t& to) {
    const size_t held = to - from;
    if (need > capacity()) {
      const size_t cap = (need + 4095) & ~size_t{4095};
      void* m = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) return false;
      std::memcpy(m, data() + from, held);
      Unmap();
      big_ = static_cast<std::byte*>(m);
      cap_ = cap;
      grown_total_->fetch_add(cap, std::memory_order_relaxed);
    } else {
      std::memmove(data(), data() + from, held);
    }
    from = 0;
    to = held;
    return true;
  }

  // Back to kSmall bytes in place, when what it holds fits them.
  void Shrink(size_t& from, size_t& to) {
    const size_t held = to - from;
    if (big_ == nullptr || held > kSmall) return;
    std::memcpy(small_.data(), big_ + from, held);
    Unmap();
    from = 0;
    to = held;
  }

 private:
  void Unmap() {
    if (big_ != nullptr) {
      ::munmap(big_, cap_);
      grown_total_->fetch_sub(cap_, std::memory_order_relaxed);
    }
    big_ = nullptr;
    cap_ = 0;
  }

  std::atomic<uint64_t>* grown_total_;
  std::array<std::byte, kSmall> small_{};
  std::byte* big_ = nullptr;
  size_t cap_ = 0;
};

// A request payload, filled as its bytes arrive. Small ones live on the heap; larger ones in an
// anonymous mapping reserved at the size the header announces but committed page by page as
// bytes are written into it, so a header that claims 64 MiB and sends 4 KiB costs the daemon
// 4 KiB of memory, not 64 MiB. (The bytes are charged to the budget as they are read, see
// Session::StepPayload.) Move-only.
class Payload {
 public:
  static constexpr size_t kMapAbove = 256u << 10;
  Payload() = default;
  Payload(Payload&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        mapped_(o.mapped_),
        advised_(o.advised_),
        charge_(std::move(o.charge_)) {}
  Payload& operator=(Payload&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      mapped_ = o.mapped_;
      advised_ = o.advised_;
      charge_ = std::move(o.charge_);
    }
    return *this;
  }
  Payload(const Payload&) = delete;
  Payload& operator=(const Payload&) = delete;
  ~Payload() { Reset(); }

  // Room for `n` bytes, uncommitted; false when not even address space is left.
  bool Reserve(size_t n, Charge charge) {
    Reset();
    advised_ = false;
    charge_ = std::move(charge);
    if (n == 0) return true;
    if (n > kMapAbove) {
      void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) return false;
      data_ = static_cast<std::byte*>(m);
      mapped_ = true;
    } else {
      data_ = static_cast<std::byte*>(std::malloc(n));
      if (data_ == nullptr) return false;
      mapped_ = false;
    }
    size_ = n;
    return true;
  }
  void Reset() {
    if (data_ != nullptr) {
      if (mapped_) {
        ::munmap(data_, size_);
      } else {
        std::free(data_);
      }
    }
    data_ = nullptr;
    size_ = 0;
    charge_.Release();
  }
  std::byte* data() { return data_; }
  size_t size() const { return size_; }
  std::span<const std::byte> span() const { return {data_, size_}; }
  Charge& charge() { return charge_; }

  // Once `arrived` bytes have come (at least 2 MiB: the peer is sending, not just claiming),
  // asks for transparent huge pages past them: one fault per 2 MiB instead of per 4 KiB, which
  // on a VM is the difference between ~0.3 and several GB/s. Memory then runs ahead of the
  // bytes by at most one huge page.
  void AdviseHugePages(size_t arrived) {
    static constexpr size_t kHuge = 2u << 20;
    if (!mapped_ || advised_ || arrived < kHuge) return;
    advised_ = true;
    const auto base = reinterpret_cast<uintptr_t>(data_);
    const uintptr_t from = (base + arrived + kHuge - 1) & ~uintptr_t{kHuge - 1};
    if (from < base + size_) ::madvise(reinterpret_cast<void*>(from), base + size_ - from, MADV_HUGEPAGE);
  }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  bool advised_ = false;
  Charge charge_;
};

// A frame to send. Its bytes are `own`, except that a GET reply's bundle bytes are sent
// straight from the store's memory (`pieces` with `ext` set), held by `keep` until written.
struct OutFrame {
  OutFrame() = default;
  OutFrame(std::vector<std::byte> bytes) : own(std::move(bytes)), size(own.size()) {  // NOLINT: implicit
    pieces.push_back({0, own.size(), {}});
  }
  struct Piece {
    size_t off = 0, len = 0;          // own[off, off + len) when ext is empty
    std::span<const std::byte> ext;   // else these bytes
  };
  std::vector<std::byte> own;
  std::vector<Piece> pieces;
  std::vector<DaemonStore::Keep> keep;
  // A SHM_GET reply built on a worker: what it lent in place, for the session to hold until the
  // client's next SHM_GET (the strand takes them over before the frame is queued).
  std::vector<DaemonStore::Keep> lent;
  uint64_t lent_bytes = 0;
  uint64_t size = 0;
  // The ext pieces are host-tier pages, counted by the pin budget: not charged again.
  bool ext_pinned = false;
  Charge charge;  // this frame's bytes in the buffer budget, while it is queued
  // A GET reply's items whose bytes go out unchecked: (item, hash, keep). Their verdicts, the
  // last piece, are filled by `finish` once the rest of the frame is in the kernel.
  struct Recheck {
    size_t item;
    wire::WireHash hash;
    DaemonStore::Keep keep;
  };
  std::vector<Recheck> recheck;
  size_t verdict_off = 0;
  std::function<void(OutFrame&)> finish;  // runs once, just before the frame is first written

  // Ends the current run of own bytes as a piece.
  void CloseOwn(size_t& from) {
    if (own.size() > from) pieces.push_back({from, own.size() - from, {}});
    from = own.size();
  }
  std::span<const std::byte> Bytes(const Piece& p) const {
    return p.ext.empty() ? std::span<const std::byte>(own.data() + p.off, p.len) : p.ext;
  }
  // Fills in the header reserved at the front of `own`. No payload checksum: the bundle bytes
  // were checked against their record's checksum as the store read them, and a second pass
  // over them here and another in the client would cost more than the rest of a GET
  // (api/PROTOCOL.md).
  void Finish(wire::Opcode op, uint16_t flags, uint64_t request_id) {
    size = 0;
    for (const Piece& p : pieces) size += Bytes(p).size();
    wire::FrameHeader h;
    h.opcode = op;
    h.flags = flags;
    h.request_id = request_id;
    h.payload_bytes = static_cast<uint32_t>(size - wire::kHeaderBytes);
    const auto header = wire::EncodeHeader(h);
    std::memcpy(own.data(), header.data(), wire::kHeaderBytes);
  }
};

// A handler's answer: a payload to be framed, or a gathered frame to finish (GET replies).
// A reply of one item status (HINT_DROP, LOG_APPEND, LOG_SUSPENDED, LOG_FINISH).
std::vector<std::byte> OneStatus(const Status& st) {
  wire::StatusListReply r;
  r.items.resize(1);
  if (!st.ok()) r.items[0] = {st.code(), std::string(st.message())};
  return wire::Encode(r);
}

struct Reply {
  Reply(std::vector<std::byte> payload) : data(std::move(payload)) {}  // NOLINT: implicit
  Reply(OutFrame f) : gathered(std::move(f)), is_gathered(true) {}    // NOLINT: implicit
  std::vector<std::byte> data;
  OutFrame gathered;
  bool is_gathered = false;
  std::vector<DaemonStore::Keep> lent;  // see OutFrame::lent
  uint64_t lent_bytes = 0;

  OutFrame ToFrame(wire::Opcode op, uint64_t request_id) && {
    OutFrame f;
    if (is_gathered) {
      gathered.Finish(op, wire::kFlagResponse, request_id);
      f = std::move(gathered);
    } else {
      f = OutFrame(wire::EncodeFrame(op, wire::kFlagResponse, request_id, data));
    }
    f.lent = std::move(lent);
    f.lent_bytes = lent_bytes;
    return f;
  }
};

std::vector<std::byte> ErrorFrame(uint64_t request_id, const Status& st) {
  return wire::EncodeFrame(wire::Opcode::kError, wire::kFlagResponse, request_id,
                           wire::Encode(wire::ErrorReply{st.code(), std::string(st.message())}));
}

}  // namespace

class Session : public std::enable_shared_from_this<Session> {
 public:
  // Where a connection stands in the server's counts (guarded by Server::Impl::mu_).
  enum class Counted { kHandshake, kAuthenticated, kNone };

  Session(Server::Impl& srv, GenericSocket socket, bool is_unix, uint64_t id)
      : srv_(srv),
        socket_(std::move(socket)),
        strand_(asio::make_strand(srv.io_)),
        tick_(srv.io_),
        linger_(srv.io_),
        is_unix_(is_unix),
        id_(id),
        created_(Clock::now()) {}

  ~Session() {
    // Again here: a HINT a worker was still handling when the session closed lands before the
    // last reference goes.
    if (authed_) srv_.store_->EndSession(id_);
    if (staging_) {
      ::munmap(staging_, staging_bytes_);
      srv_.staging_total_.fetch_sub(staging_bytes_, std::memory_order_relaxed);
    }
    if (staging_fd_ >= 0) ::close(staging_fd_);
  }

  void Start() {
    std::weak_ptr<Session> weak = shared_from_this();
    account_->wake = [weak] {
      if (auto self = weak.lock()) asio::post(self->strand_, [self] { self->Unpark(); });
    };
    asio::post(strand_, [self = shared_from_this()] {
      self->last_active_ = Clock::now();
      self->ArmTick();
      self->ReadHeader();
    });
  }

  // Refuses the connection with an ERROR frame (over the hard limit on sockets).
  void Refuse(const Status& st) {
    asio::post(strand_, [self = shared_from_this(), st] {
      self->closing_ = true;
      self->QueueWrite(ErrorFrame(0, st));
    });
  }

  // Closes the connection with an ERROR frame (id 0) that says why: replaced at a connection
  // limit, a deadline missed. Whatever the connection was reading is dropped.
  void CloseWithError(const Status& st) {
    asio::post(strand_, [self = shared_from_this(), st] { self->CloseNow(st); });
  }

  void BeginDrain() {
    asio::post(strand_, [self = shared_from_this()] {
      self->closing_ = true;
      boost::system::error_code ec;
      self->socket_.shutdown(GenericSocket::shutdown_receive, ec);
      self->MaybeClose();
    });
  }

  // Looks again whether the budget has room for a parked connection (from any thread).
  void ResumeFromPark() {
    asio::post(strand_, [self = shared_from_this()] { self->Unpark(); });
  }

  // Read by the server under its mu_ (see Server::Impl::LongestIdle).
  Counted counted_ = Counted::kHandshake;
  uint32_t counted_ns_ = 0;
  const Clock::time_point& created() const { return created_; }
  // Since when the connection has had nothing in flight (steady-clock ticks), 0 while busy.
  int64_t idle_since() const { return idle_since_.load(std::memory_order_relaxed); }
  // Whether it has sent a request since its HELLO.
  bool called() const { return called_.load(std::memory_order_relaxed); }

 private:
  enum class Resume { kNone, kHeader, kPayload };  // where a parked connection goes on

  static constexpr size_t kReadChunk = 256u << 10;     // the most one read takes
  static constexpr uint64_t kPutHereBytes = 1u << 20;  // as a GET's slice on a worker
  // A PUT over the socket is stored from the network thread up to this size (DirectPut): its
  // value is then copied once, out of the receive buffer the connection keeps, where a worker
  // would take it from a payload allocated (and faulted in) for the frame. Measured with
  // `sparsekv bench daemon --batch` on a 2-vCPU EPYC VM, 1 MiB x 16 over TCP: 0.24-0.36x the
  // socket pair through a worker, 0.85-1.01x here.
  static constexpr uint64_t kDirectPutBytes = 8u << 20;

  // Reads and handles frames. Requests are read through a buffer, so that one receive
  // usually brings a whole small request (often several); a payload's bytes past what is
  // buffered are read straight into it (StepPayload).
  void ReadHeader() {
    // A connection that pipelines many requests hands the network thread over after a few, so
    // that the others are read too.
    static constexpr int kFramesPerTurn = 16;
    for (int frames = 0;; ++frames) {
      if (closing_) return MaybeClose();
      if (frames == kFramesPerTurn) {
        asio::post(strand_, [self = shared_from_this()] { self->ReadHeader(); });
        return;
      }
      if (inflight_bytes_ + queued_bytes_ > srv_.options_.max_inflight_bytes) {
        paused_ = true;  // resumed by a completed reply
        PublishIdle();
        return;
      }
      if (!srv_.budget_.Allows(account_->held.load(std::memory_order_relaxed), 0)) return Park(Resume::kHeader);
      if (rend_ - rpos_ < wire::kHeaderBytes) break;
      // Before HELLO the limit is kMaxHelloPayload, checked below with a message that says so.
      auto h = wire::DecodeHeader(std::span<const std::byte>(rbuf_.data() + rpos_, wire::kHeaderBytes),
                                  authed_ ? srv_.options_.max_frame_bytes : wire::kMaxPayloadBytes);
      if (!h.ok()) {
        FailFrame(0, h.status());
        return;
      }
      // Before HELLO nothing but a HELLO-sized HELLO is read: an unauthenticated peer gets no
      // more of the daemon's memory than that.
      if (!authed_ && h->opcode != wire::Opcode::kHello && !(h->flags & wire::kFlagResponse)) {
        srv_.metrics_.AuthFailure();
        FailFrame(h->request_id,
                  Status::PermissionDenied(fmt::format("{} before HELLO", wire::OpcodeName(h->opcode))));
        return;
      }
      if (!authed_ && h->payload_bytes > kMaxHelloPayload) {
        FailFrame(h->request_id,
                  Status::InvalidArgument(fmt::format("a frame before HELLO may carry at most {} payload bytes; this "
                                                      "one announces {}",
                                                      kMaxHelloPayload, h->payload_bytes)));
        return;
      }
      if (put_running_ && authed_ && !(h->flags & wire::kFlagResponse) &&
          (h->opcode == wire::Opcode::kPut || h->opcode == wire::Opcode::kShmPut)) {
        put_waiting_ = true;  // read on by PutFinished
        PublishIdle();
        return;
      }
      rpos_ += wire::kHeaderBytes;
      header_ = *h;
      if (authed_) called_.store(true, std::memory_order_relaxed);
      last_active_ = frame_start_ = Clock::now();
      in_frame_ = true;
      got_ = 0;
      if (RoomPut() && StartRoom()) {
        PublishIdle();
        if (!StepRoom()) return;
        if (!FinishRoom()) return;
        continue;
      }
      if (DirectPut() && StartDirect()) {
        PublishIdle();
        if (!StepDirect()) return;
        if (!HandleDirect()) return;
        continue;
      }
      if (!payload_.Reserve(header_.payload_bytes, Charge(&srv_.budget_, account_))) {
        FailFrame(header_.request_id, Status::ResourceExhausted(fmt::format(
                                          "no address space for a {}-byte payload", header_.payload_bytes)));
        return;
      }
      PublishIdle();
      if (!StepPayload()) return;
      if (!HandleFrame()) return;
    }
    // Not a whole header buffered: keep what there is and receive more.
    if (rpos_ > 0) {
      std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
      rend_ -= rpos_;
      rpos_ = 0;
    }
    PublishIdle();
    // Into a grown buffer, a read takes only what the budget allows.
    size_t room = std::min(rbuf_.capacity() - rend_, kReadChunk);
    if (rbuf_.grown() && !srv_.budget_.Allows(account_->held.load(std::memory_order_relaxed), room)) {
      room = ReadBuffer::kSmall - rend_;  // rend_ < kHeaderBytes here
    }
    reading_ = true;
    socket_.async_read_some(asio::buffer(rbuf_.data() + rend_, room),
                            asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec,
                                                                                     size_t n) {
                              self->reading_ = false;
                              if (ec == asio::error::operation_aborted && self->trimming_ && !self->closing_) {
                                // OnTick cancelled it to give the grown buffer back.
                                self->trimming_ = false;
                                self->rbuf_.Shrink(self->rpos_, self->rend_);
                                self->ChargeReadBuffer();
                                return self->ReadHeader();
                              }
                              self->trimming_ = false;
                              if (ec) {
                                self->closing_ = true;
                                return self->MaybeClose();
                              }
                              self->rend_ += n;
                              self->ChargeReadBuffer();
                              self->ReadHeader();
                            }));
  }

  // A PUT that the network thread may store (TryPutHere) is read whole into the receive
  // buffer, grown to hold it, and stored from there: no payload is allocated for it, its value
  // is copied once (into host memory), and while the connection sends such PUTs one receive
  // usually brings a whole one. A grown buffer's bytes are charged as they are first written
  // (as a payload's are as they arrive) and stay charged while it is kept, as they stay in
  // memory; it goes once the connection has been quiet for a tick.
  bool DirectPut() const {
    return authed_ && header_.opcode == wire::Opcode::kPut && header_.payload_bytes > 0 &&
           header_.payload_bytes <= kDirectPutBytes && srv_.store_->PutsWithoutBlocking();
  }

  // Makes room in rbuf_ for header_'s payload (and, past ReadBuffer::kSmall, for the start of
  // what follows). False (the frame goes the usual way) when no memory can be had for it.
  bool StartDirect() {
    const size_t n = header_.payload_bytes;
    if (rbuf_.capacity() - rpos_ >= n) return true;
    const size_t before = rbuf_.capacity();
    if (!rbuf_.Grow(n > ReadBuffer::kSmall ? n + ReadBuffer::kSmall : n, rpos_, rend_)) return false;
    if (rbuf_.capacity() != before) {  // a new mapping: only what was moved into it is written
      rbuf_charge_.Release();
      ChargeReadBuffer();
    }
    return true;
  }

  // Charges the budget with the bytes of a grown rbuf_ that were ever written (the pages it
  // holds in memory: as many as the largest PUT read into it, not its mapped size), until it
  // goes back. The ReadBuffer::kSmall bytes in place are every connection's and not charged.
  void ChargeReadBuffer() {
    const uint64_t touched = rbuf_.grown() ? std::max<uint64_t>(rbuf_charge_.bytes(), rend_) : 0;
    if (touched == rbuf_charge_.bytes()) return;
    if (touched < rbuf_charge_.bytes()) rbuf_charge_.Release();
    if (touched == 0) return;
    if (rbuf_charge_.bytes() == 0) rbuf_charge_ = Charge(&srv_.budget_, account_);
    rbuf_charge_.Add(touched - rbuf_charge_.bytes());
  }

  // Brings a direct PUT's payload into rbuf_. True when it is all there; false when a read is
  // under way, or the frame went on the usual way: when the budget does not allow the next
  // read, what came so far moves into a payload of its own and StepPayload parks it.
  bool StepDirect() {
    const size_t n = header_.payload_bytes;
    got_ = std::min(rend_ - rpos_, n);
    if (got_ == n) {
      in_frame_ = false;
      return true;
    }
    const size_t chunk = std::min(rbuf_.capacity() - rend_, kReadChunk);
    if (!srv_.budget_.Allows(account_->held.load(std::memory_order_relaxed), chunk)) {
      if (!payload_.Reserve(n, Charge(&srv_.budget_, account_))) {
        FailFrame(header_.request_id,
                  Status::ResourceExhausted(fmt::format("no address space for a {}-byte payload", n)));
        return false;
      }
      payload_.charge().Add(got_);
      std::memcpy(payload_.data(), rbuf_.data() + rpos_, got_);
      rpos_ = rend_ = 0;
      // The grown buffer goes (no read into it is under way): its pages would otherwise stay
      // charged beside the payload's.
      rbuf_.Shrink(rpos_, rend_);
      ChargeReadBuffer();
      // StepPayload parks (the budget refused already); were it to complete the frame, the
      // next header is read from a fresh turn of the strand.
      if (StepPayload() && HandleFrame()) asio::post(strand_, [self = shared_from_this()] { self->ReadHeader(); });
      return false;
    }
    ReadPayload(asio::buffer(rbuf_.data() + rend_, chunk), [](Session& s, size_t k) {
      s.rend_ += k;
      s.ChargeReadBuffer();
      if (s.StepDirect() && s.HandleDirect()) s.ReadHeader();
    });
    return false;
  }

  // Reads some of a frame's payload into `into`; then `arrived(session, bytes)` on the strand,
  // or the connection closes when the read fails.
  template <typename Arrived>
  void ReadPayload(asio::mutable_buffer into, Arrived arrived) {
    reading_ = true;
    socket_.async_read_some(
        into, asio::bind_executor(strand_, [self = shared_from_this(), arrived](boost::system::error_code ec, size_t k) {
          self->reading_ = false;
          if (ec) {
            self->closing_ = true;
            return self->MaybeClose();
          }
          arrived(*self, k);
        }));
  }

  // Handles the direct PUT at rbuf_'s front. When the store cannot take it from this thread
  // (or the frame is bad), its bytes are copied into a payload of their own and handled as any
  // frame.
  bool HandleDirect() {
    const std::span<const std::byte> p(rbuf_.data() + rpos_, header_.payload_bytes);
    rpos_ += p.size();  // the bytes stay where they are until this returns
    bool stored = false;
    if (!(header_.flags & wire::kFlagResponse) && wire::VerifyPayload(header_, p).ok()) {
      auto req = wire::DecodePutRequest(p, srv_.options_.max_frame_bytes);
      if (req.ok()) {
        Decoded decoded;
        decoded.put = std::move(*req);
        stored = TryPutHere(header_, p.size(), decoded);  // copied by the time it returns
      }
    }
    if (stored) {
      srv_.metrics_.BytesIn(wire::kHeaderBytes + p.size());
      return true;
    }
    if (!payload_.Reserve(p.size(), Charge(&srv_.budget_, account_))) {
      return FailFrame(header_.request_id, Status::ResourceExhausted(fmt::format(
                                               "no address space for a {}-byte payload", p.size())));
    }
    payload_.charge().Add(p.size());
    std::memcpy(payload_.data(), p.data(), p.size());
    return HandleFrame();
  }

  // ---- a large PUT received straight into host memory ----
  //
  // A PUT of one value of at least put_in_place_bytes whose frame has not all come yet: room for its
  // record is reserved in the host tier (DaemonStore::ReservePut, the daemon's own), and the
  // value's bytes are read from the socket into it, not into the receive buffer: the kernel's
  // copy is the only one. Each read's bytes are hashed into the frame's checksum as they land
  // (while still in cache), so nothing reads the value again but the record's own hash at the
  // commit (DaemonStore::CommitWritten, ordered as of then, as a PUT stored then would be). The
  // room counts against the budget of lent host pages (pin_cap_) while it fills; the frame's
  // deadline runs as for any frame. A frame whose checksum does not match, or a connection that
  // closes or times out mid-value, gives the room back unpublished.
  static constexpr size_t kRoomPrefix = 4 + 16 + 4;  // item count, hash, value length
  static constexpr size_t kRoomChunk = 512u << 10;   // one read: hashed while in the L2 cache
  struct Room {
    std::unique_ptr<DaemonStore::PutReservation> reservation;
    DaemonStore::Keep pins;
    std::byte* value = nullptr;
    uint64_t bytes = 0, got = 0;
    XXH3_state_t sum;  // of the payload so far
  };

  bool RoomPut() const {
    return authed_ && header_.opcode == wire::Opcode::kPut && !(header_.flags & wire::kFlagResponse) &&
           srv_.options_.put_in_place_bytes > 0 &&
           header_.payload_bytes >= kRoomPrefix + srv_.options_.put_in_place_bytes && rend_ - rpos_ >= kRoomPrefix &&
           rend_ - rpos_ < header_.payload_bytes && srv_.store_->PutsWithoutBlocking();
  }

  // Reserves the room when the payload's front (buffered) names one value filling the rest of
  // the frame, and the store can take it; the value's bytes buffered so far move into it. False,
  // nothing changed: the frame goes the usual way, and is answered as it would be.
  bool StartRoom() {
    const std::byte* p = rbuf_.data() + rpos_;
    wire::PayloadReader r(std::span<const std::byte>(p, kRoomPrefix));
    const auto count = r.U32("PUT item count");
    const auto hash_bytes = r.Bytes(16, "PUT hash");
    const auto bytes = r.U32("PUT bundle");
    if (!count.ok() || *count != 1 || !hash_bytes.ok() || !bytes.ok() ||
        uint64_t{*bytes} + kRoomPrefix != header_.payload_bytes) {
      return false;
    }
    wire::WireHash hash;
    std::memcpy(hash.data(), hash_bytes->data(), hash.size());
    if (*bytes > srv_.store_->MaxValueBytes() || !srv_.PinsBelowCap(*bytes)) return false;
    const DaemonStore::Arena arena = srv_.store_->SharedArena();
    if (arena.base == nullptr) return false;
    auto reserved = srv_.store_->ReservePut(ns_, hash, *bytes, /*shared=*/false);
    if (!reserved.ok()) return false;
    const uint64_t at = (*reserved)->value_offset();
    if ((*reserved)->value_bytes() != *bytes || at > arena.bytes || arena.bytes - at < *bytes) return false;
    auto room = std::make_unique<Room>();
    room->pins = srv_.ChargePins(*bytes);
    room->reservation = std::move(*reserved);
    // The daemon's own memory; nothing of it is published until the commit has hashed it.
    room->value = const_cast<std::byte*>(arena.base) + at;
    room->bytes = *bytes;
    XXH3_64bits_reset(&room->sum);
    XXH3_64bits_update(&room->sum, p, kRoomPrefix);
    rpos_ += kRoomPrefix;
    const size_t buffered = std::min<size_t>(rend_ - rpos_, room->bytes);
    std::memcpy(room->value, rbuf_.data() + rpos_, buffered);
    XXH3_64bits_update(&room->sum, room->value, buffered);
    rpos_ += buffered;
    room->got = buffered;
    got_ = kRoomPrefix + buffered;
    room_ = std::move(room);
    srv_.metrics_.PutInPlace();
    return true;
  }

  // Reads the rest of the value into the room, at most what it still needs (the next frame's
  // bytes go to the receive buffer). True when it is all in; false while a read is under way.
  bool StepRoom() {
    Room& room = *room_;
    if (room.got == room.bytes) {
      in_frame_ = false;
      return true;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(room.bytes - room.got, kRoomChunk));
    reading_ = true;
    // The room outlives the read: it goes only in this handler, or with the session (which the
    // handler holds), never while the kernel may still write into it.
    socket_.async_read_some(
        asio::buffer(room.value + room.got, n),
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec, size_t k) {
          self->reading_ = false;
          Room& r = *self->room_;
          if (ec || self->closing_) {
            // The value never came whole: the room goes back unpublished.
            self->room_.reset();
            self->in_frame_ = false;
            self->closing_ = true;
            return self->MaybeClose();
          }
          XXH3_64bits_update(&r.sum, r.value + r.got, k);
          r.got += k;
          self->got_ += k;
          if (self->StepRoom() && self->FinishRoom()) self->ReadHeader();
        }));
    return false;
  }

  // Answers a store call made for frame `h` (begun at `t0`) with `stored`, one status per item:
  // from whatever thread the store answers on, possibly after the session has gone. It holds the
  // session weakly and the server by pointer, so that nothing it leaves behind touches either
  // once EndAsyncCall has let a shutdown go on. With `put_gate`, the connection's next PUT is
  // let in once the answer is queued (PutFinished).
  static void AnswerStore(const std::weak_ptr<Session>& weak, Server::Impl* srv, const wire::FrameHeader& h,
                          Clock::time_point t0, std::vector<wire::ItemStatus> stored, bool put_gate) {
    OutFrame frame = Reply(wire::Encode(wire::StatusListReply{std::move(stored)})).ToFrame(h.opcode, h.request_id);
    srv->metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), false);
    if (std::shared_ptr<Session> self = weak.lock()) {
      asio::post(self->strand_, [self, put_gate, frame = std::move(frame)]() mutable {
        --self->inflight_requests_;
        self->QueueWrite(std::move(frame));
        if (put_gate) self->PutFinished();
      });
    }  // a session already gone needs no answer
    srv->EndAsyncCall();
  }

  // The value is in: checked against the frame's checksum, then committed and answered as a
  // PUT (TryPutHere's way). False when reading must stop.
  bool FinishRoom() {
    std::unique_ptr<Room> room = std::move(room_);
    srv_.metrics_.BytesIn(wire::kHeaderBytes + header_.payload_bytes);
    if ((header_.flags & wire::kFlagPayloadChecksum) &&
        static_cast<uint32_t>(XXH3_64bits_digest(&room->sum)) != header_.payload_checksum) {
      room.reset();  // nothing published: the key keeps what it held
      return FailFrame(header_.request_id, Status::Corruption(fmt::format("{} payload checksum mismatch",
                                                                          wire::OpcodeName(header_.opcode))));
    }
    const wire::FrameHeader h = header_;
    const auto t0 = frame_start_;
    ++inflight_requests_;
    srv_.BeginAsyncCall();
    Server::Impl* srv = &srv_;
    srv_.store_->CommitWritten(ns_, std::move(room->reservation),
                               [weak = weak_from_this(), srv, h, t0](std::vector<wire::ItemStatus> stored) {
                                 AnswerStore(weak, srv, h, t0, std::move(stored), /*put_gate=*/true);
                               });
    put_running_ = true;  // until the answer is queued (PutFinished)
    return true;
  }

  // Brings the payload of header_ in: first what the receive buffer holds, then reads from the
  // socket, at most kReadChunk at a time, each read only when the budget allows that much and
  // charged with what arrived (so memory follows the bytes that came, never the size
  // announced; concurrent reads may pass the budget by a chunk each). True when the payload is
  // complete; false when a read is under way, the connection is parked, or it is closing.
  bool StepPayload() {
    const size_t n = header_.payload_bytes;
    const size_t buffered = std::min<size_t>(rend_ - rpos_, n - got_);
    if (buffered > 0) {
      if (!srv_.budget_.Allows(account_->held.load(std::memory_order_relaxed), buffered) &&
          !srv_.budget_.TakePass(this)) {
        Park(Resume::kPayload, buffered);
        return false;
      }
      payload_.charge().Add(buffered);
      std::memcpy(payload_.data() + got_, rbuf_.data() + rpos_, buffered);
      rpos_ += buffered;
      got_ += buffered;
    }
    if (got_ == n) {
      in_frame_ = false;
      srv_.budget_.ReturnPass(this);  // the frame is whole: the next held-back one may finish
      return true;
    }
    const size_t chunk = std::min(n - got_, kReadChunk);
    if (!srv_.budget_.Allows(account_->held.load(std::memory_order_relaxed), chunk) &&
        !srv_.budget_.TakePass(this)) {
      Park(Resume::kPayload, chunk);
      return false;
    }
    ReadPayload(asio::buffer(payload_.data() + got_, chunk), [](Session& s, size_t k) {
      s.payload_.charge().Add(k);  // what arrived, no more
      s.got_ += k;
      s.payload_.AdviseHugePages(s.got_);
      if (s.StepPayload() && s.HandleFrame()) s.ReadHeader();
    });
    return false;
  }

  // Stops reading until the budget has room for `need` bytes, or this connection's own bytes
  // drain.
  void Park(Resume where, uint64_t need = 0) {
    parked_ = where;
    parked_at_ = Clock::now();
    account_->parked.store(true, std::memory_order_release);
    srv_.metrics_.BackpressurePause();
    PublishIdle();
    srv_.Park(weak_from_this(), in_park_list_);
    // Bytes may have come back between the check and the parking. (The same `need` as the
    // check that parked: a smaller one would wake and park again without end.)
    if (srv_.budget_.Allows(account_->held.load(std::memory_order_acquire), need)) {
      asio::post(strand_, [self = shared_from_this()] { self->Unpark(); });
    }
  }

  void Unpark() {
    if (parked_ == Resume::kNone || closed_) return;
    const Resume where = parked_;
    parked_ = Resume::kNone;
    account_->parked.store(false, std::memory_order_release);
    // The wait was the daemon's (its budget), not the client's: the frame's clock stood still.
    if (in_frame_) frame_start_ += Clock::now() - parked_at_;
    if (closing_) return MaybeClose();
    if (where == Resume::kHeader) return ReadHeader();
    if (StepPayload() && HandleFrame()) ReadHeader();
  }

  // Publishes whether the connection is idle, for the choice of a connection to close at a
  // limit (Server::Impl::LongestIdle).
  void PublishIdle() {
    const bool busy = in_frame_ || inflight_requests_ > 0 || writing_ || !writes_.empty() || closing_ || !views_.empty();
    idle_since_.store(busy ? 0 : std::max<int64_t>(1, last_active_.time_since_epoch().count()),
                      std::memory_order_relaxed);
  }

  // One timer per connection checks its deadlines every srv_.tick_: HELLO within
  // handshake_timeout_ms, a started frame complete within frame_timeout_ms of its header,
  // replies taken within write_timeout_ms, and the idle timeout.
  void ArmTick() {
    tick_.expires_after(srv_.tick_);
    tick_.async_wait(asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed_) return;
      self->OnTick();
      if (!self->closed_) self->ArmTick();
    }));
  }

  void OnTick() {
    const ServerOptions& o = srv_.options_;
    const auto now = Clock::now();
    auto past = [&](Clock::time_point since, uint32_t ms) { return now - since >= std::chrono::milliseconds(ms); };
    // First, and even while closing (a connection closing waits for its writes): a peer that
    // takes none of its replies. Nothing more can reach it, so no ERROR frame.
    if (writing_ && !write_failed_ && past(write_started_, o.write_timeout_ms)) {
      write_failed_ = true;
      srv_.metrics_.SlowClientDropped();
      spdlog::warn("session {}: replies not taken for {} ms ({} bytes queued), disconnecting", id_,
                   o.write_timeout_ms, queued_bytes_);
      closing_ = true;
      boost::system::error_code ignored;
      socket_.shutdown(GenericSocket::shutdown_both, ignored);
      socket_.cancel(ignored);
      return MaybeClose();
    }
    if (closing_) return;
    if (!authed_ && past(created_, o.handshake_timeout_ms)) {
      srv_.metrics_.HandshakeTimedOut();
      spdlog::info("session {}: no HELLO within {} ms, closing", id_, o.handshake_timeout_ms);
      return CloseNow(Status::Aborted(fmt::format("no HELLO within {} ms", o.handshake_timeout_ms)));
    }
    // Time parked on the budget does not count (Unpark moves the frame's start by it): the
    // budget's pass (BufferBudget::TakePass) lets one held-back frame at a time finish, so
    // frames never wait on each other for good, and a client that stops sending meets this
    // deadline whether it holds the pass or not.
    if (in_frame_ && parked_ == Resume::kNone && past(frame_start_, o.frame_timeout_ms)) {
      srv_.metrics_.FrameTimedOut();
      spdlog::warn("session {}: a {}-byte frame not complete after {} ms ({} bytes came), closing", id_,
                   header_.payload_bytes, o.frame_timeout_ms, got_);
      return CloseNow(Status::Aborted(fmt::format("a frame did not arrive within {} ms", o.frame_timeout_ms)));
    }
    // A receive buffer grown for PUTs goes back once the connection has been quiet for a tick:
    // the read waiting for the next header is cancelled, and its handler shrinks the buffer
    // (nothing may be read into it meanwhile) and reads again.
    if (rbuf_.grown() && reading_ && !trimming_ && !in_frame_ && !writing_ && parked_ == Resume::kNone &&
        now - last_active_ >= srv_.tick_) {
      trimming_ = true;
      boost::system::error_code ignored;
      socket_.cancel(ignored);
    }
    // Write leases never committed are taken back: their room is freed, nothing stored.
    for (auto it = put_leases_.begin(); it != put_leases_.end();) {
      if (now >= it->second.deadline) {
        srv_.metrics_.WriteLeaseExpired();
        spdlog::info("session {}: write lease {} not committed within {} ms; its room is freed", id_, it->first,
                     o.write_lease_timeout_ms);
        it = put_leases_.erase(it);
      } else {
        ++it;
      }
    }
    if (!in_frame_ && parked_ == Resume::kNone && inflight_requests_ == 0 && !writing_ && writes_.empty() &&
        views_.empty() && past(last_active_, o.idle_timeout_ms)) {
      spdlog::info("session {}: idle for {} ms, closing", id_, o.idle_timeout_ms);
      closing_ = true;
      boost::system::error_code ignored;
      socket_.shutdown(GenericSocket::shutdown_both, ignored);
      MaybeClose();
    }
  }

  void CloseNow(const Status& st) {
    if (closed_ || closing_) return;
    closing_ = true;
    PublishIdle();
    QueueWrite(ErrorFrame(0, st));
    boost::system::error_code ignored;
    socket_.shutdown(GenericSocket::shutdown_receive, ignored);
    MaybeClose();
  }

  // Handles the frame in header_ and payload_. False when reading must stop (the session is
  // closing).
  bool HandleFrame() {
    srv_.metrics_.BytesIn(wire::kHeaderBytes + payload_.size());
    if (Status st = wire::VerifyPayload(header_, payload_.span()); !st.ok()) return FailFrame(header_.request_id, st);
    if (header_.flags & wire::kFlagResponse) {
      return FailFrame(header_.request_id, Status::InvalidArgument("a client sent a frame marked as a response"));
    }
    const wire::Opcode op = header_.opcode;
    if (op == wire::Opcode::kHello) {
      const bool go_on = OnHello();
      payload_.Reset();
      return go_on;
    }
    if (!authed_) {
      srv_.metrics_.AuthFailure();
      return FailFrame(header_.request_id,
                       Status::PermissionDenied(fmt::format("{} before HELLO", wire::OpcodeName(op))));
    }
    if (op == wire::Opcode::kEvent || op == wire::Opcode::kError || op == wire::Opcode::kShmVerdicts) {
      return FailFrame(header_.request_id,
                       Status::InvalidArgument(fmt::format("{} is sent by the server only", wire::OpcodeName(op))));
    }
    // A payload that does not decode is a malformed frame: error, then close. GET hash lists
    // and PUT item lists are decoded once here and handed to the paths served on this thread.
    Decoded decoded;
    Status valid = Status::OK();
    if (op == wire::Opcode::kGet || op == wire::Opcode::kShmGet || op == wire::Opcode::kShmView ||
        op == wire::Opcode::kShmGetOverlap) {
      auto req = wire::DecodeHashList(payload_.span());
      valid = req.status();
      if (req.ok()) decoded.get = std::move(*req);
    } else if (op == wire::Opcode::kPut) {
      auto req = wire::DecodePutRequest(payload_.span(), srv_.options_.max_frame_bytes);
      valid = req.status();
      if (req.ok()) decoded.put = std::move(*req);
    } else if (op == wire::Opcode::kShmPut) {
      auto req = wire::DecodeShmPutRequest(payload_.span());
      valid = req.status();
      if (req.ok()) decoded.shm_put = std::move(*req);
    } else if (op == wire::Opcode::kGetRanges) {
      auto req = wire::DecodeGetRangesRequest(payload_.span(), srv_.options_.max_frame_bytes);
      valid = req.status();
      if (req.ok()) decoded.ranges = std::move(*req);
    } else if (op == wire::Opcode::kPutLease) {
      auto req = wire::DecodePutLeaseRequest(payload_.span());
      valid = req.status();
      if (req.ok()) decoded.lease = std::move(*req);
    } else if (op == wire::Opcode::kPutCommit) {
      auto req = wire::DecodePutCommitRequest(payload_.span());
      valid = req.status();
      if (req.ok()) decoded.commit = std::move(*req);
    } else {
      valid = ValidateRequest(op, payload_.span());
    }
    if (!valid.ok()) return FailFrame(header_.request_id, valid);
    if (op == wire::Opcode::kSubscribe) {
      Subscribe();
    } else if (op == wire::Opcode::kPing) {
      QueueWrite(wire::EncodeFrame(op, wire::kFlagResponse, header_.request_id, payload_.span()));
    } else if (op == wire::Opcode::kTouch) {
      // Local reads the client made (api/PROTOCOL.md): counted as GET hits here, on this thread
      // (a lookup under the host tier's lock per hash). No reply: the client does not wait.
      const wire::HashList req = *wire::DecodeHashList(payload_.span());  // checked above
      srv_.metrics_.LocalReads(srv_.store_->TouchRead(ns_, req.hashes));
    } else {
      Dispatch(header_, std::move(payload_), decoded);
    }
    payload_.Reset();
    return true;
  }

  Status ValidateRequest(wire::Opcode op, std::span<const std::byte> p) const {
    switch (op) {
      case wire::Opcode::kLookup:
      case wire::Opcode::kUnpin:
      case wire::Opcode::kDelete:
      case wire::Opcode::kShmRelease:
      case wire::Opcode::kTouch: return wire::DecodeHashList(p).status();
      case wire::Opcode::kPin: return wire::DecodePinRequest(p).status();
      case wire::Opcode::kHint: return wire::DecodeHintRequest(p).status();
      case wire::Opcode::kHintDrop: return wire::DecodeHintDrop(p).status();
      case wire::Opcode::kLogAppend: return wire::DecodeLogAppend(p).status();
      case wire::Opcode::kLogSuspended: return wire::DecodeLogSuspended(p).status();
      case wire::Opcode::kLogFinish: return wire::DecodeLogFinish(p).status();
      case wire::Opcode::kShmViewEnd: return wire::DecodeLease(p).status();
      case wire::Opcode::kStats:
      case wire::Opcode::kSubscribe:
      case wire::Opcode::kLogRecover:
        return p.empty() ? Status::OK()
                         : Status::InvalidArgument(fmt::format("{} takes no payload", wire::OpcodeName(op)));
      default: return Status::OK();
    }
  }

  bool OnHello() {
    const uint64_t rid = header_.request_id;
    if (authed_) return FailFrame(rid, Status::FailedPrecondition("HELLO sent twice on one connection"));
    auto hello = wire::DecodeHelloRequest(payload_.span());
    if (!hello.ok()) return FailFrame(rid, hello.status());
    if (hello->protocol_version != wire::kProtocolVersion) {
      return FailFrame(rid, Status::NotSupported(fmt::format("HELLO asks for protocol {}; this daemon speaks {}",
                                                             hello->protocol_version, wire::kProtocolVersion)));
    }
    int ns = -1;
    for (size_t i = 0; i < srv_.options_.namespaces.size(); ++i) {
      if (srv_.options_.namespaces[i].name == hello->namespace_name) ns = static_cast<int>(i);
    }
    // Unknown namespace and wrong token read the same, so neither leaks which namespaces exist.
    const std::string& expected = ns >= 0 ? srv_.options_.namespaces[ns].token : std::string();
    if (ns < 0 || (!expected.empty() && !TokenEquals(hello->token, expected))) {
      srv_.metrics_.AuthFailure();
      spdlog::warn("session {}: HELLO refused for namespace '{}' (client '{}')", id_, hello->namespace_name,
                   hello->client_name);
      return FailFrame(rid, Status::PermissionDenied("unknown namespace or wrong token"));
    }
    // Counted against the namespace's quota and the server's limit; at either, the longest-idle
    // connection makes room, or this one is refused.
    if (Status st = srv_.AdmitAuthenticated(this, static_cast<uint32_t>(ns) + 1); !st.ok()) {
      srv_.metrics_.ConnectionRejected();
      spdlog::warn("session {}: HELLO for namespace '{}' refused: {}", id_, hello->namespace_name, st.message());
      return FailFrame(rid, st);
    }
    authed_ = true;
    ns_ = static_cast<uint32_t>(ns) + 1;  // namespace ids start at 1
    wire::HelloReply reply;
    reply.session_id = id_;
    reply.max_payload_bytes = srv_.options_.max_frame_bytes;
    reply.block_tokens = srv_.options_.block_tokens;
    reply.server_version = "sparsekvd 0.1.0";
    if (hello->want_shared_memory && is_unix_) {
      if (Status st = MakeStaging(); st.ok()) {
        reply.shm_staging_bytes = staging_bytes_;
        // With one namespace, every byte of the host arena is this namespace's: the client may
        // map it (read-only) and GETs are lent in place instead of copied.
        if (srv_.arena_ro_fd_ >= 0) {
          lend_ = true;
          reply.shm_arena_bytes = srv_.arena_.bytes;
          // Write leases: the client writes PUTs into the arena in place (its descriptor is
          // then the writable one).
          write_leases_ = hello->want_write_leases && srv_.arena_rw_fd_ >= 0;
          // Local reads: the lend table, and a token with each lend.
          lend_table_ = hello->want_lend_table && srv_.table_ro_fd_ >= 0;
        }
      } else {
        spdlog::warn("session {}: no shared memory: {}", id_, st.ToString());
      }
    }
    if (hello->want_write_leases) reply.write_leases = write_leases_;  // only to a client that asked
    // Only to a client that asked: 1 when no client can write the arena, 2 when leases let them
    // (the client then checks what it reads locally).
    if (hello->want_lend_table) reply.lend_table = !lend_table_ ? 0 : srv_.arena_rw_fd_ >= 0 ? 2 : 1;
    spdlog::info("session {}: client '{}' opened namespace '{}'{}", id_, hello->client_name, hello->namespace_name,
                 write_leases_ ? " with shared memory, the host arena and write leases"
                 : lend_       ? " with shared memory and the host arena"
                 : staging_    ? " with shared memory"
                               : "");
    const auto frame = wire::EncodeFrame(wire::Opcode::kHello, wire::kFlagResponse, rid, wire::Encode(reply));
    if (staging_fd_ >= 0) {
      // The staging fd rides with the reply's first bytes; nothing else is queued yet.
      if (!SendWithFd(frame)) {
        closing_ = true;
        MaybeClose();
        return false;
      }
      srv_.metrics_.BytesOut(frame.size());
    } else {
      QueueWrite(frame);
    }
    return true;
  }

  // The session's staging memfd, sized and then sealed (kSizeSeals and F_SEAL_SEAL) before the
  // daemon maps it or the client sees it: the client's descriptor can neither shrink nor grow
  // it, so no client can make the daemon's accesses to it fault. On failure the session has no
  // shared memory (and no descriptor is passed).
  Status MakeStaging() {
    const int fd = ::memfd_create("sparsekv-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return Status::IOError(fmt::format("memfd_create for the staging area: {}", std::strerror(errno)));
    auto fail = [fd](Status st) {
      ::close(fd);
      return st;
    };
    const uint64_t bytes = srv_.options_.staging_bytes;
    // Staging areas are memory a client can fill at will: all of them together stay within
    // max_shared_staging_bytes.
    if (srv_.staging_total_.fetch_add(bytes, std::memory_order_relaxed) + bytes > srv_.options_.max_shared_staging_bytes) {
      srv_.staging_total_.fetch_sub(bytes, std::memory_order_relaxed);
      srv_.metrics_.SharedMemoryDenied();
      return fail(Status::ResourceExhausted(fmt::format(
          "the daemon's staging areas already take {} of max_shared_staging_bytes {}; use the socket",
          srv_.staging_total_.load(std::memory_order_relaxed), srv_.options_.max_shared_staging_bytes)));
    }
    auto unreserve = [&](Status st) {
      srv_.staging_total_.fetch_sub(bytes, std::memory_order_relaxed);
      return fail(std::move(st));
    };
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      return unreserve(Status::IOError(fmt::format("sizing the staging area to {} bytes: {}", bytes, std::strerror(errno))));
    }
    if (Status st = SealMemfd(fd, kSizeSeals, "the staging area"); !st.ok()) return unreserve(st);
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      return unreserve(Status::IOError(fmt::format("mapping the staging area: {}", std::strerror(errno))));
    }
    staging_fd_ = fd;
    staging_bytes_ = bytes;
    staging_ = static_cast<std::byte*>(m);
    return Status::OK();
  }

  bool SendWithFd(const std::vector<std::byte>& frame) {
    const int fd = socket_.native_handle();
    const int fds[3] = {staging_fd_, write_leases_ ? srv_.arena_rw_fd_ : srv_.arena_ro_fd_, srv_.table_ro_fd_};
    const size_t nfds = lend_table_ ? 3 : lend_ ? 2 : 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(fds))] = {};
    iovec iov{const_cast<std::byte*>(frame.data()), frame.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    size_t sent = 0;
    while (sent < frame.size()) {
      ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));  // a fresh socket: rare
        continue;
      }
      if (k <= 0) return false;
      sent += static_cast<size_t>(k);
      iov.iov_base = const_cast<std::byte*>(frame.data()) + sent;
      iov.iov_len = frame.size() - sent;
      msg.msg_control = nullptr;  // the fds go once
      msg.msg_controllen = 0;
    }
    return true;
  }

  void Subscribe() {
    const uint64_t rid = header_.request_id;
    if (subscription_ == 0) {
      std::weak_ptr<Session> weak = shared_from_this();
      subscription_ = srv_.store_->Subscribe(ns_, [weak](const wire::EventRecord& e) {
        if (auto self = weak.lock()) {
          asio::post(self->strand_, [self, e] { self->PushEvent(e); });
        }
      });
    }
    QueueWrite(wire::EncodeFrame(wire::Opcode::kSubscribe, wire::kFlagResponse, rid, {}));
  }

  void PushEvent(const wire::EventRecord& e) {
    if (closed_ || closing_) return;
    if (queued_bytes_ > srv_.options_.max_inflight_bytes) {
      // A subscriber that does not read its events must not hold memory without bound.
      srv_.metrics_.SlowClientDropped();
      spdlog::warn("session {}: {} bytes of replies and events unread; disconnecting", id_, queued_bytes_);
      closing_ = true;
      boost::system::error_code ignored;
      socket_.shutdown(GenericSocket::shutdown_both, ignored);
      return MaybeClose();
    }
    QueueWrite(wire::EncodeFrame(wire::Opcode::kEvent, 0, 0, wire::Encode(wire::EventBatch{event_seq_++, {e}})));
  }

  // A request's payload as HandleFrame decoded it (the lists hold spans into the payload).
  struct Decoded {
    std::optional<wire::HashList> get;          // GET, SHM_GET
    std::optional<wire::PutRequest> put;        // PUT
    std::optional<wire::ShmPutRequest> shm_put;  // SHM_PUT
    std::optional<wire::GetRangesRequest> ranges;  // GET_RANGES (owns its lists)
    std::optional<wire::PutLeaseRequest> lease;    // PUT_LEASE
    std::optional<wire::PutCommitRequest> commit;  // PUT_COMMIT
  };

  void Dispatch(const wire::FrameHeader& h, Payload payload, Decoded& decoded) {
    const std::vector<wire::WireHash>* get_hashes = decoded.get ? &decoded.get->hashes : nullptr;
    // The client is done with what its previous SHM_GET lent it (api/PROTOCOL.md).
    const bool overlap = h.opcode == wire::Opcode::kShmGetOverlap;
    if (h.opcode == wire::Opcode::kShmGet || h.opcode == wire::Opcode::kShmRelease || overlap) {
      lent_.clear();
      lent_bytes_ = 0;
    }
    // Leases are served here, on the strand that owns them.
    if (h.opcode == wire::Opcode::kShmView || h.opcode == wire::Opcode::kShmViewEnd) {
      const auto t0 = Clock::now();
      Reply r = h.opcode == wire::Opcode::kShmView ? ShmView(*get_hashes) : EndView(payload.span());
      srv_.metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), false);
      QueueWrite(std::move(r).ToFrame(h.opcode, h.request_id));
      PublishIdle();
      return;
    }
    if (decoded.lease) {
      const auto t0 = Clock::now();
      Reply r = PutLease(*decoded.lease);
      srv_.metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), false);
      QueueWrite(std::move(r).ToFrame(h.opcode, h.request_id));
      PublishIdle();
      return;
    }
    if (decoded.commit) return PutCommit(h, *decoded.commit);
    // A LOOKUP the tiers answer from memory is served here, saving two thread hops: an engine's
    // scheduler waits for it (a thread hop costs tens of microseconds on a VM).
    if (h.opcode == wire::Opcode::kLookup && srv_.store_->LooksUpWithoutBlocking()) {
      const auto t0 = Clock::now();
      Result<Reply> reply = Handle(h, payload.span());
      const bool ok = reply.ok();
      OutFrame frame = ok ? std::move(*reply).ToFrame(h.opcode, h.request_id)
                          : OutFrame(ErrorFrame(h.request_id, reply.status()));
      srv_.metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), !ok);
      QueueWrite(std::move(frame));
      PublishIdle();
      return;
    }
    // A GET that memory can answer is served here, saving two thread hops.
    if (h.opcode == wire::Opcode::kGet || h.opcode == wire::Opcode::kShmGet || overlap) {
      const auto t0 = Clock::now();
      std::vector<Unchecked> unchecked;
      std::optional<Reply> fast = h.opcode == wire::Opcode::kGet ? FastGet(*get_hashes)
                                                                 : FastShmGet(*get_hashes, overlap ? &unchecked : nullptr);
      if (fast) {
        OutFrame frame = std::move(*fast).ToFrame(h.opcode, h.request_id);
        srv_.metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), false);
        if (frame.recheck.empty()) {
          QueueWrite(std::move(frame));
        } else {
          SendChecked(std::move(frame));
        }
        if (overlap) CheckLent(h.request_id, get_hashes->size(), std::move(unchecked));
        return;
      }
    }
    if ((decoded.put || decoded.shm_put) && TryPutHere(h, payload.size(), decoded)) return;
    // A GET served by a worker builds its reply there: the bytes it may take are reserved from
    // the budget now, and the reply defers what does not fit them (at least one item is always
    // answered, so the client progresses).
    uint64_t reply_limit = 0;
    Charge reserved(&srv_.budget_, account_);
    if (h.opcode == wire::Opcode::kGet) {
      const uint64_t room = srv_.budget_.limit() - std::min(srv_.budget_.limit(), srv_.budget_.used());
      reply_limit = std::clamp<uint64_t>(room, kConnectionAllowance, srv_.options_.max_frame_bytes);
      reserved.Add(reply_limit);
    } else if (decoded.ranges) {
      // The most its reply can take, reserved for the worker that builds it, and counted in
      // flight, so pipelined requests cannot pass the budget.
      reply_limit = wire::GetRangesReplyBound(*decoded.ranges);
      reserved.Add(reply_limit);
    }
    const uint64_t bytes = payload.size() + reply_limit;
    inflight_bytes_ += bytes;
    ++inflight_requests_;
    auto self = shared_from_this();
    const auto t0 = Clock::now();
    // On a worker: frames the reply, then hands it to the connection's strand.
    // SHM_GET_OVERLAP served by a worker is checked there before its reply: its verdicts are 0.
    const size_t verdicts = overlap ? get_hashes->size() : 0;
    auto complete = [self, h, bytes, t0, verdicts,
                     reserved = std::make_shared<Charge>(std::move(reserved))](Result<Reply> reply) {
      const bool ok = reply.ok();
      OutFrame frame = ok ? std::move(*reply).ToFrame(h.opcode, h.request_id)
                          : OutFrame(ErrorFrame(h.request_id, reply.status()));
      self->srv_.metrics_.Request(h.opcode, std::chrono::duration<double>(Clock::now() - t0).count(), !ok);
      asio::post(self->strand_, [self, bytes, frame = std::move(frame), reserved, ok, verdicts, h]() mutable {
        self->inflight_bytes_ -= bytes;
        --self->inflight_requests_;
        // Held until the client's next SHM_GET: one dispatched meanwhile (which the client does
        // not send before this reply) would only make them stay one request longer.
        for (DaemonStore::Keep& k : frame.lent) self->lent_.push_back(std::move(k));
        self->lent_bytes_ += frame.lent_bytes;
        frame.lent.clear();
        self->QueueWrite(std::move(frame));  // charged as queued; the reservation goes now
        if (ok && h.opcode == wire::Opcode::kShmGetOverlap) {
          const std::vector<uint8_t> zeros(verdicts, 0);
          self->QueueWrite(wire::EncodeFrame(wire::Opcode::kShmVerdicts, wire::kFlagResponse, h.request_id,
                                             wire::EncodeVerdicts(zeros)));
        }
        reserved->Release();
      });
    };
    if (h.opcode == wire::Opcode::kGet) {
      auto job = std::make_shared<SlicedGet>();
      job->request.hashes = *get_hashes;
      job->builder.emplace(*this, job->request.hashes, reply_limit, /*unchecked=*/false, /*host_pages=*/false);
      payload.Reset();
      srv_.SubmitWork(id_, [self, job, complete = std::move(complete)]() mutable {
        self->StepGet(job, [complete = std::move(complete)](Reply r) mutable { complete(std::move(r)); });
      });
      return;
    }
    if (decoded.ranges) {  // served from the request HandleFrame decoded, moved to the worker
      payload.Reset();
      srv_.SubmitWork(id_, [self, req = std::move(*decoded.ranges), complete = std::move(complete)]() mutable {
        complete(self->HandleGetRanges(req));
      });
      return;
    }
    if (h.opcode == wire::Opcode::kLogAppend) {
      // Acknowledged by the log's committer once durable, with every append waiting then: no
      // worker waits for the sync.
      Result<RequestLog*> log = srv_.RequestLogFor(ns_);
      Result<wire::LogAppendRequest> req = wire::DecodeLogAppend(payload.span());
      payload.Reset();
      if (!log.ok() || !req.ok()) {
        complete(!log.ok() ? log.status() : req.status());
        return;
      }
      (*log)->AppendAsync(req->request, req->first_token, req->tokens,
                          [complete](Status st) mutable { complete(OneStatus(st)); });
      return;
    }
    const bool put = decoded.put || decoded.shm_put;
    if (put) put_running_ = true;  // the next PUT frame waits unread until this one is answered
    srv_.SubmitWork(id_, [self, h, put, payload = std::move(payload), complete = std::move(complete)]() mutable {
      Result<Reply> reply = self->Handle(h, payload.span());
      payload.Reset();
      complete(std::move(reply));  // posts the answer to the strand first
      if (put) asio::post(self->strand_, [self] { self->PutFinished(); });
    });
  }

  // On the strand, once the PUT under way is answered: a PUT frame held back goes on.
  void PutFinished() {
    put_running_ = false;
    if (put_waiting_ && !closing_) {
      put_waiting_ = false;
      ReadHeader();
    }
  }

  // Runs on a worker thread: only reads the session's immutable-after-HELLO state.
  Result<Reply> Handle(const wire::FrameHeader& h, std::span<const std::byte> p) {
    DaemonStore& store = *srv_.store_;
    Metrics& m = srv_.metrics_;
    const uint32_t max_bundle = srv_.options_.max_frame_bytes;
    switch (h.opcode) {
      case wire::Opcode::kLookup: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::HashList req, wire::DecodeHashList(p));
        wire::LookupReply r = store.Lookup(ns_, req.hashes);
        m.Hits(r.prefix_blocks);
        m.Misses(req.hashes.size() - r.prefix_blocks);
        return wire::Encode(r);
      }
      case wire::Opcode::kPut: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::PutRequest req, wire::DecodePutRequest(p, max_bundle));
        return wire::Encode(wire::StatusListReply{store.Put(ns_, req.items)});
      }
      case wire::Opcode::kPin: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::PinRequest req, wire::DecodePinRequest(p));
        return wire::Encode(wire::StatusListReply{store.Pin(ns_, req.hashes, req.priority)});
      }
      case wire::Opcode::kUnpin: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::HashList req, wire::DecodeHashList(p));
        return wire::Encode(wire::StatusListReply{store.Unpin(ns_, req.hashes)});
      }
      case wire::Opcode::kDelete: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::HashList req, wire::DecodeHashList(p));
        return wire::Encode(wire::StatusListReply{store.Delete(ns_, req.hashes)});
      }
      case wire::Opcode::kHint: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::HintRequest req, wire::DecodeHintRequest(p));
        SPARSEKV_ASSIGN_OR_RETURN(wire::HintReply r, store.Hint(id_, ns_, req.hashes, req.ttl_ms));
        return wire::Encode(r);
      }
      case wire::Opcode::kHintDrop: {
        SPARSEKV_ASSIGN_OR_RETURN(uint64_t hint, wire::DecodeHintDrop(p));
        const Status st = store.DropHint(id_, hint);
        wire::StatusListReply r;
        r.items.resize(1);
        if (!st.ok()) r.items[0] = {st.code(), std::string(st.message())};
        return wire::Encode(r);
      }
      case wire::Opcode::kLogSuspended: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::LogSuspendedRequest req, wire::DecodeLogSuspended(p));
        SPARSEKV_ASSIGN_OR_RETURN(RequestLog * log, srv_.RequestLogFor(ns_));
        RequestLog::Suspension su;
        su.tokens = req.tokens;
        std::memcpy(&su.tail, req.tail.data(), sizeof su.tail);
        su.tag = req.tag;
        return OneStatus(log->Suspended(req.request, su));
      }
      case wire::Opcode::kLogFinish: {
        SPARSEKV_ASSIGN_OR_RETURN(uint64_t request, wire::DecodeLogFinish(p));
        SPARSEKV_ASSIGN_OR_RETURN(RequestLog * log, srv_.RequestLogFor(ns_));
        return OneStatus(log->Finish(request));
      }
      case wire::Opcode::kLogRecover: {
        if (!p.empty()) return Status::InvalidArgument("LOG_RECOVER takes no payload");
        SPARSEKV_ASSIGN_OR_RETURN(RequestLog * log, srv_.RequestLogFor(ns_));
        wire::LogRecoverReply r;
        uint64_t bytes = 4;
        for (RequestLog::Request& q : log->Unfinished()) {
          bytes += 8 + 4 + 4 * q.tokens.size() + 1 + 32;
          if (bytes > srv_.options_.max_frame_bytes) {
            return Status::ResourceExhausted(fmt::format(
                "LOG_RECOVER: the namespace's unfinished requests exceed a frame ({} bytes)",
                srv_.options_.max_frame_bytes));
          }
          wire::LogRequestState st;
          st.request = q.id;
          st.tokens = std::move(q.tokens);
          if (q.suspension) {
            st.suspended = true;
            st.state_tokens = q.suspension->tokens;
            std::memcpy(st.tail.data(), &q.suspension->tail, 16);
            st.tag = q.suspension->tag;
          }
          r.requests.push_back(std::move(st));
        }
        return wire::Encode(r);
      }
      case wire::Opcode::kStats: {
        if (!p.empty()) return Status::InvalidArgument("STATS takes no payload");
        wire::PayloadWriter w;
        w.String(store.StatsJson(ns_));
        return w.Take();
      }
      case wire::Opcode::kShmPut: return HandleShmPut(p);
      case wire::Opcode::kShmGet:
      case wire::Opcode::kShmGetOverlap: return HandleShmGet(p);
      case wire::Opcode::kShmRelease: {
        SPARSEKV_ASSIGN_OR_RETURN(wire::HashList req, wire::DecodeHashList(p));
        return wire::Encode(wire::StatusListReply{std::vector<wire::ItemStatus>(req.hashes.size())});
      }
      default:
        return Status::InvalidArgument(fmt::format("{} is not a request", wire::OpcodeName(h.opcode)));
    }
  }

  // A GET reply built around the store's bytes, one item at a time, in order: bundles the store
  // keeps alive (`keep`) are sent from where they lie, small ones copied.
  //
  // No reply exceeds max_frame_bytes (api/PROTOCOL.md): once the next item would take the
  // payload past `soft_limit` (or past max_frame_bytes), it and every item after it are
  // answered as deferred, and the client asks for them again. The first item is always
  // answered, so every reply makes progress: with its bytes if they fit max_frame_bytes, else
  // with ResourceExhausted.
  //
  // With `host_pages`, the bytes are host-tier pages that stay pinned while the reply holds
  // them: they are charged to the server's pin budget (pin_cap_), not to the buffer budget.
  class GetReplyBuilder {
   public:
    GetReplyBuilder(Session& session, std::span<const wire::WireHash> hashes, uint64_t soft_limit, bool unchecked,
                    bool host_pages)
        : s_(session),
          hashes_(hashes),
          hard_limit_(session.srv_.options_.max_frame_bytes),
          soft_limit_(std::min<uint64_t>(soft_limit, hard_limit_)),
          unchecked_(unchecked),
          host_pages_(host_pages),
          w_(wire::PayloadWriter::ReserveHeader{}),
          size_(4 + 2 * uint64_t{hashes.size()}) {
      w_.U32(static_cast<uint32_t>(hashes.size()));
      f_.ext_pinned = host_pages;
    }

    // Item `i` (the next one) as the store answered it.
    void Add(size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
      static constexpr size_t kGatherAtLeast = 4096;
      static constexpr size_t kMaxMessage = 512;  // an item's error message, at most
      next_ = i + 1;
      const std::string_view message = st.message().substr(0, kMaxMessage);
      if (!deferring_) {
        const uint64_t item = 4 + (st.ok() ? bytes.size() : message.size());
        if (size_ + item > (answered_ == 0 ? hard_limit_ : soft_limit_)) {
          if (answered_ == 0 && st.ok()) {
            // Larger than any reply may be: no request can ever fetch it.
            const std::string why = fmt::format("a bundle of {} bytes does not fit a reply of at most {} bytes",
                                                bytes.size(), hard_limit_);
            w_.U8(static_cast<uint8_t>(StatusCode::kResourceExhausted));
            w_.String(why);
            size_ += 4 + why.size();
            ++answered_;
            return;
          }
          deferring_ = true;
        }
      }
      if (deferring_) {
        w_.U8(wire::kDeferredCode);
        ++deferred_;
        return;
      }
      ++answered_;
      size_ += 4 + (st.ok() ? bytes.size() : message.size());
      w_.U8(static_cast<uint8_t>(st.code()));
      if (!st.ok()) {
        w_.String(message);
        return;
      }
      ++hits_;
      bytes_ += bytes.size();
      if (unchecked_) f_.recheck.push_back({i, hashes_[i], keep});
      if (keep && (unchecked_ || bytes.size() >= kGatherAtLeast)) pinned_ += bytes.size();
      if (keep && bytes.size() >= kGatherAtLeast) {
        w_.U32(static_cast<uint32_t>(bytes.size()));
        f_.own = w_.Take();
        f_.CloseOwn(from_);
        f_.pieces.push_back({0, 0, bytes});
        f_.keep.push_back(keep);
        w_.bytes() = std::move(f_.own);
      } else {
        w_.Reserve(bytes.size() + 64);
        w_.Blob(bytes);
      }
    }
    const DaemonStore::GetSink Sink(size_t offset = 0) {
      return [this, offset](size_t i, const Status& st, std::span<const std::byte> bytes,
                            const DaemonStore::Keep& keep) { Add(offset + i, st, bytes, keep); };
    }
    bool full() const { return deferring_; }
    size_t next() const { return next_; }
    uint64_t bundle_bytes() const { return bytes_; }

    // The reply: the items not added yet are deferred.
    Reply Finish() {
      const size_t n = hashes_.size();
      for (; next_ < n; ++next_) {
        w_.U8(wire::kDeferredCode);
        ++deferred_;
      }
      if (host_pages_ && pinned_ > 0) f_.keep.push_back(s_.srv_.ChargePins(pinned_));
      f_.own = w_.Take();
      f_.CloseOwn(from_);
      // The verdict bytes, a piece of their own at the end (0: checked; set by RunRechecks).
      f_.verdict_off = f_.own.size();
      f_.own.resize(f_.own.size() + n, std::byte{0});
      f_.CloseOwn(from_);
      s_.srv_.metrics_.Hits(hits_);
      s_.srv_.metrics_.Misses(n - hits_ - deferred_);
      return Reply(std::move(f_));
    }

   private:
    Session& s_;
    std::span<const wire::WireHash> hashes_;
    const uint64_t hard_limit_, soft_limit_;
    const bool unchecked_, host_pages_;
    wire::PayloadWriter w_;
    OutFrame f_;
    size_t from_ = 0;
    uint64_t size_;  // the payload so far, counting 2 bytes for every item not added yet
    uint64_t hits_ = 0, pinned_ = 0, deferred_ = 0, bytes_ = 0;
    size_t next_ = 0, answered_ = 0;
    bool deferring_ = false;
  };

  // A worker's GET, in slices: each turn on a worker reads at most about kSliceBytes of bundles
  // and then goes to the back of the round (Server::Impl::SubmitWork), so a GET of many large
  // bundles delays another connection's request by a slice, not by the whole GET. Items the
  // reply defers are never read.
  struct SlicedGet {
    wire::HashList request;
    std::optional<GetReplyBuilder> builder;
    size_t step = 4;  // items asked of the store at a time, adapted to their size
  };

  void StepGet(const std::shared_ptr<SlicedGet>& job, std::function<void(Reply)> done) {
    static constexpr uint64_t kSliceBytes = 1u << 20;
    GetReplyBuilder& b = *job->builder;
    const std::span<const wire::WireHash> all(job->request.hashes);
    const uint64_t start_bytes = b.bundle_bytes();
    while (b.next() < all.size() && !b.full() && b.bundle_bytes() - start_bytes < kSliceBytes) {
      const size_t at = b.next();
      const size_t k = std::min(job->step, all.size() - at);
      srv_.store_->Get(ns_, all.subspan(at, k), b.Sink(at));
      const uint64_t per_item = std::max<uint64_t>(1, b.bundle_bytes() / std::max<size_t>(1, b.next()));
      job->step = std::clamp<size_t>(kSliceBytes / 4 / per_item, 1, 64);
    }
    if (b.next() < all.size() && !b.full()) {
      srv_.SubmitWork(id_, [self = shared_from_this(), job, done = std::move(done)]() mutable {
        self->StepGet(job, std::move(done));
      });
      return;
    }
    done(b.Finish());
  }

  // A GET served on the network thread: `serve(sink)` calls the sink for every item, in order,
  // or returns false having called it for none (the fast path declined).
  template <typename Serve>
  std::optional<Reply> BuildGetReply(std::span<const wire::WireHash> hashes, Serve&& serve, uint64_t soft_limit,
                                     bool unchecked, bool host_pages) {
    GetReplyBuilder b(*this, hashes, soft_limit, unchecked, host_pages);
    if (!serve(b.Sink())) return std::nullopt;
    return b.Finish();
  }

  // From memory, the records not checked yet: SendChecked checks them once their bytes are in
  // the kernel, and the reply's verdict bytes carry the outcome. The bytes are sent from the
  // host tier's pages, so past the pin budget (slow readers hold many pages) the fast path
  // declines: a worker then checks and copies them, off the network thread, within the buffer
  // budget.
  std::optional<Reply> FastGet(std::span<const wire::WireHash> hashes) {
    if (!srv_.PinsBelowCap(0)) return std::nullopt;
    return BuildGetReply(
        hashes,
        [&](const DaemonStore::GetSink& sink) {
          return srv_.store_->TryGetWithoutBlocking(ns_, hashes, sink, /*check=*/false);
        },
        srv_.options_.max_frame_bytes, /*unchecked=*/true, /*host_pages=*/true);
  }

  // Checks what went out unchecked and fills the verdicts of `f` (its last piece).
  void RunRechecks(OutFrame& f) {
    for (const OutFrame::Recheck& r : f.recheck) {
      if (!srv_.store_->Recheck(ns_, r.hash, r.keep).ok()) {
        f.own[f.verdict_off + r.item] = std::byte{1};
        spdlog::warn("session {}: a bundle failed its checksum as it was sent; the client is told", id_);
      }
    }
    f.recheck.clear();
  }

  // Sends pieces [first, last) of `f` now, without blocking; `skip` bytes of the first were
  // sent before. Returns the bytes sent (less than asked when the socket is full), or -1.
  ssize_t SendNow(const OutFrame& f, size_t first, size_t last, size_t skip, int flags) {
    std::array<iovec, 66> iov;
    size_t n = 0;
    for (size_t i = first; i < last && n < iov.size(); ++i) {
      auto b = f.Bytes(f.pieces[i]);
      if (i == first) b = b.subspan(skip);
      iov[n++] = {const_cast<std::byte*>(b.data()), b.size()};
    }
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = n;
    ssize_t k;
    do {
      k = ::sendmsg(socket_.native_handle(), &msg, flags | MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (k < 0 && errno == EINTR);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return k;
  }

  // A GET reply with unchecked bytes: everything but the verdicts is handed to the kernel first
  // (MSG_MORE: the last partial segment waits for them), which brings the bytes into the cache;
  // the check then reads them from there, and the verdicts follow. What cannot be sent at once
  // is queued, the verdicts as a frame whose `finish` runs the checks when its turn comes.
  void SendChecked(OutFrame f) {
    const size_t last = f.pieces.size() - 1;  // the verdict piece
    size_t piece = 0, skip = 0;
    if (writes_.empty() && !writing_ && !closed_ && !write_failed_ && last <= 64) {
      uint64_t body = 0;
      for (size_t i = 0; i < last; ++i) body += f.pieces[i].ext.empty() ? f.pieces[i].len : f.pieces[i].ext.size();
      const ssize_t k = SendNow(f, 0, last, 0, MSG_MORE);
      if (k < 0) {  // the connection failed: the usual write path reports and closes
        RunRechecks(f);  // nothing went out unchecked, should a later write succeed
        return QueueWrite(std::move(f));
      }
      srv_.metrics_.BytesOut(static_cast<uint64_t>(k));
      if (static_cast<uint64_t>(k) == body) {
        RunRechecks(f);
        const ssize_t v = SendNow(f, last, last + 1, 0, 0);
        if (v == static_cast<ssize_t>(f.pieces[last].len)) {
          srv_.metrics_.BytesOut(static_cast<uint64_t>(v));
          return;
        }
        piece = last;
        skip = v > 0 ? static_cast<size_t>(v) : 0;
      } else {
        for (uint64_t left = static_cast<uint64_t>(k); piece < last; ++piece) {
          const size_t len = f.Bytes(f.pieces[piece]).size();
          if (left < len) {
            skip = left;
            break;
          }
          left -= len;
        }
      }
    }
    // Queue the unsent rest: the body (if any), then the verdicts.
    auto tail = std::make_shared<OutFrame>(std::move(f));
    if (piece < last) {
      OutFrame body;
      body.own = tail->own;
      body.keep = tail->keep;
      body.ext_pinned = tail->ext_pinned;
      for (size_t i = piece; i < last; ++i) {
        OutFrame::Piece p = tail->pieces[i];
        if (i == piece) {
          if (p.ext.empty()) {
            p.off += skip;
            p.len -= skip;
          } else {
            p.ext = p.ext.subspan(skip);
          }
        }
        body.pieces.push_back(p);
        body.size += p.ext.empty() ? p.len : p.ext.size();
      }
      QueueWrite(std::move(body));
      skip = 0;
    }
    OutFrame verdicts;
    verdicts.own = tail->own;
    verdicts.verdict_off = tail->verdict_off;
    verdicts.recheck = std::move(tail->recheck);
    OutFrame::Piece p = tail->pieces[last];
    p.off += skip;
    p.len -= skip;
    verdicts.pieces.push_back(p);
    verdicts.size = p.len;
    if (!verdicts.recheck.empty()) {
      verdicts.finish = [this](OutFrame& v) { RunRechecks(v); };
    }
    QueueWrite(std::move(verdicts));
  }

  // Whether `bytes` lie in the host arena clients map (so they can be lent by offset).
  bool InArena(std::span<const std::byte> bytes) const {
    const DaemonStore::Arena& arena = srv_.arena_;
    return arena.base != nullptr && bytes.data() >= arena.base && bytes.data() + bytes.size() <= arena.base + arena.bytes;
  }

  // SHM_VIEW: lends each bundle the host tier holds in its arena under a new lease, pinned until
  // SHM_VIEW_END or the connection's end (api/PROTOCOL.md). Only what this thread can read
  // without waiting for tier I/O is lent, within the server's pin budget; every other item is
  // answered FailedPrecondition or ResourceExhausted for the client to read with GET.
  Reply ShmView(std::span<const wire::WireHash> hashes) {
    wire::ShmViewReply reply;
    wire::ShmGetReply& items = reply.items;
    items.status.resize(hashes.size());
    auto all = [&](StatusCode code, const char* why) {
      for (wire::ItemStatus& st : items.status) st = {code, why};
    };
    std::vector<DaemonStore::Keep> keeps;
    std::vector<wire::ShmSlot> slots(hashes.size());
    const DaemonStore::Arena& arena = srv_.arena_;
    if (staging_ == nullptr || !lend_) {
      all(StatusCode::kFailedPrecondition, "this session has no shared host arena: read with GET");
    } else if (views_.size() >= kMaxViews) {
      all(StatusCode::kResourceExhausted, "this session holds the most views it may: end some, or read with GET");
    } else {
      // Item `first + i` of the request, as the store answers it.
      auto lend = [&](size_t first) {
        return [&, first](size_t i, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep& keep) {
          i += first;
          if (!st.ok()) {
            items.status[i] = {st.code(), std::string(st.message())};
            return;
          }
          if (!keep || !InArena(bytes)) {
            items.status[i] = {StatusCode::kFailedPrecondition, "not lendable in place: read with GET"};
            return;
          }
          // At least a page each, so that leases of tiny values cannot pile up bookkeeping
          // beyond what the budget's bytes suggest.
          const uint64_t charge = std::max<uint64_t>(bytes.size(), kMinViewCharge);
          if (!srv_.PinsBelowCap(charge)) {
            items.status[i] = {StatusCode::kResourceExhausted, "the daemon's pin budget is spent: read with GET"};
            return;
          }
          slots[i] = {hashes[i], staging_bytes_ + static_cast<uint64_t>(bytes.data() - arena.base),
                      static_cast<uint32_t>(bytes.size())};
          keeps.push_back(keep);
          keeps.push_back(srv_.ChargePins(charge));
        };
      };
      // The whole batch at once when memory holds all of it, else item by item (a miss, or a
      // bundle on a lower tier, answered on its own).
      if (!srv_.store_->TryGetWithoutBlocking(ns_, hashes, lend(0), /*check=*/true)) {
        for (size_t i = 0; i < hashes.size(); ++i) {
          if (!srv_.store_->TryGetWithoutBlocking(ns_, hashes.subspan(i, 1), lend(i), /*check=*/true)) {
            // Absent, or on a lower tier: GET finds out (this thread does no tier I/O).
            items.status[i] = {StatusCode::kFailedPrecondition, "not in host memory: read with GET"};
          }
        }
      }
      for (size_t i = 0; i < hashes.size(); ++i) {
        if (items.status[i].code == StatusCode::kOk) items.slots.push_back(slots[i]);
      }
    }
    if (!keeps.empty()) {
      reply.lease = next_view_++;
      views_.emplace(reply.lease, std::move(keeps));
    }
    srv_.metrics_.Hits(items.slots.size());
    srv_.metrics_.Misses(hashes.size() - items.slots.size());
    return Reply(wire::Encode(reply));
  }

  // PUT_LEASE: room in the host arena for each value, its record's header written; the client
  // writes the values in place and commits them with PUT_COMMIT (api/PROTOCOL.md).
  Reply PutLease(const wire::PutLeaseRequest& req) {
    wire::ShmViewReply reply;
    wire::ShmGetReply& items = reply.items;
    const size_t n = req.items.size();
    items.status.resize(n);
    auto all = [&](StatusCode code, const std::string& why) {
      for (wire::ItemStatus& st : items.status) st = {code, why};
    };
    // Record bytes of the request, each rounded to the arena's 4 KiB units: the quota's charge.
    uint64_t charge = 0;
    for (const wire::PutLeaseItem& it : req.items) charge += (BundleHeaderBytes(1) + it.bytes + 4095) & ~uint64_t{4095};
    PutLeaseState lease;
    if (!write_leases_) {
      all(StatusCode::kFailedPrecondition, "this session has no write leases: store with SHM_PUT or PUT");
    } else if (put_leases_.size() >= kMaxPutLeases) {
      all(StatusCode::kResourceExhausted, "this session holds the most write leases it may: commit them first");
    } else if (!srv_.ChargeLease(ns_, charge)) {
      srv_.metrics_.WriteLeaseRefused();
      all(StatusCode::kResourceExhausted,
          fmt::format("a write lease of {} bytes is past the namespace's quota ({} bytes leased now): store with "
                      "SHM_PUT or PUT",
                      charge, srv_.LeasedBytes(ns_)));
    } else {
      Server::Impl* srv = &srv_;
      const uint32_t ns = ns_;
      lease.charge = DaemonStore::Keep(nullptr, [srv, ns, charge](const void*) { srv->ReleaseLease(ns, charge); });
      lease.rooms.resize(n);
      for (size_t i = 0; i < n; ++i) {
        const wire::PutLeaseItem& it = req.items[i];
        if (it.bytes > srv_.options_.max_frame_bytes - 64) {  // as SHM_PUT: a GET reply could never carry it
          items.status[i] = {StatusCode::kInvalidArgument,
                             fmt::format("a bundle of {} bytes is larger than a reply may carry (max_frame_bytes {})",
                                         it.bytes, srv_.options_.max_frame_bytes)};
          continue;
        }
        Result<std::unique_ptr<DaemonStore::PutReservation>> room = srv_.store_->ReservePut(ns_, it.hash, it.bytes);
        if (!room.ok()) {
          items.status[i] = {room.status().code(), std::string(room.status().message())};
          continue;
        }
        items.slots.push_back({it.hash, (*room)->value_offset(), it.bytes});
        lease.rooms[i] = std::move(room).value();
        ++lease.open;
      }
    }
    if (lease.open > 0) {
      reply.lease = next_put_lease_++;
      lease.deadline = Clock::now() + std::chrono::milliseconds(srv_.options_.write_lease_timeout_ms);
      srv_.metrics_.WriteLeaseGiven(lease.open);
      put_leases_.emplace(reply.lease, std::move(lease));
    }
    return Reply(wire::Encode(reply));
  }

  // PUT_COMMIT: the leased items named are checked against their checksums and stored, on this
  // thread when small and the store need not wait for I/O, else on a worker. A lease ends when
  // its last item is committed.
  void PutCommit(const wire::FrameHeader& h, const wire::PutCommitRequest& req) {
    auto batch = std::make_shared<PutBatch>();
    batch->out.resize(req.checksums.size());
    std::vector<std::unique_ptr<DaemonStore::PutReservation>> rooms;
    std::vector<uint64_t> sums;
    auto it = put_leases_.find(req.lease);
    for (size_t k = 0; k < req.checksums.size(); ++k) {
      const uint64_t i = uint64_t{req.first} + k;
      if (it == put_leases_.end()) {
        batch->out[k] = {StatusCode::kNotFound,
                         fmt::format("write lease {} is not held by this session (committed, expired or never given)",
                                     req.lease)};
      } else if (i >= it->second.rooms.size() || !it->second.rooms[i]) {
        batch->out[k] = {StatusCode::kFailedPrecondition,
                         fmt::format("item {} of write lease {} is not leased (refused, or committed already)", i,
                                     req.lease)};
      } else {
        batch->bytes += it->second.rooms[i]->value_bytes();
        rooms.push_back(std::move(it->second.rooms[i]));
        sums.push_back(req.checksums[k]);
        batch->index.push_back(k);
        --it->second.open;
      }
    }
    // The lease's quota goes back with its last room (the rooms being committed are the store's now).
    if (it != put_leases_.end() && it->second.open == 0) put_leases_.erase(it);
    if (rooms.empty()) {
      QueueWrite(Reply(wire::Encode(wire::StatusListReply{std::move(batch->out)})).ToFrame(h.opcode, h.request_id));
      return;
    }
    const auto t0 = Clock::now();
    ++inflight_requests_;
    srv_.BeginAsyncCall();
    Server::Impl* srv = &srv_;
    // As TryPutHere's answer: it may come from a tier's thread, after the session is gone.
    auto done = [weak = weak_from_this(), srv, h, t0, batch](std::vector<wire::ItemStatus> stored) {
      batch->Answer(std::move(stored));
      for (const wire::ItemStatus& st : batch->out) {
        if (st.code == StatusCode::kCorruption) srv->metrics_.WriteLeaseTorn();
      }
      AnswerStore(weak, srv, h, t0, std::move(batch->out), /*put_gate=*/false);
    };
    const uint32_t ns = ns_;
    if (batch->bytes <= kPutHereBytes && srv_.store_->PutsWithoutBlocking()) {
      srv_.store_->CommitPuts(ns, std::move(rooms), std::move(sums), std::move(done));
      return;
    }
    auto job = std::make_shared<std::vector<std::unique_ptr<DaemonStore::PutReservation>>>(std::move(rooms));
    srv_.SubmitWork(id_, [srv, ns, job, sums = std::move(sums), done = std::move(done)]() mutable {
      srv->store_->CommitPuts(ns, std::move(*job), std::move(sums), std::move(done));
    });
  }

  // SHM_VIEW_END: unpins a lease's pages. NotFound for a lease this session does not hold.
  Reply EndView(std::span<const std::byte> p) {
    const uint64_t lease = *wire::DecodeLease(p);  // checked as the frame was decoded
    wire::StatusListReply r;
    r.items.resize(1);
    if (views_.erase(lease) == 0) {
      r.items[0] = {StatusCode::kNotFound, fmt::format("lease {} is not held by this session", lease)};
    }
    return Reply(wire::Encode(r));
  }

  // A bundle lent in place before its check (SHM_GET_OVERLAP): item, hash, and what keeps it.
  struct Unchecked {
    size_t item;
    wire::WireHash hash;
    DaemonStore::Keep keep;
  };

  // With `unchecked` (SHM_GET_OVERLAP), bundles are lent before their checksum is checked and
  // listed there for CheckLent; those copied into the GET area are checked before the copy.
  std::optional<Reply> FastShmGet(std::span<const wire::WireHash> hashes, std::vector<Unchecked>* unchecked) {
    if (staging_ == nullptr) return std::nullopt;
    return BuildShmGetReply(
        hashes,
        [&](const DaemonStore::GetSink& sink) {
          return srv_.store_->TryGetWithoutBlocking(ns_, hashes, sink, /*check=*/unchecked == nullptr);
        },
        lent_, lent_bytes_, unchecked);
  }

  // SHM_GET_OVERLAP: checks the bundles its reply lent unchecked on a worker, while the client
  // copies them on its own core, then sends the verdicts (api/PROTOCOL.md). The job holds the
  // bundles itself, so a client that moves on early cannot make the daemon read a page reused.
  void CheckLent(uint64_t request_id, size_t items, std::vector<Unchecked> unchecked) {
    auto send = [](const std::shared_ptr<Session>& self, uint64_t rid, const std::vector<uint8_t>& verdicts) {
      self->QueueWrite(wire::EncodeFrame(wire::Opcode::kShmVerdicts, wire::kFlagResponse, rid,
                                         wire::EncodeVerdicts(verdicts)));
    };
    if (unchecked.empty()) return send(shared_from_this(), request_id, std::vector<uint8_t>(items, 0));
    ++inflight_requests_;
    auto self = shared_from_this();
    srv_.SubmitWork(id_, [self, request_id, items, unchecked = std::move(unchecked), send]() mutable {
      std::vector<uint8_t> verdicts(items, 0);
      for (const Unchecked& u : unchecked) {
        if (!self->srv_.store_->Recheck(self->ns_, u.hash, u.keep).ok()) verdicts[u.item] = 1;
      }
      unchecked.clear();
      asio::post(self->strand_, [self, request_id, verdicts = std::move(verdicts), send]() {
        --self->inflight_requests_;
        send(self, request_id, verdicts);
        self->MaybeClose();  // a connection closing waited for this check
      });
    });
  }

  // A PUT's or SHM_PUT's items for the store, and the answers of those refused before it.
  struct PutBatch {
    std::vector<wire::PutItem> items;
    std::vector<size_t> index;  // request item of each of `items`
    std::vector<wire::ItemStatus> out;
    uint64_t bytes = 0;

    void Answer(std::vector<wire::ItemStatus> stored) {
      for (size_t k = 0; k < stored.size(); ++k) out[index[k]] = std::move(stored[k]);
    }
  };

  // Checks each SHM_PUT slot against the staging area's PUT half.
  PutBatch ShmPutItems(const wire::ShmPutRequest& req) const {
    const uint64_t put_area = staging_bytes_ / 2;
    PutBatch b;
    b.out.resize(req.slots.size());
    for (size_t i = 0; i < req.slots.size(); ++i) {
      const wire::ShmSlot& s = req.slots[i];
      if (s.offset > put_area || s.bytes > put_area - s.offset) {
        b.out[i] = {StatusCode::kOutOfRange,
                    fmt::format("slot [{}, +{}) is outside the {}-byte PUT area", s.offset, s.bytes, put_area)};
        continue;
      }
      if (s.bytes > srv_.options_.max_frame_bytes - 64) {  // a GET reply could never carry it
        b.out[i] = {StatusCode::kInvalidArgument,
                    fmt::format("a bundle of {} bytes is larger than a reply may carry (max_frame_bytes {})",
                                s.bytes, srv_.options_.max_frame_bytes)};
        continue;
      }
      b.items.push_back({s.hash, std::span<const std::byte>(staging_ + s.offset, s.bytes)});
      b.index.push_back(i);
      b.bytes += s.bytes;
    }
    return b;
  }

  Result<Reply> HandleShmPut(std::span<const std::byte> p) {
    if (staging_ == nullptr) return Status::FailedPrecondition("SHM_PUT on a session without shared memory");
    SPARSEKV_ASSIGN_OR_RETURN(wire::ShmPutRequest req, wire::DecodeShmPutRequest(p));
    PutBatch b = ShmPutItems(req);
    b.Answer(srv_.store_->Put(ns_, b.items));
    return wire::Encode(wire::StatusListReply{std::move(b.out)});
  }

  // An SHM_PUT of at most kPutHereBytes (a PUT of at most kDirectPutBytes) is stored from the
  // network thread when the store can take it without waiting for tier I/O: copying it into
  // host memory costs less than the two thread hops to a worker and back, which on two cores
  // were most of a 64 KiB PUT's time. Larger ones go to a worker, so that no connection holds
  // this thread long.
  // False: nothing was done, the caller dispatches the request to a worker.
  bool TryPutHere(const wire::FrameHeader& h, size_t payload_bytes, const Decoded& decoded) {
    PutBatch b;
    if (decoded.put) {
      if (payload_bytes > kDirectPutBytes) return false;
      b.items = decoded.put->items;
      b.out.resize(b.items.size());
      for (size_t i = 0; i < b.items.size(); ++i) b.index.push_back(i);
    } else {
      if (staging_ == nullptr) return false;  // the worker answers with the error
      b = ShmPutItems(*decoded.shm_put);
      if (b.bytes > kPutHereBytes) return false;
    }
    auto batch = std::make_shared<PutBatch>(std::move(b));
    const auto t0 = Clock::now();
    ++inflight_requests_;
    srv_.BeginAsyncCall();
    // The answer may come from a tier's thread, and copies of this callback may outlive the
    // call there: it holds the session weakly and the server by pointer, so that nothing it
    // leaves behind touches either once EndAsyncCall has let a shutdown go on.
    Server::Impl* srv = &srv_;
    const bool taken = srv_.store_->TryPutWithoutBlocking(
        ns_, batch->items,
        [weak = weak_from_this(), srv, h, t0, batch](std::vector<wire::ItemStatus> stored) {
          batch->items.clear();  // their bytes are the request's, gone by now
          batch->Answer(std::move(stored));
          AnswerStore(weak, srv, h, t0, std::move(batch->out), /*put_gate=*/true);
        });
    if (!taken) {
      --inflight_requests_;
      srv_.EndAsyncCall();
    } else {
      put_running_ = true;  // until the answer is queued (PutFinished); the callback may have run
    }
    return taken;
  }

  // Runs on a worker thread, from the request HandleFrame decoded.
  Result<Reply> HandleGetRanges(const wire::GetRangesRequest& req) {
    // Written as the store answers: u32 count, then per item its status and, when OK, a blob.
    wire::PayloadWriter w;
    w.Reserve(wire::GetRangesReplyBound(req));
    w.U32(static_cast<uint32_t>(req.items.size()));
    srv_.store_->GetRanges(ns_, req.items, [&](size_t, const Status& st, std::span<const std::byte> bytes) {
      if (st.ok()) {
        w.U8(0);
        w.Blob(bytes);
        return;
      }
      w.U8(static_cast<uint8_t>(st.code()));
      const std::string_view msg = st.message();
      w.String(msg.substr(0, wire::kMaxRangesMessageBytes));
    });
    return w.Take();
  }

  Result<Reply> HandleShmGet(std::span<const std::byte> p) {
    if (staging_ == nullptr) return Status::FailedPrecondition("SHM_GET on a session without shared memory");
    SPARSEKV_ASSIGN_OR_RETURN(wire::HashList req, wire::DecodeHashList(p));
    // On a worker: lent_ belongs to the strand, so what this reply lends is kept with it and
    // handed to the strand with the frame. The client's previous lends were let go when this
    // request was dispatched, so the reply may lend up to the GET half's size again.
    std::vector<DaemonStore::Keep> lent;
    uint64_t lent_bytes = 0;
    Reply r = *BuildShmGetReply(
        req.hashes,
        [&](const DaemonStore::GetSink& sink) {
          srv_.store_->GetInPlace(ns_, req.hashes, sink);
          return true;
        },
        lent, lent_bytes);
    r.lent = std::move(lent);
    r.lent_bytes = lent_bytes;
    return r;
  }

  // Answers with where each bundle lies: in the host arena, lent in place (the session maps it
  // and holds the page until its next SHM_GET), or copied into the GET half of the staging area.
  // What it lends goes into `lent` (keeps, pins) and `lent_bytes`: the session's own on its
  // strand, a worker's to hand over with the reply.
  template <typename Serve>
  std::optional<Reply> BuildShmGetReply(std::span<const wire::WireHash> hashes, Serve&& serve,
                                        std::vector<DaemonStore::Keep>& lent, uint64_t& lent_bytes,
                                        std::vector<Unchecked>* unchecked = nullptr) {
    const DaemonStore::Arena& arena = srv_.arena_;
    const uint64_t limit = staging_bytes_;
    uint64_t off = staging_bytes_ / 2;
    wire::ShmGetReply reply;
    reply.status.resize(hashes.size());
    uint64_t hits = 0;
    const bool served = serve([&](size_t i, const Status& st, std::span<const std::byte> bytes,
                                  const DaemonStore::Keep& keep) {
      if (!st.ok()) {
        reply.status[i] = {st.code(), std::string(st.message())};
        return;
      }
      if (lend_ && keep && InArena(bytes) && lent_bytes + bytes.size() <= staging_bytes_ / 2 &&
          srv_.PinsBelowCap(bytes.size())) {
        // Offsets at or past the staging area's size name the arena.
        reply.slots.push_back({hashes[i], staging_bytes_ + static_cast<uint64_t>(bytes.data() - arena.base),
                               static_cast<uint32_t>(bytes.size())});
        if (lend_table_) {
          // The token is taken now, while the record is pinned: a client reading it again later
          // compares it with the table (api/PROTOCOL.md, "Local reads").
          reply.lend.push_back(srv_.store_->Lend(ns_, hashes[i], keep));
        }
        lent.push_back(keep);
        lent.push_back(srv_.ChargePins(bytes.size()));
        lent_bytes += bytes.size();
        if (unchecked != nullptr) unchecked->push_back({i, hashes[i], keep});
        ++hits;
        return;
      }
      if (unchecked != nullptr) {  // handed out unchecked: checked before it is copied
        if (Status c = srv_.store_->Recheck(ns_, hashes[i], keep); !c.ok()) {
          reply.status[i] = {c.code(), std::string(c.message())};
          return;
        }
      }
      if (bytes.size() > limit - off) {
        reply.status[i] = {StatusCode::kResourceExhausted, "bundle does not fit the shared GET area; use GET"};
        return;
      }
      std::memcpy(staging_ + off, bytes.data(), bytes.size());
      reply.slots.push_back({hashes[i], off, static_cast<uint32_t>(bytes.size())});
      if (lend_table_) reply.lend.push_back({});  // a copy: not to be read again
      off += (bytes.size() + 63) & ~uint64_t{63};
      ++hits;
    });
    if (!served) return std::nullopt;
    srv_.metrics_.Hits(hits);
    srv_.metrics_.Misses(hashes.size() - hits);
    return Reply(wire::Encode(reply));
  }

  void Discard() {
    socket_.async_read_some(asio::buffer(discard_),
                            asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec, size_t) {
                              if (ec) {
                                self->reading_ = false;
                                return self->MaybeClose();
                              }
                              self->Discard();
                            }));
  }

  // Answers a malformed frame with an ERROR frame and closes. Returns false (stop reading).
  bool FailFrame(uint64_t request_id, const Status& st) {
    payload_.Reset();
    in_frame_ = false;
    srv_.metrics_.BadFrame();
    // Rate-limited: a client can open connections that each send a bad frame faster than a log
    // should grow (sparsekv_bad_frames_total counts them all).
    if (const uint64_t quiet = srv_.bad_frame_log_.Allow(); quiet != kLogSuppressed) {
      spdlog::warn("session {}: closing after a bad frame: {}{}", id_, st.ToString(),
                   quiet > 0 ? fmt::format(" ({} more bad frames not logged before this one)", quiet) : "");
    }
    closing_ = true;
    QueueWrite(ErrorFrame(request_id, st));
    MaybeClose();
    return false;
  }

  void QueueWrite(OutFrame frame) {
    // Once a write failed, or the peer was given up on, nothing more can reach it: a reply
    // finished meanwhile (by a worker) is dropped, and its bytes go back to the budget.
    if (closed_ || write_failed_) return;
    // Charged to the buffer budget while queued: what the frame owns, and bytes it sends from
    // elsewhere unless they are host pages (the pin budget counts those).
    uint64_t charge = frame.own.size();
    if (!frame.ext_pinned) {
      for (const OutFrame::Piece& p : frame.pieces) charge += p.ext.size();
    }
    frame.charge = Charge(&srv_.budget_, account_);
    frame.charge.Add(charge);
    queued_bytes_ += frame.size;
    writes_.push_back(std::move(frame));
    if (!writing_) DoWrite();
  }

  // Writes every queued frame, up to kMaxGather pieces, with one gathering write.
  void DoWrite() {
    if (writes_.empty()) {
      writing_ = false;
      PublishIdle();
      if (paused_ && !closing_) {
        paused_ = false;
        ReadHeader();
      }
      return MaybeClose();
    }
    static constexpr size_t kMaxGather = 64;
    writing_ = true;
    gather_.clear();
    size_t frames = 0;
    for (OutFrame& f : writes_) {
      if (frames > 0 && gather_.size() + f.pieces.size() > kMaxGather) break;
      if (f.finish) {
        // Its checks read what the frames before it sent: those must be written first.
        if (frames > 0) break;
        auto finish = std::move(f.finish);
        f.finish = nullptr;
        finish(f);
      }
      for (const auto& p : f.pieces) {
        const auto b = f.Bytes(p);
        gather_.emplace_back(b.data(), b.size());
      }
      ++frames;
    }
    write_started_ = Clock::now();
    asio::async_write(socket_, gather_, SendWhole(),
                      asio::bind_executor(strand_, [self = shared_from_this(), frames](boost::system::error_code ec,
                                                                                       size_t n) {
                        self->srv_.metrics_.BytesOut(n);
                        self->last_active_ = Clock::now();
                        for (size_t i = 0; i < frames; ++i) {
                          self->queued_bytes_ -= self->writes_.front().size;
                          self->writes_.pop_front();
                        }
                        if (ec) {
                          self->write_failed_ = true;
                          self->writes_.clear();
                          self->queued_bytes_ = 0;
                          self->closing_ = true;
                          self->writing_ = false;
                          return self->MaybeClose();
                        }
                        self->DoWrite();
                      }));
  }

  // Closes once nothing is being read, served or written. First a lingering close: FIN after the
  // last reply, then read and discard until the peer closes (at most 1 s), because closing a
  // socket with unread input sends a reset that can destroy the ERROR frame before it is read.
  void MaybeClose() {
    if (closed_ || !closing_ || reading_ || writing_ || inflight_requests_ > 0) return;
    if (!lingering_) {
      lingering_ = true;
      boost::system::error_code ignored;
      socket_.shutdown(GenericSocket::shutdown_send, ignored);
      reading_ = true;
      Discard();
      linger_.expires_after(std::chrono::seconds(1));
      linger_.async_wait(asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
        if (ec || self->closed_) return;
        boost::system::error_code ignored2;
        self->socket_.cancel(ignored2);
      }));
      return;
    }
    closed_ = true;
    linger_.cancel();
    tick_.cancel();
    srv_.budget_.ReturnPass(this);
    if (parked_ != Resume::kNone) {
      parked_ = Resume::kNone;
      account_->parked.store(false, std::memory_order_release);
    }
    payload_.Reset();
    if (subscription_) srv_.store_->Unsubscribe(subscription_);
    if (authed_) srv_.store_->EndSession(id_);  // its hints end with it
    boost::system::error_code ignored;
    socket_.close(ignored);
    srv_.OnSessionClosed(this);
  }

  Server::Impl& srv_;
  GenericSocket socket_;
  asio::strand<asio::io_context::executor_type> strand_;
  asio::steady_timer tick_;
  asio::steady_timer linger_;
  const bool is_unix_;
  const uint64_t id_;
  const Clock::time_point created_;
  std::shared_ptr<Account> account_ = std::make_shared<Account>();  // this connection's share of the budget
  std::atomic<int64_t> idle_since_{0};
  std::atomic<bool> called_{false};
  std::atomic<bool> in_park_list_{false};
  Resume parked_ = Resume::kNone;
  bool in_frame_ = false;           // a header was read and its payload is not all in
  bool write_failed_ = false;       // a write failed, or the write timeout struck
  size_t got_ = 0;                  // payload bytes in so far
  Clock::time_point frame_start_{}, write_started_{};
  Clock::time_point parked_at_{};  // when it last parked on the budget

  ReadBuffer rbuf_{&srv_.grown_rbuf_total_};  // received, not yet handled: [rpos_, rend_)
  size_t rpos_ = 0, rend_ = 0;
  Charge rbuf_charge_;     // the bytes of a grown rbuf_ written so far
  bool trimming_ = false;  // the read under way was cancelled to give a grown rbuf_ back
  Clock::time_point last_active_{};
  wire::FrameHeader header_;
  Payload payload_;
  std::deque<OutFrame> writes_;
  std::vector<asio::const_buffer> gather_;  // the write in progress
  uint64_t queued_bytes_ = 0;
  uint64_t inflight_bytes_ = 0;
  int inflight_requests_ = 0;
  bool reading_ = false, writing_ = false, paused_ = false, closing_ = false, closed_ = false;
  bool lingering_ = false;
  std::array<std::byte, 4096> discard_{};
  bool authed_ = false;
  uint32_t ns_ = 0;
  uint64_t subscription_ = 0;
  uint64_t event_seq_ = 1;
  int staging_fd_ = -1;
  std::byte* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  bool lend_ = false;                     // the client mapped the host arena
  std::vector<DaemonStore::Keep> lent_;  // what the last SHM_GET lent in place
  uint64_t lent_bytes_ = 0;
  // SHM_VIEW leases, each holding its pages pinned (and charged to the pin budget) until
  // SHM_VIEW_END or the session's end. A session holding one is never idle.
  static constexpr size_t kMaxViews = 4096;
  static constexpr uint64_t kMinViewCharge = 4096;  // pin budget bytes a lent value counts at least
  std::map<uint64_t, std::vector<DaemonStore::Keep>> views_;
  uint64_t next_view_ = 1;
  // Write leases (PUT_LEASE): per lease, the room of each item not yet committed (null once
  // committed or refused), the namespace quota it is charged to, and when it is taken back.
  // Dropping a lease (expiry, the session's end) frees its rooms: nothing of it is stored.
  static constexpr size_t kMaxPutLeases = 256;
  struct PutLeaseState {
    std::vector<std::unique_ptr<DaemonStore::PutReservation>> rooms;
    size_t open = 0;
    DaemonStore::Keep charge;  // the namespace's leased bytes, given back with the lease
    Clock::time_point deadline;
  };
  bool write_leases_ = false;
  bool lend_table_ = false;  // local reads: the lend table was passed, lends carry tokens
  std::map<uint64_t, PutLeaseState> put_leases_;
  // A connection's PUTs are stored one at a time, in the order they came: while one is under
  // way (put_running_), the next PUT frame is left unread (put_waiting_) until it is answered.
  // A client may send a batch's parts without waiting (client.cc, PutShared); two parts stored
  // at once could land in either order, and would hold a small host tier's room twice over.
  bool put_running_ = false, put_waiting_ = false;
  uint64_t next_put_lease_ = 1;
  std::unique_ptr<Room> room_;  // a large PUT's value being read into host memory (StartRoom)
};

void Server::Impl::Accept(asio::ip::tcp::acceptor& acceptor) {
  acceptor.async_accept([this, &acceptor](boost::system::error_code ec, asio::ip::tcp::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted) Accept(acceptor);
      return;
    }
    boost::system::error_code ignored;
    s.set_option(asio::ip::tcp::no_delay(true), ignored);
    Admit(GenericSocket(std::move(s)), false);
    Accept(acceptor);
  });
}

void Server::Impl::AcceptUnix() {
  unix_.acceptor()->async_accept([this](boost::system::error_code ec, asio::local::stream_protocol::socket s) {
    if (ec) {
      if (ec != asio::error::operation_aborted) AcceptUnix();
      return;
    }
    Admit(GenericSocket(std::move(s)), true);
    AcceptUnix();
  });
}

// A new connection. Before HELLO it counts against max_handshakes: at that limit the oldest
// handshake is closed to make room (a well-behaved client sends HELLO at once, so the oldest is
// the likeliest to be stuck). Sockets past twice every limit (connections still closing) are
// refused outright.
void Server::Impl::Admit(GenericSocket socket, bool is_unix) {
  auto s = std::make_shared<Session>(*this, std::move(socket), is_unix, next_session_.fetch_add(1));
  std::shared_ptr<Session> oldest;
  bool refuse = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (draining_) return;  // the socket closes with `s`
    const uint64_t hard = 2ull * (uint64_t{options_.max_connections} + options_.max_handshakes) + 16;
    if (sessions_.size() >= hard) {
      refuse = true;
      s->counted_ = Session::Counted::kNone;
    } else {
      if (handshaking_ >= std::max(1u, options_.max_handshakes)) {
        for (const auto& other : sessions_) {
          if (other->counted_ == Session::Counted::kHandshake && (!oldest || other->created() < oldest->created())) {
            oldest = other;
          }
        }
        if (oldest) {
          oldest->counted_ = Session::Counted::kNone;
          --handshaking_;
        }
      }
      ++handshaking_;
    }
    sessions_.insert(s);
  }
  metrics_.ConnectionOpened();
  if (refuse) {
    metrics_.ConnectionRejected();
    s->Refuse(Status::ResourceExhausted(
        fmt::format("sparsekvd has too many connections open or closing (limit {})", options_.max_connections)));
    return;
  }
  if (oldest) {
    metrics_.HandshakeTimedOut();
    oldest->CloseWithError(Status::ResourceExhausted(fmt::format(
        "closed: {} connections had not finished HELLO and this was the oldest", options_.max_handshakes)));
  }
  s->Start();
}

Status Server::Impl::AdmitAuthenticated(Session* s, uint32_t ns) {
  std::shared_ptr<Session> victim;
  std::string why;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (s->counted_ != Session::Counted::kHandshake) {
      return Status::Aborted("the connection was closed while it said HELLO");
    }
    const NamespaceConfig& nc = options_.namespaces[ns - 1];
    if (nc.max_connections > 0 && namespace_conns_[ns] >= nc.max_connections) {
      victim = LongestIdle(ns, s);
      if (!victim) {
        return Status::ResourceExhausted(fmt::format(
            "namespace '{}' has its {} connections and none is idle; try again later", nc.name, nc.max_connections));
      }
      why = fmt::format("closed to admit a new connection: namespace '{}' has at most {} and this one was idle the "
                        "longest{}",
                        nc.name, nc.max_connections, victim->called() ? "" : " of those that made no call since HELLO");
    } else if (authenticated_ + resp_conns_ >= options_.max_connections) {
      victim = LongestIdle(0, s);
      if (!victim) {
        return Status::ResourceExhausted(fmt::format(
            "sparsekvd serves at most {} connections and none is idle; try again later", options_.max_connections));
      }
      why = fmt::format("closed to admit a new connection: sparsekvd serves at most {} and this one was idle the "
                        "longest{}",
                        options_.max_connections, victim->called() ? "" : " of those that made no call since HELLO");
    }
    if (victim) {
      --authenticated_;
      --namespace_conns_[victim->counted_ns_];
      victim->counted_ = Session::Counted::kNone;
    }
    --handshaking_;
    ++authenticated_;
    ++namespace_conns_[ns];
    s->counted_ = Session::Counted::kAuthenticated;
    s->counted_ns_ = ns;
  }
  if (victim) {
    metrics_.IdleConnectionReplaced();
    spdlog::info("{}", why);
    victim->CloseWithError(Status::ResourceExhausted(why));
  }
  return Status::OK();
}

std::shared_ptr<Session> Server::Impl::LongestIdle(uint32_t ns, const Session* except) {
  // A connection that has made no call since its HELLO goes first: a flood of connections that
  // only say HELLO then displaces its own, not a client at work whose thread was descheduled
  // for a moment (under a flood of a connection every few milliseconds, a working client that
  // waited 0.1 s between calls was once the idlest, and lost a call to a broken pipe).
  std::shared_ptr<Session> best;
  int64_t best_since = 0;
  bool best_called = true;
  for (const auto& other : sessions_) {
    if (other.get() == except || other->counted_ != Session::Counted::kAuthenticated) continue;
    if (ns != 0 && other->counted_ns_ != ns) continue;
    const int64_t since = other->idle_since();
    if (since == 0) continue;  // busy
    const bool called = other->called();
    if (!best || (!called && best_called) || (called == best_called && since < best_since)) {
      best = other;
      best_since = since;
      best_called = called;
    }
  }
  return best;
}

void Server::Impl::Park(std::weak_ptr<Session> s, std::atomic<bool>& listed) {
  if (listed.exchange(true, std::memory_order_acq_rel)) return;  // listed already
  std::lock_guard<std::mutex> l(park_mu_);
  parked_.emplace_back(std::move(s), &listed);
  budget_.waiters_.store(static_cast<int>(parked_.size()), std::memory_order_release);
}

// Every parked connection looks again (posted to its strand); those that still find no room
// park again.
void Server::Impl::WakeParked() {
  std::vector<std::pair<std::weak_ptr<Session>, std::atomic<bool>*>> woken;
  {
    std::lock_guard<std::mutex> l(park_mu_);
    woken.swap(parked_);
    budget_.waiters_.store(0, std::memory_order_release);
  }
  for (auto& [weak, listed] : woken) {
    if (auto s = weak.lock()) {
      listed->store(false, std::memory_order_release);
      s->ResumeFromPark();
    }
  }
}

void Server::Impl::Shutdown() {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (draining_) return;
    draining_ = true;
    sessions.assign(sessions_.begin(), sessions_.end());
  }
  asio::post(control_, [this] {
    boost::system::error_code ignored;
    if (tcp_) tcp_->close(ignored);
    unix_.Release();
    if (unix_.acceptor()) unix_.acceptor()->close(ignored);
    if (metrics_acceptor_) metrics_acceptor_->close(ignored);
    signals_.cancel(ignored);
    std::lock_guard<std::mutex> l(mu_);  // FinishIfDrained's handler cancels it from another thread
    if (stopped_) return;
    drain_deadline_ = std::make_unique<asio::steady_timer>(io_, std::chrono::seconds(10));
    drain_deadline_->async_wait(asio::bind_executor(control_, [this](boost::system::error_code ec) {
      if (ec) return;
      spdlog::warn("drain deadline passed with connections still open; stopping");
      std::lock_guard<std::mutex> l(mu_);
      sessions_.clear();
      if (resp_) resp_->CloseAll();
      FinishIfDrained();
    }));
  });
  for (auto& s : sessions) s->BeginDrain();
  if (resp_) resp_->BeginDrain();
  std::lock_guard<std::mutex> l(mu_);
  FinishIfDrained();
}

void Server::Impl::OnSessionClosed(Session* s) {
  metrics_.ConnectionClosed();
  std::lock_guard<std::mutex> l(mu_);
  if (s->counted_ == Session::Counted::kHandshake) {
    --handshaking_;
  } else if (s->counted_ == Session::Counted::kAuthenticated) {
    --authenticated_;
    --namespace_conns_[s->counted_ns_];
  }
  s->counted_ = Session::Counted::kNone;
  for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
    if (it->get() == s) {
      // The session may be running its last handler: release it after that returns.
      asio::post(io_, [keep = *it] {});
      sessions_.erase(it);
      break;
    }
  }
  FinishIfDrained();
}

}  // namespace sparsekv::server
