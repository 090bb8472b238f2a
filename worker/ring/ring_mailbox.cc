#include "worker/ring/ring_mailbox.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/tensor_bytes.h"

namespace rubato {

absl::Status RingMailbox::Put(int from, int64_t tag, RingPayload payload) {
  if (tag < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring block has a negative tag ", tag));
  }
  if (from != from_rank_) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " came from rank ", from,
                                                   ", but this rank receives from rank ",
                                                   from_rank_, " only"));
  }
  if (payload.bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring block ", tag, " has ", payload.bytes, " bytes, not whole floats"));
  }
  absl::MutexLock lock(&mu_);
  if (!blocks_.emplace(tag, std::move(payload)).second) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " delivered twice"));
  }
  return absl::OkStatus();
}

// How long a Take that found the previous rank's stream broken waits for this rank's own link to
// the next rank to fail too (see Take).
constexpr absl::Duration kBrokenStreamGrace = absl::Seconds(1);
// A Take still waiting says so this often: what it waits for, on whom, and until when.
constexpr absl::Duration kStallReport = absl::Seconds(5);

bool RingMailbox::AwaitAny(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto any = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !blocks_.empty() || !broken_.empty() || !aborted_.ok();
  };
  return mu_.AwaitWithDeadline(absl::Condition(&any), deadline);
}

absl::Status RingMailbox::Take(int64_t tag, absl::Span<float> out, RingLink::Combine combine,
                               absl::Time deadline) {
  RingPayload payload;
  {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return blocks_.count(tag) > 0 || !broken_.empty() || !aborted_.ok();
    };
    const absl::Time began = absl::Now();
    absl::Time report = began + kStallReport;
    for (;;) {
      if (mu_.AwaitWithDeadline(absl::Condition(&ready), std::min(deadline, report))) break;
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "all-reduce timed out waiting for block ", tag, " from rank ", from_rank_));
      }
      // A wait that ended before its time (seen under load: thousands of early returns within a
      // second, each of which logged) waits again; the report is due every kStallReport.
      if (now < report) continue;
      report = now + kStallReport;
      RUBATO_LOG(WARNING) << "all-reduce stalled: waiting "
                          << absl::FormatDuration(absl::Trunc(now - began, absl::Seconds(1)))
                          << " for block " << tag << " from rank " << from_rank_
                          << (opened_ ? " (its stream is open; nothing has come)"
                                      : " (its stream has not opened yet)")
                          << "; giving up in "
                          << absl::FormatDuration(absl::Trunc(deadline - now, absl::Seconds(1)));
    }
    auto it = blocks_.find(tag);
    if (it == blocks_.end() && aborted_.ok()) {
      // The previous rank's stream broke. When the next rank died, the previous one often fails
      // on that first and exits, and its broken stream reaches here before this rank's own link
      // to the next rank reports the death: give that link a moment, so that the error names the
      // rank that failed first rather than one that gave up because of it.
      auto aborted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !aborted_.ok(); };
      mu_.AwaitWithDeadline(absl::Condition(&aborted),
                            std::min(deadline, absl::Now() + kBrokenStreamGrace));
    }
    if (it == blocks_.end() && !aborted_.ok()) {
      if (broken_.empty()) return aborted_;
      return absl::Status(aborted_.code(),
                          absl::StrCat(aborted_.message(), " (then the stream from rank ",
                                       from_rank_, " broke too: ", broken_, ")"));
    }
    if (it == blocks_.end()) {
      return absl::UnavailableError(absl::StrCat("all-reduce: the stream from rank ", from_rank_,
                                                 " broke before block ", tag, " came: ", broken_));
    }
    payload = std::move(it->second);
    blocks_.erase(it);
  }
  if (payload.bytes != out.size() * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " from rank ", from_rank_,
                                                   " has ", payload.bytes / sizeof(float),
                                                   " floats, expected ", out.size()));
  }
  if (!CombinePayload(payload, out, combine)) {
    // Name the culprit (from a contiguous copy: this is the error path).
    std::vector<float> values(out.size());
    CombinePayload(payload, absl::MakeSpan(values), RingLink::Combine::kCopy);
    return CheckFloatBytes(
        absl::StrCat("ring block ", tag, " from rank ", from_rank_),
        absl::string_view(reinterpret_cast<const char*>(values.data()), payload.bytes),
        static_cast<int64_t>(values.size()));
  }
  return absl::OkStatus();
}

void RingMailbox::StreamOpened() {
  absl::MutexLock lock(&mu_);
  broken_.clear();
  opened_ = true;
}

void RingMailbox::Abort(absl::Status error) {
  absl::MutexLock lock(&mu_);
  if (aborted_.ok()) aborted_ = std::move(error);
}

void RingMailbox::StreamBroke(absl::string_view why) {
  absl::MutexLock lock(&mu_);
  if (broken_.empty()) broken_ = std::string(why);
}

}  // namespace rubato
