#include "worker/training_loop.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/optimizer.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

absl::Status AtStep(int64_t step, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("step ", step, ": ", s.message()));
}

// Simulates a dead worker: no error status, no goodbye to the servers, no "done" record.
[[noreturn]] void InjectedCrash(int64_t step, std::ostream* progress) {
  progress->flush();
  std::fflush(nullptr);
  std::fprintf(stderr, "rubato_worker: injected crash at step %lld\n",
               static_cast<long long>(step));
  std::_Exit(3);
}

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& v) {
  return std::vector<absl::Span<const T>>(v.begin(), v.end());
}

}  // namespace

absl::StatusOr<TrainingResult> RunTraining(const TrainingOptions& options, const MlpSpec& spec,
                                           PsClient* client, MlpBackend* backend,
                                           ShardedBatcher* batcher, const Dataset& test,
                                           std::vector<std::vector<float>>* params,
                                           std::ostream* progress) {
  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  const int64_t batch = batcher->batch_size();
  std::vector<float> x(batch * spec.input_dim);  // (batch, input_dim)
  std::vector<int32_t> y(batch);                 // (batch)
  std::vector<std::vector<float>> grads(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) grads[i].resize(specs[i].elements());
  std::vector<absl::Span<float>> grad_spans(grads.begin(), grads.end());

  auto evaluate = [&](int64_t step, double t) -> absl::StatusOr<EvalResult> {
    ASSIGN_OR_RETURN(EvalResult r, backend->Evaluate(ConstSpans(*params), test.features.data(),
                                                     test.labels.data(), test.size));
    *progress << absl::StrFormat(
                     "{\"event\":\"eval\",\"worker\":%d,\"step\":%d,\"t\":%.3f,"
                     "\"test_loss\":%.5f,\"test_accuracy\":%.5f,\"examples\":%d}",
                     options.worker_id, step, t, r.loss, r.accuracy, r.examples)
              << std::endl;
    return r;
  };

  const absl::Time start = absl::Now();
  absl::Time interval_start = start;
  // Sums over the current log interval, in seconds (comm = pull + push).
  double loss_sum = 0, compute_s = 0, delay_s = 0, pull_s = 0, push_s = 0, grad_norm_sum = 0;
  double staleness_sum = 0;
  int64_t interval_steps = 0, dropped = 0, skipped_steps = 0;
  TrainingResult result;
  int rejoins = 0;
  // Registers again after a server dropped this worker; returns the step to continue from.
  auto rejoin = [&](int64_t step, const absl::Status& why) -> absl::StatusOr<int64_t> {
    if (++rejoins > options.max_rejoins) {
      return absl::Status(why.code(), absl::StrCat("step ", step, ": dropped ", rejoins - 1,
                                                   " times, giving up: ", why.message()));
    }
    ASSIGN_OR_RETURN(const int64_t resume, client->Register(*params, batch, step));
    *progress << absl::StrFormat(
                     "{\"event\":\"rejoin\",\"worker\":%d,\"step\":%d,\"resume_step\":%d,"
                     "\"t\":%.3f}",
                     options.worker_id, step, resume, absl::ToDoubleSeconds(absl::Now() - start))
              << std::endl;
    result.rejoins = rejoins;
    if (resume > step) result.skipped_steps += std::min(resume, options.steps) - step;
    return std::max(resume, step);
  };
  for (int64_t step = options.start_step; step < options.steps; ++step) {
    if (options.current_step != nullptr) options.current_step->store(step);
    if (options.straggler != nullptr && options.straggler->CrashAt(step)) {
      InjectedCrash(step, progress);
    }
    const absl::Time t0 = absl::Now();
    // Pull weights of version `step` (BSP: every worker's step-1 gradient applied).
    int64_t version = step;
    if (absl::Status s = client->Pull(step, absl::MakeSpan(*params), &version);
        absl::IsAborted(s)) {
      ASSIGN_OR_RETURN(const int64_t resume, rejoin(step, s));
      step = resume - 1;
      continue;
    } else {
      RETURN_IF_ERROR(AtStep(step, s));
    }
    if (options.skip_to_current_version && version > step) {
      skipped_steps += std::min(version, options.steps) - step;
      result.skipped_steps += std::min(version, options.steps) - step;
      step = version;
      if (step >= options.steps) break;
    }
    const absl::Time t1 = absl::Now();
    batcher->Next(x.data(), y.data());
    // Forward and backward on this worker's minibatch.
    absl::StatusOr<float> loss =
        backend->ForwardBackward(ConstSpans(*params), x.data(), y.data(), batch, grad_spans);
    RETURN_IF_ERROR(AtStep(step, loss.status()));
    if (options.clip_global_norm > 0) {
      grad_norm_sum += ClipByGlobalNorm(grad_spans, options.clip_global_norm);
    }
    const absl::Time t2 = absl::Now();
    // Injected straggling: this worker computes as if slower, or stalls.
    absl::Time t2_delayed = t2;
    if (options.straggler != nullptr) {
      const absl::Duration delay = options.straggler->DelayFor(step, t2 - t1);
      if (delay > absl::ZeroDuration()) {
        absl::SleepFor(delay);
        t2_delayed = absl::Now();
      }
    }
    // Push this step's gradients; the servers average them over the workers.
    PsClient::PushResult pushed;
    if (absl::Status s = client->Push(step, grads, &pushed); absl::IsAborted(s)) {
      ASSIGN_OR_RETURN(const int64_t resume, rejoin(step, s));
      step = resume - 1;
      continue;
    } else {
      RETURN_IF_ERROR(AtStep(step, s));
    }
    const absl::Time t3 = absl::Now();
    ++result.computed_steps;

    loss_sum += *loss;
    compute_s += absl::ToDoubleSeconds(t2 - t1);
    delay_s += absl::ToDoubleSeconds(t2_delayed - t2);
    pull_s += absl::ToDoubleSeconds(t1 - t0);  // Includes waiting at the barrier.
    push_s += absl::ToDoubleSeconds(t3 - t2_delayed);
    staleness_sum += pushed.max_staleness;
    dropped += pushed.dropped;
    ++interval_steps;
    const int64_t done = step + 1;
    if (done % options.log_every == 0 || done == options.steps) {
      const double elapsed = absl::ToDoubleSeconds(t3 - interval_start);
      result.final_loss = loss_sum / interval_steps;
      *progress << absl::StrFormat(
                       "{\"event\":\"step\",\"worker\":%d,\"step\":%d,\"epoch\":%d,\"t\":%.3f,"
                       "\"loss\":%.5f,\"steps_per_s\":%.2f,\"compute_ms\":%.3f,\"comm_ms\":%.3f,"
                       "\"pull_ms\":%.3f,\"push_ms\":%.3f,\"delay_ms\":%.3f,"
                       "\"staleness\":%.3f,\"dropped\":%d,\"skipped\":%d%s}",
                       options.worker_id, done, batcher->epoch(), absl::ToDoubleSeconds(t3 - start),
                       result.final_loss, interval_steps / std::max(elapsed, 1e-9),
                       1e3 * compute_s / interval_steps, 1e3 * (pull_s + push_s) / interval_steps,
                       1e3 * pull_s / interval_steps, 1e3 * push_s / interval_steps,
                       1e3 * delay_s / interval_steps, staleness_sum / interval_steps, dropped,
                       skipped_steps,
                       options.clip_global_norm > 0
                           ? absl::StrFormat(",\"grad_norm\":%.5f", grad_norm_sum / interval_steps)
                           : "")
                << std::endl;
      interval_start = t3;
      loss_sum = compute_s = delay_s = pull_s = push_s = grad_norm_sum = staleness_sum = 0;
      interval_steps = dropped = skipped_steps = 0;
    }
    if (test.size > 0 && options.eval_every > 0 && done % options.eval_every == 0 &&
        done != options.steps) {
      RETURN_IF_ERROR(evaluate(done, absl::ToDoubleSeconds(absl::Now() - start)).status());
    }
  }
  result.steps = options.steps;
  // The final weights: everything every worker pushed, applied.
  RETURN_IF_ERROR(AtStep(options.steps, client->Pull(options.steps, absl::MakeSpan(*params))));
  if (test.size > 0) {
    ASSIGN_OR_RETURN(result.test,
                     evaluate(options.steps, absl::ToDoubleSeconds(absl::Now() - start)));
  }
  result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

}  // namespace rubato
