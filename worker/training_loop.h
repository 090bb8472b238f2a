// TrainingLoop: the worker's data-parallel SGD loop, pull -> forward/backward -> push.
//
// It knows nothing of gRPC or flags: it drives a PsClient, a ModelBackend and a ShardedBatcher, and
// reports progress as JSON lines (one object per line; proto/progress.proto) to a stream, for
// ./rubato launch to read.
//
// Overlap (options.overlap, where the client supports partial pushes): the backend calls back as
// each layer's gradients are computed, last layer first, and the loop hands that layer to its
// communication thread (options.comm_thread), which waits for the gradients' host copy
// (ModelBackend::AwaitGradients) and starts the push (PsClient::StartPush: encoding and the first
// write to the socket), so communication runs while the earlier layers' backward is still
// computing and the compute thread never waits for it until the backward pass is over. Each layer's
// push is followed at once by the pull of that layer's weights for the next step, which the shard
// answers as soon as that tensor's update is applied (in BSP: once every worker's gradient of it
// has arrived). With options.layerwise_forward, the next step does not wait for all of them: it
// draws its batch and starts its forward pass at once, and the pass waits before each layer for the
// pushes (and pulls) of that layer only (ModelBackend's WeightsNeeded), so the first layers compute
// while the pulls of the later ones are still in flight; the step before is accounted for (its
// records, its decisions) once the last of them has arrived, before any of the new step's
// gradients is pushed. Its push_ms is then the time to start its pushes, and the next step's
// pull_ms the time its forward pass waited for weights (not counted as compute_ms). Where the step
// before could change what the next one computes (an adaptive batch, backup workers or adaptive
// consistency, a work feed, an evaluation due, the job's last step), the step waits for all of them
// after its backward pass instead, and the next step starts without a pull of its own (its pull_ms
// is 0, and push_ms is the wait for the pushes and their pulls after the backward pass). Each
// "step" record then gives per layer the mean time from its gradient being ready to its
// push being acknowledged, and the fraction of the time spent pushing that was hidden behind
// compute; an "overlap" record gives one step's raw timestamps. Overlap is off when gradients are
// clipped by their global norm (which needs every layer's gradient first) and when a straggler
// model delays steps (its delay stands for slower compute, so it must come before any push). An
// optional StragglerModel injects delays (slept after compute, before the push, so the rest of the
// cluster sees slow compute) and a crash (TrainingOptions.on_injected_crash).
#ifndef RUBATO_WORKER_TRAINING_LOOP_H_
#define RUBATO_WORKER_TRAINING_LOOP_H_

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/batch_plan.h"
#include "common/clock.h"
#include "proto/progress.pb.h"
#include "worker/comm_thread.h"
#include "worker/data/dataset.h"
#include "worker/job_noise_scale.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/push_buckets.h"
#include "worker/straggler_model.h"
#include "worker/work_feed.h"

