// ArrivalPolicy: the modes that apply every gradient alone on arrival (async, ssp). Pulls take
// whatever version is there; a version counts every worker's updates, so the schedule's update
// count is version / members and a checkpoint's step is version / workers; a worker may not push a
// step it has not pulled; with staleness_aware_lr the rate is divided by the staleness tau > 1
// (Zhang et al. 2016). A restored shard goes on and each worker rejoins at its own clock.
#ifndef RUBATO_SERVER_ARRIVAL_POLICY_H_
#define RUBATO_SERVER_ARRIVAL_POLICY_H_

#include "server/consistency_policy.h"

namespace rubato {

class ArrivalPolicy : public ConsistencyPolicy {
 public:
  bool Synchronous() const override { return false; }
  bool StepComplete(int64_t /*step*/, int received, bool all_members_in,
                    int members) const override {
    return false;  // Nothing is gathered.
  }
  double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                      int64_t staleness) const override;
  // One worker's batch (the workers' mean, rounded, if theirs differ): each gradient is applied
  // alone, so scaling the rate for the sum of the batches would take a step sized for a batch
  // several times larger than the one that computed the gradient.
  int64_t UpdateBatch(const Membership& members) const override;
  int64_t NeededVersion(int64_t step) const override { return 0; }
  bool KeepsClocks() const override { return true; }
  absl::Status CheckPushStep(int worker, int64_t step, int64_t pulled, int shard) const override;
  // Its own clock: versions count every worker's updates, so a rejoined worker that took the
  // version would skip steps it never computed.
  int64_t ResumeStep(int64_t min_version, int64_t own_clock) const override { return own_clock; }
  int64_t VersionsPerStep(int num_workers) const override { return num_workers; }
  bool RestoredVersionConsistent(int64_t version, int64_t step) const override {
    return version >= 0;
  }
  bool RollsBack() const override { return false; }

 protected:
  using ConsistencyPolicy::ConsistencyPolicy;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_ARRIVAL_POLICY_H_
