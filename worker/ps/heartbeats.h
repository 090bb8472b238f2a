// Heartbeats: keeps a worker's lease on every shard while it computes or waits at a barrier: a
// heartbeat (PsClient::Heartbeat, to every shard at once) every lease / 4 on the clock, from the
// construction to the destruction, on a thread of its own. A failed heartbeat is logged once, and
// again when they are answered again; the next one follows a period later.
#ifndef RUBATO_WORKER_PS_HEARTBEATS_H_
#define RUBATO_WORKER_PS_HEARTBEATS_H_

#include <atomic>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "worker/ps/ps_client.h"

namespace rubato {

class Heartbeats {
 public:
  // `client`, `step` (the step to report) and `clock` must outlive this.
  Heartbeats(PsClient* client, int64_t lease_ms, const std::atomic<int64_t>* step,
             Clock* clock = Clock::Real());
  // Stops the thread (a heartbeat in flight ends by its deadline first).
  ~Heartbeats();
  Heartbeats(const Heartbeats&) = delete;
  Heartbeats& operator=(const Heartbeats&) = delete;

  // Heartbeats sent so far (tests).
  int64_t sent() const { return sent_.load(); }

 private:
  void Loop(PsClient* client, absl::Duration period, const std::atomic<int64_t>* step);

  Clock* const clock_;
  absl::Mutex mu_;
  absl::CondVar stop_signal_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> sent_{0};
  std::thread thread_;  // Last: started once the rest exists.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_HEARTBEATS_H_
