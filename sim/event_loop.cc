#include "sim/event_loop.h"

#include <algorithm>
#include <utility>

namespace rubato {

EventLoop::EventLoop(absl::Time start) : clock_(start) {}

void EventLoop::At(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  heap_.push_back(Event{std::max(when, clock_.Now()), next_seq_++, std::move(fn)});
  std::push_heap(heap_.begin(), heap_.end(), Later());
}

int64_t EventLoop::Run(absl::Time until) {
  int64_t ran = 0;
  for (;;) {
    Event e;
    {
      absl::MutexLock lock(&mu_);
      if (heap_.empty() || heap_.front().when > until) return ran;
      std::pop_heap(heap_.begin(), heap_.end(), Later());
      e = std::move(heap_.back());
      heap_.pop_back();
    }
    clock_.SetTime(e.when);
    e.fn();
    ++ran;
  }
}

int64_t EventLoop::pending() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(heap_.size());
}

}  // namespace rubato
