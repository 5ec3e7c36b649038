// Client: one connection to sparsekvd (api/PROTOCOL.md), over TCP or a Unix socket.
//
// Every call has a synchronous form and an asynchronous form returning a std::future;
// asynchronous requests pipeline on the one connection and are matched to their responses by
// request id. Over a Unix socket with `shared_memory`, the client maps a staging area of its
// own session, passed by the daemon with SCM_RIGHTS: PUT and GET then move only metadata over
// the socket and bundle bytes through shared memory (a bundle larger than half the area falls
// back to the socket).
//
// Replies are read by the thread that needs them: a synchronous call reads the socket itself
// (handing other callers' replies to them), which saves a thread handoff per call. Futures and
// event subscriptions start one reader thread per client, which then reads every reply;
// callback requests are completed by ProcessReplies, called from the caller's event loop.
//
// Thread safety: all methods are thread-safe. Callbacks and event callbacks run on the thread
// that reads the reply and must not block.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

// A 128-bit block hash as bytes on the wire (see block_hash.h for how hashes are made).
using WireBlockHash = std::array<std::byte, 16>;

struct ClientOptions {
  // "HOST:PORT" for TCP or "unix:PATH" for the Unix socket. Default: "127.0.0.1:7420".
  std::string address = "127.0.0.1:7420";
  // Namespace to open and its access token. Default: "default", "".
  std::string namespace_name = "default";
  std::string token;
  // Name the daemon logs for this client. Default: "sparsekv-client".
  std::string client_name = "sparsekv-client";
  // Unix socket only: move bundles through a shared staging area. Default: true.
  bool shared_memory = true;
  // With shared memory and a daemon that lends its host arena: PUTs are written straight into
  // the arena under a write lease (one copy, api/PROTOCOL.md), else through the staging area.
  // Default: true.
  bool write_leases = true;
  // With shared memory and a daemon that lends its host arena and serves local reads: a
  // GetInto of a value lent to this client before copies it straight from the arena without
  // asking, as long as the daemon's lend table shows the record unchanged (api/PROTOCOL.md,
  // "Local reads"); such reads are reported to the daemon afterwards, at most once per
  // millisecond (TOUCH). Default: true.
  bool local_reads = true;
  // Limit for connecting and for each synchronous call. Default: 30 s.
  std::chrono::milliseconds timeout{30000};
  // A synchronous call whose reply has not arrived yet polls the socket without sleeping for up
  // to this long before it waits in poll(2): on a VM each sleep and wakeup costs tens of
  // microseconds, which is most of a small batch's time (api/PROTOCOL.md, "What a GET costs").
  // It burns that much CPU per call, so leave it at 0 where many clients share few cores.
  // Default: 0.
  std::chrono::microseconds spin{0};
};

enum class BlockTier : uint8_t { kAbsent = 0, kHost = 1, kSsd = 2, kRocksDb = 3, kRemote = 4 };

struct LookupResult {
  uint32_t prefix_blocks = 0;      // resumable prefix length, in blocks
  std::vector<BlockTier> tiers;    // one per hash asked about
};

struct BundleRef {
  WireBlockHash hash{};
  std::span<const std::byte> bytes;
};

// A value given in pieces: its bytes are the pieces' concatenation (a block's page in each of
// an engine's layer tensors, say). Client::PutPieces gathers them as it writes the value out.
struct PiecesRef {
  WireBlockHash hash{};
  std::span<const std::span<const std::byte>> pieces;
};

struct GetResult {
  Status status;                   // NotFound, Corruption, ... per item
  std::vector<std::byte> bytes;    // the bundle when status is OK
};

// A GET into the caller's memory (Client::GetInto): per item its outcome and the value's size.
//   OK           the value's `bytes` bytes are at the start of the item's destination;
//   OutOfRange   the value (`bytes` long) is larger than the destination, which is untouched;
//   NotFound, Corruption (the bytes failed their check; the destination may hold some of
//   them), and the other per-item errors of Get. With local reads, an item whose local copy
//   was dropped (its record changed meanwhile) and that the daemon then answers with an error
//   may have had its destination written: only an OK item's destination is defined.
struct GetIntoResult {
  Status status;
  uint64_t bytes = 0;
};

