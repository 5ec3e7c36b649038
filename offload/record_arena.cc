#include "record_arena.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cstring>

namespace sparsekv::offload {

Result<std::shared_ptr<RecordArena>> RecordArena::Create(uint64_t bytes) {
  bytes = bytes / kGranule * kGranule;
  if (bytes == 0)
    return Status::InvalidArgument(fmt::format("record arena: at least {} bytes", kGranule));
  std::shared_ptr<RecordArena> a(new RecordArena());
  // Populated now: registration pins the pages, and reads never wait on a page fault.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted(
        fmt::format("record arena: mmap of {} bytes: {}", bytes, std::strerror(errno)));
  }
  a->base_ = static_cast<std::byte*>(p);
  a->bytes_ = bytes;
  a->granules_ = bytes / kGranule;
  MutexLock lock(a->mu_);
  a->run_length_.assign(a->granules_, 0);
  a->used_.assign(a->granules_, false);
  return a;
}

RecordArena::~RecordArena() {
  if (base_) munmap(base_, bytes_);
}

RecordBuffer RecordArena::TryAllocate(uint64_t bytes) {
  const uint64_t need = std::max<uint64_t>(1, (bytes + kGranule - 1) / kGranule);
  if (need > granules_) return {};
  uint64_t start = UINT64_MAX;
  {
    MutexLock lock(mu_);
    if (used_count_ + need > granules_) return {};
    // Next fit from the hint, wrapping once.
    uint64_t at = hint_ < granules_ ? hint_ : 0;
    uint64_t run = 0;
    for (uint64_t scanned = 0; scanned < granules_ + need; ++scanned, ++at) {
      if (at == granules_) {
        at = 0;
        run = 0;
      }
      if (used_[at]) {
        run = 0;
        continue;
      }
      if (++run == need) {
        start = at + 1 - need;
        break;
      }
    }
    if (start == UINT64_MAX) return {};
    for (uint64_t g = start; g < start + need; ++g) used_[g] = true;
    run_length_[start] = static_cast<uint32_t>(need);
    used_count_ += need;
    hint_ = start + need;
  }
  std::byte* p = base_ + start * kGranule;
  const uint64_t capacity = need * kGranule;
  const uint64_t tail = bytes / 4096 * 4096;
  std::memset(p + tail, 0, std::min<uint64_t>(capacity, (bytes + 4095) / 4096 * 4096) - tail);
  return RecordBuffer(p, capacity, [self = shared_from_this()](std::byte* d) { self->Release(d); });
}

void RecordArena::Release(std::byte* p) {
  const uint64_t start = static_cast<uint64_t>(p - base_) / kGranule;
  MutexLock lock(mu_);
  const uint64_t n = run_length_[start];
  run_length_[start] = 0;
  for (uint64_t g = start; g < start + n; ++g) used_[g] = false;
  used_count_ -= n;
}

uint64_t RecordArena::used_granules() const {
  MutexLock lock(mu_);
  return used_count_;
}

}  // namespace sparsekv::offload
