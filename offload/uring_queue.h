// UringQueue: one io_uring driving a batch of positional reads and writes at a fixed depth. One
// per I/O thread; not thread-safe.
//
// An op names its own memory (4 KiB-aligned, a multiple of 4 KiB long, as O_DIRECT needs). Ops
// whose memory lies in the registered region (RegisterRegion: io_uring_register_buffers) are
// submitted as fixed-buffer I/O, which skips pinning the pages on every I/O; others as plain
// I/O. Every submission passes through its file's hooks (file_system.h), so faults can be
// injected here too; short transfers are continued where they stopped.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "sparsekv/file_system.h"
#include "sparsekv/status.h"

namespace sparsekv::offload {

struct UringOp {
  RandomRWFile* file = nullptr;
  AsyncIo::Kind kind = AsyncIo::Kind::kRead;
  uint64_t offset = 0;
  // Where the bytes come from or go: 4 KiB-aligned, `length` bytes.
  std::byte* data = nullptr;
  // A multiple of 4 KiB, at most 1 GiB.
  uint64_t length = 0;
  // RWF_* flags for the submission (RWF_DSYNC for durable writes).
  int rw_flags = 0;
  // Final outcome: `length` when done, or -errno.
  int result = 0;
};

class UringQueue {
 public:
  // `prepare(index, op)` describes op `index` just before it is submitted; `complete(index, op)`
  // sees it once it is finished, exactly once.
  using Prepare = std::function<void(uint64_t, UringOp&)>;
  using Complete = std::function<void(uint64_t, const UringOp&)>;

  // Errors: a bad depth, or io_uring_queue_init failing (the message says why: ENOSYS, EPERM...).
  static Result<std::unique_ptr<UringQueue>> Create(uint32_t depth);
  ~UringQueue();
  UringQueue(const UringQueue&) = delete;
  UringQueue& operator=(const UringQueue&) = delete;

  // Registers [base, base + bytes) as the ring's fixed buffer. On error (RLIMIT_MEMLOCK, ...)
  // nothing is registered and every op stays plain I/O.
  Status RegisterRegion(std::byte* base, uint64_t bytes);

  // Runs ops 0..count-1, at most depth() in flight. When the ring itself fails, the ops not
  // finished complete with its error, which is returned, and the queue is not used again.
  //
  // With `more`, the batch is a stream: whenever every op so far has been handed out and a slot
  // is free (and once more before returning), `more()` is asked how many ops follow (0: none
  // now); they take the next indices. So a caller keeps the ring full across requests that
  // arrive while it runs, and `complete` may queue ops of its own (a retry) for `more` to
  // return. After a ring failure, the ops `more` still returns complete with its error.
  using More = std::function<uint64_t()>;
  Status Run(uint64_t count, const Prepare& prepare, const Complete& complete,
             const More& more = nullptr);

  uint32_t depth() const { return depth_; }
  bool registered() const { return region_ != nullptr; }
  // Submissions so far (readable from any thread).
  uint64_t fixed_ios() const { return fixed_ios_.load(std::memory_order_relaxed); }
  uint64_t plain_ios() const { return plain_ios_.load(std::memory_order_relaxed); }

 private:
  UringQueue() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  uint32_t depth_ = 0;
  std::byte* region_ = nullptr;
  uint64_t region_bytes_ = 0;
  std::atomic<uint64_t> fixed_ios_{0};
  std::atomic<uint64_t> plain_ios_{0};
  Status broken_;  // set when the ring failed; every later Run fails at once
};

}  // namespace sparsekv::offload
