// ParameterShard: the tensors of one parameter-server shard, and the rule that updates them.
//
// Pure logic with no network inside: server/parameter_service.cc adapts it to gRPC, and tests drive
// it directly. Thread-safe; every public method may be called from any thread.
//
// Parts, each readable and tested alone:
//   server/membership.h          who is a member, leases, clocks (under the shard's lock);
//   server/consistency_policy.h  what each consistency mode decides;
//   server/tensor_aggregator.h   one tensor: its lock, gradients gathered in worker-id order, the
//                                optimizer step, copy-on-write weights that pulls share.
// The shard validates each call, keeps membership and the parked pulls under its one lock, and
// runs each pushed gradient on its update pool, so that the tensors of one push (and of
// concurrent pushes) are updated in parallel, off gRPC's threads.
//
// Each tensor has a version, the number of updates applied to it. A worker's clock is its step.
// Consistency models (ClusterSpec.consistency), all tracked per tensor, not per push message:
//   bsp       The gradient pushed for step t was computed on version t. When every member has
//             pushed its gradient of tensor T for step t, their mean (summed in float in worker-id
//             order, so the result does not depend on arrival order; server/tensor_aggregator.h)
//             is handed to the optimizer once, and T's version becomes t + 1. A pull for step t
//             waits for version t.
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

#include <atomic>
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
#include "common/batch_plan.h"
#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "common/tensor_wire.h"
#include "common/thread_pool.h"
#include "proto/checkpoint.pb.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/noise_scale.h"
#include "server/tensor_aggregator.h"

namespace rubato {

struct ShardOptions {
  int shard_id = 0;
  int num_shards = 1;
  // num_workers, consistency, optimizer, lr_schedule, lease_ms and wait_timeout_ms are used;
  // servers is not.
  ClusterSpec cluster;
  // Threads that share one tensor's update (large tensors only); 1 = the calling thread alone.
  int update_threads = 1;
  // Threads that apply pushed gradients, one tensor each at a time (>= 1).
  int apply_threads = 2;
  // Checkpoints every this many job steps (0: none), handed to on_checkpoint (see
  // CapturedCheckpoint), which must return quickly: it runs on the thread that applied the last
  // update of the step, with that tensor's lock held.
  int64_t checkpoint_every_steps = 0;
  std::function<void(std::shared_ptr<const struct CapturedCheckpoint>)> on_checkpoint;
  // Rolls this shard back to its checkpoint of `step`, as recovery `recovery_id` (see Rollback):
  // OK once that is arranged (the server restarts from it), an error naming why it cannot be.
  // Null: the shard keeps no checkpoints and refuses roll-backs.
  std::function<absl::Status(int64_t step, uint64_t recovery_id)> on_rollback;
  // bsp, backup: decay of the noise scale's moving averages, in [0, 1) (server/noise_scale.h).
  double noise_ema_decay = 0.95;
  // bsp: what all the workers together should have in flight to this shard. Each worker's share
  // holds two calls (a client's limit), so tensors larger than share / 2 are pushed in parts of
  // that size (RegisterResponse.part_elements; PushPartElements), between 1 and 8 MiB.
  int64_t push_budget_bytes = int64_t{32} << 20;
  // >= 0: this bsp part size (elements; 0 whole tensors) instead of PushPartElements' (tests and
  // fuzzing, which use tensors far smaller than a 1 MiB part).
  int64_t part_elements = -1;
};

// The part size (elements) for a bsp job of `num_workers` workers under `push_budget_bytes`:
// budget / (2 calls x workers), at least 1 MiB and at most 8 MiB of floats (1024-element
// multiples). 0 (whole tensors) for every other mode.
int64_t PushPartElements(const ConsistencyConfig& consistency, int num_workers,
                         int64_t push_budget_bytes);

// Every tensor of a shard at one job step, for a checkpoint. Under bsp and backup each tensor was
// taken right after the update that brought it to version `step`, so the cut is consistent even
// though tensors update independently; under async and ssp, when its own update count reached
// step x workers. The weights are shared with the shard (copy-on-write), the optimizer states
// copied. ParameterShard::CheckpointProto turns it into what server/checkpoint.h writes.
struct CapturedCheckpoint {
  int64_t step = 0;
  std::vector<TensorSnapshot> weights;  // In the shard's tensor order.
  std::vector<TensorOptimizerState> optimizer_states;
};

// One tensor of a pull's answer: its name and the shared weights of one version.
struct PulledTensor {
  const std::string* name;  // Owned by the shard.
  TensorSnapshot snapshot;
};

class ParameterShard {
 public:
  // Called exactly once per Pull, possibly on another thread, never with the shard's lock held.
  using PullDone = std::function<void(absl::Status, PullResponse)>;
  using SharedPullDone = std::function<void(absl::Status, std::vector<PulledTensor>)>;
  using PushDone = std::function<void(absl::StatusOr<PushResponse>)>;

