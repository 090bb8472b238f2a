// EventLoop: the time and the queue of a discrete-event simulation (sim/README.md).
//
// Everything a simulation runs is an event: a function due at a simulated time. Run() takes them
// in order of time (those due at the same time in the order they were scheduled), moves the clock
// to each one's time and runs it, on the calling thread; an event schedules later ones. The clock
// is a SimulatedClock (common/clock.h) that only the loop moves, so that the real shard and
// client code it drives, which read a Clock and schedule retries on a Timer, run in simulated time
// without a thread of their own. Nothing in a simulation may block on that clock: no one else
// would move it. Thread-safe, although a simulation runs on one thread.
#ifndef RUBATO_SIM_EVENT_LOOP_H_
#define RUBATO_SIM_EVENT_LOOP_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace rubato {

class EventLoop final : public Timer {
 public:
  // The clock starts at SimulatedClock's default time, or at `start`.
  EventLoop() = default;
  explicit EventLoop(absl::Time start);
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  Clock* clock() const override { return &clock_; }
  absl::Time Now() const { return clock_.Now(); }

  // Timer: `fn` runs at `when`, or now if that has passed (never inside this call).
  void At(absl::Time when, std::function<void()> fn) override;
  void After(absl::Duration d, std::function<void()> fn) { At(Now() + d, std::move(fn)); }

  // Runs events until none is left or the next is due after `until`; the clock then stands at the
  // last event's time. Returns how many ran.
  int64_t Run(absl::Time until = absl::InfiniteFuture());

  // Events scheduled and not yet run.
  int64_t pending() const;

 private:
  struct Event {
    absl::Time when;
    uint64_t seq;
    std::function<void()> fn;
  };
  // For a min-heap on (when, seq) with the std heap functions, which keep the largest first (a
  // type, not a function pointer, so that the heap's comparisons are inlined).
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.when != b.when ? a.when > b.when : a.seq > b.seq;
    }
  };

  mutable SimulatedClock clock_;
  mutable absl::Mutex mu_;
  std::vector<Event> heap_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rubato

#endif  // RUBATO_SIM_EVENT_LOOP_H_
