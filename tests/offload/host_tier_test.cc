#include "sparsekv/host_tier.h"

#include <gtest/gtest.h>


#include <cstring>
#include <thread>

#include "tests/offload/key_journal_check.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::CheckJournalMirrorsListing;
using testing::SameBytes;

// A tier of `slots` × `slot_bytes` bytes taking records of at most `slot_bytes`.
std::unique_ptr<HostTier> OpenHost(uint64_t slots, uint64_t slot_bytes = 16384) {
  HostTierOptions o;
  o.capacity_bytes = slots * slot_bytes;
  o.max_record_bytes = slot_bytes;
  o.huge_pages = false;
  auto t = HostTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(HostTier, PutGetContainsEraseWithPerItemResults) {
  auto tier = OpenHost(8);
  std::vector<BundlePtr> in = {MakeBundleOfBytes(1, 1000), MakeBundleOfBytes(2, 16000),
                               MakeBundleOfBytes(3, 50000)};
  auto st = tier->Put(in).get();
  ASSERT_EQ(st.size(), 3u);
  EXPECT_TRUE(st[0].ok());
  EXPECT_TRUE(st[1].ok());
  EXPECT_TRUE(st[2].Is(StatusCode::kInvalidArgument)) << st[2].ToString();  // too large
  auto got = tier->Get({KeyOf(2), KeyOf(1), KeyOf(3)}).get();
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(SameBytes(**got[0], *in[1]));
  ASSERT_TRUE(got[1].ok());
  EXPECT_TRUE(SameBytes(**got[1], *in[0]));
  EXPECT_TRUE(got[2].status().Is(StatusCode::kNotFound));
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(3)}).get(), (std::vector<bool>{true, false}));
  auto er = tier->Erase({KeyOf(1), KeyOf(9)}).get();
  EXPECT_TRUE(er[0].ok());
  EXPECT_TRUE(er[1].ok());
  EXPECT_FALSE(tier->Contains({KeyOf(1)}).get()[0]);
  TierStats s = tier->Stats();
  EXPECT_EQ(s.items, 1u);
  EXPECT_EQ(s.puts, 2u);
  EXPECT_EQ(s.put_failures, 1u);
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.erased, 1u);
  EXPECT_EQ(s.bytes, in[1]->record_bytes());
}

TEST(HostTier, GetPinnedReadsInPlaceAndHoldsThePageUntilReleased) {
  // Five 4 KiB units, records of at most 10000 bytes (not a multiple of 4 KiB: the record's
  // padding must still fit). 9000 bytes take 3 units, 5000 and 6000 bytes 2.
  HostTierOptions o;
  o.capacity_bytes = 5 * 4096;
  o.max_record_bytes = 10000;
  o.huge_pages = false;
  auto opened = HostTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto tier = std::move(*opened);
  std::vector<BundlePtr> in = {MakeBundleOfBytes(1, 9000), MakeBundleOfBytes(2, 5000)};
  ASSERT_TRUE(tier->Put({in[0]}).get()[0].ok());
  auto pinned = tier->GetPinned(KeyOf(1));
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_TRUE(SameBytes(**pinned, *in[0]));
  // The padding to 4 KiB reads as zeros, as a RecordBuffer's does.
  const auto padded = (*pinned)->padded_record();
  EXPECT_EQ(padded.size() % 4096, 0u);
  for (size_t i = (*pinned)->record_bytes(); i < padded.size(); ++i) ASSERT_EQ(padded[i], std::byte{0}) << i;
  // While pinned the record is neither evicted nor reused: filling the tier evicts the other.
  ASSERT_TRUE(tier->Put({in[1]}).get()[0].ok());
  auto third = tier->Put({MakeBundleOfBytes(3, 6000)}).get();
  ASSERT_TRUE(third[0].ok()) << third[0].ToString();
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(2), KeyOf(3)}).get(), (std::vector<bool>{true, false, true}));
  auto fourth = tier->Put({MakeBundleOfBytes(4, 6000)}).get();  // evicts 3: 1 is still pinned
  EXPECT_TRUE(fourth[0].ok()) << fourth[0].ToString();
  EXPECT_EQ(tier->Contains({KeyOf(1), KeyOf(3), KeyOf(4)}).get(), (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(SameBytes(**pinned, *in[0]));
  // Evicting everything not pinned still leaves too little room: refused (4 went trying).
  auto fifth = tier->Put({MakeBundleOfBytes(5, 9000)}).get();
  EXPECT_TRUE(fifth[0].Is(StatusCode::kResourceExhausted)) << fifth[0].ToString();
  EXPECT_TRUE(tier->Contains({KeyOf(1)}).get()[0]);
  EXPECT_TRUE(SameBytes(**pinned, *in[0]));
  // Erased while pinned: gone from the index at once, its space freed by the last owner.
  ASSERT_TRUE(tier->Erase({KeyOf(1)}).get()[0].ok());
  EXPECT_FALSE(tier->Contains({KeyOf(1)}).get()[0]);
  EXPECT_TRUE(SameBytes(**pinned, *in[0]));
  pinned = Status::Aborted("released");
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(5, 6000)}).get()[0].ok());
  EXPECT_EQ(tier->Contains({KeyOf(4), KeyOf(5)}).get(), (std::vector<bool>{false, true}));
}

