#include "server/tensor_aggregator.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tensor_bytes.h"

namespace rubato {

namespace {

// One part of the whole tensor unless part_elements cuts it.
int64_t PartElements(int64_t elements, int64_t part_elements) {
  return part_elements > 0 && part_elements < elements ? part_elements
                                                       : std::max<int64_t>(elements, 1);
}

}  // namespace

TensorAggregator::TensorAggregator(std::string name, std::vector<int64_t> shape,
                                   std::vector<float> initial, TensorRole role, int num_workers,
                                   int64_t part_elements)
    : name_(std::move(name)),
      shape_(std::move(shape)),
      elements_(static_cast<int64_t>(initial.size())),
      role_(role),
      num_workers_(num_workers),
      part_elements_(PartElements(elements_, part_elements)),
      parts_(static_cast<int>((std::max<int64_t>(elements_, 1) + part_elements_ - 1) /
                              part_elements_)),
      weights_(std::make_shared<std::vector<float>>(std::move(initial))),
      added_(parts_, 0),
      next_worker_(parts_, 0),
      got_(static_cast<size_t>(num_workers) * parts_, 0),
      parts_in_(num_workers, 0),
      received_(num_workers, 0),
      held_(static_cast<size_t>(num_workers) * parts_),
      last_pushed_(static_cast<size_t>(num_workers) * parts_, -1),
      pulled_version_(num_workers, 0) {}

void TensorAggregator::SetCheckpointing(int64_t every_versions, CaptureSink sink) {
  absl::MutexLock lock(&mu_);
  checkpoint_every_ = every_versions;
  checkpoint_sink_ = std::move(sink);
}

void TensorAggregator::CaptureNow() {
  absl::MutexLock lock(&mu_);
  CaptureIfDue();
}

void TensorAggregator::CaptureIfDue() {
  if (checkpoint_every_ > 0 && version_ % checkpoint_every_ == 0 && checkpoint_sink_) {
    checkpoint_sink_(version_, {weights_, version_}, optimizer_state_);
  }
}

void TensorAggregator::Restore(int64_t version, TensorOptimizerState optimizer_state) {
  absl::MutexLock lock(&mu_);
  version_ = version;
  optimizer_state_ = std::move(optimizer_state);
  guard_.Forget();
  ahead_.clear();
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

absl::Status TensorAggregator::CheckStep(const Context& ctx, int worker, int64_t step) const {
  if (!ctx.policy->Synchronous()) return absl::OkStatus();
  const int lead = ctx.policy->MaxLead();
  absl::MutexLock lock(&mu_);
  if (step > version_ + lead) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " from worker ", worker, " is from the future: tensor '", name_,
        "' is at version ", version_,
        lead > 0 ? absl::StrCat(", and a push may lead it by ", lead, " steps at most") : ""));
  }
  return absl::OkStatus();
}

ByteChunks TensorAggregator::PartOf(const Gradient& gradient, int k, int count) const {
  if (count == 1) return *gradient.data;
  return gradient.data->Sub(static_cast<size_t>(k) * part_elements_ * sizeof(float),
                            static_cast<size_t>(part_size(k)) * sizeof(float));
}

void TensorAggregator::KeepAhead(int w, int k, int64_t step, const ByteChunks& data, double max_abs,
                                 const std::shared_ptr<const void>& keepalive) {
  Ahead a;
  a.worker = w;
  a.part = k;
  a.step = step;
  a.max_abs = max_abs;
  if (keepalive != nullptr) {
    a.data = data;
    a.keepalive = keepalive;
  } else {
    auto copy = std::make_shared<const std::string>(data.Flatten());
    a.data = ByteChunks(*copy);
    a.keepalive = std::move(copy);
  }
  ahead_.push_back(std::move(a));
}

void TensorAggregator::TakeAheadDue(const Context& ctx) {
  size_t kept = 0;
  for (size_t i = 0; i < ahead_.size(); ++i) {
    Ahead& a = ahead_[i];
    if (a.step == version_) {
      TakePart(a.worker, a.part, a.step, a.data, a.max_abs, a.keepalive, nullptr, ctx);
    } else if (a.step > version_) {
      ahead_[kept++] = std::move(a);
    }  // (Older: its step was applied without it, a backup period's; dropped.)
  }
  ahead_.resize(kept);
}

