#include "sim/ring_job.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "common/ring_allreduce.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "worker/ring/partial_allreduce.h"

namespace rubato {
namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The start of an operation that ranks begin on their own at own[r] (kNever: not on its own) and
// that the others join when the previous rank's first block reaches them, `first_block` seconds
// after it started, but not before idle[r].
std::vector<double> ActivatedStarts(const std::vector<double>& own, const std::vector<double>& idle,
                                    double first_block) {
  const int n = static_cast<int>(own.size());
  const int a = static_cast<int>(std::min_element(own.begin(), own.end()) - own.begin());
  std::vector<double> start(n);
  start[a] = own[a];
  // One pass around from the earliest: no rank can be reached before own[a] + first_block.
  for (int i = 1; i < n; ++i) {
    const int r = (a + i) % n;
    start[r] = std::min(own[r], std::max(idle[r], start[(r + n - 1) % n] + first_block));
  }
  return start;
}

class RingRun {
 public:
  explicit RingRun(const RingJobOptions& o) : o_(o), n_(o.workers) {}

  absl::StatusOr<TimingJobResult> Run() {
    const absl::Time real_start = absl::Now();
    result_.workers.resize(n_);
    ready_.assign(n_, 0);
    steps_.assign(n_, 0);
    skipped_.assign(n_, 0);
    compute_.resize(n_);
    delay_.resize(n_);
    RETURN_IF_ERROR(BuildTraining());
    for (int w = 0; w < n_; ++w) {
      if (!o_.stragglers.empty()) {
        ASSIGN_OR_RETURN(StragglerModel m, StragglerModel::Create(o_.stragglers[w], w));
        models_.push_back(std::move(m));
      }
    }
    for (int w = 0; w < n_; ++w) RETURN_IF_ERROR(StartStep(w, 0));
    ASSIGN_OR_RETURN(const double wall, o_.partial ? RunPartial() : RunSynchronous());
    result_.wall = absl::Seconds(wall);
    result_.events = blocks_;
    result_.real_seconds = absl::ToDoubleSeconds(absl::Now() - real_start);
    return std::move(result_);
  }

 private:
  using Weights = std::vector<std::vector<float>>;

  // The training level's model, weights, optimizer and schedule (AllReduceClient's).
  absl::Status BuildTraining() {
    if (o_.workload == nullptr) {
      elements_ = o_.elements;
      return absl::OkStatus();
    }
    model_ = o_.workload->Model();
    params_ = o_.workload->InitialParams();
    if (params_.size() != model_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("the workload's model has ", model_.size(),
                                                     " tensors and its weights ", params_.size()));
    }
    ASSIGN_OR_RETURN(optimizer_, Optimizer::Create(o_.cluster.optimizer()));
    for (const TensorSpec& t : model_) {
      roles_.push_back(optimizer_->RoleOf(t.name(), t.shape()));
      sizes_.push_back(ElementCount(t.shape()));
      elements_ += sizes_.back();
    }
    states_.resize(model_.size());
    ScheduleContext context;
    context.global_batch = int64_t{o_.batch_size} * n_;
    context.steps_per_epoch = o_.steps_per_epoch > 0 ? o_.steps_per_epoch : o_.steps;
    context.total_steps = o_.steps;
    ASSIGN_OR_RETURN(LearningRateScheduler schedule,
                     LearningRateScheduler::Create(o_.cluster.optimizer().learning_rate(),
                                                   o_.cluster.lr_schedule(), context));
    schedule_.emplace(std::move(schedule));
    grads_.assign(n_, Weights(model_.size()));
    for (int w = 0; w < n_; ++w) {
      for (size_t i = 0; i < model_.size(); ++i) grads_[w][i].resize(sizes_[i]);
    }
    flat_.assign(n_, std::vector<float>(elements_));
    mean_.resize(elements_);
    computed_on_.resize(n_);
    return absl::OkStatus();
  }

  // Worker w computes its next step from `at` on, on the weights of now: when its gradient is
  // ready.
  absl::Status StartStep(int w, double at) {
    absl::Duration compute =
        o_.step_times != nullptr ? o_.step_times->At(w, steps_[w]) : o_.step_time;
    if (o_.workload != nullptr) {
      if (snapshot_ == nullptr) snapshot_ = std::make_shared<const Weights>(params_);
      computed_on_[w] = snapshot_;
      ASSIGN_OR_RETURN(compute, o_.workload->Compute(w, steps_[w], params_, &grads_[w]));
      int64_t offset = 0;
      for (const std::vector<float>& g : grads_[w]) {
        std::copy(g.begin(), g.end(), flat_[w].begin() + offset);
        offset += static_cast<int64_t>(g.size());
      }
    }
    const absl::Duration delay =
        models_.empty() ? absl::ZeroDuration() : models_[w].DelayFor(steps_[w], compute);
    compute_[w] = compute;
    delay_[w] = delay;
    result_.workers[w].compute += compute + delay;
    ready_[w] = at + absl::ToDoubleSeconds(compute + delay);
    return absl::OkStatus();
  }

