// BackupPolicy (backup:b): a step of a tensor is applied as soon as members - b gradients are in;
// gradients for that step that arrive later are dropped and counted (Chen et al. 2016, "Revisiting
// Distributed Synchronous SGD"). The contributors depend on arrival order, so gradients are added
// as they come.
#ifndef RUBATO_SERVER_BACKUP_POLICY_H_
#define RUBATO_SERVER_BACKUP_POLICY_H_

#include <algorithm>

#include "server/step_policy.h"

namespace rubato {

class BackupPolicy final : public StepPolicy {
 public:
  explicit BackupPolicy(const ConsistencyConfig& config) : StepPolicy(config) {}

  bool StepComplete(int64_t /*step*/, int received, bool all_members_in,
                    int members) const override {
    if (received == 0) return false;
    return all_members_in || received >= std::max(1, members - config().backup_workers());
  }
  // The members - b gradients that make a step: its update averages that many batches.
  int64_t UpdateBatch(const Membership& members) const override {
    const int n = std::max(1, members.num_workers());
    const int contributors = std::max(1, n - config().backup_workers());
    return StepPolicy::UpdateBatch(members) * contributors / n;
  }
};

}  // namespace rubato

#endif  // RUBATO_SERVER_BACKUP_POLICY_H_
