// ParameterShard: the tensors of one parameter-server shard, and the rule that updates them.
//
// Pure logic with no network inside: server/parameter_service.cc adapts it to gRPC, and
// server/data_plane.h to plain TCP; tests drive it directly. Thread-safe; every public method may
// be called from any thread. A facade that validates, locks and routes to its parts, each in a
// header of its own with its own test:
//   server/membership.h          who is a member, leases, clocks;
//   server/consistency_policy.h  what the consistency mode decides (one class per mode; the modes
//                                are defined in docs/consistency.md);
//   server/shard_tensors.h       the tensors, their names, the member set they read;
//   server/tensor_aggregator.h   one tensor: its lock, the gradients of its step, the optimizer
//                                step, copy-on-write weights that pulls share;
//   server/push_pipeline.h       a push: validate, admit, apply (on server/update_pool.h);
//   server/pull_router.h         pulls: when they may start, parked until answered
//                                (server/parked_pulls.h), their deadlines;
//   server/registration.h        checks of a registration, the initial values' election;
//   server/batch_coordinator.h   an adaptive batch's decisions;
//   server/checkpoint_capture.h  checkpoints taken, and restored;
//   server/shard_stats.h         counters and GetStats.
// Every deadline, lease and timeout reads ShardOptions.clock (common/clock.h).
//
// Each tensor has a version, the number of updates applied to it. A worker's clock is its step.
// The update that takes a tensor from version t to t + 1 uses the schedule's rate for update t
// (common/lr_schedule.h, as the policy counts updates). The schedule needs the global batch (the
// sum of the registered workers' batches) and the job's length, so it is built, and logged, when
// the last worker registers. Training starts then: pulls wait for it, and pushes before it are
// refused. Every wait has a deadline; a pull that times out fails with DEADLINE_EXCEEDED naming
// the workers it was waiting for.
#ifndef RUBATO_SERVER_PARAMETER_SHARD_H_
#define RUBATO_SERVER_PARAMETER_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
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
#include "common/clock.h"
#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "common/tensor_wire.h"
#include "common/thread_pool.h"
#include "proto/checkpoint.pb.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"
#include "server/batch_coordinator.h"
#include "server/checkpoint_capture.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/noise_scale.h"
#include "server/parked_pulls.h"
#include "server/pull_router.h"
#include "server/push_pipeline.h"
#include "server/registration.h"
#include "server/shard_options.h"
#include "server/shard_stats.h"
#include "server/shard_tensors.h"
#include "server/tensor_aggregator.h"
#include "server/update_pool.h"
#include "server/work_queue.h"

namespace rubato {

class ParameterShard : private PushStages {
 public:
  // Called exactly once per Pull, possibly on another thread, never with the shard's lock held.
  using PullDone = std::function<void(absl::Status, PullResponse)>;
  using SharedPullDone = PullState::Done;
  using PushDone = PushPipeline::Done;

  // InvalidArgument for a bad spec.
  static absl::StatusOr<std::unique_ptr<ParameterShard>> Create(const ShardOptions& options);

  int num_workers() const { return options_.cluster.num_workers(); }

  // Fails every waiting pull with UNAVAILABLE, finishes the pushes being applied, and stops the
  // deadline thread.
  ~ParameterShard() override;

  ParameterShard(const ParameterShard&) = delete;
  ParameterShard& operator=(const ParameterShard&) = delete;

  // Adds the worker to the job. The request's num_workers and consistency must be the shard's
  // (FAILED_PRECONDITION otherwise). The first registrant's model and initial values are adopted; a
  // later registrant's model must match exactly (FAILED_PRECONDITION naming the first difference).
  // A registration without initial values to a shard that has no weights yet registers nothing:
  // one registrant is answered needs_initial_values (and sends them), the others initialising
  // (and come back); see InitialValuesElection.
  // Registering again (a restarted worker) is allowed and changes nothing but its bookkeeping.
  absl::StatusOr<RegisterResponse> Register(const RegisterRequest& request);

