// Clang thread-safety annotations and an annotated mutex.
//
// Shared fields name the mutex that guards them (GUARDED_BY(mu_)) and
// functions name what they require (REQUIRES(mu_), EXCLUDES(mu_)); Clang's
// -Wthread-safety checks every access at compile time (scripts/
// check_thread_safety.sh runs it over src/scheduler with -Werror). Under GCC
// the macros expand to nothing.
//
// std::mutex carries no annotations in libstdc++, so code that wants the check
// uses Mutex / MutexLock / CondVar below: the same std::mutex and
// std::condition_variable underneath.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define STRATA_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define STRATA_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) STRATA_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY STRATA_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) STRATA_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) STRATA_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) STRATA_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) STRATA_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) STRATA_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) STRATA_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS STRATA_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace strata {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

// A condition variable used with Mutex. Wait in a loop that re-checks the
// condition in the caller (the analysis then sees every guarded read):
//   MutexLock lock(&mu_);
//   while (!ready_) cv_.Wait(&mu_);
class CondVar {
 public:
  // Atomically releases *mu, waits for a notification (or a spurious wakeup)
  // and re-acquires *mu before returning.
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's MutexLock releases it
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata
