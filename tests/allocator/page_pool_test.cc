#include "sparsekv/page_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

namespace sparsekv {
namespace {

std::unique_ptr<PagePool> MakePool(uint32_t capacity, uint64_t page_bytes = 4096,
                                   ArenaBacking backing = ArenaBacking::kAnonymous) {
  PagePoolOptions o;
  o.name = "test";
  o.capacity = capacity;
  o.page_bytes = page_bytes;
  o.backing = backing;
  auto p = PagePool::Create(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

TEST(PagePool, RejectsBadOptions) {
  PagePoolOptions o;
  EXPECT_EQ(PagePool::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.capacity = 4;
  o.backing = ArenaBacking::kFile;
  o.page_bytes = 4096;
  EXPECT_EQ(PagePool::Create(o).status().code(), StatusCode::kInvalidArgument);  // no file_path
}

TEST(PagePool, ArenaIsTwoMiBAlignedAndPagesAreDistinct) {
  auto pool = MakePool(8, 3 * 4096);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->arena_base()) % (2u << 20), 0u);
  EXPECT_GE(pool->arena_bytes(), 8u * 3 * 4096);
  std::vector<PageId> ids(8);
  ASSERT_TRUE(pool->AllocateBatch(ids).ok());
  for (PageId id : ids) std::memset(pool->PageData(id), static_cast<int>(id + 1), pool->page_bytes());
  for (PageId id : ids) {
    const auto* b = reinterpret_cast<const unsigned char*>(pool->PageData(id));
    EXPECT_EQ(b[0], id + 1);
    EXPECT_EQ(b[pool->page_bytes() - 1], id + 1);
  }
}

TEST(PagePool, ExhaustionIsAnErrorAndChangesNothing) {
  auto pool = MakePool(4);
  std::vector<PageId> got;
  for (int i = 0; i < 4; ++i) {
    auto p = pool->Allocate();
    ASSERT_TRUE(p.ok());
    got.push_back(*p);
  }
  auto none = pool->Allocate();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(none.status().retryable());
  EXPECT_EQ(pool->Stats().exhausted, 1u);
  EXPECT_EQ(pool->Stats().used, 4u);
  for (PageId p : got) EXPECT_EQ(pool->RefCount(p), 1u);
}

TEST(PagePool, FailedBatchAllocationEvictsNothing) {
  auto pool = MakePool(4);
  std::vector<PageId> evicted;
  pool->SetEvictListener([&](PageId p) { evicted.push_back(p); });
  std::vector<PageId> a(3);
  ASSERT_TRUE(pool->AllocateBatch(a).ok());
  ASSERT_TRUE(pool->ReleaseToCache(a[0]).ok());  // 1 free + 1 cached available
  std::vector<PageId> b(3);
  Status st = pool->AllocateBatch(b);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(evicted.empty());
  const PagePoolStats s = pool->Stats();
  EXPECT_EQ(s.cached, 1u);
  EXPECT_EQ(s.free, 1u);
  EXPECT_EQ(s.used, 2u);
  EXPECT_EQ(pool->State(a[0]), PageState::kCached);
}

TEST(PagePool, DoubleFreeAndUnpinnedReleaseAreDetected) {
  auto pool = MakePool(2);
  auto p = pool->Allocate();
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(pool->Release(*p).ok());
  Status again = pool->Release(*p);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(again.message()), ::testing::HasSubstr("not pinned"));
  EXPECT_EQ(pool->Retain(*p).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->Release(99).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(pool->Revive(*p).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->Stats().misuse, 4u);
  EXPECT_EQ(pool->Stats().free, 2u);  // nothing was corrupted
}

TEST(PagePool, ReferenceCountsKeepPagesUntilTheLastRelease) {
  auto pool = MakePool(2);
  auto p = pool->Allocate();
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(pool->Retain(*p).ok());
  ASSERT_TRUE(pool->Retain(*p).ok());
  EXPECT_EQ(pool->RefCount(*p), 3u);
  ASSERT_TRUE(pool->Release(*p).ok());
  ASSERT_TRUE(pool->Release(*p).ok());
  EXPECT_EQ(pool->State(*p), PageState::kInUse);
  ASSERT_TRUE(pool->ReleaseToCache(*p).ok());
  EXPECT_EQ(pool->State(*p), PageState::kCached);
  EXPECT_EQ(pool->RefCount(*p), 0u);
  // A cached page comes back with its content through Revive.
  ASSERT_TRUE(pool->Revive(*p).ok());
  EXPECT_EQ(pool->State(*p), PageState::kInUse);
  EXPECT_EQ(pool->RefCount(*p), 1u);
  ASSERT_TRUE(pool->Revive(*p).ok());  // in use: one more reference
  EXPECT_EQ(pool->RefCount(*p), 2u);
}

TEST(PagePool, CachedPagesAreEvictedInLruOrderAfterFreeOnes) {
  auto pool = MakePool(4);
  std::vector<PageId> evicted;
  pool->SetEvictListener([&](PageId p) { evicted.push_back(p); });
  std::vector<PageId> ids(4);
  ASSERT_TRUE(pool->AllocateBatch(ids).ok());
  // Released tail first, as a sequence is: ids[3] is least recently released.
  for (int i = 3; i >= 1; --i) ASSERT_TRUE(pool->ReleaseToCache(ids[i]).ok());
  ASSERT_TRUE(pool->Release(ids[0]).ok());  // hashless: free
  auto a = pool->Allocate();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, ids[0]);  // free page first
  EXPECT_TRUE(evicted.empty());
  ASSERT_TRUE(pool->Revive(ids[2]).ok());  // a hit takes a cached page back
  auto b = pool->Allocate();
  auto c = pool->Allocate();
  ASSERT_TRUE(b.ok() && c.ok());
  EXPECT_THAT(evicted, ::testing::ElementsAre(ids[3], ids[1]));
  EXPECT_EQ(pool->Stats().evictions, 2u);
  EXPECT_FALSE(pool->Allocate().ok());
}

TEST(PagePool, DropAndDropAllCached) {
  auto pool = MakePool(3);
  std::vector<PageId> ids(3);
  ASSERT_TRUE(pool->AllocateBatch(ids).ok());
  for (PageId p : ids) ASSERT_TRUE(pool->ReleaseToCache(p).ok());
  ASSERT_TRUE(pool->Drop(ids[1]).ok());
  EXPECT_EQ(pool->Drop(ids[1]).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->DropAllCached(), 2u);
  EXPECT_EQ(pool->Stats().free, 3u);
}

TEST(PagePool, HandlesReleaseOnDestruction) {
  auto pool = MakePool(2);
  {
    auto h = pool->AllocatePinned();
    ASSERT_TRUE(h.ok());
    EXPECT_NE(h->data(), nullptr);
    PageHandle moved = std::move(*h);
    EXPECT_FALSE(h->valid());
    EXPECT_EQ(pool->Stats().used, 1u);
    auto pin2 = pool->Pin(moved.id());
    ASSERT_TRUE(pin2.ok());
    EXPECT_EQ(pool->RefCount(moved.id()), 2u);
  }
  EXPECT_EQ(pool->Stats().used, 0u);
  EXPECT_EQ(pool->Stats().misuse, 0u);
}

TEST(PagePool, MetadataOnlyPoolHasNoArena) {
  auto pool = MakePool(1000, 0);
  auto p = pool->Allocate();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(pool->PageData(*p), nullptr);
  EXPECT_EQ(pool->arena_bytes(), 0u);
}

TEST(PagePool, MemfdArenaCanBeMappedByAnotherMapping) {
  auto pool = MakePool(4, 8192, ArenaBacking::kMemfd);
  ASSERT_GE(pool->arena_fd(), 0);
  auto p = pool->Allocate();
  ASSERT_TRUE(p.ok());
  std::memcpy(pool->PageData(*p), "sparsekv", 8);
  // A second mapping of the fd (what another process does after SCM_RIGHTS) sees the bytes.
  void* m = mmap(nullptr, pool->arena_bytes(), PROT_READ, MAP_SHARED, pool->arena_fd(), 0);
  ASSERT_NE(m, MAP_FAILED);
  EXPECT_EQ(std::memcmp(static_cast<char*>(m) + uint64_t{*p} * 8192, "sparsekv", 8), 0);
  munmap(m, pool->arena_bytes());
}

TEST(PagePool, FileArenaPersistsBytes) {
  const auto path = std::filesystem::temp_directory_path() / ("sparsekv_arena_" + std::to_string(getpid()));
  {
    PagePoolOptions o;
    o.capacity = 2;
    o.page_bytes = 4096;
    o.backing = ArenaBacking::kFile;
    o.file_path = path.string();
    auto pool = PagePool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    std::memcpy((*pool)->PageData(1), "persist", 7);
  }
  char buf[8] = {};
  FILE* f = std::fopen(path.c_str(), "rb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fseek(f, 4096, SEEK_SET), 0);
  ASSERT_EQ(std::fread(buf, 1, 7, f), 7u);
  std::fclose(f);
  EXPECT_STREQ(buf, "persist");
  std::filesystem::remove(path);
}

TEST(PagePoolLocalCache, AllocatesAndReleasesWithoutLosingPages) {
  auto pool = MakePool(100);
  {
    PagePool::LocalCache cache(*pool);
    std::vector<PageId> held;
    for (int i = 0; i < 100; ++i) {
      auto p = cache.Allocate();
      ASSERT_TRUE(p.ok()) << i;
      held.push_back(*p);
    }
    EXPECT_FALSE(cache.Allocate().ok());
    EXPECT_EQ(pool->Stats().used, 100u);
    for (PageId p : held) ASSERT_TRUE(cache.Release(p).ok());
    EXPECT_EQ(cache.Release(held[0]).code(), StatusCode::kFailedPrecondition);  // double free
    const PagePoolStats s = pool->Stats();
    EXPECT_EQ(s.used, 0u);
    EXPECT_EQ(s.free + s.thread_cached, 100u);
    EXPECT_LE(s.thread_cached, PagePool::LocalCache::kCapacity);
  }
  EXPECT_EQ(pool->Stats().free, 100u);  // the cache gave its pages back
}

TEST(PagePoolLocalCache, SharedPagesGoThroughThePool) {
  auto pool = MakePool(4);
  PagePool::LocalCache cache(*pool);
  auto p = cache.Allocate();
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(pool->Retain(*p).ok());
  ASSERT_TRUE(cache.Release(*p).ok());
  EXPECT_EQ(pool->State(*p), PageState::kInUse);
  EXPECT_EQ(pool->RefCount(*p), 1u);
  ASSERT_TRUE(cache.Release(*p).ok());
  EXPECT_NE(pool->State(*p), PageState::kInUse);
}

// Many threads allocate, share, write and release pages; every page's bytes belong to one
// owner at a time and no page is lost. Run under TSan by `SANITIZE=thread ./test.sh`.
TEST(PagePoolConcurrency, AllocateShareAndFreeFromManyThreads) {
  constexpr uint32_t kPages = 256;
  auto pool = MakePool(kPages, 64);
  std::atomic<uint64_t> evicted{0};
  pool->SetEvictListener([&](PageId) { evicted.fetch_add(1, std::memory_order_relaxed); });
  constexpr int kThreads = 4;
  constexpr int kIters = 20000;
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      PagePool::LocalCache cache(*pool);
      std::mt19937 rng(t);
      std::vector<PageId> mine;
      for (int i = 0; i < kIters; ++i) {
        const int op = rng() % 4;
        if (op < 2 || mine.empty()) {
          auto p = (op == 0) ? cache.Allocate() : pool->Allocate();
          if (!p.ok()) continue;  // exhausted is legal under contention
          auto* b = reinterpret_cast<uint64_t*>(pool->PageData(*p));
          b[0] = (uint64_t(t) << 32) | i;
          mine.push_back(*p);
        } else {
          const size_t k = rng() % mine.size();
          const PageId p = mine[k];
          const auto* b = reinterpret_cast<const uint64_t*>(pool->PageData(p));
          if ((b[0] >> 32) != uint64_t(t)) errors.fetch_add(1);
          mine[k] = mine.back();
          mine.pop_back();
          Status st = (op == 2) ? cache.Release(p) : (rng() % 2 ? pool->Release(p) : pool->ReleaseToCache(p));
          if (!st.ok()) errors.fetch_add(1);
        }
      }
      for (PageId p : mine) {
        if (!pool->Release(p).ok()) errors.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  const PagePoolStats s = pool->Stats();
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(s.free + s.cached, kPages);
  EXPECT_EQ(s.misuse, 0u);
  EXPECT_EQ(s.evictions, evicted.load());
}

TEST(PagePoolConcurrency, SharedPageRefcountsUnderContention) {
  auto pool = MakePool(1, 64);
  auto p = pool->Allocate();
  ASSERT_TRUE(p.ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        if (!pool->Retain(*p).ok()) std::abort();
        if (!pool->Release(*p).ok()) std::abort();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(pool->RefCount(*p), 1u);
  ASSERT_TRUE(pool->Release(*p).ok());
  EXPECT_EQ(pool->Stats().free, 1u);
}

}  // namespace
}  // namespace sparsekv

namespace sparsekv {
namespace {

// What the owner tells the eviction policy goes through the pool's checks: only pages with
// content, only the page released; the policy holds exactly the cached pages after any of it.
TEST(PagePoolPolicy, TellingIsCheckedAndThePolicyHoldsTheCachedPages) {
  for (EvictionPolicyKind kind : AllEvictionPolicies()) {
    PagePoolOptions o;
    o.capacity = 4;
    o.eviction = kind;
    auto pool = PagePool::Create(o);
    ASSERT_TRUE(pool.ok());
    PagePool& p = **pool;
    EXPECT_EQ(p.eviction_policy(), kind);
    const PagePool::Lineage free_page{0, 7, kInvalidPage};
    EXPECT_EQ(p.SetPageLineage({&free_page, 1}).code(), StatusCode::kFailedPrecondition) << "a free page has no content";
    EXPECT_EQ(p.SetPageProtected(9, true).code(), StatusCode::kOutOfRange);
    auto a = p.Allocate(), b = p.Allocate();
    ASSERT_TRUE(a.ok() && b.ok());
    const PagePool::Lineage self{*a, 1, *a};
    EXPECT_EQ(p.SetPageLineage({&self, 1}).code(), StatusCode::kFailedPrecondition);
    PagePool::Lineage wrong{*b, 5, kInvalidPage};
    EXPECT_EQ(p.ReleaseToCache(*a, &wrong).code(), StatusCode::kFailedPrecondition);
    PagePool::Lineage la{*a, 5, kInvalidPage}, lb{*b, 6, *a};
    ASSERT_TRUE(p.ReleaseToCache(*b, &lb).ok());
    ASSERT_TRUE(p.SetPageProtected(*a, true).ok());
    ASSERT_TRUE(p.ReleaseToCache(*a, &la).ok());
    EXPECT_TRUE(p.PageProtected(*a));
    EXPECT_EQ(p.PageHasDependents(*a), kind == EvictionPolicyKind::kArc) << "only ARC keeps lineage";
    EXPECT_EQ(p.Stats().protected_cached, 1u);
    ASSERT_TRUE(p.CheckPolicy().ok()) << p.CheckPolicy().ToString();
    // Four allocations: two free pages, then the unprotected cached one, then the protected.
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(p.Allocate().ok()) << i;
    EXPECT_FALSE(p.PageProtected(*a)) << "an evicted page forgets its protection";
    EXPECT_EQ(p.Stats().evictions, 2u);
    EXPECT_EQ(p.Stats().misuse, 4u);
    ASSERT_TRUE(p.CheckPolicy().ok()) << p.CheckPolicy().ToString();
  }
}

}  // namespace
}  // namespace sparsekv
