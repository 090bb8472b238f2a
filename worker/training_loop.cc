#include "worker/training_loop.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/batch_plan.h"
#include "common/log.h"
#include "common/optimizer.h"
#include "common/progress_writer.h"
#include "common/status_macros.h"
#include "proto/progress.pb.h"
#include "worker/job_noise_scale.h"
#include "worker/push_buckets.h"

namespace rubato {
namespace {

// How long the end of a step waits for the communication thread to have started every push.
constexpr absl::Duration kCommDrainTimeout = absl::Seconds(60);

absl::Status AtStep(int64_t step, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("step ", step, ": ", s.message()));
}

// The time a step's pushes (and the pulls that follow them) were in flight, the union of their
// [started, pulled] intervals, and the part of it inside the compute interval [compute_start,
// compute_end].
struct PushOverlap {
  double busy_s = 0;
  double hidden_s = 0;
};

PushOverlap MeasureOverlap(std::vector<LayerPush> pushes, absl::Time compute_start,
                           absl::Time compute_end) {
  std::sort(pushes.begin(), pushes.end(), [](const LayerPush& a, const LayerPush& b) {
    return a.timing.started < b.timing.started;
  });
  PushOverlap o;
  absl::Time begin = absl::InfinitePast(), end = absl::InfinitePast();
  auto close = [&] {
    if (end <= begin) return;
    o.busy_s += absl::ToDoubleSeconds(end - begin);
    const absl::Time b = std::max(begin, compute_start), e = std::min(end, compute_end);
    if (e > b) o.hidden_s += absl::ToDoubleSeconds(e - b);
  };
  for (const LayerPush& p : pushes) {
    if (p.timing.started > end) {
      close();
      begin = p.timing.started;
      end = p.timing.pulled;
    } else {
      end = std::max(end, p.timing.pulled);
    }
  }
  close();
  return o;
}

// The layer of tensor i in logs: its name up to the first '/' or '.' ("conv1/kernel" -> "conv1").
std::string LayerOfTensor(const std::vector<ParamSpec>& specs, size_t i) {
  return specs[i].name.substr(0, specs[i].name.find_first_of("/."));
}

// push_latency_ms: mean ready-to-acknowledged time per layer.
void AddLatencies(const std::vector<ParamSpec>& specs, const std::vector<double>& sum_s,
                  int64_t steps, StepRecord* record) {
  for (size_t i = specs.size(); i-- > 0;) {
    if (sum_s[i] == 0) continue;
    (*record->mutable_push_latency_ms())[LayerOfTensor(specs, i)] =
        RoundDecimals(1e3 * sum_s[i] / steps, 3);
  }
}

// One step's timestamps, in ms from the start of its compute: when the backward pass ended
// (compute_end_ms) and each push's start, acknowledgement and the end of the pull that follows it
// (pulled_ms; the acknowledgement when none does), in the order they started.
ProgressRecord Overlap(int worker, int64_t step, const std::vector<ParamSpec>& specs,
                       const std::vector<LayerPush>& pushes, absl::Time compute_start,
                       absl::Time compute_end) {
  auto ms = [&](absl::Time t) {
    return RoundDecimals(absl::ToDoubleMilliseconds(t - compute_start), 3);
  };
  ProgressRecord r;
  OverlapRecord* o = r.mutable_overlap();
  o->set_worker(worker);
  o->set_step(step);
  o->set_compute_end_ms(ms(compute_end));
  for (const LayerPush& push : pushes) {
    const bool all = pushes.size() == 1 && pushes[0].ticket == 0;
    OverlapRecord::Push* p = o->add_pushes();
    p->set_layer(all ? "all" : LayerOfTensor(specs, push.first_tensor));
    p->set_start_ms(ms(push.timing.started));
    p->set_ack_ms(ms(push.timing.acknowledged));
    p->set_pulled_ms(ms(push.timing.pulled));
  }
  return r;
}

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& v) {
  return std::vector<absl::Span<const T>>(v.begin(), v.end());
}

}  // namespace

