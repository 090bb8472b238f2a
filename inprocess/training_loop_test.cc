// The training loop over in-process shards, through the one PsClient over in-process channels
// (inprocess/in_process_shard_channel.h): whole jobs of several workers in one process, without
// sockets, checked for what the consistency modes promise.
#include "worker/training_loop.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/batch_plan.h"
#include "gtest/gtest.h"
#include "inprocess/in_process_shard_channel.h"
#include "inprocess/test_jobs.h"
#include "server/parameter_shard.h"
#include "worker/data/dataset.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/straggler_model.h"

namespace rubato {
namespace {

struct JobResult {
  std::vector<std::vector<std::vector<float>>> params;  // per worker
  std::vector<TrainingResult> results;
  std::vector<std::string> progress;  // per worker: its JSON lines
  GetStatsResponse stats;
  std::vector<std::string> errors;  // per worker: its run's error ("" if none)
};

// One job: `workers` threads, each with its own in-process client, over `shards` shards.
JobResult RunJob(ConsistencyMode mode, int workers, int shards, bool overlap, int64_t steps,
                 int64_t target_call_bytes, const AdaptiveBatchConfig& adaptive = {},
                 std::vector<GetStatsResponse>* shard_stats = nullptr,
                 int64_t push_bucket_bytes = 0, const char* layers = "8-16-3",
                 int64_t push_budget_bytes = ShardOptions().push_budget_bytes,
                 const std::function<void(int, TrainingOptions*)>& tweak = {},
                 const BackendWrapper& wrap = {}, bool expect_ok = true) {
  const Dataset train = SyntheticDataset(512, 1);
  const Dataset test = SyntheticDataset(256, 2);
  const ModelSpec spec = MlpModelSpec(*ParseMlpLayers(layers));
  ClusterSpec cluster;
  cluster.set_num_workers(workers);
  cluster.mutable_consistency()->set_mode(mode);
  if (mode == SSP) cluster.mutable_consistency()->set_staleness(1);
  if (mode == ADAPTIVE) cluster.mutable_consistency()->set_adaptive_every_steps(5);
  cluster.mutable_optimizer()->set_type("sgd");
  cluster.mutable_optimizer()->set_learning_rate(0.2);
  cluster.set_lease_ms(30000);
  cluster.set_wait_timeout_ms(30000);
  *cluster.mutable_adaptive_batch() = adaptive;
  std::vector<std::unique_ptr<ParameterShard>> owned;
  std::vector<ParameterShard*> shard_ptrs;
  for (int s = 0; s < shards; ++s) {
    ShardOptions o;
    o.shard_id = s;
    o.num_shards = shards;
    o.cluster = cluster;
    o.push_budget_bytes = push_budget_bytes;
    auto shard = ParameterShard::Create(o);
    EXPECT_TRUE(shard.ok()) << shard.status();
    shard_ptrs.push_back(shard->get());
    owned.push_back(std::move(*shard));
  }
  JobResult job;
  job.params.resize(workers);
  job.results.resize(workers);
  job.progress.resize(workers);
  std::vector<std::string> errors(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      PsClientOptions options = InProcessClientOptions(spec, cluster, w, steps);
      options.target_call_bytes = target_call_bytes;
      TrainingOptions t;
      t.steps = steps;
      t.overlap = overlap;
      t.push_bucket_bytes = push_bucket_bytes;
      t.log_every = 1000;
      t.adaptive_batch = adaptive.max_global_batch() > 0;
      if (tweak) tweak(w, &t);
      absl::StatusOr<WorkerRun> run =
          RunInProcessWorker(options, InProcessChannels(shard_ptrs), spec, train, test, t, wrap);
      if (!run.ok()) {
        errors[w] = run.status().ToString();
        return;
      }
      job.results[w] = run->result;
      job.params[w] = std::move(run->params);
      job.progress[w] = std::move(run->progress);
    });
  }
  for (auto& t : threads) t.join();
  if (expect_ok) {
    for (int w = 0; w < workers; ++w) EXPECT_EQ(errors[w], "") << "worker " << w;
  }
  job.errors = errors;
  job.stats = owned[0]->Stats();
  if (shard_stats != nullptr) {
    for (const auto& shard : owned) shard_stats->push_back(shard->Stats());
  }
  return job;
}

