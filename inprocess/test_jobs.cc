#include "inprocess/test_jobs.h"

#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"

namespace rubato {
namespace {

constexpr int kDim = 8;
constexpr int kClasses = 3;

}  // namespace

Dataset SyntheticDataset(int n, uint64_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::mt19937 wrng(99);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> w(kDim * kClasses);
  for (float& v : w) v = g(wrng);
  Dataset d;
  d.size = n;
  d.dim = kDim;
  d.num_classes = kClasses;
  d.features.resize(static_cast<size_t>(n) * kDim);
  d.labels.resize(n);
  for (int i = 0; i < n; ++i) {
    float best = -1e30f;
    for (int k = 0; k < kDim; ++k) d.features[i * kDim + k] = u(rng);
    for (int c = 0; c < kClasses; ++c) {
      float s = 0;
      for (int k = 0; k < kDim; ++k) s += w[k * kClasses + c] * (d.features[i * kDim + k] - 0.5f);
      if (s > best) {
        best = s;
        d.labels[i] = c;
      }
    }
  }
  return d;
}

PsClientOptions InProcessClientOptions(const ModelSpec& spec, const ClusterSpec& cluster,
                                       int worker, int64_t steps) {
  PsClientOptions options;
  options.worker_id = worker;
  options.num_workers = cluster.num_workers();
  options.consistency = cluster.consistency();
  options.steps_per_epoch = 16;
  options.total_steps = steps;
  for (const ParamSpec& p : ModelParamSpecs(spec)) {
    TensorSpec t;
    t.set_name(p.name);
    for (int64_t d : p.shape) t.add_shape(d);
    options.model.push_back(t);
  }
  return options;
}

absl::StatusOr<WorkerRun> RunInProcessWorker(const PsClientOptions& options,
                                             std::vector<std::unique_ptr<ShardChannel>> channels,
                                             const ModelSpec& spec, const Dataset& train,
                                             const Dataset& test, TrainingOptions training,
                                             const BackendWrapper& wrap) {
  ASSIGN_OR_RETURN(std::unique_ptr<PsClient> client,
                   CreatePsClient(options, std::move(channels)));
  ASSIGN_OR_RETURN(std::unique_ptr<ModelBackend> backend, CreateCpuBackend(spec, 1));
  if (wrap) backend = wrap(std::move(backend));
  ASSIGN_OR_RETURN(ShardedBatcher batcher,
                   ShardedBatcher::Create(&train, options.worker_id, options.num_workers, 16, 7));
  WorkerRun run;
  run.params = InitModelParams(spec, 5);
  ASSIGN_OR_RETURN(training.start_step, client->Register(run.params, 16, 0));
  training.worker_id = options.worker_id;
  training.num_workers = options.num_workers;
  std::ostringstream progress;
  ASSIGN_OR_RETURN(run.result, RunTraining(training, spec, client.get(), backend.get(), &batcher,
                                           test, &run.params, &progress));
  run.progress = progress.str();
  (void)client->Finish(run.result.steps);
  return run;
}

}  // namespace rubato