StepRecord StepRecordOf(int worker, int64_t done, int64_t epoch, double t, double elapsed,
                        const StepSums& sums) {
  const double n = static_cast<double>(sums.steps);
  auto ms = [n](double seconds) { return RoundDecimals(1e3 * seconds / n, 3); };
  StepRecord s;
  s.set_worker(worker);
  s.set_step(done);
  s.set_epoch(epoch);
  s.set_t(RoundDecimals(t, 3));
  s.set_loss(RoundDecimals(sums.loss / n, 5));
  s.set_steps_per_s(RoundDecimals(sums.steps / std::max(elapsed, 1e-9), 2));
  s.set_compute_ms(ms(sums.compute_s));
  s.set_comm_ms(ms(sums.pull_s + sums.push_s));
  s.set_pull_ms(ms(sums.pull_s));
  s.set_push_ms(ms(sums.push_s));
  s.set_delay_ms(ms(sums.delay_s));
  s.set_staleness(RoundDecimals(sums.staleness / n, 3));
  s.set_dropped(sums.dropped);
  s.set_skipped(sums.skipped);
  return s;
}

bool OverlapEnabled(const TrainingOptions& options, const PsClient& client, std::string* why_not) {
  std::string reason;
  if (!options.overlap) {
    reason = "--overlap=false";
  } else if (!client.supports_partial_push()) {
    reason = "allreduce reduces all tensors at once";
  } else if (options.clip_global_norm > 0) {
    reason = "clipping by global norm needs every gradient first";
  } else if (options.straggler != nullptr && options.straggler->enabled()) {
    reason = "injected straggler delays stand for compute and must precede the pushes";
  }
  if (why_not != nullptr) *why_not = reason;
  return reason.empty();
}

TrainingLoop::TrainingLoop(const TrainingOptions& options, const ModelSpec& spec, PsClient* client,
                           ModelBackend* backend, ShardedBatcher* batcher, const Dataset& test,
                           std::vector<std::vector<float>>* params, std::ostream* progress)
    : options_(options),
      spec_(spec),
      specs_(ModelParamSpecs(spec)),
      client_(client),
      backend_(backend),
      batcher_(batcher),
      test_(test),
      params_(params),
      progress_(progress),
      overlap_(OverlapEnabled(options, *client, nullptr)),
      batch0_(batcher->batch_size()),
      workers_(std::max(1, options.num_workers)),
      job_examples_(options.steps * batch0_ * workers_),
      batch_(batch0_),
      steps_(options.steps),
      plan_(workers_, batch0_),
      grads_(specs_.size()),
      buckets_(TensorBytes(specs_), options.push_bucket_bytes),
      noise_(client->shard_bytes().size()) {
  for (size_t i = 0; i < specs_.size(); ++i) grads_[i].resize(specs_[i].elements());
  grad_spans_ = std::vector<absl::Span<float>>(grads_.begin(), grads_.end());
  interval_.ready_to_ack_s.assign(specs_.size(), 0);
  if (overlap_ && options.comm_thread) comm_ = std::make_unique<CommThread>();
}

std::vector<int64_t> TrainingLoop::TensorBytes(const std::vector<ParamSpec>& specs) {
  std::vector<int64_t> bytes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    bytes[i] = static_cast<int64_t>(specs[i].elements() * sizeof(float));
  }
  return bytes;
}

double TrainingLoop::Elapsed() const {
  return absl::ToDoubleSeconds(options_.clock->Now() - start_);
}

absl::StatusOr<TrainingResult> TrainingLoop::Run() {
  // The weights are pulled into params_ and the gradients pushed from grads_: a GPU backend
  // copies to and from them directly once they are page-locked.
  std::vector<absl::Span<float>> param_spans(params_->begin(), params_->end());
  if (const absl::Status s = backend_->UseHostBuffers(param_spans, grad_spans_); !s.ok()) {
    RUBATO_LOG(WARNING) << "the weights and gradients stay in pageable memory (their copies to "
                        << "and from " << backend_->name() << " are staged): " << s;
  }
  absl::StatusOr<TrainingResult> result = RunSteps();
  (void)backend_->UseHostBuffers({}, {});
  return result;
}