// With a bucket larger than the model, the two layers' gradients go in one push per step (one
// call to the one shard, where each layer alone made two), and the result is the same bit for bit.
TEST(TrainingLoopTest, ABucketGathersTheLayersIntoOnePushWithTheSameResult) {
  const JobResult layers = RunJob(BSP, 2, 1, /*overlap=*/true, 30, 1 << 20);
  const JobResult bucket = RunJob(BSP, 2, 1, /*overlap=*/true, 30, 1 << 20, {}, nullptr, 1 << 30);
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(bucket.params[w], layers.params[w]) << "worker " << w;
    EXPECT_EQ(bucket.results[w].computed_steps, 30);
  }
  EXPECT_EQ(layers.stats.pushes(), 2 * 30 * 2);
  EXPECT_EQ(bucket.stats.pushes(), 2 * 30);
}

// A bsp shard with a small push budget takes the 8x40000 kernel (320000 elements) in parts of
// 262144 (the 1 MiB floor): the workers push it as two calls, and the job ends on the same weights,
// bit for bit, as with whole tensors, with overlap and without.
TEST(TrainingLoopTest, GradientsPushedInPartsGiveTheSameWeights) {
  ASSERT_EQ(PushPartElements(
                [] {
                  ConsistencyConfig c;
                  c.set_mode(BSP);
                  return c;
                }(),
                3, 1),
            262144);
  const JobResult whole = RunJob(BSP, 3, 1, /*overlap=*/false, 12, 1 << 20, {}, nullptr, 0,
                                 "8-40000-3", int64_t{1} << 30);
  const JobResult parts =
      RunJob(BSP, 3, 1, /*overlap=*/false, 12, 1 << 20, {}, nullptr, 0, "8-40000-3", 1);
  const JobResult overlapped =
      RunJob(BSP, 3, 1, /*overlap=*/true, 12, 1 << 20, {}, nullptr, 0, "8-40000-3", 1);
  for (int w = 0; w < 3; ++w) {
    ASSERT_EQ(whole.params[w].size(), 4u);
    EXPECT_EQ(whole.params[w], whole.params[0]) << "worker " << w;
    EXPECT_EQ(parts.params[w], whole.params[0]) << "worker " << w;
    EXPECT_EQ(overlapped.params[w], whole.params[0]) << "worker " << w;
  }
  // Calls per worker and step: whole, the kernel alone (1.28 MB > the 1 MiB target) and the other
  // three together: 2. In parts: the kernel's two parts, then the rest: 3.
  EXPECT_EQ(whole.stats.pushes(), 3 * 12 * 2);
  EXPECT_EQ(parts.stats.pushes(), 3 * 12 * 3);
  EXPECT_EQ(parts.stats.applied_updates(), 4 * 12);
}

