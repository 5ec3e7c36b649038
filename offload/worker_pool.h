// WorkerPool: a fixed set of threads, each with its own FIFO queue, so a task that owns
// per-thread state (an io_uring) always runs on the thread that owns it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/thread_annotations.h"

namespace sparsekv::offload {

class WorkerPool {
 public:
  using Task = std::function<void(size_t worker)>;

  // `name` names the threads (at most 15 characters are kept).
  WorkerPool(std::string name, size_t threads);
  // Runs every task already queued, then joins the threads.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task` on the next worker, round robin.
  void Submit(Task task);
  size_t size() const { return workers_.size(); }

 private:
  struct Worker {
    Mutex mu;
    std::condition_variable_any cv;
    std::deque<Task> queue SPARSEKV_GUARDED_BY(mu);
    bool stop SPARSEKV_GUARDED_BY(mu) = false;
    std::thread thread;
  };
  static void Loop(Worker* w, size_t index);

  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<size_t> next_{0};
};

}  // namespace sparsekv::offload
