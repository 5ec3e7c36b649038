#include "protocol/wire.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <cstring>

#include "allocator/xxhash_dispatch.h"

namespace sparsekv::wire {
namespace {

template <typename T>
T LoadLE(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // x86-64 and aarch64 Linux are little-endian
  return v;
}
template <typename T>
void StoreLE(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

uint32_t HeaderChecksum(const std::byte* header) { return XXH32(header, 28, 0); }

Status Bad(std::string msg) { return Status::InvalidArgument(std::move(msg)); }

void WriteHashes(PayloadWriter& w, const std::vector<WireHash>& hashes) {
  w.U32(static_cast<uint32_t>(hashes.size()));
  for (const WireHash& h : hashes) w.Bytes(h);
}

Result<std::vector<WireHash>> ReadHashes(PayloadReader& r, const char* field) {
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count(field, kMaxBatchItems, 16));
  std::vector<WireHash> out(n);
  for (WireHash& h : out) {
    SPARSEKV_ASSIGN_OR_RETURN(auto b, r.Bytes(16, field));
    std::memcpy(h.data(), b.data(), 16);
  }
  return out;
}

void WriteItemStatus(PayloadWriter& w, const ItemStatus& s) {
  w.U8(static_cast<uint8_t>(s.code));
  if (s.code != StatusCode::kOk) w.String(s.message);
}

Result<ItemStatus> ReadItemStatus(PayloadReader& r) {
  ItemStatus s;
  SPARSEKV_ASSIGN_OR_RETURN(uint8_t code, r.U8("item status"));
  if (code > static_cast<uint8_t>(StatusCode::kInternal)) {
    return Bad(fmt::format("item status code {} is unknown", code));
  }
  s.code = static_cast<StatusCode>(code);
  if (s.code != StatusCode::kOk) {
    SPARSEKV_ASSIGN_OR_RETURN(s.message, r.String("item status message", 4096));
  }
  return s;
}

// A list: u32 count, then each item.
template <typename T, typename Write>
void WriteList(PayloadWriter& w, const std::vector<T>& items, Write&& write) {
  w.U32(static_cast<uint32_t>(items.size()));
  for (const T& x : items) write(w, x);
}

// A list: a u32 count checked against the bytes left (each item taking at least
// `min_item_bytes`) before anything is allocated, then each item.
template <typename T, typename Read>
Status ReadList(PayloadReader& r, const char* what, uint32_t min_item_bytes, std::vector<T>& out, Read&& read) {
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count(what, kMaxBatchItems, min_item_bytes));
  out.resize(n);
  for (T& x : out) SPARSEKV_RETURN_IF_ERROR(read(x));
  return Status::OK();
}

void WriteSlot(PayloadWriter& w, const ShmSlot& s) {
  w.Bytes(s.hash);
  w.U64(s.offset);
  w.U32(s.bytes);
}

Result<ShmSlot> ReadSlot(PayloadReader& r) {
  ShmSlot s;
  SPARSEKV_ASSIGN_OR_RETURN(auto h, r.Bytes(16, "slot hash"));
  std::memcpy(s.hash.data(), h.data(), 16);
  SPARSEKV_ASSIGN_OR_RETURN(s.offset, r.U64("slot offset"));
  SPARSEKV_ASSIGN_OR_RETURN(s.bytes, r.U32("slot bytes"));
  return s;
}

}  // namespace

std::string_view OpcodeName(Opcode op) {
  switch (op) {
    case Opcode::kHello: return "HELLO";
    case Opcode::kLookup: return "LOOKUP";
    case Opcode::kPut: return "PUT";
    case Opcode::kGet: return "GET";
    case Opcode::kPin: return "PIN";
    case Opcode::kUnpin: return "UNPIN";
    case Opcode::kDelete: return "DELETE";
    case Opcode::kStats: return "STATS";
    case Opcode::kSubscribe: return "SUBSCRIBE";
    case Opcode::kEvent: return "EVENT";
    case Opcode::kError: return "ERROR";
    case Opcode::kShmPut: return "SHM_PUT";
    case Opcode::kShmGet: return "SHM_GET";
    case Opcode::kShmRelease: return "SHM_RELEASE";
    case Opcode::kPing: return "PING";
    case Opcode::kGetRanges: return "GET_RANGES";
    case Opcode::kShmView: return "SHM_VIEW";
    case Opcode::kShmViewEnd: return "SHM_VIEW_END";
    case Opcode::kShmGetOverlap: return "SHM_GET_OVERLAP";
    case Opcode::kShmVerdicts: return "SHM_VERDICTS";
    case Opcode::kHint: return "HINT";
    case Opcode::kHintDrop: return "HINT_DROP";
    case Opcode::kLogAppend: return "LOG_APPEND";
    case Opcode::kLogSuspended: return "LOG_SUSPENDED";
    case Opcode::kLogFinish: return "LOG_FINISH";
    case Opcode::kLogRecover: return "LOG_RECOVER";
    case Opcode::kPutLease: return "PUT_LEASE";
    case Opcode::kPutCommit: return "PUT_COMMIT";
    case Opcode::kTouch: return "TOUCH";
  }
  return "UNKNOWN";
}