TEST(TrainingLoopTest, BspIsBitExactWithAndWithoutOverlapAndLearns) {
  // Three workers, two shards, calls of one tensor each (a tiny target): the call plan, the
  // per-layer pushes with their pulls, and the in-order sums all take part.
  const JobResult a = RunJob(BSP, 3, 2, /*overlap=*/true, 60, /*target_call_bytes=*/64);
  const JobResult b = RunJob(BSP, 3, 2, /*overlap=*/false, 60, /*target_call_bytes=*/1 << 20);
  for (int w = 0; w < 3; ++w) {
    ASSERT_EQ(a.params[w].size(), 4u);
    EXPECT_EQ(a.params[w], a.params[0]) << "worker " << w << " ends on other weights";
    EXPECT_EQ(b.params[w], a.params[0]) << "overlap changed the result (worker " << w << ")";
    EXPECT_EQ(a.results[w].computed_steps, 60);
  }
  // Learned: well above chance (1/3) on held-out data.
  EXPECT_GT(a.results[0].test.accuracy, 0.6) << a.results[0].test.accuracy;
  // Every tensor of shard 0 went through 60 versions, one update per step.
  for (const TensorStats& t : a.stats.tensors()) EXPECT_EQ(t.version(), 60);
  EXPECT_EQ(a.stats.staleness_histogram(0), a.stats.applied_updates() * 3);
  // The gradient noise scale: every step measured by the shard, and worker 0 logged the job's
  // figure (both shards' terms added up) for each step both had reported, in order.
  EXPECT_EQ(a.stats.noise_scale().step(), 59);
  EXPECT_EQ(a.stats.noise_scale().steps(), 60);
  EXPECT_EQ(a.stats.noise_scale().workers(), 3);
  EXPECT_EQ(a.stats.noise_scale().batch_small(), 16);
  std::istringstream lines(a.progress[0]);
  int records = 0;
  int64_t last = -1;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("\"event\":\"noise\"") == std::string::npos) continue;
    ++records;
    EXPECT_NE(line.find("\"b_small\":16,\"b_big\":48,"), std::string::npos) << line;
    const size_t at = line.find("\"step\":");
    ASSERT_NE(at, std::string::npos) << line;
    const int64_t step = std::stoll(line.substr(at + 7));
    EXPECT_GT(step, last) << line;
    last = step;
  }
  EXPECT_EQ(records, 59) << a.progress[0];  // Steps 0 to 58, each from the next step's push.
  EXPECT_EQ(a.progress[1].find("\"event\":\"noise\""), std::string::npos);  // Worker 0 alone.
  for (int w = 0; w < 3; ++w) {
    EXPECT_TRUE(std::isfinite(a.results[w].noise_scale)) << "worker " << w;
    EXPECT_GT(a.results[w].noise_scale, 0) << "worker " << w;
  }
}

// The next step's forward pass waiting for each layer's pull (the default) rather than for all of
// them first changes when the weights are read, not which: the same weights, bit for bit, over
// two shards and three workers, calls of one tensor each. Every step but the first waited so.
TEST(TrainingLoopTest, TheLayerwiseForwardPassEndsOnTheSameWeights) {
  auto whole = [](int, TrainingOptions* t) { t->layerwise_forward = false; };
  const int64_t budget = ShardOptions().push_budget_bytes;
  const JobResult layerwise = RunJob(BSP, 3, 2, /*overlap=*/true, 40, /*target_call_bytes=*/64);
  const JobResult waiting =
      RunJob(BSP, 3, 2, /*overlap=*/true, 40, 64, {}, nullptr, 0, "8-16-3", budget, whole);
  for (int w = 0; w < 3; ++w) {
    ASSERT_EQ(layerwise.params[w].size(), 4u);
    EXPECT_EQ(layerwise.params[w], waiting.params[0]) << "worker " << w;
    EXPECT_EQ(layerwise.results[w].layerwise_steps, 39) << "worker " << w;
    EXPECT_EQ(waiting.results[w].layerwise_steps, 0) << "worker " << w;
    EXPECT_EQ(layerwise.results[w].computed_steps, 40) << "worker " << w;
  }
}

// What LateCopyBackend saw, over every worker of a job.
struct CopyCounts {
  absl::Mutex mu;
  int handed ABSL_GUARDED_BY(mu) = 0;
  int awaited ABSL_GUARDED_BY(mu) = 0;
  int awaited_on_compute_thread ABSL_GUARDED_BY(mu) = 0;
  // UseHostBuffers: the calls, and whether each step's spans were the ones it was given.
  int host_buffer_calls ABSL_GUARDED_BY(mu) = 0;
  int steps_on_host_buffers ABSL_GUARDED_BY(mu) = 0;
  int steps_elsewhere ABSL_GUARDED_BY(mu) = 0;
  // AwaitGradients fails (a device copy that failed) on this call, counted from 1 (0: never).
  int fail_on_await = 0;
};

