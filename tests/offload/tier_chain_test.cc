#include "sparsekv/tier_chain.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "sparsekv/host_tier.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

constexpr uint64_t kPayload = 20000;

class TierChainTest : public ::testing::Test {
 protected:
  // `wrap` may put the SSD tier inside a test tier.
  std::unique_ptr<TierChain> Make(
      WritePolicy policy, uint64_t host_slots = 4,
      const std::function<std::unique_ptr<Tier>(std::unique_ptr<Tier>)>& wrap = nullptr) {
    HostTierOptions h;
    h.max_record_bytes = 32768;
    h.capacity_bytes = host_slots * 5 * 4096;  // host_slots records of kPayload (5 units each)
    h.huge_pages = false;
    SsdTierOptions s;
    s.path = dir_.path();
    s.capacity_bytes = 16 << 20;
    s.io_bytes = 64 << 10;
    s.slab_grow_bytes = 1 << 20;
    s.read_arena_bytes = 16 << 20;
    s.durability = Durability::kNone;
    std::vector<std::unique_ptr<Tier>> tiers;
    tiers.push_back(HostTier::Open(h).value());
    auto ssd = SsdTier::Open(s);
    EXPECT_TRUE(ssd.ok()) << ssd.status().ToString();
    tiers.push_back(wrap ? wrap(std::move(*ssd)) : std::move(*ssd));
    TierChainOptions o;
    o.write_policy = policy;
    return std::make_unique<TierChain>(std::move(tiers), o);
  }
  testing::TempDir dir_{"chain"};
};

TEST_F(TierChainTest, WriteBackCascadesEvictionsAndPromotesHitsBack) {
  auto chain = Make(WritePolicy::kWriteBack);
  for (uint64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(chain->Demote({MakeBundleOfBytes(i, kPayload)}).get()[0].ok());
  }
  chain->WaitIdle();
  // The host holds the 4 most recent; the 6 older went down to the SSD.
  std::vector<BundleKey> keys;
  for (uint64_t i = 0; i < 10; ++i) keys.push_back(KeyOf(i));
  keys.push_back(KeyOf(50));
  auto where = chain->Locate(keys);
  EXPECT_EQ(where, (std::vector<int>{1, 1, 1, 1, 1, 1, 0, 0, 0, 0, -1}));
  EXPECT_EQ(chain->CountPrefix(keys), 10u);
  EXPECT_EQ(chain->Stats().cascaded, 6u);
  auto got = chain->Promote({KeyOf(2), KeyOf(8), KeyOf(50)}).get();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundleOfBytes(2, kPayload)));
  ASSERT_TRUE(got[1].ok());
  EXPECT_TRUE(got[2].status().Is(StatusCode::kNotFound));
  chain->WaitIdle();
  EXPECT_EQ(chain->Locate(std::vector<BundleKey>{KeyOf(2)})[0], 0);  // onloaded into the host tier
  EXPECT_EQ(chain->Stats().onloaded, 1u);
  chain->Prefetch({KeyOf(0), KeyOf(1)});
  chain->WaitIdle();
  EXPECT_EQ(chain->Locate(std::vector<BundleKey>{KeyOf(0), KeyOf(1)}), (std::vector<int>{0, 0}));
  EXPECT_EQ(chain->Stats().prefetched, 2u);
}

TEST_F(TierChainTest, WriteThroughFallsBackToTheLowerCopyWhenTheUpperIsCorrupt) {
  auto chain = Make(WritePolicy::kWriteThrough);
  for (const Status& s :
       chain->Demote({MakeBundleOfBytes(1, kPayload), MakeBundleOfBytes(2, kPayload)}).get()) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  auto& host = static_cast<HostTier&>(chain->tier(0));
  ASSERT_TRUE(host.CorruptForTesting(KeyOf(1), 500).ok());
  auto got = chain->Promote({KeyOf(1), KeyOf(2)}).get();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundleOfBytes(1, kPayload)));
  EXPECT_EQ(chain->Stats().fallbacks, 1u);
  EXPECT_EQ(chain->tier(0).Stats().corrupt, 1u);
  chain->WaitIdle();
  EXPECT_EQ(chain->Locate(std::vector<BundleKey>{KeyOf(1)})[0], 0);  // the good copy came back up
}

