// RecordArena: one mapped, pre-faulted region registered with the SSD tier's rings, carved into
// runs of 64 KiB granules that hold records read from the slabs. A read lands in a run with a
// fixed-buffer I/O, and the returned Bundle keeps the run until its last owner lets go, so
// reads need neither a bounce copy nor fresh pages. When the arena is full, callers fall back
// to heap buffers.
//
// Ownership: shared: every RecordBuffer it hands out holds a reference, so the region outlives
// the tier if bundles do. Thread safety: Allocate and the buffers' release are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/status.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv::offload {

class RecordArena : public std::enable_shared_from_this<RecordArena> {
 public:
  static constexpr uint64_t kGranule = 64 << 10;

  // Errors: `bytes` below one granule, or no memory.
  static Result<std::shared_ptr<RecordArena>> Create(uint64_t bytes);
  ~RecordArena();
  RecordArena(const RecordArena&) = delete;
  RecordArena& operator=(const RecordArena&) = delete;

  // A run of at least `bytes` (capacity rounded to granules, the padding after `bytes` zeroed
  // up to the next 4 KiB), or an empty buffer when no run is free.
  RecordBuffer TryAllocate(uint64_t bytes) SPARSEKV_EXCLUDES(mu_);

  std::byte* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t used_granules() const SPARSEKV_EXCLUDES(mu_);

 private:
  RecordArena() = default;
  void Release(std::byte* p) SPARSEKV_EXCLUDES(mu_);

  std::byte* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t granules_ = 0;
  mutable Mutex mu_;
  std::vector<uint32_t> run_length_
      SPARSEKV_GUARDED_BY(mu_);  // at a run's first granule, 0 elsewhere
  std::vector<bool> used_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t hint_ SPARSEKV_GUARDED_BY(mu_) = 0;  // where the next search starts (next fit)
  uint64_t used_count_ SPARSEKV_GUARDED_BY(mu_) = 0;
};

}  // namespace sparsekv::offload