// A backend that hands each layer over as the CUDA backend does, before its host gradients are
// final: at the callback they hold NaN (which a shard refuses), and AwaitGradients writes the real
// ones, after a little while, as a device copy would land.
class LateCopyBackend : public ModelBackend {
 public:
  LateCopyBackend(std::unique_ptr<ModelBackend> inner, CopyCounts* counts)
      : inner_(std::move(inner)), counts_(counts) {}
  std::string name() const override { return inner_->name(); }
  absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                        const float* x, const int32_t* labels, int64_t batch,
                                        absl::Span<const absl::Span<float>> grads,
                                        const GradientsReady& ready,
                                        const WeightsNeeded& needed) override {
    compute_thread_ = std::this_thread::get_id();
    {
      absl::MutexLock lock(&counts_->mu);
      const bool same = !host_grads_.empty() && host_grads_[0].data() == grads[0].data() &&
                        host_params_[0].data() == params[0].data();
      ++(same ? counts_->steps_on_host_buffers : counts_->steps_elsewhere);
    }
    GradientsReady late = nullptr;
    if (ready) {
      late = [&](size_t first, size_t count) {
        {
          absl::MutexLock lock(&mu_);
          for (size_t t = first; t < first + count; ++t) {
            final_[t].assign(grads[t].begin(), grads[t].end());
            std::fill(grads[t].begin(), grads[t].end(), std::nanf(""));
            spans_[t] = grads[t];
          }
        }
        {
          absl::MutexLock lock(&counts_->mu);
          ++counts_->handed;
        }
        ready(first, count);
      };
    }
    return inner_->ForwardBackward(params, x, labels, batch, grads, late, needed);
  }
  absl::Status AwaitGradients(size_t first, size_t count) override {
    absl::SleepFor(absl::Microseconds(200));
    {
      absl::MutexLock lock(&mu_);
      for (size_t t = first; t < first + count; ++t) {
        std::copy(final_[t].begin(), final_[t].end(), spans_[t].begin());
      }
    }
    absl::MutexLock lock(&counts_->mu);
    ++counts_->awaited;
    if (std::this_thread::get_id() == compute_thread_) ++counts_->awaited_on_compute_thread;
    if (counts_->awaited == counts_->fail_on_await) {
      return absl::InternalError(
          "cudaEventSynchronize(gradients copied): an illegal memory access");
    }
    return absl::OkStatus();
  }
  absl::Status UseHostBuffers(absl::Span<const absl::Span<float>> params,
                              absl::Span<const absl::Span<float>> grads) override {
    host_params_.assign(params.begin(), params.end());
    host_grads_.assign(grads.begin(), grads.end());
    absl::MutexLock lock(&counts_->mu);
    ++counts_->host_buffer_calls;
    return absl::OkStatus();
  }
  absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                      const float* x, const int32_t* labels, int64_t n) override {
    return inner_->Evaluate(params, x, labels, n);
  }
  void set_profiling(bool on) override { inner_->set_profiling(on); }
  std::vector<LayerTime> layer_times() const override { return inner_->layer_times(); }

 private:
  const std::unique_ptr<ModelBackend> inner_;
  std::vector<absl::Span<float>> host_params_, host_grads_;  // UseHostBuffers'

  CopyCounts* const counts_;
  std::thread::id compute_thread_;  // Written before any layer is handed over.
  absl::Mutex mu_;
  std::map<size_t, std::vector<float>> final_ ABSL_GUARDED_BY(mu_);
  std::map<size_t, absl::Span<float>> spans_ ABSL_GUARDED_BY(mu_);
};