std::array<std::byte, kHeaderBytes> EncodeHeader(const FrameHeader& h) {
  std::array<std::byte, kHeaderBytes> out{};
  std::byte* p = out.data();
  StoreLE<uint32_t>(p + 0, kMagic);
  StoreLE<uint16_t>(p + 4, kProtocolVersion);
  StoreLE<uint16_t>(p + 6, static_cast<uint16_t>(h.opcode));
  StoreLE<uint16_t>(p + 8, h.flags);
  StoreLE<uint16_t>(p + 10, 0);
  StoreLE<uint64_t>(p + 12, h.request_id);
  StoreLE<uint32_t>(p + 20, h.payload_bytes);
  StoreLE<uint32_t>(p + 24, h.payload_checksum);
  StoreLE<uint32_t>(p + 28, HeaderChecksum(p));
  return out;
}

Result<FrameHeader> DecodeHeader(std::span<const std::byte> bytes, uint32_t max_payload_bytes) {
  if (bytes.size() < kHeaderBytes) {
    return Bad(fmt::format("frame header is {} bytes; expected {}", bytes.size(), kHeaderBytes));
  }
  const std::byte* p = bytes.data();
  const uint32_t magic = LoadLE<uint32_t>(p);
  if (magic != kMagic) return Bad(fmt::format("bad frame magic 0x{:08x}; expected 0x{:08x} (\"SKV1\")", magic, kMagic));
  const uint32_t want = LoadLE<uint32_t>(p + 28);
  const uint32_t got = HeaderChecksum(p);
  if (want != got) return Bad(fmt::format("frame header checksum 0x{:08x} does not match its bytes (0x{:08x})", want, got));
  const uint16_t version = LoadLE<uint16_t>(p + 4);
  if (version != kProtocolVersion) {
    return Status::NotSupported(fmt::format("protocol version {}; this side speaks {}", version, kProtocolVersion));
  }
  FrameHeader h;
  const uint16_t op = LoadLE<uint16_t>(p + 6);
  if (op == 0 || op > kMaxOpcode) return Bad(fmt::format("unknown opcode {}", op));
  h.opcode = static_cast<Opcode>(op);
  h.flags = LoadLE<uint16_t>(p + 8);
  if (h.flags & ~kKnownFlags) return Bad(fmt::format("unknown frame flags 0x{:04x}", h.flags & ~kKnownFlags));
  if (LoadLE<uint16_t>(p + 10) != 0) return Bad("reserved header field is not zero");
  h.request_id = LoadLE<uint64_t>(p + 12);
  h.payload_bytes = LoadLE<uint32_t>(p + 20);
  h.payload_checksum = LoadLE<uint32_t>(p + 24);
  const uint32_t limit = std::min(max_payload_bytes, kMaxPayloadBytes);
  if (h.payload_bytes > limit) {
    return Status::ResourceExhausted(
        fmt::format("frame payload of {} bytes exceeds the limit of {}", h.payload_bytes, limit));
  }
  return h;
}

// XXH3's low 32 bits: XXH3 runs at memory speed with SIMD, where XXH32 would cost a large
// GET reply more time than the copy of its bytes.
uint32_t PayloadChecksum(std::span<const std::byte> payload) {
  return static_cast<uint32_t>(XXH3_64bits(payload.data(), payload.size()));
}

uint32_t PayloadChecksum(std::span<const std::span<const std::byte>> pieces) {
  if (pieces.size() == 1) return PayloadChecksum(pieces[0]);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (const auto& piece : pieces) XXH3_64bits_update(&state, piece.data(), piece.size());
  return static_cast<uint32_t>(XXH3_64bits_digest(&state));
}

Status VerifyPayload(const FrameHeader& header, std::span<const std::byte> payload) {
  if (payload.size() != header.payload_bytes) {
    return Bad(fmt::format("payload is {} bytes; header says {}", payload.size(), header.payload_bytes));
  }
  if ((header.flags & kFlagPayloadChecksum) && PayloadChecksum(payload) != header.payload_checksum) {
    return Status::Corruption(fmt::format("{} payload checksum mismatch", OpcodeName(header.opcode)));
  }
  return Status::OK();
}

std::vector<std::byte> EncodeFrame(Opcode op, uint16_t flags, uint64_t request_id,
                                   std::span<const std::byte> payload) {
  FrameHeader h;
  h.opcode = op;
  h.flags = flags | kFlagPayloadChecksum;
  h.request_id = request_id;
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  h.payload_checksum = PayloadChecksum(payload);
  const auto header = EncodeHeader(h);
  std::vector<std::byte> out(kHeaderBytes + payload.size());
  std::memcpy(out.data(), header.data(), kHeaderBytes);
  if (!payload.empty()) std::memcpy(out.data() + kHeaderBytes, payload.data(), payload.size());
  return out;
}

std::array<std::byte, kHeaderBytes> EncodeFrameHeader(Opcode op, uint16_t flags, uint64_t request_id,
                                                      std::span<const std::span<const std::byte>> pieces) {
  uint64_t bytes = 0;
  for (const auto& piece : pieces) bytes += piece.size();
  FrameHeader h;
  h.opcode = op;
  h.flags = flags | kFlagPayloadChecksum;
  h.request_id = request_id;
  h.payload_bytes = static_cast<uint32_t>(bytes);
  h.payload_checksum = PayloadChecksum(pieces);
  return EncodeHeader(h);
}

