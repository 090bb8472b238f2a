// AdaptivePolicy (adaptive, adaptive:K): bsp or backup:b, with b chosen every K steps from the
// workers' compute times, so that a user need not know the straggler pattern in advance.
//
// The choice. Backup workers (Chen et al. 2016, "Revisiting Distributed Synchronous SGD") trade
// the gradients of a step for its time: a step that waits for the N - b fastest of N workers takes
// about their slowest compute time, c_(N-b) (the (N-b)-th smallest), and averages N - b
// gradients. With the learning rate scaled for the gradients averaged (as backup:b's is), the
// progress per second is about (N - b) / c_(N-b) gradients, and the policy picks the b that
// maximises it (ChooseBackupWorkers), keeping the current b unless another beats it by 10%, so
// that noise in the figures does not flip the mode every period. The figures: each worker's mean
// compute time per step lately, injected straggler delay included, relayed in its pushes
// (PushRequest.consistency_relay).
//
// The agreement. Shard 0 decides at the first push of step d = K, 2K, ... the b of steps d + 1
// .. d + K (also when nothing changes), before answering it. A worker that pushes step t > d
// pushed step t - 1 first and had shard 0's answer, which carries the newest decision; it relays
// the decision governing t in its pushes of t to every shard. A shard that has not heard of a
// period's decision runs its steps as bsp (common/consistency_plan.h), so no shard applies a step
// with fewer gradients than the decision says; a worker that skipped steps (backup) and missed a
// decision only makes a shard wait for more gradients until another worker's push tells it.
// Decisions are logged by shard 0 and written by worker 0 as `consistency` progress records.
//
// What it does not choose: ssp and async (their pulls and learning rates differ from a step's),
// and work reassignment (async only). Gradients are added as they come (as backup's are), so the
// bsp periods are not bit-identical across arrival orders as bsp's are.
#ifndef RUBATO_SERVER_ADAPTIVE_POLICY_H_
#define RUBATO_SERVER_ADAPTIVE_POLICY_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/consistency_plan.h"
#include "common/tensor_wire.h"
#include "proto/parameter_server.pb.h"
#include "server/step_policy.h"

namespace rubato {

// The b in [0, n) that maximises (n - b) / c_(n-b) over the members' compute times `times_ms`
// (n of them, each > 0), or `current` unless that rate beats current's by more than
// `hysteresis` (0.1: 10%); ties go to the smaller b. Fills `change`'s backup_workers,
// expected_step_ms and gain (the rate's ratio to current's).
void ChooseBackupWorkers(std::vector<double> times_ms, int current, double hysteresis,
                         ConsistencyChange* change);

class AdaptivePolicy final : public StepPolicy {
 public:
  explicit AdaptivePolicy(const ConsistencyConfig& config);

  AdaptivePolicy* adaptive() override { return this; }

  bool StepComplete(int64_t step, int received, bool all_members_in, int members) const override;
  // The schedule's rate scaled for the gradients the step averages (members - b of them), as
  // backup:b's.
  double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                      int64_t staleness) const override;

  // A push's relay: finite compute time in [0, 1e9) ms, and a decision that governs its step
  // and agrees with the one known (INVALID_ARGUMENT / FAILED_PRECONDITION otherwise).
  absl::Status CheckRelay(const WirePush& push, int num_workers) const;
  // An admitted push: keeps its compute time and its decision; at shard 0, decides the next
  // period at the first push of a decision step, from the compute times of `member` (flags).
  void TakeRelay(const WirePush& push, int shard_id, const std::vector<char>& member);
  // The newest decision known (false: none).
  bool Newest(ConsistencyChange* out) const;
  // Every decision known, by step.
  std::vector<ConsistencyChange> Plan() const;
  // A shard restored or rolled back to `step`: forgets the decisions after it (re-decided).
  void RestartAt(int64_t step);

 private:
  void DecideLocked(int64_t step, const std::vector<char>& member)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  ConsistencyPlan plan_ ABSL_GUARDED_BY(mu_);
  std::vector<double> compute_ms_ ABSL_GUARDED_BY(mu_);  // By worker; 0: not heard yet.
  int64_t decided_through_ ABSL_GUARDED_BY(mu_) = 0;     // The last decision step decided.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_ADAPTIVE_POLICY_H_
