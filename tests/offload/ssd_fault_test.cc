// The SSD tier under injected faults: every fault gives a clear error for the operations it
// hits, the tier keeps working, and nothing acknowledged is lost or returned corrupt.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

class SsdFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(); }
  void Reopen() {
    tier_.reset();
    SsdTierOptions o;
    o.path = dir_.path();
    o.capacity_bytes = 64ull << 20;
    o.queue_depth = 8;
    o.io_bytes = 32 << 10;
    o.slab_grow_bytes = 1 << 20;
    o.read_arena_bytes = 16 << 20;
    auto t = SsdTier::Open(o, &fault_);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tier_ = std::move(*t);
  }
  std::vector<Status> Put(const std::vector<BundlePtr>& b) { return tier_->Put(b).get(); }
  Result<BundlePtr> GetOne(uint64_t id) { return std::move(tier_->Get({KeyOf(id)}).get()[0]); }
  void ExpectIntact(uint64_t id, const BundlePtr& want) {
    auto got = GetOne(id);
    ASSERT_TRUE(got.ok()) << id << ": " << got.status().ToString();
    EXPECT_TRUE(SameBytes(**got, *want)) << id;
  }
  std::vector<BundlePtr> Acked(uint64_t first, uint64_t n, uint64_t bytes = 100000) {
    std::vector<BundlePtr> v;
    for (uint64_t i = first; i < first + n; ++i) v.push_back(MakeBundleOfBytes(i, bytes));
    for (const Status& s : Put(v)) EXPECT_TRUE(s.ok()) << s.ToString();
    return v;
  }

  testing::TempDir dir_{"ssdfault"};
  FaultInjectionFileSystem fault_{FileSystem::Default(), 1234};
  std::unique_ptr<SsdTier> tier_;
};

TEST_F(SsdFaultTest, WriteEioFailsOnlyTheItemsItHits) {
  auto before = Acked(0, 4);
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEio, "data.dat", 1, 1.0});
  std::vector<BundlePtr> batch;
  for (uint64_t i = 10; i < 16; ++i) batch.push_back(MakeBundleOfBytes(i, 100000));
  auto st = Put(batch);
  int failed = 0;
  for (const Status& s : st) {
    if (s.ok()) continue;
    ++failed;
    EXPECT_TRUE(s.Is(StatusCode::kIOError)) << s.ToString();
    EXPECT_NE(s.ToString().find("Input/output error"), std::string::npos) << s.ToString();
    EXPECT_NE(s.ToString().find("data.dat"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(tier_->Stats().io_errors, 1u);
  for (size_t i = 0; i < before.size(); ++i) ExpectIntact(i, before[i]);
  Reopen();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (st[i].ok()) {
      ExpectIntact(10 + i, batch[i]);
    } else {
      EXPECT_TRUE(
          GetOne(10 + i).status().Is(StatusCode::kNotFound));  // never acknowledged, never indexed
    }
  }
  for (size_t i = 0; i < before.size(); ++i) ExpectIntact(i, before[i]);
}

TEST_F(SsdFaultTest, TornWriteIsAFailedPutAndLeavesNothingBehind) {
  auto before = Acked(0, 3);
  fault_.AddRule({FaultOp::kWrite, FaultKind::kTornWrite, "data.dat", 1, 1.0});
  auto st = Put({MakeBundleOfBytes(20, 100000)});
  EXPECT_TRUE(st[0].Is(StatusCode::kIOError)) << st[0].ToString();
  Reopen();
  EXPECT_TRUE(GetOne(20).status().Is(StatusCode::kNotFound));
  for (size_t i = 0; i < before.size(); ++i) ExpectIntact(i, before[i]);
  ASSERT_TRUE(Put({MakeBundleOfBytes(20, 100000)})[0].ok());  // the slot is reused cleanly
  ExpectIntact(20, MakeBundleOfBytes(20, 100000));
}

TEST_F(SsdFaultTest, EnospcWhileGrowingIsRetryableAndRecovers) {
  fault_.AddRule({FaultOp::kAllocate, FaultKind::kEnospc, "data.dat", 1, 1.0});
  auto st = Put({MakeBundleOfBytes(1, 100000)});
  EXPECT_TRUE(st[0].Is(StatusCode::kResourceExhausted)) << st[0].ToString();
  EXPECT_TRUE(st[0].retryable());
  EXPECT_NE(st[0].ToString().find("No space left"), std::string::npos) << st[0].ToString();
  ASSERT_TRUE(Put({MakeBundleOfBytes(1, 100000)})[0].ok());
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEnospc, "data.dat", 1, 1.0});
  st = Put({MakeBundleOfBytes(2, 100000)});
  EXPECT_TRUE(st[0].Is(StatusCode::kResourceExhausted)) << st[0].ToString();
  ExpectIntact(1, MakeBundleOfBytes(1, 100000));
}