// ---- primitives ----

void PayloadWriter::Raw(const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out_.insert(out_.end(), b, b + n);
}

void PayloadWriter::Blob(std::span<const std::byte> b) {
  U32(static_cast<uint32_t>(b.size()));
  Bytes(b);
}

void PayloadWriter::String(std::string_view s) {
  Blob(std::as_bytes(std::span<const char>(s.data(), s.size())));
}

Status PayloadReader::Short(const char* field, size_t need) const {
  return Bad(fmt::format("payload ends inside {}: {} bytes needed, {} left", field, need, remaining()));
}

#define SPARSEKV_READ_SCALAR(T, NAME)                         \
  Result<T> PayloadReader::NAME(const char* field) {          \
    if (remaining() < sizeof(T)) return Short(field, sizeof(T)); \
    T v = LoadLE<T>(in_.data() + pos_);                       \
    pos_ += sizeof(T);                                        \
    return v;                                                 \
  }
SPARSEKV_READ_SCALAR(uint8_t, U8)
SPARSEKV_READ_SCALAR(uint16_t, U16)
SPARSEKV_READ_SCALAR(uint32_t, U32)
SPARSEKV_READ_SCALAR(uint64_t, U64)
#undef SPARSEKV_READ_SCALAR

Result<std::span<const std::byte>> PayloadReader::Bytes(size_t n, const char* field) {
  if (remaining() < n) return Short(field, n);
  auto s = in_.subspan(pos_, n);
  pos_ += n;
  return s;
}

Result<std::span<const std::byte>> PayloadReader::Blob(const char* field, uint32_t max_bytes) {
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, U32(field));
  if (n > max_bytes) return Bad(fmt::format("{} of {} bytes exceeds the limit of {}", field, n, max_bytes));
  return Bytes(n, field);
}

Result<std::string> PayloadReader::String(const char* field, uint32_t max_bytes) {
  SPARSEKV_ASSIGN_OR_RETURN(auto b, Blob(field, max_bytes));
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

Result<uint32_t> PayloadReader::Count(const char* field, uint32_t max_items, size_t min_item_bytes) {
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, U32(field));
  if (n > max_items) return Bad(fmt::format("{} = {} exceeds the limit of {}", field, n, max_items));
  if (min_item_bytes && n > remaining() / min_item_bytes) {
    return Bad(fmt::format("{} = {} but only {} bytes follow", field, n, remaining()));
  }
  return n;
}

Status PayloadReader::Finish(const char* message) const {
  if (remaining() != 0) return Bad(fmt::format("{} has {} trailing bytes", message, remaining()));
  return Status::OK();
}

// ---- messages ----

std::vector<std::byte> Encode(const HelloRequest& m) {
  PayloadWriter w;
  w.U16(m.protocol_version);
  w.String(m.namespace_name);
  w.String(m.token);
  w.String(m.client_name);
  w.U8((m.want_shared_memory ? 1 : 0) | (m.want_shared_memory && m.want_write_leases ? 2 : 0) |
       (m.want_shared_memory && m.want_lend_table ? 4 : 0));
  return w.Take();
}

Result<HelloRequest> DecodeHelloRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  HelloRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.protocol_version, r.U16("HELLO version"));
  SPARSEKV_ASSIGN_OR_RETURN(m.namespace_name, r.String("HELLO namespace", kMaxNameBytes));
  SPARSEKV_ASSIGN_OR_RETURN(m.token, r.String("HELLO token", kMaxNameBytes));
  SPARSEKV_ASSIGN_OR_RETURN(m.client_name, r.String("HELLO client name", kMaxNameBytes));
  SPARSEKV_ASSIGN_OR_RETURN(uint8_t shm, r.U8("HELLO shared-memory flag"));
  if (shm > 7 || (shm != 0 && (shm & 1) == 0)) return Bad("HELLO shared-memory flag must be 0, 1, 3, 5 or 7");
  m.want_shared_memory = (shm & 1) != 0;
  m.want_write_leases = (shm & 2) != 0;
  m.want_lend_table = (shm & 4) != 0;
  SPARSEKV_RETURN_IF_ERROR(r.Finish("HELLO"));
  if (m.namespace_name.empty()) return Bad("HELLO namespace is empty");
  return m;
}

std::vector<std::byte> Encode(const HelloReply& m) {
  PayloadWriter w;
  w.U64(m.session_id);
  w.U32(m.max_payload_bytes);
  w.U32(m.block_tokens);
  w.U64(m.shm_staging_bytes);
  w.String(m.server_version);
  w.U64(m.shm_arena_bytes);
  if (m.write_leases || m.lend_table) w.U8(m.write_leases.value_or(false) ? 1 : 0);
  if (m.lend_table) w.U8(*m.lend_table);
  return w.Take();
}

