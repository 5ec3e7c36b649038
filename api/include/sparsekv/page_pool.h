// PagePool: fixed-size pages over one contiguous arena, with reference counts and an eviction
// policy over the cached pages (eviction_policy.h: ARC by default, LRU on request).
//
// A page is one token block of one cache kind for all the layers that keep it (see
// block_geometry.h). The pool owns its arena (anonymous memory, a memfd another process can
// map, or a file) and a pointer-free metadata array; allocate and free are O(1) and never touch
// the heap.
//
// Page states: free (in the free list or a LocalCache), in use (refcount >= 1), cached
// (refcount 0, content kept, evictable). Allocate takes a free page, else evicts the cached page
// the policy names (telling the EvictListener), else fails with ResourceExhausted and changes
// nothing. Releasing the last reference of a page makes it free (Release) or cached
// (ReleaseToCache: the policy's most recent); Revive takes a cached page back, and tells the
// policy the page was reused (a hit). The owner may tell the policy more about a page in use or
// cached (SetPageLineage, SetPageProtected); that is forgotten when the page is
// freed or evicted. With EvictionPolicyKind::kLru the pool evicts the least recently released
// cached page, as every version before the policies did.
//
// Misuse (release of an unpinned page, double free, an id out of range) returns an error in
// every build and is counted in Stats().misuse.
//
// Thread safety: every PagePool method is thread-safe (one internal mutex). A LocalCache is a
// per-thread magazine of free pages: its Allocate and Release take no lock and do no atomic
// read-modify-write in the common case; one LocalCache must be used by one thread at a time.
// Retain is legal only while the caller holds a reference (or for a page it just allocated);
// Revive is the way back from the cached state.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "sparsekv/eviction_policy.h"
#include "sparsekv/status.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv {

using PageId = uint32_t;
inline constexpr PageId kInvalidPage = UINT32_MAX;

enum class ArenaBacking : uint8_t {
  kAnonymous,  // private anonymous memory
  kMemfd,      // a memfd: its fd can be passed to another process to map the same pages
  kFile,       // a file at PagePoolOptions::file_path, mapped shared
};

struct PagePoolOptions {
  // Name used in messages and statistics. Default: "pool".
  std::string name = "pool";
  // Number of pages. Must be at least 1. Default: 0 (must be set).
  uint32_t capacity = 0;
  // Bytes per page; 0 makes a metadata-only pool with no arena (PageData returns nullptr), as
  // trace replay uses. Default: 0.
  uint64_t page_bytes = 0;
  // What backs the arena. Default: kAnonymous.
  ArenaBacking backing = ArenaBacking::kAnonymous;
  // kFile only: the file to create or reuse. Default: empty.
  std::string file_path;
  // Ask the kernel for transparent huge pages (the arena is 2 MiB-aligned). Default: true.
  bool huge_pages = true;
  // Fault every arena page in at creation (MAP_POPULATE). Default: false.
  bool populate = false;
  // Which cached page an allocation evicts. Default: kDefaultEvictionPolicy (ARC).
  EvictionPolicyKind eviction = kDefaultEvictionPolicy;
};

enum class PageState : uint8_t { kFree = 0, kLocal = 1, kInUse = 2, kCached = 3 };

struct PagePoolStats {
  uint64_t capacity = 0;
  uint64_t used = 0;           // refcount >= 1
  uint64_t free = 0;           // in the free list
  uint64_t cached = 0;         // refcount 0, content kept, evictable
  uint64_t thread_cached = 0;  // free pages held by LocalCaches
  uint64_t peak_used = 0;      // highest `used`, sampled under the pool lock, LocalCache pages counted as used
  uint64_t evictions = 0;      // cached pages taken by an allocation
  uint64_t exhausted = 0;      // allocations refused for want of pages
  uint64_t misuse = 0;         // double frees, releases of unpinned pages, bad ids
  uint64_t protected_cached = 0;  // cached pages a hint protects (evicted only when no other is)
  uint64_t policy_history = 0;    // keys of evicted pages the policy remembers (ARC's ghosts)
};

