// TrainingWorkload: the simulator's training level (sim/README.md). Every simulated worker trains
// the real model on its real shard of the data: it draws its batches from a ShardedBatcher as
// rubato_worker does, computes real gradients on a ModelBackend (one, shared: the simulation runs
// on one thread), and writes the progress records rubato_worker writes (start, step, eval, done;
// proto/progress.proto), with simulated time in their "t", so that the launcher's summary and the
// experiment reports read a simulated run as they read a real one.
//
// What a step costs in simulated time is not what it costs the simulation: every step computes
// for `compute_time` and every evaluation takes `eval_time` (calibrated from a real worker's,
// sim/sim_main.cc), whatever the host running the simulation took.
#ifndef RUBATO_SIM_TRAINING_WORKLOAD_H_
#define RUBATO_SIM_TRAINING_WORKLOAD_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sim/workload.h"
#include "worker/data/dataset.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/worker_records.h"

namespace rubato {

struct TrainingWorkloadOptions {
  ModelSpec spec;
  std::string model_text;           // As --model spells it (for the start record).
  const Dataset* train = nullptr;   // Not owned; must outlive the workload.
  const Dataset* test = nullptr;    // Not owned; may be empty (no evaluation).
  ModelBackend* backend = nullptr;  // Not owned.
  int num_workers = 1;
  int batch_size = 64;  // Per worker.
  uint64_t seed = 1;    // The weights' and the data order's, as rubato_worker's --seed.
  JobLength job;
  int64_t eval_every = 0;  // Steps; 0: only at the end.
  int64_t log_every = 20;
  // Which workers evaluate, by rubato_worker's rule (WorkerEvaluates, worker/worker_records.h).
  ConsistencyMode consistency = BSP;
  bool eval_all_workers = false;
  std::string mode;  // FormatConsistency's spelling, for the start record.
  absl::Duration compute_time = absl::Milliseconds(1);  // One step's forward and backward pass.
  absl::Duration eval_time = absl::ZeroDuration();      // One evaluation of the test set.
  // One per worker (not owned): where its records go.
  std::vector<std::ostream*> progress;
};

class TrainingWorkload final : public Workload {
 public:
  // INVALID_ARGUMENT naming the option: no data or backend, a model that does not fit the data,
  // a stream per worker missing, a negative time.
  static absl::StatusOr<std::unique_ptr<TrainingWorkload>> Create(TrainingWorkloadOptions options);

  std::vector<TensorSpec> Model() const override;
  std::vector<std::vector<float>> InitialParams() const override;
  absl::StatusOr<absl::Duration> Compute(int worker, int64_t step,
                                         absl::Span<const std::vector<float>> params,
                                         std::vector<std::vector<float>>* grads) override;
  absl::StatusOr<absl::Duration> StepDone(const SimStep& step,
                                          absl::Span<const std::vector<float>> params) override;
  absl::StatusOr<absl::Duration> Finished(int worker, int64_t steps, int64_t computed,
                                          int64_t skipped, absl::Duration at,
                                          absl::Span<const std::vector<float>> params) override;

  // Writes every worker's start record (at simulated time 0).
  void Start();

  bool evaluates(int worker) const {
    return options_.test != nullptr && options_.test->size > 0 &&
           WorkerEvaluates(worker, options_.consistency, options_.eval_all_workers);
  }

 private:
  // A log interval's sums, as TrainingLoop keeps them.
  struct Interval : StepSums {
    absl::Duration start;
  };
  struct Worker {
    std::unique_ptr<ShardedBatcher> batcher;
    Interval interval;
    float loss = 0;  // Of the step computed last.
    double final_loss = 0;
    int64_t applied_examples = -1;
  };

  explicit TrainingWorkload(TrainingWorkloadOptions options);
  absl::StatusOr<EvalResult> Evaluate(int worker, int64_t step, absl::Duration at,
                                      int64_t applied_examples,
                                      absl::Span<const std::vector<float>> params);

  // The test set's result for `params`: an evaluation is a function of the weights alone (one
  // deterministic backend, one test set), and workers that pulled the same weights (backup, the
  // rings, adaptive: every worker evaluates) would compute it again and again. So the newest
  // results are kept with the weights they were computed on, matched by fingerprint and then
  // compared element by element; simulated time is spent as before.
  absl::StatusOr<EvalResult> EvaluateWeights(absl::Span<const std::vector<float>> params);

  const TrainingWorkloadOptions options_;
  const std::vector<ParamSpec> specs_;
  std::vector<Worker> workers_;
  std::vector<float> x_;
  std::vector<int32_t> y_;
  struct Evaluated {
    uint64_t fingerprint = 0;
    std::vector<std::vector<float>> params;
    EvalResult result;
  };
  std::deque<Evaluated> evaluated_;  // Newest first; at most kEvaluationsKept.
  static constexpr size_t kEvaluationsKept = 8;
  int64_t evaluations_ = 0;
  int64_t evaluations_reused_ = 0;

 public:
  // Evaluations asked for, and of those answered from the kept results.
  int64_t evaluations() const { return evaluations_; }
  int64_t evaluations_reused() const { return evaluations_reused_; }
};

}  // namespace rubato

#endif  // RUBATO_SIM_TRAINING_WORKLOAD_H_
