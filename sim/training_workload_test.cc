#include "sim/training_workload.h"

#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "sim/ring_job.h"
#include "sim/timing_job.h"

namespace rubato {
namespace {

// Two classes of 4 features: the label is whether x0 > x1, which a small MLP learns.
Dataset Separable(int64_t n, uint64_t seed) {
  Dataset d;
  d.size = n;
  d.dim = 4;
  d.num_classes = 2;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0, 1);
  for (int64_t i = 0; i < n; ++i) {
    float x[4] = {u(rng), u(rng), u(rng), u(rng)};
    d.features.insert(d.features.end(), x, x + 4);
    d.labels.push_back(x[0] > x[1] ? 1 : 0);
  }
  return d;
}

int Count(const std::string& records, const std::string& event) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(records, '\n')) {
    n += absl::StartsWith(line, "{\"event\":\"" + event + "\"");
  }
  return n;
}

class TrainingLevelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    train_ = Separable(512, 1);
    test_ = Separable(256, 2);
    absl::StatusOr<ModelSpec> spec = ParseModelSpec("mlp:4-16-2");
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    absl::StatusOr<std::unique_ptr<ModelBackend>> backend = CreateCpuBackend(spec_, 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
  }

  // A job of `workers` workers on one host with a fast loopback.
  absl::StatusOr<TimingJobResult> Run(int workers, const std::string& mode, int64_t steps,
                                      std::vector<std::ostringstream>* out, int cores = 0) {
    RETURN_IF_ERROR(MakeWorkload(workers, mode, steps, out));
    TimingJobOptions o;
    o.cluster.set_num_workers(workers);
    o.cluster.mutable_consistency()->set_mode(mode == "bsp" ? BSP : ASYNC);
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(0.5);
    o.cluster.set_wait_timeout_ms(60000);
    o.workload = workload_.get();
    o.steps = steps;
    o.batch_size = 16;
    o.colocated = true;
    o.worker_host.loopback_bytes_per_second = 1e15;
    o.worker_host.loopback_latency = absl::ZeroDuration();
    o.worker_host.cores = cores;
    return RunTimingJob(o);
  }

  // The same job on a ring (sim/ring_job.h): quorum = workers is the synchronous ring.
  absl::StatusOr<TimingJobResult> RunRing(int workers, int quorum, int64_t steps,
                                          std::vector<std::ostringstream>* out,
                                          std::vector<StragglerOptions> stragglers = {}) {
    RETURN_IF_ERROR(MakeWorkload(workers, "allreduce", steps, out));
    RingJobOptions o;
    o.workers = workers;
    o.quorum = quorum;
    o.partial = quorum < workers;
    o.steps = steps;
    o.stragglers = std::move(stragglers);
    o.host.nic_bytes_per_second = 1e15;
    o.host.latency = absl::ZeroDuration();
    o.workload = workload_.get();
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(0.5);
    o.batch_size = 16;
    return RunRingJob(o);
  }

  absl::Status MakeWorkload(int workers, const std::string& mode, int64_t steps,
                            std::vector<std::ostringstream>* out) {
    out->clear();
    out->resize(workers);
    TrainingWorkloadOptions t;
    t.spec = spec_;
    t.model_text = "mlp:4-16-2";
    t.train = &train_;
    t.test = &test_;
    t.backend = backend_.get();
    t.num_workers = workers;
    t.batch_size = 16;
    t.job.global_batch = 16 * workers;
    t.job.steps_per_epoch = 512 / t.job.global_batch;
    t.job.steps = steps;
    t.eval_every = 10;
    t.log_every = 10;
    t.consistency = mode == "bsp" ? BSP : mode == "async" ? ASYNC : ALLREDUCE;
    t.mode = mode;
    t.compute_time = absl::Milliseconds(3);
    t.eval_time = absl::Milliseconds(7);
    for (auto& o : *out) t.progress.push_back(&o);
    absl::StatusOr<std::unique_ptr<TrainingWorkload>> w = TrainingWorkload::Create(t);
    if (!w.ok()) return w.status();
    workload_ = std::move(*w);
    workload_->Start();
    return absl::OkStatus();
  }

  Dataset train_, test_;
  ModelSpec spec_;
  std::unique_ptr<ModelBackend> backend_;
  std::unique_ptr<TrainingWorkload> workload_;
};

