// AdaptivePolicy (adaptive, adaptive:K): bsp, backup:b or ssp:s, chosen every K steps from the
// workers' compute times, so that a user need not know the straggler pattern in advance.
//
// The choices. Backup workers (Chen et al. 2016, "Revisiting Distributed Synchronous SGD") trade
// the gradients of a step for its time: a step that waits for the N - b fastest of N workers ends
// when the (N - b)-th of them does, and averages N - b gradients. Stale synchronous parallel (Ho et
// al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server")
// trades freshness instead: a worker may compute step t on weights without the last s steps, so
// that a worker slow on one step need not hold the others back, as long as it catches up within s
// steps. Here ssp:s keeps the steps (every step still averages every member's gradient, as bsp's,
// applied in step order) and relaxes only the pull: a pull for step t is answered once steps up
// to t - 1 - s are applied; a worker's gradients for steps past the version wait in the tensor
// (server/tensor_aggregator.h). So a constant straggler gains nothing from it (the others wait
// for it every s steps) and per-step noise is absorbed.
//
// The figures. Each worker relays in its pushes its compute time of the previous step (injected
// straggler delay included) and its mean lately (PushRequest.consistency_relay). At a decision,
// shard 0 replays the period just past (each step's times; a time missing, such as a step a
// backup worker skipped, is that worker's mean) under each choice (ChooseConsistency): bsp and
// ssp:s by simulating the workers' clocks with the pull rule above, backup:b as the sum over steps
// of the (N - b)-th smallest time. It picks the choice with the most gradients averaged per
// second, keeping the current one unless another beats it by 10%, so that noise in the figures does
// not flip the mode every period; ties go to bsp, then to the smaller s, then the smaller b.
//
// The agreement. Shard 0 decides at the first push of step d = K, 2K, ... the choice of steps
// d + 1 .. d + K (also when nothing changes), before answering it. A worker that pushes step t > d
// pushed step t - 1 first and had shard 0's answer, which carries the newest decision; it relays
// the decision governing t in its pushes of t to every shard. A shard that has not heard of a
// period's decision runs its steps as bsp (common/consistency_plan.h): it waits for more gradients,
// or answers pulls with newer weights, than the decision asks, never fewer or older. Decisions are
// logged by shard 0 and written by worker 0 as `consistency` progress records.
//
// What it does not choose: async and the arrival-based ssp (their versions count gradients, not
// steps), and work reassignment (async only). Gradients are added as they come (as backup's are),
// so the bsp periods are not bit-identical across arrival orders as bsp's are.
#ifndef RUBATO_SERVER_ADAPTIVE_POLICY_H_
#define RUBATO_SERVER_ADAPTIVE_POLICY_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/consistency_plan.h"
#include "common/tensor_wire.h"
#include "proto/parameter_server.pb.h"
#include "server/step_policy.h"

namespace rubato {

// The choice among bsp, backup:b (b in [1, n)) and ssp:s (s in [1, max_staleness]) with the most
// gradients averaged per second over a window of steps whose compute times are `steps_ms` (a row
// per step, each with the n members' times, every one > 0), or `current`'s choice (its
// backup_workers and staleness) unless that beats current's by more than `hysteresis` (0.1:
// 10%). Fills `change`'s backup_workers, staleness, expected_step_ms (the window's time per step
// under the choice) and gain (its rate's ratio to current's).
void ChooseConsistency(const std::vector<std::vector<double>>& steps_ms,
                       const ConsistencyChange& current, int max_staleness, double hysteresis,
                       ConsistencyChange* change);

class AdaptivePolicy final : public StepPolicy {
 public:
  explicit AdaptivePolicy(const ConsistencyConfig& config);

  AdaptivePolicy* adaptive() override { return this; }

  bool StepComplete(int64_t step, int received, bool all_members_in, int members) const override;
  // step - s in an ssp:s period (else step); the job's final weights (step >= its total steps)
  // whole.
  int64_t NeededVersion(int64_t step) const override;
  // The job's steps (the workers' total_steps; 0: unknown), once training starts.
  void SetTotalSteps(int64_t steps);
  int MaxLead() const override { return kMaxAdaptiveStaleness; }
  // The schedule's rate scaled for the gradients the step averages (members - b of them), as
  // backup:b's.
  double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                      int64_t staleness) const override;

  // A push's relay: finite compute times in [0, 1e9) ms, and a decision that governs its step
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
  // Shard 0: each recent step's compute time by worker (0: not heard), for steps after the last
  // decision's window.
  std::map<int64_t, std::vector<double>> step_ms_ ABSL_GUARDED_BY(mu_);
  int64_t decided_through_ ABSL_GUARDED_BY(mu_) = 0;     // The last decision step decided.
  int64_t total_steps_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_ADAPTIVE_POLICY_H_
