#include "server/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"
#include "common/log.h"

namespace rubato {

Membership::Membership(int shard_id, int num_workers, int64_t lease_ms)
    : shard_id_(shard_id),
      lease_ms_(lease_ms),
      workers_(num_workers),
      member_(num_workers, 0),
      clock_(num_workers, 0),
      past_clock_(num_workers, 0) {}

absl::Status Membership::CheckMember(int id) const {
  if (id >= 0 && id < num_workers()) {
    if (workers_[id].registered) return absl::OkStatus();
    if (workers_[id].dropped) {
      return absl::AbortedError(absl::StrCat("worker ", id, " was dropped by shard ", shard_id_,
                                             " after more than ", lease_ms_,
                                             " ms of silence; register again to rejoin"));
    }
    if (restored_step_ >= 0) {
      return absl::AbortedError(absl::StrCat("shard ", shard_id_,
                                             " restarted from its checkpoint of step ",
                                             restored_step_, "; register again to rejoin"));
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat("worker ", id, " is not registered with shard ", shard_id_));
}

absl::Status Membership::CheckMemberAt(int id, int64_t step) const {
  absl::Status s = CheckMember(id);
  if (!absl::IsFailedPrecondition(s) || step <= 0 || restored_step_ >= 0 || id < 0 ||
      id >= num_workers() || workers_[id].dropped) {
    return s;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "worker ", id, " (at step ", step, ") is not registered with shard ", shard_id_,
      ": the shard started afresh after the worker registered with an earlier run of it, with no "
      "checkpoint to restore (no --checkpoint_dir, or none written yet), so the job's state on "
      "it is lost; restart every process of the job (with --checkpoint_dir, a restarted shard "
      "restores its checkpoint instead)"));
}

void Membership::SetMember(int id, bool member) {
  Worker& w = workers_[id];
  if (w.registered != member) members_ += member ? 1 : -1;
  w.registered = member;
  member_[id] = member ? 1 : 0;
  min_clock_valid_ = false;
}

Membership::Worker Membership::Enroll(int id, int32_t batch_size, int64_t steps_per_epoch,
                                      int64_t total_steps, int64_t resume_step, absl::Time now) {
  const Worker before = workers_[id];
  SetMember(id, true);
  Worker& w = workers_[id];
  w.finished = false;
  w.batch_size = batch_size;
  w.steps_per_epoch = steps_per_epoch;
  w.total_steps = total_steps;
  w.last_step = resume_step - 1;
  w.last_seen = now;
  return before;
}

void Membership::Unenroll(int id, const Worker& before) {
  SetMember(id, before.registered);
  workers_[id] = before;
}

absl::Time Membership::ExpireLeases(absl::Time now, std::vector<int>* dropped) {
  const absl::Duration lease = absl::Milliseconds(lease_ms_);
  absl::Time next = absl::InfiniteFuture();
  for (int id = 0; id < num_workers(); ++id) {
    Worker& w = workers_[id];
    if (!w.registered || w.finished) continue;  // A finished worker no longer heartbeats.
    if (now - w.last_seen > lease) {
      SetMember(id, false);
      w.dropped = true;
      dropped->push_back(id);
      RUBATO_LOG(WARNING) << "shard " << shard_id_ << ": dropped worker " << id << ", silent for "
                          << absl::FormatDuration(now - w.last_seen) << " (lease "
                          << absl::FormatDuration(lease) << "); " << members_ << " member(s) left";
    } else {
      next = std::min(next, w.last_seen + lease + absl::Milliseconds(1));
    }
  }
  return next;
}

void Membership::SetTensorCount(int tensors) {
  tensors_ = tensors;
  pushed_.assign(num_workers(), std::vector<int64_t>(tensors, -1));
  std::fill(clock_.begin(), clock_.end(), 0);
  std::fill(past_clock_.begin(), past_clock_.end(), 0);
  min_clock_valid_ = false;
}

void Membership::RestoreClocks(int64_t clock) {
  for (int w = 0; w < num_workers(); ++w) {
    std::fill(pushed_[w].begin(), pushed_[w].end(), clock - 1);
    clock_[w] = clock;
    past_clock_[w] = 0;
  }
  min_clock_valid_ = false;
}

bool Membership::SkipTo(int w, int64_t clock) {
  if (clock <= clock_[w]) return false;
  past_clock_[w] = 0;
  for (int64_t& p : pushed_[w]) {
    p = std::max(p, clock - 1);
    past_clock_[w] += p + 1 > clock ? 1 : 0;
  }
  clock_[w] = clock;
  min_clock_valid_ = false;
  return true;
}

bool Membership::Pushed(int w, int t, int64_t step) {
  int64_t& last = pushed_[w][t];
  if (step <= last) return false;
  const bool was_past = last + 1 > clock_[w];
  last = step;
  if (was_past || step + 1 <= clock_[w]) return false;
  if (++past_clock_[w] < tensors_) return false;
  // Every tensor is past the clock: it advances to the new minimum.
  int64_t clock = kMaxStep;
  for (int64_t p : pushed_[w]) clock = std::min(clock, p + 1);
  clock_[w] = clock;
  past_clock_[w] = 0;
  for (int64_t p : pushed_[w]) past_clock_[w] += p + 1 > clock ? 1 : 0;
  min_clock_valid_ = false;
  return true;
}

int64_t Membership::MinMemberClock() const {
  if (min_clock_valid_) return min_clock_;
  int64_t c = kMaxStep;
  for (int w = 0; w < num_workers(); ++w) {
    if (member_[w]) c = std::min(c, clock_[w]);
  }
  min_clock_ = c;
  min_clock_valid_ = true;
  return c;
}

absl::Status Membership::CheckSameJob(int id, int64_t steps_per_epoch,
                                      int64_t total_steps) const {
  for (int other = 0; other < num_workers(); ++other) {
    const Worker& w = workers_[other];
    if (other == id || !w.registered) continue;
    if (w.steps_per_epoch != steps_per_epoch || w.total_steps != total_steps) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job mismatch: worker ", other, " runs ", w.total_steps, " steps of ", w.steps_per_epoch,
          " per epoch, but worker ", id, " was started for ", total_steps, " steps of ",
          steps_per_epoch, " per epoch"));
    }
  }
  return absl::OkStatus();
}