TEST(HostTier, GetPinnedChecksTheRecordAndDropsACorruptOne) {
  auto tier = OpenHost(2);
  auto b = MakeBundleOfBytes(7, 3000);
  ASSERT_TRUE(tier->Put({b}).get()[0].ok());
  ASSERT_TRUE(tier->CorruptForTesting(KeyOf(7), b->record_bytes() - 1).ok());
  auto got = tier->GetPinned(KeyOf(7));
  EXPECT_TRUE(got.status().data_loss()) << got.status().ToString();
  EXPECT_FALSE(tier->Contains({KeyOf(7)}).get()[0]);
  EXPECT_TRUE(tier->GetPinned(KeyOf(8)).status().Is(StatusCode::kNotFound));
  EXPECT_EQ(tier->Stats().corrupt, 1u);
}

TEST(HostTier, EvictsLeastRecentlyUsedAndHandsItOver) {
  auto tier = OpenHost(4);  // four records of 16000 bytes fill it
  std::vector<BundlePtr> evicted;
  ASSERT_TRUE(tier->SetEvictionListener([&](std::vector<BundlePtr> b) {
                    for (auto& x : b) evicted.push_back(std::move(x));
                  })
                  .ok());
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(i, 16000)}).get()[0].ok());
  ASSERT_TRUE(tier->Get({KeyOf(0)}).get()[0].ok());  // 0 is now the most recent; 1 the least
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(10, 16000)}).get()[0].ok());
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0]->key(), KeyOf(1));
  EXPECT_TRUE(SameBytes(*evicted[0], *MakeBundleOfBytes(1, 16000)));
  EXPECT_EQ(tier->Contains({KeyOf(0), KeyOf(1), KeyOf(2), KeyOf(10)}).get(),
            (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(tier->Stats().evictions, 1u);
}

TEST(HostTier, CorruptBundleIsReportedCountedErasedNeverReturned) {
  auto tier = OpenHost(4);
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 4000), MakeBundleOfBytes(2, 4000)}).get()[0].ok());
  ASSERT_TRUE(tier->CorruptForTesting(KeyOf(1), 777).ok());
  auto got = tier->Get({KeyOf(1), KeyOf(2)}).get();
  EXPECT_TRUE(got[0].status().Is(StatusCode::kCorruption)) << got[0].status().ToString();
  EXPECT_TRUE(got[0].status().data_loss());
  EXPECT_TRUE(got[1].ok());
  EXPECT_EQ(tier->Stats().corrupt, 1u);
  EXPECT_TRUE(tier->Get({KeyOf(1)}).get()[0].status().Is(StatusCode::kNotFound));
  // The slot is usable again.
  for (uint64_t i = 3; i < 6; ++i)
    ASSERT_TRUE(tier->Put({MakeBundleOfBytes(i, 4000)}).get()[0].ok());
  EXPECT_EQ(tier->Stats().items, 4u);
}

TEST(HostTier, ReplacingAKeyKeepsOneCopy) {
  auto tier = OpenHost(4);
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 4000, 1)}).get()[0].ok());
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 4000, 2)}).get()[0].ok());
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(1, 4000, 2)}).get()[0].ok());  // the same again
  auto got = tier->Get({KeyOf(1)}).get();
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundleOfBytes(1, 4000, 2)));
  EXPECT_EQ(tier->Stats().items, 1u);
  EXPECT_EQ(tier->Stats().bytes, MakeBundleOfBytes(1, 4000, 2)->record_bytes());
}

