// Bundle: every cache kind of one token block, as the offload tiers store and return it.
//
// Offload and restore move all kinds of a block together (DESIGN.md), so a tier never stores
// one kind without the others. A bundle is one contiguous *record*: a small header naming the
// key and the size of each kind's segment, then the segments back to back (the payload). The
// record is what every tier writes; it carries its own XXH3-64 checksum, so any tier can tell
// a damaged or misplaced record from a good one without trusting its own metadata.
//
// Record layout (little-endian; the header is padded to a multiple of 8 bytes):
//   0  u32 magic "SKVB"        4  u16 format version (3)     6  u16 segment count
//   8  u64 XXH3-64 (seed 0) of every byte from offset 16 to the end of the payload
//  16  u32 namespace id       20  u32 pages tag (0: not recorded)
//  24  u64 hash.lo            32  u64 hash.hi                40  u64 payload bytes
//  48  u64 sequence
//  56  u32 segment bytes × segment count, then zero padding, then the payload
//
// The sequence orders the versions of one key: a TierChain stamps every new version with a
// larger one (TierChain::NextSequence), every copy carries it, and no tier lets a copy replace
// one with a larger sequence. It is covered by the checksum, so a damaged sequence is caught
// like any damaged byte. Sequence 0 means "unversioned" (made outside a chain).
//
// The pages tag names what the segments' pages are: a 32-bit digest of the writer's model, block
// layout and each pool's kind and storage format (OffloadedCache::PagesTag), so that a reader
// configured otherwise takes the record for a miss instead of decoding pages of one format as
// another (V3.2's c8 and fp8 pages have the same sizes). It was the header's flags word, always 0
// before; readers of earlier releases ignore it, so records that carry one still read there. 0:
// not recorded (records made before it, and values that are plain bytes, as the daemon's own).
//
// Versions: a record of another format version is not damage. VerifyRecord answers NotSupported
// for it (no data_loss), and no tier deletes it on a read: it is a miss, left to its writer and to
// eviction. Only a record that fails its checks (Corruption) is removed.
//
// Ownership: a Bundle owns its record (a RecordBuffer) and is immutable once made; tiers and
// callers share it as a BundlePtr (shared_ptr<const Bundle>), so one bundle written to several
// tiers is not copied, and the SSD tier writes it straight from its memory.
// Thread safety: immutable, share freely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "sparsekv/block_hash.h"
#include "sparsekv/status.h"

namespace sparsekv {

// What a tier files a bundle under: the block's prefix hash within a namespace.
struct BundleKey {
  uint32_t namespace_id = 0;
  BlockHash hash;

