// sparsekv's wire protocol (see api/PROTOCOL.md): length-prefixed frames with a fixed 32-byte
// header that carries its own checksum, and little-endian payloads decoded with bounds checks.
//
// Everything here is a pure function over byte spans: no I/O, no allocation beyond the
// decoded values. Decoders never trust a length they have not checked against the bytes they
// hold, and every error names the field at fault. Thread-safe.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <sys/types.h>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::wire {

inline constexpr uint32_t kMagic = 0x31564B53;  // bytes "SKV1"
// 2: GET replies end with verdict bytes; the HELLO reply ends with the arena size.
// 3: a GET reply never exceeds the announced maximum payload; items past it are deferred
//    (kDeferredCode) and asked for again.
inline constexpr uint16_t kProtocolVersion = 3;
inline constexpr size_t kHeaderBytes = 32;
// Upper bound any side accepts; a server configures a lower one. 64 MiB.
inline constexpr uint32_t kMaxPayloadBytes = 64u << 20;

enum class Opcode : uint16_t {
  kHello = 1,       // open a session in a namespace
  kLookup = 2,      // block hashes -> resumable prefix length and tier of each block
  kPut = 3,         // store bundles
  kGet = 4,         // fetch bundles
  kPin = 5,         // keep blocks resident, with a priority
  kUnpin = 6,
  kDelete = 7,
  kStats = 8,       // JSON statistics of the namespace
  kSubscribe = 9,   // start receiving kEvent frames
  kEvent = 10,      // server -> client: KV events
  kError = 11,      // server -> client: the request failed; payload is an ErrorReply
  kShmPut = 12,     // shared-memory path: bundles the client wrote into its staging area
  kShmGet = 13,     // shared-memory path: bundles copied into the staging area, offsets returned
  kShmRelease = 14, // reserved; answered OK per item
  kPing = 15,
  kGetRanges = 16,  // chosen byte ranges of stored values (entry-granular reads)
  kShmView = 17,    // shared-memory path: bundles lent in place under a lease the client ends
  kShmViewEnd = 18, // ends a SHM_VIEW lease: its pages are unpinned
  kShmGetOverlap = 19,  // SHM_GET whose lent bundles are checked while the client copies them
  kShmVerdicts = 20,    // server -> client: the checks of a SHM_GET_OVERLAP, after its reply
  kHint = 21,           // blocks a scheduler will read soon: protected from eviction a while
  kHintDrop = 22,       // ends a HINT before its time to live
  kLogAppend = 23,      // request log: a request's next tokens, acknowledged once durable
  kLogSuspended = 24,   // request log: a request was suspended at a state (its tail record's key)
  kLogFinish = 25,      // request log: a request is done; its records become garbage
  kLogRecover = 26,     // request log: every unfinished request of the namespace
  kPutLease = 27,       // write lease: room in the host arena for values the client writes in place
  kPutCommit = 28,      // write lease: the client's checksums of leased values; checked, then stored
  kTouch = 29,          // local reads: values the client read from the arena itself; no reply
};
inline constexpr uint16_t kMaxOpcode = 29;
std::string_view OpcodeName(Opcode op);

// Header flags.
inline constexpr uint16_t kFlagResponse = 1u << 0;
inline constexpr uint16_t kFlagPayloadChecksum = 1u << 1;  // payload_checksum is set
inline constexpr uint16_t kKnownFlags = kFlagResponse | kFlagPayloadChecksum;

struct FrameHeader {
  Opcode opcode = Opcode::kPing;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t payload_bytes = 0;
  uint32_t payload_checksum = 0;  // XXH32 of the payload when kFlagPayloadChecksum
};

// Layout (little-endian): magic u32 | version u16 | opcode u16 | flags u16 | reserved u16 (0) |
// request_id u64 | payload_bytes u32 | payload_checksum u32 | header_checksum u32, the last being
// XXH32 (seed 0) of the 28 bytes before it.
std::array<std::byte, kHeaderBytes> EncodeHeader(const FrameHeader& header);
// Errors: bad magic, unsupported version, checksum mismatch, unknown opcode or flags, a
// non-zero reserved field, payload larger than `max_payload_bytes`.
Result<FrameHeader> DecodeHeader(std::span<const std::byte> bytes, uint32_t max_payload_bytes);
uint32_t PayloadChecksum(std::span<const std::byte> payload);
// The checksum of the pieces' concatenation, without concatenating them.
uint32_t PayloadChecksum(std::span<const std::span<const std::byte>> pieces);
// Checks the payload against the header's checksum when the header carries one.
Status VerifyPayload(const FrameHeader& header, std::span<const std::byte> payload);

