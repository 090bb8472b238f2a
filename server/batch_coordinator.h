// BatchCoordinator: a shard's side of an adaptive batch (ClusterSpec.adaptive_batch, bsp only;
// common/batch_plan.h). Every shard decides the same changes at the same steps from the same
// relayed figures: each worker relays the job's noise-scale sums in its pushes; every `every_steps`
// steps d the coordinator keeps the relays of step d, and the first push of a later step decides
// from the lowest-numbered worker's relay. A change takes effect at d + 2 (workers learn it from
// the push responses of d + 1). It also checks each push's batch against the plan (or, without
// an adaptive batch, against the worker's registered batch).
//
// Not thread-safe: the shard holds it under its lock; view() is published for readers without it.
#ifndef RUBATO_SERVER_BATCH_COORDINATOR_H_
#define RUBATO_SERVER_BATCH_COORDINATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "common/batch_plan.h"
#include "common/lr_schedule.h"
#include "common/tensor_wire.h"
#include "proto/cluster.pb.h"
#include "server/membership.h"
#include "server/noise_scale.h"

namespace rubato {

class BatchCoordinator {
 public:
  // `noise` (may be null) learns each change's batch, to measure steps at their own batch.
  BatchCoordinator(int shard_id, const AdaptiveBatchConfig& config, NoiseScaleMonitor* noise);

  bool enabled() const { return config_.max_global_batch() > 0; }

  // A worker registering with `batch`: under an adaptive batch every worker starts from the same
  // batch (FAILED_PRECONDITION naming both otherwise).
  absl::Status CheckRegistration(int worker, int batch, const Membership& members) const;
  // Training starts: the plan begins at every worker's `initial_batch`.
  void Start(int workers, int initial_batch);

  // A push's relay must be finite and its step in range (INVALID_ARGUMENT), and its batch the
  // plan's for its step, or the worker's `registered_batch` without a plan (FAILED_PRECONDITION).
  absl::Status CheckPush(const WirePush& request, int registered_batch) const;
  // An admitted push: keeps its relay if it is for a decision step, and decides each earlier
  // decision step the first time a later step's push arrives, at the schedule's rate.
  void TakeRelay(const WirePush& request, const LearningRateScheduler& schedule);

  // The plan; null before training starts or without an adaptive batch.
  const BatchPlan* plan() const { return plan_.has_value() ? &*plan_ : nullptr; }
  // The plan published for readers without the lock (std::atomic_load it; null without one).
  const std::shared_ptr<const BatchPlan>* view() const { return &view_; }

 private:
  void Decide(const LearningRateScheduler& schedule);
  void Publish();

  // Constant after construction.
  const int shard_id_;
  const AdaptiveBatchConfig config_;
  NoiseScaleMonitor* const noise_;

  std::optional<BatchPlan> plan_;
  std::shared_ptr<const BatchPlan> view_;
  int64_t relay_step_ = -1;  // The decision step being collected.
  int64_t decided_through_ = 0;
  std::map<int, NoiseScaleRelay> relays_;  // By worker, for relay_step_.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_BATCH_COORDINATOR_H_