TEST_F(TrainingLevelTest, OneWorkerTrainsExactlyAsSgdOnItsBatches) {
  std::vector<std::ostringstream> out;
  absl::StatusOr<TimingJobResult> r = Run(1, "bsp", 40, &out);
  ASSERT_TRUE(r.ok()) << r.status();
  // The same steps by hand: the same batches, the same initial weights, w -= 0.5 g.
  std::vector<std::vector<float>> w = InitModelParams(spec_, 1);
  std::vector<std::vector<float>> g = w;
  absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&train_, 0, 1, 16, 1);
  ASSERT_TRUE(batcher.ok());
  std::vector<float> x(16 * 4);
  std::vector<int32_t> y(16);
  for (int step = 0; step < 40; ++step) {
    batcher->Next(x.data(), y.data());
    std::vector<absl::Span<const float>> in(w.begin(), w.end());
    std::vector<absl::Span<float>> grads(g.begin(), g.end());
    ASSERT_TRUE(backend_->ForwardBackward(in, x.data(), y.data(), 16, grads).ok());
    for (size_t t = 0; t < w.size(); ++t) {
      for (size_t i = 0; i < w[t].size(); ++i) w[t][i] -= 0.5f * g[t][i];
    }
  }
  std::vector<absl::Span<const float>> in(w.begin(), w.end());
  absl::StatusOr<EvalResult> expected =
      backend_->Evaluate(in, test_.features.data(), test_.labels.data(), test_.size);
  ASSERT_TRUE(expected.ok());
  const std::string records = out[0].str();
  // The done record carries the final evaluation of the weights the job ended with.
  const size_t done = records.find("{\"event\":\"done\"");
  ASSERT_NE(done, std::string::npos) << records;
  const std::string want = "\"test_accuracy\":";
  const size_t at = records.find(want, done);
  ASSERT_NE(at, std::string::npos) << records.substr(done);
  EXPECT_NEAR(std::stod(records.substr(at + want.size())), expected->accuracy, 1e-4);
  EXPECT_GT(expected->accuracy, 0.8) << "the model did not learn: the check would be empty";

  // Simulated time: 40 steps of 3 ms, 3 evaluations along the way and the final one, 7 ms each;
  // the network is all but free.
  EXPECT_NEAR(absl::ToDoubleMilliseconds(r->wall), 40 * 3 + 4 * 7, 0.5);
  EXPECT_EQ(Count(records, "start"), 1);
  EXPECT_EQ(Count(records, "step"), 4);
  EXPECT_EQ(Count(records, "eval"), 4);  // Steps 10, 20, 30 and the final one at 40.
  EXPECT_EQ(Count(records, "done"), 1);
  // The first evaluation, after step 10: at 10 steps of 3 ms.
  const size_t eval = records.find("{\"event\":\"eval\"");
  ASSERT_NE(eval, std::string::npos);
  const std::string first = records.substr(eval, records.find('\n', eval) - eval);
  EXPECT_TRUE(absl::StrContains(first, "\"t\":0.03,")) << first;
}