  // The optimizer step of update `step` with mean_ (AllReduceClient::Apply).
  void Apply(int64_t step) {
    const float lr = static_cast<float>(schedule_->At(step));
    int64_t offset = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      optimizer_->Update(lr, absl::MakeConstSpan(mean_).subspan(offset, sizes_[i]),
                         absl::MakeSpan(params_[i]), roles_[i], &states_[i]);
      offset += sizes_[i];
    }
    snapshot_ = nullptr;  // The weights changed.
  }

  // Worker w's gradient, ready at ready_[w], was applied (or the ring done with) at `end`; the
  // workload hears of the step. Returns when the worker may start its next one.
  absl::StatusOr<double> Done(int w, double end, int64_t staleness) {
    TimingJobResult::Worker& r = result_.workers[w];
    r.waiting += absl::Seconds(end - ready_[w]);
    r.finished = absl::Seconds(end);
    ++r.computed_steps;
    if (o_.workload == nullptr) return end;
    SimStep s;
    s.worker = w;
    s.step = steps_[w];
    s.skipped = skipped_[w];
    s.compute = compute_[w];
    s.delay = delay_[w];
    s.push = absl::Seconds(end - ready_[w]);
    s.at = absl::Seconds(end);
    s.pushed.max_staleness = staleness;
    if (o_.partial) s.pushed.applied_examples = applied_gradients_ * o_.batch_size;
    ASSIGN_OR_RETURN(const absl::Duration extra, o_.workload->StepDone(s, *computed_on_[w]));
    return end + absl::ToDoubleSeconds(extra);
  }

  // Worker w ends at `at` after `steps` steps: the workload's final evaluation.
  absl::Status Finish(int w, double at) {
    TimingJobResult::Worker& r = result_.workers[w];
    r.finished = absl::Seconds(at);
    if (o_.workload == nullptr) return absl::OkStatus();
    ASSIGN_OR_RETURN(const absl::Duration extra,
                     o_.workload->Finished(w, steps_[w], r.computed_steps, r.skipped_steps,
                                           absl::Seconds(at), params_));
    r.finished = absl::Seconds(at) + extra;
    return absl::OkStatus();
  }

  absl::StatusOr<double> RunSynchronous() {
    std::vector<absl::Span<const float>> inputs;
    for (int w = 0; o_.workload != nullptr && w < n_; ++w) inputs.push_back(flat_[w]);
    for (int64_t step = 0; step < o_.steps; ++step) {
      const std::vector<double> ends =
          RingAllReduceEnds(ready_, elements_, o_.segment_elements, o_.host, &blocks_);
      if (o_.workload != nullptr) {
        RingReduceInOrder(inputs, RingMeanScale(n_), absl::MakeSpan(mean_));
        Apply(step);
      }
      for (int w = 0; w < n_; ++w) {
        ASSIGN_OR_RETURN(const double next, Done(w, ends[w], 0));
        ++steps_[w];
        if (step + 1 < o_.steps) {
          RETURN_IF_ERROR(StartStep(w, next));
        } else {
          RETURN_IF_ERROR(Finish(w, next));
        }
      }
    }
    double wall = 0;
    for (const TimingJobResult::Worker& r : result_.workers) {
      wall = std::max(wall, absl::ToDoubleSeconds(r.finished));
    }
    return wall;
  }

  absl::StatusOr<double> RunPartial() {
    const int64_t elements = elements_ + 1;  // The count rides along.
    const int64_t segment =
        o_.segment_elements > 0 ? o_.segment_elements : DefaultRingSegmentElements(elements, n_);
    const double rate = o_.host.nic_bytes_per_second;
    const double latency = absl::ToDoubleSeconds(o_.host.latency);
    auto first_block = [&](int64_t floats) {
      const int64_t first = std::min(segment, Ceil(floats, n_));
      return (4.0 * first + kRingBlockOverheadBytes) / rate + latency;
    };
    const double round_first = first_block(elements);
    const double poll_first = first_block(1);
    const int64_t goal = o_.steps * n_;
    std::vector<double> comm_free(n_, 0.0), own(n_), start;
    std::vector<bool> reported(n_);
    std::vector<absl::Span<const float>> inputs(n_);
    int64_t round = 0;
    while (applied_gradients_ < goal) {
      if (o_.quorum <= 1) {
        for (int w = 0; w < n_; ++w) own[w] = std::max(comm_free[w], ready_[w]);
        start = ActivatedStarts(own, comm_free, round_first);
      } else {
        // Polls until one counts a quorum; the round follows it on every rank.
        std::fill(reported.begin(), reported.end(), false);
        for (;;) {
          for (int w = 0; w < n_; ++w) {
            own[w] = reported[w] ? kNever : std::max(comm_free[w], ready_[w]);
          }
          const std::vector<double> polled = ActivatedStarts(own, comm_free, poll_first);
          int count = 0;
          for (int w = 0; w < n_; ++w) {
            reported[w] = ready_[w] <= polled[w];
            count += reported[w];
          }
          comm_free = RingAllReduceEnds(polled, 1, 0, o_.host, &blocks_);
          if (count >= o_.quorum) break;
        }
        start = comm_free;
      }
      const std::vector<double> ends =
          RingAllReduceEnds(start, elements, segment, o_.host, &blocks_);
      std::vector<int> carried;
      for (int w = 0; w < n_; ++w) {
        if (ready_[w] <= start[w]) carried.push_back(w);
      }
      const int64_t progress = applied_gradients_ / n_;  // The schedule's step.
      applied_gradients_ += static_cast<int64_t>(carried.size());
      ++round;
      if (o_.workload != nullptr) {
        for (int w : carried) inputs[w] = flat_[w];
        // The others send zeros; only the carried ranks' values are read.
        RingReduceInOrder(inputs, 1.0f, absl::MakeSpan(mean_), carried);
        const float inv = 1.0f / static_cast<float>(carried.size());
        for (float& x : mean_) x *= inv;
        Apply(progress);
      }
      for (int w : carried) {
        ASSIGN_OR_RETURN(const double next,
                         Done(w, ends[w], std::max<int64_t>(0, round - 1 - steps_[w])));
        // The training loop's next step: this one's successor, or the rounds done if more.
        const int64_t to = std::max(steps_[w] + 1, round);
        skipped_[w] = to - steps_[w] - 1;  // Reported with the step it leads to.
        result_.workers[w].skipped_steps += skipped_[w];
        steps_[w] = to;
        RETURN_IF_ERROR(StartStep(w, next));
      }
      comm_free = ends;
    }
    const double wall = *std::max_element(comm_free.begin(), comm_free.end());
    for (int w = 0; w < n_; ++w) {
      // A gradient pending at the end is dropped; its worker waited for the end. One still being
      // computed is not counted: the worker stops at the end.
      if (ready_[w] <= comm_free[w]) {
        ++result_.dropped_gradients;
        result_.workers[w].waiting += absl::Seconds(comm_free[w] - ready_[w]);
      } else {
        result_.workers[w].compute -= absl::Seconds(ready_[w] - comm_free[w]);
      }
      RETURN_IF_ERROR(Finish(w, comm_free[w]));
    }
    double end = wall;
    for (const TimingJobResult::Worker& r : result_.workers) {
      end = std::max(end, absl::ToDoubleSeconds(r.finished));
    }
    return end;
  }

  const RingJobOptions& o_;
  const int n_;
  std::vector<StragglerModel> models_;
  std::vector<double> ready_;     // When each worker's current gradient is (or was) ready.
  std::vector<int64_t> steps_;    // Each worker's current step,
  std::vector<int64_t> skipped_;  // and the steps it jumped over to it (a partial ring's).
  std::vector<absl::Duration> compute_, delay_;  // Of each worker's current step.
  int64_t elements_ = 0;
  int64_t blocks_ = 0;
  int64_t applied_gradients_ = 0;  // By the partial rounds so far.
  TimingJobResult result_;
  // The training level.
  std::vector<TensorSpec> model_;
  std::vector<int64_t> sizes_;
  Weights params_;  // Every rank's: they are identical.
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<TensorRole> roles_;
  std::vector<TensorOptimizerState> states_;
  std::optional<LearningRateScheduler> schedule_;
  std::vector<Weights> grads_;            // Each worker's current gradient, by tensor,
  std::vector<std::vector<float>> flat_;  // and end to end.
  std::vector<float> mean_;
  std::shared_ptr<const Weights> snapshot_;  // params_ as they are now, once a worker needed it.
  std::vector<std::shared_ptr<const Weights>> computed_on_;  // Each worker's current step's.
};

}  // namespace

