// ConsistencyPolicy: what each consistency mode (ClusterSpec.consistency) decides, in one place,
// as pure functions of counts and clocks. The shard (server/parameter_shard.h) and each tensor
// (server/tensor_aggregator.h) ask it; they hold the state.
//
//   bsp       A step of a tensor is complete when every member's gradient is in; the sum is taken
//             in worker-id order. A pull for step t waits for version t.
//   backup:b  Complete once members - b gradients are in (Chen et al. 2016, "Revisiting
//             Distributed Synchronous SGD"); later ones for that step are dropped.
//   async     Every gradient is applied alone on arrival (Dean et al. 2012, Downpour); pulls never
//             wait; with staleness_aware_lr the rate is divided by the staleness tau > 1 (Zhang et
//             al. 2016).
//   ssp:s     Applied on arrival as async; a pull for step c waits until every member's clock is
//             at least c - s (Ho et al. 2013).
// In async and ssp the schedule's update count is version / members, so that the rate follows the
// job's steps rather than the number of pushes.
#ifndef RUBATO_SERVER_CONSISTENCY_POLICY_H_
#define RUBATO_SERVER_CONSISTENCY_POLICY_H_

#include <algorithm>
#include <cstdint>

#include "common/lr_schedule.h"
#include "proto/cluster.pb.h"

namespace rubato {

class ConsistencyPolicy {
 public:
  explicit ConsistencyPolicy(const ConsistencyConfig& config) : config_(config) {}

  ConsistencyMode mode() const { return config_.mode(); }
  const ConsistencyConfig& config() const { return config_; }

  // Gradients are gathered into steps (bsp, backup) rather than applied on arrival.
  bool Synchronous() const { return mode() == BSP || mode() == BACKUP; }
  // The sum is taken in worker-id order, holding early arrivals (bsp).
  bool SumsInWorkerOrder() const { return mode() == BSP; }

  // Whether a step with `received` gradients, `all_members_in` telling whether every member's is
  // among them, may be applied (bsp, backup).
  bool StepComplete(int received, bool all_members_in, int members) const {
    if (received == 0) return false;
    if (all_members_in) return true;
    return mode() == BACKUP && received >= std::max(1, members - config_.backup_workers());
  }

  // The version a pull for `step` needs (bsp, backup); async and ssp take whatever is there.
  int64_t NeededVersion(int64_t step) const { return Synchronous() ? step : 0; }

  // ssp: the smallest clock every member must have reached for a pull of `step`.
  int64_t SspNeededClock(int64_t step) const { return step - config_.staleness(); }

  // The rate of an update taking a tensor from `version` to version + 1.
  double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                      int64_t staleness) const {
    if (Synchronous()) return schedule.At(version);
    double lr = schedule.At(version / std::max(1, members));
    if (config_.staleness_aware_lr() && staleness > 1) lr /= static_cast<double>(staleness);
    return lr;
  }

 private:
  const ConsistencyConfig config_;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_CONSISTENCY_POLICY_H_
