// RetryTimer: runs functions at given times on the clock (common/clock.h), on one thread of its
// own, so that a call waiting out its backoff holds no thread (worker/ps/fan_out.h).
#ifndef RUBATO_WORKER_PS_RETRY_TIMER_H_
#define RUBATO_WORKER_PS_RETRY_TIMER_H_

#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace rubato {

class RetryTimer final : public Timer {
 public:
  // `clock` must outlive the timer.
  explicit RetryTimer(Clock* clock);
  // Stops the thread; what is still due is not run (the owner ends every operation first).
  ~RetryTimer() override;
  RetryTimer(const RetryTimer&) = delete;
  RetryTimer& operator=(const RetryTimer&) = delete;

  // Runs `fn` on the timer's thread once the clock reaches `when` (at once if it has), after what
  // is due earlier.
  void At(absl::Time when, std::function<void()> fn) override;

  Clock* clock() const override { return clock_; }

 private:
  void Loop();

  Clock* const clock_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::multimap<absl::Time, std::function<void()>> due_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_RETRY_TIMER_H_