  bool operator==(const BundleKey&) const = default;
  // "ns 3 / 0123...cdef" for messages.
  std::string ToString() const;
};

struct BundleKeyHasher {
  size_t operator()(const BundleKey& k) const {
    return static_cast<size_t>(k.hash.lo ^ (k.hash.hi * 0x9e3779b97f4a7c15ull) ^ k.namespace_id);
  }
};

inline constexpr uint32_t kBundleMagic = 0x42564b53;  // "SKVB" read as little-endian bytes
// 3: c8_mla pages in CANN's byte order (nope | rope | scales); 2 had scales before the rope.
inline constexpr uint16_t kBundleFormatVersion = 3;
// The format version this process writes and reads: kBundleFormatVersion, unless a test set
// another (SetBundleFormatVersionForTesting).
uint16_t BundleFormatVersion();
// For tests only: makes this process write and read records of format `version` (the layout
// stays this release's), as a release of another format would, so that two processes of
// different formats can share a tier in a test. Returns the previous one. Thread-safe, but
// bundles made before the call keep their version.
uint16_t SetBundleFormatVersionForTesting(uint16_t version);
inline constexpr uint32_t kMaxBundleSegments = 64;
inline constexpr uint64_t kBundleFixedHeaderBytes = 56;

// Header bytes of a record with `segment_count` segments.
constexpr uint64_t BundleHeaderBytes(uint32_t segment_count) {
  return (kBundleFixedHeaderBytes + 4ull * segment_count + 7) & ~uint64_t{7};
}
// Record bytes (header + payload) of a bundle with these segment sizes.
uint64_t BundleRecordBytes(std::span<const uint64_t> segment_bytes);

class Bundle;
using BundlePtr = std::shared_ptr<const Bundle>;

// Memory for one record: 4 KiB-aligned, its capacity a multiple of 4 KiB, bytes past the record
// zeroed, so an O_DIRECT read can land in it and an O_DIRECT write can take it as it is. It
// comes from the heap (Allocate) or from a tier's registered arena, and goes back there
// through `release` when the last owner lets go. Move-only.
class RecordBuffer {
 public:
  RecordBuffer() = default;
  RecordBuffer(std::byte* data, uint64_t capacity, std::function<void(std::byte*)> release)
      : data_(data), capacity_(capacity), release_(std::move(release)) {}
  RecordBuffer(RecordBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        capacity_(std::exchange(o.capacity_, 0)),
        release_(std::move(o.release_)) {}
  RecordBuffer& operator=(RecordBuffer&& o) noexcept;
  RecordBuffer(const RecordBuffer&) = delete;
  RecordBuffer& operator=(const RecordBuffer&) = delete;
  ~RecordBuffer() { Reset(); }

  // Heap memory for a record of `bytes` (capacity rounded up to 4 KiB, the padding zeroed).
  // Buffers of 2 MiB and more get their own mapping with huge pages asked for; when the last
  // owner lets go, the mapping is kept for the next Allocate of the same rounded size, up to a
  // process-wide limit on the bytes kept (the oldest are unmapped first), so a steady stream of
  // block-sized records neither maps nor faults. A reused buffer's bytes before the padding are
  // whatever its last owner wrote.
  static RecordBuffer Allocate(uint64_t bytes);
  // The limit at start (none kept in AddressSanitizer builds, so that a use after release still
  // faults).
  static constexpr uint64_t kDefaultReuseBytes = 256ull << 20;
  // Sets the limit on the bytes of freed mappings kept for reuse (0: none kept; those above
  // the new limit are unmapped now) and returns the previous one. Thread-safe.
  static uint64_t SetReuseLimit(uint64_t bytes);
  void Reset();
  std::byte* data() const { return data_; }
  uint64_t capacity() const { return capacity_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  std::byte* data_ = nullptr;
  uint64_t capacity_ = 0;
  std::function<void(std::byte*)> release_;
};

class Bundle {
 public:
  // Gathers `segments` (one per cache kind, in the model's pool order) under `key` as version
  // `sequence`: builds the header, copies the payload and computes the checksum. Errors: more
  // than kMaxBundleSegments segments, or a segment of 4 GiB or more.
  // `pages`: the pages tag to record (see above; 0 for plain bytes).
  static Result<BundlePtr> Make(const BundleKey& key,
                                std::span<const std::span<const std::byte>> segments,
                                uint64_t sequence = 0, uint32_t pages = 0);
  // As Make, with segments of the given sizes filled in place by `fill(index, destination)`:
  // spares a copy when the caller gathers from pages itself.
  static Result<BundlePtr> MakeWith(
      const BundleKey& key, std::span<const uint64_t> segment_bytes,
      const std::function<void(uint32_t, std::span<std::byte>)>& fill, uint64_t sequence = 0,
      uint32_t pages = 0);

  // Writes the record Make would build into `out` (at least BundleRecordBytes of the segments'
  // sizes; bytes past the record are left alone) and returns its checksum: header, then each
  // segment copied and hashed in cache-sized chunks, one pass. For a tier that fills its own
  // memory (HostTier::PutGathered). Errors: as Make, and an `out` too small.
  static Result<uint64_t> WriteRecord(std::span<std::byte> out, const BundleKey& key,
                                      std::span<const std::span<const std::byte>> segments,
                                      uint64_t sequence, uint32_t pages = 0);

  // Writes only the header of the record Make would build for segments of `segment_bytes`
  // (checksum field 0) into `out` (at least BundleHeaderBytes(count) bytes) and returns its
  // size: for a record whose payload another writer fills in place (a write lease,
  // HostTier::Reserve). Errors: as Make, and an `out` too small.
  static Result<uint64_t> WriteRecordHeader(std::span<std::byte> out, const BundleKey& key,
                                            std::span<const uint64_t> segment_bytes, uint64_t sequence,
                                            uint32_t pages = 0);
  // The checksum a whole record carries at byte 8: XXH3-64 (seed 0) of its bytes from 16 on.
  static uint64_t ChecksumOf(std::span<const std::byte> record);
  // The checksum a record's header holds (what VerifyRecord compares ChecksumOf with). The
  // record must be at least a header long.
  static uint64_t StoredChecksum(std::span<const std::byte> record);

  // Checks a record read back from storage: magic, version, sizes against `record.size()`, the
  // checksum, and that it is filed under `expected`. Returns Corruption (data_loss) naming what
  // failed, or NotSupported for an intact-looking record of another format version (not damage:
  // callers never delete it; IsOtherBundleVersion tells it apart). `ParseRecord` copies; `AdoptRecord` takes over a buffer holding the record (its
  // bytes past `record_bytes` must be zero, as RecordBuffer keeps them).
  static Result<BundlePtr> ParseRecord(std::span<const std::byte> record,
                                       const BundleKey& expected);
  static Result<BundlePtr> AdoptRecord(RecordBuffer buffer, uint64_t record_bytes,
                                       const BundleKey& expected);
  // As AdoptRecord for a record the caller has just checked with VerifyRecord (no second
  // checksum pass). Precondition: VerifyRecord({buffer.data(), record_bytes}, key) is OK.
  static BundlePtr AdoptVerifiedRecord(RecordBuffer buffer, uint64_t record_bytes);
  // The checks of ParseRecord without building a bundle; OK when `record` is a good record of
  // `expected`.
  static Status VerifyRecord(std::span<const std::byte> record, const BundleKey& expected);
  // For a record shared between processes that number a namespace differently (RemoteTier):
  // checks `record` as filed under `written` (VerifyRecord), then rewrites its namespace id to
  // `namespace_id` and its checksum to match, in place. Returns VerifyRecord's error, having
  // changed nothing.
  static Status RestampNamespace(std::span<std::byte> record, const BundleKey& written, uint32_t namespace_id);
  // The namespace id, hash and sequence a record's header names, unchecked (nullopt when it is
  // shorter than a header): what to verify it against.
  struct RecordHeader {
    BundleKey key;
    uint64_t sequence = 0;
    uint16_t version = 0;  // the format version at byte 4
    uint32_t pages = 0;    // the pages tag
  };
  static std::optional<RecordHeader> PeekHeader(std::span<const std::byte> record);
  // VerifyRecord's checks of the header (magic, version, sizes, key) without the checksum pass:
  // enough to trust the record's layout, so that no span reaches past it.
  static Status VerifyRecordLayout(std::span<const std::byte> record, const BundleKey& expected);

  // Copies segment i into dst[i] (segment_bytes(i) bytes; a null dst[i] is read, not copied)
  // and checks the record's checksum over the bytes as they land, in the same pass: the one
  // pass over memory a restore of a record not yet checked needs (HostTier::GetPinned with
  // `check` false). Returns Corruption on a mismatch; the destinations then hold what the
  // record held, damage included. Precondition: dst.size() == segment_count().
  Status CopySegmentsVerified(std::span<std::byte* const> dst) const;

  const BundleKey& key() const { return key_; }
  // The version this copy holds (see the record layout above).
  uint64_t sequence() const { return sequence_; }
  uint32_t segment_count() const { return segment_count_; }
  uint64_t segment_bytes(uint32_t i) const;
  // Precondition: i < segment_count().
  std::span<const std::byte> segment(uint32_t i) const;
  std::span<const std::byte> payload() const;
  // Header + payload: what a tier stores.
  std::span<const std::byte> record() const { return {record_.data(), record_bytes_}; }
  // The record followed by zeros up to a multiple of 4 KiB, 4 KiB-aligned: an O_DIRECT write.
  std::span<const std::byte> padded_record() const {
    return {record_.data(), (record_bytes_ + 4095) & ~uint64_t{4095}};
  }
  uint64_t record_bytes() const { return record_bytes_; }
  uint64_t checksum() const { return checksum_; }
  // The pages tag the writer recorded (0: none).
  uint32_t pages() const { return pages_; }

  Bundle(const Bundle&) = delete;
  Bundle& operator=(const Bundle&) = delete;

 private:
  Bundle() = default;
  static Result<BundlePtr> FromVerified(RecordBuffer buffer, uint64_t record_bytes);

  BundleKey key_;
  uint64_t sequence_ = 0;
  uint32_t segment_count_ = 0;
  uint64_t header_bytes_ = 0;
  uint64_t record_bytes_ = 0;
  uint64_t checksum_ = 0;
  uint32_t pages_ = 0;
  RecordBuffer record_;
};

// True for VerifyRecord's answer to a record of another format version: a miss to count, never
// a record to delete.
bool IsOtherBundleVersion(const Status& s);

}  // namespace sparsekv
