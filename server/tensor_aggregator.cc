#include "server/tensor_aggregator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tensor_bytes.h"

namespace rubato {

TensorAggregator::TensorAggregator(std::string name, std::vector<int64_t> shape,
                                   std::vector<float> initial, TensorRole role, int num_workers)
    : name_(std::move(name)),
      shape_(std::move(shape)),
      elements_(static_cast<int64_t>(initial.size())),
      role_(role),
      num_workers_(num_workers),
      weights_(std::make_shared<std::vector<float>>(std::move(initial))),
      received_(num_workers, 0),
      held_(num_workers),
      last_pushed_(num_workers, -1),
      pulled_version_(num_workers, 0) {}

void TensorAggregator::SetCheckpointing(int64_t every_versions, CaptureSink sink) {
  absl::MutexLock lock(&mu_);
  checkpoint_every_ = every_versions;
  checkpoint_sink_ = std::move(sink);
}

void TensorAggregator::Restore(int64_t version, TensorOptimizerState optimizer_state) {
  absl::MutexLock lock(&mu_);
  version_ = version;
  optimizer_state_ = std::move(optimizer_state);
  std::fill(pulled_version_.begin(), pulled_version_.end(), version);
}

int64_t TensorAggregator::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

TensorSnapshot TensorAggregator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return {weights_, version_};
}

absl::Status TensorAggregator::CheckStep(const Context& ctx, int worker, int64_t step) const {
  if (!ctx.policy->Synchronous()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (step > version_) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " from worker ", worker,
                                                      " is from the future: tensor '", name_,
                                                      "' is at version ", version_));
  }
  return absl::OkStatus();
}

void TensorAggregator::Accumulate(const ByteChunks& data, bool measure) {
  if (sum_.empty()) sum_.resize(elements_);
  if (added_ == 0) squared_norms_ = 0;
  if (!measure) {
    added_ == 0 ? CopyFloats(data, sum_.data()) : AddFloats(data, sum_.data());
  } else if (added_ == 0) {
    CopyFloats(data, sum_.data(), &squared_norms_);
  } else {
    AddFloats(data, sum_.data(), &squared_norms_);
  }
  ++added_;
}

namespace {

// v[i] /= divisor (kDivide), returning the sum of the results' squares, summed as
// common/tensor_wire.cc's MoveFloatsWithSquares does.
template <bool kDivide>
double DivideAndSquare(float* v, int64_t n, float divisor) {
  double total = 0;
  for (int64_t b = 0; b < n; b += kSquaresBlock) {
    const int64_t end = std::min(n, b + kSquaresBlock);
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = b;
    for (; i + 8 <= end; i += 8) {
      for (int k = 0; k < 8; ++k) {
        if constexpr (kDivide) v[i + k] /= divisor;
        lanes[k] += v[i + k] * v[i + k];
      }
    }
    double block = 0;
    for (; i < end; ++i) {
      if constexpr (kDivide) v[i] /= divisor;
      block += static_cast<double>(v[i]) * v[i];
    }
    for (float l : lanes) block += l;
    total += block;
  }
  return total;
}

}  // namespace

void TensorAggregator::AddHeld(int w, Released* released) {
  Held& h = held_[w];
  Accumulate(h.data);
  if (h.on_added) released->acks.emplace_back(std::move(h.on_added), absl::OkStatus());
  h = Held();
}

void TensorAggregator::DrainInOrder(const Members& members, Released* released) {
  while (next_worker_ < num_workers_) {
    const int w = next_worker_;
    if (received_[w]) {
      AddHeld(w, released);
    } else if (members.member[w]) {
      return;  // A member's gradient is still to come: later ones wait for it.
    }
    ++next_worker_;
  }
}

namespace {

// The policy's rate for the update from `version`, scaled for an adaptive batch's step.
double Rate(const TensorAggregator::Context& ctx, int64_t version, int members, int64_t staleness) {
  double lr = ctx.policy->LearningRate(*ctx.schedule, version, members, staleness);
  if (ctx.plan != nullptr) {
    if (std::shared_ptr<const BatchPlan> plan = std::atomic_load(ctx.plan); plan != nullptr) {
      lr *= ctx.schedule->BatchFactor(int64_t{plan->BatchAt(version)} * plan->workers());
    }
  }
  return lr;
}

}  // namespace