TEST(HostTier, ConcurrentReadersWritersAndErasers) {
  auto tier = OpenHost(16);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 400; ++i) {
        const uint64_t id = (i * 7 + t) % 24;
        switch ((i + t) % 3) {
          case 0:
            (void)tier->Put({MakeBundleOfBytes(id, 3000)}).get();
            break;
          case 1: {
            auto g = tier->Get({KeyOf(id)}).get();
            if (g[0].ok() && !SameBytes(**g[0], *MakeBundleOfBytes(id, 3000))) ++bad;
            if (!g[0].ok() && !g[0].status().Is(StatusCode::kNotFound)) ++bad;
            break;
          }
          default:
            (void)tier->Erase({KeyOf(id)}).get();
            break;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(tier->Stats().corrupt, 0u);
  EXPECT_LE(tier->Stats().items, 16u);
}

// PutGathered writes a record from scattered segments straight into the tier: the bytes are
// Bundle::Make's, the result is pinned (not evicted while held), a later put of the same bundle
// only refreshes it, its evictions reach the listener, and it refuses what a put refuses.
TEST(HostTier, PutGatheredStoresTheRecordMakeWouldBuildAndPinsIt) {
  auto tier = OpenHost(3);
  std::vector<BundlePtr> handed;
  ASSERT_TRUE(tier->SetEvictionListener([&](std::vector<BundlePtr> e) {
                    for (auto& b : e) handed.push_back(std::move(b));
                  }).ok());
  std::vector<std::byte> a(9000), c(3000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::byte(i * 13);
  for (size_t i = 0; i < c.size(); ++i) c[i] = std::byte(i * 7);
  const std::vector<std::span<const std::byte>> segs = {a, c};
  auto pinned = tier->PutGathered(KeyOf(1), segs, 5);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  auto made = Bundle::Make(KeyOf(1), segs, 5);
  ASSERT_TRUE(made.ok());
  EXPECT_TRUE(SameBytes(**pinned, **made));
  EXPECT_EQ((*pinned)->checksum(), (*made)->checksum());
  auto got = tier->Get({KeyOf(1)}).get();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_TRUE(SameBytes(**got[0], **made));
  // The chain's put of the same bundle: only its recency changes (no second record).
  ASSERT_TRUE(tier->Put({*pinned}).get()[0].ok());
  EXPECT_EQ(tier->Stats().items, 1u);
  EXPECT_EQ(tier->Stats().puts, 1u);
  // Fill the tier (12 units: 3 + 4 + 4): key 1 is the least recent but pinned, so the next
  // record evicts key 2 or 3.
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(2, 14000)}).get()[0].ok());  // 4 units each
  ASSERT_TRUE(tier->Put({MakeBundleOfBytes(3, 14000)}).get()[0].ok());
  auto second = tier->PutGathered(KeyOf(4), segs, 6);  // evicts one of 2 and 3, never 1
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(tier->Contains({KeyOf(1)}).get()[0]);
  ASSERT_EQ(handed.size(), 1u) << "the eviction went to the listener";
  EXPECT_TRUE(handed[0]->key() == KeyOf(2) || handed[0]->key() == KeyOf(3));
  // Refusals: a newer version held; too large.
  EXPECT_EQ(tier->PutGathered(KeyOf(1), segs, 4).status().code(),
            StatusCode::kFailedPrecondition);
  std::vector<std::byte> big(20000);
  const std::vector<std::span<const std::byte>> too_big = {big};
  EXPECT_EQ(tier->PutGathered(KeyOf(8), too_big, 9).status().code(),
            StatusCode::kInvalidArgument);
}

// A reservation committed with a new sequence (a record the daemon filled itself, as a large
// RESP SET) is ordered as of its commit: it replaces a version published while it was filled,
// which a commit at its reservation's sequence could not.
TEST(HostTier, AReservationCommittedWithANewSequenceWinsOverOnePublishedMeanwhile) {
  for (const bool resequence : {false, true}) {
    auto tier = OpenHost(4);
    auto r = tier->Reserve(KeyOf(1), 5000, 10);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<std::byte> value(5000);
    for (size_t i = 0; i < value.size(); ++i) value[i] = std::byte(i * 31 + 7);
    std::memcpy(r->record + r->header_bytes, value.data(), value.size());
    // Another version of the key, newer than the reservation, published while it fills.
    ASSERT_TRUE(tier->PutGathered(KeyOf(1), std::vector<std::span<const std::byte>>{std::span(value).first(100)}, 11)
                    .ok());
    auto done = tier->CommitReserved(*r, 0, resequence ? 12 : 0);
    auto got = tier->Get({KeyOf(1)}).get();
    ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
    if (!resequence) {
      EXPECT_EQ(done.status().code(), StatusCode::kFailedPrecondition);
      EXPECT_EQ((*got[0])->payload().size(), 100u) << "the newer version stays";
      continue;
    }
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_EQ((*done)->sequence(), 12u);
    ASSERT_EQ((*got[0])->payload().size(), value.size());
    EXPECT_EQ(std::memcmp((*got[0])->payload().data(), value.data(), value.size()), 0);
    EXPECT_EQ((*got[0])->sequence(), 12u);
    EXPECT_EQ(tier->Stats().items, 1u);
  }
}

TEST(HostTier, RejectsBadOptions) {
  HostTierOptions o;
  o.huge_pages = false;
  o.capacity_bytes = 1000;  // below one 4 KiB unit
  EXPECT_TRUE(HostTier::Open(o).status().Is(StatusCode::kInvalidArgument));
  o.capacity_bytes = 1 << 20;
  o.max_record_bytes = 2 << 20;  // larger than the tier
  EXPECT_TRUE(HostTier::Open(o).status().Is(StatusCode::kInvalidArgument));
  o.max_record_bytes = 0;  // the capacity
  auto t = HostTier::Open(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->max_record_bytes(), 1u << 20);
}

TEST(HostTier, KeyJournalMirrorsTheListing) {
  auto tier = OpenHost(24, 8192);  // fewer slots than keys: evictions
  CheckJournalMirrorsListing(*tier, 40, 6000, 1,
                             [&](const BundleKey& k) { return tier->CorruptForTesting(k, 100).ok(); });
}

}  // namespace
}  // namespace sparsekv