namespace rubato {

struct TrainingOptions {
  int worker_id = 0;
  int64_t steps = 0;       // Steps to run; every worker of a BSP job must run the same number.
  int64_t eval_every = 0;  // Evaluate on the test set every this many steps (0: only at the end).
  int64_t log_every = 20;  // Emit a "step" record every this many steps.
  // > 0: scale this worker's gradient to at most this global L2 norm before pushing it. Clipping
  // happens on each worker's gradient, before averaging: with whole tensors spread over shards, no
  // shard sees the global norm of the averaged gradient.
  double clip_global_norm = 0;
  int64_t start_step = 0;  // From PsClient::Register.
  // What the loop's timings and an injected straggler delay read (a simulator's clock); must
  // outlive the loop.
  Clock* clock = Clock::Real();
  // backup:b: a worker whose step was applied without it skips to the servers' current version
  // instead of computing gradients that would be dropped.
  bool skip_to_current_version = false;
  // When a server has dropped this worker (ABORTED, after its lease ran out), the loop registers
  // again and continues from the servers' current step, at most this many times.
  int max_rejoins = 10;
  // bsp and backup: after registering again, continue from the servers' step even when it is
  // behind this worker's (the job was rolled back to a checkpoint after a shard restarted), and
  // draw the examples from there. Otherwise the loop never goes back.
  bool rewind_on_rejoin = false;
  // If set, the loop stores the step it is working on here (read by the heartbeat thread).
  std::atomic<int64_t>* current_step = nullptr;
  // If set (not owned), the loop sleeps StragglerModel::DelayFor after each step's compute, and at
  // the start of a step where CrashAt is true it flushes `progress` and calls on_injected_crash.
  StragglerModel* straggler = nullptr;
  // The injected crash: rubato_worker's main ends the process here (a worker that dies without a
  // word to the servers). If it returns, or is unset, the loop fails with INTERNAL "injected crash
  // at step K".
  std::function<void(int64_t step)> on_injected_crash;
  // Push each layer's gradients as soon as the backward pass produces them (see above).
  bool overlap = true;
  // With overlap: start each push on a communication thread of the loop's own
  // (worker/comm_thread.h), which also waits for a GPU's copy of the gradients to the host, so the
  // compute thread goes straight on with the next layer's backward pass; false starts them from
  // the compute thread inside the backward pass (for comparison).
  bool comm_thread = true;
  // With overlap: the next step's forward pass waits for each layer's weights as it reaches that
  // layer, not for all of them before it starts (see above); false waits for every pull after the
  // backward pass (for comparison).
  bool layerwise_forward = true;
  // With overlap: consecutive layers are gathered into one push until it holds at least this many
  // bytes (worker/push_buckets.h); 0 pushes every layer alone.
  int64_t push_bucket_bytes = 0;
  // Adaptive batch (ClusterSpec.adaptive_batch; common/batch_plan.h): the servers announce each
  // batch change in the push responses of the step before it; every worker applies it at that
  // step, and the loop runs until the job has drawn the examples of `steps` steps at the starting
  // batch (the same examples as a fixed-batch run), so the step count follows the plan. Worker 0
  // writes a "batch" record for each change.
  bool adaptive_batch = false;
  int num_workers = 1;  // The job's workers (for the global batch).
  // The training set's size: each "eval" record then gives the epochs drawn so far (0: none).
  int64_t train_examples = 0;
  // Work reassignment (not owned; worker/work_feed.h): batches come from the feed, not the
  // batcher, a "unit" record is written as each unit begins, and the loop ends when the feed has
  // no more (this worker's steps are then its own count, and `steps` only a bound). A batch may
  // be short (the last of a worker's share).
  WorkFeed* work = nullptr;
};

struct TrainingResult {
  int64_t steps = 0;           // The job's steps: the loop ran until the job reached this one.
  int final_batch = 0;         // The per-worker batch of the last step.
  int64_t computed_steps = 0;  // Steps this worker computed and pushed.
  int64_t skipped_steps = 0;   // Steps it jumped over (backup:b catching up, a rejoin).
  int64_t redone_steps = 0;    // Steps computed again after the job was rolled back.
  int rejoins = 0;             // Times it registered again after being dropped.
  double final_loss = 0;       // Mean training loss over the last log interval.
  EvalResult test;             // At the end.
  double wall_seconds = 0;
  // bsp, backup: the job's gradient noise scale B_simple from the shards' moving averages at the
  // last step measured (NaN if none; server/noise_scale.h).
  double noise_scale = std::nan("");
  // Work reassignment: units drawn, and of those, units of other workers' shares.
  int64_t units = 0;
  int64_t reassigned_units = 0;
  // Steps whose forward pass started before their weights had all arrived (layerwise_forward).
  int64_t layerwise_steps = 0;
};

// What a step record reports of a log interval: sums over its steps, times in seconds.
struct StepSums {
  double loss = 0, compute_s = 0, delay_s = 0, pull_s = 0, push_s = 0, staleness = 0;
  int64_t steps = 0, dropped = 0, skipped = 0;
};

// The step record (proto/progress.proto) of an interval of `sums.steps` (>= 1) steps that ended
// with step `done`, `t` seconds after the loop began and `elapsed` seconds after the interval
// did: the means per step, rounded as every record is. The loop's overlap figures are its own.
StepRecord StepRecordOf(int worker, int64_t done, int64_t epoch, double t, double elapsed,
                        const StepSums& sums);

// Whether RunTraining will overlap pushes with the backward pass, and if not, why not (for logs).
bool OverlapEnabled(const TrainingOptions& options, const PsClient& client, std::string* why_not);

// One push of a step: a layer's tensors [first_tensor, ...) with overlap, every tensor without
// (ticket 0), and when it started, was acknowledged and its pull ended.
struct LayerPush {
  int64_t ticket = 0;
  size_t first_tensor = 0;
  size_t tensors = 0;
  PsClient::PushTiming timing;
};

// Runs options.steps steps. `params` holds the weights (one vector per ModelParamSpecs entry) and
// is overwritten by every pull. `test` may be empty (no evaluation). Stops at the first error,
// which names the step. Progress goes to `progress` as JSON lines.
class TrainingLoop {
 public:
  TrainingLoop(const TrainingOptions& options, const ModelSpec& spec, PsClient* client,
               ModelBackend* backend, ShardedBatcher* batcher, const Dataset& test,
               std::vector<std::vector<float>>* params, std::ostream* progress);

