// The host-DRAM tier: records in extents of one arena, an eviction policy over them
// (host_tier.h).
//
// An entry is a record's extent and what the index knows of it. A get pins the entry (readers),
// copies or checks the record outside the lock and lets go; a put reserves an extent under the
// lock (evicting the policy's victims nobody reads until one fits), copies the record outside
// it and publishes the entry. Erasing, replacing or evicting an entry somebody reads
// only takes it out of the index ("orphaned"): its extent is freed by the last reader, so no
// byte a reader holds is ever rewritten.
#include "sparsekv/host_tier.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <optional>
#include <unordered_map>
#include <vector>

#include "allocator/arena.h"
#include "extent_allocator.h"
#include "tier_eviction.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv {
namespace {

constexpr uint64_t kUnit = 4096;

uint64_t UnitsOf(uint64_t bytes) {
  return (bytes + kUnit - 1) / kUnit;
}

class HostTierImpl final : public HostTier {
 public:
  explicit HostTierImpl(HostTierOptions options)
      : options_(std::move(options)),
        eviction_(options_.eviction, static_cast<uint64_t>(std::clamp(options_.hint_bound, 0.0, 1.0) *
                                                           static_cast<double>(options_.capacity_bytes))) {}
  ~HostTierImpl() override {
    UnmapArena(arena_);
    UnmapArena(table_);
  }

  Status Init() {
    if (!(options_.hint_bound >= 0 && options_.hint_bound <= 1)) {
      return Status::InvalidArgument(
          fmt::format("host tier: hint_bound {} must be from 0 to 1", options_.hint_bound));
    }
    units_ = options_.capacity_bytes / kUnit;
    if (units_ == 0 || units_ > (uint64_t{1} << 40)) {
      return Status::InvalidArgument(fmt::format(
          "host tier: capacity_bytes {} must be from 4 KiB to 4 PiB", options_.capacity_bytes));
    }
    if (options_.max_record_bytes == 0) options_.max_record_bytes = units_ * kUnit;
    if (options_.max_record_bytes < BundleHeaderBytes(0) ||
        UnitsOf(options_.max_record_bytes) > units_) {
      return Status::InvalidArgument(
          fmt::format("host tier: max_record_bytes {} must be from {} to the capacity ({} bytes)",
                      options_.max_record_bytes, BundleHeaderBytes(0), units_ * kUnit));
    }
    SPARSEKV_ASSIGN_OR_RETURN(arena_, MapArena(units_ * kUnit, options_.backing, "", options_.name,
                                               options_.huge_pages, options_.populate));
    if (options_.backing == ArenaBacking::kMemfd) {
      // The lend table (LendToken): one u32 per unit, zeroed by the kernel.
      SPARSEKV_ASSIGN_OR_RETURN(table_, MapArena(units_ * sizeof(uint32_t), ArenaBacking::kMemfd, "",
                                                 options_.name + "-lend-table", false, false));
    }
    MutexLock lock(mu_);
    free_.AddFree(0, units_);
    return Status::OK();
  }

  std::string_view name() const override { return options_.name; }
  uint64_t capacity_bytes() const override { return units_ * kUnit; }
  uint64_t max_record_bytes() const override { return options_.max_record_bytes; }

  TierStats Stats() const override {
    MutexLock lock(mu_);
    TierStats s = stats_;
    s.name = options_.name;
    s.capacity_bytes = capacity_bytes();
    s.items = index_.size();
    s.protected_items = eviction_.protected_items();
    s.protected_bytes = eviction_.protected_bytes();
    s.hinted_keys = eviction_.hinted_keys();
    s.hint_cut = eviction_.hint_cut();
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
    HandOver(std::move(evicted));
    done(std::move(out));
  }

