// Keys and values the daemon tests send: a block hash numbered `i` and tagged per test file
// (so two files' keys never meet), and `n` pseudo-random bytes from a seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "sparsekv/client.h"

namespace sparsekv::testing {

inline WireBlockHash TaggedHash(uint64_t i, std::byte tag) {
  WireBlockHash h{};
  std::memcpy(h.data(), &i, 8);
  h[15] = tag;
  return h;
}

inline std::vector<std::byte> RandomValue(uint64_t seed, size_t n) {
  std::vector<std::byte> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = std::byte(rng());
  return v;
}

}  // namespace sparsekv::testing
