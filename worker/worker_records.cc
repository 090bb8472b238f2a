#include "worker/worker_records.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"
#include "common/progress_writer.h"

namespace rubato {

uint64_t ParamsFingerprint(const std::vector<std::vector<float>>& params) {
  uint64_t h = 1469598103934665603ULL;
  for (const std::vector<float>& t : params) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(t.data());
    for (size_t i = 0; i < t.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  }
  return h;
}

JobLength JobLengthOf(int batch_size, int num_workers, int64_t train_examples, int64_t steps,
                      int epochs) {
  JobLength j;
  j.global_batch = int64_t{batch_size} * num_workers;
  j.steps_per_epoch = std::max<int64_t>(1, (train_examples + j.global_batch - 1) / j.global_batch);
  j.steps = steps > 0 ? steps : epochs * j.steps_per_epoch;
  return j;
}

ProgressRecord StartProgress(int worker, const JobLength& job, int batch_size,
                             const std::string& model, int64_t parameters,
                             const std::string& backend, bool overlap, const std::string& mode,
                             int64_t shard_examples) {
  ProgressRecord r;
  StartRecord* s = r.mutable_start();
  s->set_worker(worker);
  s->set_steps(job.steps);
  s->set_steps_per_epoch(job.steps_per_epoch);
  s->set_batch_size(batch_size);
  s->set_global_batch(job.global_batch);
  s->set_model(model);
  s->set_parameters(parameters);
  s->set_backend(backend);
  s->set_overlap(overlap);
  s->set_mode(mode);
  s->set_shard_examples(shard_examples);
  return r;
}

ProgressRecord DoneProgress(int worker, const TrainingResult& result,
                            const std::vector<std::vector<float>>& params, bool evaluated) {
  ProgressRecord r;
  DoneRecord* d = r.mutable_done();
  d->set_worker(worker);
  d->set_steps(result.steps);
  d->set_computed_steps(result.computed_steps);
  d->set_skipped_steps(result.skipped_steps);
  d->set_redone_steps(result.redone_steps);
  d->set_rejoins(result.rejoins);
  d->set_wall_s(RoundDecimals(result.wall_seconds, 3));
  d->set_params_fnv1a(absl::StrFormat("%016x", ParamsFingerprint(params)));
  d->set_train_loss(RoundDecimals(result.final_loss, 5));
  if (evaluated) {
    d->set_test_loss(RoundDecimals(result.test.loss, 5));
    d->set_test_accuracy(RoundDecimals(result.test.accuracy, 5));
  }
  d->set_final_batch(result.final_batch);
  d->set_units(result.units);
  d->set_reassigned_units(result.reassigned_units);
  d->set_layerwise_steps(result.layerwise_steps);
  if (std::isfinite(result.noise_scale)) {
    d->set_noise_scale(RoundSignificant(result.noise_scale, 6));
  }
  return r;
}

ProgressRecord EvalModelProgress(const std::string& path, const ModelFile& about,
                                 const std::string& backend, const EvalResult& result) {
  ProgressRecord r;
  EvalModelRecord* e = r.mutable_eval_model();
  e->set_path(path);
  e->set_model(about.model());
  e->set_steps(about.steps());
  e->set_mode(about.mode());
  e->set_backend(backend);
  e->set_test_loss(RoundDecimals(result.loss, 5));
  e->set_test_accuracy(RoundDecimals(result.accuracy, 5));
  e->set_examples(result.examples);
  e->set_job_test_accuracy(RoundDecimals(about.test_accuracy(), 5));
  return r;
}

ProgressRecord SharpnessProgress(const std::string& path, const ModelFile& about, double epsilon,
                                 int steps, int64_t examples, const SharpnessResult& result) {
  ProgressRecord r;
  SharpnessRecord* s = r.mutable_sharpness();
  s->set_path(path);
  s->set_model(about.model());
  s->set_global_batch(about.global_batch());
  s->set_optimizer(about.optimizer());
  s->set_epsilon(RoundSignificant(epsilon, 6));
  s->set_steps(steps);
  s->set_examples(examples);
  s->set_loss(RoundDecimals(result.loss, 6));
  s->set_max_loss(RoundDecimals(result.max_loss, 6));
  s->set_sharpness(RoundDecimals(result.sharpness, 4));
  s->set_best_step(result.best_step);
  return r;
}

}  // namespace rubato
