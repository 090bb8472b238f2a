// The progress records rubato_worker writes itself (proto/progress.proto,
// docs/running.md#progress-records): start before the first step, done after the last, and the
// eval_model and sharpness lines of its tools over an exported model. The training loop writes the
// rest (worker/training_loop.h). Each builder only fills and rounds; WriteProgress prints.
#ifndef RUBATO_WORKER_WORKER_RECORDS_H_
#define RUBATO_WORKER_WORKER_RECORDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "proto/cluster.pb.h"
#include "proto/model_file.pb.h"
#include "proto/progress.pb.h"
#include "worker/model/model_backend.h"
#include "worker/model/sharpness.h"
#include "worker/training_loop.h"

namespace rubato {

// The job's length: every worker runs the same number of steps, so that no BSP barrier waits for
// a finished worker.
struct JobLength {
  int64_t global_batch = 0;
  int64_t steps_per_epoch = 0;
  int64_t steps = 0;
};

// The length of a job of `num_workers` x `batch_size` over `train_examples`: `steps` when > 0,
// else `epochs` passes (an epoch's last step may be short of examples).
JobLength JobLengthOf(int batch_size, int num_workers, int64_t train_examples, int64_t steps,
                      int epochs);

// --eval_every's default: twice an epoch.
inline int64_t DefaultEvalEvery(const JobLength& job) {
  return job.steps_per_epoch / 2 > 1 ? job.steps_per_epoch / 2 : 1;
}

// Whether a worker evaluates: worker 0 under bsp (every worker holds the same weights), every
// worker otherwise or with --eval_all_workers.
inline bool WorkerEvaluates(int worker, ConsistencyMode mode, bool eval_all_workers) {
  return worker == 0 || eval_all_workers || mode != BSP;
}

// FNV-1a over the final weights' bytes: equal on workers that hold bit-identical parameters.
uint64_t ParamsFingerprint(const std::vector<std::vector<float>>& params);

// The start record: the job as worker `worker` runs it. `model` is the --model spec, `parameters`
// its parameter count, `mode` the consistency mode as FormatConsistency spells it.
ProgressRecord StartProgress(int worker, const JobLength& job, int batch_size,
                             const std::string& model, int64_t parameters,
                             const std::string& backend, bool overlap, const std::string& mode,
                             int64_t shard_examples);

// The done record of a finished loop, with the fingerprint of its final `params`; the test
// figures only where this worker `evaluated`.
ProgressRecord DoneProgress(int worker, const TrainingResult& result,
                            const std::vector<std::vector<float>>& params, bool evaluated);

// --eval_model: the model exported to `path` (described by `about`) evaluated on `backend`.
ProgressRecord EvalModelProgress(const std::string& path, const ModelFile& about,
                                 const std::string& backend, const EvalResult& result);

// --sharpness: the model exported to `path` at box size `epsilon`, after `steps` ascent steps over
// `examples` training examples.
ProgressRecord SharpnessProgress(const std::string& path, const ModelFile& about, double epsilon,
                                 int steps, int64_t examples, const SharpnessResult& result);

}  // namespace rubato

#endif  // RUBATO_WORKER_WORKER_RECORDS_H_
