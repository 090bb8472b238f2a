// CommThread: the thread a worker's communication runs on, so that the compute thread never
// encodes a push or waits on the network during the backward pass.
//
// The training loop posts one task per push bucket from the backend's GradientsReady callback
// (on a GPU: as soon as the layer's copy to the host is enqueued behind its CUDA event; the task
// waits for that copy, then starts the push), and drains the thread before it waits for the pushes
// at the end of the step. Tasks run one at a time in the order posted, so pushes start in the order
// the backward pass finished their layers, as they did from the compute thread. Posting never
// blocks; what a task touches must stay valid until Drain returns.
#ifndef RUBATO_WORKER_COMM_THREAD_H_
#define RUBATO_WORKER_COMM_THREAD_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rubato {

class CommThread {
 public:
  CommThread();
  // Runs what is still queued, then joins the thread.
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `task` (named `what` in a timeout's message) behind the tasks posted before it.
  void Post(std::string what, std::function<void()> task);

  // Waits until every task posted so far has run. DEADLINE_EXCEEDED after `timeout`, naming the
  // task still running and how many wait behind it; the tasks are then still queued and a later
  // Drain waits for them again.
  absl::Status Drain(absl::Duration timeout);

  // Tasks run so far (for tests and logs).
  int64_t tasks_run() const;

 private:
  struct Task {
    std::string what;
    std::function<void()> run;
  };
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  std::string running_ ABSL_GUARDED_BY(mu_);  // The task being run ("" when idle).
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t run_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // Last: started once the rest is set up.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_COMM_THREAD_H_
