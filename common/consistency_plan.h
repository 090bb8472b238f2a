// ConsistencyPlan: adaptive consistency's decisions (ConsistencyChange, ConsistencyConfig ADAPTIVE)
// by the period they govern. With K = adaptive_every_steps, shard 0 decides at step d = K, 2K, ...
// how the steps d + 1 .. d + K run (server/adaptive_policy.h): bsp, backup:b (b backup workers)
// or ssp:s (a pull for step t needs steps up to t - 1 - s applied, so that a worker may run up to
// s steps ahead of the slowest; every step still averages every member's gradient). Steps 0 .. K,
// and any period whose decision a shard or worker does not know, run as bsp (b = s = 0), so that a
// step is never applied with fewer gradients, nor a pull answered with older weights, than its
// decision says. Shards learn decisions from shard 0
// (its own) or from the workers' pushes (ConsistencyRelay), workers from push responses.
//
// Not thread-safe.
#ifndef RUBATO_COMMON_CONSISTENCY_PLAN_H_
#define RUBATO_COMMON_CONSISTENCY_PLAN_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// The largest s of an ssp:s decision: how far a worker may run ahead of a tensor's version, and so
// how many of its gradients a tensor may hold for steps not yet due.
inline constexpr int kMaxAdaptiveStaleness = 3;

// "bsp", "backup:B" or "ssp:S" for a decision (null: bsp).
std::string DescribeDecision(const ConsistencyChange* change);

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
  // Its staleness s (0 when unknown).
  int StalenessAt(int64_t step) const;
  // The latest decision known, or null.
  const ConsistencyChange* Newest() const;

  // OK when `change` could be a decision of a job of `num_workers`: its from_step a period's
  // first step, its b in [0, num_workers), its s in [0, kMaxAdaptiveStaleness] and not both
  // non-zero (INVALID_ARGUMENT), and the same b and s as a decision already known for that period
  // (FAILED_PRECONDITION, naming both).
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