  // Validates the whole request first: on any error nothing is applied (INVALID_ARGUMENT for an
  // unknown tensor, a repeated tensor, a wrong byte size, a NaN or Inf, a negative step;
  // FAILED_PRECONDITION for an unregistered worker, a push before all workers registered, or a step
  // from the future). A gradient whose (worker, step, tensor) was already received is acknowledged
  // as a duplicate and ignored. The gradients are then applied (server/push_pipeline.h), and
  // `done` is called (on a pool thread, or at once for an error) when all are. With a keepalive, a
  // bsp gradient that arrives before a lower-numbered member's is held and counts as applied only
  // once it is added (or fails with DEADLINE_EXCEEDED after wait_timeout_ms, naming whom it waits
  // for), so the shard holds at most the calls each worker has in flight.
  //
  // The gradients' bytes are views (common/tensor_wire.h) that `keepalive` keeps valid for as long
  // as the shard holds it; with a null keepalive they must stay valid until `done` is called, and
  // are copied if they must be held longer (an early arrival under bsp).
  void Push(WirePush request, std::shared_ptr<const void> keepalive, PushDone done);
  // The same, waiting for the answer.
  absl::StatusOr<PushResponse> Push(const PushRequest& request);

  // Answers with the requested tensors once each has the version the policy needs for
  // request.step, or fails at `deadline` (capped by the cluster's wait_timeout_ms) with
  // DEADLINE_EXCEEDED naming whom it waited for. Bad requests fail at once. The answer shares the
  // weights: nothing is copied.
  void Pull(const PullRequest& request, absl::Time deadline, SharedPullDone done);
  // The same, with the values copied into a PullResponse.
  void Pull(const PullRequest& request, absl::Time deadline, PullDone done);

  absl::StatusOr<HeartbeatResponse> Heartbeat(const HeartbeatRequest& request);

  // A worker (registered, or dropped) has finished training: its lease no longer runs. Repeating
  // it is harmless; registering again makes the worker a live member again.
  absl::StatusOr<FinishResponse> Finish(const FinishRequest& request);

  // Work reassignment (ClusterSpec.reassign): the registered worker's next unit of data, from
  // shard 0's WorkQueue. FAILED_PRECONDITION on another shard, in a job without reassignment, or
  // for a worker that is not a member.
  absl::StatusOr<TakeWorkResponse> TakeWork(const TakeWorkRequest& request);

  // Whether the job is over for this shard, polled by the server's main loop:
  //   true    every worker has finished; or none is live (registered, not finished, heard from
  //           within its lease) and at least one finished, and no worker has been live for one
  //           lease since (the dropped ones had that long to come back);
  //   false   training goes on, or may still;
  //   error   DEADLINE_EXCEEDED when no worker has been live for `idle_timeout` and none has
  //           finished (workers that never came, or all died), naming them.
  absl::StatusOr<bool> JobFinished(absl::Duration idle_timeout);

  GetStatsResponse Stats() const;

  // Without a deadline thread (ShardOptions.deadline_thread false): ends what is due by now
  // (expired leases, held gradients and pulls past their deadlines, with what that completes), and
  // returns when to call again. Nothing new that arrives before then is due earlier than the
  // cluster's wait timeout and lease from its arrival.
  absl::Time ExpireDeadlines();

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

  // Where the policy recovers by roll-back (bsp, backup), rolls the shard back to its checkpoint
  // of request.step, as recovery request.recovery_id (proto/parameter_server.proto,
  // RollbackRequest): restarting false when it already belongs to that recovery; otherwise
  // options.on_rollback arranges it and restarting is true, or, when the shard has no checkpoint
  // of that step, lacks_checkpoint names the newest before it. FAILED_PRECONDITION under async and
  // ssp (a restored shard there needs no roll-back), without on_rollback, or for a step ahead of
  // this shard's; INVALID_ARGUMENT for a bad worker, step or id.
  absl::StatusOr<RollbackResponse> Rollback(const RollbackRequest& request);

  // Fails every waiting pull, held gradient and later call with `why` (UNAVAILABLE "parameter
  // server shard N is shutting down" if not given; workers do not retry that). A shard that stops
  // to be started again (a roll-back) gives an UNAVAILABLE that does not say "shutting down", so
  // that workers retry their calls until its restarted self answers. The first call decides.
  void Shutdown(absl::Status why = absl::OkStatus());

 private:
  ParameterShard(const ShardOptions& options, std::unique_ptr<ConsistencyPolicy> policy,
                 std::unique_ptr<Optimizer> optimizer);