// The communication thread waits for each layer's gradients before pushing them (a push of the
// NaN there before would be refused), off the compute thread; the job ends on the same weights,
// bit for bit, as with the plain backend and every push started from the compute thread.
TEST(TrainingLoopTest, TheCommunicationThreadPushesGradientsOnlyOnceTheirCopyHasLanded) {
  CopyCounts threaded_counts, inline_counts;
  auto late = [](CopyCounts* counts) -> BackendWrapper {
    return [counts](std::unique_ptr<ModelBackend> inner) -> std::unique_ptr<ModelBackend> {
      return std::make_unique<LateCopyBackend>(std::move(inner), counts);
    };
  };
  auto no_comm_thread = [](int, TrainingOptions* t) { t->comm_thread = false; };
  const int64_t budget = ShardOptions().push_budget_bytes;
  const JobResult threaded = RunJob(BSP, 2, 2, /*overlap=*/true, 40, /*target_call_bytes=*/64, {},
                                    nullptr, 0, "8-16-3", budget, {}, late(&threaded_counts));
  const JobResult inline_late = RunJob(BSP, 2, 2, /*overlap=*/true, 40, 64, {}, nullptr, 0,
                                       "8-16-3", budget, no_comm_thread, late(&inline_counts));
  const JobResult plain =
      RunJob(BSP, 2, 2, /*overlap=*/true, 40, 64, {}, nullptr, 0, "8-16-3", budget, no_comm_thread);
  for (int w = 0; w < 2; ++w) {
    ASSERT_EQ(plain.params[w].size(), 4u);
    EXPECT_EQ(threaded.results[w].computed_steps, 40);
    EXPECT_EQ(threaded.params[w], plain.params[0]) << "worker " << w;
    EXPECT_EQ(inline_late.params[w], plain.params[0]) << "worker " << w;
  }
  constexpr int kHanded = 2 * 40 * 2;  // workers x steps x layers
  absl::MutexLock a(&threaded_counts.mu);
  EXPECT_EQ(threaded_counts.handed, kHanded);
  EXPECT_EQ(threaded_counts.awaited, kHanded);
  EXPECT_EQ(threaded_counts.awaited_on_compute_thread, 0);
  // The loop gave the backend its buffers before the first step (and took them back at the end),
  // and every step computed in them, so that a GPU copies to and from them directly.
  EXPECT_EQ(threaded_counts.host_buffer_calls, 2 * 2);
  EXPECT_EQ(threaded_counts.steps_on_host_buffers, 2 * 40);
  EXPECT_EQ(threaded_counts.steps_elsewhere, 0);
  absl::MutexLock b(&inline_counts.mu);
  EXPECT_EQ(inline_counts.awaited, kHanded);
  EXPECT_EQ(inline_counts.awaited_on_compute_thread, kHanded);
}

// A layer whose copy to the host fails ends the step with that error, naming the step, and no
// push of that step starts after it (the shard applies no update of that step).
TEST(TrainingLoopTest, AFailedGradientCopyEndsTheStepWithItsError) {
  CopyCounts counts;
  counts.fail_on_await = 2 * 7 + 1;  // step 7's first layer (two layers a step)
  const JobResult job = RunJob(
      BSP, 1, 1, /*overlap=*/true, 20, 64, {}, nullptr, 0, "8-16-3",
      ShardOptions().push_budget_bytes, {},
      [&counts](std::unique_ptr<ModelBackend> inner) -> std::unique_ptr<ModelBackend> {
        return std::make_unique<LateCopyBackend>(std::move(inner), &counts);
      },
      /*expect_ok=*/false);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_NE(job.errors[0].find("step 7: cudaEventSynchronize(gradients copied)"), std::string::npos)
      << job.errors[0];
  for (const TensorStats& t : job.stats.tensors()) EXPECT_EQ(t.version(), 7) << t.name();
}

