// The training loop's layerwise forward pass (TrainingOptions.layerwise_forward), against a client
// that writes each pulled layer only when its ticket is waited for: the order in which the loop
// waits for the last step's pulls, computes each layer and starts the next pushes; the weights
// each layer computes with; and a push of the step before that fails while the next one is
// computing.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "inprocess/test_jobs.h"
#include "worker/data/dataset.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/training_loop.h"

namespace rubato {
namespace {

// The weights of version `version` for tensor t: one value each, small enough to train on.
float WeightOf(int64_t version, size_t t) {
  return 0.01f * static_cast<float>((version % 5) + 1) + 0.001f * static_cast<float>(t);
}

// What the loop did, in order: "pull S", "push S T" (a push of step S from tensor T), "wait S T"
// (its ticket waited for), "layer T" (the forward pass reached the layer of tensor T).
class EventLog {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

// One shard's worth of client for the 4-tensor MLP whose pulls write WeightOf(version, t): a
// whole pull at once, a ticket's only when WaitPush is called for it. The ticket that pushed
// `fail_tensor` at `fail_step` fails once with `failure`; a registration after it answers
// `resume_step` (the servers' step).
class LayerwiseClient : public FakeClient {
 public:
  LayerwiseClient(EventLog* log, int64_t fail_step = -1, size_t fail_tensor = 0,
                  absl::Status failure = absl::OkStatus(), int64_t resume_step = 0)
      : log_(log),
        fail_step_(fail_step),
        fail_tensor_(fail_tensor),
        failure_(failure),
        resume_step_(resume_step) {}

  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>>, int32_t,
                                   int64_t) override {
    return failed_ ? resume_step_ : 0;
  }
  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    log_->Add(absl::StrCat("pull ", step));
    for (size_t t = 0; t < params.size(); ++t) Fill(step, t, &params[t]);
    if (min_version != nullptr) *min_version = step;
    return absl::OkStatus();
  }
  absl::Status Push(int64_t, absl::Span<const std::vector<float>>, PushResult* result) override {
    if (result != nullptr) *result = PushResult();
    return absl::OkStatus();
  }
  bool supports_partial_push() const override { return true; }
  absl::StatusOr<int64_t> StartPush(int64_t step, absl::Span<const int> tensors,
                                    absl::Span<const std::vector<float>>,
                                    std::vector<std::vector<float>>* pull_into) override {
    log_->Add(absl::StrCat("push ", step, " ", tensors[0]));
    absl::MutexLock lock(&mu_);
    tickets_.push_back(
        {step, std::vector<int>(tensors.begin(), tensors.end()), pull_into, absl::Now()});
    return static_cast<int64_t>(tickets_.size()) - 1;
  }
  absl::Status WaitPush(int64_t ticket, PushResult* result, PushTiming* timing) override {
    Ticket t;
    {
      absl::MutexLock lock(&mu_);
      t = tickets_.at(static_cast<size_t>(ticket));
    }
    log_->Add(absl::StrCat("wait ", t.step, " ", t.tensors[0]));
    if (timing != nullptr) *timing = {t.started, absl::Now(), absl::Now()};
    if (!failed_ && t.step == fail_step_ &&
        std::find(t.tensors.begin(), t.tensors.end(), fail_tensor_) != t.tensors.end()) {
      failed_ = true;
      return failure_;
    }
    if (t.pull_into != nullptr) {
      for (int i : t.tensors) Fill(t.step + 1, static_cast<size_t>(i), &(*t.pull_into)[i]);
      if (result != nullptr) {
        result->min_version =
            result->min_version < 0 ? t.step + 1 : std::min(result->min_version, t.step + 1);
      }
    }
    return absl::OkStatus();
  }

 private:
  struct Ticket {
    int64_t step = 0;
    std::vector<int> tensors;
    std::vector<std::vector<float>>* pull_into = nullptr;
    absl::Time started;
  };
  // In place: the loop's buffers keep their addresses (a GPU may have page-locked them).
  static void Fill(int64_t version, size_t t, std::vector<float>* v) {
    std::fill(v->begin(), v->end(), WeightOf(version, t));
  }

