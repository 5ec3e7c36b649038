#include "sparsekv/bundle.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "allocator/copy_checksum.h"
#include "allocator/xxhash_dispatch.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv {
namespace {

// Offsets in the record header (bundle.h).
constexpr uint64_t kMagicAt = 0;
constexpr uint64_t kVersionAt = 4;
constexpr uint64_t kCountAt = 6;
constexpr uint64_t kChecksumAt = 8;
constexpr uint64_t kNamespaceAt = 16;
constexpr uint64_t kPagesAt = 20;  // the pages tag; the flags word, always 0, before it
constexpr uint64_t kHashLoAt = 24;
constexpr uint64_t kHashHiAt = 32;
constexpr uint64_t kPayloadAt = 40;
constexpr uint64_t kSequenceAt = 48;
constexpr uint64_t kSegmentsAt = 56;
// Everything after the checksum field is covered by it.
constexpr uint64_t kCoveredFrom = 16;

constexpr uint64_t kPageAlign = 4096;  // kDirectIoAlignment, without depending on file_system.h
constexpr uint64_t kHugePage = 2 << 20;
constexpr uint64_t kHugeFrom = 2 << 20;  // record buffers this large get their own mapping
// Copies and hashes in chunks small enough to be hashed from L1/L2 right after their copy.
constexpr uint64_t kCopyChunk = 64 << 10;

// Large record buffers' mappings, kept after their last owner lets go for the next Allocate of
// the same mapped size. A fresh mapping is faulted in as it is written: three 2 MiB faults for
// a 6 MB block, the kernel zeroing every byte first, which costs as much as the copy that
// follows (and far more when it must compact memory for a huge page). A pipeline that makes and
// drops block-sized bundles (a write-back eviction, a store through a chain) reuses the same few.
// Most recently freed first, as the warmest; the oldest are unmapped past the limit.
#if defined(__SANITIZE_ADDRESS__)
constexpr uint64_t kInitialReuseBytes = 0;  // a use after release must still fault
#else
constexpr uint64_t kInitialReuseBytes = RecordBuffer::kDefaultReuseBytes;
#endif
struct MappingCache {
  Mutex mu;
  std::vector<std::pair<std::byte*, uint64_t>> free SPARSEKV_GUARDED_BY(mu);  // (base, mapped)
  uint64_t bytes SPARSEKV_GUARDED_BY(mu) = 0;
  uint64_t limit SPARSEKV_GUARDED_BY(mu) = kInitialReuseBytes;
};

MappingCache& Mappings() {
  static auto* cache = [] {
    auto* c = new MappingCache();  // never destroyed: buffers may go back at exit
    MutexLock lock(c->mu);
    c->free.reserve(kInitialReuseBytes / kHugePage + 1);  // every kept mapping is >= 2 MiB
    return c;
  }();
  return *cache;
}

std::byte* TakeMapping(uint64_t mapped) {
  MappingCache& c = Mappings();
  MutexLock lock(c.mu);
  for (size_t i = c.free.size(); i-- > 0;) {
    if (c.free[i].second != mapped) continue;
    std::byte* p = c.free[i].first;
    c.free.erase(c.free.begin() + static_cast<std::ptrdiff_t>(i));
    c.bytes -= mapped;
    return p;
  }
  return nullptr;
}

// Unmaps the oldest kept mappings until at most `keep` bytes are kept (rare: under the lock).
void UnmapOldestLocked(MappingCache& c, uint64_t keep) SPARSEKV_REQUIRES(c.mu) {
  size_t drop = 0;
  for (; c.bytes > keep; ++drop) {
    c.bytes -= c.free[drop].second;
    ::munmap(c.free[drop].first, c.free[drop].second);
  }
  c.free.erase(c.free.begin(), c.free.begin() + static_cast<std::ptrdiff_t>(drop));
}

// Runs from ~RecordBuffer, so it allocates nothing (the list's room is reserved with the limit)
// and cannot throw. The rare unmapping past the limit happens under the lock.
void GiveBackMapping(std::byte* p, uint64_t mapped) noexcept {
  MappingCache& c = Mappings();
  MutexLock lock(c.mu);
  if (mapped > c.limit || c.free.size() == c.free.capacity()) {
    ::munmap(p, mapped);
    return;
  }
  UnmapOldestLocked(c, c.limit - mapped);
  c.free.emplace_back(p, mapped);
  c.bytes += mapped;
}

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
void Store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

uint64_t RecordChecksum(std::span<const std::byte> record) {
  return XXH3_64bits(record.data() + kCoveredFrom, record.size() - kCoveredFrom);
}

Status CheckSegments(std::span<const uint64_t> segment_bytes) {
  if (segment_bytes.size() > kMaxBundleSegments) {
    return Status::InvalidArgument(fmt::format("a bundle holds at most {} segments, got {}",
                                               kMaxBundleSegments, segment_bytes.size()));
  }
  for (size_t i = 0; i < segment_bytes.size(); ++i) {
    if (segment_bytes[i] > std::numeric_limits<uint32_t>::max()) {
      return Status::InvalidArgument(fmt::format(
          "bundle segment {} is {} bytes; a segment must be under 4 GiB", i, segment_bytes[i]));
    }
  }
  return Status::OK();
}

std::atomic<uint16_t> g_format_version{kBundleFormatVersion};

// Everything of a record's header but its checksum.
void WriteHeader(std::byte* p, const BundleKey& key, std::span<const uint64_t> segment_bytes,
                 uint64_t total, uint64_t sequence, uint32_t pages) {
  const auto count = static_cast<uint32_t>(segment_bytes.size());
  const uint64_t header = BundleHeaderBytes(count);
  std::memset(p, 0, header);
  Store<uint32_t>(p + kMagicAt, kBundleMagic);
  Store<uint16_t>(p + kVersionAt, g_format_version.load(std::memory_order_relaxed));
  Store<uint16_t>(p + kCountAt, static_cast<uint16_t>(count));
  Store<uint32_t>(p + kNamespaceAt, key.namespace_id);
  Store<uint32_t>(p + kPagesAt, pages);
  Store<uint64_t>(p + kHashLoAt, key.hash.lo);
  Store<uint64_t>(p + kHashHiAt, key.hash.hi);
  Store<uint64_t>(p + kPayloadAt, total - header);
  Store<uint64_t>(p + kSequenceAt, sequence);
  for (uint32_t i = 0; i < count; ++i)
    Store<uint32_t>(p + kSegmentsAt + 4ull * i, static_cast<uint32_t>(segment_bytes[i]));
}

}  // namespace

