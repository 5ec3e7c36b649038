// ExtentAllocator: contiguous runs ("extents") of fixed-size units carved out of one address
// space, for the host tier's arena and the SSD tier's data file (both in 4 KiB units).
//
// Why extents rather than size classes: a tier that sizes its slots for the largest record, or
// keeps one slab per size class, strands space as soon as the mix of record sizes changes (a
// class with free slots cannot lend them to another). Here every free unit serves every size:
// a mix of records from 4 KiB to the largest bundle fills the space up to its last units before
// anything must be evicted. Allocation is best fit (the smallest free extent that holds the
// request, the lowest such offset on ties), which keeps large holes for large records; freeing
// coalesces with both neighbours, so evicting adjacent records makes room for a larger one.
//
// Not thread-safe: the owner serializes calls (the tiers call it under their own lock).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace sparsekv::offload {

class ExtentAllocator {
 public:
  // Adds [at, at + units) to the free space (the space grew, or recovery found a gap); merges
  // with free neighbours. Precondition: the range is not free already.
  void AddFree(uint64_t at, uint64_t units);
  // The offset of `units` free units taken out of the free space, or nullopt when no free
  // extent is that large. Precondition: units > 0.
  std::optional<uint64_t> Allocate(uint64_t units);
  // Gives back an extent Allocate returned (or that recovery found in use).
  void Free(uint64_t at, uint64_t units) { AddFree(at, units); }
  // Takes whatever free units lie within [at, at + units) out of the free space (they must not
  // be handed out, e.g. while an index may still name them); returns how many it took.
  uint64_t RemoveFreeWithin(uint64_t at, uint64_t units);

  uint64_t free_units() const { return free_units_; }
  uint64_t largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }
  size_t free_extents() const { return by_offset_.size(); }
  // Whether `units` units could be allocated now.
  bool CanAllocate(uint64_t units) const { return largest_free() >= units; }

 private:
  void Insert(uint64_t at, uint64_t units);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  std::map<uint64_t, uint64_t> by_offset_;           // free extents: offset -> units
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (units, offset) of the same extents
  uint64_t free_units_ = 0;
};

}  // namespace sparsekv::offload
