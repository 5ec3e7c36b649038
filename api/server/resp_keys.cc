#include "server/resp_keys.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <chrono>
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

size_t HeaderBytes(std::string_view key, bool expiring) {
  if (IsBridgeKey(key)) return 0;
  return (expiring ? kExpiringHeaderBytes : kFixedHeaderBytes) + key.size();
}

void WriteHeader(std::string_view key, uint64_t value_bytes, std::byte* out, int64_t deadline_ms) {
  const uint32_t magic = deadline_ms != 0 ? kExpiringMagic : kRecordMagic;
  const auto key_bytes = static_cast<uint32_t>(key.size());
  std::memcpy(out, &magic, 4);
  std::memcpy(out + 4, &key_bytes, 4);
  std::memcpy(out + 8, &value_bytes, 8);
  size_t at = kFixedHeaderBytes;
  if (deadline_ms != 0) {
    std::memcpy(out + at, &deadline_ms, 8);
    at = kExpiringHeaderBytes;
  }
  if (!key.empty()) std::memcpy(out + at, key.data(), key.size());
}

std::optional<Header> ReadFixedHeader(std::span<const std::byte> first) {
  if (first.size() < kFixedHeaderBytes) return std::nullopt;
  uint32_t magic;
  Header h;
  std::memcpy(&magic, first.data(), 4);
  std::memcpy(&h.key_bytes, first.data() + 4, 4);
  std::memcpy(&h.value_bytes, first.data() + 8, 8);
  if ((magic != kRecordMagic && magic != kExpiringMagic) || h.key_bytes > kMaxKeyBytes) return std::nullopt;
  if (magic == kExpiringMagic) {
    h.fixed_bytes = kExpiringHeaderBytes;
    h.deadline_known = first.size() >= kExpiringHeaderBytes;
    if (h.deadline_known) {
      std::memcpy(&h.deadline_ms, first.data() + kFixedHeaderBytes, 8);
      if (h.deadline_ms == 0) return std::nullopt;  // never written so: damaged
    }
  }
  return h;
}

std::optional<Stored> Parse(std::span<const std::byte> stored, std::string_view key) {
  if (IsBridgeKey(key)) return Stored{stored, 0};
  const std::optional<Header> h = ReadFixedHeader(stored);
  if (!h || !h->deadline_known || h->key_bytes != key.size()) return std::nullopt;
  const uint64_t header = h->header_bytes();
  if (stored.size() < header || stored.size() - header != h->value_bytes) return std::nullopt;
  if (!key.empty() && std::memcmp(stored.data() + h->fixed_bytes, key.data(), key.size()) != 0) return std::nullopt;
  return Stored{stored.subspan(header), h->deadline_ms};
}

std::optional<std::span<const std::byte>> ValueOf(std::span<const std::byte> stored, std::string_view key,
                                                  int64_t now_ms) {
  const std::optional<Stored> s = Parse(stored, key);
  if (!s || Expired(s->deadline_ms, now_ms)) return std::nullopt;
  return s->value;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace sparsekv::server::resp