absl::StatusOr<TrainingResult> TrainingLoop::RunSteps() {
  start_ = options_.clock->Now();
  interval_.start = start_;
  // A worker that starts mid-job (a resumed job, a restarted worker) draws the examples an
  // uninterrupted one would draw from this step on.
  RETURN_IF_ERROR(Adopt(client_->registered_batch_plan(), -1));
  if (options_.start_step > 0) Seek(options_.start_step);
  for (int64_t step = options_.start_step; step < steps_;) {
    ASSIGN_OR_RETURN(step, Step(step));
  }
  result_.steps = steps_;
  result_.final_batch = batch_;
  // The final weights: everything every worker pushed, applied.
  if (prefetched_step_ != steps_) {
    RETURN_IF_ERROR(AtStep(steps_, client_->Pull(steps_, absl::MakeSpan(*params_))));
  }
  if (test_.size > 0) {
    ASSIGN_OR_RETURN(result_.test, Evaluate(steps_));
  }
  result_.wall_seconds = Elapsed();
  result_.noise_scale = noise_.b_simple_ema();
  return result_;
}

// One step: pull -> forward/backward (pushing each layer's gradient as it is final, with
// overlap) -> push. Returns the step to run next: step + 1, or where a rejoin or a skip lands.
absl::StatusOr<int64_t> TrainingLoop::Step(int64_t step) {
  if (options_.current_step != nullptr) options_.current_step->store(step);
  if (options_.straggler != nullptr && options_.straggler->CrashAt(step)) return InjectCrash(step);
  StepTimes t;
  t.start = options_.clock->Now();
  // Layerwise forward: the weights arrive during the forward pass, each layer's as it needs them.
  const bool layerwise = deferred_.has_value();
  if (!layerwise) {
    // Weights of version `step` (bsp: every worker's step-1 gradient applied), unless the last
    // step's pushes pulled them already, layer by layer.
    ASSIGN_OR_RETURN(const PullOutcome pulled, PullWeights(step));
    if (pulled.resume >= 0) return pulled.resume;
    t.pulled = pulled.pulled;
    if (const std::optional<int64_t> last = client_->FinalStep(); last.has_value()) {
      steps_ = std::min(steps_, std::max(*last, step));  // The client ended the job there.
    }
    if (options_.skip_to_current_version && pulled.version > step) {
      // backup:b: this step was applied without us; go on from the servers' version.
      const int64_t skipped = std::min(pulled.version, steps_) - step;
      interval_.skipped += skipped;
      result_.skipped_steps += skipped;
      step = pulled.version;
      if (step >= steps_) return step;
    }
    if (step >= steps_) return step;
  }
  UseBatchOf(step);
  t.drawn = options_.clock->Now();
  ASSIGN_OR_RETURN(rows_, Draw(step));
  if (rows_ == 0) {  // The work feed's data is done: the job ends here for this worker.
    steps_ = step;
    return step;
  }
  const absl::StatusOr<float> loss = ForwardBackward(step, &t);
  if (layerwise) {
    ASSIGN_OR_RETURN(const int64_t next, FinishDeferred(step, &t));
    if (next >= 0) return next;
    t.pulled = true;
    ++result_.layerwise_steps;
  }
  RETURN_IF_ERROR(DrainPushes(step));
  if (loss.ok() && MayDefer(step)) {
    // Its pushes are waited for in the next step's forward pass, layer by layer.
    t.pushed = options_.clock->Now();
    t.deferred = true;
    Deferred d;
    d.step = step;
    d.loss = *loss;
    d.t = t;
    d.pushes = std::move(pushes_);
    d.waited.assign(d.pushes.size(), false);
    deferred_ = std::move(d);
    pushes_.clear();
    prefetched_step_ = -1;
    return step + 1;
  }
  PsClient::PushResult pushed;
  absl::Status push_status = WaitForPushes(step, loss.ok(), &pushed);
  RETURN_IF_ERROR(AtStep(step, loss.status()));
  if (options_.clip_global_norm > 0) {
    interval_.grad_norm += ClipByGlobalNorm(grad_spans_, options_.clip_global_norm);
  }
  Straggle(step, &t);
  if (!overlap_) push_status = PushAll(step, t.computed_delayed, &pushed);
  if (absl::IsAborted(push_status)) return Rejoin(step, push_status, /*drawn=*/true);
  RETURN_IF_ERROR(AtStep(step, push_status));
  t.pushed = options_.clock->Now();
  ++result_.computed_steps;
  RETURN_IF_ERROR(AtStep(step, Account(step, *loss, t, pushed, pushes_)));
  return step + 1;
}

