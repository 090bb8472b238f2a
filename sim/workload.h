// Workload: what each simulated worker of a TimingJob computes, and what it reports.
//
// Without one, the job runs at the timing level: every worker pushes tensors of zeros held at
// 1 / scale of their size and its step takes the job's step_time. With one (the training level,
// sim/training_workload.h), the workload supplies the model's tensors and starting weights, each
// worker's real gradient of each step and that step's compute time, and is told of every step's
// timings, so that it can train a real model in simulated time and write the records a real
// worker writes. The job calls it on its one thread.
#ifndef RUBATO_SIM_WORKLOAD_H_
#define RUBATO_SIM_WORKLOAD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/cluster.pb.h"
#include "worker/ps/ps_client.h"

namespace rubato {

// One step of one worker, as the job saw it.
struct SimStep {
  int worker = 0;
  int64_t step = 0;        // The step computed; done = step + 1.
  int64_t skipped = 0;     // Steps jumped over before it (backup:b).
  absl::Duration pull;     // From the pull's start to its answer (waiting at a barrier included).
  absl::Duration compute;  // The workload's compute time.
  absl::Duration delay;    // The StragglerModel's delay (floor, slowdown, random delays).
  absl::Duration push;     // From the push's start to its acknowledgement.
  absl::Duration at;       // The push's acknowledgement, from the job's start.
  PsClient::PushResult pushed;
};

class Workload {
 public:
  virtual ~Workload() = default;

  // The model's tensors as the shards hold them, and the weights every worker registers with.
  virtual std::vector<TensorSpec> Model() const = 0;
  virtual std::vector<std::vector<float>> InitialParams() const = 0;

  // Worker `worker`'s gradients of `step` at `params` into `grads` (sized as the model); returns
  // the time that compute takes, before the worker's StragglerModel adds its delay.
  virtual absl::StatusOr<absl::Duration> Compute(int worker, int64_t step,
                                                 absl::Span<const std::vector<float>> params,
                                                 std::vector<std::vector<float>>* grads) = 0;

  // After a worker's step was acknowledged, with `params` the weights it computed on: returns the
  // time the worker spends before its next step (an evaluation that falls due).
  virtual absl::StatusOr<absl::Duration> StepDone(const SimStep& step,
                                                  absl::Span<const std::vector<float>> params) = 0;

  // After a worker's last step and its pull of the final weights (`params`, at `at` from the
  // job's start): returns the time it spends before it tells the shards it finished (a final
  // evaluation).
  virtual absl::StatusOr<absl::Duration> Finished(int worker, int64_t steps, int64_t computed,
                                                  int64_t skipped, absl::Duration at,
                                                  absl::Span<const std::vector<float>> params) = 0;
};

}  // namespace rubato

#endif  // RUBATO_SIM_WORKLOAD_H_
