// Releases of two bundle formats over one tier: each reads the other's records as misses,
// counted, and neither deletes a record of the other. A process plays the other release through
// the test hook SetBundleFormatVersionForTesting (records of format 4, this release's layout).
// Also the tiers' own encodings: an SSD index entry of a later release refuses the open and
// deletes nothing; a longer RocksDB metadata value (a later release's, fields appended) is kept.
#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "sparsekv/host_tier.h"
#include "sparsekv/rocksdb_tier.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

// Plays the release of bundle format `version` while alive.
class AsFormat {
 public:
  explicit AsFormat(uint16_t version) : previous_(SetBundleFormatVersionForTesting(version)) {}
  ~AsFormat() { SetBundleFormatVersionForTesting(previous_); }
  AsFormat(const AsFormat&) = delete;
  AsFormat& operator=(const AsFormat&) = delete;

 private:
  uint16_t previous_;
};

constexpr uint16_t kOther = kBundleFormatVersion + 1;

SsdTierOptions SsdOptions(const std::string& path) {
  SsdTierOptions o;
  o.path = path;
  o.capacity_bytes = 64ull << 20;
  o.slab_grow_bytes = 1 << 20;
  o.read_arena_bytes = 16 << 20;
  return o;
}

RocksDbTierOptions RocksOptions(const std::string& path) {
  RocksDbTierOptions o;
  o.path = path;
  o.capacity_bytes = 64ull << 20;
  o.durability = Durability::kNone;
  return o;
}

std::vector<BundlePtr> Records(uint64_t first, size_t n) {
  std::vector<BundlePtr> out;
  for (size_t i = 0; i < n; ++i) out.push_back(MakeBundleOfBytes(first + i, 9000 + i * 4100, 0, first + i));
  return out;
}

std::vector<BundleKey> Keys(const std::vector<BundlePtr>& b) {
  std::vector<BundleKey> out;
  for (const BundlePtr& x : b) out.push_back(x->key());
  return out;
}

// Reads `mine` (all hits, byte for byte) and `theirs` (all misses: NotFound, counted as another
// version) from a tier opened by `open`, as the release of format `version`.
template <typename Open>
void ReadBoth(Open open, uint16_t version, const std::vector<BundlePtr>& mine, const std::vector<BundlePtr>& theirs) {
  AsFormat as(version);
  auto tier = open();
  ASSERT_NE(tier, nullptr);
  // Before a read, the index cannot tell (it does not record formats): the keys are held.
  const auto before = tier->Contains(Keys(theirs)).get();
  EXPECT_EQ(std::count(before.begin(), before.end(), true), static_cast<long>(theirs.size()));
  const auto got_theirs = tier->Get(Keys(theirs)).get();
  for (size_t i = 0; i < theirs.size(); ++i) {
    EXPECT_TRUE(got_theirs[i].status().Is(StatusCode::kNotFound)) << got_theirs[i].status().ToString();
    EXPECT_NE(got_theirs[i].status().message().find("format version"), std::string_view::npos)
        << got_theirs[i].status().ToString();
  }
  const auto got_mine = tier->Get(Keys(mine)).get();
  for (size_t i = 0; i < mine.size(); ++i) {
    ASSERT_TRUE(got_mine[i].ok()) << "format " << version << ": " << got_mine[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got_mine[i], *mine[i]));
  }
  const TierStats s = tier->Stats();
  EXPECT_EQ(s.other_version, theirs.size());
  EXPECT_EQ(s.corrupt, 0u);
  EXPECT_EQ(s.items, mine.size() + theirs.size()) << "format " << version << " deleted records";
  // Once read, lookups agree with reads: absent for this release (still held for the other).
  const auto has = tier->Contains(Keys(theirs)).get();
  EXPECT_EQ(std::count(has.begin(), has.end(), true), 0);
  const auto own = tier->Contains(Keys(mine)).get();
  EXPECT_EQ(std::count(own.begin(), own.end(), true), static_cast<long>(mine.size()));
}

// A directory handed from this release to one of another format and back, twice: after each
// has written its records and read the other's, every record of both is there.
template <typename Open>
void HandOver(Open open) {
  std::vector<BundlePtr> ours, theirs;
  {
    auto tier = open();
    ASSERT_NE(tier, nullptr);
    ours = Records(100, 4);
    for (const Status& s : tier->Put(ours).get()) ASSERT_TRUE(s.ok()) << s.ToString();
  }
  {
    AsFormat as(kOther);
    theirs = Records(200, 3);
    auto tier = open();
    ASSERT_NE(tier, nullptr);
    for (const Status& s : tier->Put(theirs).get()) ASSERT_TRUE(s.ok()) << s.ToString();
  }
  for (int round = 0; round < 2; ++round) {
    ReadBoth(open, kBundleFormatVersion, ours, theirs);
    ReadBoth(open, kOther, theirs, ours);
  }
}

TEST(FormatVersions, AnSsdDirectoryHandedBetweenTwoBundleFormatsKeepsEveryRecordOfBoth) {
  testing::TempDir dir("fmtver");
  const SsdTierOptions o = SsdOptions(dir.path());
  HandOver([&]() -> std::unique_ptr<Tier> {
    auto t = SsdTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  });
}

