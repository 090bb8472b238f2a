// What the in-process job tests (training_loop_test, kill_points_test) share: a learnable
// synthetic dataset, and the client options of one of a job's workers.
#ifndef RUBATO_INPROCESS_TEST_JOBS_H_
#define RUBATO_INPROCESS_TEST_JOBS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/cluster.pb.h"
#include "worker/data/dataset.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/ps/shard_channel.h"
#include "worker/training_loop.h"

namespace rubato {

// `n` examples of 8 features in [0, 1) whose label (of 3) is the argmax of a fixed linear map of
// the features: learnable. The same `seed`, the same examples.
Dataset SyntheticDataset(int n, uint64_t seed);

// Worker `worker`'s client options for a job of `cluster` training `spec` for `steps` steps
// (16 steps an epoch): its id, the job's workers and consistency, and the model's tensors.
PsClientOptions InProcessClientOptions(const ModelSpec& spec, const ClusterSpec& cluster,
                                       int worker, int64_t steps);

// What one worker's run ended with.
struct WorkerRun {
  TrainingResult result;
  std::vector<std::vector<float>> params;
  std::string progress;  // Its JSON lines.
};

// A client of one shard for a 4-tensor model (the 8-16-3 MLP) whose pulls leave the weights as
// they are and whose other calls succeed, for tests of the loop alone: a fake overrides Push and
// what it tests.
class FakeClient : public PsClient {
 public:
  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>>, int32_t,
                                   int64_t) override {
    return 0;
  }
  absl::Status Pull(int64_t, absl::Span<std::vector<float>>, int64_t*) override {
    return absl::OkStatus();
  }
  absl::Status Heartbeat(int64_t) override { return absl::OkStatus(); }
  absl::Status Finish(int64_t) override { return absl::OkStatus(); }
  const std::vector<int>& shard_of() const override { return shard_of_; }
  const std::vector<int64_t>& shard_bytes() const override { return shard_bytes_; }

 private:
  std::vector<int> shard_of_ = {0, 0, 0, 0};
  std::vector<int64_t> shard_bytes_ = {1};
};

// What a test puts around a worker's backend (a decorator that stands for another device).
using BackendWrapper =
    std::function<std::unique_ptr<ModelBackend>(std::unique_ptr<ModelBackend> backend)>;

// Worker options.worker_id's whole run over `channels`: a CPU backend (inside `wrap`, if set),
// batches of 16 from `train` (shuffle seed 7), initial weights of seed 5, registration, the
// training loop with `training` (its worker_id, num_workers and start_step are set here), then
// Finish. The first error, if any.
absl::StatusOr<WorkerRun> RunInProcessWorker(const PsClientOptions& options,
                                             std::vector<std::unique_ptr<ShardChannel>> channels,
                                             const ModelSpec& spec, const Dataset& train,
                                             const Dataset& test, TrainingOptions training,
                                             const BackendWrapper& wrap = {});

}  // namespace rubato

#endif  // RUBATO_INPROCESS_TEST_JOBS_H_
