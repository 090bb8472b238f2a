// Membership: who is in the job on one shard, their leases, and their clocks. Not thread-safe: the
// shard (server/parameter_shard.h) holds it under its lock.
//
// A member is a worker that registered and has not been dropped: it counts in barriers. A member
// silent for longer than the lease is dropped; registering again makes it a member again. A
// worker that said it finished no longer heartbeats and is never dropped for its silence.
//
// Clocks (ssp): a worker's clock is the number of steps it has pushed to every tensor of the
// shard, min over tensors of (last step pushed + 1). It is kept incrementally: per worker, the
// clock and how many tensors are past it; the minimum is taken again only when all are, so a push
// costs O(1) and a clock tick O(tensors), instead of O(tensors x workers) per waiting pull.
#ifndef RUBATO_SERVER_MEMBERSHIP_H_
#define RUBATO_SERVER_MEMBERSHIP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rubato {

class Membership {
 public:
  struct Worker {
    bool registered = false;  // A member.
    bool dropped = false;     // Was a member, then silent for longer than the lease.
    bool finished = false;    // Said it has finished (Finish); no longer heartbeats.
    int32_t batch_size = 0;
    int64_t steps_per_epoch = 0;
    int64_t total_steps = 0;
    int64_t last_step = -1;
    int64_t pulled_step = -1;  // Highest step this worker has pulled (async, ssp: pushes up to it).
    absl::Time last_seen;
  };

  Membership(int shard_id, int num_workers, int64_t lease_ms);

  int num_workers() const { return static_cast<int>(workers_.size()); }
  Worker& worker(int id) { return workers_[id]; }
  const Worker& worker(int id) const { return workers_[id]; }
  int members() const { return members_; }
  // member()[w] != 0 for each member.
  const std::vector<char>& member() const { return member_; }

  // OK for a member; ABORTED for a dropped worker, and for any worker not registered with a shard
  // restored from a checkpoint (it registered with the shard's previous process);
  // FAILED_PRECONDITION for an unknown one.
  absl::Status CheckMember(int id) const;
  // CheckMember for a call of worker `id` at `step`. A worker unknown here that calls past step 0
  // registered with an earlier run of this shard, which has started afresh (no checkpoint to
  // restore): FAILED_PRECONDITION saying so, and what to do.
  absl::Status CheckMemberAt(int id, int64_t step) const;
  void SetMember(int id, bool member);
  // Worker `id` registers (again): a member, not finished, with this batch and job, going on from
  // `resume_step`, seen at `now`. Returns what it was before, for Unenroll.
  Worker Enroll(int id, int32_t batch_size, int64_t steps_per_epoch, int64_t total_steps,
                int64_t resume_step, absl::Time now);
  // Puts worker `id` back as it was before Enroll (a registration refused after all).
  void Unenroll(int id, const Worker& before);

  // Drops members silent for longer than the lease (into *dropped) and returns the earliest time
  // another member's lease can run out. `shard_id` names the shard in the log.
  absl::Time ExpireLeases(absl::Time now, std::vector<int>* dropped);

  // Clocks, over `tensors` tensors (set once the model is known).
  void SetTensorCount(int tensors);
  // Worker `w` pushed `step` to tensor `t`; true if its clock advanced.
  bool Pushed(int w, int t, int64_t step);
  int64_t Clock(int w) const { return clock_[w]; }
  // Every worker has pushed steps 0 .. clock-1 to every tensor (a restored checkpoint).
  void RestoreClocks(int64_t clock);
  // Worker `w` goes on from step `clock` and will not push the steps before it (it computed them
  // before this shard was restored, or is a restarted worker that starts mid-job): they count as
  // pushed. Nothing changes if its clock is there already. True if the clock advanced.
  bool SkipTo(int w, int64_t clock);
  // This shard was restored from its checkpoint of `step` (CheckMember's answer, stats).
  void SetRestored(int64_t step) { restored_step_ = step; }
  int64_t restored_step() const { return restored_step_; }  // -1: started afresh.
  // The smallest clock among members (kMaxStep with none). Kept until a clock or the membership
  // changes, so that ssp asking it for each parked pull costs one pass over the workers, not one
  // per pull.
  int64_t MinMemberClock() const;

  // FAILED_PRECONDITION unless every other registered worker runs the same job (steps per epoch,
  // total steps) as worker `id` says it was started for.
  absl::Status CheckSameJob(int id, int64_t steps_per_epoch, int64_t total_steps) const;
  // Worker `id` was heard from at `now`, at `step` (a heartbeat).
  void Heard(int id, int64_t step, absl::Time now);
  // Worker `id` (registered, or dropped) has finished after `steps` steps: its lease no longer
  // runs. FAILED_PRECONDITION for a worker that never registered. The number of workers finished.
  absl::StatusOr<int> Finish(int id, int64_t steps, absl::Time now);
  // Whether the job is over for this shard (ParameterShard::JobFinished says when), given the
  // lease and how long to wait with no worker live and none finished; `last_live` is when a
  // worker was last live, updated here. DEADLINE_EXCEEDED naming who never registered and who
  // went silent once idle_timeout has passed that way.
  absl::StatusOr<bool> JobOver(absl::Time now, absl::Duration idle_timeout,
                               absl::Time* last_live) const;

 private:
  const int shard_id_;
  const int64_t lease_ms_;
  std::vector<Worker> workers_;
  std::vector<char> member_;
  int members_ = 0;
  int tensors_ = 0;
  std::vector<std::vector<int64_t>> pushed_;  // (workers, tensors) last step pushed
  std::vector<int64_t> clock_;                // (workers)
  std::vector<int> past_clock_;               // (workers) tensors with pushed + 1 > clock
  int64_t restored_step_ = -1;
  mutable int64_t min_clock_ = 0;  // MinMemberClock(), while min_clock_valid_.
  mutable bool min_clock_valid_ = false;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_MEMBERSHIP_H_