bool TrainingLoop::MayDefer(int64_t step) const {
  // Overlap (partial pushes, each with its pull) is off for straggler injection and for the one
  // client that may end the job early (the partial all-reduce: FinalStep).
  if (!options_.layerwise_forward || !overlap_ || !start_error_.ok()) return false;
  // What the step's answers decide for the next one must be known before it starts.
  if (options_.adaptive_batch || options_.skip_to_current_version || options_.work != nullptr) {
    return false;
  }
  // The last step's weights are pulled by the loop's end; an evaluation needs them all, and the
  // backend between two passes.
  if (step + 1 >= steps_ || EvalDue(step + 1)) return false;
  size_t tensors = 0;
  for (const LayerPush& p : pushes_) tensors += p.tensors;
  return tensors == specs_.size();  // Every tensor's pull follows its push.
}

void TrainingLoop::WaitDeferred(size_t i) {
  Deferred& d = *deferred_;
  LayerPush& p = d.pushes[i];
  const absl::Status s = client_->WaitPush(p.ticket, &d.pushed, &p.timing);
  d.waited[i] = true;
  if (d.status.ok()) d.status = s;
}

absl::Status TrainingLoop::AwaitWeights(size_t first, size_t count) {
  Deferred& d = *deferred_;
  if (d.completed) return absl::OkStatus();
  const absl::Time start = options_.clock->Now();
  for (size_t i = 0; i < d.pushes.size(); ++i) {
    const LayerPush& p = d.pushes[i];
    if (!d.waited[i] && p.first_tensor < first + count && first < p.first_tensor + p.tensors) {
      WaitDeferred(i);
    }
  }
  d.t.next_forward_wait += options_.clock->Now() - start;
  // A failure stops the pass; FinishDeferred deals with it.
  if (!d.status.ok()) return d.status;
  if (std::find(d.waited.begin(), d.waited.end(), false) != d.waited.end()) {
    return absl::OkStatus();
  }
  d.completed = true;
  d.status = Complete(d);
  return d.status;
}

absl::Status TrainingLoop::Complete(const Deferred& d) {
  ++result_.computed_steps;
  return AtStep(d.step, Account(d.step, d.loss, d.t, d.pushed, d.pushes));
}

absl::StatusOr<int64_t> TrainingLoop::FinishDeferred(int64_t step, StepTimes* t) {
  // The pushes the pass did not wait for (it stopped before their layers): none outlives the
  // step it belongs to.
  for (size_t i = 0; i < deferred_->pushes.size(); ++i) {
    if (!deferred_->waited[i]) WaitDeferred(i);
  }
  Deferred d = std::move(*deferred_);
  deferred_.reset();
  t->weights_wait = d.t.next_forward_wait;
  if (d.status.ok() && !d.completed) {
    d.completed = true;
    d.status = Complete(d);
  }
  if (d.status.ok()) return -1;
  if (d.completed) return d.status;  // The accounting's error, which names the step.
  // A push of the step before failed; this step's pass stopped before it pushed anything.
  if (!absl::IsAborted(d.status)) return AtStep(d.step, d.status);
  ASSIGN_OR_RETURN(const int64_t next, Rejoin(d.step, d.status, /*drawn=*/true));
  // This step's batch was drawn for nothing: draw on from where the step to run next begins (a
  // batcher's position follows from the step; a work feed never defers a step).
  if (next < steps_) Seek(next);
  return next;
}

bool TrainingLoop::EvalDue(int64_t done) const {
  // Every eval_every steps' worth of examples at the starting batch (every eval_every steps
  // when the batch does not change).
  if (test_.size == 0 || options_.eval_every <= 0 || done == steps_) return false;
  const int64_t eval_examples = options_.eval_every * batch0_ * workers_;
  return plan_.ExamplesBefore(done) / eval_examples >
         plan_.ExamplesBefore(done - 1) / eval_examples;
}

absl::Status TrainingLoop::InjectCrash(int64_t step) {
  progress_->flush();
  if (options_.on_injected_crash) options_.on_injected_crash(step);
  return absl::InternalError(absl::StrCat("injected crash at step ", step));
}

