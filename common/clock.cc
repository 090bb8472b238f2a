#include "common/clock.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace rubato {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  bool WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) override {
    return cv->WaitWithDeadline(mu, deadline);
  }
  void SleepFor(absl::Duration d) override { absl::SleepFor(d); }
};

// A waiter re-checks the simulated time at least this often in real time. A signal from Advance
// that comes between the waiter's check of the time and the start of its wait would otherwise be
// lost (Advance cannot take the waiter's mutex: the waiter holds it while it takes the clock's).
constexpr absl::Duration kRecheck = absl::Milliseconds(2);

}  // namespace

Clock* Clock::Real() {
  static Clock* const clock = new RealClock();
  return clock;
}

SimulatedClock::SimulatedClock(absl::Time start) : now_(start) {}

absl::Time SimulatedClock::Now() const {
  absl::MutexLock lock(&mu_);
  return now_;
}

bool SimulatedClock::WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (now_ >= deadline) return true;
    waiting_.push_back({cv, now_});
  }
  cv->WaitWithTimeout(mu, kRecheck);
  absl::MutexLock lock(&mu_);
  waiting_.erase(std::find_if(waiting_.begin(), waiting_.end(),
                              [cv](const Waiting& w) { return w.cv == cv; }));
  return now_ >= deadline;
}

void SimulatedClock::SleepFor(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  const absl::Time until = now_ + d;
  ++sleepers_;
  while (now_ < until) moved_.WaitWithTimeout(&mu_, kRecheck);
  --sleepers_;
}

void SimulatedClock::Advance(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  if (d > absl::ZeroDuration()) now_ += d;
  WakeAll();
}

void SimulatedClock::SetTime(absl::Time t) {
  absl::MutexLock lock(&mu_);
  now_ = std::max(now_, t);
  WakeAll();
}

int SimulatedClock::Waiters() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size()) + sleepers_;
}

bool SimulatedClock::AwaitWaitersAtNow(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::count_if(waiting_.begin(), waiting_.end(),
                         [this](const Waiting& w)
                             ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return w.since == now_; }) >= n;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

void SimulatedClock::WakeAll() {
  for (const Waiting& w : waiting_) w.cv->SignalAll();
  moved_.SignalAll();
}

}  // namespace rubato