bool TensorAggregator::StepComplete(const Context& ctx, const Members& members) const {
  bool all = true;
  for (int w = 0; w < num_workers_ && all; ++w) all = !members.member[w] || received_[w];
  return ctx.policy->StepComplete(received_count_, all, members.count);
}

double TensorAggregator::Add(const Context& ctx, int worker, int64_t step, Gradient gradient,
                             GradientOutcome* outcome, Released* released) {
  *outcome = GradientOutcome();
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<const Members> members = std::atomic_load(ctx.members);
  if (step <= last_pushed_[worker]) {  // (worker, step, tensor) seen before.
    outcome->kind = GradientOutcome::kDuplicate;
    return 0;
  }
  last_pushed_[worker] = step;
  if (!ctx.policy->Synchronous()) {
    // async, ssp: applied now, alone.
    outcome->staleness = std::max<int64_t>(0, version_ - pulled_version_[worker]);
    added_ = 0;
    Accumulate(*gradient.data, /*measure=*/false);
    received_count_ = 1;
    const double lr = Rate(ctx, version_, members->count, outcome->staleness);
    Apply(ctx, lr, released);
    outcome->applied = true;
    return lr;
  }
  if (step < version_) {  // backup: its step was applied without it.
    outcome->kind = GradientOutcome::kDropped;
    return 0;
  }
  received_[worker] = 1;
  ++received_count_;
  if (ctx.policy->SumsInWorkerOrder() && worker != next_worker_) {
    if (worker > next_worker_) {
      Held& h = held_[worker];
      if (gradient.keepalive != nullptr) {
        h.data = *gradient.data;
        h.keepalive = std::move(gradient.keepalive);
      } else {
        h.owned = gradient.data->Flatten();
        h.data = ByteChunks(h.owned);
      }
      h.since = absl::Now();
      h.step = step;
      if (gradient.on_added) {
        h.on_added = std::move(gradient.on_added);
        outcome->held = true;
      }
    } else {
      // A worker that rejoined after its turn was skipped: added now, after the others.
      Accumulate(*gradient.data);
    }
  } else {
    Accumulate(*gradient.data);
    if (ctx.policy->SumsInWorkerOrder()) ++next_worker_;
  }
  if (ctx.policy->SumsInWorkerOrder()) DrainInOrder(*members, released);
  if (!StepComplete(ctx, *members)) return 0;
  const double lr = Rate(ctx, version_, members->count, 0);
  Apply(ctx, lr, released);
  outcome->applied = true;
  return lr;
}

bool TensorAggregator::ApplyIfComplete(const Context& ctx, Released* released,
                                       double* learning_rate) {
  if (!ctx.policy->Synchronous()) return false;
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<const Members> members = std::atomic_load(ctx.members);
  if (ctx.policy->SumsInWorkerOrder()) DrainInOrder(*members, released);
  if (!StepComplete(ctx, *members)) return false;
  *learning_rate = Rate(ctx, version_, members->count, 0);
  Apply(ctx, *learning_rate, released);
  return true;
}

absl::Time TensorAggregator::ExpireHeld(absl::Time cutoff, const Members& members,
                                        int64_t waited_ms, Released* released) {
  absl::MutexLock lock(&mu_);
  absl::Time earliest = absl::InfiniteFuture();
  for (int w = 0; w < num_workers_; ++w) {
    Held& h = held_[w];
    if (!h.on_added) continue;
    if (h.since >= cutoff) {
      earliest = std::min(earliest, h.since);
      continue;
    }
    std::vector<int> before;
    for (int v = 0; v < w; ++v) {
      if (members.member[v] && !received_[v]) before.push_back(v);
    }
    released->acks.emplace_back(
        std::move(h.on_added),
        absl::DeadlineExceededError(
            absl::StrCat("gradient of '", name_, "' for step ", h.step, " from worker ", w,
                         " waited ", waited_ms, " ms for the gradients of worker(s) ",
                         absl::StrJoin(before, ", "), " (bsp adds them in worker-id order)")));
    h.on_added = nullptr;
  }
  return earliest;
}

