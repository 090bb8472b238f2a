// StepPolicy: the modes that gather gradients into steps, one update per step (bsp, backup). A
// pull for step t waits for version t; versions count job steps; the noise scale is measured;
// failures are recovered by rolling every shard back to one checkpoint.
#ifndef RUBATO_SERVER_STEP_POLICY_H_
#define RUBATO_SERVER_STEP_POLICY_H_

#include "server/consistency_policy.h"

namespace rubato {

class StepPolicy : public ConsistencyPolicy {
 public:
  bool Synchronous() const override { return true; }
  double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                      int64_t staleness) const override {
    return schedule.At(version);
  }
  // The sum of the members' batches (every worker's gradient, averaged into one update).
  int64_t UpdateBatch(const Membership& members) const override;
  int64_t NeededVersion(int64_t step) const override { return step; }
  int64_t ResumeStep(int64_t min_version, int64_t own_clock) const override { return min_version; }
  int64_t VersionsPerStep(int num_workers) const override { return 1; }
  bool RestoredVersionConsistent(int64_t version, int64_t step) const override {
    return version == step;
  }
  bool RollsBack() const override { return true; }

 protected:
  using ConsistencyPolicy::ConsistencyPolicy;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_STEP_POLICY_H_