  // InvalidArgument for a bad spec.
  static absl::StatusOr<std::unique_ptr<ParameterShard>> Create(const ShardOptions& options);

  // Fails every waiting pull with UNAVAILABLE, finishes the pushes being applied, and stops the
  // deadline thread.
  ~ParameterShard();

  ParameterShard(const ParameterShard&) = delete;
  ParameterShard& operator=(const ParameterShard&) = delete;

  // Adds the worker to the job. The request's num_workers and consistency must be the shard's
  // (FAILED_PRECONDITION otherwise). The first registrant's model and initial values are adopted; a
  // later registrant's model must match exactly (FAILED_PRECONDITION naming the first difference).
  // A registration without initial values to a shard that has no weights yet registers nothing:
  // the first such registrant is answered needs_initial_values (and sends them), the others
  // initialising (and come back), so that one worker sends the model's values, once. If the one
  // asked has not sent them within 10 s, the next registrant is asked instead.
  // Registering again (a restarted worker) is allowed and changes nothing but its bookkeeping.
  absl::StatusOr<RegisterResponse> Register(const RegisterRequest& request);

  // Validates the whole request first: on any error nothing is applied (INVALID_ARGUMENT for an
  // unknown tensor, a repeated tensor, a wrong byte size, a NaN or Inf, a negative step;
  // FAILED_PRECONDITION for an unregistered worker, a push before all workers registered, or a step
  // from the future). A gradient whose (worker, step, tensor) was already received is acknowledged
  // as a duplicate and ignored. The gradients are then applied on the update pool, and `done` is
  // called (on a pool thread, or at once for an error) when all are. With a keepalive, a bsp
  // gradient that arrives before a lower-numbered member's is held and counts as applied only once
  // it is added (or fails with DEADLINE_EXCEEDED after wait_timeout_ms, naming whom it waits
  // for), so the shard holds at most the calls each worker has in flight.
  //
  // The gradients' bytes are views (common/tensor_wire.h) that `keepalive` keeps valid for as long
  // as the shard holds it; with a null keepalive they must stay valid until `done` is called, and
  // are copied if they must be held longer (an early arrival under bsp).
  void Push(const WirePush& request, std::shared_ptr<const void> keepalive, PushDone done);
  // The same, waiting for the answer.
  absl::StatusOr<PushResponse> Push(const PushRequest& request);

  // Answers with the requested tensors once each has version >= request.step, or fails at
  // `deadline` (capped by the cluster's wait_timeout_ms) with DEADLINE_EXCEEDED naming whom it
  // waited for. Bad requests fail at once. The answer shares the weights: nothing is copied.
  void Pull(const PullRequest& request, absl::Time deadline, SharedPullDone done);
  // The same, with the values copied into a PullResponse.
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