uint16_t BundleFormatVersion() { return g_format_version.load(std::memory_order_relaxed); }

uint16_t SetBundleFormatVersionForTesting(uint16_t version) { return g_format_version.exchange(version); }

bool IsOtherBundleVersion(const Status& s) { return s.Is(StatusCode::kNotSupported); }

std::string BundleKey::ToString() const {
  return fmt::format("ns {} / {:016x}{:016x}", namespace_id, hash.hi, hash.lo);
}

uint64_t BundleRecordBytes(std::span<const uint64_t> segment_bytes) {
  uint64_t total = BundleHeaderBytes(static_cast<uint32_t>(segment_bytes.size()));
  for (uint64_t s : segment_bytes) total += s;
  return total;
}

RecordBuffer& RecordBuffer::operator=(RecordBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    data_ = std::exchange(o.data_, nullptr);
    capacity_ = std::exchange(o.capacity_, 0);
    release_ = std::move(o.release_);
  }
  return *this;
}

void RecordBuffer::Reset() {
  if (data_ != nullptr && release_) release_(data_);
  data_ = nullptr;
  capacity_ = 0;
  release_ = nullptr;
}

RecordBuffer RecordBuffer::Allocate(uint64_t bytes) {
  const uint64_t capacity =
      std::max<uint64_t>(kPageAlign, (bytes + kPageAlign - 1) / kPageAlign * kPageAlign);
  if (capacity >= kHugeFrom) {
    const uint64_t mapped = (capacity + kHugePage - 1) / kHugePage * kHugePage;
    auto release = [mapped](std::byte* d) { GiveBackMapping(d, mapped); };
    if (std::byte* p = TakeMapping(mapped)) {
      // The record's own bytes are about to be written; only the padding needs zeros.
      std::memset(p + (bytes / kPageAlign) * kPageAlign, 0, capacity - (bytes / kPageAlign) * kPageAlign);
      return RecordBuffer(p, capacity, std::move(release));
    }
    // A block's record is megabytes, and every new one is faulted in as it is written: at 4 KiB
    // a page that costs more than the copy (about 0.3 GB/s on a VM), with 2 MiB pages far less.
    // So large records take their own mapping, 2 MiB-aligned, with huge pages asked for; the
    // kernel hands it out zeroed, padding included.
    void* raw = ::mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw != MAP_FAILED) {
      auto* base = static_cast<std::byte*>(raw);
      const uint64_t lead =
          (kHugePage - reinterpret_cast<uintptr_t>(base) % kHugePage) % kHugePage;
      if (lead > 0) ::munmap(base, lead);
      if (kHugePage - lead > 0) ::munmap(base + lead + mapped, kHugePage - lead);
      std::byte* p = base + lead;
      ::madvise(p, mapped, MADV_HUGEPAGE);  // advice only: 4 KiB pages if refused
      return RecordBuffer(p, capacity, std::move(release));
    }
  }
  auto* p = static_cast<std::byte*>(::operator new(capacity, std::align_val_t(kPageAlign)));
  // The record's own bytes are about to be written; only the padding needs zeros.
  std::memset(p + (bytes / kPageAlign) * kPageAlign, 0,
              capacity - (bytes / kPageAlign) * kPageAlign);
  return RecordBuffer(p, capacity,
                      [](std::byte* d) { ::operator delete(d, std::align_val_t(kPageAlign)); });
}