absl::StatusOr<TrainingLoop::PullOutcome> TrainingLoop::PullWeights(int64_t step) {
  PullOutcome out;
  out.version = step;
  absl::Status status;
  if (prefetched_step_ == step) {
    out.version = prefetched_version_;
  } else {
    status = client_->Pull(step, absl::MakeSpan(*params_), &out.version);
    out.pulled = true;
  }
  prefetched_step_ = -1;
  if (absl::IsAborted(status)) {
    ASSIGN_OR_RETURN(out.resume, Rejoin(step, status, /*drawn=*/false));
    return out;
  }
  RETURN_IF_ERROR(AtStep(step, status));
  return out;
}

void TrainingLoop::UseBatchOf(int64_t step) {
  if (options_.adaptive_batch) {
    if (const int b = plan_.BatchAt(step); b != batch_) {
      batch_ = b;
      batcher_->SetBatchSize(b);
    }
    client_->SetPushExtras(batch_, noise_.relay());
  }
  x_.resize(static_cast<size_t>(batch_) * spec_.input.size());
  y_.resize(batch_);
}

absl::StatusOr<int> TrainingLoop::Draw(int64_t step) {
  if (options_.work == nullptr) {
    batcher_->Next(x_.data(), y_.data());
    return batch_;
  }
  std::optional<WorkUnit> began;
  absl::StatusOr<int> rows = options_.work->Next(x_.data(), y_.data(), &began);
  if (!rows.ok()) return AtStep(step, rows.status());
  if (began.has_value()) {
    ++result_.units;
    if (began->owner() != options_.worker_id) ++result_.reassigned_units;
    ProgressRecord r;
    UnitRecord* u = r.mutable_unit();
    u->set_worker(options_.worker_id);
    u->set_step(step);
    u->set_epoch(began->epoch());
    u->set_owner(began->owner());
    u->set_unit(began->index());
    u->set_seq(began->seq());
    u->set_t(RoundDecimals(Elapsed(), 3));
    WriteProgress(*progress_, r, /*flush=*/false);
  }
  return *rows;
}

absl::StatusOr<float> TrainingLoop::ForwardBackward(int64_t step, StepTimes* t) {
  pushes_.clear();
  start_error_ = absl::OkStatus();
  GradientsReady ready = nullptr;
  if (overlap_) {
    ready = [this, step](size_t first, size_t count) {
      // The layer's host gradients are final once awaited (on a GPU, their copy may still run).
      Communicate(absl::StrCat("the push of ", LayerOfTensor(specs_, first), " at step ", step),
                  [this, step, first, count, ranges = buckets_.Add(first, count)] {
                    const absl::Status copied = backend_->AwaitGradients(first, count);
                    if (!copied.ok()) {
                      if (start_error_.ok()) start_error_ = copied;
                      return;
                    }
                    StartPushes(step, ranges);
                  });
    };
  }
  WeightsNeeded needed = nullptr;
  if (deferred_.has_value()) {
    needed = [this](size_t first, size_t count) { return AwaitWeights(first, count); };
  }
  absl::StatusOr<float> loss = backend_->ForwardBackward(ConstSpans(*params_), x_.data(), y_.data(),
                                                         rows_, grad_spans_, ready, needed);
  if (overlap_) {
    // The layers still in the bucket; none after a failed pass (its gradients are not final).
    std::vector<PushBuckets::Range> rest = buckets_.Flush();
    if (loss.ok() && !rest.empty()) {
      Communicate(absl::StrCat("the last push of step ", step),
                  [this, step, rest = std::move(rest)] { StartPushes(step, rest); });
    }
  }
  t->computed = options_.clock->Now();
  t->computed_delayed = t->computed;
  return loss;
}

void TrainingLoop::Communicate(std::string what, std::function<void()> task) {
  if (comm_ == nullptr) {
    task();
  } else {
    comm_->Post(std::move(what), std::move(task));
  }
}

void TrainingLoop::StartPushes(int64_t step, const std::vector<PushBuckets::Range>& ranges) {
  if (!start_error_.ok()) return;  // A gradient copy failed: the step's pushes are over.
  for (const PushBuckets::Range& r : ranges) {
    std::vector<int> tensors(r.count);
    for (size_t k = 0; k < r.count; ++k) tensors[k] = static_cast<int>(r.first + k);
    absl::StatusOr<int64_t> ticket = client_->StartPush(step, tensors, grads_, params_);
    if (!ticket.ok()) {
      if (start_error_.ok()) start_error_ = ticket.status();
      return;
    }
    pushes_.push_back({*ticket, r.first, r.count});
  }
}

