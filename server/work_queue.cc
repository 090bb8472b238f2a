#include "server/work_queue.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rubato {

namespace {

constexpr int64_t kMaxUnitsPerShare = int64_t{1} << 24;
constexpr int64_t kMaxEpochs = int64_t{1} << 20;

std::string Layout(absl::Span<const int64_t> units, int64_t epochs) {
  return absl::StrCat(epochs, " epoch(s) of [", absl::StrJoin(units, ", "), "] units per share");
}

}  // namespace

WorkQueue::WorkQueue(int num_workers)
    : num_workers_(num_workers), last_request_(num_workers, 0), last_answer_(num_workers) {}

absl::Status WorkQueue::CheckLayout(const TakeWorkRequest& request) {
  if (request.units_per_worker_size() != num_workers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("TakeWork: units_per_worker has ", request.units_per_worker_size(),
                     " entries; the job has ", num_workers_, " workers"));
  }
  for (int w = 0; w < num_workers_; ++w) {
    const int64_t u = request.units_per_worker(w);
    if (u < 1 || u > kMaxUnitsPerShare) {
      return absl::InvalidArgumentError(
          absl::StrCat("TakeWork: units_per_worker[", w, "] must be in [1, 2^24], got ", u));
    }
  }
  if (request.epochs() < 1 || request.epochs() > kMaxEpochs) {
    return absl::InvalidArgumentError(
        absl::StrCat("TakeWork: epochs must be in [1, 2^20], got ", request.epochs()));
  }
  if (units_.empty()) {
    units_.assign(request.units_per_worker().begin(), request.units_per_worker().end());
    epochs_ = request.epochs();
    BeginEpoch();
    return absl::OkStatus();
  }
  if (!std::equal(units_.begin(), units_.end(), request.units_per_worker().begin()) ||
      epochs_ != request.epochs()) {
    return absl::FailedPreconditionError(
        absl::StrCat("TakeWork: job mismatch: worker ", request.worker_id(), " asks for ",
                     Layout(request.units_per_worker(), request.epochs()),
                     ", but the job hands out ", Layout(units_, epochs_)));
  }
  return absl::OkStatus();
}

void WorkQueue::BeginEpoch() {
  front_.assign(num_workers_, 0);
  back_ = units_;
}

absl::StatusOr<TakeWorkResponse> WorkQueue::Take(const TakeWorkRequest& request) {
  const int w = request.worker_id();
  if (w < 0 || w >= num_workers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("TakeWork: worker_id must be in [0, ", num_workers_, "), got ", w));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckLayout(request); !s.ok()) return s;
  if (request.request() > 0 && request.request() == last_request_[w]) return last_answer_[w];
  last_request_[w] = request.request();
  TakeWorkResponse& response = last_answer_[w];
  response.Clear();
  while (epoch_ < epochs_) {
    int owner = w;
    if (front_[w] == back_[w]) {
      // Its own share is done: the share with the most units left.
      for (int o = 0; o < num_workers_; ++o) {
        if (back_[o] - front_[o] > back_[owner] - front_[owner]) owner = o;
      }
    }
    const int64_t left = back_[owner] - front_[owner];
    if (left == 0) {  // Every unit of this epoch is out: the next one.
      ++epoch_;
      if (epoch_ < epochs_) BeginEpoch();
      continue;
    }
    WorkUnit* unit = response.mutable_unit();
    unit->set_epoch(epoch_);
    unit->set_owner(owner);
    if (owner == w) {
      unit->set_index(front_[w]++);
    } else {
      unit->set_index(--back_[owner]);
      unit->set_owner_had(left);
      ++reassigned_;
    }
    unit->set_seq(seq_++);
    return response;
  }
  response.set_done(true);
  return response;
}

int64_t WorkQueue::handed_out() const {
  absl::MutexLock lock(&mu_);
  return seq_;
}

int64_t WorkQueue::reassigned() const {
  absl::MutexLock lock(&mu_);
  return reassigned_;
}

}  // namespace rubato
