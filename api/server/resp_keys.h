// How a RESP key names a stored block, and how its record holds the key.
//
// A key of exactly 32 lowercase hex digits is a *bridge key*: it names the native block hash it
// spells (the high 64 bits first, as `sparsekv get` prints hashes), and its value is stored as
// it is, so a block PUT through the native protocol is read through RESP and the reverse.
//
// Any other key (any bytes, up to kMaxKeyBytes) is filed under the XXH3-128 of the key with a
// seed of RESP's own, and its value is stored behind a header that holds the whole key:
//   0  u32 magic "SKVR"   4  u32 key bytes   8  u64 value bytes   16  the key   then the value
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

inline constexpr uint32_t kRecordMagic = 0x52564b53;  // "SKVR" read as little-endian bytes
inline constexpr size_t kMaxKeyBytes = 64u << 10;
inline constexpr size_t kFixedHeaderBytes = 16;

bool IsBridgeKey(std::string_view key);
// The block hash a key is filed under.
wire::WireHash KeyHash(std::string_view key);
// The key of a block hash as SCAN shows a bridge key (32 lowercase hex digits, high bits first).
std::string BridgeKeyOf(const wire::WireHash& hash);

// Bytes of the header before a value for `key` (0 for a bridge key: its value is stored bare).
size_t HeaderBytes(std::string_view key);
// Writes the header for `key` and a value of `value_bytes` into `out` (HeaderBytes(key) bytes).
void WriteHeader(std::string_view key, uint64_t value_bytes, std::byte* out);

// What a stored record says of itself, from its first bytes (at least kFixedHeaderBytes).
struct Header {
  uint32_t key_bytes = 0;
  uint64_t value_bytes = 0;
};
std::optional<Header> ReadFixedHeader(std::span<const std::byte> first);

// The value of `key` in the stored bytes, or nullopt when they are not `key`'s (another key's
// record, a native block, a damaged header). A bridge key's value is the stored bytes.
std::optional<std::span<const std::byte>> ValueOf(std::span<const std::byte> stored, std::string_view key);

}  // namespace sparsekv::server::resp
