#include "worker/ps/heartbeats.h"

#include <algorithm>

#include "common/log.h"

namespace rubato {

Heartbeats::Heartbeats(PsClient* client, int64_t lease_ms, const std::atomic<int64_t>* step,
                       Clock* clock)
    : clock_(clock) {
  const absl::Duration period = absl::Milliseconds(std::max<int64_t>(lease_ms / 4, 1));
  thread_ = std::thread([this, client, period, step] { Loop(client, period, step); });
}

Heartbeats::~Heartbeats() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    stop_signal_.Signal();
  }
  thread_.join();
}

void Heartbeats::Loop(PsClient* client, absl::Duration period, const std::atomic<int64_t>* step) {
  bool failing = false;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time next = clock_->Now() + period;
      while (!stop_ && clock_->Now() < next) clock_->WaitWithDeadline(&mu_, &stop_signal_, next);
      if (stop_) return;
    }
    const absl::Status s = client->Heartbeat(step->load());
    sent_.fetch_add(1);
    if (!s.ok() && !failing) RUBATO_LOG(WARNING) << "heartbeat failed: " << s;
    if (s.ok() && failing) RUBATO_LOG(INFO) << "heartbeats answered again";
    failing = !s.ok();
  }
}

}  // namespace rubato
