// TrainingLoop: the worker's data-parallel SGD loop, pull -> forward/backward -> push.
//
// It knows nothing of gRPC or flags: it drives a PsClient, an MlpBackend and a ShardedBatcher, and
// reports progress as JSON lines (one object per line) to a stream, for ./rubato launch to read.
// An optional StragglerModel injects delays (slept after compute, before the push, so the rest of
// the cluster sees slow compute) and a crash.
#ifndef RUBATO_WORKER_TRAINING_LOOP_H_
#define RUBATO_WORKER_TRAINING_LOOP_H_

#include <atomic>
#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/dataset.h"
#include "worker/straggler_model.h"
#include "worker/mlp.h"
#include "worker/mlp_backend.h"
#include "worker/ps_client.h"

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
  // backup:b: a worker whose step was applied without it skips to the servers' current version
  // instead of computing gradients that would be dropped.
  bool skip_to_current_version = false;
  // When a server has dropped this worker (ABORTED, after its lease ran out), the loop registers
  // again and continues from the servers' current step, at most this many times.
  int max_rejoins = 10;
  // If set, the loop stores the step it is working on here (read by the heartbeat thread).
  std::atomic<int64_t>* current_step = nullptr;
  // If set (not owned), the loop sleeps StragglerModel::DelayFor after each step's compute, and at
  // the start of a step where CrashAt is true it prints "rubato_worker: injected crash at step K"
  // to stderr, flushes stdout and ends the process with std::_Exit(3): a worker that dies without
  // a word to the servers.
  StragglerModel* straggler = nullptr;
};

struct TrainingResult {
  int64_t steps = 0;           // The job's steps: the loop ran until the job reached this one.
  int64_t computed_steps = 0;  // Steps this worker computed and pushed.
  int64_t skipped_steps = 0;   // Steps it jumped over (backup:b catching up, a rejoin).
  int rejoins = 0;             // Times it registered again after being dropped.
  double final_loss = 0;  // Mean training loss over the last log interval.
  EvalResult test;        // At the end.
  double wall_seconds = 0;
};

// Runs options.steps steps. `params` holds the weights (one vector per MlpParamSpecs entry) and is
// overwritten by every pull. `test` may be empty (no evaluation). Stops at the first error, which
// names the step.
absl::StatusOr<TrainingResult> RunTraining(const TrainingOptions& options, const MlpSpec& spec,
                                           PsClient* client, MlpBackend* backend,
                                           ShardedBatcher* batcher, const Dataset& test,
                                           std::vector<std::vector<float>>* params,
                                           std::ostream* progress);

}  // namespace rubato

#endif  // RUBATO_WORKER_TRAINING_LOOP_H_
