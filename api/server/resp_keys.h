// How a RESP key names a stored block, and how its record holds the key.
//
// A key of exactly 32 lowercase hex digits is a *bridge key*: it names the native block hash it
// spells (the high 64 bits first, as `sparsekv get` prints hashes), and its value is stored as
// it is, so a block PUT through the native protocol is read through RESP and the reverse.
//
// Any other key (any bytes, up to kMaxKeyBytes) is filed under the XXH3-128 of the key with a
// seed of RESP's own, and its value is stored behind a header that holds the whole key:
//   0  u32 magic "SKVR"   4  u32 key bytes   8  u64 value bytes   16  the key   then the value
// A key with an expiry (EXPIRE, SET EX, ...) keeps its deadline in the record, so that it holds
// across a restart:
//   0  u32 magic "SKVE"   4  u32 key bytes   8  u64 value bytes   16  i64 deadline, Unix ms
//   24  the key   then the value
// A release before expiry reads an "SKVE" record as no value of its key (a miss, never a value
// past its deadline). A bridge key's value is a native block's bytes: it takes no expiry.
// Every read compares the key, so two keys whose hashes collide never read each other's value:
// a read that finds another key's record (or a native block's bytes) is a miss. The value's
// length in the header lets STRLEN and GETRANGE read the header and the bytes asked for, not
// the whole value.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "protocol/wire.h"

namespace sparsekv::server::resp {

inline constexpr uint32_t kRecordMagic = 0x52564b53;    // "SKVR" read as little-endian bytes
inline constexpr uint32_t kExpiringMagic = 0x45564b53;  // "SKVE"
inline constexpr size_t kMaxKeyBytes = 64u << 10;
inline constexpr size_t kFixedHeaderBytes = 16;     // what every record starts with
inline constexpr size_t kExpiringHeaderBytes = 24;  // the fixed part of an "SKVE" record

bool IsBridgeKey(std::string_view key);
// The block hash a key is filed under.
wire::WireHash KeyHash(std::string_view key);
// The key of a block hash as SCAN shows a bridge key (32 lowercase hex digits, high bits first).
std::string BridgeKeyOf(const wire::WireHash& hash);

// Bytes of the header before a value for `key` (0 for a bridge key: its value is stored bare),
// with room for a deadline when `expiring`.
size_t HeaderBytes(std::string_view key, bool expiring = false);
// Writes the header for `key` and a value of `value_bytes` into `out` (HeaderBytes(key,
// deadline_ms != 0) bytes). `deadline_ms`: Unix milliseconds, 0 for none.
void WriteHeader(std::string_view key, uint64_t value_bytes, std::byte* out, int64_t deadline_ms = 0);

// What a stored record says of itself, from its first bytes: at least kFixedHeaderBytes, and an
// "SKVE" record's deadline only from kExpiringHeaderBytes (else `deadline_known` is false).
struct Header {
  uint32_t key_bytes = 0;
  uint64_t value_bytes = 0;
  size_t fixed_bytes = kFixedHeaderBytes;  // the key starts here
  int64_t deadline_ms = 0;                 // 0: none
  bool deadline_known = true;
  size_t header_bytes() const { return fixed_bytes + key_bytes; }
};
std::optional<Header> ReadFixedHeader(std::span<const std::byte> first);

// `key`'s value in the stored bytes and its deadline (0: none), or nullopt when they are not
// `key`'s (another key's record, a native block, a damaged header). A bridge key's value is the
// stored bytes. Whether the deadline has passed is the caller's to ask (Expired).
struct Stored {
  std::span<const std::byte> value;
  int64_t deadline_ms = 0;
};
std::optional<Stored> Parse(std::span<const std::byte> stored, std::string_view key);
// As Parse, the value alone, nullopt also when its deadline is at or before `now_ms`.
std::optional<std::span<const std::byte>> ValueOf(std::span<const std::byte> stored, std::string_view key,
                                                  int64_t now_ms);

// Unix time in milliseconds (Redis's mstime), the clock deadlines are kept in.
int64_t NowMs();
// Whether a record with `deadline_ms` is past it at `now_ms` (Redis: expired at the deadline).
inline bool Expired(int64_t deadline_ms, int64_t now_ms) { return deadline_ms != 0 && deadline_ms <= now_ms; }

}  // namespace sparsekv::server::resp
