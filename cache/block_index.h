// BlockIndex: the prefix cache's map from block hash to block record, open addressing.
//
// Why not std::unordered_map: it allocates a node per entry and chases a pointer per probe;
// trace replay inserts and erases a block per microsecond. The keys are already uniform
// 128-bit hashes, so a power-of-two table with linear probing on the low bits and
// backward-shift deletion (no tombstones) stays short-probed at the fixed load it is sized for.
// The capacity is fixed at construction (the manager knows how many records can exist).
//
// Thread-compatible: the owner serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsekv/block_hash.h"

namespace sparsekv::cache_internal {

using RecordId = uint32_t;
inline constexpr RecordId kNoRecord = UINT32_MAX;

class BlockIndex {
 public:
  // Room for `max_entries` keys at a load of at most one half.
  explicit BlockIndex(uint64_t max_entries);

  // The record stored under `key`, or kNoRecord.
  RecordId Find(const BlockHash& key) const {
    for (uint64_t i = key.lo & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.record == kNoRecord) return kNoRecord;
      if (s.key == key) return s.record;
    }
  }
  // The value stored under `key`, writable in place (it must stay other than kNoRecord), or
  // nullptr.
  RecordId* FindMutable(const BlockHash& key) {
    for (uint64_t i = key.lo & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.record == kNoRecord) return nullptr;
      if (s.key == key) return &s.record;
    }
  }
  uint64_t max_entries() const { return max_entries_; }
  // Precondition: `key` is absent and size() < max_entries.
  void Insert(const BlockHash& key, RecordId record);
  // Returns whether `key` was there.
  bool Erase(const BlockHash& key);
  void Clear();

  uint64_t size() const { return size_; }
  uint64_t slot_count() const { return slots_.size(); }

 private:
  struct Slot {
    BlockHash key;
    RecordId record = kNoRecord;
  };
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  uint64_t size_ = 0;
  uint64_t max_entries_ = 0;
};

}  // namespace sparsekv::cache_internal
