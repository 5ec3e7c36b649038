#include "sparsekv/page_pool.h"

#include <fmt/format.h>

#include <algorithm>

#include "arena.h"

namespace sparsekv {
namespace {

std::string_view StateName(PageState s) {
  switch (s) {
    case PageState::kFree: return "free";
    case PageState::kLocal: return "free (thread cache)";
    case PageState::kInUse: return "in use";
    case PageState::kCached: return "cached";
  }
  return "?";
}

}  // namespace

Result<std::unique_ptr<PagePool>> PagePool::Create(PagePoolOptions options) {
  if (options.capacity == 0) {
    return Status::InvalidArgument(fmt::format("pool {}: capacity is 0; expected at least 1 page", options.name));
  }
  if (options.capacity == kInvalidPage) {
    return Status::InvalidArgument(fmt::format("pool {}: capacity {} is too large", options.name, options.capacity));
  }
  if (options.eviction != EvictionPolicyKind::kLru && options.eviction != EvictionPolicyKind::kArc) {
    return Status::InvalidArgument(
        fmt::format("pool {}: eviction policy {} does not exist", options.name, static_cast<int>(options.eviction)));
  }
  if (options.page_bytes != 0 && options.capacity > UINT64_MAX / options.page_bytes) {
    return Status::InvalidArgument(fmt::format("pool {}: capacity x page_bytes overflows", options.name));
  }
  std::unique_ptr<PagePool> pool(new PagePool(std::move(options)));
  SPARSEKV_RETURN_IF_ERROR(pool->Init());
  return pool;
}

PagePool::PagePool(PagePoolOptions options)
    : options_(std::move(options)), capacity_(options_.capacity), page_bytes_(options_.page_bytes) {}

Status PagePool::Init() {
  refs_ = std::make_unique<std::atomic<uint32_t>[]>(capacity_);
  state_ = std::make_unique<std::atomic<uint8_t>[]>(capacity_);
  next_ = std::make_unique<uint32_t[]>(capacity_);
  told_ = std::make_unique<std::atomic<uint8_t>[]>(capacity_);
  {
    MutexLock l(mu_);
    policy_ = EvictionPolicy::Create(options_.eviction, capacity_);
    uses_lineage_ = policy_->UsesLineage();
    // Page 0 on top of the free list so a fresh pool hands out pages in address order.
    for (uint32_t i = capacity_; i-- > 0;) PushFreeLocked(i);
  }
  if (page_bytes_ != 0) {
    auto arena = MapArena(uint64_t{capacity_} * page_bytes_, options_.backing, options_.file_path,
                          options_.name, options_.huge_pages, options_.populate);
    if (!arena.ok()) return arena.status();
    base_ = arena->base;
    arena_bytes_ = arena->bytes;
    arena_fd_ = arena->fd;
  }
  return Status::OK();
}

PagePool::~PagePool() {
  Arena a{base_, arena_bytes_, arena_fd_};
  UnmapArena(a);
}

void PagePool::SetEvictListener(EvictListener listener) {
  MutexLock l(mu_);
  evict_listener_ = std::move(listener);
}

Status PagePool::CheckId(PageId page, const char* op) const {
  if (page < capacity_) return Status::OK();
  misuse_.fetch_add(1, std::memory_order_relaxed);
  return Status::OutOfRange(
      fmt::format("pool {}: {} of page {}: no such page (capacity {})", options_.name, op, page, capacity_));
}

Status PagePool::Misuse(PageId page, const char* op, const char* why) const {
  misuse_.fetch_add(1, std::memory_order_relaxed);
  return Status::FailedPrecondition(fmt::format("pool {}: {} of page {}: {} (page is {})", options_.name, op,
                                                page, why, StateName(State(page))));
}

PageId PagePool::PopFreeLocked() {
  const PageId p = free_head_;
  if (p != kInvalidPage) {
    free_head_ = next_[p];
    --free_count_;
  }
  return p;
}

void PagePool::PushFreeLocked(PageId page) {
  state_[page].store(static_cast<uint8_t>(PageState::kFree), std::memory_order_relaxed);
  next_[page] = free_head_;
  free_head_ = page;
  ++free_count_;
}

void PagePool::CacheAppendLocked(PageId page) {
  state_[page].store(static_cast<uint8_t>(PageState::kCached), std::memory_order_relaxed);
  policy_->Add(page);
  ++cached_count_;
}

void PagePool::CacheUnlinkLocked(PageId page) {
  policy_->Remove(page);
  --cached_count_;
}

void PagePool::ForgetLocked(PageId page) {
  if (told_[page].load(std::memory_order_relaxed) == 0) return;
  policy_->Forget(page);
  told_[page].store(0, std::memory_order_relaxed);
}

PageId PagePool::TakeOneLocked() {
  PageId p = PopFreeLocked();
  if (p != kInvalidPage) return p;
  p = policy_->Victim();
  if (p == kInvalidPage) return kInvalidPage;
  policy_->Evict(p);
  told_[p].store(0, std::memory_order_relaxed);
  --cached_count_;
  ++evictions_;
  if (evict_listener_) evict_listener_(p);
  return p;
}

void PagePool::NotePeakLocked() {
  peak_used_ = std::max<uint64_t>(peak_used_, capacity_ - free_count_ - cached_count_);
}

Result<PageId> PagePool::Allocate() {
  MutexLock l(mu_);
  const PageId p = TakeOneLocked();
  if (p == kInvalidPage) {
    ++exhausted_;
    return Status::ResourceExhausted(
        fmt::format("pool {}: all {} pages are in use (none free or cached)", options_.name, capacity_));
  }
  refs_[p].store(1, std::memory_order_relaxed);
  state_[p].store(static_cast<uint8_t>(PageState::kInUse), std::memory_order_relaxed);
  NotePeakLocked();
  return p;
}

PageId PagePool::EvictOldest() {
  MutexLock l(mu_);
  const PageId p = policy_->Victim();
  if (p == kInvalidPage) return kInvalidPage;
  policy_->Evict(p);
  told_[p].store(0, std::memory_order_relaxed);
  --cached_count_;
  ++evictions_;
  if (evict_listener_) evict_listener_(p);
  refs_[p].store(1, std::memory_order_relaxed);
  state_[p].store(static_cast<uint8_t>(PageState::kInUse), std::memory_order_relaxed);
  NotePeakLocked();
  return p;
}

uint64_t PagePool::FreeCount() const {
  MutexLock l(mu_);
  return free_count_;
}

Status PagePool::AllocateBatch(std::span<PageId> out) {
  MutexLock l(mu_);
  if (free_count_ + cached_count_ < out.size()) {
    ++exhausted_;
    return Status::ResourceExhausted(fmt::format(
        "pool {}: {} pages asked for, {} available ({} free, {} cached); nothing was allocated",
        options_.name, out.size(), free_count_ + cached_count_, free_count_, cached_count_));
  }
  for (PageId& p : out) {
    p = TakeOneLocked();
    refs_[p].store(1, std::memory_order_relaxed);
    state_[p].store(static_cast<uint8_t>(PageState::kInUse), std::memory_order_relaxed);
  }
  NotePeakLocked();
  return Status::OK();
}

Status PagePool::Retain(PageId page) {
  SPARSEKV_RETURN_IF_ERROR(CheckId(page, "retain"));
  uint32_t r = refs_[page].load(std::memory_order_relaxed);
  do {
    if (r == 0) return Misuse(page, "retain", "no reference is held (use Revive for a cached page)");
  } while (!refs_[page].compare_exchange_weak(r, r + 1, std::memory_order_relaxed));
  return Status::OK();
}

Status PagePool::ReleaseImpl(PageId page, bool keep_cached, const Lineage* lineage) {
  const char* op = keep_cached ? "release to cache" : "release";
  SPARSEKV_RETURN_IF_ERROR(CheckId(page, op));
  // Not the last reference: a lock-free decrement.
  uint32_t r = refs_[page].load(std::memory_order_acquire);
  while (r > 1) {
    if (refs_[page].compare_exchange_weak(r, r - 1, std::memory_order_acq_rel)) return Status::OK();
  }
  // Possibly the last: decide under the lock, so no other locked call sees an in-use page with
  // no reference.
  MutexLock l(mu_);
  r = refs_[page].load(std::memory_order_acquire);
  for (;;) {
    if (r == 0) return Misuse(page, op, "released while not pinned (double free?)");
    if (refs_[page].compare_exchange_weak(r, r - 1, std::memory_order_acq_rel)) break;
  }
  if (r > 1) return Status::OK();
  if (!keep_cached) {
    ForgetLocked(page);
    PushFreeLocked(page);
    return Status::OK();
  }
  // A lineage the pool refuses is reported; the page is cached all the same.
  Status told;
  if (lineage != nullptr && uses_lineage_ && !policy_->Seen(page)) told = TellLineageLocked(*lineage);
  CacheAppendLocked(page);
  return told;
}

Status PagePool::Release(PageId page) { return ReleaseImpl(page, false); }
Status PagePool::ReleaseToCache(PageId page, const Lineage* lineage) {
  if (lineage != nullptr && lineage->page != page) {
    return Misuse(page, "release to cache", "the lineage given is another page's");
  }
  return ReleaseImpl(page, true, lineage);
}

Status PagePool::ReleaseBatch(std::span<const PageId> pages, bool keep_cached) {
  Status first;
  for (PageId p : pages) {
    Status st = ReleaseImpl(p, keep_cached);
    if (!st.ok() && first.ok()) first = std::move(st);
  }
  return first;
}

Status PagePool::Revive(PageId page) {
  SPARSEKV_RETURN_IF_ERROR(CheckId(page, "revive"));
  MutexLock l(mu_);
  switch (static_cast<PageState>(state_[page].load(std::memory_order_relaxed))) {
    case PageState::kCached:
      CacheUnlinkLocked(page);
      policy_->MarkReused(page);
      told_[page].store(1, std::memory_order_relaxed);
      refs_[page].store(1, std::memory_order_relaxed);
      state_[page].store(static_cast<uint8_t>(PageState::kInUse), std::memory_order_relaxed);
      NotePeakLocked();
      return Status::OK();
    case PageState::kInUse:
      refs_[page].fetch_add(1, std::memory_order_relaxed);
      policy_->MarkReused(page);
      told_[page].store(1, std::memory_order_relaxed);
      return Status::OK();
    default:
      return Misuse(page, "revive", "the page is free and its content is gone");
  }
}

Status PagePool::Drop(PageId page) {
  SPARSEKV_RETURN_IF_ERROR(CheckId(page, "drop"));
  MutexLock l(mu_);
  if (static_cast<PageState>(state_[page].load(std::memory_order_relaxed)) != PageState::kCached) {
    return Misuse(page, "drop", "only a cached page can be dropped");
  }
  CacheUnlinkLocked(page);
  ForgetLocked(page);
  PushFreeLocked(page);
  return Status::OK();
}

uint64_t PagePool::DropAllCached() {
  MutexLock l(mu_);
  uint64_t n = 0;
  for (PageId p = policy_->Victim(); p != kInvalidPage; p = policy_->Victim()) {
    CacheUnlinkLocked(p);
    ForgetLocked(p);
    PushFreeLocked(p);
    ++n;
  }
  return n;
}

Status PagePool::TellLocked(PageId page, const char* op) const {
  SPARSEKV_RETURN_IF_ERROR(CheckId(page, op));
  const auto st = static_cast<PageState>(state_[page].load(std::memory_order_relaxed));
  if (st != PageState::kInUse && st != PageState::kCached) {
    return Misuse(page, op, "only a page in use or cached has content to tell about");
  }
  return Status::OK();
}

Status PagePool::SetPageProtected(PageId page, bool on) {
  MutexLock l(mu_);
  SPARSEKV_RETURN_IF_ERROR(TellLocked(page, "protect"));
  policy_->SetProtected(page, on);
  told_[page].store(1, std::memory_order_relaxed);
  return Status::OK();
}

Status PagePool::SetPageLineage(std::span<const Lineage> items) {
  MutexLock l(mu_);
  Status first;
  // Start every random load first, so that the misses overlap.
  for (const Lineage& it : items) {
    if (it.page < capacity_) policy_->Prefetch(it.key, it.parent);
  }
  for (const Lineage& it : items) {
    Status st = TellLineageLocked(it);
    if (!st.ok() && first.ok()) first = std::move(st);
  }
  return first;
}

Status PagePool::TellLineageLocked(const Lineage& it) {
  SPARSEKV_RETURN_IF_ERROR(TellLocked(it.page, "set lineage"));
  if (it.parent != kInvalidPage) SPARSEKV_RETURN_IF_ERROR(TellLocked(it.parent, "set lineage"));
  if (it.parent == it.page) return Misuse(it.page, "set lineage", "a page cannot extend itself");
  policy_->SetKey(it.page, it.key);
  policy_->SetParent(it.page, it.parent);
  told_[it.page].store(1, std::memory_order_relaxed);
  if (it.parent != kInvalidPage) told_[it.parent].store(1, std::memory_order_relaxed);
  return Status::OK();
}

bool PagePool::PageProtected(PageId page) const {
  MutexLock l(mu_);
  return page < capacity_ && policy_->Protected(page);
}

bool PagePool::PageHasDependents(PageId page) const {
  MutexLock l(mu_);
  return page < capacity_ && policy_->HasDependents(page);
}

Status PagePool::CheckPolicy() const {
  MutexLock l(mu_);
  SPARSEKV_RETURN_IF_ERROR(policy_->Check().WithContext(fmt::format("pool {}", options_.name)));
  if (policy_->size() != cached_count_) {
    return Status::Internal(fmt::format("pool {}: {} cached pages but the eviction policy holds {}",
                                        options_.name, cached_count_, policy_->size()));
  }
  for (PageId p = 0; p < capacity_; ++p) {
    const bool cached = static_cast<PageState>(state_[p].load(std::memory_order_relaxed)) == PageState::kCached;
    if (cached != policy_->Evictable(p)) {
      return Status::Internal(fmt::format("pool {}: page {} is {} but {} evictable", options_.name, p,
                                          StateName(State(p)), cached ? "not" : ""));
    }
  }
  return Status::OK();
}

Result<PageHandle> PagePool::AllocatePinned() {
  auto p = Allocate();
  if (!p.ok()) return p.status();
  return PageHandle(this, *p);
}

Result<PageHandle> PagePool::Pin(PageId page) {
  SPARSEKV_RETURN_IF_ERROR(Revive(page));
  return PageHandle(this, page);
}

uint32_t PagePool::RefCount(PageId page) const {
  return page < capacity_ ? refs_[page].load(std::memory_order_relaxed) : 0;
}

PageState PagePool::State(PageId page) const {
  return page < capacity_ ? static_cast<PageState>(state_[page].load(std::memory_order_relaxed))
                          : PageState::kFree;
}

PagePoolStats PagePool::Stats() const {
  PagePoolStats s;
  MutexLock l(mu_);
  s.capacity = capacity_;
  s.free = free_count_;
  s.cached = cached_count_;
  for (const LocalCache* c = locals_; c != nullptr; c = c->next_) {
    s.thread_cached += c->published_count_.load(std::memory_order_relaxed);
  }
  s.used = capacity_ - s.free - s.cached - s.thread_cached;
  s.peak_used = peak_used_;
  s.evictions = evictions_;
  s.exhausted = exhausted_;
  s.misuse = misuse_.load(std::memory_order_relaxed);
  s.protected_cached = policy_->protected_size();
  s.policy_history = policy_->history_size();
  return s;
}

uint32_t PagePool::RefillLocal(PageId* out, uint32_t want) {
  MutexLock l(mu_);
  uint32_t n = 0;
  while (n < want) {
    const PageId p = PopFreeLocked();
    if (p == kInvalidPage) break;
    ForgetLocked(p);
    state_[p].store(static_cast<uint8_t>(PageState::kLocal), std::memory_order_relaxed);
    out[n++] = p;
  }
  NotePeakLocked();
  return n;
}

void PagePool::FlushLocal(const PageId* pages, uint32_t n) {
  MutexLock l(mu_);
  for (uint32_t i = 0; i < n; ++i) PushFreeLocked(pages[i]);
}

void PagePool::RegisterLocal(LocalCache* cache) {
  MutexLock l(mu_);
  cache->next_ = locals_;
  cache->prev_ = nullptr;
  if (locals_) locals_->prev_ = cache;
  locals_ = cache;
}

void PagePool::UnregisterLocal(LocalCache* cache) {
  MutexLock l(mu_);
  if (cache->prev_) {
    cache->prev_->next_ = cache->next_;
  } else {
    locals_ = cache->next_;
  }
  if (cache->next_) cache->next_->prev_ = cache->prev_;
}

// ---- LocalCache ----

PagePool::LocalCache::LocalCache(PagePool& pool) : pool_(&pool) { pool_->RegisterLocal(this); }

PagePool::LocalCache::~LocalCache() {
  Flush();
  pool_->UnregisterLocal(this);
}

void PagePool::LocalCache::Flush() {
  if (count_ == 0) return;
  pool_->FlushLocal(ids_, count_);
  SetCount(0);
}

Result<PageId> PagePool::LocalCache::AllocateSlow() {
  SetCount(pool_->RefillLocal(ids_, kBatch));
  // Nothing free: the pool's own path may evict a cached page.
  if (count_ == 0) return pool_->Allocate();
  return Allocate();
}

Status PagePool::LocalCache::ReleaseSlow(PageId page) {
  SPARSEKV_RETURN_IF_ERROR(pool_->CheckId(page, "release"));
  const uint32_t r = pool_->refs_[page].load(std::memory_order_acquire);
  if (r != 1 || pool_->State(page) != PageState::kInUse) {
    // Shared (or misused) page: the pool's locked path sorts it out.
    return pool_->Release(page);
  }
  // Full: give back the oldest half and keep the most recently freed (warm) pages.
  pool_->FlushLocal(ids_, kBatch);
  std::copy(ids_ + kBatch, ids_ + kCapacity, ids_);
  SetCount(kCapacity - kBatch);
  return Release(page);
}

// ---- PageHandle ----

PageHandle& PageHandle::operator=(PageHandle&& other) noexcept {
  if (this != &other) {
    Reset().IgnoreError();  // a failure is counted in the pool's misuse statistics
    pool_ = other.pool_;
    page_ = other.page_;
    other.pool_ = nullptr;
    other.page_ = kInvalidPage;
  }
  return *this;
}

PageHandle::~PageHandle() { Reset().IgnoreError(); }

Status PageHandle::Reset() {
  if (pool_ == nullptr) return Status::OK();
  PagePool* pool = pool_;
  pool_ = nullptr;
  return pool->Release(page_);
}

}  // namespace sparsekv
