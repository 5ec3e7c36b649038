// Clang thread-safety annotations (no-ops elsewhere) and an annotated mutex.
#pragma once

#include <mutex>

#if defined(__clang__)
#define SPARSEKV_TSA(x) __attribute__((x))
#else
#define SPARSEKV_TSA(x)
#endif

#define SPARSEKV_CAPABILITY(x) SPARSEKV_TSA(capability(x))
#define SPARSEKV_GUARDED_BY(x) SPARSEKV_TSA(guarded_by(x))
#define SPARSEKV_PT_GUARDED_BY(x) SPARSEKV_TSA(pt_guarded_by(x))
#define SPARSEKV_REQUIRES(...) SPARSEKV_TSA(requires_capability(__VA_ARGS__))
#define SPARSEKV_EXCLUDES(...) SPARSEKV_TSA(locks_excluded(__VA_ARGS__))
#define SPARSEKV_ACQUIRE(...) SPARSEKV_TSA(acquire_capability(__VA_ARGS__))
#define SPARSEKV_RELEASE(...) SPARSEKV_TSA(release_capability(__VA_ARGS__))
#define SPARSEKV_SCOPED_CAPABILITY SPARSEKV_TSA(scoped_lockable)
#define SPARSEKV_NO_THREAD_SAFETY_ANALYSIS SPARSEKV_TSA(no_thread_safety_analysis)

namespace sparsekv {

class SPARSEKV_CAPABILITY("mutex") Mutex {
 public:
  void lock() SPARSEKV_ACQUIRE() { mu_.lock(); }
  void unlock() SPARSEKV_RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

class SPARSEKV_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) SPARSEKV_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() SPARSEKV_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace sparsekv