TEST(TrainingLoopTest, AsyncAndSspRunToTheEndWithStalenessInTheirBounds) {
  for (ConsistencyMode mode : {ASYNC, SSP}) {
    const JobResult j = RunJob(mode, 3, 1, /*overlap=*/true, 40, 1 << 20);
    for (int w = 0; w < 3; ++w) EXPECT_EQ(j.results[w].computed_steps, 40);
    // Every gradient applied alone: 3 workers x 40 steps per tensor.
    for (const TensorStats& t : j.stats.tensors()) EXPECT_EQ(t.version(), 120);
    // No pair of batch sizes to compare: no noise scale.
    EXPECT_FALSE(j.stats.has_noise_scale());
    EXPECT_TRUE(std::isnan(j.results[0].noise_scale));
    if (mode == SSP) {
      // ssp:1 bounds how far a worker runs ahead, so staleness stays small (< 8 updates).
      for (int b = 5; b < 8; ++b) EXPECT_EQ(j.stats.staleness_histogram(b), 0) << "bucket " << b;
    }
  }
}

TEST(TrainingLoopTest, AdaptiveConsistencyLeavesTheStragglerOutAndEveryShardAgrees) {
  // Four workers over two shards, decisions every 5 steps; worker 3 computes four times as long
  // as the others (each step padded to 15 ms, worker 3's then slowed 4x).
  std::vector<StragglerModel> stragglers;
  for (int w = 0; w < 4; ++w) {
    StragglerOptions o;
    o.min_step_ms = 15;
    o.slowdown = w == 3 ? 4 : 1;
    absl::StatusOr<StragglerModel> m = StragglerModel::Create(o, w);
    ASSERT_TRUE(m.ok()) << m.status();
    stragglers.push_back(std::move(*m));
  }
  std::vector<GetStatsResponse> shards;
  const JobResult j =
      RunJob(ADAPTIVE, 4, 2, /*overlap=*/false, 40, 1 << 20, {}, &shards, 0, "8-16-3",
             ShardOptions().push_budget_bytes, [&](int w, TrainingOptions* t) {
               t->straggler = &stragglers[w];
               t->skip_to_current_version = true;
             });
  ASSERT_EQ(shards.size(), 2u);
  // Shard 0 decided every period from step 6 on; the first, from the first 5 steps' times, leaves
  // the straggler out.
  const auto& plan = shards[0].consistency_plan();
  ASSERT_GE(plan.size(), 6);
  EXPECT_EQ(plan[0].from_step(), 6);
  EXPECT_EQ(plan[0].backup_workers(), 1);
  ASSERT_EQ(plan[0].compute_ms_size(), 4);
  EXPECT_GT(plan[0].compute_ms(3), 2.5 * plan[0].compute_ms(0));
  // Shard 1 learned the decisions from the workers' relays: the same, for every period it knows.
  std::map<int64_t, int> decided;
  for (const ConsistencyChange& c : plan) decided[c.from_step()] = c.backup_workers();
  ASSERT_GE(shards[1].consistency_plan_size(), 5);
  for (const ConsistencyChange& c : shards[1].consistency_plan()) {
    ASSERT_TRUE(decided.count(c.from_step())) << c.from_step();
    EXPECT_EQ(decided[c.from_step()], c.backup_workers()) << c.from_step();
  }
  // Every step was applied on both shards, and the straggler's late gradients were dropped.
  for (const GetStatsResponse& s : shards) {
    for (const TensorStats& t : s.tensors()) EXPECT_EQ(t.version(), 40) << t.name();
  }
  EXPECT_GT(shards[0].dropped_gradients(), 0);
  // Worker 0 wrote each decision it learned as a `consistency` record.
  EXPECT_NE(j.progress[0].find("\"event\":\"consistency\""), std::string::npos);
  EXPECT_NE(j.progress[0].find("\"backup_workers\":1"), std::string::npos);
  for (int w = 0; w < 3; ++w) EXPECT_EQ(j.results[w].computed_steps, 40) << "worker " << w;
  EXPECT_LT(j.results[3].computed_steps, 40);  // It skipped the steps applied without it.
}

