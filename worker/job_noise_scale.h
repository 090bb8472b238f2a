// The job's gradient noise scale on a worker (bsp, backup): every push response carries its
// shard's noise-scale figures of the step before (server/noise_scale.h); JobNoiseScale adds up the
// shards' figures of one step into the job's and writes a "noise" record for each step that every
// shard has reported. Reports are from the network: one that could not come from a shard of this
// job (an unknown shard, a batch or gradient count out of range, a figure that is not finite) is
// ignored.
#ifndef RUBATO_WORKER_JOB_NOISE_SCALE_H_
#define RUBATO_WORKER_JOB_NOISE_SCALE_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "proto/parameter_server.pb.h"

namespace rubato {

class JobNoiseScale {
 public:
  explicit JobNoiseScale(size_t shards);

  // Takes one step's reports; returns the noise record (proto/progress.proto, one JSON line
  // without its newline) of a step newly reported by every shard, or "".
  std::string Update(int worker, const std::vector<NoiseScaleStats>& reports);

  // B_simple from the moving averages of the newest step (NaN before the first).
  double b_simple_ema() const { return b_simple_ema_; }
  // The job's moving averages of the newest step every shard has reported (null before the
  // first), for the servers' adaptive batch (PushRequest.noise_relay).
  const NoiseScaleRelay* relay() const { return relay_.step() >= 0 ? &relay_ : nullptr; }

 private:
  std::vector<NoiseScaleStats> latest_;  // Per shard, its newest valid report.
  int64_t measured_step_ = -1;
  double b_simple_ema_ = std::nan("");
  NoiseScaleRelay relay_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_JOB_NOISE_SCALE_H_
