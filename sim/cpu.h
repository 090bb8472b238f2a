// Cpu: a host's processors, shared by the work of the processes on it (sim/README.md).
//
// Processor sharing: each piece of work has a width, the cores it can use at once (1 for a
// worker's compute; 2 for a loopback transfer, which keeps its sender and its receiver busy).
// While the running pieces' widths add up to at most the host's c cores, each runs at its width;
// beyond, each at width x c / (the sum), so four workers that evaluate at once on two cores each
// take twice as long as one alone. A host of 0 cores has as many as its work needs (each piece
// takes its work over its width). Work is CPU time as one core would spend it; what waits on a
// network or sleeps (an injected straggler delay) is not work.
#ifndef RUBATO_SIM_CPU_H_
#define RUBATO_SIM_CPU_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/time/time.h"
#include "sim/event_loop.h"

namespace rubato {

class Cpu {
 public:
  // `loop` must outlive the Cpu; cores >= 0.
  Cpu(EventLoop* loop, int cores) : loop_(loop), cores_(cores) {}
  Cpu(const Cpu&) = delete;
  Cpu& operator=(const Cpu&) = delete;

  // Runs `work` (>= 0) of CPU time from now on up to `width` (>= 1) cores; `done` runs (as an
  // event) when it is finished.
  void Run(absl::Duration work, std::function<void()> done, int width = 1);

  int running() const { return static_cast<int>(jobs_.size()); }
  absl::Duration busy() const { return busy_; }  // Work finished so far.

 private:
  struct Job {
    double remaining_ns;
    absl::Duration work;
    std::function<void()> done;
    int width;
  };

  double Share() const;  // What each job gets of its width now.
  // Moves every job's remaining work to now.
  void Advance();
  // Finishes the jobs that are done and schedules the next finish.
  void Settle();

  EventLoop* const loop_;
  const int cores_;
  std::vector<Job> jobs_;
  int64_t width_ = 0;  // The running jobs' widths.
  absl::Time last_;
  uint64_t generation_ = 0;  // A scheduled finish is stale once this has moved on.
  absl::Duration busy_;
};

}  // namespace rubato

#endif  // RUBATO_SIM_CPU_H_
