#include "sim/cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace rubato {
namespace {

// Work left below this (rounding of the rates) counts as done.
constexpr double kEpsilonNs = 0.5;

}  // namespace

double Cpu::Rate() const {
  const int n = static_cast<int>(jobs_.size());
  if (cores_ == 0 || n <= cores_) return 1.0;
  return static_cast<double>(cores_) / n;
}

void Cpu::Run(absl::Duration work, std::function<void()> done) {
  if (cores_ == 0) {  // Nothing to share: the work takes its own time.
    busy_ += work;
    loop_->After(work, std::move(done));
    return;
  }
  Advance();
  jobs_.push_back(
      Job{absl::ToDoubleNanoseconds(std::max(work, absl::ZeroDuration())), work, std::move(done)});
  Settle();
}

void Cpu::Advance() {
  const absl::Time now = loop_->Now();
  if (!jobs_.empty() && now > last_) {
    const double progress = absl::ToDoubleNanoseconds(now - last_) * Rate();
    for (Job& j : jobs_) j.remaining_ns -= progress;
  }
  last_ = now;
}

void Cpu::Settle() {
  // Finished jobs leave (their `done` as events of now, in the order they came).
  auto finished = std::stable_partition(jobs_.begin(), jobs_.end(),
                                        [](const Job& j) { return j.remaining_ns > kEpsilonNs; });
  for (auto it = finished; it != jobs_.end(); ++it) {
    busy_ += it->work;
    loop_->After(absl::ZeroDuration(), std::move(it->done));
  }
  jobs_.erase(finished, jobs_.end());
  ++generation_;
  if (jobs_.empty()) return;
  double least = std::numeric_limits<double>::infinity();
  for (const Job& j : jobs_) least = std::min(least, j.remaining_ns);
  const uint64_t generation = generation_;
  // Rounded up to a whole nanosecond, so that the job is done when it fires.
  const double ns = std::ceil(least / Rate());
  loop_->After(absl::Nanoseconds(static_cast<int64_t>(ns)), [this, generation] {
    if (generation != generation_) return;  // Work came or went since: rescheduled.
    Advance();
    Settle();
  });
}

}  // namespace rubato