Result<HelloReply> DecodeHelloReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  HelloReply m;
  SPARSEKV_ASSIGN_OR_RETURN(m.session_id, r.U64("HELLO reply session"));
  SPARSEKV_ASSIGN_OR_RETURN(m.max_payload_bytes, r.U32("HELLO reply max payload"));
  SPARSEKV_ASSIGN_OR_RETURN(m.block_tokens, r.U32("HELLO reply block tokens"));
  SPARSEKV_ASSIGN_OR_RETURN(m.shm_staging_bytes, r.U64("HELLO reply staging bytes"));
  SPARSEKV_ASSIGN_OR_RETURN(m.server_version, r.String("HELLO reply version", kMaxNameBytes));
  SPARSEKV_ASSIGN_OR_RETURN(m.shm_arena_bytes, r.U64("HELLO reply arena bytes"));
  if (r.remaining() == 1 || r.remaining() == 2) {  // a HELLO that asked for leases or the lend table
    const bool lend = r.remaining() == 2;
    SPARSEKV_ASSIGN_OR_RETURN(uint8_t leases, r.U8("HELLO reply write leases"));
    if (leases > 1) return Bad("HELLO reply write-lease flag must be 0 or 1");
    m.write_leases = leases == 1;
    if (lend) {
      SPARSEKV_ASSIGN_OR_RETURN(uint8_t table, r.U8("HELLO reply lend table"));
      if (table > 2) return Bad("HELLO reply lend-table flag must be 0, 1 or 2");
      m.lend_table = table;
    }
  }
  SPARSEKV_RETURN_IF_ERROR(r.Finish("HELLO reply"));
  return m;
}

std::vector<std::byte> Encode(const HashList& m) {
  PayloadWriter w;
  WriteHashes(w, m.hashes);
  return w.Take();
}

Result<HashList> DecodeHashList(std::span<const std::byte> p) {
  PayloadReader r(p);
  HashList m;
  SPARSEKV_ASSIGN_OR_RETURN(m.hashes, ReadHashes(r, "hash count"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("hash list"));
  return m;
}

std::vector<std::byte> Encode(const LookupReply& m) {
  PayloadWriter w;
  w.U32(m.prefix_blocks);
  WriteList(w, m.tiers, [](PayloadWriter& o, uint8_t t) { o.U8(t); });
  return w.Take();
}

Result<LookupReply> DecodeLookupReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  LookupReply m;
  SPARSEKV_ASSIGN_OR_RETURN(m.prefix_blocks, r.U32("LOOKUP prefix"));
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "LOOKUP tier count", 1, m.tiers, [&](uint8_t& t) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(t, r.U8("LOOKUP tier"));
    return Status::OK();
  }));
  if (m.prefix_blocks > m.tiers.size()) return Bad("LOOKUP prefix is longer than the list of blocks");
  SPARSEKV_RETURN_IF_ERROR(r.Finish("LOOKUP reply"));
  return m;
}

std::vector<std::byte> Encode(const PinRequest& m) {
  PayloadWriter w;
  w.U8(m.priority);
  WriteHashes(w, m.hashes);
  return w.Take();
}

Result<PinRequest> DecodePinRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  PinRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.priority, r.U8("PIN priority"));
  SPARSEKV_ASSIGN_OR_RETURN(m.hashes, ReadHashes(r, "PIN hash count"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("PIN"));
  return m;
}

std::vector<std::byte> Encode(const HintRequest& m) {
  PayloadWriter w;
  w.U32(m.ttl_ms);
  WriteHashes(w, m.hashes);
  return w.Take();
}

Result<HintRequest> DecodeHintRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  HintRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.ttl_ms, r.U32("HINT time to live"));
  SPARSEKV_ASSIGN_OR_RETURN(m.hashes, ReadHashes(r, "HINT hash count"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("HINT"));
  if (m.ttl_ms == 0) return Bad("HINT time to live is 0 ms: a hint must live at least 1 ms");
  return m;
}

std::vector<std::byte> Encode(const HintReply& m) {
  PayloadWriter w;
  w.U64(m.hint);
  w.U32(m.found);
  w.U32(m.in_memory);
  w.U32(m.prefetching);
  return w.Take();
}

Result<HintReply> DecodeHintReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  HintReply m;
  SPARSEKV_ASSIGN_OR_RETURN(m.hint, r.U64("HINT id"));
  SPARSEKV_ASSIGN_OR_RETURN(m.found, r.U32("HINT found"));
  SPARSEKV_ASSIGN_OR_RETURN(m.in_memory, r.U32("HINT in memory"));
  SPARSEKV_ASSIGN_OR_RETURN(m.prefetching, r.U32("HINT prefetching"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("HINT reply"));
  if (m.in_memory > m.found || m.prefetching > m.found - m.in_memory)
    return Bad("HINT reply counts more blocks in memory or prefetching than found");
  return m;
}

std::vector<std::byte> EncodeHintDrop(uint64_t hint) {
  PayloadWriter w;
  w.U64(hint);
  return w.Take();
}

Result<uint64_t> DecodeHintDrop(std::span<const std::byte> p) {
  PayloadReader r(p);
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t hint, r.U64("HINT_DROP id"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("HINT_DROP"));
  return hint;
}

namespace {
void WriteTokens(PayloadWriter& w, const std::vector<int32_t>& t) {
  w.U32(static_cast<uint32_t>(t.size()));
  w.Bytes(std::as_bytes(std::span<const int32_t>(t)));
}
Result<std::vector<int32_t>> ReadTokens(PayloadReader& r, const char* field, uint32_t max_tokens) {
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count(field, max_tokens, 4));
  SPARSEKV_ASSIGN_OR_RETURN(auto b, r.Bytes(4ull * n, field));
  std::vector<int32_t> out(n);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}
}  // namespace