  // PushStages.
  absl::Status CheckState(const WirePush& request) override ABSL_LOCKS_EXCLUDED(mu_);
  TensorAggregator::Context Context() const override;
  absl::Status Admit(const WirePush& request) override ABSL_LOCKS_EXCLUDED(mu_);
  void Apply(int worker, int64_t step, const GradientTarget& target, const ByteChunks* data,
             std::shared_ptr<const void> keepalive, std::function<void(absl::Status)> on_added,
             GradientOutcome* outcome) override;
  void Annotate(int64_t step, PushResponse* response) const override;
  void Count(bool accepted) override { counters_.CountPush(accepted); }
  void Post(std::function<void()> task) override {
    if (options_.post) {
      options_.post(std::move(task));
    } else {
      update_pool_->Post(std::move(task));
    }
  }

  // The tensors are in place (adopted or restored): set up what depends on them.
  void TensorsReady() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's fields of a RegisterResponse.
  void DescribeJob(RegisterResponse* response) const;
  // The tensors a pull names (all of them for none), after checking names and the worker.
  absl::StatusOr<std::vector<int>> CheckPull(const PullRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers a pull whose every tensor is filled. No lock held.
  void Complete(const PullStatePtr& pull) ABSL_LOCKS_EXCLUDED(mu_);
  // Builds the schedule once every worker has registered. An error here (e.g. a warmup longer than
  // the job) refuses the last registration.
  absl::Status StartTrainingIfComplete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the current members to the tensors, then completes the steps they no longer wait
  // for.
  void MembersChanged(std::vector<PullStatePtr>* ready, Released* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the pulls and answers the held gradients in `released`. No lock held.
  void Finish(Released* released);
  // The deadline thread's work under the lock: leases, held gradients, expired pulls; returns when
  // to look again.
  absl::Time ExpireDue(std::vector<PullStatePtr>* ready, Released* released,
                       std::vector<std::pair<PullStatePtr, absl::Status>>* expired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether ExpireDue found anything; answers what it found (no lock held).
  static bool AnyDue(const std::vector<PullStatePtr>& ready, const Released& released,
                     const std::vector<std::pair<PullStatePtr, absl::Status>>& expired);
  void EndDue(const std::vector<PullStatePtr>& ready, Released* released,
              std::vector<std::pair<PullStatePtr, absl::Status>>* expired) ABSL_LOCKS_EXCLUDED(mu_);
  void DeadlineLoop();

  // Constant after construction.
  const ShardOptions options_;
  Clock* const clock_;
  const std::unique_ptr<ConsistencyPolicy> policy_;
  const std::unique_ptr<Optimizer> optimizer_;
  const absl::Duration max_wait_;
  const int64_t part_elements_;       // The policy's part size; 0: whole tensors
  std::unique_ptr<ThreadPool> pool_;  // Null with update_threads == 1.

  mutable absl::Mutex mu_;
  bool initialised_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status shutdown_status_ ABSL_GUARDED_BY(mu_);  // What calls get once shut down.
  InitialValuesElection election_ ABSL_GUARDED_BY(mu_);
  Membership members_ ABSL_GUARDED_BY(mu_);
  PullRouter pulls_ ABSL_GUARDED_BY(mu_);
  absl::CondVar parked_changed_;
  std::optional<LearningRateScheduler> schedule_ ABSL_GUARDED_BY(mu_);
  std::atomic<const LearningRateScheduler*> schedule_ptr_{nullptr};  // &*schedule_ once built
  // bsp, backup: the gradient noise scale's terms, fed by every synchronous update (through
  // Context(), which is const; the monitor is thread-safe on its own).
  mutable NoiseScaleMonitor noise_;
  // Under mu_, but for its view(), which is read without the lock (not annotated for that).
  BatchCoordinator batch_;
  // When some worker was last live (JobFinished); the shard's creation at first.
  absl::Time last_live_ ABSL_GUARDED_BY(mu_);
  ShardCounters counters_;
  std::unique_ptr<WorkQueue> work_;  // Shard 0 of a job with reassignment; thread-safe.
  std::unique_ptr<CheckpointAssembler> checkpoints_;  // Set with the tensors, if checkpointing.
  std::atomic<uint64_t> recovery_id_{0};
  int64_t restored_versions_ = 0;  // Their sum at the restore (set before training).
  // Set once, at the first registration or the restore, under mu_, and constant after (used
  // without the lock by pushes and pulls that passed the checks made under it), but for the
  // member view it publishes and the held gradients' check, under mu_.
  ShardTensors tensors_;
  PushPipeline pushes_;

  std::unique_ptr<UpdatePool> update_pool_;  // Unless options_.post is set.
  std::thread deadline_thread_;  // Last members: started when everything else is ready (if at all).
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PARAMETER_SHARD_H_
