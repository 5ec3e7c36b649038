#include "block_index.h"

#include <algorithm>
#include <bit>

namespace sparsekv::cache_internal {

BlockIndex::BlockIndex(uint64_t max_entries) {
  const uint64_t slots = std::bit_ceil(std::max<uint64_t>(16, 2 * max_entries));
  slots_.resize(slots);
  mask_ = slots - 1;
  max_entries_ = max_entries;
}

void BlockIndex::Insert(const BlockHash& key, RecordId record) {
  uint64_t i = key.lo & mask_;
  while (slots_[i].record != kNoRecord) i = (i + 1) & mask_;
  slots_[i] = Slot{key, record};
  ++size_;
}

bool BlockIndex::Erase(const BlockHash& key) {
  uint64_t i = key.lo & mask_;
  for (;; i = (i + 1) & mask_) {
    if (slots_[i].record == kNoRecord) return false;
    if (slots_[i].key == key) break;
  }
  // Backward shift: pull later members of the probe run into the hole when their home slot
  // does not lie cyclically in (hole, j].
  uint64_t hole = i;
  for (uint64_t j = (hole + 1) & mask_; slots_[j].record != kNoRecord; j = (j + 1) & mask_) {
    const uint64_t home = slots_[j].key.lo & mask_;
    const bool home_in_range = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!home_in_range) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = Slot{};
  --size_;
  return true;
}

void BlockIndex::Clear() {
  for (Slot& s : slots_) s = Slot{};
  size_ = 0;
}

}  // namespace sparsekv::cache_internal
