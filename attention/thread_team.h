// ThreadTeam: a fixed set of threads that run the items of one parallel loop, the caller's
// thread among them. Items are handed out by an atomic counter, so which thread runs an item
// varies between runs; the kernels make every item's result independent of that.
//
// Run allocates nothing and takes a plain function pointer, so a kernel call makes no heap
// allocation. Thread safety: one Run at a time (the kernels that own a team are not reentrant).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "sparsekv/thread_annotations.h"

namespace sparsekv::attention {

class ThreadTeam {
 public:
  // fn(ctx, item, thread): thread is in [0, size()); 0 is the caller.
  using ItemFn = void (*)(void* ctx, uint32_t item, uint32_t thread);

  explicit ThreadTeam(uint32_t threads);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  uint32_t size() const { return static_cast<uint32_t>(workers_.size()) + 1; }
  // Runs fn for items [0, items) and returns when all are done.
  void Run(uint32_t items, ItemFn fn, void* ctx);

 private:
  void WorkerLoop(uint32_t thread);
  void Drain(uint32_t thread);

  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // guarded by mu_
  uint32_t busy_ = 0;        // workers still in the current run; guarded by mu_
  bool stop_ = false;        // guarded by mu_
  // Set under mu_ before a run starts, read by workers after they see the new generation.
  ItemFn fn_ = nullptr;
  void* ctx_ = nullptr;
  uint32_t items_ = 0;
  std::atomic<uint32_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace sparsekv::attention