TEST(FormatVersions, ARocksDbDirectoryHandedBetweenTwoBundleFormatsKeepsEveryRecordOfBoth) {
  testing::TempDir dir("fmtver");
  const RocksDbTierOptions o = RocksOptions(dir.path());
  HandOver([&]() -> std::unique_ptr<Tier> {
    auto t = RocksDbTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  });
}

// The host tier (memory) holds records made before a switch of format: read after it as
// another version's, kept, and read again once the format is back.
TEST(FormatVersions, TheHostTierKeepsARecordOfAnotherFormatAndReadsItAsAMiss) {
  HostTierOptions h;
  h.capacity_bytes = 8 << 20;
  h.huge_pages = false;
  auto tier = HostTier::Open(h);
  ASSERT_TRUE(tier.ok());
  const std::vector<BundlePtr> ours = Records(1, 2);
  for (const Status& s : (*tier)->Put(ours).get()) ASSERT_TRUE(s.ok());
  {
    AsFormat as(kOther);
    const auto got = (*tier)->Get(Keys(ours)).get();
    for (const auto& g : got) EXPECT_TRUE(g.status().Is(StatusCode::kNotFound)) << g.status().ToString();
    for (bool check : {true, false}) {
      auto pinned = (*tier)->GetPinned(ours[0]->key(), check);
      EXPECT_TRUE(pinned.status().Is(StatusCode::kNotFound)) << pinned.status().ToString();
    }
    EXPECT_EQ((*tier)->Stats().other_version, 4u);
    EXPECT_EQ((*tier)->Stats().corrupt, 0u);
  }
  EXPECT_EQ((*tier)->Stats().items, 2u);
  const auto back = (*tier)->Get(Keys(ours)).get();
  for (size_t i = 0; i < ours.size(); ++i) {
    ASSERT_TRUE(back[i].ok()) << back[i].status().ToString();
    EXPECT_TRUE(SameBytes(**back[i], *ours[i]));
  }
}

// Every file under `dir`, by relative path.
std::map<std::string, std::string> Files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[std::filesystem::relative(e.path(), dir).string()] =
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

// An index entry whose encoding is a later release's (its leading version byte above this
// release's): the open is refused, naming the entry, and not a byte of the directory changes.
// Before, it was dropped as undecodable and its extent handed out as free space.
TEST(FormatVersions, AnSsdIndexEntryOfALaterReleaseRefusesTheOpenAndDeletesNothing) {
  testing::TempDir dir("fmtver");
  const SsdTierOptions o = SsdOptions(dir.path());
  {
    auto tier = SsdTier::Open(o);
    ASSERT_TRUE(tier.ok());
    for (const Status& s : (*tier)->Put(Records(1, 3)).get()) ASSERT_TRUE(s.ok());
  }
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path() + "/index", &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    std::string key, value;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().ToString() == "m:format") continue;
      key = it->key().ToString();
      value = it->value().ToString();
      break;
    }
    ASSERT_FALSE(key.empty());
    value[0] = static_cast<char>(value[0] + 1);  // the next index version
    value += "later fields";
    it.reset();
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), key, value).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  // The data file byte for byte, and every index entry (RocksDB's own logs and manifests
  // change with any open).
  auto index = [&] {
    std::map<std::string, std::string> out;
    rocksdb::DB* raw = nullptr;
    EXPECT_TRUE(rocksdb::DB::OpenForReadOnly(rocksdb::Options(), dir.path() + "/index", &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) out[it->key().ToString()] = it->value().ToString();
    return out;
  };
  const auto data_before = Files(dir.path()).at("data.dat");
  const auto index_before = index();
  ASSERT_GE(index_before.size(), 4u);  // three entries and the mark
  auto refused = SsdTier::Open(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("later release"), std::string_view::npos) << refused.status().ToString();
  EXPECT_TRUE(Files(dir.path()).at("data.dat") == data_before) << "the refused open changed the data file";
  EXPECT_TRUE(index() == index_before) << "the refused open changed the index";
}

// RocksDB tier metadata longer than this release's (a later release appending fields) is read by
// its first fields and kept: the record still reads.
TEST(FormatVersions, RocksDbMetadataWithFieldsOfALaterReleaseIsKept) {
  testing::TempDir dir("fmtver");
  const RocksDbTierOptions o = RocksOptions(dir.path());
  const std::vector<BundlePtr> recs = Records(1, 2);
  {
    auto tier = RocksDbTier::Open(o);
    ASSERT_TRUE(tier.ok());
    for (const Status& s : (*tier)->Put(recs).get()) ASSERT_TRUE(s.ok());
  }
  {
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {{rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path(), families, &handles, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), handles[1]));
    std::vector<std::pair<std::string, std::string>> longer;
    for (it->SeekToFirst(); it->Valid(); it->Next())
      longer.emplace_back(it->key().ToString(), it->value().ToString() + std::string(16, '\x7f'));
    it.reset();
    ASSERT_EQ(longer.size(), recs.size());
    for (const auto& [k, v] : longer) ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), handles[1], k, v).ok());
    for (auto* h : handles) ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  auto tier = RocksDbTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_EQ((*tier)->Stats().items, recs.size());
  const auto got = (*tier)->Get(Keys(recs)).get();
  for (size_t i = 0; i < recs.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *recs[i]));
  }
}

}  // namespace
}  // namespace sparsekv