TEST_F(TrainingLevelTest, BspWorkersShareOneModelAndOnlyWorkerZeroEvaluates) {
  std::vector<std::ostringstream> out;
  absl::StatusOr<TimingJobResult> r = Run(3, "bsp", 30, &out);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int w = 0; w < 3; ++w) {
    const std::string records = out[w].str();
    EXPECT_EQ(Count(records, "done"), 1) << w;
    EXPECT_TRUE(absl::StrContains(records, "\"computed_steps\":30")) << records;
    EXPECT_EQ(Count(records, "eval"), w == 0 ? 3 : 0) << records;
  }
  // Every worker pulled the same final weights.
  auto fingerprint = [&](int w) {
    const std::string records = out[w].str();
    const size_t at = records.find("\"params_fnv1a\":\"");
    return at == std::string::npos ? std::string() : records.substr(at, 34);
  };
  EXPECT_FALSE(fingerprint(0).empty());
  EXPECT_EQ(fingerprint(0), fingerprint(1));
  EXPECT_EQ(fingerprint(0), fingerprint(2));
  ASSERT_EQ(r->shard_stats.size(), 1u);
  EXPECT_GT(r->shard_stats[0].applied_updates(), 0);
}

TEST_F(TrainingLevelTest, RunsAreDeterministic) {
  std::vector<std::ostringstream> a, b;
  ASSERT_TRUE(Run(2, "async", 20, &a).ok());
  ASSERT_TRUE(Run(2, "async", 20, &b).ok());
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(a[w].str(), b[w].str());
    EXPECT_EQ(Count(a[w].str(), "eval"), 2);  // Every worker evaluates in async.
  }
}

TEST_F(TrainingLevelTest, WorkersOfOneHostShareItsCores) {
  // Two async workers, 10 steps of 3 ms and a final evaluation of 7 ms each (none on the way: the
  // one due at step 10 is the final one).
  std::vector<std::ostringstream> out;
  absl::StatusOr<TimingJobResult> alone = Run(2, "async", 10, &out, /*cores=*/0);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_NEAR(absl::ToDoubleMilliseconds(alone->wall), 10 * 3 + 7, 0.5);
  // On one core they compute and evaluate at half speed.
  absl::StatusOr<TimingJobResult> shared = Run(2, "async", 10, &out, /*cores=*/1);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_NEAR(absl::ToDoubleMilliseconds(shared->wall), 2 * (10 * 3 + 7), 0.5);
  EXPECT_NEAR(absl::ToDoubleMilliseconds(shared->workers[0].compute), 2 * 10 * 3, 0.5);
}

std::string Fingerprint(const std::string& records) {
  const size_t at = records.find("\"params_fnv1a\":\"");
  return at == std::string::npos ? std::string() : records.substr(at, 34);
}

double FinalAccuracy(const std::string& records) {
  const size_t done = records.find("{\"event\":\"done\"");
  const std::string want = "\"test_accuracy\":";
  const size_t at = records.find(want, done);
  return done == std::string::npos || at == std::string::npos
             ? -1
             : std::stod(records.substr(at + want.size()));
}

TEST_F(TrainingLevelTest, TheSynchronousRingTrainsAsBspDoes) {
  // One worker: the ring's mean is the gradient itself, so the weights are bsp's bit for bit (the
  // same batches, optimizer and schedule).
  std::vector<std::ostringstream> ps, ring;
  ASSERT_TRUE(Run(1, "bsp", 40, &ps).ok());
  absl::StatusOr<TimingJobResult> one = RunRing(1, 1, 40, &ring);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(Fingerprint(ring[0].str()).empty()) << ring[0].str();
  EXPECT_EQ(Fingerprint(ring[0].str()), Fingerprint(ps[0].str()));
  // Three: every rank ends on the same weights, within rounding of bsp's (the ring sums each
  // chunk in its own order); every rank evaluates (as rubato_worker's rule has it outside bsp):
  // 30 steps of 3 ms and the evaluations after steps 10 and 20, and the final one.
  ASSERT_TRUE(Run(3, "bsp", 30, &ps).ok());
  absl::StatusOr<TimingJobResult> three = RunRing(3, 3, 30, &ring);
  ASSERT_TRUE(three.ok()) << three.status();
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(Count(ring[w].str(), "done"), 1) << w;
    EXPECT_EQ(Count(ring[w].str(), "eval"), 3) << ring[w].str();
    EXPECT_EQ(Fingerprint(ring[w].str()), Fingerprint(ring[0].str())) << w;
  }
  EXPECT_GT(FinalAccuracy(ps[0].str()), 0.8);
  EXPECT_NEAR(FinalAccuracy(ring[0].str()), FinalAccuracy(ps[0].str()), 0.02);
  // Ranks 1 and 2 evaluate the weights rank 0 evaluated: the kept results answer them.
  EXPECT_EQ(workload_->evaluations(), 9);
  EXPECT_EQ(workload_->evaluations_reused(), 6);
  for (int w = 1; w < 3; ++w) EXPECT_EQ(FinalAccuracy(ring[w].str()), FinalAccuracy(ring[0].str()));
  EXPECT_NEAR(absl::ToDoubleMilliseconds(three->wall), 30 * 3 + 3 * 7, 0.5);
}

