// An adaptive batch size: the plan of per-worker batches over a job's steps, and the rule that
// moves the batch towards the measured gradient noise scale.
//
// McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018 (arXiv
// 1812.06162): the critical batch, beyond which more examples per step buy little speed, is about
// the noise scale B_simple = tr(Sigma) / |G|^2, and it grows as the loss falls. Training at a batch
// near it spends neither steps (a batch far below) nor examples (far above). Smith, Kindermans,
// Ying and Le, "Don't Decay the Learning Rate, Increase the Batch Size", 2017 (arXiv 1711.00489),
// grow the batch on a schedule to the same effect. Here the servers measure B_simple
// (server/noise_scale.h) and the rule below follows it:
//
//   every `every_steps` steps: target = clamp(B_simple, min_global_batch, max_global_batch);
//   per-worker batch b' = round(target / workers), kept within the bounds;
//   change only when b' differs from the current batch by a factor of at least kHysteresis, so
//   that the estimate's noise (its relative error, server/noise_scale.h) does not make the batch
//   jitter from one decision to the next.
//
// The learning rate follows the job's scaling rule (LearningRateScheduler::BatchFactor) for each
// step's global batch. A job of E epochs ends when E x the training set's examples have been
// drawn, so its step count follows the plan (TotalSteps).
#ifndef RUBATO_COMMON_BATCH_PLAN_H_
#define RUBATO_COMMON_BATCH_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// A job's plan: the batch of step 0, then each change in step order. Not thread-safe.
class BatchPlan {
 public:
  static constexpr double kHysteresis = 1.5;
  // A plan holds at most this many changes; later decisions keep the batch.
  static constexpr int kMaxChanges = 4096;

  BatchPlan() = default;
  BatchPlan(int workers, int initial_batch);

  int workers() const { return workers_; }
  int initial_batch() const { return initial_batch_; }
  // The per-worker batch of `step`.
  int BatchAt(int64_t step) const;
  // Examples the whole job drew in steps [0, step).
  int64_t ExamplesBefore(int64_t step) const;
  // The steps that draw `examples` examples in all: the first step s with ExamplesBefore(s) >=
  // examples, assuming the plan's last batch from its last change on.
  int64_t TotalSteps(int64_t examples) const;
  const std::vector<BatchChange>& changes() const { return changes_; }

  // Appends a change. InvalidArgument unless its from_step is after the last change's (and in (0,
  // 2^48)), its batch in [1, kMaxBatchSize] and different from the batch it replaces, its
  // global_batch batch x workers, or if the plan is full.
  absl::Status Add(const BatchChange& change);

 private:
  int workers_ = 1;
  int initial_batch_ = 1;
  std::vector<BatchChange> changes_;
};

// The per-worker batch that the rule above picks for a job of `workers` at per-worker batch
// `current`, given B_simple (NaN, infinite or <= 0: no opinion, `current` is kept).
int ProposeBatch(const AdaptiveBatchConfig& config, int workers, int current, double b_simple);

// InvalidArgument naming the field unless max_global_batch is 0 (off), or 1 <= min <= max <=
// kMaxBatchSize x workers, min >= workers (at least one example per worker), and every_steps is 0
// (the default) or >= 2 (a change takes effect two steps after the step it was decided at).
absl::Status ValidateAdaptiveBatch(const AdaptiveBatchConfig& config, int workers);

// every_steps with its default.
int64_t AdaptiveBatchEvery(const AdaptiveBatchConfig& config);

}  // namespace rubato

#endif  // RUBATO_COMMON_BATCH_PLAN_H_