  // Puts back a checkpoint (server/checkpoint.h) before any worker registers: the tensors, their
  // versions and optimizer states, and under async and ssp every worker's clock at the
  // checkpoint's step. Workers then register without values and go on from that step.
  // FAILED_PRECONDITION naming the difference for another job's checkpoint (shard, shard count,
  // workers, mode, optimizer type), DATA_LOSS for one that is inconsistent.
  absl::Status Restore(const ShardCheckpoint& checkpoint);
  // The checkpoint to write for `capture`: it plus the job, the tensors' names and shapes, and the
  // workers' batches and clocks.
  ShardCheckpoint CheckpointProto(const CapturedCheckpoint& capture) const;

  // Which recovery this shard's state belongs to (RegisterResponse.recovery_id): set by the
  // server after Restore, 0 (the default) for a fresh start.
  void SetRecoveryId(uint64_t id) { recovery_id_.store(id); }
  uint64_t recovery_id() const { return recovery_id_.load(); }

  // Under bsp and backup, rolls the shard back to its checkpoint of request.step, as recovery
  // request.recovery_id (proto/parameter_server.proto, RollbackRequest): restarting false when it
  // already belongs to that recovery; otherwise options.on_rollback arranges it and restarting is
  // true. FAILED_PRECONDITION under async and ssp (a restored shard there needs no roll-back),
  // without on_rollback, or for a step ahead of this shard's; INVALID_ARGUMENT for a bad worker,
  // step or id.
  absl::StatusOr<RollbackResponse> Rollback(const RollbackRequest& request);

  // Fails every waiting pull with UNAVAILABLE; later pulls fail at once. Idempotent.
  void Shutdown();

 private:
  class PullState;
  class UpdatePool;
  using PullStatePtr = std::shared_ptr<PullState>;

  ParameterShard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer);

