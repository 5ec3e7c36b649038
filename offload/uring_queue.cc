#include "uring_queue.h"

#include <fmt/format.h>
#include <liburing.h>
#include <spdlog/spdlog.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "io_status.h"

namespace sparsekv::offload {

struct UringQueue::Impl {
  struct Slot {
    uint64_t index = 0;  // op index in the batch
    UringOp op;
    AsyncIo io;
    uint64_t done = 0;  // bytes transferred so far
  };

  io_uring ring{};
  bool ring_ok = false;
  std::vector<Slot> slots;  // one per op in flight

  ~Impl() {
    if (ring_ok) io_uring_queue_exit(&ring);
  }
};

Result<std::unique_ptr<UringQueue>> UringQueue::Create(uint32_t depth) {
  if (depth == 0 || depth > 4096)
    return Status::InvalidArgument(fmt::format("queue depth {} is not in [1, 4096]", depth));
  std::unique_ptr<UringQueue> q(new UringQueue());
  q->impl_ = std::make_unique<Impl>();
  q->depth_ = depth;
  const int rc = io_uring_queue_init(depth, &q->impl_->ring, 0);
  if (rc < 0) {
    return ErrnoStatus(-rc, fmt::format("io_uring_queue_init({}) (io_uring may be disabled by "
                                        "/proc/sys/kernel/io_uring_disabled or a seccomp policy)",
                                        depth));
  }
  q->impl_->ring_ok = true;
  q->impl_->slots.resize(depth);
  return q;
}

UringQueue::~UringQueue() = default;

Status UringQueue::RegisterRegion(std::byte* base, uint64_t bytes) {
  if (region_ != nullptr)
    return Status::FailedPrecondition("io_uring: a region is registered already");
  iovec iov{base, bytes};
  const int r = io_uring_register_buffers(&impl_->ring, &iov, 1);
  if (r < 0) return ErrnoStatus(-r, fmt::format("io_uring_register_buffers of {} bytes", bytes));
  region_ = base;
  region_bytes_ = bytes;
  return Status::OK();
}

Status UringQueue::Run(uint64_t count, const Prepare& prepare, const Complete& complete,
                       const More& more) {
  Impl& im = *impl_;
  std::vector<uint32_t> free_slots;
  free_slots.reserve(depth_);
  for (uint32_t i = depth_; i-- > 0;) free_slots.push_back(i);
  std::vector<bool> busy(depth_, false);
  uint64_t next = 0;
  uint32_t in_flight = 0;

  // Finished ops wait here while the ring is refilled, so a slow `complete` (a checksum over a
  // whole record) runs with the next I/Os already in flight.
  std::vector<std::pair<uint64_t, UringOp>> finished;
  finished.reserve(depth_);
  auto finish = [&](uint32_t b, int result) {
    Impl::Slot& s = im.slots[b];
    s.op.result = result;
    busy[b] = false;
    finished.emplace_back(s.index, s.op);
    free_slots.push_back(b);
  };
  auto flush_finished = [&] {
    for (const auto& [index, op] : finished) complete(index, op);
    finished.clear();
  };
  // Fails every op not finished yet; after a ring failure nothing is submitted again.
  auto fail_all = [&](int err) {
    for (uint32_t b = 0; b < depth_; ++b) {
      if (busy[b]) finish(b, -err);
    }
    flush_finished();
    for (;;) {
      while (next < count) {
        Impl::Slot& s = im.slots[0];
        s.index = next++;
        s.op = UringOp{};
        prepare(s.index, s.op);
        s.op.result = -err;
        complete(s.index, s.op);
      }
      const uint64_t m = more ? more() : 0;
      if (m == 0) break;
      count += m;
    }
  };
  if (!broken_.ok()) {
    fail_all(EIO);
    return broken_;
  }
  // Submits what remains of slot b's op, or finishes it at once when a hook fails it.
  auto submit_rest = [&](uint32_t b) {
    Impl::Slot& s = im.slots[b];
    s.io = AsyncIo{};
    s.io.kind = s.op.kind;
    s.io.offset = s.op.offset + s.done;
    s.io.buffer = std::span<std::byte>(s.op.data + s.done, s.op.length - s.done);
    s.io.submit_bytes = s.op.length - s.done;
    s.op.file->BeforeSubmit(s.io);
    if (s.io.fail_errno != 0) {
      finish(b, -s.io.fail_errno);
      return;
    }
    // At most depth ops are in flight and the ring has depth entries: never null.
    io_uring_sqe* sqe = io_uring_get_sqe(&im.ring);
    const int fd = s.op.file->fd();
    const auto len = static_cast<unsigned>(s.io.submit_bytes);
    std::byte* data = s.io.buffer.data();
    const bool fixed =
        region_ != nullptr && data >= region_ && data + len <= region_ + region_bytes_;
    if (s.op.kind == AsyncIo::Kind::kRead) {
      if (fixed) {
        io_uring_prep_read_fixed(sqe, fd, data, len, s.io.offset, 0);
      } else {
        io_uring_prep_read(sqe, fd, data, len, s.io.offset);
      }
    } else {
      if (fixed) {
        io_uring_prep_write_fixed(sqe, fd, data, len, s.io.offset, 0);
      } else {
        io_uring_prep_write(sqe, fd, data, len, s.io.offset);
      }
    }
    (fixed ? fixed_ios_ : plain_ios_).fetch_add(1, std::memory_order_relaxed);
    sqe->rw_flags = s.op.rw_flags;
    io_uring_sqe_set_data64(sqe, b);
    ++in_flight;
  };

  std::vector<std::pair<uint32_t, int>> reaped;
  reaped.reserve(depth_);
  // More ops of a stream, when every op so far has been handed out.
  auto ask_more = [&] {
    if (next < count || !more) return next < count;
    count += more();
    return next < count;
  };
  for (;;) {
    if (next >= count && in_flight == 0 && finished.empty() && !ask_more()) break;
    uint32_t queued = 0;
    while (!free_slots.empty() && ask_more()) {
      const uint32_t b = free_slots.back();
      free_slots.pop_back();
      busy[b] = true;
      Impl::Slot& s = im.slots[b];
      s.index = next++;
      s.op = UringOp{};
      s.done = 0;
      prepare(s.index, s.op);
      const bool aligned = reinterpret_cast<uintptr_t>(s.op.data) % kDirectIoAlignment == 0 &&
                           s.op.length % kDirectIoAlignment == 0;
      if (s.op.file == nullptr || s.op.data == nullptr || s.op.length == 0 ||
          s.op.length > (1u << 30) || !aligned) {
        finish(b, -EINVAL);
        continue;
      }
      submit_rest(b);
      ++queued;
    }
    if (queued > 0) io_uring_submit(&im.ring);  // errors surface in submit_and_wait below
    flush_finished();
    if (in_flight == 0) continue;
    const int rc = io_uring_submit_and_wait(&im.ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      broken_ = ErrnoStatus(-rc, "io_uring_submit_and_wait");
      spdlog::error("{}; this ring is not used again", broken_.ToString());
      fail_all(-rc);
      return broken_;
    }
    unsigned head;
    io_uring_cqe* cqe;
    unsigned seen = 0;
    reaped.clear();
    io_uring_for_each_cqe(&im.ring, head, cqe) {
      reaped.emplace_back(static_cast<uint32_t>(io_uring_cqe_get_data64(cqe)), cqe->res);
      ++seen;
    }
    io_uring_cq_advance(&im.ring, seen);
    for (auto [b, res] : reaped) {
      --in_flight;
      Impl::Slot& s = im.slots[b];
      res = s.op.file->AfterComplete(s.io, res);
      if (res >= 0 && s.io.error_after_submit != 0) res = -s.io.error_after_submit;
      if (res < 0) {
        finish(b, res);
      } else if (res == 0) {
        finish(b, -EIO);  // no progress: end of file, or a device that gave up
      } else {
        s.done += static_cast<uint64_t>(res);
        if (s.done >= s.op.length) {
          finish(b, static_cast<int>(s.op.length));
        } else {
          submit_rest(b);  // a short transfer: continue where it stopped
        }
      }
    }
  }
  return Status::OK();
}

}  // namespace sparsekv::offload