  // Runs the loop once.
  absl::StatusOr<TrainingResult> Run();

 private:
  // When a step reached each of its stages.
  struct StepTimes {
    absl::Time start;             // Before the pull.
    absl::Time drawn;             // Before the batch is drawn (the pull is over).
    absl::Time computed;          // Backward pass over (overlapped pushes started).
    absl::Time computed_delayed;  // ... plus an injected straggler delay.
    absl::Time pushed;            // Every push acknowledged (deferred: every push started).
    bool pulled = false;          // It pulled (rather than using the last step's prefetch).
    // Layerwise forward: the time this step's forward pass waited for weights.
    absl::Duration weights_wait = absl::ZeroDuration();
    // A deferred step (its pushes waited for in the next step's forward pass): the part of that
    // wait spent on its pulls, which was not hidden behind compute.
    bool deferred = false;
    absl::Duration next_forward_wait = absl::ZeroDuration();
  };
  // A step whose pushes (and the pulls of the next step's weights behind them) are still in
  // flight while the next step computes: the next step's forward pass waits for them layer by
  // layer (AwaitWeights), and the step is accounted for once all have arrived (Complete).
  struct Deferred {
    int64_t step = 0;
    float loss = 0;
    StepTimes t;
    std::vector<LayerPush> pushes;
    std::vector<bool> waited;  // per push
    PsClient::PushResult pushed;
    absl::Status status;     // the first push that failed, or the accounting's error
    bool completed = false;  // accounted for (Complete)
  };
  // The weights a step pulled: their version, or where a rejoin lands (resume >= 0).
  struct PullOutcome {
    int64_t version = 0;
    bool pulled = false;
    int64_t resume = -1;
  };
  // Sums over the current log interval, in seconds (comm = pull + push), and the overlap
  // accounting: time pushes were in flight (the union of their intervals), the part of it inside
  // the step's compute, and per layer (by its first tensor) the time from gradient ready to push
  // acknowledged.
  struct Interval : StepSums {
    absl::Time start;
    double grad_norm = 0, push_busy_s = 0, push_hidden_s = 0;
    std::vector<double> ready_to_ack_s;
  };

  // The steps, the final pull and the test: Run's work, inside its use of the host buffers.
  absl::StatusOr<TrainingResult> RunSteps();
  static std::vector<int64_t> TensorBytes(const std::vector<ParamSpec>& specs);
  double Elapsed() const;

  // pull -> forward/backward -> push; returns the step to run next.
  absl::StatusOr<int64_t> Step(int64_t step);
  absl::Status InjectCrash(int64_t step);
  absl::StatusOr<PullOutcome> PullWeights(int64_t step);
  void UseBatchOf(int64_t step);
  // Draws this step's batch into x_, y_ and returns its rows (0: the work feed has no more).
  absl::StatusOr<int> Draw(int64_t step);
  // With overlap, starts each layer's push from the backend's callback as soon as its gradients
  // are final.
  absl::StatusOr<float> ForwardBackward(int64_t step, StepTimes* t);
  void StartPushes(int64_t step, const std::vector<PushBuckets::Range>& ranges);
  // Runs `task` on the communication thread (in the order posted), or at once without one.
  void Communicate(std::string what, std::function<void()> task);
  // Waits until every push of the step has started (the communication thread is idle).
  absl::Status DrainPushes(int64_t step);
  absl::Status WaitForPushes(int64_t step, bool computed, PsClient::PushResult* pushed);
  // Whether the step's pushes may be waited for in the next step's forward pass (see above).
  bool MayDefer(int64_t step) const;
  // Waits for the deferred step's push i, keeping the first error.
  void WaitDeferred(size_t i);
  // Layerwise forward: waits for the deferred pushes of tensors [first, first + count), and
  // completes the deferred step once none is left.
  absl::Status AwaitWeights(size_t first, size_t count);
  // Accounts for the deferred step (all its pushes arrived): as the end of Step would have.
  absl::Status Complete(const Deferred& d);
  // After the forward/backward pass of `step`: waits for what the pass did not, completes the
  // deferred step and sets t->weights_wait; returns -1 to go on with `step`, else the step to run
  // next (where a rejoin lands; the pass then stopped before pushing anything).
  absl::StatusOr<int64_t> FinishDeferred(int64_t step, StepTimes* t);
  // Whether an evaluation falls due after step done - 1.
  bool EvalDue(int64_t done) const;
  void Straggle(int64_t step, StepTimes* t);
  absl::Status PushAll(int64_t step, absl::Time computed, PsClient::PushResult* pushed);
  // The step's figures into the interval; records, batch changes and evaluations that fall due.
  absl::Status Account(int64_t step, float loss, const StepTimes& t,
                       const PsClient::PushResult& pushed, const std::vector<LayerPush>& pushes);
  void Report(int64_t done, const StepTimes& t, const std::vector<LayerPush>& pushes);
  absl::StatusOr<EvalResult> Evaluate(int64_t step);
  // Adaptive batch: takes the changes the shards announced. `computed` is the last step this
  // worker has computed (-1 at registration, when they are the job's history): a change for a
  // step already computed cannot be applied and is an error, as are shards that disagree.
  absl::Status Adopt(const std::vector<BatchChange>& changes, int64_t computed);
  // Adaptive consistency: relays this step's compute time from now on, and takes the decisions
  // the shards announced (worker 0 writes each new one as a `consistency` record).
  absl::Status AdoptConsistency(int64_t step, const StepTimes& t,
                                const PsClient::PushResult& pushed);
  // Draws the examples an uninterrupted worker would draw from `step` on.
  void Seek(int64_t step);
  // Registers again after a server dropped this worker (or was restored); returns the step to
  // continue from. `drawn`: this step's batch was drawn already (its push failed), so going back
  // to it draws that batch again.
  absl::StatusOr<int64_t> Rejoin(int64_t step, const absl::Status& why, bool drawn);

