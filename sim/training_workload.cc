#include "sim/training_workload.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/progress_writer.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

std::vector<absl::Span<const float>> ConstSpans(absl::Span<const std::vector<float>> v) {
  return std::vector<absl::Span<const float>>(v.begin(), v.end());
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingWorkload>> TrainingWorkload::Create(
    TrainingWorkloadOptions o) {
  if (o.train == nullptr || o.train->size == 0) {
    return absl::InvalidArgumentError("the training level needs training data");
  }
  if (o.backend == nullptr) return absl::InvalidArgumentError("the training level needs a backend");
  if (o.spec.input.size() != o.train->dim || ModelNumClasses(o.spec) != o.train->num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", o.model_text, " needs ", o.spec.input.size(), " inputs and ",
                     ModelNumClasses(o.spec), " classes; the data has ", o.train->dim, " and ",
                     o.train->num_classes));
  }
  if (o.num_workers < 1 || o.batch_size < 1 || o.log_every < 1 || o.eval_every < 0 ||
      o.job.steps < 1) {
    return absl::InvalidArgumentError(
        "num_workers, batch_size, log_every and the job's steps must be >= 1, eval_every >= 0");
  }
  if (static_cast<int>(o.progress.size()) != o.num_workers ||
      std::find(o.progress.begin(), o.progress.end(), nullptr) != o.progress.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a progress stream for each of the ", o.num_workers, " workers is needed"));
  }
  if (o.compute_time < absl::ZeroDuration() || o.eval_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("compute_time and eval_time must be >= 0");
  }
  std::unique_ptr<TrainingWorkload> w(new TrainingWorkload(std::move(o)));
  const TrainingWorkloadOptions& opt = w->options_;
  for (int r = 0; r < opt.num_workers; ++r) {
    ASSIGN_OR_RETURN(ShardedBatcher b, ShardedBatcher::Create(opt.train, r, opt.num_workers,
                                                              opt.batch_size, opt.seed));
    w->workers_[r].batcher = std::make_unique<ShardedBatcher>(std::move(b));
  }
  return w;
}

TrainingWorkload::TrainingWorkload(TrainingWorkloadOptions options)
    : options_(std::move(options)),
      specs_(ModelParamSpecs(options_.spec)),
      workers_(options_.num_workers),
      x_(static_cast<size_t>(options_.batch_size) * options_.spec.input.size()),
      y_(options_.batch_size) {}

std::vector<TensorSpec> TrainingWorkload::Model() const {
  std::vector<TensorSpec> model;
  for (const ParamSpec& p : specs_) {
    TensorSpec t;
    t.set_name(p.name);
    for (int64_t d : p.shape) t.add_shape(d);
    model.push_back(std::move(t));
  }
  return model;
}

std::vector<std::vector<float>> TrainingWorkload::InitialParams() const {
  return InitModelParams(options_.spec, options_.seed);
}

void TrainingWorkload::Start() {
  for (int r = 0; r < options_.num_workers; ++r) {
    WriteProgress(
        *options_.progress[r],
        StartProgress(r, options_.job, options_.batch_size, options_.model_text,
                      ModelParamCount(options_.spec), options_.backend->name(),
                      /*overlap=*/false, options_.mode, workers_[r].batcher->shard_size()));
  }
}

absl::StatusOr<absl::Duration> TrainingWorkload::Compute(
    int worker, int64_t step, absl::Span<const std::vector<float>> params,
    std::vector<std::vector<float>>* grads) {
  Worker& w = workers_[worker];
  w.batcher->Next(x_.data(), y_.data());
  std::vector<absl::Span<float>> out(grads->begin(), grads->end());
  absl::StatusOr<float> loss = options_.backend->ForwardBackward(
      ConstSpans(params), x_.data(), y_.data(), options_.batch_size, out);
  if (!loss.ok()) {
    return absl::Status(loss.status().code(),
                        absl::StrCat("step ", step, ": ", loss.status().message()));
  }
  w.loss = *loss;
  return options_.compute_time;
}