// Values read in place (Client::GetViews): each item's bytes, lent from the daemon's host
// arena (mapped read-only, checked against their record's checksum as the daemon read them, the
// pages pinned) where it could, else a copy held here. The pins are the daemon's: they count
// against its pin budget (a quarter of the host tier, shared by all clients) until the views are
// released, by Release() or the destructor. Release them promptly: a lent page is neither evicted
// nor reused while held. Move-only. The Client may be destroyed first: its connection then stays
// open, doing nothing else, until the last views are released.
class ValueViews {
 public:
  ValueViews();
  ~ValueViews();
  ValueViews(ValueViews&&) noexcept;
  ValueViews& operator=(ValueViews&&) noexcept;
  ValueViews(const ValueViews&) = delete;
  ValueViews& operator=(const ValueViews&) = delete;

  size_t size() const;
  // OK, NotFound, Corruption, ... as for Get.
  const Status& status(size_t i) const;
  // The value when status(i) is OK; valid until Release.
  std::span<const std::byte> bytes(size_t i) const;
  // Whether bytes(i) lies in the daemon's arena (no copy was made).
  bool lent(size_t i) const;
  // Total bytes lent in place.
  uint64_t lent_bytes() const;
  // Gives the pins back (without waiting for the daemon's answer); bytes() is empty afterwards.
  void Release();

  struct State;

 private:
  friend class Client;
  std::unique_ptr<State> state_;
};

// GET_RANGES: byte ranges of one stored value (the bytes a PUT stored), read without the rest.
struct ValueRange {
  uint64_t offset = 0;
  uint32_t bytes = 0;
};
struct RangesRequest {
  WireBlockHash hash{};
  std::vector<ValueRange> ranges;
};

struct EventNotice {
  uint8_t type = 0;                // 1 stored, 2 removed, 3 all cleared
  BlockTier tier = BlockTier::kAbsent;
  uint64_t sequence = 0;
  std::vector<WireBlockHash> hashes;
};
using EventCallback = std::function<void(const EventNotice&)>;

class Client {
 public:
  // Connects and says HELLO. Errors: bad address, refused, PermissionDenied (namespace/token).
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  Result<LookupResult> Lookup(std::span<const WireBlockHash> hashes);
  Result<std::vector<Status>> Put(std::span<const BundleRef> bundles);
  // Put of values given in pieces, each gathered straight into the shared-memory staging area
  // or its write lease (no buffer of the whole value on those paths; over a socket a value of
  // several pieces is gathered into one first). Results as Put's.
  Result<std::vector<Status>> PutPieces(std::span<const PiecesRef> values);
  Result<std::vector<GetResult>> Get(std::span<const WireBlockHash> hashes);
  // Get into `results` (resized to hashes.size()), reusing each item's buffer: a value of the
  // size the buffer had costs no allocation and no first touch of fresh pages. Same outcomes.
  Status Get(std::span<const WireBlockHash> hashes, std::vector<GetResult>& results);
  // GET into the caller's memory: item i's value lands at destinations[i] (see GetIntoResult),
  // with one copy and no allocation per value: over shared memory straight out of the daemon's
  // arena (or its copy in the GET area), over a socket received straight into the destination.
  // Requests are cut to fit the staging area or the largest frame by the destinations' sizes,
  // and pipelined over a socket. Errors (of the whole call): InvalidArgument when the counts
  // differ; a broken connection or a timeout, after which the destinations hold what arrived.
  Result<std::vector<GetIntoResult>> GetInto(std::span<const WireBlockHash> hashes,
                                             std::span<const std::span<std::byte>> destinations);
  // Zero-copy reads (api/PROTOCOL.md, SHM_VIEW): the values lent in place where the daemon can
  // (a Unix socket with shared memory, a one-namespace daemon, the value in host memory, room in
  // the pin budget), copies otherwise. For consumers that read the bytes once.
  Result<ValueViews> GetViews(std::span<const WireBlockHash> hashes);
  // Per item, its ranges' bytes back to back, in order (api/PROTOCOL.md, GET_RANGES). The
  // daemon does not check a value's checksum for this (it would read all of it): check what
  // the ranges carry (sparse records carry a checksum per entry). Items are sent in as many
  // requests as the daemon's maximum payload needs. Per item: NotFound, InvalidArgument (no
  // range, a range of 0 bytes, reaching past 2^64 or past the value's end, an item whose
  // request or reply alone could exceed the maximum payload), IOError.
  Result<std::vector<GetResult>> GetRanges(std::span<const RangesRequest> items);
  Result<std::vector<Status>> Pin(std::span<const WireBlockHash> hashes, uint8_t priority);
  Result<std::vector<Status>> Unpin(std::span<const WireBlockHash> hashes);
  Result<std::vector<Status>> Delete(std::span<const WireBlockHash> hashes);
  // HINT (api/PROTOCOL.md): the blocks `hashes` will be read soon. The daemon's tiers evict them
  // last (within each tier's hint bound) and bring those held only below host memory up into
  // it, until `ttl` passes, DropHint, or this connection closes. Errors: InvalidArgument (a time
  // to live under 1 ms or above the daemon's max_hint_ttl_ms), ResourceExhausted (the session
  // would hint more than max_hinted_blocks_per_session blocks at once).
  struct HintResult {
    uint64_t hint = 0;         // for DropHint
    uint32_t found = 0;        // blocks some tier holds
    uint32_t in_memory = 0;    // of those, in host memory
    uint32_t prefetching = 0;  // held only below it, being brought up
  };
  Result<HintResult> Hint(std::span<const WireBlockHash> hashes, std::chrono::milliseconds ttl);
  // NotFound when this connection holds no such hint (dropped or expired).
  Status DropHint(uint64_t hint);