void TensorAggregator::ApplyDueSteps(const Context& ctx, const Members& members,
                                     Released* released) {
  // Each update takes the parts kept for the next step (Apply); that step may be complete.
  while (StepComplete(ctx, members)) {
    const double lr = Rate(ctx, version_, members.count, 0);
    // A refusal is in released->refused: no push waits for this step to answer.
    Apply(ctx, lr, version_, /*worker=*/-1, released).IgnoreError();
  }
}

void TensorAggregator::Accumulate(int k, const ByteChunks& data, double max_abs, bool measure) {
  if (sum_.empty()) sum_.resize(elements_);
  max_abs_ = std::max(max_abs_, max_abs);
  float* out = sum_.data() + int64_t{k} * part_elements_;
  if (!measure) {
    added_[k] == 0 ? CopyFloats(data, out) : AddFloats(data, out);
  } else if (added_[k] == 0) {
    CopyFloats(data, out, &squared_norms_);
  } else {
    AddFloats(data, out, &squared_norms_);
  }
  ++added_[k];
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

void TensorAggregator::AddHeld(int w, int k, Released* released) {
  Held& h = held(w, k);
  Accumulate(k, h.data, h.max_abs);
  // The Add's acknowledgement goes once its last held part is in: the others, and the Add while
  // it runs, hold a reference to it.
  if (h.on_added != nullptr && h.on_added.use_count() == 1 && *h.on_added) {
    released->acks.emplace_back(std::move(*h.on_added), absl::OkStatus());
  }
  h = Held();
}

void TensorAggregator::DrainInOrder(int k, const Members& members, Released* released) {
  int& next = next_worker_[k];
  while (next < num_workers_) {
    const int w = next;
    if (got_[w * parts_ + k]) {
      // Every part in at or past the turn came early, and was held.
      if (held(w, k).present) AddHeld(w, k, released);
    } else if (members.member[w]) {
      return;  // A member's part is still to come: later ones wait for it.
    }
    ++next;
  }
}

void TensorAggregator::TakePart(int w, int k, int64_t step, const ByteChunks& data,
                                double max_abs, const std::shared_ptr<const void>& keepalive,
                                const std::shared_ptr<std::function<void(absl::Status)>>& on_added,
                                const Context& ctx) {
  got_[w * parts_ + k] = 1;
  if (++parts_in_[w] == parts_) {
    received_[w] = 1;
    ++received_count_;
  }
  const bool in_order = ctx.policy->SumsInWorkerOrder();
  if (in_order && w > next_worker_[k]) {
    Held& h = held(w, k);
    if (keepalive != nullptr) {
      h.data = data;
      h.keepalive = keepalive;
    } else {
      h.owned = data.Flatten();
      h.data = ByteChunks(h.owned);
    }
    h.max_abs = max_abs;
    h.since = ctx.clock->Now();
    h.step = step;
    h.on_added = on_added;
    h.present = true;
    return;
  }
  // Its turn, or no order is kept (backup), or a worker that rejoined after its turn was skipped:
  // added now (the last, after the others).
  Accumulate(k, data, max_abs);
  if (in_order && w == next_worker_[k]) ++next_worker_[k];
}

bool TensorAggregator::StepComplete(const Context& ctx, const Members& members) const {
  bool all = true;
  for (int w = 0; w < num_workers_ && all; ++w) all = !members.member[w] || received_[w];
  return ctx.policy->StepComplete(version_, received_count_, all, members.count);
}

double TensorAggregator::Add(const Context& ctx, int worker, int64_t step, Gradient gradient,
                             GradientOutcome* outcome, Released* released) {
  *outcome = GradientOutcome();
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<const Members> members = std::atomic_load(ctx.members);
  // The parts this gradient holds: one, or all of them. A part seen before for this step (or a
  // later one) is a repeat and is skipped; a gradient all of whose parts are is a duplicate.
  const int first = gradient.part < 0 ? 0 : gradient.part;
  const int count = gradient.part < 0 ? parts_ : 1;
  for (int k = 0; k < parts_ && outcome->first_part; ++k) {
    if (last_pushed_[worker * parts_ + k] >= step) outcome->first_part = false;
  }
  bool any = false;
  const int64_t last_before = last_pushed_[worker * parts_ + first];  // async: the only part
  for (int k = first; k < first + count; ++k) {
    int64_t& last = last_pushed_[worker * parts_ + k];
    any |= step > last;
    last = std::max(last, step);
  }
  if (!any) {  // (worker, step, tensor, part) seen before.
    outcome->kind = GradientOutcome::kDuplicate;
    return 0;
  }
  if (!ctx.policy->Synchronous()) {
    // async, ssp: applied now, alone (always one part).
    outcome->staleness = std::max<int64_t>(0, version_ - pulled_version_[worker]);
    std::fill(added_.begin(), added_.end(), 0);
    Accumulate(0, *gradient.data, gradient.max_abs, /*measure=*/false);
    received_count_ = 1;
    const double lr = Rate(ctx, version_, members->count, outcome->staleness);
    outcome->refused = Apply(ctx, lr, step, worker, released);
    outcome->applied = outcome->refused.ok();
    if (!outcome->applied) {
      // Not taken: the same step sent again is checked again, not called a duplicate.
      last_pushed_[worker * parts_ + first] = last_before;
    }
    return lr;
  }
  if (step < version_) {  // backup: its step was applied without it.
    outcome->kind = GradientOutcome::kDropped;
    return 0;
  }
  // The updates its weights lacked: under adaptive consistency's ssp:s periods up to s, else 0.
  outcome->staleness = std::max<int64_t>(0, step - pulled_version_[worker]);
  if (step > version_) {  // ssp:s: ahead of the version (CheckStep bounded how far); kept.
    for (int k = first; k < first + count; ++k) {
      KeepAhead(worker, k, step, PartOf(gradient, k, count), gradient.max_abs, gradient.keepalive);
    }
    return 0;
  }
  // One acknowledgement for the whole Add, shared by the parts held; sent by the last one added.
  std::shared_ptr<std::function<void(absl::Status)>> on_added;
  if (gradient.on_added) {
    on_added = std::make_shared<std::function<void(absl::Status)>>(std::move(gradient.on_added));
  }
  for (int k = first; k < first + count; ++k) {
    if (got_[worker * parts_ + k]) continue;  // this step's part came before (alone)
    TakePart(worker, k, step, PartOf(gradient, k, count), gradient.max_abs, gradient.keepalive,
             on_added, ctx);
  }
  if (ctx.policy->SumsInWorkerOrder()) {
    // (A drain of a part this gradient did not bring changes nothing.)
    for (int k = first; k < first + count; ++k) DrainInOrder(k, *members, released);
  }
  // Still held, some part of it: acknowledged once the last such part is added (AddHeld; this
  // Add's reference kept that from happening during the drain above). Otherwise the caller
  // acknowledges it now.
  bool still_held = false;
  for (int k = first; k < first + count && !still_held; ++k) still_held = held(worker, k).present;
  outcome->held = still_held && on_added != nullptr;
  if (!StepComplete(ctx, *members)) return 0;
  const double lr = Rate(ctx, version_, members->count, 0);
  outcome->refused = Apply(ctx, lr, step, worker, released);
  outcome->applied = outcome->refused.ok();
  ApplyDueSteps(ctx, *members, released);
  return lr;
}

bool TensorAggregator::ApplyIfComplete(const Context& ctx, Released* released,
                                       double* learning_rate) {
  if (!ctx.policy->Synchronous()) return false;
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<const Members> members = std::atomic_load(ctx.members);
  if (ctx.policy->SumsInWorkerOrder()) {
    for (int k = 0; k < parts_; ++k) DrainInOrder(k, *members, released);
  }
  if (!StepComplete(ctx, *members)) return false;
  *learning_rate = Rate(ctx, version_, members->count, 0);
  ApplyDueSteps(ctx, *members, released);  // This step, and any that gradients ahead complete.
  return true;
}

absl::Time TensorAggregator::ExpireHeld(absl::Time cutoff, const Members& members,
                                        int64_t waited_ms, Released* released) {
  absl::MutexLock lock(&mu_);
  absl::Time earliest = absl::InfiniteFuture();
  for (int w = 0; w < num_workers_; ++w) {
    for (int k = 0; k < parts_; ++k) {
      Held& h = held(w, k);
      if (h.on_added == nullptr || !*h.on_added) continue;
      if (h.since >= cutoff) {
        earliest = std::min(earliest, h.since);
        continue;
      }
      std::vector<int> before;
      for (int v = 0; v < w; ++v) {
        if (members.member[v] && !got_[v * parts_ + k]) before.push_back(v);
      }
      // Answered once for every part it held (they share the function, emptied here).
      released->acks.emplace_back(
          std::move(*h.on_added),
          absl::DeadlineExceededError(absl::StrCat(
              "gradient of '", name_, "'",
              parts_ > 1 ? absl::StrCat(" (part ", k, " of ", parts_, ")") : std::string(),
              " for step ", h.step, " from worker ", w, " waited ", waited_ms,
              " ms for the gradients of worker(s) ", absl::StrJoin(before, ", "),
              " (bsp adds them in worker-id order)")));
      *h.on_added = nullptr;
    }
  }
  return earliest;
}

void TensorAggregator::ReleaseHeld(const absl::Status& status, Released* released) {
  absl::MutexLock lock(&mu_);
  for (Held& h : held_) {
    if (h.on_added != nullptr && *h.on_added) {
      released->acks.emplace_back(std::move(*h.on_added), status);
      *h.on_added = nullptr;
    }
  }
}

absl::Status TensorAggregator::Apply(const Context& ctx, double learning_rate, int64_t step,
                                     int worker, Released* released) {
  // Parts held for workers that were members when they pushed and have left since: added after
  // the rest, in worker-id order.
  for (int w = 0; w < num_workers_; ++w) {
    for (int k = 0; k < parts_; ++k) {
      if (held(w, k).present) AddHeld(w, k, released);
    }
  }
  // The mean of each part over the gradients added into it (the same count for every part, but
  // for a worker that left midway through its parts).
  if (ctx.policy->Synchronous() && ctx.noise != nullptr) {
    // The mean, and |mean|^2 in the same pass, for the noise scale.
    double mean_squared = 0;
    int added = added_[0];
    for (int k = 0; k < parts_; ++k) {
      float* part = sum_.data() + int64_t{k} * part_elements_;
      mean_squared += added_[k] > 1
                          ? DivideAndSquare<true>(part, part_size(k), static_cast<float>(added_[k]))
                          : DivideAndSquare<false>(part, part_size(k), 1.0f);
      added = std::min(added, added_[k]);
    }
    ctx.noise->Add(version_,
                   EstimateNoiseTerms(added, squared_norms_ / std::max(added, 1), mean_squared));
  } else {
    for (int k = 0; k < parts_; ++k) {
      if (added_[k] <= 1) continue;
      const float n = static_cast<float>(added_[k]);
      float* part = sum_.data() + int64_t{k} * part_elements_;
      for (int64_t i = 0; i < part_size(k); ++i) part[i] /= n;
    }
  }
  if (weights_.use_count() > 1) {
    // A pull still sends the current version: update a copy.
    weights_ = std::make_shared<std::vector<float>>(*weights_);
  }
  absl::Status refused;
  if (!guard_.Update(*ctx.optimizer, static_cast<float>(learning_rate), sum_, max_abs_,
                     absl::MakeSpan(*weights_), role_, &optimizer_state_, ctx.pool)) {
    const bool synchronous = ctx.policy->Synchronous();
    refused = absl::InvalidArgumentError(absl::StrCat(
        "the update of tensor '", name_, "' for step ", step,
        worker >= 0 ? absl::StrCat(" (completed by worker ", worker, "'s gradient)") : "",
        ", with gradient magnitudes below ", max_abs_, " and learning rate ", learning_rate,
        ", would make a weight or an optimizer slot NaN or Inf: refused, '", name_,
        "' keeps its weights", synchronous ? " and skips this step" : ""));
    released->refused.push_back(refused);
  }
  max_abs_ = 0;
  if (refused.ok() || ctx.policy->Synchronous()) {
    ++version_;
    CaptureIfDue();
  }
  std::fill(received_.begin(), received_.end(), 0);
  std::fill(got_.begin(), got_.end(), 0);
  std::fill(parts_in_.begin(), parts_in_.end(), 0);
  std::fill(added_.begin(), added_.end(), 0);
  std::fill(next_worker_.begin(), next_worker_.end(), 0);
  received_count_ = 0;
  squared_norms_ = 0;
  if (!ahead_.empty()) TakeAheadDue(ctx);
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
  return refused;
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
  for (const Ahead& a : ahead_) bytes += static_cast<int64_t>(a.data.size());
  return bytes;
}

}  // namespace rubato