absl::Status TrainingLoop::DrainPushes(int64_t step) {
  // Every push has started once the communication thread is idle (a bounded wait: it only
  // encodes, writes what the sockets take and waits for the device's copies).
  if (comm_ == nullptr) return absl::OkStatus();
  return AtStep(step, comm_->Drain(kCommDrainTimeout));
}

absl::Status TrainingLoop::WaitForPushes(int64_t step, bool computed,
                                         PsClient::PushResult* pushed) {
  // Wait for every push that started, even after an error, so none outlives its step.
  absl::Status status = start_error_;
  size_t pulled_tensors = 0;
  for (LayerPush& p : pushes_) {
    absl::Status s = client_->WaitPush(p.ticket, pushed, &p.timing);
    if (status.ok()) status = s;
    pulled_tensors += p.tensors;
  }
  if (overlap_ && status.ok() && computed && pulled_tensors == specs_.size()) {
    prefetched_step_ = step + 1;
    prefetched_version_ = pushed->min_version;
  }
  return status;
}

void TrainingLoop::Straggle(int64_t step, StepTimes* t) {
  // Injected straggling: this worker computes as if slower, or stalls.
  if (options_.straggler == nullptr) return;
  const absl::Duration delay = options_.straggler->DelayFor(step, t->computed - t->drawn);
  if (delay > absl::ZeroDuration()) {
    options_.clock->SleepFor(delay);
    t->computed_delayed = options_.clock->Now();
  }
}

absl::Status TrainingLoop::PushAll(int64_t step, absl::Time computed,
                                   PsClient::PushResult* pushed) {
  // All of this step's gradients at once; the servers average them over the workers.
  absl::Status status = client_->Push(step, grads_, pushed);
  const absl::Time acknowledged = options_.clock->Now();
  pushes_.assign(1, LayerPush{0, 0, specs_.size(), {computed, acknowledged, acknowledged}});
  return status;
}

absl::Status TrainingLoop::Account(int64_t step, float loss, const StepTimes& t,
                                   const PsClient::PushResult& pushed,
                                   const std::vector<LayerPush>& pushes) {
  Interval& i = interval_;
  if (pushed.applied_examples >= 0) applied_examples_ = pushed.applied_examples;
  i.loss += loss;
  i.compute_s += absl::ToDoubleSeconds(t.computed - t.drawn - t.weights_wait);
  i.delay_s += absl::ToDoubleSeconds(t.computed_delayed - t.computed);
  // Includes waiting at the barrier (and, layerwise, in the forward pass); a step whose weights
  // came with the last pushes pulled nothing (not even the microseconds of bookkeeping counted as
  // pulling).
  if (t.pulled) i.pull_s += absl::ToDoubleSeconds(t.drawn - t.start + t.weights_wait);
  i.push_s += absl::ToDoubleSeconds(t.pushed - t.computed_delayed);
  PushOverlap o = MeasureOverlap(pushes, t.drawn, t.computed);
  if (t.deferred) {
    // Hidden: all but what the compute thread waited for, after the backward pass and in the
    // next step's forward pass.
    o.hidden_s = std::max(
        0.0, o.busy_s - absl::ToDoubleSeconds(t.pushed - t.computed + t.next_forward_wait));
  }
  i.push_busy_s += o.busy_s;
  i.push_hidden_s += o.hidden_s;
  for (const LayerPush& p : pushes) {
    i.ready_to_ack_s[p.first_tensor] +=
        absl::ToDoubleSeconds(p.timing.acknowledged - p.timing.started);
  }
  i.staleness += pushed.max_staleness;
  if (!pushed.noise.empty()) {
    // Every worker sees the same figures; worker 0 writes them. Not flushed: a write per step
    // (and the reader woken for it) cost the 2-core demo 20% of its wall time; they go out
    // with the next step record, every log interval.
    const std::string record = noise_.Update(options_.worker_id, pushed.noise);
    if (!record.empty() && options_.worker_id == 0) *progress_ << record << '\n';
  }
  RETURN_IF_ERROR(Adopt(pushed.batch_changes, step));
  RETURN_IF_ERROR(AdoptConsistency(step, t, pushed));
  i.dropped += pushed.dropped;
  ++i.steps;
  const int64_t done = step + 1;
  if (done % options_.log_every == 0 || done == steps_) Report(done, t, pushes);
  if (EvalDue(done)) RETURN_IF_ERROR(Evaluate(done).status());
  return absl::OkStatus();
}