uint64_t RecordBuffer::SetReuseLimit(uint64_t bytes) {
  MappingCache& c = Mappings();
  MutexLock lock(c.mu);
  c.free.reserve(bytes / kHugePage + 1);  // may throw here, never when a buffer comes back
  UnmapOldestLocked(c, bytes);
  return std::exchange(c.limit, bytes);
}

Result<BundlePtr> Bundle::MakeWith(
    const BundleKey& key, std::span<const uint64_t> segment_bytes,
    const std::function<void(uint32_t, std::span<std::byte>)>& fill, uint64_t sequence,
    uint32_t pages) {
  SPARSEKV_RETURN_IF_ERROR(CheckSegments(segment_bytes));
  const auto count = static_cast<uint32_t>(segment_bytes.size());
  const uint64_t header = BundleHeaderBytes(count);
  const uint64_t total = BundleRecordBytes(segment_bytes);
  RecordBuffer buf = RecordBuffer::Allocate(total);
  std::byte* p = buf.data();
  WriteHeader(p, key, segment_bytes, total, sequence, pages);
  uint64_t at = header;
  for (uint32_t i = 0; i < count; ++i) {
    fill(i, std::span<std::byte>(p + at, segment_bytes[i]));
    at += segment_bytes[i];
  }
  Store<uint64_t>(p + kChecksumAt, RecordChecksum({p, total}));
  return FromVerified(std::move(buf), total);
}

