// A page content that names its block: tests write it where an engine would write KV data, and
// check later that a page (kept, evicted, demoted, restored) still holds that block's bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "sparsekv/block_hash.h"

namespace sparsekv::testing {

// The pattern's seed for one pool's page of the block with hash `h`.
inline uint64_t PatternSeed(const BlockHash& h, size_t pool) {
  return h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull) ^ ((pool + 1) * 0xbf58476d1ce4e5b9ull);
}

// splitmix64: the next word of the pattern.
inline uint64_t PatternWord(uint64_t& x) {
  x += 0x9e3779b97f4a7c15ull;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline void FillPattern(std::byte* d, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = PatternWord(seed);
    std::memcpy(d + i, &v, 8);
  }
}

inline bool HoldsPattern(const std::byte* d, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = PatternWord(seed);
    if (std::memcmp(d + i, &v, 8) != 0) return false;
  }
  return true;
}

}  // namespace sparsekv::testing