class PageHandle;

class PagePool {
 public:
  // Called with the id of a cached page that an allocation is about to reuse, under the pool's
  // lock: it must not call back into this pool.
  using EvictListener = std::function<void(PageId)>;

  static Result<std::unique_ptr<PagePool>> Create(PagePoolOptions options);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Set before the pool is shared between threads.
  void SetEvictListener(EvictListener listener);

  // A free page with refcount 1, evicting the LRU cached page if none is free.
  Result<PageId> Allocate() SPARSEKV_EXCLUDES(mu_);
  // All `out.size()` pages or none: on failure nothing is evicted and no count moves.
  Status AllocateBatch(std::span<PageId> out) SPARSEKV_EXCLUDES(mu_);
  // One more reference to an in-use page.
  Status Retain(PageId page) SPARSEKV_EXCLUDES(mu_);
  // Drops one reference; at zero the page becomes free (content abandoned).
  Status Release(PageId page) SPARSEKV_EXCLUDES(mu_);
  // A page's key and parent for the eviction policy (see SetPageLineage).
  struct Lineage {
    PageId page = kInvalidPage;
    uint64_t key = 0;
    PageId parent = kInvalidPage;
  };
  // Drops one reference; at zero the page becomes cached (the policy's most recent). With
  // `lineage`, a page cached for the first time since it was filled is told its key and parent
  // on the way (as SetPageLineage, without another lock); later releases ignore it.
  Status ReleaseToCache(PageId page, const Lineage* lineage = nullptr) SPARSEKV_EXCLUDES(mu_);
  // Releases in the order given (callers pass a sequence's pages tail first). Every page is
  // tried; the first error is returned.
  Status ReleaseBatch(std::span<const PageId> pages, bool keep_cached) SPARSEKV_EXCLUDES(mu_);
  // A cached page back in use with refcount 1; an in-use page gets one more reference.
  Status Revive(PageId page) SPARSEKV_EXCLUDES(mu_);
  // The least recently released cached page taken into use with refcount 1, telling the
  // EvictListener as Allocate's eviction does, even while free pages remain (evicting ahead of
  // need). kInvalidPage when no page is cached.
  PageId EvictOldest() SPARSEKV_EXCLUDES(mu_);
  // Pages in the free list now.
  uint64_t FreeCount() const SPARSEKV_EXCLUDES(mu_);
  // A cached page made free without telling the EvictListener (the caller already knows).
  Status Drop(PageId page) SPARSEKV_EXCLUDES(mu_);
  // Every cached page made free. Returns how many.
  uint64_t DropAllCached() SPARSEKV_EXCLUDES(mu_);

  // What the eviction policy may know about a page in use or cached (see eviction_policy.h),
  // kept until the page is freed or evicted. A free page is misuse (FailedPrecondition).
  //   key: the identity of its content (a block hash), so that content evicted recently is
  //        recognized when it comes back.
  //   parent: the page this one extends (the block before it in a prefix chain): without the
  //        parent the page is useless, so the policy evicts it first (kInvalidPage: none).
  //   protected: a hint says it will be read soon; a cached protected page is evicted only when
  //        no unprotected one is cached.
  // Key and parent of many pages under one lock (parent kInvalidPage: none; ReleaseToCache
  // takes one page's on the way). Every item is tried; the first error is returned.
  Status SetPageLineage(std::span<const Lineage> items) SPARSEKV_EXCLUDES(mu_);
  // Whether the policy uses keys and parents at all (LRU does not: telling them costs a lock).
  bool policy_uses_lineage() const { return uses_lineage_; }
  Status SetPageProtected(PageId page, bool on) SPARSEKV_EXCLUDES(mu_);
  bool PageProtected(PageId page) const SPARSEKV_EXCLUDES(mu_);
  bool PageHasDependents(PageId page) const SPARSEKV_EXCLUDES(mu_);
  EvictionPolicyKind eviction_policy() const { return options_.eviction; }
  // The policy's own bookkeeping, and that it holds exactly the cached pages.
  Status CheckPolicy() const SPARSEKV_EXCLUDES(mu_);