absl::Status ValidateRingJobOptions(const RingJobOptions& o) {
  if (o.workers < 1) return absl::InvalidArgumentError("ring job: workers must be >= 1");
  if (o.steps < 1) return absl::InvalidArgumentError("ring job: steps must be >= 1");
  if (o.quorum < 1 || o.quorum > o.workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring job: quorum ", o.quorum, " is not in [1, ", o.workers, "]"));
  }
  if (!o.partial && o.quorum != o.workers) {
    return absl::InvalidArgumentError("ring job: the synchronous ring's quorum is every worker");
  }
  if (o.step_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ring job: step_time must be >= 0");
  }
  if (o.segment_elements < 0) {
    return absl::InvalidArgumentError("ring job: segment_elements must be >= 0");
  }
  if (o.workload == nullptr && o.elements < 1) {
    return absl::InvalidArgumentError("ring job: elements must be >= 1");
  }
  if (o.workload != nullptr && o.batch_size < 1) {
    return absl::InvalidArgumentError("ring job: batch_size must be >= 1");
  }
  if (!o.stragglers.empty() && static_cast<int>(o.stragglers.size()) != o.workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring job: straggler options for ", o.stragglers.size(), " workers, not ", o.workers));
  }
  return ValidateHostSpec(o.host);
}

