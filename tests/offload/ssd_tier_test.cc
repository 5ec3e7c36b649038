#include "sparsekv/ssd_tier.h"

#include <gtest/gtest.h>

#include <rocksdb/db.h>

#include <filesystem>
#include <thread>

#include "sparsekv/fault_injection_file_system.h"
#include "tests/offload/key_journal_check.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::CheckJournalMirrorsListing;
using testing::SameBytes;

SsdTierOptions SmallOptions(const std::string& path) {
  SsdTierOptions o;
  o.path = path;
  o.capacity_bytes = 64ull << 20;
  o.queue_depth = 8;
  o.io_bytes = 64 << 10;  // records of several I/Os
  o.slab_grow_bytes = 1 << 20;
  o.max_record_bytes = 4 << 20;
  o.read_arena_bytes = 16 << 20;
  return o;
}

std::unique_ptr<SsdTier> OpenSsd(const SsdTierOptions& o, FileSystem* fs = nullptr) {
  auto t = SsdTier::Open(o, fs);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

// The space a record takes in the data file: its size rounded up to 4 KiB.
uint64_t Aligned(uint64_t record_bytes) { return (record_bytes + 4095) / 4096 * 4096; }

TEST(SsdTier, RoundTripManySizes) {
  testing::TempDir dir("ssd");
  auto tier = OpenSsd(SmallOptions(dir.path()));
  ASSERT_TRUE(tier);
  std::vector<BundlePtr> in;
  const uint64_t sizes[] = {10, 4000, 4096, 5000, 65536, 65537, 200000, 1 << 20, 3 << 20};
  for (uint64_t i = 0; i < std::size(sizes); ++i) in.push_back(MakeBundleOfBytes(i, sizes[i]));
  auto st = tier->Put(in).get();
  for (size_t i = 0; i < st.size(); ++i) EXPECT_TRUE(st[i].ok()) << i << ": " << st[i].ToString();
  std::vector<BundleKey> keys;
  for (auto& b : in) keys.push_back(b->key());
  keys.push_back(KeyOf(999));
  auto got = tier->Get(keys).get();
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *in[i])) << i;
  }
  EXPECT_TRUE(got.back().status().Is(StatusCode::kNotFound));
  TierStats s = tier->Stats();
  EXPECT_EQ(s.items, in.size());
  EXPECT_EQ(s.hits, in.size());
  EXPECT_EQ(s.misses, 1u);
  uint64_t taken = 0;
  for (auto& b : in) taken += Aligned(b->record_bytes());
  EXPECT_EQ(tier->Details().allocated_bytes - tier->Details().free_bytes, taken)
      << "each record takes its size rounded to 4 KiB, nothing more";
  SsdTierDetails d = tier->Details();
  EXPECT_TRUE(d.buffers_registered);
  EXPECT_GT(d.fixed_ios, 0u);  // reads landed in the registered arena
  EXPECT_GT(d.arena_bytes_in_use, 0u);
  got.clear();
  EXPECT_EQ(tier->Details().arena_bytes_in_use, 0u)
      << "the bundles read are gone, and so are their runs";
  auto loc = tier->Locate(KeyOf(2));
  ASSERT_TRUE(loc.ok());
  EXPECT_EQ(loc->record_bytes, in[2]->record_bytes());
  EXPECT_EQ(loc->segment_bytes.size(), 3u);
  EXPECT_EQ(loc->offset % 4096, 0u);
}

TEST(SsdTier, PerItemResultsInOneBatch) {
  testing::TempDir dir("ssd");
  auto tier = OpenSsd(SmallOptions(dir.path()));
  auto st = tier->Put({MakeBundleOfBytes(1, 1000), MakeBundleOfBytes(2, 5 << 20), nullptr,
                       MakeBundleOfBytes(3, 1000)})
                .get();
  EXPECT_TRUE(st[0].ok());
  EXPECT_TRUE(st[1].Is(StatusCode::kInvalidArgument)) << st[1].ToString();
  EXPECT_NE(st[1].ToString().find("max_record_bytes"), std::string::npos);
  EXPECT_TRUE(st[2].Is(StatusCode::kInvalidArgument));
  EXPECT_TRUE(st[3].ok());
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(2), KeyOf(3)}).get(),
            (std::vector<bool>{true, false, true}));
}

