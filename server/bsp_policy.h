// BspPolicy (bsp): bulk synchronous parallel. A step of a tensor is applied once every member's
// gradient is in, summed in worker-id order whatever the arrival order (bit-exact), so early
// arrivals are held; large tensors are pushed in parts.
#ifndef RUBATO_SERVER_BSP_POLICY_H_
#define RUBATO_SERVER_BSP_POLICY_H_

#include "server/step_policy.h"

namespace rubato {

class BspPolicy final : public StepPolicy {
 public:
  explicit BspPolicy(const ConsistencyConfig& config) : StepPolicy(config) {}

  bool SumsInWorkerOrder() const override { return true; }
  bool StepComplete(int64_t /*step*/, int received, bool all_members_in,
                    int members) const override {
    return received > 0 && all_members_in;
  }
  // budget / (2 calls x workers), at least 1 MiB and at most 8 MiB of floats, in multiples of
  // 1024 elements.
  int64_t PartElements(int num_workers, int64_t push_budget_bytes) const override;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_BSP_POLICY_H_