void TrainingLoop::Report(int64_t done, const StepTimes& t, const std::vector<LayerPush>& pushes) {
  Interval& i = interval_;
  const double n = static_cast<double>(i.steps);
  result_.final_loss = i.loss / n;
  auto ms = [n](double seconds) { return RoundDecimals(1e3 * seconds / n, 3); };
  ProgressRecord r;
  StepRecord* s = r.mutable_step();
  *s = StepRecordOf(options_.worker_id, done,
                    options_.work != nullptr ? options_.work->epoch() : batcher_->epoch(),
                    absl::ToDoubleSeconds(t.pushed - start_),
                    absl::ToDoubleSeconds(t.pushed - i.start), i);
  s->set_overlap(overlap_);
  s->set_push_busy_ms(ms(i.push_busy_s));
  s->set_hidden_fraction(
      RoundDecimals(i.push_busy_s > 0 ? i.push_hidden_s / i.push_busy_s : 0.0, 4));
  if (overlap_) AddLatencies(specs_, i.ready_to_ack_s, i.steps, s);
  if (options_.clip_global_norm > 0) s->set_grad_norm(RoundDecimals(i.grad_norm / n, 5));
  WriteProgress(*progress_, r);
  WriteProgress(*progress_, Overlap(options_.worker_id, done, specs_, pushes, t.drawn, t.computed));
  std::vector<double> ready_to_ack = std::move(i.ready_to_ack_s);
  std::fill(ready_to_ack.begin(), ready_to_ack.end(), 0.0);
  i = Interval();
  i.start = t.pushed;
  i.ready_to_ack_s = std::move(ready_to_ack);
}

absl::StatusOr<EvalResult> TrainingLoop::Evaluate(int64_t step) {
  const double t = Elapsed();
  ASSIGN_OR_RETURN(EvalResult r, backend_->Evaluate(ConstSpans(*params_), test_.features.data(),
                                                    test_.labels.data(), test_.size));
  ProgressRecord record;
  EvalRecord* e = record.mutable_eval();
  e->set_worker(options_.worker_id);
  e->set_step(step);
  e->set_t(RoundDecimals(t, 3));
  e->set_test_loss(RoundDecimals(r.loss, 5));
  e->set_test_accuracy(RoundDecimals(r.accuracy, 5));
  e->set_examples(r.examples);
  if (options_.work != nullptr) {
    e->set_epochs(RoundDecimals(options_.work->epochs(), 4));
  } else if (applied_examples_ >= 0 && options_.train_examples > 0) {
    e->set_epochs(
        RoundDecimals(static_cast<double>(applied_examples_) / options_.train_examples, 4));
  } else if (options_.train_examples > 0) {
    e->set_epochs(RoundDecimals(
        static_cast<double>(plan_.ExamplesBefore(step)) / options_.train_examples, 4));
  }
  WriteProgress(*progress_, record);
  return r;
}

absl::Status TrainingLoop::AdoptConsistency(int64_t step, const StepTimes& t,
                                            const PsClient::PushResult& pushed) {
  const double ms = 1e3 * absl::ToDoubleSeconds(t.computed_delayed - t.drawn - t.weights_wait);
  compute_ms_ema_ = NextComputeMsMean(compute_ms_ema_, ms);
  client_->SetComputeMs(compute_ms_ema_, step, ms);
  std::vector<ConsistencyChange> learned;
  RETURN_IF_ERROR(client_->AdoptConsistency(pushed.consistency_changes, &learned));
  if (options_.worker_id != 0) return absl::OkStatus();
  for (const ConsistencyChange& c : learned) {
    ProgressRecord r;
    ConsistencyRecord* k = r.mutable_consistency();
    k->set_worker(options_.worker_id);
    k->set_step(c.from_step());
    k->set_backup_workers(c.backup_workers());
    k->set_staleness(c.staleness());
    for (double ms : c.compute_ms()) k->add_compute_ms(RoundDecimals(ms, 2));
    k->set_expected_step_ms(RoundDecimals(c.expected_step_ms(), 2));
    k->set_gain(RoundDecimals(c.gain(), 3));
    k->set_t(RoundDecimals(Elapsed(), 3));
    WriteProgress(*progress_, r, /*flush=*/false);
  }
  return absl::OkStatus();
}