TEST(TrainingLoopTest, AdaptiveBatchChangesAtTheSameStepOnEveryWorker) {
  // Three workers of 16 (a global batch of 48) over two shards; the bounds start at 96, so the
  // first decision (step 4, from the noise scale relayed with its pushes) must at least double the
  // batch, and later ones follow B_simple within [96, 480].
  AdaptiveBatchConfig adaptive;
  adaptive.set_min_global_batch(96);
  adaptive.set_max_global_batch(480);
  adaptive.set_every_steps(4);
  std::vector<GetStatsResponse> shards;
  const JobResult j = RunJob(BSP, 3, 2, /*overlap=*/true, 60, 64, adaptive, &shards);
  ASSERT_EQ(shards.size(), 2u);
  // Both shards decided the same plan, each change two steps after a decision step.
  ASSERT_GE(shards[0].batch_plan_size(), 1);
  ASSERT_EQ(shards[0].batch_plan_size(), shards[1].batch_plan_size());
  BatchPlan plan(3, 16);
  for (int k = 0; k < shards[0].batch_plan_size(); ++k) {
    const BatchChange& c = shards[0].batch_plan(k);
    EXPECT_EQ(c.SerializeAsString(), shards[1].batch_plan(k).SerializeAsString()) << k;
    EXPECT_EQ((c.from_step() - 2) % 4, 0) << c.from_step();
    EXPECT_GE(c.global_batch(), 96);
    EXPECT_LE(c.global_batch(), 480);
    EXPECT_GT(c.b_simple(), 0);
    ASSERT_TRUE(plan.Add(c).ok());
  }
  EXPECT_EQ(shards[0].batch_plan(0).from_step(), 6);
  EXPECT_GE(shards[0].batch_plan(0).batch_size(), 32);
  // Every worker applied every change (the shards refuse a push of another batch), ran the steps
  // that draw the 60 x 48 examples of the fixed-batch job, and ended on the same weights.
  const int64_t steps = plan.TotalSteps(60 * 48);
  EXPECT_LT(steps, 60);
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(j.results[w].steps, steps) << "worker " << w;
    EXPECT_EQ(j.results[w].computed_steps, steps) << "worker " << w;
    EXPECT_EQ(j.results[w].final_batch, plan.BatchAt(steps - 1)) << "worker " << w;
    EXPECT_EQ(j.params[w], j.params[0]) << "worker " << w;
  }
  for (const TensorStats& t : shards[0].tensors()) EXPECT_EQ(t.version(), steps);
  // Worker 0 wrote a "batch" record per change; the noise scale was measured at each step's own
  // batch.
  size_t records = 0;
  for (size_t at = 0; (at = j.progress[0].find("\"event\":\"batch\"", at)) != std::string::npos;
       ++at) {
    ++records;
  }
  EXPECT_EQ(records, static_cast<size_t>(plan.changes().size())) << j.progress[0];
  EXPECT_EQ(j.progress[1].find("\"event\":\"batch\""), std::string::npos);
  EXPECT_EQ(shards[0].noise_scale().batch_small(), plan.BatchAt(shards[0].noise_scale().step()));
}

// A client whose every push answers with the given batch change, for the worker's checks of
// what the servers announce.
class AnnouncingClient : public FakeClient {
 public:
  explicit AnnouncingClient(BatchChange change) : change_(std::move(change)) {}
  absl::Status Push(int64_t, absl::Span<const std::vector<float>>, PushResult* result) override {
    if (result != nullptr) {
      *result = PushResult();
      result->batch_changes.push_back(change_);
    }
    return absl::OkStatus();
  }

 private:
  BatchChange change_;
};