std::vector<double> RingAllReduceEnds(const std::vector<double>& start, int64_t elements,
                                      int64_t segment_elements, const HostSpec& host,
                                      int64_t* blocks) {
  const int n = static_cast<int>(start.size());
  if (n <= 1) return start;
  if (segment_elements <= 0) segment_elements = DefaultRingSegmentElements(elements, n);
  const int64_t chunk = Ceil(elements, n);
  const int segments = static_cast<int>(std::max<int64_t>(1, Ceil(chunk, segment_elements)));
  // Each segment's time on the wire; the last may be shorter.
  std::vector<double> wire(segments);
  for (int s = 0; s < segments; ++s) {
    const int64_t floats = std::min(segment_elements, chunk - s * segment_elements);
    wire[s] =
        (4.0 * std::max<int64_t>(floats, 0) + kRingBlockOverheadBytes) / host.nic_bytes_per_second;
  }
  const double latency = absl::ToDoubleSeconds(host.latency);
  // arrived[r * segments + s]: when segment s of the previous step reached rank r.
  std::vector<double> arrived(static_cast<size_t>(n) * segments), next(arrived.size());
  std::vector<double> out_free(start);  // When each rank's NIC is free to send.
  const int steps = 2 * (n - 1);
  for (int k = 0; k < steps; ++k) {
    for (int r = 0; r < n; ++r) {
      const int to = r + 1 == n ? 0 : r + 1;
      const double* in = &arrived[static_cast<size_t>(r) * segments];
      double* out = &next[static_cast<size_t>(to) * segments];
      double t = out_free[r];
      for (int s = 0; s < segments; ++s) {
        // Step 0 sends at the rank's start; later steps after the block they pass on arrived.
        if (k > 0) t = std::max(t, in[s]);
        t += wire[s];
        out[s] = t + latency;
      }
      out_free[r] = t;
    }
    arrived.swap(next);
  }
  if (blocks != nullptr) *blocks += static_cast<int64_t>(steps) * n * segments;
  std::vector<double> end(n);
  for (int r = 0; r < n; ++r) {
    const int to = r + 1 == n ? 0 : r + 1;
    const double* mine = &arrived[static_cast<size_t>(r) * segments];
    const double* theirs = &arrived[static_cast<size_t>(to) * segments];
    // The last block received, and the next rank holding every block sent (Flush).
    end[r] = std::max({start[r], *std::max_element(mine, mine + segments),
                       *std::max_element(theirs, theirs + segments)});
  }
  return end;
}

absl::Status SetRingConsistency(const ConsistencyConfig& consistency, RingJobOptions* o) {
  if (consistency.mode() != ALLREDUCE) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ring job runs allreduce, not ", ConsistencyMode_Name(consistency.mode())));
  }
  o->partial = consistency.allreduce_quorum() != QUORUM_ALL;
  if (!o->partial) {
    o->quorum = o->workers;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(
      o->quorum,
      PartialQuorum(o->workers,
                    consistency.allreduce_quorum() == QUORUM_SOLO ? "solo" : "majority"));
  return absl::OkStatus();
}

absl::StatusOr<TimingJobResult> RunRingJob(const RingJobOptions& options) {
  RETURN_IF_ERROR(ValidateRingJobOptions(options));
  return RingRun(options).Run();
}

}  // namespace rubato
