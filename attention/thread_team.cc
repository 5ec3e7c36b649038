#include "attention/thread_team.h"

namespace sparsekv::attention {

ThreadTeam::ThreadTeam(uint32_t threads) {
  const uint32_t extra = threads > 1 ? threads - 1 : 0;
  workers_.reserve(extra);
  for (uint32_t t = 0; t < extra; ++t) workers_.emplace_back([this, t] { WorkerLoop(t + 1); });
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadTeam::Drain(uint32_t thread) {
  for (;;) {
    const uint32_t item = next_.fetch_add(1, std::memory_order_relaxed);
    if (item >= items_) return;
    fn_(ctx_, item, thread);
  }
}

void ThreadTeam::Run(uint32_t items, ItemFn fn, void* ctx) {
  if (items == 0) return;
  if (workers_.empty() || items == 1) {
    for (uint32_t i = 0; i < items; ++i) fn(ctx, i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = fn;
    ctx_ = ctx;
    items_ = items;
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<uint32_t>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  Drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return busy_ == 0; });
}

void ThreadTeam::WorkerLoop(uint32_t thread) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain(thread);
    std::lock_guard<std::mutex> lock(mu_);
    if (--busy_ == 0) done_cv_.notify_one();
  }
}

}  // namespace sparsekv::attention