TEST_F(TrainingLevelTest, ThePartialRingTrainsWithoutItsStraggler) {
  // Solo rounds, rank 2 four times slower: the others' rounds go on; the job ends once its rounds
  // carried the synchronous job's 3 x 30 gradients.
  std::vector<StragglerOptions> slow(3);
  slow[2].slowdown = 4;
  std::vector<std::ostringstream> sync, solo;
  absl::StatusOr<TimingJobResult> s = RunRing(3, 3, 30, &sync, slow);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<TimingJobResult> p = RunRing(3, 1, 30, &solo, slow);
  ASSERT_TRUE(p.ok()) << p.status();
  int64_t carried = 0;
  for (const TimingJobResult::Worker& w : p->workers) carried += w.computed_steps;
  EXPECT_GE(carried, 90);
  EXPECT_LT(p->workers[2].computed_steps, p->workers[0].computed_steps);
  EXPECT_GT(p->workers[0].skipped_steps, 0);  // Rank 0 goes on from the rounds done.
  EXPECT_LT(absl::ToDoubleSeconds(p->wall), 0.6 * absl::ToDoubleSeconds(s->wall));
  EXPECT_GT(FinalAccuracy(solo[0].str()), 0.8) << solo[0].str();
}

TEST_F(TrainingLevelTest, BadOptionsAreNamed) {
  TrainingWorkloadOptions t;
  t.spec = spec_;
  t.train = &train_;
  t.test = &test_;
  t.backend = backend_.get();
  t.num_workers = 2;
  t.job.steps = 10;
  std::ostringstream one;
  t.progress = {&one};
  absl::StatusOr<std::unique_ptr<TrainingWorkload>> w = TrainingWorkload::Create(t);
  ASSERT_FALSE(w.ok());
  EXPECT_TRUE(absl::StrContains(w.status().message(), "progress stream")) << w.status();

  absl::StatusOr<ModelSpec> wide = ParseModelSpec("mlp:8-4-2");
  ASSERT_TRUE(wide.ok());
  t.spec = *wide;
  t.model_text = "mlp:8-4-2";
  w = TrainingWorkload::Create(t);
  ASSERT_FALSE(w.ok());
  EXPECT_TRUE(absl::StrContains(w.status().message(), "needs 8 inputs")) << w.status();

  // A workload trains the model at its size.
  t.spec = spec_;
  TimingJobOptions o;
  o.cluster.set_num_workers(1);
  o.cluster.mutable_consistency()->set_mode(BSP);
  o.cluster.mutable_optimizer()->set_type("sgd");
  o.cluster.mutable_optimizer()->set_learning_rate(0.1);
  o.scale = 4;
  std::ostringstream s0;
  t.num_workers = 1;
  t.progress = {&s0};
  w = TrainingWorkload::Create(t);
  ASSERT_TRUE(w.ok()) << w.status();
  o.workload = w->get();
  absl::Status bad = ValidateTimingJobOptions(o);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "scale must be 1")) << bad;
}

}  // namespace
}  // namespace rubato
