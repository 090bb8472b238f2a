// CallGate: how many calls to one shard may be in flight at once.
//
// Lets calls run at once while their weights (1 a call, or its bytes) add up to at most a limit, in
// the order they were begun; one runs alone whatever its weight. A call begun while the rest would
// not fit starts (on the thread that ends an earlier one) once they do. PsClient keeps one per
// shard for the calls that carry gradients, shared by every push (worker/ps/ps_client.h explains
// the limit), and gives each other operation gates of its own.
#ifndef RUBATO_WORKER_PS_CALL_GATE_H_
#define RUBATO_WORKER_PS_CALL_GATE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace rubato {

class CallGate {
 public:
  explicit CallGate(int64_t limit) : limit_(limit) {}
  CallGate(const CallGate&) = delete;
  CallGate& operator=(const CallGate&) = delete;

  // Runs `start` now, or queues it until enough ends.
  void Begin(int64_t weight, std::function<void()> start) {
    {
      absl::MutexLock lock(&mu_);
      if (!waiting_.empty() || !FitsLocked(weight)) {
        waiting_.push_back({weight, std::move(start)});
        return;
      }
      in_flight_ += weight;
      ++running_;
    }
    start();
  }

  // A call of `weight` that Begin started has ended: the queued ones that now fit start, in order.
  void End(int64_t weight) {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      in_flight_ -= weight;
      --running_;
      TakeReadyLocked(&ready);
    }
    for (auto& start : ready) start();
  }

  // A new limit (a shard announced its part size), for the calls begun from now on.
  void SetLimit(int64_t limit) {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      limit_ = limit;
      TakeReadyLocked(&ready);
    }
    for (auto& start : ready) start();
  }

 private:
  bool FitsLocked(int64_t weight) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ == 0 || in_flight_ + weight <= limit_;
  }
  void TakeReadyLocked(std::vector<std::function<void()>>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!waiting_.empty() && FitsLocked(waiting_.front().first)) {
      in_flight_ += waiting_.front().first;
      ++running_;
      ready->push_back(std::move(waiting_.front().second));
      waiting_.pop_front();
    }
  }

  absl::Mutex mu_;
  int64_t limit_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::pair<int64_t, std::function<void()>>> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_CALL_GATE_H_
