// The host-DRAM tier: one PagePool page per bundle, the pool's cached-page LRU as the tier's
// LRU (host_tier.h).
//
// A stored bundle's page is "cached" in the pool (refcount 0, in the LRU). A get revives it
// (pinning it and taking it out of the LRU), copies and checks the record outside the lock, and
// releases it back to the most recently used end. A put allocates a page, which makes the pool
// evict its least recently used cached page when none is free; the pool tells us through the
// evict listener, under our lock (Allocate is only called with mu_ held), and we forget that
// key. Erasing or replacing a key whose page is pinned by a reader marks the page orphaned: the
// reader frees it instead of caching it.
#include "sparsekv/host_tier.h"

#include <fmt/format.h>

#include <cstring>
#include <unordered_map>
#include <vector>

#include "sparsekv/thread_annotations.h"

namespace sparsekv {
namespace {

class HostTierImpl final : public HostTier {
 public:
  explicit HostTierImpl(HostTierOptions options) : options_(std::move(options)) {}

  Status Init() {
    if (options_.slot_bytes < BundleHeaderBytes(0)) {
      return Status::InvalidArgument(
          fmt::format("host tier: slot_bytes {} is too small: set it to the record bytes of the "
                      "model's block (at least {})",
                      options_.slot_bytes, BundleHeaderBytes(0)));
    }
    const uint64_t slots = options_.capacity_bytes / options_.slot_bytes;
    if (slots == 0 || slots > UINT32_MAX - 1) {
      return Status::InvalidArgument(
          fmt::format("host tier: capacity_bytes {} holds {} slots of {} bytes; expected 1 to {}",
                      options_.capacity_bytes, slots, options_.slot_bytes, UINT32_MAX - 1));
    }
    PagePoolOptions po;
    po.name = options_.name;
    po.capacity = static_cast<uint32_t>(slots);
    po.page_bytes = (options_.slot_bytes + 4095) & ~uint64_t{4095};  // a record's 4 KiB padding fits
    po.backing = options_.backing;
    po.huge_pages = options_.huge_pages;
    SPARSEKV_ASSIGN_OR_RETURN(pool_, PagePool::Create(po));
    meta_.resize(slots);
    pool_->SetEvictListener([this](PageId page)
                                SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { OnEvictLocked(page); });
    return Status::OK();
  }

  std::string_view name() const override { return options_.name; }
  uint64_t capacity_bytes() const override {
    return uint64_t{pool_->capacity()} * options_.slot_bytes;
  }
  uint64_t max_record_bytes() const override { return options_.slot_bytes; }

  TierStats Stats() const override {
    MutexLock lock(mu_);
    TierStats s = stats_;
    s.name = options_.name;
    s.capacity_bytes = capacity_bytes();
    s.items = index_.size();
    return s;
  }