std::vector<std::byte> Encode(const LogAppendRequest& m) {
  PayloadWriter w;
  w.U64(m.request);
  w.U64(m.first_token);
  WriteTokens(w, m.tokens);
  return w.Take();
}

Result<LogAppendRequest> DecodeLogAppend(std::span<const std::byte> p) {
  PayloadReader r(p);
  LogAppendRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.request, r.U64("LOG_APPEND request"));
  SPARSEKV_ASSIGN_OR_RETURN(m.first_token, r.U64("LOG_APPEND first token"));
  SPARSEKV_ASSIGN_OR_RETURN(m.tokens, ReadTokens(r, "LOG_APPEND token count", kMaxLogAppendTokens));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("LOG_APPEND"));
  if (m.tokens.empty()) return Bad("LOG_APPEND of no tokens");
  return m;
}

std::vector<std::byte> Encode(const LogSuspendedRequest& m) {
  PayloadWriter w;
  w.U64(m.request);
  w.U64(m.tokens);
  w.Bytes(m.tail);
  w.U64(m.tag);
  return w.Take();
}

Result<LogSuspendedRequest> DecodeLogSuspended(std::span<const std::byte> p) {
  PayloadReader r(p);
  LogSuspendedRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.request, r.U64("LOG_SUSPENDED request"));
  SPARSEKV_ASSIGN_OR_RETURN(m.tokens, r.U64("LOG_SUSPENDED tokens"));
  SPARSEKV_ASSIGN_OR_RETURN(auto b, r.Bytes(16, "LOG_SUSPENDED tail"));
  std::memcpy(m.tail.data(), b.data(), 16);
  SPARSEKV_ASSIGN_OR_RETURN(m.tag, r.U64("LOG_SUSPENDED tag"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("LOG_SUSPENDED"));
  return m;
}

std::vector<std::byte> EncodeLogFinish(uint64_t request) {
  PayloadWriter w;
  w.U64(request);
  return w.Take();
}

Result<uint64_t> DecodeLogFinish(std::span<const std::byte> p) {
  PayloadReader r(p);
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t request, r.U64("LOG_FINISH request"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("LOG_FINISH"));
  return request;
}

std::vector<std::byte> Encode(const LogRecoverReply& m) {
  PayloadWriter w;
  w.U32(static_cast<uint32_t>(m.requests.size()));
  for (const LogRequestState& q : m.requests) {
    w.U64(q.request);
    WriteTokens(w, q.tokens);
    w.U8(q.suspended ? 1 : 0);
    if (q.suspended) {
      w.U64(q.state_tokens);
      w.Bytes(q.tail);
      w.U64(q.tag);
    }
  }
  return w.Take();
}

Result<LogRecoverReply> DecodeLogRecoverReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  LogRecoverReply m;
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count("LOG_RECOVER request count", UINT32_MAX, 13));
  m.requests.resize(n);
  for (LogRequestState& q : m.requests) {
    SPARSEKV_ASSIGN_OR_RETURN(q.request, r.U64("LOG_RECOVER request"));
    SPARSEKV_ASSIGN_OR_RETURN(q.tokens, ReadTokens(r, "LOG_RECOVER token count", UINT32_MAX / 4));
    SPARSEKV_ASSIGN_OR_RETURN(uint8_t s, r.U8("LOG_RECOVER suspended"));
    if (s > 1) return Bad("LOG_RECOVER suspended flag is neither 0 nor 1");
    q.suspended = s == 1;
    if (q.suspended) {
      SPARSEKV_ASSIGN_OR_RETURN(q.state_tokens, r.U64("LOG_RECOVER state tokens"));
      SPARSEKV_ASSIGN_OR_RETURN(auto b, r.Bytes(16, "LOG_RECOVER tail"));
      std::memcpy(q.tail.data(), b.data(), 16);
      SPARSEKV_ASSIGN_OR_RETURN(q.tag, r.U64("LOG_RECOVER tag"));
      if (q.state_tokens > q.tokens.size()) return Bad("LOG_RECOVER state past the request's tokens");
    }
  }
  SPARSEKV_RETURN_IF_ERROR(r.Finish("LOG_RECOVER reply"));
  return m;
}

std::vector<std::byte> Encode(const PutRequest& m) {
  PayloadWriter w;
  WriteList(w, m.items, [](PayloadWriter& o, const PutItem& it) {
    o.Bytes(it.hash);
    o.Blob(it.bundle);
  });
  return w.Take();
}

std::vector<std::span<const std::byte>> EncodePieces(const PutRequest& m, std::vector<std::byte>& framing) {
  // Encode's layout: u32 count, then per item its 16 hash bytes, u32 length and the bytes.
  framing.assign(4 + 20 * m.items.size(), std::byte{0});
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) framing[at + i] = static_cast<std::byte>(v >> (8 * i));
  };
  put32(0, static_cast<uint32_t>(m.items.size()));
  std::vector<std::span<const std::byte>> pieces;
  pieces.reserve(2 * m.items.size() + 1);
  size_t start = 0;  // framing bytes not yet in a piece
  for (size_t i = 0; i < m.items.size(); ++i) {
    const size_t at = 4 + 20 * i;
    std::memcpy(framing.data() + at, m.items[i].hash.data(), 16);
    put32(at + 16, static_cast<uint32_t>(m.items[i].bundle.size()));
    if (m.items[i].bundle.empty()) continue;  // the next item's framing follows on
    pieces.emplace_back(framing.data() + start, at + 20 - start);
    pieces.push_back(m.items[i].bundle);
    start = at + 20;
  }
  if (start < framing.size()) pieces.emplace_back(framing.data() + start, framing.size() - start);
  return pieces;
}

