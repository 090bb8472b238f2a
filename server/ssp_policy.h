// SspPolicy (ssp:s): stale synchronous parallel (Ho et al. 2013). Gradients are applied on arrival
// as under async; the bound is enforced at the pull: a worker's pull for step c starts only once
// every member's clock on this shard (steps pushed to all its tensors) is at least c - s.
#ifndef RUBATO_SERVER_SSP_POLICY_H_
#define RUBATO_SERVER_SSP_POLICY_H_

#include <string>

#include "server/arrival_policy.h"

namespace rubato {

class SspPolicy final : public ArrivalPolicy {
 public:
  explicit SspPolicy(const ConsistencyConfig& config) : ArrivalPolicy(config) {}

  // The smallest clock every member must have reached for a pull of `step`.
  int64_t NeededClock(int64_t step) const { return step - config().staleness(); }

  bool MayStartPull(int64_t step, const Membership& members) const override {
    return members.MinMemberClock() >= NeededClock(step);
  }
  std::string DescribeBlockedPull(int64_t step, const Membership& members) const override;
  bool ClockReleasesPulls() const override { return true; }
};

}  // namespace rubato

#endif  // RUBATO_SERVER_SSP_POLICY_H_
