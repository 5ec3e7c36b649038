// The SSD tier's coalesced reads (issue 47): records whose extents lie next to each other are
// read in shared I/Os, and each comes back with exactly its own bytes; a damaged record in a
// coalesced range fails alone, and an I/O error over several records fails only the record
// whose own read fails again.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "offload/uring_queue.h"
#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

constexpr uint64_t kUnit = 4096;

class SsdCoalesceTest : public ::testing::Test {
 protected:
  void Open(uint64_t io_bytes, uint64_t coalesce_bytes, uint64_t gap_bytes, uint32_t depth = 8) {
    tier_.reset();
    SsdTierOptions o;
    o.path = dir_.path();
    o.capacity_bytes = 256ull << 20;
    o.queue_depth = depth;
    o.io_bytes = io_bytes;
    o.read_coalesce_bytes = coalesce_bytes;
    o.read_gap_bytes = gap_bytes;
    o.slab_grow_bytes = 4 << 20;
    o.read_arena_bytes = 4 << 20;  // small: some groups land in heap memory
    o.durability = Durability::kNone;
    auto t = SsdTier::Open(o, &fault_);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tier_ = std::move(*t);
  }
  std::vector<Status> Put(const std::vector<BundlePtr>& b) { return tier_->Put(b).get(); }
  std::vector<Result<BundlePtr>> Get(const std::vector<uint64_t>& ids) {
    std::vector<BundleKey> keys;
    for (uint64_t id : ids) keys.push_back(KeyOf(id));
    return tier_->Get(keys).get();
  }
  uint64_t OffsetOf(uint64_t id) {
    auto l = tier_->Locate(KeyOf(id));
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? l->offset : 0;
  }

  testing::TempDir dir_{"ssdcoalesce"};
  FaultInjectionFileSystem fault_{FileSystem::Default(), 77};
  std::unique_ptr<SsdTier> tier_;
};

// Random sizes (one unit to several I/Os), holes punched by erasing, random subsets read in
// random order with repeats: every record comes back exactly, whatever range it shared.
TEST_F(SsdCoalesceTest, CoalescedReadsReturnExactlyEachRecord) {
  // 32 KiB I/Os, ranges of at most 160 KiB, gaps of up to 16 KiB read through.
  Open(32 << 10, 160 << 10, 16 << 10);
  std::mt19937_64 rng(2024);
  std::map<uint64_t, BundlePtr> held;
  std::vector<BundlePtr> batch;
  for (uint64_t id = 0; id < 160; ++id) {
    const uint64_t pick = rng() % 10;
    const uint64_t bytes = pick < 4 ? 200 + rng() % 3000           // one unit
                           : pick < 8 ? 5000 + rng() % 40000       // a few units, across I/Os
                                      : 70000 + rng() % 150000;    // several I/Os, past a range
    batch.push_back(MakeBundleOfBytes(id, bytes));
    held[id] = batch.back();
  }
  for (const Status& s : Put(batch)) ASSERT_TRUE(s.ok()) << s.ToString();
  // Holes: every record of one unit with an id divisible by 3 goes.
  std::vector<BundleKey> gone;
  for (auto it = held.begin(); it != held.end();) {
    if (it->first % 3 == 0 && it->second->record_bytes() <= kUnit) {
      gone.push_back(KeyOf(it->first));
      it = held.erase(it);
    } else {
      ++it;
    }
  }
  for (const Status& s : tier_->Erase(gone).get()) ASSERT_TRUE(s.ok()) << s.ToString();

  // The layout covers what the test is about: neighbours, small gaps and large ones.
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // (offset, end)
  for (const auto& [id, b] : held) {
    const uint64_t at = OffsetOf(id);
    spans.emplace_back(at, at + (b->record_bytes() + kUnit - 1) / kUnit * kUnit);
  }
  std::sort(spans.begin(), spans.end());
  int adjacent = 0, small_gaps = 0;
  for (size_t i = 1; i < spans.size(); ++i) {
    adjacent += spans[i].first == spans[i - 1].second;
    small_gaps += spans[i].first > spans[i - 1].second && spans[i].first - spans[i - 1].second <= (16 << 10);
  }
  EXPECT_GT(adjacent, 50);
  EXPECT_GT(small_gaps, 5);

  std::vector<uint64_t> ids;
  for (const auto& [id, b] : held) ids.push_back(id);
  for (int round = 0; round < 6; ++round) {
    std::vector<uint64_t> want = ids;
    if (round > 0) {
      std::shuffle(want.begin(), want.end(), rng);
      want.resize(want.size() / (round + 1) + 1);
      want.push_back(want[0]);  // the same key twice in one batch
      want.push_back(999999);   // and a miss
    }
    const SsdTierDetails d0 = tier_->Details();
    auto got = Get(want);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] == 999999) {
        EXPECT_TRUE(got[i].status().Is(StatusCode::kNotFound));
        continue;
      }
      ASSERT_TRUE(got[i].ok()) << want[i] << ": " << got[i].status().ToString();
      EXPECT_TRUE(SameBytes(**got[i], *held[want[i]])) << "record " << want[i] << " in round " << round;
    }
    if (round == 0) {
      EXPECT_GT(tier_->Details().coalesced_records - d0.coalesced_records, 50u);
    }
  }
  EXPECT_EQ(tier_->Stats().corrupt, 0u);
  EXPECT_EQ(tier_->Stats().io_errors, 0u);
  EXPECT_EQ(tier_->Details().arena_bytes_in_use, 0u);  // every shared buffer went back
}