Result<PutRequest> DecodePutRequest(std::span<const std::byte> p, uint32_t max_bundle_bytes) {
  PayloadReader r(p);
  PutRequest m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "PUT item count", 20, m.items, [&](PutItem& it) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(auto h, r.Bytes(16, "PUT hash"));
    std::memcpy(it.hash.data(), h.data(), 16);
    SPARSEKV_ASSIGN_OR_RETURN(it.bundle, r.Blob("PUT bundle", max_bundle_bytes));
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("PUT"));
  return m;
}

std::vector<std::byte> Encode(const StatusListReply& m) {
  PayloadWriter w;
  WriteList(w, m.items, WriteItemStatus);
  return w.Take();
}

Result<StatusListReply> DecodeStatusListReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  StatusListReply m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "status count", 1, m.items, [&](ItemStatus& s) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(s, ReadItemStatus(r));
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("status list"));
  return m;
}

std::vector<std::byte> Encode(const GetReply& m) {
  PayloadWriter w;
  WriteList(w, m.items, [](PayloadWriter& o, const GetItem& it) {
    if (it.deferred) {
      o.U8(kDeferredCode);
      return;
    }
    WriteItemStatus(o, it.status);
    if (it.status.code == StatusCode::kOk) o.Blob(it.bundle);
  });
  for (const GetItem& it : m.items) w.U8(it.verdict);
  return w.Take();
}

Result<GetReply> DecodeGetReply(std::span<const std::byte> p, uint32_t max_bundle_bytes) {
  PayloadReader r(p);
  GetReply m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "GET item count", 2, m.items, [&](GetItem& it) -> Status {
    if (r.Peek() == kDeferredCode) {
      SPARSEKV_RETURN_IF_ERROR(r.U8("GET item status").status());
      it.deferred = true;
      return Status::OK();
    }
    SPARSEKV_ASSIGN_OR_RETURN(it.status, ReadItemStatus(r));
    if (it.status.code == StatusCode::kOk) {
      SPARSEKV_ASSIGN_OR_RETURN(it.bundle, r.Blob("GET bundle", max_bundle_bytes));
    }
    return Status::OK();
  }));
  for (GetItem& it : m.items) {
    SPARSEKV_ASSIGN_OR_RETURN(it.verdict, r.U8("GET verdict"));
    if (it.verdict > 1) return Bad(fmt::format("GET verdict {} is unknown", it.verdict));
    if (it.deferred && it.verdict != 0) return Bad("a deferred GET item has a verdict");
    if (it.verdict != 0 && it.status.code == StatusCode::kOk) {
      it.status = {StatusCode::kCorruption, "the bundle failed its checksum as sparsekvd sent it"};
      it.bundle = {};
    }
  }
  SPARSEKV_RETURN_IF_ERROR(r.Finish("GET reply"));
  return m;
}

std::vector<std::byte> Encode(const ShmPutRequest& m) {
  PayloadWriter w;
  WriteList(w, m.slots, WriteSlot);
  return w.Take();
}

Result<ShmPutRequest> DecodeShmPutRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  ShmPutRequest m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "SHM_PUT slot count", 28, m.slots, [&](ShmSlot& s) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(s, ReadSlot(r));
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("SHM_PUT"));
  return m;
}

std::vector<std::byte> Encode(const ShmGetReply& m) {
  PayloadWriter w;
  w.U32(static_cast<uint32_t>(m.status.size()));
  size_t slot = 0;
  for (const ItemStatus& s : m.status) {
    WriteItemStatus(w, s);
    if (s.code == StatusCode::kOk) WriteSlot(w, m.slots[slot++]);
  }
  if (!m.lend.empty()) {
    w.U32(static_cast<uint32_t>(m.lend.size()));
    for (const LendInfo& l : m.lend) {
      w.U32(l.token);
      w.U64(l.record_offset);
      w.U64(l.checksum);
    }
  }
  return w.Take();
}

Result<ShmGetReply> DecodeShmGetReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  ShmGetReply m;
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count("SHM_GET item count", kMaxBatchItems, 1));
  m.status.resize(n);
  for (ItemStatus& s : m.status) {
    SPARSEKV_ASSIGN_OR_RETURN(s, ReadItemStatus(r));
    if (s.code == StatusCode::kOk) {
      SPARSEKV_ASSIGN_OR_RETURN(ShmSlot slot, ReadSlot(r));
      m.slots.push_back(slot);
    }
  }
  if (r.remaining() > 0) {  // the lend table's part, one per slot
    SPARSEKV_ASSIGN_OR_RETURN(uint32_t k, r.Count("SHM_GET lend count", kMaxBatchItems, 20));
    if (k != m.slots.size()) return Bad(fmt::format("SHM_GET reply: {} lend entries for {} slots", k, m.slots.size()));
    m.lend.resize(k);
    for (LendInfo& l : m.lend) {
      SPARSEKV_ASSIGN_OR_RETURN(l.token, r.U32("SHM_GET lend token"));
      SPARSEKV_ASSIGN_OR_RETURN(l.record_offset, r.U64("SHM_GET lend record offset"));
      SPARSEKV_ASSIGN_OR_RETURN(l.checksum, r.U64("SHM_GET lend checksum"));
    }
  }
  SPARSEKV_RETURN_IF_ERROR(r.Finish("SHM_GET reply"));
  return m;
}

