// ParameterShard: the tensors of one parameter-server shard, and the rule that updates them.
//
// Pure logic with no network inside: server/parameter_service.cc adapts it to gRPC, and tests drive
// it directly. Thread-safe; every public method may be called from any thread.
//
// Each tensor has a version, the number of updates applied to it. A worker's clock is its step.
// Consistency models (ClusterSpec.consistency), all tracked per tensor, not per push message:
//   bsp       The gradient pushed for step t was computed on version t. When every member has
//             pushed its gradient of tensor T for step t, their mean (summed in double in worker-id
//             order, so the result does not depend on arrival order) is handed to the optimizer
//             once, and T's version becomes t + 1. A pull for step t waits for version t.
//   backup:b  As bsp, but step t of T is applied as soon as (members - b) gradients are in (Chen et
//             al. 2016); gradients for step t that arrive later are dropped and counted.
//   async     Every gradient is applied on arrival, alone (Downpour, Dean et al. 2012); pulls
//             never wait. With staleness_aware_lr its rate is divided by its staleness tau.
//   ssp:s     Applied on arrival as async; the bound is enforced at the pull: a worker's pull for
//             step c waits until every member has pushed step c - s - 1 (its clock, the number of
//             steps it has pushed to every tensor of this shard, is >= c - s) (Ho et al. 2013).
// Staleness tau of a gradient = updates applied to its tensor since the version the worker pulled
// (0 under bsp and backup). In async and ssp the schedule's update count is version / members, so
// that the rate follows the job's steps rather than the number of pushes.
//
// Learning rate: the update that takes a tensor from version t to t + 1 uses the schedule's rate
// for update t (common/lr_schedule.h), so the rate follows the shard's own count of applied
// updates. The schedule needs the global batch (the sum of the registered workers' batches) and the
// job's length, so it is built, and logged, when the last worker registers.
//
// Training starts when all `num_workers` workers of the cluster spec have registered: pulls wait
// for that, and pushes before it are refused. Every wait has a deadline; a pull that times out
// fails with DEADLINE_EXCEEDED naming the workers it was waiting for.
#ifndef RUBATO_SERVER_PARAMETER_SHARD_H_
#define RUBATO_SERVER_PARAMETER_SHARD_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "common/thread_pool.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

struct ShardOptions {
  int shard_id = 0;
  int num_shards = 1;
  // num_workers, consistency, optimizer, lr_schedule, lease_ms and wait_timeout_ms are used;
  // servers is not.
  ClusterSpec cluster;
  // Threads that share one tensor's update (large tensors only); 1 = the calling thread alone.
  int update_threads = 1;
};

class ParameterShard {
 public:
  // Called exactly once per Pull, possibly on another thread, never with the shard's lock held.
  using PullDone = std::function<void(absl::Status, PullResponse)>;

  // InvalidArgument for a bad spec.
  static absl::StatusOr<std::unique_ptr<ParameterShard>> Create(const ShardOptions& options);

  // Fails every waiting pull with UNAVAILABLE and stops the deadline thread.
  ~ParameterShard();

  ParameterShard(const ParameterShard&) = delete;
  ParameterShard& operator=(const ParameterShard&) = delete;

  // Adds the worker to the job. The request's num_workers and consistency must be the shard's
  // (FAILED_PRECONDITION otherwise). The first registrant's model and initial values are adopted; a
  // later registrant's model must match exactly (FAILED_PRECONDITION naming the first difference).
  // Registering again (a restarted worker) is allowed and changes nothing but its bookkeeping.
  absl::StatusOr<RegisterResponse> Register(const RegisterRequest& request);

  // Validates the whole request first: on any error nothing is applied (INVALID_ARGUMENT for an
  // unknown tensor, a repeated tensor, a wrong byte size, a NaN or Inf, a negative step;
  // FAILED_PRECONDITION for an unregistered worker, a push before all workers registered, or a step
  // from the future). A gradient whose (worker, step, tensor) was already received is acknowledged
  // as a duplicate and ignored.
  absl::StatusOr<PushResponse> Push(const PushRequest& request);

  // Answers with the requested tensors once each has version >= request.step, or fails at
  // `deadline` (capped by the cluster's wait_timeout_ms) with DEADLINE_EXCEEDED naming whom it
  // waited for. Bad requests fail at once.
  void Pull(const PullRequest& request, absl::Time deadline, PullDone done);

  absl::StatusOr<HeartbeatResponse> Heartbeat(const HeartbeatRequest& request);

  // A worker (registered, or dropped) has finished training: its lease no longer runs. Repeating
  // it is harmless; registering again makes the worker a live member again.
  absl::StatusOr<FinishResponse> Finish(const FinishRequest& request);

