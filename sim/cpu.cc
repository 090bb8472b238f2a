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

double Cpu::Share() const {
  if (cores_ == 0 || width_ <= cores_) return 1.0;
  return static_cast<double>(cores_) / static_cast<double>(width_);
}

void Cpu::Run(absl::Duration work, std::function<void()> done, int width) {
  width = std::max(width, 1);
  if (cores_ == 0) {  // Nothing to share: the work takes its own time over its width.
    busy_ += work;
    loop_->After(work / width, std::move(done));
    return;
  }
  Advance();
  jobs_.push_back(Job{absl::ToDoubleNanoseconds(std::max(work, absl::ZeroDuration())), work,
                      std::move(done), width});
  width_ += width;
  Settle();
}

void Cpu::Advance() {
  const absl::Time now = loop_->Now();
  if (!jobs_.empty() && now > last_) {
    const double progress = absl::ToDoubleNanoseconds(now - last_) * Share();
    for (Job& j : jobs_) j.remaining_ns -= progress * j.width;
  }
  last_ = now;
}

void Cpu::Settle() {
  // Finished jobs leave (their `done` as events of now, in the order they came).
  auto finished = std::stable_partition(jobs_.begin(), jobs_.end(),
                                        [](const Job& j) { return j.remaining_ns > kEpsilonNs; });
  for (auto it = finished; it != jobs_.end(); ++it) {
    busy_ += it->work;
    width_ -= it->width;
    loop_->After(absl::ZeroDuration(), std::move(it->done));
  }
  jobs_.erase(finished, jobs_.end());
  ++generation_;
  if (jobs_.empty()) return;
  double least = std::numeric_limits<double>::infinity();  // Time to the first finish.
  for (const Job& j : jobs_) least = std::min(least, j.remaining_ns / (j.width * Share()));
  const uint64_t generation = generation_;
  // Rounded up to a whole nanosecond, so that the job is done when it fires.
  const double ns = std::ceil(least);
  loop_->After(absl::Nanoseconds(static_cast<int64_t>(ns)), [this, generation] {
    if (generation != generation_) return;  // Work came or went since: rescheduled.
    Advance();
    Settle();
  });
}

}  // namespace rubato