void TensorAggregator::ReleaseHeld(const absl::Status& status, Released* released) {
  absl::MutexLock lock(&mu_);
  for (Held& h : held_) {
    if (h.on_added) released->acks.emplace_back(std::move(h.on_added), status);
    h.on_added = nullptr;
  }
}

void TensorAggregator::Apply(const Context& ctx, double learning_rate, Released* released) {
  // Gradients held for workers that were members when they pushed and have left since: added
  // after the rest, in worker-id order.
  for (int w = 0; w < num_workers_; ++w) {
    if (received_[w] && !held_[w].data.empty()) AddHeld(w, released);
  }
  if (ctx.policy->Synchronous() && ctx.noise != nullptr) {
    // The mean, and |mean|^2 in the same pass, for the noise scale.
    const double mean_squared =
        added_ > 1 ? DivideAndSquare<true>(sum_.data(), elements_, static_cast<float>(added_))
                   : DivideAndSquare<false>(sum_.data(), elements_, 1.0f);
    ctx.noise->Add(version_,
                   EstimateNoiseTerms(added_, squared_norms_ / std::max(added_, 1), mean_squared));
  } else if (added_ > 1) {
    const float n = static_cast<float>(added_);
    for (float& v : sum_) v /= n;
  }
  if (weights_.use_count() > 1) {
    // A pull still sends the current version: update a copy.
    weights_ = std::make_shared<std::vector<float>>(*weights_);
  }
  ctx.optimizer->Update(static_cast<float>(learning_rate), sum_, absl::MakeSpan(*weights_), role_,
                        &optimizer_state_, ctx.pool);
  ++version_;
  if (checkpoint_every_ > 0 && version_ % checkpoint_every_ == 0 && checkpoint_sink_) {
    checkpoint_sink_(version_, {weights_, version_}, optimizer_state_);
  }
  std::fill(received_.begin(), received_.end(), 0);
  received_count_ = 0;
  added_ = 0;
  next_worker_ = 0;
  // Release the pulls this version satisfies; forget those that are over.
  TensorSnapshot snapshot{weights_, version_};
  size_t kept = 0;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    Waiting& wt = waiting_[i];
    if (wt.waiter->Over()) continue;
    if (wt.need <= version_) {
      pulled_version_[wt.worker] = version_;
      if (wt.waiter->Fill(wt.slot, snapshot)) released->pulls.push_back(std::move(wt.waiter));
      continue;
    }
    waiting_[kept++] = std::move(wt);
  }
  waiting_.resize(kept);
}

bool TensorAggregator::Pull(int worker, int64_t need, const std::shared_ptr<PullWaiter>& waiter,
                            int slot) {
  absl::MutexLock lock(&mu_);
  if (version_ >= need) {
    pulled_version_[worker] = version_;
    return waiter->Fill(slot, {weights_, version_});
  }
  // Forget pulls that are over (superseded, timed out) before queueing: the queue holds only live
  // pulls, at most one per worker and tensor.
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [](const Waiting& w) { return w.waiter->Over(); }),
                 waiting_.end());
  waiting_.push_back({waiter, slot, need, worker});
  return false;
}

std::vector<int> TensorAggregator::Missing(const std::vector<char>& member) const {
  absl::MutexLock lock(&mu_);
  std::vector<int> missing;
  for (int w = 0; w < num_workers_; ++w) {
    if (member[w] && !received_[w]) missing.push_back(w);
  }
  return missing;
}

int64_t TensorAggregator::ExtraBytes() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = static_cast<int64_t>(sum_.capacity() * sizeof(float));
  for (const Held& h : held_) bytes += static_cast<int64_t>(h.data.size());
  return bytes;
}

}  // namespace rubato