std::vector<std::byte> Encode(const ShmViewReply& m) {
  std::vector<std::byte> items = Encode(m.items);
  PayloadWriter w;
  w.Reserve(8 + items.size());
  w.U64(m.lease);
  w.Bytes(items);
  return w.Take();
}

Result<ShmViewReply> DecodeShmViewReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  ShmViewReply m;
  SPARSEKV_ASSIGN_OR_RETURN(m.lease, r.U64("SHM_VIEW lease"));
  SPARSEKV_ASSIGN_OR_RETURN(m.items, DecodeShmGetReply(p.subspan(8)));
  return m;
}

std::vector<std::byte> Encode(const PutLeaseRequest& m) {
  PayloadWriter w;
  w.Reserve(4 + 20 * m.items.size());
  WriteList(w, m.items, [](PayloadWriter& o, const PutLeaseItem& it) {
    o.Bytes(it.hash);
    o.U32(it.bytes);
  });
  return w.Take();
}

Result<PutLeaseRequest> DecodePutLeaseRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  PutLeaseRequest m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "PUT_LEASE item count", 20, m.items, [&](PutLeaseItem& it) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(auto h, r.Bytes(16, "PUT_LEASE hash"));
    std::memcpy(it.hash.data(), h.data(), 16);
    SPARSEKV_ASSIGN_OR_RETURN(it.bytes, r.U32("PUT_LEASE bytes"));
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("PUT_LEASE"));
  return m;
}

std::vector<std::byte> Encode(const PutCommitRequest& m) {
  PayloadWriter w;
  w.Reserve(16 + 8 * m.checksums.size());
  w.U64(m.lease);
  w.U32(m.first);
  WriteList(w, m.checksums, [](PayloadWriter& o, uint64_t c) { o.U64(c); });
  return w.Take();
}

Result<PutCommitRequest> DecodePutCommitRequest(std::span<const std::byte> p) {
  PayloadReader r(p);
  PutCommitRequest m;
  SPARSEKV_ASSIGN_OR_RETURN(m.lease, r.U64("PUT_COMMIT lease"));
  SPARSEKV_ASSIGN_OR_RETURN(m.first, r.U32("PUT_COMMIT first item"));
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "PUT_COMMIT checksum count", 8, m.checksums, [&](uint64_t& c) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(c, r.U64("PUT_COMMIT checksum"));
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("PUT_COMMIT"));
  return m;
}

std::vector<std::byte> EncodeLease(uint64_t lease) {
  PayloadWriter w;
  w.U64(lease);
  return w.Take();
}

Result<uint64_t> DecodeLease(std::span<const std::byte> p) {
  PayloadReader r(p);
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t lease, r.U64("SHM_VIEW_END lease"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("SHM_VIEW_END"));
  return lease;
}

std::vector<std::byte> EncodeVerdicts(std::span<const uint8_t> verdicts) {
  PayloadWriter w;
  w.Reserve(4 + verdicts.size());
  w.U32(static_cast<uint32_t>(verdicts.size()));
  w.Bytes(std::as_bytes(verdicts));
  return w.Take();
}

Result<std::vector<uint8_t>> DecodeVerdicts(std::span<const std::byte> p) {
  PayloadReader r(p);
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count("SHM_VERDICTS count", kMaxBatchItems, 1));
  SPARSEKV_ASSIGN_OR_RETURN(std::span<const std::byte> b, r.Bytes(n, "SHM_VERDICTS"));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("SHM_VERDICTS"));
  std::vector<uint8_t> out(n);
  for (uint32_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint8_t>(b[i]);
    if (out[i] > 1) return Status::InvalidArgument(fmt::format("SHM_VERDICTS: verdict {} of item {}", out[i], i));
  }
  return out;
}

uint64_t GetRangesReplyBound(const GetRangesRequest& m) {
  uint64_t bound = 4;
  for (const RangeItem& it : m.items) {
    uint64_t bytes = 0;
    for (const ByteRange& r : it.ranges) bytes += r.bytes;
    bound += 5 + std::max<uint64_t>(bytes, kMaxRangesMessageBytes);
  }
  return bound;
}

std::vector<std::byte> Encode(const GetRangesRequest& m) {
  PayloadWriter w;
  WriteList(w, m.items, [](PayloadWriter& o, const RangeItem& it) {
    o.Bytes(it.hash);
    o.U32(static_cast<uint32_t>(it.ranges.size()));
    for (const ByteRange& r : it.ranges) {
      o.U64(r.offset);
      o.U32(r.bytes);
    }
  });
  return w.Take();
}

