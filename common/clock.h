// Clock: where Rubato's deadlines, leases, backoffs, heartbeats, idle timeouts and checkpoint
// periods read the time, and how they wait for it.
//
// Clock::Real() is absl::Now() and absl::CondVar's own timed waits. SimulatedClock is a clock that
// moves only when told to (Advance, SetTime), so tests of leases and deadlines, and a simulator,
// run in simulated time without real waits. Code takes a `Clock*` in its Options (default:
// Clock::Real()) and never calls absl::Now() for anything that decides behaviour.
//
// Socket I/O deadlines (common/socket_io.h) stay on the real clock: the kernel waits for them.
#ifndef RUBATO_COMMON_CLOCK_H_
#define RUBATO_COMMON_CLOCK_H_

#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rubato {

class Clock {
 public:
  virtual ~Clock() = default;

  // The process-wide real clock; never deleted.
  static Clock* Real();

  virtual absl::Time Now() const = 0;

  // With `mu` held: waits on `cv` until it is signalled or Now() reaches `deadline`, and returns
  // true if the deadline has passed. Like absl::CondVar::WaitWithDeadline, it may also return
  // early without either; callers re-check their condition in a loop.
  virtual bool WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) = 0;

  // Returns once Now() has moved on by `d`.
  virtual void SleepFor(absl::Duration d) = 0;
};

// Timer: runs functions at given times on a clock. RetryTimer (worker/ps/retry_timer.h) runs them
// on a thread of its own; a simulator's event loop (sim/event_loop.h) runs them in simulated time,
// on the thread that runs the loop.
class Timer {
 public:
  virtual ~Timer() = default;
  virtual Clock* clock() const = 0;
  // Runs `fn` once the clock reaches `when` (soon, if it has), after what is due earlier. Never
  // runs it inside this call.
  virtual void At(absl::Time when, std::function<void()> fn) = 0;
};

// A clock that stands still until Advance or SetTime moves it. Waits whose deadline the new time
// reaches are woken. Thread-safe.
class SimulatedClock : public Clock {
 public:
  explicit SimulatedClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24 * 365 * 50));

  absl::Time Now() const override;
  bool WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) override;
  void SleepFor(absl::Duration d) override;

  // Moves the time on by `d` (>= 0) and wakes the waits it may end.
  void Advance(absl::Duration d);
  // Moves the time to `t` if it is later than now.
  void SetTime(absl::Time t);
  // How many threads are in WaitWithDeadline or SleepFor now (tests use it to know that a thread
  // has reached its wait before they advance the clock).
  int Waiters() const;
  // Waits, in real time up to `timeout`, until at least `n` threads are in WaitWithDeadline having
  // begun their wait at the current time: each has done whatever the last move of the clock made
  // due, and waits for something later. False on timeout.
  bool AwaitWaitersAtNow(int n, absl::Duration timeout) const;

 private:
  void WakeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  // The waits in progress: each one's condition variable, signalled when the time moves, and the
  // time at which it began. A waiter removes its entry (under mu_) before it returns, so a
  // signalled CondVar is alive.
  struct Waiting {
    absl::CondVar* cv;
    absl::Time since;
  };
  std::vector<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  absl::CondVar moved_;  // For SleepFor.
  int sleepers_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_CLOCK_H_