  // RAII forms: a handle holds one reference and releases it (to the free list) when destroyed.
  Result<PageHandle> AllocatePinned();
  Result<PageHandle> Pin(PageId page);

  uint32_t RefCount(PageId page) const;
  PageState State(PageId page) const;
  bool Valid(PageId page) const { return page < capacity_; }

  // Start of a page's bytes, or nullptr for a metadata-only pool. Precondition: Valid(page).
  std::byte* PageData(PageId page) const { return base_ ? base_ + uint64_t{page} * page_bytes_ : nullptr; }
  std::byte* arena_base() const { return base_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  // The memfd or file descriptor behind the arena, or -1 for anonymous memory.
  int arena_fd() const { return arena_fd_; }
  uint32_t capacity() const { return capacity_; }
  uint64_t page_bytes() const { return page_bytes_; }
  const std::string& name() const { return options_.name; }

  PagePoolStats Stats() const SPARSEKV_EXCLUDES(mu_);

  class LocalCache;

 private:
  explicit PagePool(PagePoolOptions options);
  Status Init();
  Status CheckId(PageId page, const char* op) const;
  Status Misuse(PageId page, const char* op, const char* why) const;
  PageId PopFreeLocked() SPARSEKV_REQUIRES(mu_);
  void PushFreeLocked(PageId page) SPARSEKV_REQUIRES(mu_);
  void CacheAppendLocked(PageId page) SPARSEKV_REQUIRES(mu_);
  void CacheUnlinkLocked(PageId page) SPARSEKV_REQUIRES(mu_);
  // Frees-to-be pages lose what the policy was told about them.
  void ForgetLocked(PageId page) SPARSEKV_REQUIRES(mu_);
  Status TellLocked(PageId page, const char* op) const SPARSEKV_REQUIRES(mu_);
  PageId TakeOneLocked() SPARSEKV_REQUIRES(mu_);
  Status ReleaseImpl(PageId page, bool keep_cached, const Lineage* lineage = nullptr) SPARSEKV_EXCLUDES(mu_);
  // Tells the policy one item's key and parent; the checks of SetPageLineage.
  Status TellLineageLocked(const Lineage& it) SPARSEKV_REQUIRES(mu_);
  void NotePeakLocked() SPARSEKV_REQUIRES(mu_);
  // LocalCache support.
  uint32_t RefillLocal(PageId* out, uint32_t want) SPARSEKV_EXCLUDES(mu_);
  void FlushLocal(const PageId* pages, uint32_t n) SPARSEKV_EXCLUDES(mu_);
  void RegisterLocal(LocalCache* cache) SPARSEKV_EXCLUDES(mu_);
  void UnregisterLocal(LocalCache* cache) SPARSEKV_EXCLUDES(mu_);

  const PagePoolOptions options_;
  const uint32_t capacity_;
  const uint64_t page_bytes_;
  std::byte* base_ = nullptr;
  uint64_t arena_bytes_ = 0;
  int arena_fd_ = -1;

  // Per-page metadata, allocated once. refs_ and state_ are atomics so that LocalCache fast
  // paths and readers never race; list links are guarded by mu_.
  std::unique_ptr<std::atomic<uint32_t>[]> refs_;
  std::unique_ptr<std::atomic<uint8_t>[]> state_;
  std::unique_ptr<uint32_t[]> next_ SPARSEKV_PT_GUARDED_BY(mu_);  // free list
  // Set (under mu_) once the policy was told something about the page, so that a LocalCache
  // hands such a page to the locked path, which makes the policy forget it.
  std::unique_ptr<std::atomic<uint8_t>[]> told_;
  std::unique_ptr<EvictionPolicy> policy_ SPARSEKV_PT_GUARDED_BY(mu_);
  bool uses_lineage_ = false;  // set by Init

  mutable Mutex mu_;
  EvictListener evict_listener_;
  PageId free_head_ SPARSEKV_GUARDED_BY(mu_) = kInvalidPage;
  uint64_t free_count_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t cached_count_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t peak_used_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t exhausted_ SPARSEKV_GUARDED_BY(mu_) = 0;
  mutable std::atomic<uint64_t> misuse_{0};
  LocalCache* locals_ SPARSEKV_GUARDED_BY(mu_) = nullptr;
};

// A per-thread magazine of free pages in front of a PagePool (as tcmalloc's per-CPU caches):
// Allocate pops a page and Release pushes one back without a lock; the pool's lock is taken
// only to refill or flush kBatch pages at a time. Pages released here become free, never
// cached: use the pool's ReleaseToCache for pages whose content should stay findable.
// Must not outlive its pool; returns its pages to the pool when destroyed.
class PagePool::LocalCache {
 public:
  static constexpr uint32_t kCapacity = 64;
  static constexpr uint32_t kBatch = 32;