Result<uint64_t> Bundle::WriteRecord(std::span<std::byte> out, const BundleKey& key,
                                     std::span<const std::span<const std::byte>> segments,
                                     uint64_t sequence, uint32_t pages) {
  uint64_t sizes[kMaxBundleSegments];
  if (segments.size() > kMaxBundleSegments) {
    return Status::InvalidArgument(fmt::format("a bundle holds at most {} segments, got {}",
                                               kMaxBundleSegments, segments.size()));
  }
  for (size_t i = 0; i < segments.size(); ++i) sizes[i] = segments[i].size();
  const std::span<const uint64_t> segment_bytes(sizes, segments.size());
  SPARSEKV_RETURN_IF_ERROR(CheckSegments(segment_bytes));
  const uint64_t header = BundleHeaderBytes(static_cast<uint32_t>(segments.size()));
  const uint64_t total = BundleRecordBytes(segment_bytes);
  if (out.size() < total) {
    return Status::InvalidArgument(
        fmt::format("bundle {}: a record of {} bytes does not fit {} bytes", key.ToString(), total,
                    out.size()));
  }
  std::byte* p = out.data();
  WriteHeader(p, key, segment_bytes, total, sequence, pages);
  if (segments.size() == 1 && header - kCoveredFrom == kRecordChecksumPrefixBytes) {
    // One value: copied and hashed in one pass over its bytes (CopyWithRecordChecksum).
    const uint64_t sum = CopyWithRecordChecksum(p + header, segments[0].data(), segments[0].size(), p + kCoveredFrom);
    Store<uint64_t>(p + kChecksumAt, sum);
    return sum;
  }
  // One pass: each chunk is hashed right after its copy, while it is still in cache.
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, p + kCoveredFrom, header - kCoveredFrom);
  std::byte* at = p + header;
  for (const std::span<const std::byte> seg : segments) {
    for (uint64_t i = 0; i < seg.size(); i += kCopyChunk) {
      const uint64_t len = std::min<uint64_t>(kCopyChunk, seg.size() - i);
      std::memcpy(at + i, seg.data() + i, len);
      XXH3_64bits_update(&state, at + i, len);
    }
    at += seg.size();
  }
  const uint64_t sum = XXH3_64bits_digest(&state);
  Store<uint64_t>(p + kChecksumAt, sum);
  return sum;
}

Result<uint64_t> Bundle::WriteRecordHeader(std::span<std::byte> out, const BundleKey& key,
                                            std::span<const uint64_t> segment_bytes, uint64_t sequence,
                                            uint32_t pages) {
  SPARSEKV_RETURN_IF_ERROR(CheckSegments(segment_bytes));
  const uint64_t header = BundleHeaderBytes(static_cast<uint32_t>(segment_bytes.size()));
  if (out.size() < header) {
    return Status::InvalidArgument(
        fmt::format("bundle {}: a header of {} bytes does not fit {} bytes", key.ToString(), header, out.size()));
  }
  WriteHeader(out.data(), key, segment_bytes, BundleRecordBytes(segment_bytes), sequence, pages);
  return header;
}

uint64_t Bundle::ChecksumOf(std::span<const std::byte> record) { return RecordChecksum(record); }

uint64_t Bundle::StoredChecksum(std::span<const std::byte> record) {
  return record.size() >= kChecksumAt + 8 ? Load<uint64_t>(record.data() + kChecksumAt) : 0;
}

Result<BundlePtr> Bundle::Make(const BundleKey& key,
                               std::span<const std::span<const std::byte>> segments,
                               uint64_t sequence, uint32_t pages) {
  if (segments.size() > kMaxBundleSegments) {
    return Status::InvalidArgument(fmt::format("a bundle holds at most {} segments, got {}",
                                               kMaxBundleSegments, segments.size()));
  }
  uint64_t sizes[kMaxBundleSegments];
  for (size_t i = 0; i < segments.size(); ++i) sizes[i] = segments[i].size();
  const std::span<const uint64_t> segment_bytes(sizes, segments.size());
  SPARSEKV_RETURN_IF_ERROR(CheckSegments(segment_bytes));  // before allocating
  const uint64_t total = BundleRecordBytes(segment_bytes);
  RecordBuffer buf = RecordBuffer::Allocate(total);
  SPARSEKV_RETURN_IF_ERROR(WriteRecord({buf.data(), total}, key, segments, sequence, pages).status());
  return FromVerified(std::move(buf), total);
}