  Result<BundlePtr> PutGathered(const BundleKey& key,
                                std::span<const std::span<const std::byte>> segments,
                                uint64_t sequence, uint32_t pages = 0) override {
    std::vector<uint64_t> sizes;
    for (const auto& seg : segments) sizes.push_back(seg.size());
    if (segments.size() > kMaxBundleSegments) {
      return Status::InvalidArgument(fmt::format("host tier: a bundle holds at most {} segments",
                                                 kMaxBundleSegments));
    }
    const uint64_t record_bytes = BundleRecordBytes(sizes);
    if (record_bytes > options_.max_record_bytes) return TooLarge(key, record_bytes);
    const uint64_t units = UnitsOf(record_bytes);
    std::vector<BundlePtr> evicted;
    EntryId id = 0;
    std::byte* dst = nullptr;
    Status refused;
    {
      MutexLock lock(mu_);
      auto same = index_.find(key);
      if (same != index_.end() && entries_[same->second].sequence > sequence) {
        ++stats_.superseded;
        return Status::FailedPrecondition(
            fmt::format("host tier: a newer version of {} is held", key.ToString()));
      }
      std::optional<uint64_t> at = AllocateLocked(units, listener_ ? &evicted : nullptr);
      if (!at) {
        ++stats_.put_failures;
        refused = Status::ResourceExhausted(fmt::format(
            "host tier: no room for {} bytes: the {} bytes that are not free are held by "
            "readers",
            units * kUnit, capacity_bytes() - free_.free_units() * kUnit));
      } else {
        id = NewEntryLocked();
        Entry& e = entries_[id];
        e.key = key;
        e.at = *at;
        e.units = units;
        e.record_bytes = record_bytes;
        e.sequence = sequence;
        e.readers = 1;  // the copy below, then the pinned result: never evictable meanwhile
        dst = DataOf(e);
      }
    }
    HandOver(std::move(evicted));
    if (!refused.ok()) return refused;
    Result<uint64_t> sum = Bundle::WriteRecord({dst, record_bytes}, key, segments, sequence, pages);
    std::memset(dst + record_bytes, 0, units * kUnit - record_bytes);  // as PutOne's padding
    MutexLock lock(mu_);
    Entry& e = entries_[id];
    if (!sum.ok()) {
      ReleaseReaderLocked(id);
      ++stats_.put_failures;
      return sum.status().WithContext("host tier");
    }
    e.checksum = *sum;
    if (!PublishLocked(id)) {
      ReleaseReaderLocked(id);
      return Status::FailedPrecondition(
          fmt::format("host tier: a newer version of {} is held", key.ToString()));
    }
    RecordBuffer view(dst, units * kUnit, [this, id](std::byte*) { ReleaseReader(id); });
    return Bundle::AdoptVerifiedRecord(std::move(view), record_bytes);
  }

  Result<Reservation> Reserve(const BundleKey& key, uint64_t payload_bytes, uint64_t sequence) override {
    const uint64_t sizes[1] = {payload_bytes};
    const uint64_t record_bytes = BundleRecordBytes(sizes);
    if (record_bytes > options_.max_record_bytes) return TooLarge(key, record_bytes);
    const uint64_t units = UnitsOf(record_bytes);
    std::vector<BundlePtr> evicted;
    Reservation r;
    Status refused;
    {
      MutexLock lock(mu_);
      auto same = index_.find(key);
      if (same != index_.end() && entries_[same->second].sequence > sequence) {
        ++stats_.superseded;
        return Status::FailedPrecondition(fmt::format("host tier: a newer version of {} is held", key.ToString()));
      }
      std::optional<uint64_t> at = AllocateLocked(units, listener_ ? &evicted : nullptr);
      if (!at) {
        ++stats_.put_failures;
        refused = Status::ResourceExhausted(fmt::format(
            "host tier: no room for {} bytes: the {} bytes that are not free are held by readers", units * kUnit,
            capacity_bytes() - free_.free_units() * kUnit));
      } else {
        const EntryId id = NewEntryLocked();
        Entry& e = entries_[id];
        e.key = key;
        e.at = *at;
        e.units = units;
        e.record_bytes = record_bytes;
        e.sequence = sequence;
        e.readers = 1;  // the writer's, then the pinned result's: never evictable meanwhile
        r.id = id;
        r.record = DataOf(e);
        r.record_bytes = record_bytes;
      }
    }
    HandOver(std::move(evicted));
    if (!refused.ok()) return refused;
    Result<uint64_t> header = Bundle::WriteRecordHeader({r.record, record_bytes}, key, sizes, sequence);
    if (!header.ok()) {
      AbortReserved(r);
      return header.status().WithContext("host tier");
    }
    r.header_bytes = *header;  // the padding after the record is zeroed at the commit
    return r;
  }

