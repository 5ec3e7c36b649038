#include "server/resp_keys.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cstring>

namespace sparsekv::server::resp {
namespace {

// RESP keys' own seed, so that a RESP key and a native block never share a hash by design.
constexpr uint64_t kKeySeed = 0x7370617273656b76ull;  // "sparsekv"

}  // namespace

bool IsBridgeKey(std::string_view key) {
  if (key.size() != 32) return false;
  for (char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

wire::WireHash KeyHash(std::string_view key) {
  wire::WireHash out{};
  uint64_t lo = 0, hi = 0;
  if (IsBridgeKey(key)) {
    for (size_t i = 0; i < 32; ++i) {
      const char c = key[i];
      const uint64_t v = c <= '9' ? static_cast<uint64_t>(c - '0') : static_cast<uint64_t>(c - 'a' + 10);
      uint64_t& part = i < 16 ? hi : lo;
      part = (part << 4) | v;
    }
  } else {
    const XXH128_hash_t h = XXH3_128bits_withSeed(key.data(), key.size(), kKeySeed);
    lo = h.low64;
    hi = h.high64;
  }
  std::memcpy(out.data(), &lo, 8);
  std::memcpy(out.data() + 8, &hi, 8);
  return out;
}

std::string BridgeKeyOf(const wire::WireHash& hash) {
  uint64_t lo, hi;
  std::memcpy(&lo, hash.data(), 8);
  std::memcpy(&hi, hash.data() + 8, 8);
  return fmt::format("{:016x}{:016x}", hi, lo);
}

size_t HeaderBytes(std::string_view key) { return IsBridgeKey(key) ? 0 : kFixedHeaderBytes + key.size(); }

void WriteHeader(std::string_view key, uint64_t value_bytes, std::byte* out) {
  if (IsBridgeKey(key)) return;
  const uint32_t magic = kRecordMagic;
  const auto key_bytes = static_cast<uint32_t>(key.size());
  std::memcpy(out, &magic, 4);
  std::memcpy(out + 4, &key_bytes, 4);
  std::memcpy(out + 8, &value_bytes, 8);
  if (!key.empty()) std::memcpy(out + kFixedHeaderBytes, key.data(), key.size());
}

std::optional<Header> ReadFixedHeader(std::span<const std::byte> first) {
  if (first.size() < kFixedHeaderBytes) return std::nullopt;
  uint32_t magic;
  Header h;
  std::memcpy(&magic, first.data(), 4);
  std::memcpy(&h.key_bytes, first.data() + 4, 4);
  std::memcpy(&h.value_bytes, first.data() + 8, 8);
  if (magic != kRecordMagic || h.key_bytes > kMaxKeyBytes) return std::nullopt;
  return h;
}

std::optional<std::span<const std::byte>> ValueOf(std::span<const std::byte> stored, std::string_view key) {
  if (IsBridgeKey(key)) return stored;
  const std::optional<Header> h = ReadFixedHeader(stored);
  if (!h || h->key_bytes != key.size()) return std::nullopt;
  const uint64_t header = kFixedHeaderBytes + key.size();
  if (stored.size() < header || stored.size() - header != h->value_bytes) return std::nullopt;
  if (!key.empty() && std::memcmp(stored.data() + kFixedHeaderBytes, key.data(), key.size()) != 0) return std::nullopt;
  return stored.subspan(header);
}

}  // namespace sparsekv::server::resp
