#include "worker/ring/partial_allreduce.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace rubato {

absl::StatusOr<int> PartialQuorum(int size, const std::string& kind) {
  if (kind == "majority") return (size + 1) / 2;
  if (kind == "solo") return 1;
  return absl::InvalidArgumentError(
      absl::StrCat("partial all-reduce: '", kind,
                   "' is not majority or solo (allreduce:majority, allreduce:solo)"));
}

PartialAllReduce::PartialAllReduce(const PartialAllReduceOptions& options, RingLink* link,
                                   Apply apply)
    : options_(options),
      link_(link),
      apply_(std::move(apply)),
      send_(options.elements + 1, 0.0f),
      poll_(1, 0.0f),
      pending_(options.elements, 0.0f) {
  thread_ = std::thread([this] { Run(); });
}

PartialAllReduce::~PartialAllReduce() { Stop(); }

void PartialAllReduce::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int64_t PartialAllReduce::rounds_done() const {
  absl::MutexLock lock(&mu_);
  return rounds_done_;
}

bool PartialAllReduce::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

PartialAllReduce::Counts PartialAllReduce::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void PartialAllReduce::Run() {
  absl::Status status = RunRounds();
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
  counts_.dropped = pending_count_;
  finished_ = true;
}

absl::StatusOr<bool> PartialAllReduce::AwaitReadyOrIncoming(absl::Time deadline,
                                                            bool reported_ready) {
  if (options_.size == 1) {  // No ring: only this rank's gradient can start a round.
    absl::MutexLock lock(&mu_);
    auto ready = [&]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || pending_count_ > 0; };
    const bool go = mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
    if (stopping_) return absl::CancelledError("the partial all-reduce was stopped");
    return go;
  }
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::CancelledError("the partial all-reduce was stopped");
      if (pending_count_ > 0 && !reported_ready) return true;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    ASSIGN_OR_RETURN(const bool incoming, link_->Incoming(std::min(deadline, now + options_.poll)));
    if (incoming) return true;
  }
}

absl::Status PartialAllReduce::Activate(int64_t round) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  bool reported_ready = false;
  int last_count = 0;
  for (;;) {
    ASSIGN_OR_RETURN(const bool go, AwaitReadyOrIncoming(deadline, reported_ready));
    if (!go) {
      return absl::DeadlineExceededError(absl::StrCat(
          "partial all-reduce rank ", options_.rank, ": round ", round, " waited ",
          absl::FormatDuration(options_.timeout), " for ", options_.quorum,
          " rank(s) to have a gradient ready; ", last_count, " had at the last count"));
    }
    if (options_.quorum <= 1) return absl::OkStatus();
    {
      absl::MutexLock lock(&mu_);
      reported_ready = pending_count_ > 0;
      ++counts_.polls;
    }
    poll_[0] = reported_ready ? 1.0f : 0.0f;
    RETURN_IF_ERROR(RingAllReduceSum(options_.rank, options_.size, &next_tag_, link_,
                                     absl::MakeSpan(poll_), options_.timeout));
    last_count = static_cast<int>(std::lround(poll_[0]));
    if (last_count >= options_.quorum) return absl::OkStatus();
  }
}

absl::Status PartialAllReduce::RunRounds() {
  const int64_t n = options_.elements;
  for (int64_t round = 0; round < options_.rounds; ++round) {
    if (options_.gradients > 0 && carried_total_ >= options_.gradients) break;
    RETURN_IF_ERROR(Activate(round));
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::CancelledError("the partial all-reduce was stopped");
      std::copy(pending_.begin(), pending_.end(), send_.begin());
      std::fill(pending_.begin(), pending_.end(), 0.0f);
      send_[n] = static_cast<float>(pending_count_);
      if (pending_count_ > 0) {
        counts_.sent += pending_count_;
        pending_count_ = 0;
        carried_ = deposits_;
        carried_round_ = round;
      }
    }
    RETURN_IF_ERROR(RingAllReduceSum(options_.rank, options_.size, &next_tag_, link_,
                                     absl::MakeSpan(send_), options_.timeout));
    const int64_t gradients = std::llround(send_[n]);
    if (gradients < 1) {  // The quorum had gradients: a count below one is a broken ring.
      return absl::InternalError(
          absl::StrCat("partial all-reduce round ", round, " carried ", send_[n], " gradients"));
    }
    carried_total_ += gradients;
    const float inv = 1.0f / static_cast<float>(gradients);
    for (int64_t i = 0; i < n; ++i) send_[i] *= inv;
    RETURN_IF_ERROR(apply_(round, absl::MakeConstSpan(send_).subspan(0, n), gradients));
    absl::MutexLock lock(&mu_);
    rounds_done_ = round + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<PartialAllReduce::Outcome> PartialAllReduce::Contribute(
    absl::Span<const float> gradient, absl::Time deadline) {
  if (static_cast<int64_t>(gradient.size()) != options_.elements) {
    return absl::InvalidArgumentError(absl::StrCat("partial all-reduce: a gradient of ",
                                                   gradient.size(), " floats, expected ",
                                                   options_.elements));
  }
  absl::MutexLock lock(&mu_);
  ++counts_.contributed;
  const int64_t mine = ++deposits_;
  if (finished_) {  // No rounds left to carry it.
    counts_.dropped += 1;
    if (!status_.ok()) return status_;
    return Outcome{-1, rounds_done_};
  }
  for (size_t i = 0; i < gradient.size(); ++i) pending_[i] += gradient[i];
  ++pending_count_;
  auto applied = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ || (carried_ >= mine && rounds_done_ > carried_round_);
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&applied), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "partial all-reduce rank ", options_.rank, ": no round carried this rank's gradient by ",
        "the deadline (", rounds_done_, " of ", options_.rounds, " rounds done)"));
  }
  if (carried_ >= mine && rounds_done_ > carried_round_)
    return Outcome{carried_round_, rounds_done_};
  if (!status_.ok()) return status_;
  return Outcome{-1, rounds_done_};  // Finished with it still pending: dropped (Run counted it).
}

absl::Status PartialAllReduce::Wait(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("partial all-reduce rank ", options_.rank, ": ",
                                                    rounds_done_, " of ", options_.rounds,
                                                    " rounds done by the deadline"));
  }
  return status_;
}

}  // namespace rubato
