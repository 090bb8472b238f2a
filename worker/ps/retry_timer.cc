#include "worker/ps/retry_timer.h"

#include <utility>

namespace rubato {

RetryTimer::RetryTimer(Clock* clock) : clock_(clock), thread_([this] { Loop(); }) {}

RetryTimer::~RetryTimer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.Signal();
  }
  thread_.join();
}

void RetryTimer::At(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  due_.emplace(when, std::move(fn));
  changed_.Signal();
}

void RetryTimer::Loop() {
  mu_.Lock();
  while (!stop_) {
    // Waits on the clock even with nothing due, so that a simulated clock's AwaitWaitersAtNow
    // tells when the timer has run everything due by now.
    const absl::Time next = due_.empty() ? absl::InfiniteFuture() : due_.begin()->first;
    if (clock_->Now() < next) {
      clock_->WaitWithDeadline(&mu_, &changed_, next);
      continue;
    }
    std::function<void()> fn = std::move(due_.begin()->second);
    due_.erase(due_.begin());
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace rubato