Status Bundle::VerifyRecordLayout(std::span<const std::byte> record, const BundleKey& expected) {
  const std::byte* p = record.data();
  const uint64_t n = record.size();
  if (n < kBundleFixedHeaderBytes) {
    return Status::Corruption(
        fmt::format("bundle {}: record of {} bytes is shorter than a header ({} bytes)",
                    expected.ToString(), n, kBundleFixedHeaderBytes));
  }
  if (Load<uint32_t>(p + kMagicAt) != kBundleMagic) {
    return Status::Corruption(fmt::format("bundle {}: bad magic {:#010x}, expected {:#010x}",
                                          expected.ToString(), Load<uint32_t>(p + kMagicAt),
                                          kBundleMagic));
  }
  if (const uint16_t version = Load<uint16_t>(p + kVersionAt); version != BundleFormatVersion()) {
    // Not damage: another release's record. Its checksum and layout may follow rules this one
    // does not know, so nothing past the version is judged, and the record is left in place.
    return Status::NotSupported(fmt::format(
        "bundle {}: a record of format version {}; this release reads {} (a miss: left in place)",
        expected.ToString(), version, BundleFormatVersion()));
  }
  const uint32_t count = Load<uint16_t>(p + kCountAt);
  const uint64_t header = BundleHeaderBytes(count);
  if (count > kMaxBundleSegments || header > n) {
    return Status::Corruption(fmt::format("bundle {}: {} segments do not fit a record of {} bytes",
                                          expected.ToString(), count, n));
  }
  uint64_t payload = 0;
  for (uint32_t i = 0; i < count; ++i) payload += Load<uint32_t>(p + kSegmentsAt + 4ull * i);
  if (Load<uint64_t>(p + kPayloadAt) != payload || header + payload != n) {
    return Status::Corruption(
        fmt::format("bundle {}: sizes disagree: header says {} payload bytes, segments sum to {}, "
                    "record holds {}",
                    expected.ToString(), Load<uint64_t>(p + kPayloadAt), payload, n - header));
  }
  BundleKey found;
  found.namespace_id = Load<uint32_t>(p + kNamespaceAt);
  found.hash.lo = Load<uint64_t>(p + kHashLoAt);
  found.hash.hi = Load<uint64_t>(p + kHashHiAt);
  if (!(found == expected)) {
    return Status::Corruption(
        fmt::format("bundle {}: the record belongs to {}", expected.ToString(), found.ToString()));
  }
  return Status::OK();
}

Status Bundle::VerifyRecord(std::span<const std::byte> record, const BundleKey& expected) {
  SPARSEKV_RETURN_IF_ERROR(VerifyRecordLayout(record, expected));
  const uint64_t stored = Load<uint64_t>(record.data() + kChecksumAt);
  const uint64_t actual = RecordChecksum(record);
  if (stored != actual) {
    return Status::Corruption(
        fmt::format("bundle {}: checksum mismatch: stored {:016x}, computed {:016x}",
                    expected.ToString(), stored, actual));
  }
  return Status::OK();
}

Status Bundle::RestampNamespace(std::span<std::byte> record, const BundleKey& written, uint32_t namespace_id) {
  SPARSEKV_RETURN_IF_ERROR(VerifyRecord(record, written));
  Store<uint32_t>(record.data() + kNamespaceAt, namespace_id);
  Store<uint64_t>(record.data() + kChecksumAt, RecordChecksum(record));
  return Status::OK();
}

std::optional<Bundle::RecordHeader> Bundle::PeekHeader(std::span<const std::byte> record) {
  if (record.size() < kBundleFixedHeaderBytes) return std::nullopt;
  const std::byte* p = record.data();
  RecordHeader h;
  h.key.namespace_id = Load<uint32_t>(p + kNamespaceAt);
  h.key.hash.lo = Load<uint64_t>(p + kHashLoAt);
  h.key.hash.hi = Load<uint64_t>(p + kHashHiAt);
  h.sequence = Load<uint64_t>(p + kSequenceAt);
  h.version = Load<uint16_t>(p + kVersionAt);
  h.pages = Load<uint32_t>(p + kPagesAt);
  return h;
}

