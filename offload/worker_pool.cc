#include "worker_pool.h"

#include <pthread.h>

namespace sparsekv::offload {

WorkerPool::WorkerPool(std::string name, size_t threads) {
  for (size_t i = 0; i < threads; ++i) {
    auto w = std::make_unique<Worker>();
    w->thread = std::thread(&WorkerPool::Loop, w.get(), i);
    const std::string thread_name = (name + "-" + std::to_string(i)).substr(0, 15);
    pthread_setname_np(w->thread.native_handle(), thread_name.c_str());
    workers_.push_back(std::move(w));
  }
}

WorkerPool::~WorkerPool() {
  for (auto& w : workers_) {
    {
      MutexLock lock(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
  }
  for (auto& w : workers_) w->thread.join();
}

void WorkerPool::Submit(Task task) {
  Worker& w = *workers_[next_.fetch_add(1, std::memory_order_relaxed) % workers_.size()];
  {
    MutexLock lock(w.mu);
    w.queue.push_back(std::move(task));
  }
  w.cv.notify_one();
}

void WorkerPool::Loop(Worker* w, size_t index) {
  for (;;) {
    Task task;
    {
      MutexLock lock(w->mu);
      w->cv.wait(w->mu,
                 [w]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { return w->stop || !w->queue.empty(); });
      if (w->queue.empty()) return;  // stopping, and nothing left to run
      task = std::move(w->queue.front());
      w->queue.pop_front();
    }
    task(index);
  }
}

}  // namespace sparsekv::offload