  // The tensors a pull names (all of them for none), after checking names and the worker.
  absl::StatusOr<std::vector<int>> CheckPull(const PullRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeWait(const PullState& pull) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks each tensor of `pull` for its snapshot (queueing where the version is not there yet);
  // true if that completed it.
  bool Arm(const PullStatePtr& pull) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Arms the parked pulls that may start now (training started, ssp clocks); completed ones go
  // to *ready.
  void ArmParked(std::vector<PullStatePtr>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends (ABORTED) the same worker's parked pulls that share a tensor with `pull`: an honest
  // worker has one pull per tensor in flight, and a retry replaces a pull whose call broke. This
  // bounds a worker's parked pulls by the shard's tensors.
  void SupersedePulls(const PullState& pull, std::vector<std::function<void()>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers a pull whose every tensor is filled. No lock held.
  void Complete(const PullStatePtr& pull);
  int64_t MinVersion() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Builds the schedule once every worker has registered. An error here (e.g. a warmup longer than
  // the job) refuses the last registration.
  absl::Status StartTrainingIfComplete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the current members to the tensors, then completes the steps they no longer wait
  // for.
  void MembersChanged(std::vector<PullStatePtr>* ready, Released* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the pulls and answers the held gradients in `released`. No lock held.
  void Finish(Released* released);
  TensorAggregator::Context Context() const;
  // A push that passed its checks: its worker must still be a member (it may have been dropped
  // since), its lease is renewed, and an adaptive batch's relay is kept. An error: nothing may be
  // applied.
  absl::Status AdmitPush(const WirePush& request) ABSL_LOCKS_EXCLUDED(mu_);
  void ApplyGradient(int worker, int64_t step, int tensor, int part, const ByteChunks* data,
                     std::shared_ptr<const void> keepalive,
                     std::function<void(absl::Status)> on_added, GradientOutcome* outcome);
  void RecordStaleness(int64_t tau);
  // Adaptive batch: checks a push's batch against the plan (FAILED_PRECONDITION naming both).
  absl::Status CheckPushBatch(const WirePush& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adaptive batch: keeps the noise scale that a member relays with its push of a decision step,
  // and decides each earlier decision step the first time a later step's push arrives.
  void TakeRelay(const WirePush& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DecideBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeadlineLoop();
  // Points every tensor's checkpoint captures at OnCaptured.
  void SetUpCheckpointing() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnCaptured(int tensor, int64_t version, TensorSnapshot weights,
                  TensorOptimizerState optimizer_state);

  // Constant after construction.
  const ShardOptions options_;
  const ConsistencyPolicy policy_;
  const std::unique_ptr<Optimizer> optimizer_;
  const absl::Duration max_wait_;
  const int64_t part_elements_;       // bsp's part size (PushPartElements); 0: whole tensors
  std::unique_ptr<ThreadPool> pool_;  // Null with update_threads == 1.

  mutable absl::Mutex mu_;
  bool initialised_ ABSL_GUARDED_BY(mu_) = false;
  // The registrant last asked for the initial values (-1: none yet), and when.
  int values_asked_of_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time values_asked_at_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Set once, at the first registration, and constant after (read without the lock by pushes that
  // passed the checks made under it).
  std::vector<std::unique_ptr<TensorAggregator>> tensors_;
  absl::flat_hash_map<std::string, int> index_;  // name -> tensors_ slot
  Membership members_ ABSL_GUARDED_BY(mu_);
  // members_'s member set, published for the tensors (std::atomic_load / atomic_store).
  std::shared_ptr<const TensorAggregator::Members> member_view_;
  std::list<PullStatePtr> parked_ ABSL_GUARDED_BY(mu_);  // Pulls not yet answered.
  absl::CondVar parked_changed_;
  absl::Time next_held_check_ ABSL_GUARDED_BY(mu_);  // bsp: when held gradients are next checked
  std::optional<LearningRateScheduler> schedule_ ABSL_GUARDED_BY(mu_);
  std::atomic<const LearningRateScheduler*> schedule_ptr_{nullptr};  // &*schedule_ once built
  // Adaptive batch (ClusterSpec.adaptive_batch; common/batch_plan.h), once training starts: the
  // plan, published for the tensors' learning rates and the push responses (std::atomic_load).
  // Every shard decides the same changes at the same steps from the same relayed figures: under
  // bsp every worker pushes a decision step d to every shard before any pushes d + 1, and a
  // decision takes the relay of the lowest-numbered worker.
  std::optional<BatchPlan> plan_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const BatchPlan> plan_view_;
  int64_t relay_step_ ABSL_GUARDED_BY(mu_) = -1;  // The decision step being collected.
  int64_t decided_through_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, NoiseScaleRelay> relays_ ABSL_GUARDED_BY(mu_);  // By worker, for relay_step_.
  // When some worker was last live (JobFinished); the shard's creation at first.
  absl::Time last_live_ ABSL_GUARDED_BY(mu_) = absl::Now();
  // Counters for GetStats.
  std::atomic<int64_t> pushes_{0};
  std::atomic<int64_t> rejected_pushes_{0};
  std::atomic<int64_t> duplicate_gradients_{0};
  std::atomic<int64_t> dropped_workers_{0};
  std::atomic<int64_t> dropped_gradients_{0};
  std::atomic<int64_t> staleness_histogram_[8] = {};
  std::atomic<double> last_learning_rate_{0};
  // bsp, backup: the gradient noise scale's terms, fed by every synchronous update (through
  // Context(), which is const; the monitor is thread-safe on its own).
  mutable NoiseScaleMonitor noise_;
  // Checkpoint captures not yet complete, by step. Locked after a tensor's lock, never before.
  struct PendingCheckpoint {
    std::vector<TensorSnapshot> weights;
    std::vector<TensorOptimizerState> optimizer_states;
    size_t filled = 0;
  };
  absl::Mutex checkpoint_mu_;
  std::map<int64_t, PendingCheckpoint> pending_checkpoints_ ABSL_GUARDED_BY(checkpoint_mu_);
  std::atomic<uint64_t> recovery_id_{0};
  int64_t restored_versions_ = 0;  // Their sum at the restore (set before training).
  std::atomic<int64_t> last_checkpoint_step_{-1};

  std::unique_ptr<UpdatePool> update_pool_;
  std::thread deadline_thread_;  // Last members: started when everything else is ready.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PARAMETER_SHARD_H_
