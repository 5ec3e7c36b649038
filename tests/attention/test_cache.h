// Test caches for the attention kernels: an arena of pages of one format filled through the
// codec with Gaussian rows, and a shuffled block table, so that logical and physical order
// differ as they do in a real pool.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/paged_cache_view.h"

namespace sparsekv::attention::testing {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

struct TestCache {
  std::unique_ptr<std::byte, FreeDeleter> arena;
  uint64_t arena_bytes = 0;
  PagedCacheView view;
  std::vector<uint32_t> table;  // logical block -> physical block
  uint32_t seq_entries = 0;     // entries written for the sequence

  // Logical entry -> FlashMLA index.
  int32_t Index(uint64_t entry) const {
    return PhysicalIndex(table, view.block_entries, entry);
  }
};

// A cache of `num_blocks` physical pages, `seq_blocks` of which (a random subset, in random
// order) hold one sequence; every page is filled with N(0, sigma) rows.
inline TestCache MakeCache(StorageFormat format, uint32_t dims, uint32_t block_entries,
                           uint32_t num_blocks, uint32_t seq_blocks, uint32_t seed,
                           float sigma = 1.0f) {
  TestCache c;
  c.view.format = format;
  c.view.dims = dims;
  c.view.block_entries = block_entries;
  c.view.num_blocks = num_blocks;
  // A stride with a little slack past the page, as pools with several layers have.
  c.view.block_stride = (FormatPageBytes(format, dims, block_entries) + 64 + 63) / 64 * 64;
  c.arena_bytes = c.view.block_stride * num_blocks;
  c.arena.reset(static_cast<std::byte*>(std::aligned_alloc(64, c.arena_bytes)));
  std::memset(c.arena.get(), 0, c.arena_bytes);
  c.view.base = c.arena.get();
  auto codec = PageCodec::Create(format, dims, block_entries);
  EXPECT_TRUE(codec.ok()) << codec.status().ToString();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> rows(uint64_t{block_entries} * dims);
  for (uint32_t b = 0; b < num_blocks; ++b) {
    for (float& x : rows) x = normal(rng);
    EXPECT_TRUE(codec
                    ->WriteTokens(c.arena.get() + b * c.view.block_stride, 0,
                                  RowsView::Fp32(rows.data(), block_entries, dims))
                    .ok());
  }
  std::vector<uint32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.table.assign(perm.begin(), perm.begin() + seq_blocks);
  c.seq_entries = seq_blocks * block_entries;
  return c;
}

inline std::vector<uint16_t> RandomBf16(uint64_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = Bf16FromFloat(normal(rng));
  return v;
}

inline std::vector<SimdPath> Paths() { return SupportedSimdPaths(); }

}  // namespace sparsekv::attention::testing
