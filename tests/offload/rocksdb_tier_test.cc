#include "sparsekv/rocksdb_tier.h"

#include <gtest/gtest.h>

#include <rocksdb/db.h>

#include <filesystem>

#include "tests/offload/key_journal_check.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::CheckJournalMirrorsListing;
using testing::SameBytes;

// A tier of `slots` × `slot_bytes` bytes taking records of at most `slot_bytes`.

std::unique_ptr<RocksDbTier> OpenRocks(const RocksDbTierOptions& o) {
  auto t = RocksDbTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

RocksDbTierOptions Options(const std::string& path) {
  RocksDbTierOptions o;
  o.path = path;
  o.capacity_bytes = 64ull << 20;
  o.durability = Durability::kNone;
  return o;
}

TEST(RocksDbTier, RoundTripRestartAndBlobFiles) {
  testing::TempDir dir("rocks");
  RocksDbTierOptions o = Options(dir.path());
  std::vector<BundlePtr> in;
  for (uint64_t i = 0; i < 12; ++i) in.push_back(MakeBundleOfBytes(i, i < 3 ? 100 : 200000));
  {
    auto tier = OpenRocks(o);
    auto st = tier->Put(in).get();
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
    auto got = tier->Get({KeyOf(0), KeyOf(5), KeyOf(77)}).get();
    ASSERT_TRUE(got[0].ok());
    EXPECT_TRUE(SameBytes(**got[0], *in[0]));
    ASSERT_TRUE(got[1].ok());
    EXPECT_TRUE(SameBytes(**got[1], *in[5]));
    EXPECT_TRUE(got[2].status().Is(StatusCode::kNotFound));
    ASSERT_TRUE(tier->Erase({KeyOf(4)}).get()[0].ok());
  }
  auto tier = OpenRocks(o);
  EXPECT_EQ(tier->Stats().items, 11u);
  std::vector<BundleKey> keys;
  for (auto& b : in) keys.push_back(b->key());
  auto got = tier->Get(keys).get();
  for (size_t i = 0; i < in.size(); ++i) {
    if (i == 4) {
      EXPECT_TRUE(got[i].status().Is(StatusCode::kNotFound));
      continue;
    }
    ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *in[i]));
  }
  bool blob = false;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    blob |= e.path().extension() == ".blob";
  EXPECT_TRUE(blob) << "large values should live in blob files";
}

// The tier marks its database with the record format. One holding records but no mark was
// written by a release of bundle format 2 (c8_mla scales before the rope) and is refused with
// an error that says so; so is a mark of another format. A new database is marked and opens.
TEST(RocksDbTier, RecordsOfAnotherBundleFormatAreRefusedAtOpen) {
  testing::TempDir dir("rocks");
  RocksDbTierOptions o = Options(dir.path());
  {
    auto tier = OpenRocks(o);
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 100)}).get()[0].ok());
  }
  ASSERT_TRUE(RocksDbTier::Open(o).ok()) << "its own format reopens";
  // Opens the database as RocksDB itself, checks the mark is `expect` (nullptr: none), then
  // sets it to `value` (nullptr: deletes it).
  auto rewrite = [&](const char* expect, const char* value) {
    rocksdb::DBOptions dbo;
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(dbo, dir.path(), families, &handles, &raw).ok());
    std::string format;
    const rocksdb::Status got =
        raw->Get(rocksdb::ReadOptions(), handles[0], "sparsekv:format", &format);
    if (expect == nullptr) {
      EXPECT_TRUE(got.IsNotFound());
    } else {
      EXPECT_TRUE(got.ok());
      EXPECT_EQ(format, expect);
    }
    const rocksdb::Status put =
        value == nullptr ? raw->Delete(rocksdb::WriteOptions(), handles[0], "sparsekv:format")
                         : raw->Put(rocksdb::WriteOptions(), handles[0], "sparsekv:format", value);
    EXPECT_TRUE(put.ok());
    for (auto* h : handles) raw->DestroyColumnFamilyHandle(h);
    delete raw;
  };
  rewrite("sparsekv-bundle-3", nullptr);  // as a release before the mark left it
  auto old = RocksDbTier::Open(o);
  ASSERT_FALSE(old.ok());
  EXPECT_EQ(old.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("bundle format 2"), std::string_view::npos)
      << old.status().ToString();
  rewrite(nullptr, "sparsekv-bundle-9");  // a mark naming another format
  auto other = RocksDbTier::Open(o);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("sparsekv-bundle-9"), std::string_view::npos)
      << other.status().ToString();
  // An empty database without the mark is simply new.
  testing::TempDir fresh("rocks");
  ASSERT_TRUE(RocksDbTier::Open(Options(fresh.path())).ok());
}

TEST(RocksDbTier, CorruptValueIsDetectedCountedErased) {
  testing::TempDir dir("rocks");
  auto tier = OpenRocks(Options(dir.path()));
  BundlePtr good = MakeBundleOfBytes(1, 50000);
  ASSERT_TRUE(tier->Put({good, MakeBundleOfBytes(2, 50000)}).get()[0].ok());
  std::vector<std::byte> bad(good->record().begin(), good->record().end());
  bad[bad.size() / 2] ^= std::byte{4};
  ASSERT_TRUE(tier->PutRawForTesting(KeyOf(1), bad).ok());
  auto got = tier->Get({KeyOf(1), KeyOf(2)}).get();
  EXPECT_TRUE(got[0].status().Is(StatusCode::kCorruption)) << got[0].status().ToString();
  EXPECT_TRUE(got[0].status().data_loss());
  EXPECT_TRUE(got[1].ok());
  EXPECT_EQ(tier->Stats().corrupt, 1u);
  EXPECT_TRUE(tier->Get({KeyOf(1)}).get()[0].status().Is(StatusCode::kNotFound));
  // A well-formed record of another key is not served under this one.
  ASSERT_TRUE(tier->PutRawForTesting(KeyOf(3), MakeBundleOfBytes(2, 50000)->record()).ok());
  EXPECT_TRUE(tier->Get({KeyOf(3)}).get()[0].status().Is(StatusCode::kCorruption));
}

TEST(RocksDbTier, EvictsLeastRecentlyUsedBeyondCapacity) {
  testing::TempDir dir("rocks");
  RocksDbTierOptions o = Options(dir.path());
  const uint64_t rec = MakeBundleOfBytes(0, 10000)->record_bytes();
  o.capacity_bytes = 4 * rec;
  auto tier = OpenRocks(o);
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(i, 10000)}).get()[0].ok());
  ASSERT_TRUE(tier->Get({KeyOf(0)}).get()[0].ok());
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(4, 10000), MakeBundleOfBytes(5, 10000)}).get()[0].ok());
  EXPECT_EQ(tier->Contains({KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(3), KeyOf(4), KeyOf(5)}).get(),
            (std::vector<bool>{true, false, false, true, true, true}));
  EXPECT_EQ(tier->Stats().evictions, 2u);
  EXPECT_LE(tier->Stats().bytes, o.capacity_bytes);
  auto too_big = tier->Put({MakeBundleOfBytes(9, 50000)}).get();
  EXPECT_TRUE(too_big[0].Is(StatusCode::kInvalidArgument));
}

TEST(RocksDbTier, KeyJournalMirrorsTheListing) {
  testing::TempDir dir("rocks");
  RocksDbTierOptions o = Options(dir.path());
  o.capacity_bytes = 24 * 8192;  // fewer records than keys: evictions
  auto tier = OpenRocks(o);
  CheckJournalMirrorsListing(*tier, 40, 6000, 3);
}

}  // namespace
}  // namespace sparsekv