  // Whether the job is over for this shard, polled by the server's main loop:
  //   true    every worker has finished; or none is live (registered, not finished, heard from
  //           within its lease) and at least one finished, and no worker has been live for one
  //           lease since (the dropped ones had that long to come back);
  //   false   training goes on, or may still;
  //   error   DEADLINE_EXCEEDED when no worker has been live for `idle_timeout` and none has
  //           finished (workers that never came, or all died), naming them.
  absl::StatusOr<bool> JobFinished(absl::Duration idle_timeout);

  GetStatsResponse Stats() const;

  // Fails every waiting pull with UNAVAILABLE; later pulls fail at once. Idempotent.
  void Shutdown();

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> weights;  // (elements)
    int64_t version = 0;         // Updates applied.
    TensorRole role;             // Weight decay / layer adaptation, from the exclusion rules.
    TensorOptimizerState optimizer_state;
    // Gradients received for step == version, indexed by worker id; (num_workers, elements).
    std::vector<std::vector<float>> pending;
    std::vector<bool> received;  // (num_workers)
    int received_count = 0;
    std::vector<int64_t> last_pushed;     // (num_workers) Highest step pushed by each worker.
    std::vector<int64_t> pulled_version;  // (num_workers) Version each worker last pulled.
  };
  struct Worker {
    bool registered = false;  // A member: counted in barriers.
    bool dropped = false;     // Was a member, then silent for longer than the lease.
    bool finished = false;    // Said it has finished (Finish); no longer heartbeats.
    int32_t batch_size = 0;
    int64_t steps_per_epoch = 0;
    int64_t total_steps = 0;
    int64_t last_step = -1;
    int64_t pulled_step = -1;  // Highest step this worker has pulled (async, ssp: pushes up to it).
    absl::Time last_seen;
  };
  struct PendingPull {
    PullRequest request;
    absl::Time deadline;
    PullDone done;
  };
  struct Completion {
    PullDone done;
    absl::Status status;
    PullResponse response;
  };

  ParameterShard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer);

  // Checks names and the worker; InvalidArgument / FailedPrecondition, or OK.
  absl::Status CheckPull(const PullRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PullReady(const PullRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PullResponse Snapshot(const PullRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeWait(const PullRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves every satisfied waiter into `out`.
  void CollectReady(std::vector<Completion>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Averages the pending gradients, applies the optimizer and bumps the version.
  void ApplyUpdate(Tensor* tensor, double learning_rate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether step `version` of `t` can be applied now (bsp, backup).
  bool StepComplete(const Tensor& t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Number of steps worker `w` has pushed to every tensor of this shard.
  int64_t Clock(int w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordStaleness(int64_t tau) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails (ABORTED) the same worker's parked pulls that share a tensor with `request`: an honest
  // worker has one pull per tensor in flight, and a retry replaces a pull whose call broke. This
  // bounds a worker's parked pulls, and the snapshots they cost, by the shard's tensors.
  void SupersedePulls(const PullRequest& request, std::vector<Completion>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers which versions a worker was given (async, ssp staleness).
  void RecordPulled(const PullRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int RegisteredCount() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Builds the schedule once every worker has registered. An error here (e.g. a warmup longer than
  // the job) refuses the last registration.
  absl::Status StartTrainingIfComplete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t MinVersion() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops members silent for longer than the lease, completes the steps they held up, and returns
  // the earliest time another member's lease can run out.
  absl::Time ExpireLeases(std::vector<Completion>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies every tensor whose current step every member has pushed.
  void ApplyCompleteSteps() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK for a member; ABORTED for a dropped worker; FAILED_PRECONDITION for an unknown one.
  absl::Status CheckMember(int id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeadlineLoop();
  static void Run(std::vector<Completion>* completions);

  // Constant after construction.
  const ShardOptions options_;
  const std::unique_ptr<Optimizer> optimizer_;
  const absl::Duration max_wait_;
  std::unique_ptr<ThreadPool> pool_;  // Null with update_threads == 1.

  mutable absl::Mutex mu_;
  bool initialised_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Tensor> tensors_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> index_ ABSL_GUARDED_BY(mu_);  // name -> tensors_ slot
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);                     // (num_workers)
  std::list<PendingPull> waiting_ ABSL_GUARDED_BY(mu_);
  absl::CondVar waiting_changed_;
  // Counters for GetStats.
  int64_t pushes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rejected_pushes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t duplicate_gradients_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t applied_updates_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_workers_ ABSL_GUARDED_BY(mu_) = 0;
  // When some worker was last live (JobFinished); the shard's creation at first.
  absl::Time last_live_ ABSL_GUARDED_BY(mu_) = absl::Now();
  int64_t dropped_gradients_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> staleness_histogram_ ABSL_GUARDED_BY(mu_) = std::vector<int64_t>(8, 0);
  std::optional<LearningRateScheduler> schedule_ ABSL_GUARDED_BY(mu_);
  double last_learning_rate_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread deadline_thread_;  // Last member: started when everything else is ready.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PARAMETER_SHARD_H_