  EventLog* const log_;
  const int64_t fail_step_;
  const size_t fail_tensor_;
  const absl::Status failure_;
  const int64_t resume_step_;
  bool failed_ = false;  // Read and written on the compute thread only.
  absl::Mutex mu_;
  std::vector<Ticket> tickets_ ABSL_GUARDED_BY(mu_);
};

// The CPU backend, logging each layer the forward pass reaches (once the loop has let it) and
// checking that layer's weights there: those of the version the pass computes, counted by its
// calls (`versions`, one per call, including a pass the loop stops). Records each call's inputs.
class CheckingBackend : public ModelBackend {
 public:
  CheckingBackend(std::unique_ptr<ModelBackend> inner, EventLog* log, std::vector<int64_t> versions)
      : inner_(std::move(inner)), log_(log), versions_(std::move(versions)) {}
  std::string name() const override { return inner_->name(); }
  absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                        const float* x, const int32_t* labels, int64_t batch,
                                        absl::Span<const absl::Span<float>> grads,
                                        const GradientsReady& ready,
                                        const WeightsNeeded& needed) override {
    const size_t call = inputs_.size();
    inputs_.emplace_back(x, x + batch * 8);
    const int64_t version = call < versions_.size() ? versions_[call] : -1;
    WeightsNeeded checked = [&](size_t first, size_t count) -> absl::Status {
      if (needed) RETURN_IF_ERROR(needed(first, count));
      log_->Add(absl::StrCat("layer ", first));
      for (size_t t = first; t < first + count; ++t) {
        EXPECT_EQ(params[t][0], WeightOf(version, t)) << "call " << call << ", tensor " << t;
        EXPECT_EQ(params[t].back(), WeightOf(version, t)) << "call " << call << ", tensor " << t;
      }
      return absl::OkStatus();
    };
    return inner_->ForwardBackward(params, x, labels, batch, grads, ready, checked);
  }
  absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                      const float* x, const int32_t* labels, int64_t n) override {
    return inner_->Evaluate(params, x, labels, n);
  }
  void set_profiling(bool on) override { inner_->set_profiling(on); }
  std::vector<LayerTime> layer_times() const override { return inner_->layer_times(); }
  const std::vector<std::vector<float>>& inputs() const { return inputs_; }

 private:
  const std::unique_ptr<ModelBackend> inner_;
  EventLog* const log_;
  const std::vector<int64_t> versions_;
  std::vector<std::vector<float>> inputs_;
};

struct LoopRun {
  absl::StatusOr<TrainingResult> result;
  std::vector<std::string> events;
  std::vector<std::vector<float>> inputs;  // Per ForwardBackward call.
};

// `steps` steps of the 8-16-3 MLP, batch 4, through `client`, each pass checked against the
// weight versions `versions` (one per pass).
LoopRun RunLoop(LayerwiseClient* client, EventLog* log, int64_t steps,
                std::vector<int64_t> versions, bool layerwise = true,
                bool rewind_on_rejoin = false) {
  const Dataset train = SyntheticDataset(64, 1);
  const ModelSpec spec = MlpModelSpec(*ParseMlpLayers("8-16-3"));
  absl::StatusOr<std::unique_ptr<ModelBackend>> cpu = CreateCpuBackend(spec, 1);
  EXPECT_TRUE(cpu.ok());
  CheckingBackend backend(std::move(*cpu), log, std::move(versions));
  absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&train, 0, 1, 4, 7);
  EXPECT_TRUE(batcher.ok());
  std::vector<std::vector<float>> params = InitModelParams(spec, 5);
  TrainingOptions t;
  t.steps = steps;
  t.layerwise_forward = layerwise;
  t.rewind_on_rejoin = rewind_on_rejoin;
  std::ostringstream progress;
  LoopRun run;
  run.result = RunTraining(t, spec, client, &backend, &*batcher, Dataset(), &params, &progress);
  run.events = log->events();
  run.inputs = backend.inputs();
  return run;
}