TEST(SsdTier, ReplaceEraseAndSlotReuseKeepTheFileSize) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  const uint64_t cb = Aligned(MakeBundleOfBytes(0, 60000)->record_bytes());
  o.slab_grow_bytes = 8 * cb;  // room for 8 records at a time
  auto tier = OpenSsd(o);
  for (uint64_t round = 0; round < 5; ++round) {
    std::vector<BundlePtr> batch;
    for (uint64_t i = 0; i < 8; ++i) batch.push_back(MakeBundleOfBytes(i, 60000, round));
    for (const Status& s : tier->Put(batch).get()) ASSERT_TRUE(s.ok()) << s.ToString();
    if (round % 2 == 1) {
      for (const Status& s : tier->Erase({KeyOf(0), KeyOf(1), KeyOf(2)}).get()) ASSERT_TRUE(s.ok());
    }
  }
  auto got = tier->Get({KeyOf(0), KeyOf(7)}).get();
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundleOfBytes(0, 60000, 4)));
  EXPECT_TRUE(SameBytes(**got[1], *MakeBundleOfBytes(7, 60000, 4)));
  // Replacements write to fresh space first, so at most 16 records' space was ever needed.
  EXPECT_LE(tier->Details().allocated_bytes, 16u * cb);
  EXPECT_EQ(tier->Stats().items, 8u);
  EXPECT_EQ(tier->Stats().erased, 6u);
  // Putting the same bundle again writes nothing.
  const uint64_t written = tier->Stats().bytes_written;
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(3, 60000, 4)}).get()[0].ok());
  EXPECT_EQ(tier->Stats().bytes_written, written);
}

TEST(SsdTier, EvictsLeastRecentlyUsedAtCapacity) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  const uint64_t cb = Aligned(MakeBundleOfBytes(0, 60000)->record_bytes());
  o.capacity_bytes = 4 * cb;
  o.slab_grow_bytes = cb;
  auto tier = OpenSsd(o);
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(i, 60000)}).get()[0].ok());
  ASSERT_TRUE(tier->Get({KeyOf(0)}).get()[0].ok());
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(4, 60000)}).get()[0].ok());
  EXPECT_EQ(tier->Contains({KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3), KeyOf(4)}).get(),
            (std::vector<bool>{true, false, true, true, true}));
  EXPECT_EQ(tier->Stats().evictions, 1u);
  EXPECT_EQ(tier->Details().allocated_bytes, 4u * cb);
  // A larger record evicts least recently used bundles until a free extent holds it.
  auto big = tier->Put({MakeBundleOfBytes(9, 200000)}).get();
  EXPECT_TRUE(big[0].ok()) << big[0].ToString();
  EXPECT_TRUE(tier->Contains({KeyOf(9)}).get()[0]);
  // One larger than the whole tier is refused cleanly, and nothing is evicted for it.
  const uint64_t evictions = tier->Stats().evictions;
  auto huge = tier->Put({MakeBundleOfBytes(10, 5 * 60000)}).get();
  EXPECT_TRUE(huge[0].Is(StatusCode::kInvalidArgument)) << huge[0].ToString();
  EXPECT_EQ(tier->Stats().evictions, evictions);
  EXPECT_TRUE(tier->Contains({KeyOf(9)}).get()[0]);
  // The evictions survive a restart: the evicted keys do not come back.
  tier.reset();
  tier = OpenSsd(o);
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(2), KeyOf(9)}).get(),
            (std::vector<bool>{false, false, true}));
}

class SsdRestart : public ::testing::TestWithParam<Durability> {};

