// How bundle keys are spelled as RocksDB keys: a tag byte, then the namespace id and the hash
// big-endian, so byte order is numeric order and a namespace's keys are contiguous.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "sparsekv/bundle.h"

namespace sparsekv::offload {

inline constexpr char kBundleKeyTag = 'k';
inline constexpr size_t kEncodedKeyBytes = 1 + 4 + 8 + 8;

inline void PutBigEndian(std::string& out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t GetBigEndian(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<uint8_t>(in[at + i]);
  return v;
}

inline std::string EncodeBundleKey(const BundleKey& key) {
  std::string out;
  out.reserve(kEncodedKeyBytes);
  out.push_back(kBundleKeyTag);
  PutBigEndian(out, key.namespace_id, 4);
  PutBigEndian(out, key.hash.hi, 8);
  PutBigEndian(out, key.hash.lo, 8);
  return out;
}

inline std::optional<BundleKey> DecodeBundleKey(std::string_view in) {
  if (in.size() != kEncodedKeyBytes || in[0] != kBundleKeyTag) return std::nullopt;
  BundleKey k;
  k.namespace_id = static_cast<uint32_t>(GetBigEndian(in, 1, 4));
  k.hash.hi = GetBigEndian(in, 5, 8);
  k.hash.lo = GetBigEndian(in, 13, 8);
  return k;
}

}  // namespace sparsekv::offload