// Coalescing off (ranges of one unit): the same bytes, one range per record.
TEST_F(SsdCoalesceTest, NoCoalescingReadsOneRangePerRecord) {
  Open(32 << 10, kUnit, 0);
  std::vector<BundlePtr> in;
  for (uint64_t id = 0; id < 12; ++id) in.push_back(MakeBundleOfBytes(id, 9000 + id * 1000));
  for (const Status& s : Put(in)) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint64_t> ids(12);
  for (uint64_t i = 0; i < 12; ++i) ids[i] = i;
  auto got = Get(ids);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *in[i]));
  }
  EXPECT_EQ(tier_->Details().coalesced_records, 0u);
  EXPECT_EQ(tier_->Details().read_groups, 12u);
}

TEST_F(SsdCoalesceTest, DamagedRecordInACoalescedRangeFailsAlone) {
  Open(64 << 10, 8 << 20, 32 << 10);
  std::vector<BundlePtr> in;
  for (uint64_t id = 0; id < 8; ++id) in.push_back(MakeBundleOfBytes(id, 50000));
  for (const Status& s : Put(in)) ASSERT_TRUE(s.ok()) << s.ToString();
  for (uint64_t id = 1; id < 8; ++id) ASSERT_EQ(OffsetOf(id), OffsetOf(id - 1) + 53248) << "not adjacent";
  const uint64_t bad = 3;
  auto loc = tier_->Locate(KeyOf(bad));
  ASSERT_TRUE(loc.ok());
  ASSERT_TRUE(fault_.FlipBitInFile(loc->file, loc->offset + 30000, 5).ok());
  auto got = Get({0, 1, 2, 3, 4, 5, 6, 7});
  for (uint64_t id = 0; id < 8; ++id) {
    if (id == bad) {
      EXPECT_TRUE(got[id].status().Is(StatusCode::kCorruption)) << got[id].status().ToString();
      EXPECT_TRUE(got[id].status().data_loss());
      continue;
    }
    ASSERT_TRUE(got[id].ok()) << id << ": " << got[id].status().ToString();
    EXPECT_TRUE(SameBytes(**got[id], *in[id])) << id;
  }
  EXPECT_EQ(tier_->Details().coalesced_records, 8u);
  EXPECT_EQ(tier_->Stats().corrupt, 1u);
  // The damaged record is erased; its neighbours stay, coalesced again around the hole.
  got = Get({0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_TRUE(got[bad].status().Is(StatusCode::kNotFound)) << got[bad].status().ToString();
  for (uint64_t id = 0; id < 8; ++id) {
    if (id != bad) {
      EXPECT_TRUE(got[id].ok() && SameBytes(**got[id], *in[id])) << id;
    }
  }
}

// One I/O over eight records fails: each is read again alone, and only the one whose own read
// fails again is reported (an I/O error, not corruption: it stays stored).
TEST_F(SsdCoalesceTest, IoErrorOverACoalescedRangeFailsOnlyTheRecordThatFailsAlone) {
  Open(1 << 20, 8 << 20, 32 << 10);
  std::vector<BundlePtr> in;
  for (uint64_t id = 0; id < 8; ++id) in.push_back(MakeBundleOfBytes(id, 20000));
  for (const Status& s : Put(in)) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint64_t> ids = {7, 2, 5, 0, 1, 3, 6, 4};
  // The first fault hits the one I/O of the range; the second, the first record read alone.
  fault_.AddRule({FaultOp::kRead, FaultKind::kEio, "data.dat", 2, 1.0});
  auto got = Get(ids);
  int failed = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!got[i].ok()) {
      ++failed;
      EXPECT_TRUE(got[i].status().Is(StatusCode::kIOError)) << got[i].status().ToString();
      EXPECT_FALSE(got[i].status().data_loss());
      EXPECT_NE(got[i].status().ToString().find("data.dat"), std::string::npos);
      EXPECT_EQ(ids[i], 0u) << "the record first in the file is read alone first";
      continue;
    }
    EXPECT_TRUE(SameBytes(**got[i], *in[ids[i]])) << ids[i];
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(tier_->Stats().io_errors, 2u);
  EXPECT_EQ(tier_->Stats().corrupt, 0u);
  // Still stored: the device's error was not the record's.
  got = Get(ids);
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_TRUE(got[i].ok() && SameBytes(**got[i], *in[ids[i]])) << ids[i];
  // Short reads inside coalesced I/Os are continued.
  fault_.AddRule({FaultOp::kRead, FaultKind::kShortRead, "data.dat", 10, 1.0});
  got = Get(ids);
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_TRUE(got[i].ok() && SameBytes(**got[i], *in[ids[i]])) << ids[i];
}

// Many batches at once (a restore asks for several chunks ahead): each answered once, with its
// own records, while the ring streams across them.
TEST_F(SsdCoalesceTest, ConcurrentBatchesStreamThroughOneRing) {
  Open(64 << 10, 1 << 20, 32 << 10, 4);
  std::vector<BundlePtr> in;
  for (uint64_t id = 0; id < 64; ++id) in.push_back(MakeBundleOfBytes(id, 30000 + (id % 5) * 7000));
  for (const Status& s : Put(in)) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<std::future<std::vector<Result<BundlePtr>>>> futures;
  for (uint64_t c = 0; c < 16; ++c) {
    std::vector<BundleKey> keys;
    for (uint64_t id = c * 4; id < c * 4 + 4; ++id) keys.push_back(KeyOf(id));
    futures.push_back(tier_->Get(keys));
  }
  for (uint64_t c = 0; c < 16; ++c) {
    auto got = futures[c].get();
    ASSERT_EQ(got.size(), 4u);
    for (uint64_t j = 0; j < 4; ++j) {
      ASSERT_TRUE(got[j].ok()) << got[j].status().ToString();
      EXPECT_TRUE(SameBytes(**got[j], *in[c * 4 + j]));
    }
  }
  EXPECT_EQ(tier_->Stats().hits, 64u);
}

TEST_F(SsdCoalesceTest, RejectsBadReadOptions) {
  SsdTierOptions o;
  o.path = dir_.path();
  o.read_gap_bytes = 1000;
  EXPECT_TRUE(SsdTier::Open(o).status().Is(StatusCode::kInvalidArgument));
  o.read_gap_bytes = 0;
  o.read_coalesce_bytes = 2ull << 30;
  EXPECT_TRUE(SsdTier::Open(o).status().Is(StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace sparsekv