  Status SetEvictionListener(EvictionListener listener) override {
    MutexLock lock(mu_);
    listener_ = std::move(listener);
    return Status::OK();
  }

  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    std::vector<Status> out(bundles.size());
    std::vector<BundlePtr> evicted;
    for (size_t i = 0; i < bundles.size(); ++i) out[i] = PutOne(bundles[i], &evicted);
    if (!evicted.empty()) {
      EvictionListener listener;
      {
        MutexLock lock(mu_);
        listener = listener_;
      }
      if (listener) listener(std::move(evicted));
    }
    done(std::move(out));
  }

  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    std::vector<Result<BundlePtr>> out;
    out.reserve(keys.size());
    for (const BundleKey& k : keys) out.push_back(GetOne(k));
    done(std::move(out));
  }

  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    std::vector<bool> out(keys.size());
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < keys.size(); ++i) out[i] = index_.count(keys[i]) != 0;
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    std::vector<Status> out(keys.size());
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        auto it = index_.find(keys[i]);
        if (it == index_.end()) continue;
        ++stats_.erased;
        out[i] = ForgetLocked(it);
      }
    }
    done(std::move(out));
  }

  Status CorruptForTesting(const BundleKey& key, uint64_t offset) override {
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return Status::NotFound("host tier: no bundle " + key.ToString());
    if (offset >= meta_[it->second].record_bytes)
      return Status::OutOfRange("host tier: offset past the record");
    pool_->PageData(it->second)[offset] ^= std::byte{0x10};
    return Status::OK();
  }

 private:
  struct PageMeta {
    BundleKey key;
    uint64_t record_bytes = 0;
    uint64_t checksum = 0;
    bool orphaned = false;  // erased or replaced while a reader held it
  };

  Status PutOne(const BundlePtr& b, std::vector<BundlePtr>* evicted) SPARSEKV_EXCLUDES(mu_) {
    if (!b) return Status::InvalidArgument("host tier: null bundle");
    if (b->record_bytes() > options_.slot_bytes) {
      MutexLock lock(mu_);
      ++stats_.put_failures;
      return Status::InvalidArgument(
          fmt::format("host tier: bundle {} of {} bytes exceeds the slot of {} bytes",
                      b->key().ToString(), b->record_bytes(), options_.slot_bytes));
    }
    PageId page;
    {
      MutexLock lock(mu_);
      auto same = index_.find(b->key());
      if (same != index_.end() && meta_[same->second].checksum == b->checksum() &&
          meta_[same->second].record_bytes == b->record_bytes() &&
          pool_->State(same->second) == PageState::kCached) {
        // The same bundle again (a repeated demote): only its recency changes.
        SPARSEKV_RETURN_IF_ERROR(pool_->Revive(same->second));
        return pool_->ReleaseToCache(same->second);
      }
      evicting_into_ = listener_ ? evicted : nullptr;
      Result<PageId> p = pool_->Allocate();
      evicting_into_ = nullptr;
      if (!p.ok()) {
        ++stats_.put_failures;
        return Status::ResourceExhausted(
            fmt::format("host tier: every one of {} slots is being read", pool_->capacity()));
      }
      page = *p;
    }
    // The page is pinned and not yet in the index: nobody else touches it. The padding to
    // 4 KiB is zeroed, as a RecordBuffer's is (GetPinned hands the page out as one).
    std::byte* dst = pool_->PageData(page);
    std::memcpy(dst, b->record().data(), b->record_bytes());
    const uint64_t padded = (b->record_bytes() + 4095) & ~uint64_t{4095};
    std::memset(dst + b->record_bytes(), 0, padded - b->record_bytes());
    MutexLock lock(mu_);
    auto it = index_.find(b->key());
    if (it != index_.end()) {
      Status s = ForgetLocked(it);
      if (!s.ok()) return s;
    }
    meta_[page] = {b->key(), b->record_bytes(), b->checksum(), false};
    index_.emplace(b->key(), page);
    stats_.bytes += b->record_bytes();
    stats_.bytes_written += b->record_bytes();
    ++stats_.puts;
    return pool_->ReleaseToCache(page);
  }

  Arena arena() const override {
    return {pool_->arena_fd(), pool_->PageData(0), uint64_t{pool_->capacity()} * pool_->page_bytes()};
  }

  Result<BundlePtr> GetPinned(const BundleKey& key, bool check) override {
    return GetOne(key, /*in_place=*/true, check);
  }

  Status CheckPinned(const BundlePtr& b, const BundleKey& key) override {
    Status v = Bundle::VerifyRecord(b->record(), key);
    if (v.ok()) return v;
    MutexLock lock(mu_);
    ++stats_.corrupt;
    auto it = index_.find(key);  // not b->key(): that was read from the damaged page
    if (it != index_.end() && pool_->PageData(it->second) == b->record().data()) {
      stats_.bytes -= meta_[it->second].record_bytes;
      meta_[it->second].orphaned = true;  // freed when the last reader lets go
      index_.erase(it);
    }
    return v.WithContext("host tier");
  }

  Result<BundlePtr> GetOne(const BundleKey& key, bool in_place = false, bool check = true) SPARSEKV_EXCLUDES(mu_) {
    PageId page;
    uint64_t bytes;
    {
      MutexLock lock(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) {
        ++stats_.misses;
        return Status::NotFound("host tier: no bundle " + key.ToString());
      }
      page = it->second;
      bytes = meta_[page].record_bytes;
      SPARSEKV_RETURN_IF_ERROR(pool_->Revive(page));
    }
    std::byte* data = pool_->PageData(page);
    if (in_place) {
      Status v = check ? Bundle::VerifyRecord({data, bytes}, key) : Bundle::VerifyRecordLayout({data, bytes}, key);
      if (v.ok()) {
        {
          MutexLock lock(mu_);
          ++stats_.hits;
          stats_.bytes_read += bytes;
        }
        // The page stays pinned until the bundle's last owner lets go.
        RecordBuffer view(data, (bytes + 4095) & ~uint64_t{4095},
                          [this, page](std::byte*) { ReleasePinned(page).IgnoreError(); });
        return Bundle::AdoptVerifiedRecord(std::move(view), bytes);
      }
    }
    Result<BundlePtr> b = Bundle::ParseRecord({data, bytes}, key);
    MutexLock lock(mu_);
    if (!b.ok()) {
      ++stats_.corrupt;
      auto it = index_.find(key);
      if (it != index_.end() && it->second == page) {
        index_.erase(it);
        stats_.bytes -= bytes;
        meta_[page].orphaned = true;
      }
    } else {
      ++stats_.hits;
      stats_.bytes_read += bytes;
    }
    const Status s = ReleaseLocked(page);
    if (!s.ok()) return s;
    if (!b.ok()) return b.status().WithContext("host tier");
    return b;
  }

  // A reader lets go of a page: back to the LRU, or freed if erased or replaced meanwhile.
  Status ReleaseLocked(PageId page) SPARSEKV_REQUIRES(mu_) {
    const bool keep = !meta_[page].orphaned;
    if (pool_->RefCount(page) == 1) meta_[page].orphaned = false;  // the last reader
    return keep ? pool_->ReleaseToCache(page) : pool_->Release(page);
  }

  Status ReleasePinned(PageId page) SPARSEKV_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return ReleaseLocked(page);
  }

  // Drops a key's page: made free now if cached, by its reader if pinned.
  Status ForgetLocked(std::unordered_map<BundleKey, PageId, BundleKeyHasher>::iterator it)
      SPARSEKV_REQUIRES(mu_) {
    const PageId page = it->second;
    stats_.bytes -= meta_[page].record_bytes;
    index_.erase(it);
    if (pool_->State(page) == PageState::kCached) return pool_->Drop(page);
    meta_[page].orphaned = true;
    return Status::OK();
  }

  // The pool is about to reuse a cached page: runs inside Allocate, which holds mu_.
  void OnEvictLocked(PageId page) SPARSEKV_REQUIRES(mu_) {
    const PageMeta& m = meta_[page];
    auto it = index_.find(m.key);
    if (it == index_.end() || it->second != page) return;
    if (evicting_into_) {
      // Checked like any read: a damaged bundle is not handed down.
      Result<BundlePtr> b = Bundle::ParseRecord({pool_->PageData(page), m.record_bytes}, m.key);
      if (b.ok()) {
        evicting_into_->push_back(std::move(*b));
      } else {
        ++stats_.corrupt;
      }
    }
    stats_.bytes -= m.record_bytes;
    ++stats_.evictions;
    index_.erase(it);
  }

  const HostTierOptions options_;
  std::unique_ptr<PagePool> pool_;
  std::vector<PageMeta> meta_ SPARSEKV_GUARDED_BY(mu_);
  mutable Mutex mu_;
  std::unordered_map<BundleKey, PageId, BundleKeyHasher> index_ SPARSEKV_GUARDED_BY(mu_);
  EvictionListener listener_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<BundlePtr>* evicting_into_ SPARSEKV_GUARDED_BY(mu_) = nullptr;
  TierStats stats_ SPARSEKV_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<HostTier>> HostTier::Open(const HostTierOptions& options) {
  auto tier = std::make_unique<HostTierImpl>(options);
  SPARSEKV_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<HostTier>(std::move(tier));
}

}  // namespace sparsekv
