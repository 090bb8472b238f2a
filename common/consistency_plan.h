// ConsistencyPlan: adaptive consistency's decisions (ConsistencyChange, ConsistencyConfig ADAPTIVE)
// by the period they govern. With K = adaptive_every_steps, shard 0 decides at step d = K, 2K, ...
// the backup workers b of the steps d + 1 .. d + K (server/adaptive_policy.h); steps 0 .. K, and
// any period whose decision a shard or worker does not know, run as bsp (b = 0), so that a step is
// never applied with fewer gradients than its decision says. Shards learn decisions from shard 0
// (its own) or from the workers' pushes (ConsistencyRelay), workers from push responses.
//
// Not thread-safe.
#ifndef RUBATO_COMMON_CONSISTENCY_PLAN_H_
#define RUBATO_COMMON_CONSISTENCY_PLAN_H_

#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

class ConsistencyPlan {
 public:
  explicit ConsistencyPlan(int every_steps) : every_(every_steps < 1 ? 1 : every_steps) {}

  int every_steps() const { return every_; }
  // The first step of the period `step` lies in: its decision's from_step; 0 for steps 0 .. K,
  // which no decision governs.
  int64_t PeriodStart(int64_t step) const {
    return step <= every_ ? 0 : (step - 1) / every_ * every_ + 1;
  }
  // Whether shard 0 decides the next period at `step`'s first push.
  bool DecidesAt(int64_t step) const { return step >= every_ && step % every_ == 0; }

  // The decision governing `step`, or null (bsp).
  const ConsistencyChange* At(int64_t step) const;
  // Its backup workers (0 when unknown).
  int BackupAt(int64_t step) const;
  // The latest decision known, or null.
  const ConsistencyChange* Newest() const;

  // OK when `change` could be a decision of a job of `num_workers`: its from_step a period's
  // first step (INVALID_ARGUMENT) and its b in [0, num_workers) (INVALID_ARGUMENT), and the same b
  // as a decision already known for that period (FAILED_PRECONDITION, naming both).
  absl::Status Check(const ConsistencyChange& change, int num_workers) const;
  // Check, then keeps it; *added (may be null) tells whether it was new.
  absl::Status Add(const ConsistencyChange& change, int num_workers, bool* added = nullptr);
  // Forgets the decisions of periods starting after `step` (a roll-back to `step`).
  void DropAfter(int64_t step);

  size_t size() const { return changes_.size(); }
  const std::map<int64_t, ConsistencyChange>& changes() const { return changes_; }

 private:
  int every_;
  std::map<int64_t, ConsistencyChange> changes_;  // By from_step.
};

}  // namespace rubato

#endif  // RUBATO_COMMON_CONSISTENCY_PLAN_H_