absl::Status TrainingLoop::Adopt(const std::vector<BatchChange>& changes, int64_t computed) {
  if (!options_.adaptive_batch) return absl::OkStatus();
  for (const BatchChange& c : changes) {
    const std::vector<BatchChange>& have = plan_.changes();
    auto same = std::find_if(have.begin(), have.end(),
                             [&](const BatchChange& h) { return h.from_step() == c.from_step(); });
    if (same != have.end()) {
      if (same->batch_size() != c.batch_size()) {
        return absl::InternalError(absl::StrCat("the shards disagree on the batch from step ",
                                                c.from_step(), ": ", same->batch_size(), " and ",
                                                c.batch_size()));
      }
      continue;
    }
    if (computed >= 0 && c.from_step() <= computed) {
      return absl::InternalError(absl::StrCat("a batch change from step ", c.from_step(),
                                              " arrived after step ", computed, " was computed"));
    }
    // A change past the job's end could not be applied (and would make the examples it counts
    // overflow).
    if (c.from_step() > steps_) {
      return absl::InternalError(absl::StrCat("the servers announced a batch change from step ",
                                              c.from_step(), ", past the job's ", steps_,
                                              " steps"));
    }
    if (absl::Status s = plan_.Add(c); !s.ok()) {
      return absl::InternalError(absl::StrCat("the servers announced ", s.message()));
    }
    steps_ = plan_.TotalSteps(job_examples_);
    if (options_.worker_id == 0) {
      ProgressRecord r;
      BatchRecord* b = r.mutable_batch();
      b->set_worker(options_.worker_id);
      b->set_step(c.from_step());
      b->set_batch_size(c.batch_size());
      b->set_global_batch(c.global_batch());
      b->set_b_simple(RoundSignificant(c.b_simple(), 6));
      b->set_learning_rate(RoundSignificant(c.learning_rate(), 6));
      b->set_steps(steps_);
      b->set_t(RoundDecimals(Elapsed(), 3));
      WriteProgress(*progress_, r);
    }
  }
  return absl::OkStatus();
}

void TrainingLoop::Seek(int64_t step) {
  batch_ = plan_.BatchAt(step);
  batcher_->SetBatchSize(batch_);
  batcher_->SeekToExample(plan_.ExamplesBefore(step) / workers_);
}

absl::StatusOr<int64_t> TrainingLoop::Rejoin(int64_t step, const absl::Status& why, bool drawn) {
  if (++result_.rejoins > options_.max_rejoins) {
    return absl::Status(why.code(), absl::StrCat("step ", step, ": dropped ", result_.rejoins - 1,
                                                 " times, giving up: ", why.message()));
  }
  ASSIGN_OR_RETURN(const int64_t resume, client_->Register(*params_, batch0_, step));
  RETURN_IF_ERROR(Adopt(client_->registered_batch_plan(), -1));
  ProgressRecord r;
  RejoinRecord* rejoin = r.mutable_rejoin();
  rejoin->set_worker(options_.worker_id);
  rejoin->set_step(step);
  rejoin->set_resume_step(resume);
  rejoin->set_t(RoundDecimals(Elapsed(), 3));
  WriteProgress(*progress_, r);
  if (resume > step) result_.skipped_steps += std::min(resume, steps_) - step;
  if (options_.rewind_on_rejoin && (resume < step || (resume == step && drawn))) {
    result_.redone_steps += step - resume + (drawn ? 1 : 0);
    Seek(resume);
    return resume;
  }
  return std::max(resume, step);
}

absl::StatusOr<TrainingResult> RunTraining(const TrainingOptions& options, const ModelSpec& spec,
                                           PsClient* client, ModelBackend* backend,
                                           ShardedBatcher* batcher, const Dataset& test,
                                           std::vector<std::vector<float>>* params,
                                           std::ostream* progress) {
  return TrainingLoop(options, spec, client, backend, batcher, test, params, progress).Run();
}

}  // namespace rubato