// A whole frame: header then payload, with the payload checksum set.
std::vector<std::byte> EncodeFrame(Opcode op, uint16_t flags, uint64_t request_id,
                                   std::span<const std::byte> payload);
// The header of a frame whose payload is the pieces' concatenation, checksum set: a sender
// writes it and then the pieces where they lie (one gathered send, no copy).
std::array<std::byte, kHeaderBytes> EncodeFrameHeader(Opcode op, uint16_t flags, uint64_t request_id,
                                                      std::span<const std::span<const std::byte>> pieces);

// ---- payload primitives ----

class PayloadWriter {
 public:
  PayloadWriter() = default;
  // Starts with kHeaderBytes zero bytes, for a header filled in later.
  struct ReserveHeader {};
  explicit PayloadWriter(ReserveHeader) : out_(kHeaderBytes) {}
  // Room for `more` bytes; grows geometrically, so that reserving before each of many appends
  // costs amortized O(1) per byte, not a copy of everything so far each time.
  void Reserve(size_t more) {
    if (out_.capacity() < out_.size() + more) out_.reserve(std::max(out_.size() + more, out_.capacity() * 2));
  }
  void U8(uint8_t v) { Raw(&v, 1); }
  void U16(uint16_t v) { Raw(&v, 2); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Bytes(std::span<const std::byte> b) { Raw(b.data(), b.size()); }
  // u32 length, then the bytes.
  void Blob(std::span<const std::byte> b);
  void String(std::string_view s);
  std::vector<std::byte>& bytes() { return out_; }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  void Raw(const void* p, size_t n);
  std::vector<std::byte> out_;
};

class PayloadReader {
 public:
  explicit PayloadReader(std::span<const std::byte> in) : in_(in) {}
  // Each returns an error naming `field` when the bytes run out.
  Result<uint8_t> U8(const char* field);
  Result<uint16_t> U16(const char* field);
  Result<uint32_t> U32(const char* field);
  Result<uint64_t> U64(const char* field);
  Result<std::span<const std::byte>> Bytes(size_t n, const char* field);
  Result<std::span<const std::byte>> Blob(const char* field, uint32_t max_bytes);
  Result<std::string> String(const char* field, uint32_t max_bytes);
  // A count of items of at least `min_item_bytes` each: refused if the rest cannot hold them.
  Result<uint32_t> Count(const char* field, uint32_t max_items, size_t min_item_bytes);
  // Error when bytes are left over.
  Status Finish(const char* message) const;
  size_t remaining() const { return in_.size() - pos_; }
  // The next byte without consuming it; -1 at the end.
  int Peek() const { return pos_ < in_.size() ? static_cast<int>(in_[pos_]) : -1; }