void Membership::Heard(int id, int64_t step, absl::Time now) {
  Worker& w = workers_[id];
  w.last_seen = now;
  w.last_step = std::max(w.last_step, step);
}

absl::StatusOr<int> Membership::Finish(int id, int64_t steps, absl::Time now) {
  if (id < 0 || id >= num_workers() || !(workers_[id].registered || workers_[id].dropped)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", id, " is not registered with shard ", shard_id_));
  }
  Worker& w = workers_[id];
  if (!w.finished) {
    RUBATO_LOG(INFO) << "shard " << shard_id_ << ": worker " << id << " finished after " << steps
                     << " steps";
  }
  w.finished = true;
  w.last_step = std::max(w.last_step, steps - 1);
  w.last_seen = now;
  int finished = 0;
  for (const Worker& other : workers_) finished += other.finished ? 1 : 0;
  return finished;
}

absl::StatusOr<bool> Membership::JobOver(absl::Time now, absl::Duration idle_timeout,
                                         absl::Time* last_live) const {
  const absl::Duration lease = absl::Milliseconds(lease_ms_);
  int finished = 0;
  int live = 0;
  for (const Worker& w : workers_) {
    if (w.finished) {
      ++finished;
    } else if (w.registered && now - w.last_seen <= lease) {
      ++live;
    }
  }
  if (finished == num_workers()) return true;
  if (live > 0) {
    *last_live = now;
    return false;
  }
  if (finished > 0) return now - *last_live >= lease;
  if (now - *last_live < idle_timeout) return false;
  std::vector<int> never, gone;
  for (int id = 0; id < num_workers(); ++id) {
    const Worker& w = workers_[id];
    (w.registered || w.dropped ? gone : never).push_back(id);
  }
  std::string who;
  if (!never.empty()) absl::StrAppend(&who, "never registered: ", absl::StrJoin(never, ","));
  if (!gone.empty()) {
    absl::StrAppend(&who, who.empty() ? "" : "; ",
                    "registered, then silent: ", absl::StrJoin(gone, ","));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("shard ", shard_id_, ": no worker has been live for ",
                   absl::FormatDuration(now - *last_live), " and none has finished (", who, ")"));
}

}  // namespace rubato