TEST_P(SsdRestart, EveryAcknowledgedBundleIsFoundByteIdenticalAfterReopen) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  o.durability = GetParam();
  std::vector<BundlePtr> in;
  for (uint64_t i = 0; i < 40; ++i) in.push_back(MakeBundleOfBytes(i, 1000 + i * 9000));
  {
    auto tier = OpenSsd(o);
    for (size_t at = 0; at < in.size(); at += 10) {
      std::vector<BundlePtr> batch(in.begin() + at, in.begin() + at + 10);
      for (const Status& s : tier->Put(batch).get()) ASSERT_TRUE(s.ok()) << s.ToString();
    }
    for (const Status& s : tier->Erase({KeyOf(5), KeyOf(6)}).get()) ASSERT_TRUE(s.ok());
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(7, 1000 + 7 * 9000, 1)}).get()[0].ok());
  }
  auto tier = OpenSsd(o);
  EXPECT_EQ(tier->Details().recovered, 38u);
  std::vector<BundleKey> keys;
  for (auto& b : in) keys.push_back(b->key());
  auto got = tier->Get(keys).get();
  for (size_t i = 0; i < in.size(); ++i) {
    if (i == 5 || i == 6) {
      EXPECT_TRUE(got[i].status().Is(StatusCode::kNotFound)) << i;
      continue;
    }
    ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], i == 7 ? *MakeBundleOfBytes(7, 1000 + 7 * 9000, 1) : *in[i]))
        << i;
  }
  // Free slots were rebuilt: new puts reuse them instead of growing the files.
  const uint64_t allocated = tier->Details().allocated_bytes;
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(100, 1000 + 5 * 9000)}).get()[0].ok());
  EXPECT_EQ(tier->Details().allocated_bytes, allocated);
}

INSTANTIATE_TEST_SUITE_P(Durability, SsdRestart,
                         ::testing::Values(Durability::kNone, Durability::kFdatasync,
                                           Durability::kDsync),
                         [](const auto& info) { return std::string(DurabilityName(info.param)); });

TEST(SsdTier, DamagedSlabBytesAreDetectedAfterRestartAndDropped) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  std::vector<SsdRecordLocation> where;
  {
    auto tier = OpenSsd(o);
    std::vector<BundlePtr> in;
    for (uint64_t i = 0; i < 6; ++i) in.push_back(MakeBundleOfBytes(i, 30000));
    for (const Status& s : tier->Put(in).get()) ASSERT_TRUE(s.ok());
    for (uint64_t i = 0; i < 3; ++i) where.push_back(*tier->Locate(KeyOf(i)));
  }
  FaultInjectionFileSystem fault(FileSystem::Default());
  ASSERT_TRUE(fault.FlipBitInFile(where[0].file, where[0].offset + 100, 3).ok());  // payload
  ASSERT_TRUE(fault.FlipBitInFile(where[1].file, where[1].offset + 20, 0).ok());   // key in header
  ASSERT_TRUE(fault.FlipBitInFile(where[2].file, where[2].offset + where[2].record_bytes - 1, 7)
                  .ok());  // last byte
  auto tier = OpenSsd(o);
  auto got = tier->Get({KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3)}).get();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(got[i].status().Is(StatusCode::kCorruption))
        << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(got[i].status().data_loss());
  }
  EXPECT_TRUE(got[3].ok());
  EXPECT_EQ(tier->Stats().corrupt, 3u);
  EXPECT_EQ(tier->Contains({KeyOf(0), KeyOf(1), KeyOf(2)}).get(),
            (std::vector<bool>{false, false, false}));
  tier.reset();
  tier = OpenSsd(o);  // the corrupt entries were erased from the index, too
  EXPECT_EQ(tier->Details().recovered, 3u);
}

TEST(SsdTier, IndexEntriesPointingOutsideTheDataFileAreDroppedAtOpen) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  std::string file;
  uint64_t end_of_1 = 0;
  {
    auto tier = OpenSsd(o);
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 30000)}).get()[0].ok());
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(2, 300000)}).get()[0].ok());
    auto l1 = tier->Locate(KeyOf(1));
    auto l2 = tier->Locate(KeyOf(2));
    ASSERT_TRUE(l1.ok() && l2.ok());
    ASSERT_LT(l1->offset, l2->offset);
    file = l2->file;
    end_of_1 = Aligned(l1->offset + l1->record_bytes);
  }
  std::filesystem::resize_file(file, end_of_1);  // key 2's record is cut off
  auto tier = OpenSsd(o);
  EXPECT_EQ(tier->Details().dropped_at_open, 1u);
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(2)}).get(), (std::vector<bool>{true, false}));
  EXPECT_TRUE(tier->Get({KeyOf(1)}).get()[0].ok());
}