Result<BundlePtr> Bundle::ParseRecord(std::span<const std::byte> record,
                                      const BundleKey& expected) {
  SPARSEKV_RETURN_IF_ERROR(VerifyRecord(record, expected));
  RecordBuffer buf = RecordBuffer::Allocate(record.size());
  if (!record.empty()) std::memcpy(buf.data(), record.data(), record.size());
  return FromVerified(std::move(buf), record.size());
}

Result<BundlePtr> Bundle::AdoptRecord(RecordBuffer buffer, uint64_t record_bytes,
                                      const BundleKey& expected) {
  if (!buffer || buffer.capacity() < record_bytes) {
    return Status::InvalidArgument("bundle: a record buffer smaller than its record");
  }
  SPARSEKV_RETURN_IF_ERROR(VerifyRecord({buffer.data(), record_bytes}, expected));
  return FromVerified(std::move(buffer), record_bytes);
}

BundlePtr Bundle::AdoptVerifiedRecord(RecordBuffer buffer, uint64_t record_bytes) {
  return *FromVerified(std::move(buffer), record_bytes);
}

Result<BundlePtr> Bundle::FromVerified(RecordBuffer buffer, uint64_t record_bytes) {
  auto b = std::shared_ptr<Bundle>(new Bundle());
  const std::byte* p = buffer.data();
  b->key_.namespace_id = Load<uint32_t>(p + kNamespaceAt);
  b->key_.hash.lo = Load<uint64_t>(p + kHashLoAt);
  b->key_.hash.hi = Load<uint64_t>(p + kHashHiAt);
  b->sequence_ = Load<uint64_t>(p + kSequenceAt);
  b->segment_count_ = Load<uint16_t>(p + kCountAt);
  b->header_bytes_ = BundleHeaderBytes(b->segment_count_);
  b->record_bytes_ = record_bytes;
  b->checksum_ = Load<uint64_t>(p + kChecksumAt);
  b->pages_ = Load<uint32_t>(p + kPagesAt);
  b->record_ = std::move(buffer);
  return BundlePtr(std::move(b));
}

uint64_t Bundle::segment_bytes(uint32_t i) const {
  return i < segment_count_ ? Load<uint32_t>(record_.data() + kSegmentsAt + 4ull * i) : 0;
}

Status Bundle::CopySegmentsVerified(std::span<std::byte* const> dst) const {
  constexpr uint64_t kChunk = kCopyChunk;
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, record_.data() + kCoveredFrom, header_bytes_ - kCoveredFrom);
  const std::byte* src = record_.data() + header_bytes_;
  const std::byte* const end = record_.data() + record_bytes_;
  for (uint32_t i = 0; i < segment_count_; ++i) {
    // Bounded by the record as it was checked: a record in memory another process may write
    // (a host arena shared for write leases) can have its sizes changed after the check.
    const uint64_t n = std::min<uint64_t>(segment_bytes(i), static_cast<uint64_t>(end - src));
    std::byte* out = dst[i];
    for (uint64_t at = 0; at < n; at += kChunk) {
      const uint64_t len = std::min(kChunk, n - at);
      if (out != nullptr) {
        std::memcpy(out + at, src + at, len);
        XXH3_64bits_update(&state, out + at, len);
      } else {
        XXH3_64bits_update(&state, src + at, len);
      }
    }
    src += n;
  }
  const uint64_t sum = XXH3_64bits_digest(&state);
  if (sum == checksum_) return Status::OK();
  return Status::Corruption(fmt::format("bundle {}: checksum {:016x}, its header says {:016x}",
                                        key_.ToString(), sum, checksum_));
}

std::span<const std::byte> Bundle::segment(uint32_t i) const {
  // Bounded by the record's size as it was checked (see CopySegmentsVerified).
  uint64_t at = header_bytes_;
  for (uint32_t k = 0; k < i; ++k) at += segment_bytes(k);
  at = std::min(at, record_bytes_);
  return {record_.data() + at, std::min<uint64_t>(segment_bytes(i), record_bytes_ - at)};
}

std::span<const std::byte> Bundle::payload() const {
  return {record_.data() + header_bytes_, record_bytes_ - header_bytes_};
}

}  // namespace sparsekv
