// The manager from several threads at once, as the daemon calls it: shared prefixes, evictions,
// forks, pins, lookups, resets and a subscriber. Run under TSan in the sanitizer build.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_set>

#include "sparsekv/cache_manager.h"
#include "tests/cache/cache_test_util.h"

namespace sparsekv {
namespace {

using testing::MakeCache;
using testing::OneKindSpec;
using testing::Prompt;

// Rebuilds the set of cached blocks from the event stream alone, as a router would.
class RouterView {
 public:
  void On(const KvEvent& e) {
    std::lock_guard<std::mutex> l(mu_);
    if (last_ != 0 && e.sequence_number != last_ + 1) ++out_of_order_;
    last_ = e.sequence_number;
    switch (e.type) {
      case KvEventType::kBlocksStored:
        if (e.kinds.Has(full_kind_)) {
          for (const BlockHash& h : e.block_hashes) {
            if (!blocks_.insert(h).second) ++double_stores_;
          }
        }
        break;
      case KvEventType::kBlocksRemoved:
        if (e.kinds.Has(full_kind_)) {
          for (const BlockHash& h : e.block_hashes) {
            if (blocks_.erase(h) == 0) ++unknown_removals_;
          }
        }
        break;
      case KvEventType::kAllCleared:
        blocks_.clear();
        break;
    }
  }
  explicit RouterView(CacheKind full_kind) : full_kind_(full_kind) {}
  size_t size() {
    std::lock_guard<std::mutex> l(mu_);
    return blocks_.size();
  }
  uint64_t out_of_order_ = 0, double_stores_ = 0, unknown_removals_ = 0;