 private:
  Status Short(const char* field, size_t need) const;
  std::span<const std::byte> in_;
  size_t pos_ = 0;
};

// ---- messages ----

using WireHash = std::array<std::byte, 16>;  // a 128-bit block hash
inline constexpr uint32_t kMaxBatchItems = 65536;
inline constexpr uint32_t kMaxNameBytes = 256;

struct HelloRequest {
  uint16_t protocol_version = kProtocolVersion;
  std::string namespace_name;
  std::string token;
  std::string client_name;
  bool want_shared_memory = false;  // Unix socket only: the reply carries a staging memfd
  // With want_shared_memory: also write leases (PUT_LEASE); sent as bit 1 of the flag byte.
  bool want_write_leases = false;
  // With want_shared_memory: also the lend table, for local reads; sent as bit 2.
  bool want_lend_table = false;
};
struct HelloReply {
  uint64_t session_id = 0;
  uint32_t max_payload_bytes = 0;
  uint32_t block_tokens = 0;
  uint64_t shm_staging_bytes = 0;  // size of the staging memfd passed with SCM_RIGHTS; 0: none
  std::string server_version;
  uint64_t shm_arena_bytes = 0;    // size of the host arena's read-only memfd passed after it; 0: none
  // Only in replies to a HELLO that asked for write leases (a trailing u8): 1 when they are
  // served, the arena's memfd then being passed writable.
  std::optional<bool> write_leases = std::nullopt;
  // Only in replies to a HELLO that asked for the lend table (then after the write-lease byte,
  // which such a reply always carries): 0 not granted; 1 granted, no client can write the arena
  // (a lent record stays as checked); 2 granted, clients can write it (write leases): check a
  // local read against the record's checksum. The table's memfd is passed after the arena's.
  std::optional<uint8_t> lend_table = std::nullopt;
};

struct HashList {  // LOOKUP, GET, UNPIN, DELETE, SHM_GET requests
  std::vector<WireHash> hashes;
};

struct LookupReply {
  uint32_t prefix_blocks = 0;   // length of the resumable prefix, in blocks
  std::vector<uint8_t> tiers;   // per hash: 0 absent, 1 host memory, 2 SSD, 3 RocksDB
};

struct PinRequest {
  std::vector<WireHash> hashes;
  uint8_t priority = 0;  // higher outlives lower
};

struct HintRequest {
  uint32_t ttl_ms = 0;  // how long the hint lives, from 1 ms to the server's maximum
  std::vector<WireHash> hashes;
};
struct HintReply {
  uint64_t hint = 0;        // the hint's id, for HINT_DROP
  uint32_t found = 0;       // hashes some tier holds now
  uint32_t in_memory = 0;   // of those, held in the first tier (host memory)
  uint32_t prefetching = 0; // held only below it, being brought up into it now
};

struct PutItem {
  WireHash hash{};
  std::span<const std::byte> bundle;  // a view into the frame's payload
};
struct PutRequest {
  std::vector<PutItem> items;
};

// Per-item outcome: a StatusCode and, when not OK, a message.
// The request log (api/include/sparsekv/request_log.h) through the daemon, one per namespace.
struct LogAppendRequest {
  uint64_t request = 0;
  uint64_t first_token = 0;
  std::vector<int32_t> tokens;
};
struct LogSuspendedRequest {
  uint64_t request = 0;
  uint64_t tokens = 0;  // the state's tokens
  WireHash tail{};      // the tail record's key
  uint64_t tag = 0;
};
struct LogRequestState {
  uint64_t request = 0;
  std::vector<int32_t> tokens;  // every acknowledged token
  bool suspended = false;
  uint64_t state_tokens = 0;  // when suspended
  WireHash tail{};
  uint64_t tag = 0;
};
struct LogRecoverReply {
  std::vector<LogRequestState> requests;
};
// Tokens in one LOG_APPEND at most (a 64 MiB payload holds more; this bounds a request).
inline constexpr uint32_t kMaxLogAppendTokens = 1u << 20;

struct ItemStatus {
  StatusCode code = StatusCode::kOk;
  std::string message;
};
struct StatusListReply {  // PUT, PIN, UNPIN, DELETE, SHM_PUT, SHM_RELEASE replies
  std::vector<ItemStatus> items;
};

// A GET reply item's status code meaning "not answered in this reply, which reached the
// announced maximum payload: ask again". No message follows it. GET replies only.
inline constexpr uint8_t kDeferredCode = 255;

struct GetItem {
  ItemStatus status;
  std::span<const std::byte> bundle;  // empty unless OK
  // The verdict byte that ends the reply (api/PROTOCOL.md): 0 when the bundle's bytes were
  // checked against their stored record, 1 when they failed. Decoding turns a failed item's
  // status into Corruption and drops its bytes.
  uint8_t verdict = 0;
  // Not answered here (kDeferredCode on the wire); `status` is then OK and `bundle` empty.
  bool deferred = false;
};
struct GetReply {
  std::vector<GetItem> items;
};

struct ShmSlot {
  WireHash hash{};
  uint64_t offset = 0;  // into the staging area
  uint32_t bytes = 0;
};
struct ShmPutRequest {  // bundles the client wrote at offsets it was given by SHM_GET/alloc
  std::vector<ShmSlot> slots;
};
// What a client needs to read a lent record again without asking (api/PROTOCOL.md, "Local
// reads"): sent only to sessions granted the lend table, one per slot.
struct LendInfo {
  uint32_t token = 0;          // the record's lend-table entry + 1 when lent; 0: do not read again
  uint64_t record_offset = 0;  // of the record's first byte (its header) in the arena; 4 KiB aligned
  uint64_t checksum = 0;       // the record's checksum (bundle.h), from the daemon's own metadata
};
struct ShmGetReply {
  std::vector<ItemStatus> status;
  std::vector<ShmSlot> slots;  // one per OK item, in order
  std::vector<LendInfo> lend;  // empty, or one per slot (after the items on the wire)
};

// SHM_VIEW's reply: a lease (0 when nothing was lent) and where each lent bundle lies in the
// host arena. Items not lent carry a status: NotFound, or FailedPrecondition/ResourceExhausted
// when the bundle cannot be lent (not in host memory, the pin budget spent), to be read with GET.
struct ShmViewReply {
  uint64_t lease = 0;
  ShmGetReply items;
};

// PUT_LEASE: room for values the client writes in place into the host arena.
struct PutLeaseItem {
  WireHash hash{};
  uint32_t bytes = 0;
};
struct PutLeaseRequest {
  std::vector<PutLeaseItem> items;
};
// PUT_LEASE's reply is a ShmViewReply: the lease (0: nothing leased), then per item a status
// and, when OK, (hash, offset of the value's first byte in the arena, bytes).
// PUT_COMMIT: the checksums of items first.. of a lease, in order.
struct PutCommitRequest {
  uint64_t lease = 0;
  uint32_t first = 0;
  std::vector<uint64_t> checksums;
};

// GET_RANGES: byte ranges of one stored value, read without reading the rest of it.
struct ByteRange {
  uint64_t offset = 0;  // into the value (the bytes a PUT stored)
  uint32_t bytes = 0;   // at least 1
};
struct RangeItem {
  WireHash hash{};
  std::vector<ByteRange> ranges;
};
struct GetRangesRequest {
  std::vector<RangeItem> items;
};
// Ranges of all items of one request together, at most.
inline constexpr uint32_t kMaxRangesPerRequest = 65536;
// An item's error message in a GET_RANGES reply is cut to this many bytes, so that the reply's
// size is bounded by the request (GetRangesReplyBound).
inline constexpr uint32_t kMaxRangesMessageBytes = 256;
struct RangesItem {
  ItemStatus status;
  std::span<const std::byte> bytes;  // the ranges' bytes back to back, in order; empty unless OK
};
struct GetRangesReply {
  std::vector<RangesItem> items;
};
// The largest reply `m` can get: 4 + per item 5 + max(its ranges' bytes, kMaxRangesMessageBytes).
uint64_t GetRangesReplyBound(const GetRangesRequest& m);

struct ErrorReply {
  StatusCode code = StatusCode::kInternal;
  std::string message;
};

struct EventRecord {
  uint8_t type = 0;  // 1 stored, 2 removed, 3 all cleared
  uint8_t tier = 0;
  std::vector<WireHash> hashes;
};
struct EventBatch {
  uint64_t sequence = 0;  // first event's sequence number
  std::vector<EventRecord> events;
};

std::vector<std::byte> Encode(const HelloRequest& m);
std::vector<std::byte> Encode(const HelloReply& m);
std::vector<std::byte> Encode(const HashList& m);
std::vector<std::byte> Encode(const LookupReply& m);
std::vector<std::byte> Encode(const PinRequest& m);
std::vector<std::byte> Encode(const HintRequest& m);
std::vector<std::byte> Encode(const HintReply& m);
std::vector<std::byte> EncodeHintDrop(uint64_t hint);
std::vector<std::byte> Encode(const LogAppendRequest& m);
std::vector<std::byte> Encode(const LogSuspendedRequest& m);
std::vector<std::byte> Encode(const LogRecoverReply& m);
std::vector<std::byte> EncodeLogFinish(uint64_t request);
std::vector<std::byte> Encode(const PutRequest& m);
// Encode(m) as pieces to send gathered: the list's framing goes into `framing` (which must
// outlive the pieces), each bundle's bytes are named where they lie.
std::vector<std::span<const std::byte>> EncodePieces(const PutRequest& m, std::vector<std::byte>& framing);
std::vector<std::byte> Encode(const StatusListReply& m);
std::vector<std::byte> Encode(const GetReply& m);
std::vector<std::byte> Encode(const ShmPutRequest& m);
std::vector<std::byte> Encode(const ShmGetReply& m);
std::vector<std::byte> Encode(const ShmViewReply& m);
std::vector<std::byte> Encode(const PutLeaseRequest& m);
std::vector<std::byte> Encode(const PutCommitRequest& m);
// SHM_VIEW_END's request: the lease, a u64 and nothing else.
std::vector<std::byte> EncodeLease(uint64_t lease);
// SHM_VERDICTS: list<u8>, per item of the request 0 (checked, or nothing to check) or 1 (its
// lent bytes failed their record's checksum).
std::vector<std::byte> EncodeVerdicts(std::span<const uint8_t> verdicts);

std::vector<std::byte> Encode(const GetRangesRequest& m);
std::vector<std::byte> Encode(const GetRangesReply& m);
std::vector<std::byte> Encode(const ErrorReply& m);
std::vector<std::byte> Encode(const EventBatch& m);

Result<HelloRequest> DecodeHelloRequest(std::span<const std::byte> p);
Result<HelloReply> DecodeHelloReply(std::span<const std::byte> p);
Result<HashList> DecodeHashList(std::span<const std::byte> p);
Result<LookupReply> DecodeLookupReply(std::span<const std::byte> p);
Result<PinRequest> DecodePinRequest(std::span<const std::byte> p);
Result<HintRequest> DecodeHintRequest(std::span<const std::byte> p);
Result<HintReply> DecodeHintReply(std::span<const std::byte> p);
Result<uint64_t> DecodeHintDrop(std::span<const std::byte> p);
Result<LogAppendRequest> DecodeLogAppend(std::span<const std::byte> p);
Result<LogSuspendedRequest> DecodeLogSuspended(std::span<const std::byte> p);
Result<uint64_t> DecodeLogFinish(std::span<const std::byte> p);
Result<LogRecoverReply> DecodeLogRecoverReply(std::span<const std::byte> p);
// Bundle views point into `p`, which must outlive the result.
Result<PutRequest> DecodePutRequest(std::span<const std::byte> p, uint32_t max_bundle_bytes);
Result<StatusListReply> DecodeStatusListReply(std::span<const std::byte> p);
Result<GetReply> DecodeGetReply(std::span<const std::byte> p, uint32_t max_bundle_bytes);
Result<ShmPutRequest> DecodeShmPutRequest(std::span<const std::byte> p);
Result<ShmGetReply> DecodeShmGetReply(std::span<const std::byte> p);
Result<ShmViewReply> DecodeShmViewReply(std::span<const std::byte> p);
Result<uint64_t> DecodeLease(std::span<const std::byte> p);
Result<PutLeaseRequest> DecodePutLeaseRequest(std::span<const std::byte> p);
Result<PutCommitRequest> DecodePutCommitRequest(std::span<const std::byte> p);
Result<std::vector<uint8_t>> DecodeVerdicts(std::span<const std::byte> p);
// Errors: as for every list, plus more than kMaxRangesPerRequest ranges in all, an item of no
// ranges, a range of 0 bytes or reaching past 2^64, a reply that could exceed
// `max_reply_bytes` (GetRangesReplyBound).
Result<GetRangesRequest> DecodeGetRangesRequest(std::span<const std::byte> p, uint32_t max_reply_bytes);
Result<GetRangesReply> DecodeGetRangesReply(std::span<const std::byte> p);
Result<ErrorReply> DecodeErrorReply(std::span<const std::byte> p);
Result<EventBatch> DecodeEventBatch(std::span<const std::byte> p);

// recvmsg of up to `n` bytes into `buf` that also takes the descriptors passed with them
// (SCM_RIGHTS: the HELLO reply's staging area and arena, in that order), close-on-exec, into
// `fds` (appended; up to 8 per call, the kernel closes any beyond). Returns what recvmsg does:
// the bytes received, 0 at end of stream, -1 with errno set.
ssize_t RecvWithFds(int fd, void* buf, size_t n, int flags, std::vector<int>* fds);

}  // namespace sparsekv::wire
