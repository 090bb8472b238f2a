#include "worker/training_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/batch_plan.h"
#include "common/optimizer.h"
#include "common/status_macros.h"
#include "worker/job_noise_scale.h"
#include "worker/push_buckets.h"

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

// One push of a step: a layer's tensors [first_tensor, ...) with overlap, every tensor without.
struct LayerPush {
  int64_t ticket = 0;
  size_t first_tensor = 0;
  size_t tensors = 0;
  PsClient::PushTiming timing;
};

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

// ,"push_latency_ms":{"dense2":1.234,...}: mean ready-to-acknowledged time per layer, last first.
std::string LatencyField(const std::vector<ParamSpec>& specs, const std::vector<double>& sum_s,
                         int64_t steps) {
  std::string out = ",\"push_latency_ms\":{";
  bool first = true;
  for (size_t i = specs.size(); i-- > 0;) {
    if (sum_s[i] == 0) continue;
    absl::StrAppendFormat(&out, "%s\"%s\":%.3f", first ? "" : ",", LayerOfTensor(specs, i),
                          1e3 * sum_s[i] / steps);
    first = false;
  }
  return out + "}";
}

// One step's timestamps, in ms from the start of its compute: when the backward pass ended
// (compute_end_ms) and each push's start, acknowledgement and the end of the pull that follows it
// (pulled_ms; the acknowledgement when none does), in the order they started.
std::string OverlapRecord(int worker, int64_t step, const std::vector<ParamSpec>& specs,
                          const std::vector<LayerPush>& pushes, absl::Time compute_start,
                          absl::Time compute_end) {
  auto ms = [&](absl::Time t) { return absl::ToDoubleMilliseconds(t - compute_start); };
  std::string out = absl::StrFormat(
      "{\"event\":\"overlap\",\"worker\":%d,\"step\":%d,\"compute_end_ms\":%.3f,"
      "\"pushes\":[",
      worker, step, ms(compute_end));
  for (size_t k = 0; k < pushes.size(); ++k) {
    const bool all = pushes.size() == 1 && pushes[0].ticket == 0;
    absl::StrAppendFormat(
        &out, "%s{\"layer\":\"%s\",\"start_ms\":%.3f,\"ack_ms\":%.3f,\"pulled_ms\":%.3f}",
        k == 0 ? "" : ",", all ? "all" : LayerOfTensor(specs, pushes[k].first_tensor),
        ms(pushes[k].timing.started), ms(pushes[k].timing.acknowledged),
        ms(pushes[k].timing.pulled));
  }
  return out + "]}";
}

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& v) {
  return std::vector<absl::Span<const T>>(v.begin(), v.end());
}

}  // namespace

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

