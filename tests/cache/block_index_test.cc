#include "cache/block_index.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

namespace sparsekv::cache_internal {
namespace {

TEST(BlockIndex, InsertFindErase) {
  BlockIndex idx(8);
  EXPECT_EQ(idx.Find(BlockHash{1, 2}), kNoRecord);
  idx.Insert(BlockHash{1, 2}, 7);
  idx.Insert(BlockHash{3, 4}, 9);
  EXPECT_EQ(idx.Find(BlockHash{1, 2}), 7u);
  EXPECT_EQ(idx.Find(BlockHash{3, 4}), 9u);
  EXPECT_EQ(idx.Find(BlockHash{1, 3}), kNoRecord);  // same low bits, other key
  EXPECT_TRUE(idx.Erase(BlockHash{1, 2}));
  EXPECT_FALSE(idx.Erase(BlockHash{1, 2}));
  EXPECT_EQ(idx.Find(BlockHash{1, 2}), kNoRecord);
  EXPECT_EQ(idx.size(), 1u);
  idx.Clear();
  EXPECT_EQ(idx.Find(BlockHash{3, 4}), kNoRecord);
  EXPECT_EQ(idx.size(), 0u);
}

TEST(BlockIndex, CollidingHomeSlotsSurviveBackwardShiftDeletion) {
  // Keys whose low bits pick the same few slots, including runs that wrap around the table end.
  BlockIndex idx(32);
  const uint64_t slots = idx.slot_count();
  std::unordered_map<uint64_t, RecordId> model;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t home = (rng() % 3 == 0) ? slots - 1 - rng() % 2 : rng() % 4;
    const BlockHash key{home + slots * (rng() % 8), rng() % 3};
    const uint64_t k = key.lo * 4 + key.hi;
    auto it = model.find(k);
    if (it == model.end() && model.size() < 32) {
      idx.Insert(key, static_cast<RecordId>(step));
      model[k] = static_cast<RecordId>(step);
    } else if (it != model.end()) {
      ASSERT_EQ(idx.Find(key), it->second);
      ASSERT_TRUE(idx.Erase(key));
      model.erase(it);
    }
    ASSERT_EQ(idx.size(), model.size());
    for (const auto& [mk, rec] : model) ASSERT_EQ(idx.Find(BlockHash{mk / 4, mk % 4}), rec);
  }
}

}  // namespace
}  // namespace sparsekv::cache_internal