std::vector<int64_t> Range(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Each layer's forward pass starts as soon as that layer's pull of the step before has been
// waited for, before the next layer's; the step's pushes start only once every pull is in.
TEST(LayerwiseForwardTest, EachLayerComputesOnceItsOwnWeightsHaveArrived) {
  EventLog log;
  LayerwiseClient client(&log);
  const LoopRun run = RunLoop(&client, &log, 4, Range(4));
  ASSERT_TRUE(run.result.ok()) << run.result.status();
  EXPECT_EQ(run.result->layerwise_steps, 3);  // Every step but the first, which pulls.
  EXPECT_EQ(run.result->computed_steps, 4);
  const std::vector<std::string> want = {
      "pull 0",   "layer 0",  "layer 2",  "push 0 2", "push 0 0",              // step 0
      "wait 0 0", "layer 0",  "wait 0 2", "layer 2",  "push 1 2", "push 1 0",  // step 1
      "wait 1 0", "layer 0",  "wait 1 2", "layer 2",  "push 2 2", "push 2 0",  // step 2
      "wait 2 0", "layer 0",  "wait 2 2", "layer 2",  "push 3 2", "push 3 0",  // step 3
      "wait 3 2", "wait 3 0",  // the last step's pulls: the job's final weights
  };
  EXPECT_EQ(run.events, want) << absl::StrJoin(run.events, ", ");
}

// Without it, the step waits for every pull after its backward pass, as before.
TEST(LayerwiseForwardTest, OffTheStepWaitsForEveryPullFirst) {
  EventLog log;
  LayerwiseClient client(&log);
  const LoopRun run = RunLoop(&client, &log, 3, Range(3), /*layerwise=*/false);
  ASSERT_TRUE(run.result.ok()) << run.result.status();
  EXPECT_EQ(run.result->layerwise_steps, 0);
  const std::vector<std::string> want = {
      "pull 0",  "layer 0", "layer 2",  "push 0 2", "push 0 0", "wait 0 2", "wait 0 0",
      "layer 0", "layer 2", "push 1 2", "push 1 0", "wait 1 2", "wait 1 0",  //
      "layer 0", "layer 2", "push 2 2", "push 2 0", "wait 2 2", "wait 2 0",
  };
  EXPECT_EQ(run.events, want) << absl::StrJoin(run.events, ", ");
}

// A pull of the step before that fails stops the pass at that layer: the error names that step,
// every ticket of it is still waited for, and nothing of the next step is pushed.
TEST(LayerwiseForwardTest, AFailedPullOfTheStepBeforeStopsThePassBeforeAnyPush) {
  EventLog log;
  LayerwiseClient client(&log, /*fail_step=*/2, /*fail_tensor=*/0,
                         absl::InternalError("shard 0 lost its disk"));
  const LoopRun run = RunLoop(&client, &log, 6, Range(6));
  ASSERT_FALSE(run.result.ok());
  EXPECT_EQ(run.result.status(), absl::InternalError("step 2: shard 0 lost its disk"));
  const std::vector<std::string> tail(run.events.end() - 3, run.events.end());
  EXPECT_EQ(tail, (std::vector<std::string>{"push 2 0", "wait 2 0", "wait 2 2"}))
      << absl::StrJoin(run.events, ", ");
}

// A push the servers refuse (ABORTED: register again) while the next step computes: the worker
// registers again and goes on from the servers' step, drawing the batches an uninterrupted worker
// would draw from there: rolled back to the failed step, it computes that step again on the same
// batch; where the servers had applied that step (the pull behind it failed), it computes the
// step whose pass it stopped on that step's batch.
TEST(LayerwiseForwardTest, ARejoinFromTheStepBeforeDrawsTheSameBatchesAgain) {
  EventLog reference_log;
  LayerwiseClient reference_client(&reference_log);
  const LoopRun reference = RunLoop(&reference_client, &reference_log, 6, Range(6));
  ASSERT_TRUE(reference.result.ok()) << reference.result.status();
  ASSERT_EQ(reference.inputs.size(), 6u);
  for (const int64_t resume : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("resuming at step ", resume));
    EventLog log;
    LayerwiseClient client(&log, /*fail_step=*/2, /*fail_tensor=*/2,
                           absl::AbortedError("shard 0 restarted; register again"), resume);
    // Passes: steps 0, 1, 2, 3 (stopped at its second layer), then from `resume` on.
    std::vector<int64_t> versions = {0, 1, 2, 3};
    for (int64_t step = resume; step < 6; ++step) versions.push_back(step);
    const LoopRun run = RunLoop(&client, &log, 6, versions, /*layerwise=*/true, /*rewind=*/true);
    ASSERT_TRUE(run.result.ok()) << run.result.status();
    EXPECT_EQ(run.result->rejoins, 1);
    EXPECT_EQ(run.result->redone_steps, resume == 2 ? 1 : 0);
    ASSERT_EQ(run.inputs.size(), versions.size());
    for (size_t call = 0; call < versions.size(); ++call) {
      EXPECT_EQ(run.inputs[call], reference.inputs[versions[call]]) << "pass " << call;
    }
    // The stopped pass of step 3 pushed nothing: step 3's pushes start once, after the rejoin.
    EXPECT_EQ(std::count(run.events.begin(), run.events.end(), "push 3 0"), 1)
        << absl::StrJoin(run.events, ", ");
  }
}

}  // namespace
}  // namespace rubato