  // Constant after construction.
  const TrainingOptions options_;
  const ModelSpec& spec_;
  const std::vector<ParamSpec> specs_;
  PsClient* const client_;
  ModelBackend* const backend_;
  ShardedBatcher* const batcher_;
  const Dataset& test_;
  std::vector<std::vector<float>>* const params_;
  std::ostream* const progress_;
  const bool overlap_;
  const int batch0_;
  const int workers_;
  const int64_t job_examples_;  // The fixed-batch job's examples (an adaptive batch draws as many).

  int batch_;
  int rows_ = 0;   // The rows of the batch drawn (batch_, or fewer from a work feed).
  int64_t steps_;  // The job's steps; an adaptive batch changes them.
  BatchPlan plan_;
  std::vector<float> x_;    // (batch, input size)
  std::vector<int32_t> y_;  // (batch)
  std::vector<std::vector<float>> grads_;
  std::vector<absl::Span<float>> grad_spans_;
  PushBuckets buckets_;
  // This step's pushes, and the first that failed to start (or whose gradients' copy failed):
  // written by the communication thread during the backward pass, read once it is drained.
  std::vector<LayerPush> pushes_;
  absl::Status start_error_;
  std::unique_ptr<CommThread> comm_;  // With overlap and options.comm_thread.
  // With overlap, each layer's push is followed by its pull for the next step; when every tensor
  // was pulled that way, the next step skips its pull.
  int64_t prefetched_step_ = -1;
  int64_t prefetched_version_ = 0;
  std::optional<Deferred> deferred_;  // Layerwise forward: the step before, still in flight.
  // The newest PushResult::applied_examples (-1: none): what the eval records' epochs count.
  int64_t applied_examples_ = -1;
  // Adaptive consistency: the moving average of this worker's compute time per step (injected
  // delay included), relayed to the servers.
  double compute_ms_ema_ = 0;
  JobNoiseScale noise_;
  absl::Time start_;
  Interval interval_;
  TrainingResult result_;
};

// TrainingLoop(...).Run().
// Adaptive consistency: the moving mean of a worker's compute time per step that it relays
// (PsClient::SetComputeMs), after a step of `ms`; `mean` <= 0: none yet.
inline double NextComputeMsMean(double mean, double ms) {
  return mean <= 0 ? ms : 0.8 * mean + 0.2 * ms;
}

absl::StatusOr<TrainingResult> RunTraining(const TrainingOptions& options, const ModelSpec& spec,
                                           PsClient* client, ModelBackend* backend,
                                           ShardedBatcher* batcher, const Dataset& test,
                                           std::vector<std::vector<float>>* params,
                                           std::ostream* progress);

}  // namespace rubato

#endif  // RUBATO_WORKER_TRAINING_LOOP_H_