absl::StatusOr<absl::Duration> TrainingWorkload::StepDone(
    const SimStep& s, absl::Span<const std::vector<float>> params) {
  Worker& w = workers_[s.worker];
  Interval& i = w.interval;
  if (s.pushed.applied_examples >= 0) w.applied_examples = s.pushed.applied_examples;
  i.loss += w.loss;
  i.compute_s += Seconds(s.compute);
  i.delay_s += Seconds(s.delay);
  i.pull_s += Seconds(s.pull);
  i.push_s += Seconds(s.push);
  i.staleness += s.pushed.max_staleness;
  i.dropped += s.pushed.dropped;
  i.skipped += s.skipped;
  ++i.steps;
  const int64_t done = s.step + 1;
  const int64_t steps = options_.job.steps;
  if (done % options_.log_every == 0 || done == steps) {
    // The step record TrainingLoop writes (without the overlap's fields: no overlap).
    w.final_loss = i.loss / static_cast<double>(i.steps);
    ProgressRecord r;
    *r.mutable_step() =
        StepRecordOf(s.worker, done, w.batcher->epoch(), Seconds(s.at), Seconds(s.at - i.start), i);
    WriteProgress(*options_.progress[s.worker], r, /*flush=*/false);
    i = Interval();
    i.start = s.at;
  }
  // TrainingLoop's rule at a fixed batch: every eval_every steps, but not at the last (the final
  // evaluation follows it).
  if (evaluates(s.worker) && options_.eval_every > 0 && done != steps &&
      done % options_.eval_every == 0) {
    RETURN_IF_ERROR(Evaluate(s.worker, done, s.at, w.applied_examples, params).status());
    return options_.eval_time;
  }
  return absl::ZeroDuration();
}

absl::StatusOr<absl::Duration> TrainingWorkload::Finished(
    int worker, int64_t steps, int64_t computed, int64_t skipped, absl::Duration at,
    absl::Span<const std::vector<float>> params) {
  Worker& w = workers_[worker];
  TrainingResult result;
  result.steps = steps;
  result.final_batch = options_.batch_size;
  result.computed_steps = computed;
  result.skipped_steps = skipped;
  result.final_loss = w.final_loss;
  absl::Duration spent = absl::ZeroDuration();
  const bool evaluated = evaluates(worker);
  if (evaluated) {
    ASSIGN_OR_RETURN(result.test, Evaluate(worker, steps, at, w.applied_examples, params));
    spent = options_.eval_time;
  }
  result.wall_seconds = Seconds(at + spent);
  const std::vector<std::vector<float>> final_params(params.begin(), params.end());
  WriteProgress(*options_.progress[worker], DoneProgress(worker, result, final_params, evaluated));
  return spent;
}

absl::StatusOr<EvalResult> TrainingWorkload::Evaluate(int worker, int64_t step, absl::Duration at,
                                                      int64_t applied_examples,
                                                      absl::Span<const std::vector<float>> params) {
  ASSIGN_OR_RETURN(const EvalResult r, EvaluateWeights(params));
  ProgressRecord record;
  EvalRecord* e = record.mutable_eval();
  e->set_worker(worker);
  e->set_step(step);
  e->set_t(RoundDecimals(Seconds(at), 3));
  e->set_test_loss(RoundDecimals(r.loss, 5));
  e->set_test_accuracy(RoundDecimals(r.accuracy, 5));
  e->set_examples(r.examples);
  const double examples = applied_examples >= 0 ? static_cast<double>(applied_examples)
                                                : static_cast<double>(step) * options_.batch_size *
                                                      options_.num_workers;
  e->set_epochs(RoundDecimals(examples / options_.train->size, 4));
  WriteProgress(*options_.progress[worker], record);
  return r;
}

namespace {

bool SameBits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<EvalResult> TrainingWorkload::EvaluateWeights(
    absl::Span<const std::vector<float>> params) {
  ++evaluations_;
  const std::vector<std::vector<float>> weights(params.begin(), params.end());
  const uint64_t fingerprint = ParamsFingerprint(weights);
  for (const Evaluated& e : evaluated_) {
    if (e.fingerprint == fingerprint && SameBits(e.params, weights)) {
      ++evaluations_reused_;
      return e.result;
    }
  }
  const Dataset& test = *options_.test;
  ASSIGN_OR_RETURN(EvalResult r,
                   options_.backend->Evaluate(ConstSpans(params), test.features.data(),
                                              test.labels.data(), test.size));
  evaluated_.push_front(Evaluated{fingerprint, weights, r});
  if (evaluated_.size() > kEvaluationsKept) evaluated_.pop_back();
  return r;
}

}  // namespace rubato