  Result<BundlePtr> CommitReserved(const Reservation& r, uint64_t checksum, uint64_t resequence) override {
    BundleKey key;
    uint64_t sequence, units;
    {
      MutexLock lock(mu_);
      Entry& e = entries_[r.id];
      // Unpublished, so no reader knows the entry's sequence yet: the version may take a later one.
      if (resequence > e.sequence) e.sequence = resequence;
      key = e.key;
      sequence = e.sequence;
      units = e.units;
    }
    // The header as Reserve wrote it, built again from the tier's own metadata: the shared
    // bytes are compared with it, never parsed, so a writer changing them meanwhile can make
    // the check fail but never make it read outside the extent.
    std::byte want[BundleHeaderBytes(1)];
    const uint64_t sizes[1] = {r.record_bytes - r.header_bytes};
    Status bad;
    const bool built = Bundle::WriteRecordHeader(want, key, sizes, sequence).ok();
    // A record the daemon wrote itself, given a later sequence: its header takes the new one.
    if (built && resequence != 0) std::memcpy(r.record + 16, want + 16, r.header_bytes - 16);
    if (!built) {
      bad = Status::Internal("host tier: the reserved header cannot be built again");
    } else if (checksum == 0 && std::memcmp(r.record + 16, want + 16, r.header_bytes - 16) == 0) {
      // No checksum from the writer: the header is checked, and the record's checksum is
      // computed here over the bytes as they are now (a later change fails its reads' checks).
      checksum = Bundle::ChecksumOf({r.record, r.record_bytes});
      std::memcpy(r.record + 8, &checksum, 8);
      std::memcpy(want + 8, &checksum, 8);
      std::memset(r.record + r.record_bytes, 0, units * kUnit - r.record_bytes);
      if (std::memcmp(r.record, want, r.header_bytes) != 0) {
        bad = Status::Corruption(
            fmt::format("host tier: the leased record of {} had its header changed; not stored", key.ToString()));
      }
    } else {
      std::memcpy(want + 8, &checksum, 8);
      std::memcpy(r.record + 8, &checksum, 8);
      std::memset(r.record + r.record_bytes, 0, units * kUnit - r.record_bytes);
      if (std::memcmp(r.record, want, r.header_bytes) != 0) {
        bad = Status::Corruption(
            fmt::format("host tier: the leased record of {} had its header changed; not stored", key.ToString()));
      } else if (const uint64_t sum = Bundle::ChecksumOf({r.record, r.record_bytes}); sum != checksum) {
        bad = Status::Corruption(fmt::format(
            "host tier: the leased record of {} has checksum {:016x}, its commit says {:016x}; not stored",
            key.ToString(), sum, checksum));
      }
    }
    MutexLock lock(mu_);
    Entry& e = entries_[r.id];
    if (!bad.ok()) {
      ++stats_.put_failures;
      ReleaseReaderLocked(r.id);
      return bad;
    }
    e.checksum = checksum;
    if (!PublishLocked(r.id)) {
      ReleaseReaderLocked(r.id);
      return Status::FailedPrecondition(fmt::format("host tier: a newer version of {} is held", key.ToString()));
    }
    const EntryId id = static_cast<EntryId>(r.id);
    RecordBuffer view(r.record, units * kUnit, [this, id](std::byte*) { ReleaseReader(id); });
    return Bundle::AdoptVerifiedRecord(std::move(view), r.record_bytes);
  }

  void AbortReserved(const Reservation& r) override {
    MutexLock lock(mu_);
    ReleaseReaderLocked(static_cast<EntryId>(r.id));
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
      // A record on its way to the eviction listener is still held, for the moment.
      for (size_t i = 0; i < keys.size(); ++i)
        out[i] = index_.count(keys[i]) != 0 || handing_over_.count(keys[i]) != 0;
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    EraseOlderAsync(std::move(keys), {}, std::move(done));
  }