TEST(TrainingLoopTest, AdaptiveBatchChangesThatCannotBeAppliedAreErrors) {
  const Dataset train = SyntheticDataset(64, 1);
  const ModelSpec spec = MlpModelSpec(*ParseMlpLayers("8-16-3"));
  auto backend = CreateCpuBackend(spec, 1);
  ASSERT_TRUE(backend.ok());
  auto run = [&](int64_t from_step) {
    BatchChange c;
    c.set_from_step(from_step);
    c.set_batch_size(8);
    c.set_global_batch(16);
    AnnouncingClient client(c);
    auto batcher = ShardedBatcher::Create(&train, 0, 2, 4, 7);
    EXPECT_TRUE(batcher.ok());
    std::vector<std::vector<float>> params = InitModelParams(spec, 5);
    TrainingOptions t;
    t.steps = 10;
    t.overlap = false;
    t.adaptive_batch = true;
    t.num_workers = 2;
    std::ostringstream progress;
    return RunTraining(t, spec, &client, backend->get(), &*batcher, Dataset(), &params, &progress)
        .status();
  };
  // Announced in the answer to step 0's push: step 0 is computed already.
  const absl::Status late = run(0);
  EXPECT_NE(late.message().find("arrived after step 0"), std::string::npos) << late;
  // Past the job's 10 steps.
  const absl::Status past = run(int64_t{1} << 40);
  EXPECT_NE(past.message().find("past the job's 10 steps"), std::string::npos) << past;
  // A change the worker can apply: the job runs to the steps of its examples.
  EXPECT_TRUE(run(2).ok()) << run(2);
}

// Records what each step pushed (the sum of its gradients: with weights that never change, a
// function of the step's batch alone), and refuses the push of `fail_at` once with ABORTED, as a
// shard does that was restarted; registering again then resumes at `fail_at`.
class RollBackClient : public FakeClient {
 public:
  explicit RollBackClient(int64_t fail_at) : fail_at_(fail_at) {}
  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>>, int32_t,
                                   int64_t) override {
    return failed_ ? fail_at_ : 0;
  }
  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    if (step == fail_at_ && !failed_) {
      failed_ = true;
      return absl::AbortedError("register again: the shard was restored");
    }
    double sum = 0;
    for (const std::vector<float>& g : grads) {
      for (float v : g) sum += v;
    }
    pushed_[step] = sum;
    if (result != nullptr) *result = PushResult();
    return absl::OkStatus();
  }
  const std::map<int64_t, double>& pushed() const { return pushed_; }

 private:
  const int64_t fail_at_;
  bool failed_ = false;
  std::map<int64_t, double> pushed_;
};

// A bsp job rolled back to the step whose push failed (the shard restored that step, as when a
// shard dies just after its checkpoint) computes that step again on the same batch, so it goes on
// exactly as if never interrupted. It drew a batch too many before this was fixed, and the job's
// weights ended elsewhere than the uninterrupted run's.
TEST(TrainingLoopTest, AStepRolledBackAfterItsPushFailedIsComputedAgainOnTheSameBatch) {
  const Dataset train = SyntheticDataset(256, 1);
  const ModelSpec spec = MlpModelSpec(*ParseMlpLayers("8-16-3"));
  auto backend = CreateCpuBackend(spec, 1);
  ASSERT_TRUE(backend.ok());
  auto run = [&](int64_t fail_at, TrainingResult* out) {
    RollBackClient client(fail_at);
    auto batcher = ShardedBatcher::Create(&train, 0, 1, 8, 7);
    EXPECT_TRUE(batcher.ok());
    std::vector<std::vector<float>> params = InitModelParams(spec, 5);
    TrainingOptions t;
    t.steps = 12;
    t.overlap = false;
    t.rewind_on_rejoin = true;
    std::ostringstream progress;
    absl::StatusOr<TrainingResult> r =
        RunTraining(t, spec, &client, backend->get(), &*batcher, Dataset(), &params, &progress);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) *out = *r;
    return client.pushed();
  };
  TrainingResult uninterrupted, rolled_back;
  const std::map<int64_t, double> want = run(-1, &uninterrupted);
  const std::map<int64_t, double> got = run(5, &rolled_back);
  ASSERT_EQ(want.size(), 12u);
  EXPECT_EQ(got, want);
  EXPECT_EQ(rolled_back.rejoins, 1);
  EXPECT_EQ(rolled_back.redone_steps, 1) << "step 5 was computed twice";
}

}  // namespace
}  // namespace rubato
