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
// An absl::Condition is evaluated inside the library with the lock held, but out of the wrappers'
// sight: before the call that takes the lock returns, or by another thread, the one unlocking
// (after its wrapper has released). So Condition::Eval, which the library calls through its PLT,
// is defined here too: it acquires the mutex whose call (by this thread) is evaluating it before,
// and releases it after, so that whoever takes the lock next sees what the condition read.
//
// Only built with --config=tsan (tagged manual): it is meaningless, and would slow every lock,
// elsewhere.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/blocking_counter.h"
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

// The mutex on which this thread is inside a wrapped call (for Condition::Eval), or null.
thread_local const void* current_mutex = nullptr;

// Sets current_mutex for the lifetime of the object.
class InCall {
 public:
  explicit InCall(const void* mu) : saved_(current_mutex) { current_mutex = mu; }
  ~InCall() { current_mutex = saved_; }
  InCall(const InCall&) = delete;
  InCall& operator=(const InCall&) = delete;

 private:
  const void* const saved_;
};

void Acquire(const void* p) { __tsan_acquire(const_cast<void*>(p)); }
void Release(const void* p) { __tsan_release(const_cast<void*>(p)); }

// A wrapped conditional lock (the lock is held on return, whatever it returns) or Await (which
// releases the lock while it waits): `release` says whether the lock is held on entry.
template <typename R, typename... Args>
R Wrapped(R (*real)(absl::Mutex*, Args...), absl::Mutex* mu, bool release, Args... args) {
  if (release) Release(mu);
  R result;
  {
    InCall in_call(mu);
    result = real(mu, args...);
  }
  Acquire(mu);
  return result;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Locks: acquire after.
#define RUBATO_TSAN_LOCK(method, suffix)                              \
  void Mutex::method() ABSL_NO_THREAD_SAFETY_ANALYSIS {               \
    static const auto real = RealFn<void (*)(Mutex*)>(false, suffix); \
    {                                                                 \
      InCall in_call(this);                                           \
      real(this);                                                     \
    }                                                                 \
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
    InCall in_call(this);                                             \
    real(this);                                                       \
  }
RUBATO_TSAN_UNLOCK(Unlock, "5Mutex6UnlockEv")
RUBATO_TSAN_UNLOCK(ReaderUnlock, "5Mutex12ReaderUnlockEv")
#undef RUBATO_TSAN_UNLOCK

// Try-locks: acquire if taken.
#define RUBATO_TSAN_TRYLOCK(method, suffix)                           \
  bool Mutex::method() ABSL_NO_THREAD_SAFETY_ANALYSIS {               \
    static const auto real = RealFn<bool (*)(Mutex*)>(false, suffix); \
    bool taken;                                                       \
    {                                                                 \
      InCall in_call(this);                                           \
      taken = real(this);                                             \
    }                                                                 \
    if (taken) Acquire(this);                                         \
    return taken;                                                     \
  }
RUBATO_TSAN_TRYLOCK(TryLock, "5Mutex7TryLockEv")
RUBATO_TSAN_TRYLOCK(ReaderTryLock, "5Mutex13ReaderTryLockEv")
#undef RUBATO_TSAN_TRYLOCK

// Conditional locks (the lock is held on return, whatever they return) and Await.
void Mutex::LockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex8LockWhenERKNS0_9ConditionE");
  InCall in_call(this);
  real(this, cond);
  Acquire(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  InCall in_call(this);
  real(this, cond);
  Acquire(this);
}
void Mutex::Await(const Condition& cond) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static const auto real =
      RealFn<void (*)(Mutex*, const Condition&)>(false, "5Mutex5AwaitERKNS0_9ConditionE");
  Release(this);
  InCall in_call(this);
  real(this, cond);
  Acquire(this);
}

#define RUBATO_TSAN_TIMED(method, type, release, suffix)                                      \
  bool Mutex::method(const Condition& cond, type t) ABSL_NO_THREAD_SAFETY_ANALYSIS {          \
    static const auto real = RealFn<bool (*)(Mutex*, const Condition&, type)>(false, suffix); \
    return Wrapped<bool, const Condition&, type>(real, this, release, cond, t);               \
  }
RUBATO_TSAN_TIMED(LockWhenWithTimeout, Duration, false,
                  "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_TIMED(LockWhenWithDeadline, Time, false,
                  "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
RUBATO_TSAN_TIMED(ReaderLockWhenWithTimeout, Duration, false,
                  "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_TIMED(ReaderLockWhenWithDeadline, Time, false,
                  "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
RUBATO_TSAN_TIMED(AwaitWithTimeout, Duration, true,
                  "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE")
RUBATO_TSAN_TIMED(AwaitWithDeadline, Time, true,
                  "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE")
#undef RUBATO_TSAN_TIMED

// Condition variables: the same, on the mutex waited with.
void CondVar::Wait(Mutex* mu) {
  static const auto real = RealFn<void (*)(CondVar*, Mutex*)>(false, "7CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  {
    InCall in_call(mu);
    real(this, mu);
  }
  Acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = RealFn<bool (*)(CondVar*, Mutex*, Duration)>(
      false, "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  bool result;
  {
    InCall in_call(mu);
    result = real(this, mu, timeout);
  }
  Acquire(mu);
  return result;
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = RealFn<bool (*)(CondVar*, Mutex*, Time)>(
      false, "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  bool result;
  {
    InCall in_call(mu);
    result = real(this, mu, deadline);
  }
  Acquire(mu);
  return result;
}

// Conditions: see the top of the file. Evaluated outside any wrapped call (not seen in practice),
// they are left alone.
bool Condition::Eval() const {
  static const auto real = RealFn<bool (*)(const Condition*)>(true, "9Condition4EvalEv");
  const void* mu = current_mutex;
  if (mu != nullptr) Acquire(mu);
  const bool result = real(this);
  if (mu != nullptr) Release(mu);
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

// BlockingCounter and Barrier: an atomic count inside the library (only the last decrement
// takes the mutex). Each decrement releases, the wait acquires.
bool BlockingCounter::DecrementCount() {
  static const auto real =
      RealFn<bool (*)(BlockingCounter*)>(false, "15BlockingCounter14DecrementCountEv");
  Release(this);
  return real(this);
}
void BlockingCounter::Wait() {
  static const auto real = RealFn<void (*)(BlockingCounter*)>(false, "15BlockingCounter4WaitEv");
  real(this);
  Acquire(this);
}
bool Barrier::Block() {
  static const auto real = RealFn<bool (*)(Barrier*)>(false, "7Barrier5BlockEv");
  Release(this);
  const bool last = real(this);
  Acquire(this);
  return last;
}

ABSL_NAMESPACE_END
}  // namespace absl

// Races inside gRPC's own inline code (its headers are compiled into Rubato's objects, the rest
// of it is not instrumented): a call's operation sets and interceptor state are handed between
// gRPC's threads by synchronization TSan cannot see.
extern "C" const char* __tsan_default_suppressions() {
  return "race:grpc::internal::CallOpSet\n"
         "race:grpc::internal::InterceptorBatchMethodsImpl\n";
}