  void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below,
                       StatusesCallback done) override {
    std::vector<Status> out(keys.size());
    {
      MutexLock lock(mu_);
      // A key evicted but not yet handed to the listener is in neither this tier's index nor
      // (for a chain) on its way down: wait until it is, so that whoever erases it next in the
      // tier below cannot miss it.
      handed_over_.wait(mu_, [&]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
        return std::none_of(keys.begin(), keys.end(),
                            [&](const BundleKey& k) { return handing_over_.count(k) != 0; });
      });
      for (size_t i = 0; i < keys.size(); ++i) {
        auto it = index_.find(keys[i]);
        if (it == index_.end()) continue;
        if (!below.empty() && entries_[it->second].sequence >= below[i]) continue;
        ++stats_.erased;
        ForgetLocked(it);
      }
    }
    done(std::move(out));
  }

  std::optional<std::vector<BundleKey>> ListKeys() const override { return Keys(); }
  bool SetKeyJournal(std::shared_ptr<KeyJournal> journal) override {
    MutexLock lock(mu_);
    journal_ = std::move(journal);
    return true;
  }
  std::vector<BundleKey> Keys() const override {
    MutexLock lock(mu_);
    std::vector<BundleKey> keys;
    keys.reserve(index_.size());
    eviction_.ForEach([&](uint32_t id) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { keys.push_back(entries_[id].key); });
    // Parked entries (read when the policy named them) were read last.
    for (EntryId id = 0; id < entries_.size(); ++id) {
      if (entries_[id].indexed && eviction_.Parked(id)) keys.push_back(entries_[id].key);
    }
    return keys;
  }

  Status CorruptForTesting(const BundleKey& key, uint64_t offset) override {
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return Status::NotFound("host tier: no bundle " + key.ToString());
    const Entry& e = entries_[it->second];
    if (offset >= e.record_bytes) return Status::OutOfRange("host tier: offset past the record");
    DataOf(e)[offset] ^= std::byte{0x10};
    return Status::OK();
  }

  Arena arena() const override { return {arena_.fd, arena_.base, units_ * kUnit}; }

  Arena lend_table() const override {
    if (table_.base == nullptr) return {};
    return {table_.fd, table_.base, units_ * sizeof(uint32_t)};
  }

  uint32_t LendToken(const BundleKey& key, const BundlePtr& bundle) override {
    if (table_.base == nullptr || !bundle) return 0;
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return 0;
    const Entry& e = entries_[it->second];
    if (DataOf(e) != bundle->record().data()) return 0;  // another copy took its place
    const uint32_t v = std::atomic_ref<uint32_t>(TableAt(e.at)).load(std::memory_order_relaxed);
    return v == UINT32_MAX ? 0 : v + 1;
  }

  Touched TouchRead(std::span<const BundleKey> keys) override {
    Touched t;
    MutexLock lock(mu_);
    for (const BundleKey& k : keys) {
      auto it = index_.find(k);
      if (it == index_.end()) continue;
      eviction_.Touch(it->second);
      ++t.items;
      t.bytes += entries_[it->second].record_bytes;
    }
    stats_.hits += t.items;
    stats_.bytes_read += t.bytes;
    return t;
  }

  void Hint(std::span<const BundleKey> keys, bool on) override {
    MutexLock lock(mu_);
    for (const BundleKey& k : keys) {
      auto it = index_.find(k);
      eviction_.Hint(k, it == index_.end() ? offload::TierEviction::kNone : it->second, on);
    }
  }

  Status CheckEviction() const override {
    MutexLock lock(mu_);
    SPARSEKV_RETURN_IF_ERROR(eviction_.Check());
    for (const auto& [k, id] : index_) {
      if (!entries_[id].indexed) return Status::Internal("host tier: an indexed entry is marked unindexed");
    }
    return Status::OK();
  }

  Result<BundlePtr> GetPinned(const BundleKey& key, bool check) override {
    return GetOne(key, /*in_place=*/true, check);
  }

  Status CheckPinned(const BundlePtr& b, const BundleKey& key) override {
    Status v = Bundle::VerifyRecord(b->record(), key);
    MutexLock lock(mu_);
    if (v.ok()) {
      // Whole in itself; and still the record this tier wrote (not rewritten, checksum and all).
      auto it = index_.find(key);
      if (it == index_.end() || DataOf(entries_[it->second]) != b->record().data()) return v;
      v = MatchesIndex(Bundle::StoredChecksum(b->record()), entries_[it->second].checksum, key);
      if (v.ok()) return v;
    }
    if (IsOtherBundleVersion(v)) {  // another release's record: a miss, left in place
      ++stats_.other_version;
      return v.WithContext("host tier");
    }
    ++stats_.corrupt;
    auto it = index_.find(key);  // not b->key(): that was read from the damaged record
    if (it != index_.end() && DataOf(entries_[it->second]) == b->record().data()) ForgetLocked(it);
    return v.WithContext("host tier");
  }

 private:
  using EntryId = uint32_t;
  struct Entry {
    BundleKey key;
    uint64_t at = 0;     // first unit of the extent
    uint64_t units = 0;  // extent length
    uint64_t record_bytes = 0;
    uint64_t checksum = 0;
    uint64_t sequence = 0;
    uint32_t readers = 0;  // gets holding the record, and the put writing it
    bool indexed = false;  // named by index_ (and known to eviction_)
  };
  using Index = std::unordered_map<BundleKey, EntryId, BundleKeyHasher>;

  std::byte* DataOf(const Entry& e) const { return arena_.base + e.at * kUnit; }
  uint32_t& TableAt(uint64_t unit) const { return reinterpret_cast<uint32_t*>(table_.base)[unit]; }

  EntryId NewEntryLocked() SPARSEKV_REQUIRES(mu_) {
    if (!spare_ids_.empty()) {
      const EntryId id = spare_ids_.back();
      spare_ids_.pop_back();
      entries_[id] = Entry{};
      return id;
    }
    entries_.emplace_back();
    return static_cast<EntryId>(entries_.size() - 1);
  }

  // The extent goes back to the free space and the id to the spares.
  void ReleaseEntryLocked(EntryId id) SPARSEKV_REQUIRES(mu_) {
    free_.Free(entries_[id].at, entries_[id].units);
    spare_ids_.push_back(id);
  }

  // Takes a published entry out of the index; frees it now unless somebody reads it. The
  // eviction order forgets it, unless it was `evicted` (then it was told so).
  void ForgetLocked(Index::iterator it, bool evicted = false) SPARSEKV_REQUIRES(mu_) {
    const EntryId id = it->second;
    Entry& e = entries_[id];
    stats_.bytes -= e.record_bytes;
    if (!evicted) eviction_.Erase(id);
    e.indexed = false;
    // The record is no longer its key's copy: local readers holding its token see the change
    // before any byte of its room is written again (LendToken). Only this tier writes the table,
    // under mu_. The full fence orders the new value before every later store of this thread
    // (the room may be handed out and written by it right after, without the lock taken again);
    // a store of another thread comes after taking mu_, so after this. An entry stops at its
    // largest value instead of wrapping: no token is given for it, and no stale token can match
    // it again.
    if (table_.base != nullptr) {
      std::atomic_ref<uint32_t> entry(TableAt(e.at));
      const uint32_t v = entry.load(std::memory_order_relaxed);
      if (v != UINT32_MAX) entry.store(v + 1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    if (journal_) journal_->Note(it->first, false);
    index_.erase(it);
    if (e.readers == 0) ReleaseEntryLocked(id);
  }

  // An extent of `units`, evicting the policy's victims nobody reads until one fits. Evicted
  // records are copied out into `evicted` (checked like any read) when a listener wants them,
  // before their bytes can be reused.
  std::optional<uint64_t> AllocateLocked(uint64_t units, std::vector<BundlePtr>* evicted)
      SPARSEKV_REQUIRES(mu_) {
    for (;;) {
      if (auto at = free_.Allocate(units)) return at;
      const EntryId id = eviction_.Victim(
          [&](uint32_t v) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { return entries_[v].readers > 0; });
      if (id == offload::TierEviction::kNone) return std::nullopt;
      Entry& e = entries_[id];
      if (evicted != nullptr) {
        Result<BundlePtr> b = Bundle::ParseRecord({DataOf(e), e.record_bytes}, e.key);
        if (b.ok()) {
          if (Status m = MatchesIndex((*b)->checksum(), e.checksum, e.key); !m.ok()) b = m;
        }
        if (b.ok()) {
          ++handing_over_[e.key];
          evicted->push_back(std::move(*b));
        } else if (!IsOtherBundleVersion(b.status())) {
          ++stats_.corrupt;  // another release's record leaves by eviction, not handed down
        }
      }
      ++stats_.evictions;
      eviction_.Evicted(id);
      ForgetLocked(index_.find(e.key), /*evicted=*/true);
    }
  }

  // A put refused for a record above max_record_bytes, counted.
  Status TooLarge(const BundleKey& key, uint64_t record_bytes) SPARSEKV_EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      ++stats_.put_failures;
    }
    return Status::InvalidArgument(
        fmt::format("host tier: bundle {} of {} bytes exceeds the largest record the tier takes "
                    "({} bytes)",
                    key.ToString(), record_bytes, options_.max_record_bytes));
  }

  // Gives evicted records to the eviction listener, then marks them handed over (a chain
  // registers them as moving down in the listener).
  void HandOver(std::vector<BundlePtr> evicted) SPARSEKV_EXCLUDES(mu_) {
    if (evicted.empty()) return;
    EvictionListener listener;
    std::vector<BundleKey> keys;
    {
      MutexLock lock(mu_);
      listener = listener_;
    }
    for (const BundlePtr& b : evicted) keys.push_back(b->key());
    if (listener) listener(std::move(evicted));
    MutexLock lock(mu_);
    for (const BundleKey& k : keys) {
      auto it = handing_over_.find(k);
      if (it != handing_over_.end() && --it->second == 0) handing_over_.erase(it);
    }
    handed_over_.notify_all();
  }

  Status PutOne(const BundlePtr& b, std::vector<BundlePtr>* evicted) SPARSEKV_EXCLUDES(mu_) {
    if (!b) return Status::InvalidArgument("host tier: null bundle");
    if (b->record_bytes() > options_.max_record_bytes)
      return TooLarge(b->key(), b->record_bytes());
    const uint64_t units = UnitsOf(b->record_bytes());
    EntryId id;
    std::byte* dst;
    {
      MutexLock lock(mu_);
      auto same = index_.find(b->key());
      if (same != index_.end()) {
        Entry& held = entries_[same->second];
        if (held.sequence > b->sequence()) {
          ++stats_.superseded;
          return Status::OK();
        }
        if (held.sequence == b->sequence() && held.checksum == b->checksum() &&
            held.record_bytes == b->record_bytes()) {
          // The same bundle again (a repeated demote): only its recency changes.
          eviction_.Refresh(same->second);
          return Status::OK();
        }
      }
      std::optional<uint64_t> at = AllocateLocked(units, listener_ ? evicted : nullptr);
      if (!at) {
        ++stats_.put_failures;
        return Status::ResourceExhausted(fmt::format(
            "host tier: no room for {} bytes: the {} bytes that are not free are held by "
            "readers",
            units * kUnit, capacity_bytes() - free_.free_units() * kUnit));
      }
      id = NewEntryLocked();
      Entry& e = entries_[id];
      e.key = b->key();
      e.at = *at;
      e.units = units;
      e.record_bytes = b->record_bytes();
      e.checksum = b->checksum();
      e.sequence = b->sequence();
      e.readers = 1;  // the copy below: not evictable, not yet findable
      dst = DataOf(e);
    }
    // The padding to 4 KiB is zeroed, as a RecordBuffer's is (GetPinned hands it out as one).
    std::memcpy(dst, b->record().data(), b->record_bytes());
    std::memset(dst + b->record_bytes(), 0, units * kUnit - b->record_bytes());
    MutexLock lock(mu_);
    entries_[id].readers = 0;
    if (!PublishLocked(id)) ReleaseEntryLocked(id);  // a newer copy landed while it was copied
    return Status::OK();
  }

  // Makes entry `id`, just written, its key's copy in place of an older one. False (counted as
  // superseded, nothing changed) when a newer copy landed while it was written.
  bool PublishLocked(EntryId id) SPARSEKV_REQUIRES(mu_) {
    Entry& e = entries_[id];
    auto it = index_.find(e.key);
    if (it != index_.end()) {
      if (entries_[it->second].sequence > e.sequence) {
        ++stats_.superseded;
        return false;
      }
      ForgetLocked(it);
    }
    e.indexed = true;
    eviction_.Insert(id, e.key, e.record_bytes);
    index_.emplace(e.key, id);
    if (journal_) journal_->Note(e.key, true);
    stats_.bytes += e.record_bytes;
    stats_.bytes_written += e.record_bytes;
    ++stats_.puts;
    return true;
  }

  // A record whole in itself may still not be the one this tier stored: with write leases a
  // client can rewrite one in place, its checksum included. The checksum kept in the entry is
  // the one the tier wrote or checked; a record whose own differs is damaged.
  static Status MatchesIndex(uint64_t stored, uint64_t expected, const BundleKey& key) {
    if (stored == expected) return Status::OK();
    return Status::Corruption(fmt::format("bundle {}: the record's checksum {:016x} is not the {:016x} it was stored with",
                                          key.ToString(), stored, expected));
  }

  Result<BundlePtr> GetOne(const BundleKey& key, bool in_place = false, bool check = true)
      SPARSEKV_EXCLUDES(mu_) {
    EntryId id;
    std::byte* data;
    uint64_t bytes;
    uint64_t expected;  // the record's checksum as this tier wrote or checked it
    {
      MutexLock lock(mu_);
      auto it = index_.find(key);
      // A key evicted but not yet handed to the listener is in no index yet (for a chain: not
      // yet registered as moving down, where a read that misses here finds it): wait until it
      // is, so that a read racing the move cannot miss a bundle the chain holds. Brief: the
      // listener registers the move and returns.
      while (it == index_.end() && handing_over_.count(key) != 0) {
        handed_over_.wait(mu_, [&]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { return handing_over_.count(key) == 0; });
        it = index_.find(key);
      }
      if (it == index_.end()) {
        ++stats_.misses;
        return Status::NotFound("host tier: no bundle " + key.ToString());
      }
      id = it->second;
      Entry& e = entries_[id];
      ++e.readers;
      eviction_.Touch(id);
      data = DataOf(e);
      bytes = e.record_bytes;
      expected = e.checksum;
    }
    if (in_place) {
      Status v = check ? Bundle::VerifyRecord({data, bytes}, key)
                       : Bundle::VerifyRecordLayout({data, bytes}, key);
      if (v.ok() && check) v = MatchesIndex(Bundle::StoredChecksum({data, bytes}), expected, key);
      if (v.ok()) {
        {
          MutexLock lock(mu_);
          ++stats_.hits;
          stats_.bytes_read += bytes;
        }
        // The record stays pinned until the bundle's last owner lets go.
        RecordBuffer view(data, UnitsOf(bytes) * kUnit,
                          [this, id](std::byte*) { ReleaseReader(id); });
        return Bundle::AdoptVerifiedRecord(std::move(view), bytes);
      }
    }
    Result<BundlePtr> b = Bundle::ParseRecord({data, bytes}, key);
    if (b.ok()) {
      if (Status m = MatchesIndex((*b)->checksum(), expected, key); !m.ok()) b = m;
    }
    MutexLock lock(mu_);
    if (!b.ok() && IsOtherBundleVersion(b.status())) {
      // Another release's record: a miss, counted, left to its writer and to eviction.
      ++stats_.other_version;
      ++stats_.misses;
      ReleaseReaderLocked(id);
      return Status::NotFound(fmt::format("host tier: {}", b.status().message()));
    }
    if (!b.ok()) {
      ++stats_.corrupt;
      auto it = index_.find(key);
      if (it != index_.end() && it->second == id) ForgetLocked(it);
    } else {
      ++stats_.hits;
      stats_.bytes_read += bytes;
    }
    ReleaseReaderLocked(id);
    if (!b.ok()) return b.status().WithContext("host tier");
    return b;
  }

  void ReleaseReaderLocked(EntryId id) SPARSEKV_REQUIRES(mu_) {
    Entry& e = entries_[id];
    if (--e.readers > 0) return;
    if (!e.indexed) {
      ReleaseEntryLocked(id);  // orphaned meanwhile
    } else {
      eviction_.Unbusy(id);
    }
  }

  void ReleaseReader(EntryId id) SPARSEKV_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ReleaseReaderLocked(id);
  }

  HostTierOptions options_;
  uint64_t units_ = 0;
  sparsekv::Arena arena_;
  sparsekv::Arena table_;  // the lend table (lend_table()), when the arena is a memfd
  mutable Mutex mu_;
  offload::ExtentAllocator free_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<Entry> entries_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<EntryId> spare_ids_ SPARSEKV_GUARDED_BY(mu_);
  Index index_ SPARSEKV_GUARDED_BY(mu_);
  std::shared_ptr<KeyJournal> journal_ SPARSEKV_GUARDED_BY(mu_);  // SetKeyJournal
  offload::TierEviction eviction_ SPARSEKV_GUARDED_BY(mu_);  // the indexed entries' eviction order
  EvictionListener listener_ SPARSEKV_GUARDED_BY(mu_);
  // Keys evicted for the listener and not yet handed to it, and the signal that they were.
  std::unordered_map<BundleKey, uint32_t, BundleKeyHasher> handing_over_ SPARSEKV_GUARDED_BY(mu_);
  std::condition_variable_any handed_over_;
  TierStats stats_ SPARSEKV_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<HostTier>> HostTier::Open(const HostTierOptions& options) {
  auto tier = std::make_unique<HostTierImpl>(options);
  SPARSEKV_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<HostTier>(std::move(tier));
}

}  // namespace sparsekv
