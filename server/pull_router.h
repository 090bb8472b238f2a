// PullRouter: a shard's pulls, from the request (checked by the shard) to the answer. A pull is
// armed (its tensors asked for the version the consistency policy needs) once training has started
// and the policy lets it start; until then, or until its tensors have that version, it is parked
// (server/parked_pulls.h) with its deadline.
//
// Not thread-safe: the shard (server/parameter_shard.h) calls it under its lock, and answers the
// pulls it hands back without that lock (PullState::Answer; ShardTensors::Answer for the values).
#ifndef RUBATO_SERVER_PULL_ROUTER_H_
#define RUBATO_SERVER_PULL_ROUTER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/parked_pulls.h"
#include "server/shard_tensors.h"

namespace rubato {

class PullRouter {
 public:
  // Each outlives the router; `members` and `tensors` are changed only under the lock it is
  // called under. A pull waits at most `max_wait` (the cluster's wait_timeout_ms).
  PullRouter(int shard_id, absl::Duration max_wait, const ConsistencyPolicy* policy,
             const ShardTensors* tensors, const Membership* members)
      : shard_id_(shard_id),
        max_wait_(max_wait),
        policy_(policy),
        tensors_(tensors),
        members_(members) {}

  // Every worker has registered: pulls may be armed from now on (ArmParked arms those waiting).
  void StartTraining() { started_ = true; }

  // Worker `worker`'s pull for `step` of the tensors in slots `which`, waiting until `deadline`
  // at the latest (capped at now + max_wait). Its earlier parked pulls of any of those tensors
  // are superseded: what answers them ABORTED goes to *superseded. Returns the pull if it is
  // complete at once (to answer), null if it was parked; then *sooner (if given) says whether its
  // deadline is earlier than any Expire has to look at (ParkedPulls::Park).
  PullStatePtr Take(int worker, int64_t step, std::vector<int> which, absl::Time deadline,
                    absl::Time now, PullState::Done done,
                    std::vector<std::function<void()>>* superseded, bool* sooner = nullptr);

  // Arms the parked pulls that may start now (training started, the policy allows, after a
  // change of members or clocks); those that completed go to *ready.
  void ArmParked(std::vector<PullStatePtr>* ready);

  // Ends the pulls past their deadline, each with DEADLINE_EXCEEDED naming what it waited for
  // (into *expired); returns the earliest deadline left (InfiniteFuture if none).
  absl::Time Expire(absl::Time now, std::vector<std::pair<PullStatePtr, absl::Status>>* expired);

  // Ends every parked pull (a shutdown); those not over yet go to *ended.
  void EndAll(std::vector<PullStatePtr>* ended) { parked_.EndAll(ended); }
  // Ends worker `worker`'s parked pulls (HeartbeatRequest.end_pulls); those not over yet go to
  // *ended.
  void EndWorker(int worker, std::vector<PullStatePtr>* ended) {
    parked_.EndWorker(worker, ended);
  }

  // Parked pulls not yet over.
  int64_t Pending() const { return parked_.Pending(); }

 private:
  bool MayStart(const PullState& pull) const;
  // Asks each tensor of `pull` for its version; true if that completed it.
  bool Arm(const PullStatePtr& pull);

  const int shard_id_;
  const absl::Duration max_wait_;
  const ConsistencyPolicy* const policy_;
  const ShardTensors* const tensors_;
  const Membership* const members_;
  bool started_ = false;
  ParkedPulls parked_;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PULL_ROUTER_H_