TEST_F(SsdFaultTest, FailedFdatasyncAcknowledgesNothing) {
  fault_.AddRule({FaultOp::kSync, FaultKind::kEio, "data.dat", 1, 1.0});
  auto st = Put({MakeBundleOfBytes(1, 50000), MakeBundleOfBytes(2, 50000)});
  EXPECT_TRUE(st[0].Is(StatusCode::kIOError)) << st[0].ToString();
  EXPECT_NE(st[0].ToString().find("fdatasync"), std::string::npos);
  EXPECT_TRUE(st[1].Is(StatusCode::kIOError));
  EXPECT_FALSE(tier_->Contains({KeyOf(1)}).get()[0]);
  auto ok = Acked(3, 1);
  Reopen();
  EXPECT_TRUE(GetOne(1).status().Is(StatusCode::kNotFound));
  ExpectIntact(3, ok[0]);
}

TEST_F(SsdFaultTest, ShortReadsAreContinued) {
  auto in = Acked(0, 5);
  fault_.AddRule({FaultOp::kRead, FaultKind::kShortRead, "data.dat", 20, 1.0});
  for (size_t i = 0; i < in.size(); ++i) ExpectIntact(i, in[i]);
  EXPECT_GT(fault_.Stats().short_reads, 5u);
  EXPECT_EQ(tier_->Stats().corrupt, 0u);
}

TEST_F(SsdFaultTest, ReadEioIsReportedAndTheBundleStays) {
  auto in = Acked(0, 2);
  fault_.AddRule({FaultOp::kRead, FaultKind::kEio, "data.dat", 1, 1.0});
  auto got = GetOne(0);
  EXPECT_TRUE(got.status().Is(StatusCode::kIOError)) << got.status().ToString();
  EXPECT_FALSE(got.status().data_loss());
  ExpectIntact(0, in[0]);  // a device error is not a corrupt bundle: it is still there
  EXPECT_EQ(tier_->Stats().io_errors, 1u);
}

TEST_F(SsdFaultTest, FlippedBitsAreDetectedNeverReturned) {
  auto in = Acked(0, 3);
  fault_.AddRule({FaultOp::kRead, FaultKind::kFlipBit, "data.dat", 1, 1.0});
  auto got = GetOne(1);
  EXPECT_TRUE(got.status().Is(StatusCode::kCorruption)) << got.status().ToString();
  EXPECT_TRUE(got.status().data_loss());
  EXPECT_EQ(tier_->Stats().corrupt, 1u);
  EXPECT_TRUE(GetOne(1).status().Is(StatusCode::kNotFound));  // erased
  // Silent damage on the way to the disk: acknowledged, then caught by the checksum.
  fault_.AddRule({FaultOp::kWrite, FaultKind::kFlipBit, "data.dat", 1, 1.0});
  ASSERT_TRUE(Put({MakeBundleOfBytes(9, 100000)})[0].ok());
  Reopen();
  EXPECT_TRUE(GetOne(9).status().Is(StatusCode::kCorruption));
  ExpectIntact(0, in[0]);
  ExpectIntact(2, in[2]);
}

TEST_F(SsdFaultTest, RandomFaultsNeverLoseOrCorruptAcknowledgedBundles) {
  std::map<uint64_t, BundlePtr> acked;
  std::mt19937_64 rng(99);
  for (FaultKind k : {FaultKind::kEio, FaultKind::kTornWrite, FaultKind::kEnospc}) {
    fault_.AddRule({FaultOp::kWrite, k, "data.dat", UINT64_MAX, 0.03});
  }
  fault_.AddRule({FaultOp::kRead, FaultKind::kEio, "data.dat", UINT64_MAX, 0.03});
  fault_.AddRule({FaultOp::kRead, FaultKind::kShortRead, "data.dat", UINT64_MAX, 0.05});
  fault_.AddRule({FaultOp::kSync, FaultKind::kEio, "data.dat", UINT64_MAX, 0.05});
  fault_.AddRule({FaultOp::kAllocate, FaultKind::kEnospc, "data.dat", UINT64_MAX, 0.1});
  int wrong = 0;
  for (int round = 0; round < 30; ++round) {
    std::vector<BundlePtr> batch;
    for (int i = 0; i < 6; ++i)
      batch.push_back(MakeBundleOfBytes(rng() % 40, 10000 + rng() % 150000, round));
    auto st = Put(batch);
    for (size_t i = 0; i < batch.size(); ++i) {
      const uint64_t id = batch[i]->key().hash.lo;
      if (st[i].ok()) {
        acked[id] = batch[i];
      }
      // A failed replacement leaves the old version in place: still acknowledged.
    }
    std::vector<BundleKey> keys;
    for (int i = 0; i < 8; ++i) keys.push_back(KeyOf(rng() % 40));
    auto got = tier_->Get(keys).get();
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!got[i].ok()) continue;
      auto it = acked.find(keys[i].hash.lo);
      if (it == acked.end() || !SameBytes(**got[i], *it->second)) ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_GT(fault_.Stats().injected, 10u);
  EXPECT_EQ(tier_->Stats().corrupt, 0u);
  fault_.ClearRules();
  Reopen();
  for (const auto& [id, b] : acked) ExpectIntact(id, b);
}

}  // namespace
}  // namespace sparsekv