Result<GetRangesRequest> DecodeGetRangesRequest(std::span<const std::byte> p, uint32_t max_reply_bytes) {
  PayloadReader r(p);
  GetRangesRequest m;
  uint64_t ranges = 0;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "GET_RANGES item count", 20, m.items, [&](RangeItem& it) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(auto h, r.Bytes(16, "GET_RANGES hash"));
    std::memcpy(it.hash.data(), h.data(), 16);
    SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count("GET_RANGES range count", kMaxRangesPerRequest, 12));
    if (n == 0) return Bad("a GET_RANGES item names no range");
    ranges += n;
    if (ranges > kMaxRangesPerRequest) {
      return Bad(fmt::format("GET_RANGES names more than {} ranges", kMaxRangesPerRequest));
    }
    it.ranges.resize(n);
    for (ByteRange& br : it.ranges) {
      SPARSEKV_ASSIGN_OR_RETURN(br.offset, r.U64("GET_RANGES range offset"));
      SPARSEKV_ASSIGN_OR_RETURN(br.bytes, r.U32("GET_RANGES range bytes"));
      if (br.bytes == 0) return Bad("a GET_RANGES range of 0 bytes");
      if (br.offset > UINT64_MAX - br.bytes) return Bad("a GET_RANGES range reaches past 2^64");
    }
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("GET_RANGES"));
  const uint64_t bound = GetRangesReplyBound(m);
  if (bound > max_reply_bytes) {
    return Bad(fmt::format("GET_RANGES asks for a reply of up to {} bytes; the most is {}", bound, max_reply_bytes));
  }
  return m;
}

std::vector<std::byte> Encode(const GetRangesReply& m) {
  PayloadWriter w;
  WriteList(w, m.items, [](PayloadWriter& o, const RangesItem& it) {
    WriteItemStatus(o, it.status);
    if (it.status.code == StatusCode::kOk) o.Blob(it.bytes);
  });
  return w.Take();
}

Result<GetRangesReply> DecodeGetRangesReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  GetRangesReply m;
  SPARSEKV_RETURN_IF_ERROR(ReadList(r, "GET_RANGES item count", 2, m.items, [&](RangesItem& it) -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(it.status, ReadItemStatus(r));
    if (it.status.code == StatusCode::kOk) {
      SPARSEKV_ASSIGN_OR_RETURN(it.bytes, r.Blob("GET_RANGES bytes", kMaxPayloadBytes));
    }
    return Status::OK();
  }));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("GET_RANGES reply"));
  return m;
}

std::vector<std::byte> Encode(const ErrorReply& m) {
  PayloadWriter w;
  w.U8(static_cast<uint8_t>(m.code));
  w.String(m.message);
  return w.Take();
}

Result<ErrorReply> DecodeErrorReply(std::span<const std::byte> p) {
  PayloadReader r(p);
  ErrorReply m;
  SPARSEKV_ASSIGN_OR_RETURN(uint8_t code, r.U8("ERROR code"));
  if (code == 0 || code > static_cast<uint8_t>(StatusCode::kInternal)) {
    return Bad(fmt::format("ERROR code {} is unknown", code));
  }
  m.code = static_cast<StatusCode>(code);
  SPARSEKV_ASSIGN_OR_RETURN(m.message, r.String("ERROR message", 4096));
  SPARSEKV_RETURN_IF_ERROR(r.Finish("ERROR"));
  return m;
}

std::vector<std::byte> Encode(const EventBatch& m) {
  PayloadWriter w;
  w.U64(m.sequence);
  w.U32(static_cast<uint32_t>(m.events.size()));
  for (const EventRecord& e : m.events) {
    w.U8(e.type);
    w.U8(e.tier);
    WriteHashes(w, e.hashes);
  }
  return w.Take();
}

Result<EventBatch> DecodeEventBatch(std::span<const std::byte> p) {
  PayloadReader r(p);
  EventBatch m;
  SPARSEKV_ASSIGN_OR_RETURN(m.sequence, r.U64("EVENT sequence"));
  SPARSEKV_ASSIGN_OR_RETURN(uint32_t n, r.Count("EVENT count", kMaxBatchItems, 6));
  m.events.resize(n);
  for (EventRecord& e : m.events) {
    SPARSEKV_ASSIGN_OR_RETURN(e.type, r.U8("EVENT type"));
    if (e.type < 1 || e.type > 3) return Bad(fmt::format("EVENT type {} is unknown", e.type));
    SPARSEKV_ASSIGN_OR_RETURN(e.tier, r.U8("EVENT tier"));
    SPARSEKV_ASSIGN_OR_RETURN(e.hashes, ReadHashes(r, "EVENT hash count"));
  }
  SPARSEKV_RETURN_IF_ERROR(r.Finish("EVENT"));
  return m;
}

ssize_t RecvWithFds(int fd, void* buf, size_t n, int flags, std::vector<int>* fds) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  iovec iov{buf, n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t k = ::recvmsg(fd, &msg, flags | MSG_CMSG_CLOEXEC);
  if (k < 0) return k;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const size_t at = fds->size();
    fds->resize(at + count);
    std::memcpy(fds->data() + at, CMSG_DATA(c), count * sizeof(int));
  }
  return k;
}

}  // namespace sparsekv::wire