TEST_F(TierChainTest, AFailedDemoteDropsTheBlockCleanly) {
  auto chain = Make(WritePolicy::kWriteBack);
  auto st = chain->Demote({MakeBundleOfBytes(1, 100000), MakeBundleOfBytes(2, kPayload)}).get();
  EXPECT_TRUE(st[0].Is(StatusCode::kInvalidArgument));  // larger than a host slot
  EXPECT_TRUE(st[1].ok());
  EXPECT_EQ(chain->Stats().demote_dropped, 1u);
  EXPECT_EQ(chain->Locate(std::vector<BundleKey>{KeyOf(1), KeyOf(2)}), (std::vector<int>{-1, 0}));
}

TEST_F(TierChainTest, EraseRemovesFromEveryTier) {
  auto chain = Make(WritePolicy::kWriteThrough);
  ASSERT_TRUE(chain->Demote({MakeBundleOfBytes(1, kPayload)}).get()[0].ok());
  for (const Status& s : chain->Erase({KeyOf(1)}).get()) EXPECT_TRUE(s.ok());
  EXPECT_EQ(chain->Locate(std::vector<BundleKey>{KeyOf(1)})[0], -1);
}

// A lower tier that keeps the bundles it was given (as the SSD tier's commit thread does for a
// moment after answering a write) and reads them when it is destroyed.
class KeepingTier : public testing::ForwardingTier {
 public:
  KeepingTier(std::unique_ptr<Tier> inner, int* checked) : ForwardingTier(std::move(inner)), checked_(checked) {}
  ~KeepingTier() override {
    for (const auto& [b, copy] : kept_) {
      EXPECT_EQ(std::memcmp(b->record().data(), copy.data(), copy.size()), 0);
      ++*checked_;
    }
  }
  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (const BundlePtr& b : bundles) {
        kept_.emplace_back(b, std::vector<std::byte>(b->record().begin(), b->record().begin() + b->record_bytes()));
      }
    }
    inner_->PutAsync(std::move(bundles), std::move(done));
  }

 private:
  int* checked_;
  std::mutex mu_;
  std::vector<std::pair<BundlePtr, std::vector<std::byte>>> kept_;
};

// The chain destroys its tiers slowest first: bundles a lower tier still holds, read from the
// host tier's memory, are released while the host tier is there (ASan: no use after free; the
// reads in ~KeepingTier would touch an unmapped arena otherwise).
TEST_F(TierChainTest, ALowerTierMayHoldHostBundlesUntilItIsDestroyed) {
  int checked = 0;
  {
    auto chain = Make(WritePolicy::kWriteThrough, 4, [&](std::unique_ptr<Tier> ssd) -> std::unique_ptr<Tier> {
      return std::make_unique<KeepingTier>(std::move(ssd), &checked);
    });
    // As sparsekvd's PUTs: written into the host tier in place, then the pinned view of the
    // host's memory goes down the chain.
    auto& host = static_cast<HostTier&>(chain->tier(0));
    for (uint64_t i = 0; i < 3; ++i) {
      const std::vector<std::byte> bytes(kPayload, std::byte(0x40 + i));
      const std::span<const std::byte> segments[1] = {bytes};
      auto pinned = host.PutGathered(KeyOf(i), segments, chain->NextSequence());
      ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
      ASSERT_TRUE(chain->Demote({std::move(pinned).value()}).get()[0].ok());
    }
    chain->WaitIdle();
  }
  EXPECT_EQ(checked, 3);
}

}  // namespace
}  // namespace sparsekv