 private:
  CacheKind full_kind_;
  std::mutex mu_;
  uint64_t last_ = 0;
  std::unordered_set<BlockHash, BlockHashHasher> blocks_;
};

void Hammer(CacheManager& c, uint32_t block_tokens, int threads, int iterations) {
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> hits{0}, exhausted{0};
  std::latch start(threads + 1);  // everyone starts together, so the calls really overlap
  auto worker = [&](int id) {
    std::mt19937 rng(1234 + id);
    start.arrive_and_wait();
    for (int it = 0; it < iterations; ++it) {
      // One of four system prompts of two blocks, then a user turn of 1..3 blocks.
      auto tokens = Prompt(2 * block_tokens, rng() % 4);
      const auto user = Prompt(1 + rng() % (3 * block_tokens), 1000 + rng() % 50);
      tokens.insert(tokens.end(), user.begin(), user.end());
      SequenceOptions so;
      so.namespace_salt = (rng() % 8 == 0) ? "other" : "";
      auto seq = c.CreateSequence(so);
      ASSERT_TRUE(seq.ok());
      ASSERT_TRUE(c.AppendTokens(*seq, tokens).ok());
      auto hit = c.AcquireCachedPrefix(*seq);
      ASSERT_TRUE(hit.ok());
      hits += hit->blocks;
      auto slots = c.AllocateSlots(*seq, tokens.size());
      if (!slots.ok()) {
        ASSERT_EQ(slots.status().code(), StatusCode::kResourceExhausted)
            << slots.status().ToString();
        ++exhausted;
        ASSERT_TRUE(c.Free(*seq).ok());
        continue;
      }
      ASSERT_TRUE(c.CommitComputed(*seq, tokens.size()).ok());
      if (rng() % 4 == 0) {  // beam-style fork, a few decode steps each
        auto f = c.Fork(*seq);
        ASSERT_TRUE(f.ok());
        for (SequenceId s : {*seq, *f}) {
          for (int step = 0; step < 3; ++step) {
            const TokenId t = static_cast<TokenId>(rng());
            ASSERT_TRUE(c.AppendTokens(s, std::span<const TokenId>(&t, 1)).ok());
            const uint64_t n = c.GetSequenceInfo(s)->tokens;
            auto more = c.AllocateSlots(s, n);
            if (!more.ok()) {
              ASSERT_EQ(more.status().code(), StatusCode::kResourceExhausted);
              break;
            }
            ASSERT_TRUE(c.CommitComputed(s, n).ok());
          }
        }
        ASSERT_TRUE(c.Free(*f).ok());
      }
      ASSERT_TRUE(c.Free(*seq).ok());
    }
  };
  auto observer = [&] {
    std::mt19937 rng(99);
    start.arrive_and_wait();
    std::vector<PinId> pins;
    while (!stop.load()) {
      const auto p = Prompt(2 * block_tokens + 1, rng() % 4);
      PrefixQuery q;
      q.tokens = p;
      auto m = c.LookupPrefix(q);
      ASSERT_TRUE(m.ok());
      ASSERT_LE(m->blocks, 2u);
      (void)c.Stats();
      if (rng() % 16 == 0) {
        auto pin = c.PinPrefix(q, rng() % 3);
        if (pin.ok()) pins.push_back(pin->id);
      }
      if (pins.size() > 2) {
        const Status st = c.Unpin(pins.front());
        ASSERT_TRUE(st.ok() || st.code() == StatusCode::kNotFound)
            << st.ToString();  // given up under pressure
        pins.erase(pins.begin());
      }
      if (rng() % 64 == 0) {
        const Status st = c.Reset();
        ASSERT_TRUE(st.ok() || st.code() == StatusCode::kFailedPrecondition) << st.ToString();
        if (st.ok()) pins.clear();
      }
      std::this_thread::yield();
    }
    for (PinId id : pins) (void)c.Unpin(id);
  };
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) ts.emplace_back(worker, i);
  std::thread obs(observer);
  for (auto& t : ts) t.join();
  stop = true;
  obs.join();
  EXPECT_GT(hits.load(), 0u);
}

TEST(CacheConcurrency, ThreadsShareEvictForkPinAndReset) {
  CacheManagerOptions o;
  o.block_tokens = 4;
  o.capacity_blocks = 48;  // small: evictions and refused allocations happen all the time
  o.metadata_only = true;
  auto c = MakeCache(OneKindSpec(), o);
  RouterView view(CacheKind::kMlaLatent);
  const SubscriptionId sub = c->Subscribe([&](const KvEvent& e) { view.On(e); });
#if SPARSEKV_TSAN
  constexpr int kIterations = 1000;
#else
  constexpr int kIterations = 4000;
#endif
  Hammer(*c, 4, 4, kIterations);
  c->Unsubscribe(sub);

  const CacheStats s = c->Stats();
  EXPECT_EQ(s.internal_errors, 0u) << s.first_internal_error;
  EXPECT_EQ(s.sequences, 0u);
  EXPECT_GT(s.evicted_blocks, 0u);
  EXPECT_EQ(c->pool(0).Stats().used, 0u);
  EXPECT_EQ(c->pool(0).Stats().misuse, 0u);
  EXPECT_EQ(view.out_of_order_, 0u);
  EXPECT_EQ(view.double_stores_, 0u);
  EXPECT_EQ(view.unknown_removals_, 0u);
  EXPECT_EQ(view.size(), s.cached_blocks);  // the events told the whole story
  ASSERT_TRUE(c->Reset().ok());
}

TEST(CacheConcurrency, V4PoolsStayConsistentUnderContention) {
  CacheManagerOptions o;
  o.block_tokens = 128;
  o.capacity_blocks = 40;
  o.window_capacity_blocks = 24;
  o.state_capacity_blocks = 24;
  o.metadata_only = true;
  auto c = MakeCache(*ModelPreset("deepseek-v4-flash", KvPrecision::kFp8), o);
  RouterView view(CacheKind::kCsaCompressed);
  const SubscriptionId sub = c->Subscribe([&](const KvEvent& e) { view.On(e); });
#if SPARSEKV_TSAN
  constexpr int kIterations = 400;
#else
  constexpr int kIterations = 1500;
#endif
  Hammer(*c, 128, 3, kIterations);
  c->Unsubscribe(sub);
  const CacheStats s = c->Stats();
  EXPECT_EQ(s.internal_errors, 0u) << s.first_internal_error;
  for (size_t q = 0; q < c->num_pools(); ++q) {
    EXPECT_EQ(c->pool(q).Stats().used, 0u) << q;
    EXPECT_EQ(c->pool(q).Stats().misuse, 0u) << q;
  }
  EXPECT_EQ(view.out_of_order_, 0u);
  EXPECT_EQ(view.unknown_removals_, 0u);
  EXPECT_EQ(view.size(), s.cached_blocks);
}

}  // namespace
}  // namespace sparsekv
