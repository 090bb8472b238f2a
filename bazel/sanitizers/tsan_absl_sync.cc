// ThreadSanitizer annotations for Debian's uninstrumented Abseil synchronization library.
//
// libabsl_synchronization.so is built without -fsanitize=thread, so TSan sees neither its locks
// nor the atomics inside them: every access to data guarded by an absl::Mutex from two threads
// would be reported as a race. This file, linked into every binary of --config=tsan (through
// --custom_malloc, which adds a library to every link), defines absl::Mutex's, CondVar's and
// Notification's entry points in the executable itself. They take precedence over the library's
// (for gRPC too, whose grpc_core::Mutex is an absl::Mutex); each calls the library's own, found
// with dlsym(RTLD_NEXT), and tells TSan that the lock was acquired (__tsan_acquire on its address)
// or is about to be released (__tsan_release). Reader locks are treated as exclusive ones, which
// may hide a race between two readers' writes but reports nothing false.
//
// Only built with --config=tsan (tagged manual): it is meaningless, and would slow every lock,
// elsewhere.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {

#define RUBATO_TSAN_STR2(x) #x
#define RUBATO_TSAN_STR(x) RUBATO_TSAN_STR2(x)

// The library's definition of the function whose mangled name is _ZN[K]4absl<ns><suffix>, ns
// being Abseil's inline namespace (for Debian's 20220623 build, "debian3").
void* Real(bool is_const, const char* suffix) {
  const std::string ns = RUBATO_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name =
      std::string(is_const ? "_ZNK4absl" : "_ZN4absl") + std::to_string(ns.size()) + ns + suffix;
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return f;
}

template <typename F>
F RealFn(bool is_const, const char* suffix) {
  return reinterpret_cast<F>(Real(is_const, suffix));
}

void Acquire(const void* p) { __tsan_acquire(const_cast<void*>(p)); }
void Release(const void* p) { __tsan_release(const_cast<void*>(p)); }

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Locks: acquire after.
#define RUBATO_TSAN_LOCK(method, suffix)                              \
  void Mutex::method() ABSL_NO_THREAD_SAFETY_ANALYSIS {               \
    static const auto real = RealFn<void (*)(Mutex*)>(false, suffix); \
    real(this);                                                       \
    Acquire(this);                                                    \
  }
RUBATO_TSAN_LOCK(Lock, "5Mutex4LockEv")
RUBATO_TSAN_LOCK(ReaderLock, "5Mutex10ReaderLockEv")
#undef RUBATO_TSAN_LOCK

// Unlocks: release before.
#define RUBATO_TSAN_UNLOCK(method, suffix)                            \
  void Mutex::method() ABSL_NO_THREAD_SAFETY_ANALYSIS {               \
    static const auto real = RealFn<void (*)(Mutex*)>(false, suffix); \
    Release(this);                                                    \
    real(this);                                                       \
  }
RUBATO_TSAN_UNLOCK(Unlock, "5Mutex6UnlockEv")
RUBATO_TSAN_UNLOCK(ReaderUnlock, "5Mutex12ReaderUnlockEv")
#undef RUBATO_TSAN_UNLOCK

// Try-locks: acquire if taken.
#define RUBATO_TSAN_TRYLOCK(method, suffix)                           \
  bool Mutex::method() ABSL_NO_THREAD_SAFETY_ANALYSIS {               \
    static const auto real = RealFn<bool (*)(Mutex*)>(false, suffix); \
    const bool taken = real(this);                                    \
    if (taken) Acquire(this);                                         \
    return taken;                                                     \
  }
RUBATO_TSAN_TRYLOCK(TryLock, "5Mutex7TryLockEv")
RUBATO_TSAN_TRYLOCK(ReaderTryLock, "5Mutex13ReaderTryLockEv")
#undef RUBATO_TSAN_TRYLOCK

// Conditional locks: the lock is held on return, whatever they return.
void Mutex::LockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex8LockWhenERKNS0_9ConditionE");
  real(this, cond);
  Acquire(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  real(this, cond);
  Acquire(this);
}
#define RUBATO_TSAN_LOCK_WHEN(method, type, suffix)                                           \
  bool Mutex::method(const Condition& cond, type t) ABSL_NO_THREAD_SAFETY_ANALYSIS {          \
    static const auto real = RealFn<bool (*)(Mutex*, const Condition&, type)>(false, suffix); \
    const bool result = real(this, cond, t);                                                  \
    Acquire(this);                                                                            \
    return result;                                                                            \
  }
RUBATO_TSAN_LOCK_WHEN(LockWhenWithTimeout, Duration,
                      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_LOCK_WHEN(LockWhenWithDeadline, Time,
                      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
RUBATO_TSAN_LOCK_WHEN(ReaderLockWhenWithTimeout, Duration,
                      "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_LOCK_WHEN(ReaderLockWhenWithDeadline, Time,
                      "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
#undef RUBATO_TSAN_LOCK_WHEN

// Await: releases the lock while waiting and holds it again on return.
void Mutex::Await(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex5AwaitERKNS0_9ConditionE");
  Release(this);
  real(this, cond);
  Acquire(this);
}
#define RUBATO_TSAN_AWAIT(method, type, suffix)                                               \
  bool Mutex::method(const Condition& cond, type t) ABSL_NO_THREAD_SAFETY_ANALYSIS {          \
    static const auto real = RealFn<bool (*)(Mutex*, const Condition&, type)>(false, suffix); \
    Release(this);                                                                            \
    const bool result = real(this, cond, t);                                                  \
    Acquire(this);                                                                            \
    return result;                                                                            \
  }
RUBATO_TSAN_AWAIT(AwaitWithTimeout, Duration,
                  "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_AWAIT(AwaitWithDeadline, Time, "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE")
#undef RUBATO_TSAN_AWAIT

// Condition variables: the same, on the mutex waited with.
void CondVar::Wait(Mutex* mu) {
  static const auto real = RealFn<void (*)(CondVar*, Mutex*)>(false, "7CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  real(this, mu);
  Acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = RealFn<bool (*)(CondVar*, Mutex*, Duration)>(
      false, "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  const bool result = real(this, mu, timeout);
  Acquire(mu);
  return result;
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = RealFn<bool (*)(CondVar*, Mutex*, Time)>(
      false, "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  const bool result = real(this, mu, deadline);
  Acquire(mu);
  return result;
}

// Notification: Notify releases, the waits acquire. (HasBeenNotified is inline: an atomic load
// that TSan sees, of a store it does not.)
void Notification::Notify() {
  static const auto real = RealFn<void (*)(Notification*)>(false, "12Notification6NotifyEv");
  Release(this);
  real(this);
}
void Notification::WaitForNotification() const {
  static const auto real =
      RealFn<void (*)(const Notification*)>(true, "12Notification19WaitForNotificationEv");
  real(this);
  Acquire(this);
}
bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const auto real = RealFn<bool (*)(const Notification*, Duration)>(
      true, "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) Acquire(this);
  return notified;
}
bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const auto real = RealFn<bool (*)(const Notification*, Time)>(
      true, "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) Acquire(this);
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