  // The namespace's request log in the daemon (request_log.h; api/PROTOCOL.md, LOG_*).
  // LogAppend returns once the tokens are durable; FailedPrecondition when they do not continue
  // the request or it is finished; NotSupported when the daemon keeps no log.
  Status LogAppend(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens);
  Status LogSuspended(uint64_t request, uint64_t state_tokens, const WireBlockHash& tail, uint64_t tag = 0);
  Status LogFinish(uint64_t request);
  struct LoggedRequest {
    uint64_t id = 0;
    std::vector<int32_t> tokens;  // every acknowledged token
    bool suspended = false;
    uint64_t state_tokens = 0;
    WireBlockHash tail{};
    uint64_t tag = 0;
  };
  // Every unfinished request of the namespace, by id.
  Result<std::vector<LoggedRequest>> LogRecover();
  Result<std::string> Stats();  // JSON
  Status Ping();
  // Starts event delivery to `callback` (on the reader thread).
  Status Subscribe(EventCallback callback);

  // Futures: a reader thread, started by the first of these (or by Subscribe), reads every
  // reply from then on and completes the futures (a GET's after asking for what the daemon
  // deferred), so wait_for and wait_until work and get() can be called on any thread. A
  // Client destroyed or disconnected with futures outstanding completes them with its error.
  //
  // Every GET returns all its items: a reply never exceeds the daemon's maximum frame
  // (max_payload_bytes()), so the items it defers are asked for again, transparently. A
  // synchronous PUT over the socket is split into frames within that maximum too, and a value
  // too large for any frame is answered ResourceExhausted without being sent; PutAsync sends
  // one frame, and refuses (ResourceExhausted, nothing sent) a batch larger than the maximum.
  std::future<Result<LookupResult>> LookupAsync(std::vector<WireBlockHash> hashes);
  std::future<Result<std::vector<Status>>> PutAsync(std::vector<BundleRef> bundles);
  std::future<Result<std::vector<GetResult>>> GetAsync(std::vector<WireBlockHash> hashes);

  // Callbacks, for event loops: the request is sent before the call returns (PUT bytes are
  // copied or sent, so `bundles` may be reused at once) and `done` runs on whichever thread
  // reads the reply: ProcessReplies, a synchronous call on another thread, or the reader
  // thread once futures or events started it. A connection failure reaches `done` as its
  // status, and so does the Client's destruction (Unavailable, on the destroying thread). Over shared memory one callback GET and one callback PUT use the staging area at a
  // time; a second one in flight goes over the socket.
  using GetCallback = std::function<void(Result<std::vector<GetResult>>)>;
  using StatusesCallback = std::function<void(Result<std::vector<Status>>)>;
  void GetAsync(std::vector<WireBlockHash> hashes, GetCallback done);
  void PutAsync(std::span<const BundleRef> bundles, StatusesCallback done);
  // The socket, for an event loop to watch for input (poll/epoll; do not read it).
  int native_handle() const;
  // Handles every reply that has arrived, running callbacks, without waiting for more (a frame
  // already begun is read to its end). Returns how many frames were handled; 0 also when
  // another thread is reading. Errors: the connection broke.
  Result<size_t> ProcessReplies();

  bool shared_memory() const;
  // The daemon lends GETs in place from its host arena, mapped read-only (a one-namespace daemon).
  bool shared_arena() const;
  // PUTs are written straight into the host arena under write leases (asked for with
  // ClientOptions::write_leases and granted by a daemon with `write_leases` on).
  bool write_leases() const;
  // GetInto items answered from the arena without asking the daemon (local reads), so far.
  uint64_t local_reads() const;
  uint64_t session_id() const;
  uint32_t block_tokens() const;
  uint32_t max_payload_bytes() const;

  class Impl;

 private:
  explicit Client(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with the ValueViews still held
};

}  // namespace sparsekv
