#include "extent_allocator.h"

#include <algorithm>

namespace sparsekv::offload {

void ExtentAllocator::Insert(uint64_t at, uint64_t units) {
  by_offset_.emplace(at, units);
  by_size_.emplace(units, at);
  free_units_ += units;
}

void ExtentAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_units_ -= it->second;
  by_offset_.erase(it);
}

void ExtentAllocator::AddFree(uint64_t at, uint64_t units) {
  if (units == 0) return;
  auto next = by_offset_.lower_bound(at);
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      at = prev->first;
      units += prev->second;
      Erase(prev);
    }
  }
  if (next != by_offset_.end() && at + units == next->first) {
    units += next->second;
    Erase(next);
  }
  Insert(at, units);
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t units) {
  auto fit = by_size_.lower_bound({units, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const auto [have, at] = *fit;
  Erase(by_offset_.find(at));
  if (have > units) Insert(at + units, have - units);
  return at;
}

uint64_t ExtentAllocator::RemoveFreeWithin(uint64_t at, uint64_t units) {
  const uint64_t end = at + units;
  uint64_t taken = 0;
  auto it = by_offset_.upper_bound(at);
  if (it != by_offset_.begin()) --it;
  while (it != by_offset_.end() && it->first < end) {
    const uint64_t f_at = it->first, f_end = it->first + it->second;
    auto next = std::next(it);
    if (f_end > at) {
      Erase(it);
      if (f_at < at) Insert(f_at, at - f_at);
      if (f_end > end) Insert(end, f_end - end);
      taken += std::min(f_end, end) - std::max(f_at, at);
    }
    it = next;
  }
  return taken;
}

}  // namespace sparsekv::offload