  explicit LocalCache(PagePool& pool);
  ~LocalCache();
  LocalCache(const LocalCache&) = delete;
  LocalCache& operator=(const LocalCache&) = delete;

  // Inline fast paths; the pool's lock only on refill, flush or a shared page.
  Result<PageId> Allocate() {
    if (count_ == 0) return AllocateSlow();
    const PageId p = ids_[count_ - 1];
    SetCount(count_ - 1);
    pool_->refs_[p].store(1, std::memory_order_relaxed);
    pool_->state_[p].store(static_cast<uint8_t>(PageState::kInUse), std::memory_order_relaxed);
    return p;
  }
  Status Release(PageId page) {
    // Fast only when the caller holds the only reference, so no other thread may touch the page.
    if (page >= pool_->capacity_ || count_ == kCapacity ||
        pool_->refs_[page].load(std::memory_order_acquire) != 1 ||
        pool_->told_[page].load(std::memory_order_relaxed) != 0 ||
        pool_->state_[page].load(std::memory_order_relaxed) != static_cast<uint8_t>(PageState::kInUse)) {
      return ReleaseSlow(page);
    }
    pool_->refs_[page].store(0, std::memory_order_relaxed);
    pool_->state_[page].store(static_cast<uint8_t>(PageState::kLocal), std::memory_order_relaxed);
    ids_[count_] = page;
    SetCount(count_ + 1);
    return Status::OK();
  }
  // Gives every page held back to the pool.
  void Flush();
  PagePool& pool() const { return *pool_; }

 private:
  friend class PagePool;
  Result<PageId> AllocateSlow();
  Status ReleaseSlow(PageId page);
  void SetCount(uint32_t n) {
    count_ = n;
    published_count_.store(n, std::memory_order_relaxed);
  }

  PagePool* pool_;
  uint32_t count_ = 0;
  std::atomic<uint32_t> published_count_{0};  // read by PagePool::Stats
  LocalCache* next_ = nullptr;                // registry links, guarded by pool_->mu_
  LocalCache* prev_ = nullptr;
  PageId ids_[kCapacity];
};

// One reference to one page, released when the handle goes (LevelDB's Cache::Handle, DuckDB's
// BufferHandle). Move-only; no raw page pointer should outlive it.
class PageHandle {
 public:
  PageHandle() = default;
  PageHandle(PageHandle&& other) noexcept : pool_(other.pool_), page_(other.page_) {
    other.pool_ = nullptr;
    other.page_ = kInvalidPage;
  }
  PageHandle& operator=(PageHandle&& other) noexcept;
  PageHandle(const PageHandle&) = delete;
  PageHandle& operator=(const PageHandle&) = delete;
  ~PageHandle();

  bool valid() const { return pool_ != nullptr; }
  PageId id() const { return page_; }
  std::byte* data() const { return pool_ ? pool_->PageData(page_) : nullptr; }
  // Releases now and reports what the pool said.
  Status Reset();

 private:
  friend class PagePool;
  PageHandle(PagePool* pool, PageId page) : pool_(pool), page_(page) {}
  PagePool* pool_ = nullptr;
  PageId page_ = kInvalidPage;
};

}  // namespace sparsekv