// A directory written by a release of bundle format 2 (c8_mla scales before the rope) is
// refused at open with an error that says so; its records are never read as today's.
TEST(SsdTier, AnIndexOfBundleFormat2IsRefusedAtOpen) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  {
    auto tier = OpenSsd(o);
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 30000)}).get()[0].ok());
  }
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path() + "/index", &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::string format;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), "m:format", &format).ok());
    EXPECT_EQ(format, "sparsekv-ssd-index-3");
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "m:format", "sparsekv-ssd-index-2").ok());
  }
  auto old = SsdTier::Open(o);
  ASSERT_FALSE(old.ok());
  EXPECT_EQ(old.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("bundle format 2"), std::string_view::npos)
      << old.status().ToString();
  EXPECT_NE(old.status().message().find("remove the directory"), std::string_view::npos);
}

TEST(SsdTier, ConcurrentBatchesOnTwoRings) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  o.io_threads = 2;
  o.durability = Durability::kNone;
  auto tier = OpenSsd(o);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t round = 0; round < 20; ++round) {
        std::vector<BundlePtr> batch;
        for (uint64_t i = 0; i < 6; ++i)
          batch.push_back(MakeBundleOfBytes(t * 100 + i, 20000 + i * 1000, round));
        for (const Status& s : tier->Put(batch).get()) bad += !s.ok();
        auto got = tier->Get({KeyOf(t * 100 + round % 6)}).get();
        if (!got[0].ok() ||
            !SameBytes(**got[0], *MakeBundleOfBytes(t * 100 + round % 6, 20000 + (round % 6) * 1000,
                                                    round))) {
          ++bad;
        }
        if (round % 5 == 0) (void)tier->Erase({KeyOf(t * 100 + 5)}).get();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(tier->Stats().corrupt, 0u);
}

TEST(SsdTier, UnregisteredBuffersWorkToo) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  o.register_buffers = false;
  auto tier = OpenSsd(o);
  EXPECT_FALSE(tier->Details().buffers_registered);
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 100000)}).get()[0].ok());
  auto got = tier->Get({KeyOf(1)}).get();
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundleOfBytes(1, 100000)));
  EXPECT_EQ(tier->Details().fixed_ios, 0u);
}

TEST(SsdTier, ReturnedBundlesHoldArenaRunsAndAFullArenaFallsBackToTheHeap) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  o.read_arena_bytes = 4 * 65536;  // room for two of the bundles below
  auto tier = OpenSsd(o);
  std::vector<BundlePtr> in;
  for (uint64_t i = 0; i < 4; ++i) in.push_back(MakeBundleOfBytes(i, 100000));
  for (const Status& s : tier->Put(in).get()) ASSERT_TRUE(s.ok());
  auto held = tier->Get({KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3)}).get();
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(held[i].ok());
    EXPECT_TRUE(SameBytes(**held[i], *in[i]));
  }
  EXPECT_EQ(tier->Details().arena_bytes_in_use, 4u * 65536);
  held.clear();
  EXPECT_EQ(tier->Details().arena_bytes_in_use, 0u);
  // A bundle read back (arena memory) can be written again: to another key's slot, as is.
  auto again = tier->Get({KeyOf(2)}).get();
  ASSERT_TRUE(again[0].ok());
  tier.reset();  // the bundle outlives the tier and keeps its arena alive
  EXPECT_TRUE(SameBytes(**again[0], *in[2]));
}

TEST(SsdTier, RejectsBadOptionsWithClearErrors) {
  SsdTierOptions o;
  EXPECT_NE(SsdTier::Open(o).status().ToString().find("path"), std::string::npos);
  testing::TempDir dir("ssd");
  o.path = dir.path();
  o.queue_depth = 0;
  EXPECT_NE(SsdTier::Open(o).status().ToString().find("queue_depth"), std::string::npos);
  o.queue_depth = 4;
  o.io_bytes = 1000;
  EXPECT_NE(SsdTier::Open(o).status().ToString().find("io_bytes"), std::string::npos);
}

TEST(SsdTier, KeyJournalMirrorsTheListing) {
  testing::TempDir dir("ssd");
  SsdTierOptions o = SmallOptions(dir.path());
  o.capacity_bytes = 24 * 8192;  // fewer records than keys: evictions
  o.slab_grow_bytes = 64 << 10;
  auto tier = OpenSsd(o);
  CheckJournalMirrorsListing(*tier, 40, 6000, 2);
}

}  // namespace
}  // namespace sparsekv