absl::StatusOr<TrainingResult> RunTraining(const TrainingOptions& options, const ModelSpec& spec,
                                           PsClient* client, ModelBackend* backend,
                                           ShardedBatcher* batcher, const Dataset& test,
                                           std::vector<std::vector<float>>* params,
                                           std::ostream* progress) {
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const int batch0 = batcher->batch_size();
  int batch = batch0;
  const bool overlap = OverlapEnabled(options, *client, nullptr);
  std::vector<float> x(batch * spec.input.size());  // (batch, input size)
  std::vector<int32_t> y(batch);                    // (batch)
  std::vector<std::vector<float>> grads(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) grads[i].resize(specs[i].elements());
  std::vector<absl::Span<float>> grad_spans(grads.begin(), grads.end());

  // The batch plan (one batch throughout unless adaptive), the job's examples and its steps.
  const int workers = std::max(1, options.num_workers);
  BatchPlan plan(workers, batch0);
  const int64_t job_examples = options.steps * batch0 * workers;
  int64_t steps = options.steps;

  auto evaluate = [&](int64_t step, double t) -> absl::StatusOr<EvalResult> {
    ASSIGN_OR_RETURN(EvalResult r, backend->Evaluate(ConstSpans(*params), test.features.data(),
                                                     test.labels.data(), test.size));
    *progress << absl::StrFormat(
                     "{\"event\":\"eval\",\"worker\":%d,\"step\":%d,\"t\":%.3f,"
                     "\"test_loss\":%.5f,\"test_accuracy\":%.5f,\"examples\":%d%s}",
                     options.worker_id, step, t, r.loss, r.accuracy, r.examples,
                     options.train_examples > 0
                         ? absl::StrFormat(",\"epochs\":%.4f",
                                           static_cast<double>(plan.ExamplesBefore(step)) /
                                               options.train_examples)
                         : "")
              << std::endl;
    return r;
  };

  const absl::Time start = absl::Now();
  absl::Time interval_start = start;
  // Sums over the current log interval, in seconds (comm = pull + push).
  double loss_sum = 0, compute_s = 0, delay_s = 0, pull_s = 0, push_s = 0, grad_norm_sum = 0;
  double staleness_sum = 0;
  int64_t interval_steps = 0, dropped = 0, skipped_steps = 0;
  // Overlap accounting over the interval: time pushes were in flight (the union of their
  // intervals), the part of it inside the step's compute, and per layer (by its first tensor) the
  // summed time from gradient ready to push acknowledged.
  double push_busy_s = 0, push_hidden_s = 0;
  std::vector<double> ready_to_ack_s(specs.size(), 0);
  std::vector<LayerPush> pushes;
  std::vector<int64_t> tensor_bytes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    tensor_bytes[i] = static_cast<int64_t>(specs[i].elements() * sizeof(float));
  }
  PushBuckets buckets(std::move(tensor_bytes), options.push_bucket_bytes);
  // With overlap, each layer's push is followed by its pull for the next step; when every tensor
  // was pulled that way, the next step skips its pull.
  int64_t prefetched_step = -1, prefetched_version = 0;
  TrainingResult result;
  JobNoiseScale noise(client->shard_bytes().size());
  // Adaptive batch: takes the changes the shards announced. `computed` is the last step this
  // worker has computed (-1 at registration, when they are the job's history): a change for a
  // step already computed cannot be applied and is an error, as are shards that disagree.
  auto adopt = [&](const std::vector<BatchChange>& changes, int64_t computed) -> absl::Status {
    if (!options.adaptive_batch) return absl::OkStatus();
    for (const BatchChange& c : changes) {
      const std::vector<BatchChange>& have = plan.changes();
      auto same = std::find_if(have.begin(), have.end(), [&](const BatchChange& h) {
        return h.from_step() == c.from_step();
      });
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
      if (c.from_step() > steps) {
        return absl::InternalError(absl::StrCat("the servers announced a batch change from step ",
                                                c.from_step(), ", past the job's ", steps,
                                                " steps"));
      }
      if (absl::Status s = plan.Add(c); !s.ok()) {
        return absl::InternalError(absl::StrCat("the servers announced ", s.message()));
      }
      steps = plan.TotalSteps(job_examples);
      if (options.worker_id == 0) {
        *progress << absl::StrFormat(
                         "{\"event\":\"batch\",\"worker\":%d,\"step\":%d,\"batch_size\":%d,"
                         "\"global_batch\":%d,\"b_simple\":%.6g,\"learning_rate\":%.6g,"
                         "\"steps\":%d,\"t\":%.3f}",
                         options.worker_id, c.from_step(), c.batch_size(), c.global_batch(),
                         c.b_simple(), c.learning_rate(), steps,
                         absl::ToDoubleSeconds(absl::Now() - start))
                  << std::endl;
      }
    }
    return absl::OkStatus();
  };
  // Draws the examples an uninterrupted worker would draw from `step` on.
  auto seek = [&](int64_t step) {
    batch = plan.BatchAt(step);
    batcher->SetBatchSize(batch);
    batcher->SeekToExample(plan.ExamplesBefore(step) / workers);
  };
  int rejoins = 0;
  // Registers again after a server dropped this worker (or was restored); returns the step to
  // continue from. `drawn`: this step's batch was drawn already (its push failed), so going back
  // to it draws that batch again.
  auto rejoin = [&](int64_t step, const absl::Status& why, bool drawn) -> absl::StatusOr<int64_t> {
    if (++rejoins > options.max_rejoins) {
      return absl::Status(why.code(), absl::StrCat("step ", step, ": dropped ", rejoins - 1,
                                                   " times, giving up: ", why.message()));
    }
    ASSIGN_OR_RETURN(const int64_t resume, client->Register(*params, batch0, step));
    RETURN_IF_ERROR(adopt(client->registered_batch_plan(), -1));
    *progress << absl::StrFormat(
                     "{\"event\":\"rejoin\",\"worker\":%d,\"step\":%d,\"resume_step\":%d,"
                     "\"t\":%.3f}",
                     options.worker_id, step, resume, absl::ToDoubleSeconds(absl::Now() - start))
              << std::endl;
    result.rejoins = rejoins;
    if (resume > step) result.skipped_steps += std::min(resume, steps) - step;
    if (options.rewind_on_rejoin && (resume < step || (resume == step && drawn))) {
      result.redone_steps += step - resume + (drawn ? 1 : 0);
      seek(resume);
      return resume;
    }
    return std::max(resume, step);
  };
  // A worker that starts mid-job (a resumed job, a restarted worker) draws the examples an
  // uninterrupted one would draw from this step on.
  RETURN_IF_ERROR(adopt(client->registered_batch_plan(), -1));
  if (options.start_step > 0) seek(options.start_step);
  for (int64_t step = options.start_step; step < steps; ++step) {
    if (options.current_step != nullptr) options.current_step->store(step);
    if (options.straggler != nullptr && options.straggler->CrashAt(step)) {
      InjectedCrash(step, progress);
    }
    const absl::Time t0 = absl::Now();
    // Pull weights of version `step` (BSP: every worker's step-1 gradient applied), unless the
    // last step's pushes pulled them already, layer by layer.
    int64_t version = step;
    absl::Status pull_status;
    bool pulled = false;
    if (prefetched_step == step) {
      version = prefetched_version;
    } else {
      pull_status = client->Pull(step, absl::MakeSpan(*params), &version);
      pulled = true;
    }
    prefetched_step = -1;
    if (absl::Status s = pull_status; absl::IsAborted(s)) {
      ASSIGN_OR_RETURN(const int64_t resume, rejoin(step, s, /*drawn=*/false));
      step = resume - 1;
      continue;
    } else {
      RETURN_IF_ERROR(AtStep(step, s));
    }
    if (options.skip_to_current_version && version > step) {
      skipped_steps += std::min(version, steps) - step;
      result.skipped_steps += std::min(version, steps) - step;
      step = version;
      if (step >= steps) break;
    }
    if (options.adaptive_batch) {
      if (const int b = plan.BatchAt(step); b != batch) {
        batch = b;
        batcher->SetBatchSize(b);
      }
      client->SetPushExtras(batch, noise.relay());
    }
    x.resize(static_cast<size_t>(batch) * spec.input.size());
    y.resize(batch);
    const absl::Time t1 = absl::Now();
    batcher->Next(x.data(), y.data());
    // Forward and backward on this worker's minibatch; with overlap, each layer's push starts from
    // the backend's callback as soon as its gradients are final.
    pushes.clear();
    absl::Status start_error;
    GradientsReady ready = nullptr;
    auto start_pushes = [&](const std::vector<PushBuckets::Range>& ranges) {
      for (const PushBuckets::Range& r : ranges) {
        std::vector<int> tensors(r.count);
        for (size_t k = 0; k < r.count; ++k) tensors[k] = static_cast<int>(r.first + k);
        absl::StatusOr<int64_t> ticket = client->StartPush(step, tensors, grads, params);
        if (!ticket.ok()) {
          if (start_error.ok()) start_error = ticket.status();
          return;
        }
        pushes.push_back({*ticket, r.first, r.count});
      }
    };
    if (overlap) {
      ready = [&](size_t first, size_t count) { start_pushes(buckets.Add(first, count)); };
    }
    absl::StatusOr<float> loss =
        backend->ForwardBackward(ConstSpans(*params), x.data(), y.data(), batch, grad_spans, ready);
    if (overlap) {
      // The layers still in the bucket; none after a failed pass (its gradients are not final).
      const std::vector<PushBuckets::Range> rest = buckets.Flush();
      if (loss.ok()) start_pushes(rest);
    }
    const absl::Time t2 = absl::Now();
    PsClient::PushResult pushed;
    // Wait for every push that started, even after an error, so none outlives its step.
    absl::Status push_status = start_error;
    size_t pulled_tensors = 0;
    for (LayerPush& p : pushes) {
      absl::Status s = client->WaitPush(p.ticket, &pushed, &p.timing);
      if (push_status.ok()) push_status = s;
      pulled_tensors += p.tensors;
    }
    if (overlap && push_status.ok() && loss.ok() && pulled_tensors == specs.size()) {
      prefetched_step = step + 1;
      prefetched_version = pushed.min_version;
    }
    RETURN_IF_ERROR(AtStep(step, loss.status()));
    if (options.clip_global_norm > 0) {
      grad_norm_sum += ClipByGlobalNorm(grad_spans, options.clip_global_norm);
    }
    // Injected straggling: this worker computes as if slower, or stalls.
    absl::Time t2_delayed = t2;
    if (options.straggler != nullptr) {
      const absl::Duration delay = options.straggler->DelayFor(step, t2 - t1);
      if (delay > absl::ZeroDuration()) {
        absl::SleepFor(delay);
        t2_delayed = absl::Now();
      }
    }
    // Push this step's gradients (all at once without overlap); the servers average them over the
    // workers.
    if (!overlap) {
      push_status = client->Push(step, grads, &pushed);
      const absl::Time acknowledged = absl::Now();
      pushes.assign(1, LayerPush{0, 0, specs.size(), {t2_delayed, acknowledged, acknowledged}});
    }
    if (absl::IsAborted(push_status)) {
      ASSIGN_OR_RETURN(const int64_t resume, rejoin(step, push_status, /*drawn=*/true));
      step = resume - 1;
      continue;
    } else {
      RETURN_IF_ERROR(AtStep(step, push_status));
    }
    const absl::Time t3 = absl::Now();
    ++result.computed_steps;

    loss_sum += *loss;
    compute_s += absl::ToDoubleSeconds(t2 - t1);
    delay_s += absl::ToDoubleSeconds(t2_delayed - t2);
    // Includes waiting at the barrier; a step whose weights came with the last pushes pulled
    // nothing (not even the microseconds of bookkeeping counted as pulling).
    if (pulled) pull_s += absl::ToDoubleSeconds(t1 - t0);
    push_s += absl::ToDoubleSeconds(t3 - t2_delayed);
    {
      const PushOverlap o = MeasureOverlap(pushes, t1, t2);
      push_busy_s += o.busy_s;
      push_hidden_s += o.hidden_s;
      for (const LayerPush& p : pushes) {
        ready_to_ack_s[p.first_tensor] +=
            absl::ToDoubleSeconds(p.timing.acknowledged - p.timing.started);
      }
    }
    staleness_sum += pushed.max_staleness;
    if (!pushed.noise.empty()) {
      // Every worker sees the same figures; worker 0 writes them. Not flushed: a write per step
      // (and the reader woken for it) cost the 2-core demo 20% of its wall time; they go out
      // with the next step record, every log interval.
      const std::string record = noise.Update(options.worker_id, pushed.noise);
      if (!record.empty() && options.worker_id == 0) *progress << record << '\n';
    }
    RETURN_IF_ERROR(AtStep(step, adopt(pushed.batch_changes, step)));
    dropped += pushed.dropped;
    ++interval_steps;
    const int64_t done = step + 1;
    if (done % options.log_every == 0 || done == steps) {
      const double elapsed = absl::ToDoubleSeconds(t3 - interval_start);
      result.final_loss = loss_sum / interval_steps;
      *progress << absl::StrFormat(
                       "{\"event\":\"step\",\"worker\":%d,\"step\":%d,\"epoch\":%d,\"t\":%.3f,"
                       "\"loss\":%.5f,\"steps_per_s\":%.2f,\"compute_ms\":%.3f,\"comm_ms\":%.3f,"
                       "\"pull_ms\":%.3f,\"push_ms\":%.3f,\"delay_ms\":%.3f,"
                       "\"staleness\":%.3f,\"dropped\":%d,\"skipped\":%d,"
                       "\"overlap\":%s,\"push_busy_ms\":%.3f,\"hidden_fraction\":%.4f%s%s}",
                       options.worker_id, done, batcher->epoch(), absl::ToDoubleSeconds(t3 - start),
                       result.final_loss, interval_steps / std::max(elapsed, 1e-9),
                       1e3 * compute_s / interval_steps, 1e3 * (pull_s + push_s) / interval_steps,
                       1e3 * pull_s / interval_steps, 1e3 * push_s / interval_steps,
                       1e3 * delay_s / interval_steps, staleness_sum / interval_steps, dropped,
                       skipped_steps, overlap ? "true" : "false",
                       1e3 * push_busy_s / interval_steps,
                       push_busy_s > 0 ? push_hidden_s / push_busy_s : 0.0,
                       overlap ? LatencyField(specs, ready_to_ack_s, interval_steps) : "",
                       options.clip_global_norm > 0
                           ? absl::StrFormat(",\"grad_norm\":%.5f", grad_norm_sum / interval_steps)
                           : "")
                << std::endl;
      *progress << OverlapRecord(options.worker_id, done, specs, pushes, t1, t2) << std::endl;
      interval_start = t3;
      loss_sum = compute_s = delay_s = pull_s = push_s = grad_norm_sum = staleness_sum = 0;
      push_busy_s = push_hidden_s = 0;
      std::fill(ready_to_ack_s.begin(), ready_to_ack_s.end(), 0.0);
      interval_steps = dropped = skipped_steps = 0;
    }
    // Every eval_every steps' worth of examples at the starting batch (every eval_every steps
    // when the batch does not change).
    const int64_t eval_examples = options.eval_every * batch0 * workers;
    if (test.size > 0 && options.eval_every > 0 && done != steps &&
        plan.ExamplesBefore(done) / eval_examples > plan.ExamplesBefore(step) / eval_examples) {
      RETURN_IF_ERROR(evaluate(done, absl::ToDoubleSeconds(absl::Now() - start)).status());
    }
  }
  result.steps = steps;
  result.final_batch = batch;
  // The final weights: everything every worker pushed, applied.
  if (prefetched_step != steps) {
    RETURN_IF_ERROR(AtStep(steps, client->Pull(steps, absl::MakeSpan(*params))));
  }
  if (test.size > 0) {
    ASSIGN_OR_RETURN(result.test, evaluate(steps, absl::ToDoubleSeconds(absl::Now() - start)));
  }
  result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  result.noise_scale = noise.b_simple_ema();
  return result;
}

}  // namespace rubato
