#include "server/noise_scale.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace rubato {
namespace {

// Steps waiting for some tensor's terms before the oldest is given up on.
constexpr size_t kMaxPending = 16;

}  // namespace

NoiseTerms EstimateNoiseTerms(int n, double small, double big) {
  NoiseTerms t;
  t.workers = n;
  if (n < 2) return t;  // No spread to measure: Measure skips the step.
  const double k = n;
  t.g2 = (k * big - small) / (k - 1);
  t.trace_over_batch = k * (small - big) / (k - 1);
  return t;
}

void NoiseScaleEma::Add(double g2, double trace) {
  g2_ = decay_ * g2_ + (1 - decay_) * g2;
  trace_ = decay_ * trace_ + (1 - decay_) * trace;
  power_ *= decay_;
  ++steps_;
}

double NoiseScaleEma::g2() const { return steps_ == 0 ? 0 : g2_ / (1 - power_); }
double NoiseScaleEma::trace() const { return steps_ == 0 ? 0 : trace_ / (1 - power_); }

NoiseScaleMonitor::NoiseScaleMonitor(int shard_id, double ema_decay)
    : shard_id_(shard_id), ema_(ema_decay) {}

void NoiseScaleMonitor::SetTensors(int tensors) {
  absl::MutexLock lock(&mu_);
  tensors_ = tensors;
}

void NoiseScaleMonitor::SetBatch(int batch) {
  absl::MutexLock lock(&mu_);
  if (batch_ == 0) {
    batch_ = batch;
  } else if (batch != batch_) {
    unequal_batches_ = true;
  }
}

void NoiseScaleMonitor::SetBatchFrom(int64_t step, int batch) {
  absl::MutexLock lock(&mu_);
  batch_from_[step] = batch;
}

int NoiseScaleMonitor::BatchAt(int64_t step) const {
  auto it = batch_from_.upper_bound(step);
  return it == batch_from_.begin() ? batch_ : std::prev(it)->second;
}

void NoiseScaleMonitor::Add(int64_t step, const NoiseTerms& terms) {
  absl::MutexLock lock(&mu_);
  if (tensors_ <= 0 || (next_ >= 0 && step < next_)) return;  // Not set up, or passed over.
  Pending& p = pending_[step];
  p.sum.g2 += terms.g2;
  p.sum.trace_over_batch += terms.trace_over_batch;
  p.sum.workers = p.tensors == 0 ? terms.workers : std::min(p.sum.workers, terms.workers);
  ++p.tensors;
  // Measure complete steps in order. Every tensor gives every step it applies, so a step stays
  // incomplete only if a tensor skipped it (a restore, a roll-back): give up on it once enough
  // later steps wait.
  while (!pending_.empty()) {
    auto first = pending_.begin();
    if (first->second.tensors >= tensors_) {
      Measure(first->first, first->second.sum);
    } else if (pending_.size() <= kMaxPending) {
      break;
    }
    next_ = first->first + 1;
    pending_.erase(first);
  }
}

void NoiseScaleMonitor::Measure(int64_t step, const NoiseTerms& sum) {
  const int batch = BatchAt(step);
  if (unequal_batches_ || batch <= 0 || sum.workers < 2) return;
  const double trace = sum.trace_over_batch * batch;
  // Gradients near the float range overflow their squares (summed in float lanes): such a step
  // says nothing and must not poison the averages.
  if (!std::isfinite(sum.g2) || !std::isfinite(trace)) return;
  ema_.Add(sum.g2, trace);
  NoiseScaleStats& s = history_[step];
  s.set_shard_id(shard_id_);
  s.set_step(step);
  s.set_g2(sum.g2);
  s.set_trace(trace);
  s.set_g2_ema(ema_.g2());
  s.set_trace_ema(ema_.trace());
  s.set_steps(ema_.steps());
  s.set_batch_small(batch);
  s.set_workers(sum.workers);
  if (history_.size() > kHistory) history_.erase(history_.begin());
}

std::optional<NoiseScaleStats> NoiseScaleMonitor::StatsAt(int64_t step) const {
  absl::MutexLock lock(&mu_);
  if (unequal_batches_) return std::nullopt;
  auto it = history_.find(step);
  if (it == history_.end()) return std::nullopt;
  return it->second;
}

NoiseScaleStats NoiseScaleMonitor::Stats() const {
  absl::MutexLock lock(&mu_);
  NoiseScaleStats s;
  if (history_.empty()) {
    s.set_shard_id(shard_id_);
    s.set_step(-1);
  } else {
    s = history_.rbegin()->second;
  }
  if (unequal_batches_) s.set_batch_small(0);
  return s;
}

}  // namespace rubato
