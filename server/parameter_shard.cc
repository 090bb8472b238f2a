#include "server/parameter_shard.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/cluster_spec.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "server/adaptive_policy.h"
#include "server/request_checks.h"

namespace rubato {
namespace {

// How long the registrant asked for a shard's initial values has to send them before another is
// asked.
constexpr absl::Duration kInitialValuesGrant = absl::Seconds(10);

absl::Status ShuttingDown(int shard_id) {
  return absl::UnavailableError(
      absl::StrCat("parameter server shard ", shard_id, " is shutting down"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterShard>> ParameterShard::Create(
    const ShardOptions& options) {
  RETURN_IF_ERROR(ValidateShardOptions(options));
  ASSIGN_OR_RETURN(std::unique_ptr<ConsistencyPolicy> policy,
                   ConsistencyPolicy::Create(options.cluster.consistency()));
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   Optimizer::Create(options.cluster.optimizer()));
  return std::unique_ptr<ParameterShard>(
      new ParameterShard(options, std::move(policy), std::move(optimizer)));
}

ParameterShard::ParameterShard(const ShardOptions& options,
                               std::unique_ptr<ConsistencyPolicy> policy,
                               std::unique_ptr<Optimizer> optimizer)
    : options_(options),
      clock_(options.clock),
      policy_(std::move(policy)),
      optimizer_(std::move(optimizer)),
      max_wait_(absl::Milliseconds(options.cluster.wait_timeout_ms())),
      part_elements_(PartElementsFor(options, *policy_)),
      election_(kInitialValuesGrant),
      members_(options.shard_id, options.cluster.num_workers(), options.cluster.lease_ms()),
      pulls_(options.shard_id, max_wait_, policy_.get(), &tensors_, &members_),
      noise_(options.shard_id, options.noise_ema_decay),
      batch_(options.shard_id, options.cluster.adaptive_batch(), &noise_),
      last_live_(clock_->Now()),
      tensors_(options.cluster.num_workers()),
      pushes_(options.shard_id, &tensors_.all(), &tensors_.index(), this) {
  if (options.update_threads > 1) pool_ = std::make_unique<ThreadPool>(options.update_threads);
  if (!options.post) update_pool_ = std::make_unique<UpdatePool>(options.apply_threads);
  if (options.shard_id == 0 && options.cluster.reassign().unit_batches() > 0) {
    work_ = std::make_unique<WorkQueue>(options.cluster.num_workers());
  }
  if (options.deadline_thread) deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

ParameterShard::~ParameterShard() {
  Shutdown();
  if (deadline_thread_.joinable()) deadline_thread_.join();
  update_pool_.reset();  // Applies what was queued; pulls it completes fail as shut down.
  Shutdown();
}

void ParameterShard::Shutdown(absl::Status why) {
  std::vector<PullStatePtr> failed;
  Released released;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_) shutdown_status_ = why.ok() ? ShuttingDown(options_.shard_id) : why;
    shutdown_ = true;
    status = shutdown_status_;
    tensors_.ReleaseHeld(status, &released);
    pulls_.EndAll(&failed);
    parked_changed_.SignalAll();
  }
  for (const PullStatePtr& p : failed) p->Answer(status, {});
  Finish(&released);
}

TensorAggregator::Context ParameterShard::Context() const {
  TensorAggregator::Context ctx;
  ctx.policy = policy_.get();
  ctx.optimizer = optimizer_.get();
  ctx.pool = pool_.get();
  ctx.members = tensors_.member_view();
  ctx.schedule = schedule_ptr_.load(std::memory_order_acquire);
  ctx.noise = &noise_;
  ctx.plan = batch_.view();
  ctx.clock = clock_;
  return ctx;
}

void ParameterShard::MembersChanged(std::vector<PullStatePtr>* ready, Released* released) {
  tensors_.PublishMembers(members_);
  if (schedule_ptr_.load() == nullptr) return;
  if (std::optional<double> lr = tensors_.ApplyCompleted(Context(), released); lr.has_value()) {
    counters_.SetLearningRate(*lr);
  }
  pulls_.ArmParked(ready);
}

// ---- Registration ----

void ParameterShard::DescribeJob(RegisterResponse* response) const {
  response->set_shard_id(options_.shard_id);
  response->set_num_shards(options_.num_shards);
  *response->mutable_consistency() = options_.cluster.consistency();
  response->set_num_workers(options_.cluster.num_workers());
  response->set_lease_ms(options_.cluster.lease_ms());
}

absl::StatusOr<RegisterResponse> ParameterShard::Register(const RegisterRequest& request) {
  absl::flat_hash_map<std::string, int> model_index;
  RETURN_IF_ERROR(
      ValidateRegisterRequest(request, options_.cluster, options_.shard_id, &model_index));
  const int id = request.worker_id();
  std::vector<PullStatePtr> ready;
  Released released;
  RegisterResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return shutdown_status_;
    RETURN_IF_ERROR(members_.CheckSameJob(id, request.steps_per_epoch(), request.total_steps()));
    if (!initialised_ && request.initial_values().empty()) {
      // One registrant is asked for the values; the others come back once they are in.
      DescribeJob(&response);
      if (election_.Ask(id, clock_->Now())) {
        response.set_needs_initial_values(true);
      } else {
        response.set_initialising(true);
      }
      return response;
    }
    if (!initialised_) {
      tensors_.Adopt(request, *optimizer_, part_elements_);
      TensorsReady();
    } else {
      RETURN_IF_ERROR(CheckModelMatches(tensors_.all(), tensors_.index(), request, model_index,
                                        options_.shard_id));
    }
    RETURN_IF_ERROR(batch_.CheckRegistration(id, request.batch_size(), members_));
    const Membership::Worker before =
        members_.Enroll(id, request.batch_size(), request.steps_per_epoch(),
                        request.total_steps(), request.resume_step(), clock_->Now());
    noise_.SetBatch(request.batch_size());
    if (absl::Status s = StartTrainingIfComplete(); !s.ok()) {
      members_.Unenroll(id, before);
      return s;
    }
    // Where clocks are kept, a worker goes on from its own step, so the steps before it count as
    // pushed. Otherwise a worker that rejoins a shard restored from an older checkpoint would
    // hold that checkpoint's clock, and under ssp its own next pull would wait on it for ever.
    if (policy_->KeepsClocks()) members_.SkipTo(id, request.resume_step());
    MembersChanged(&ready, &released);  // The last registrant may release the step-0 pulls.
    parked_changed_.Signal();           // Leases may start (or restart) running.
    DescribeJob(&response);
    response.set_min_version(tensors_.MinVersion());
    response.set_max_version(tensors_.MaxVersion());
    response.set_resume_step(policy_->ResumeStep(tensors_.MinVersion(), members_.Clock(id)));
    response.set_restored_step(members_.restored_step());
    response.set_recovery_id(recovery_id_.load());
    response.set_part_elements(part_elements_);
    if (const BatchPlan* plan = batch_.plan(); plan != nullptr) {
      for (const BatchChange& c : plan->changes()) *response.add_batch_plan() = c;
    }
  }
  for (const PullStatePtr& p : ready) Complete(p);
  Finish(&released);
  return response;
}

void ParameterShard::TensorsReady() {
  members_.SetTensorCount(static_cast<int>(tensors_.size()));
  noise_.SetTensors(static_cast<int>(tensors_.size()));
  initialised_ = true;
  if (options_.checkpoint_every_steps <= 0 || !options_.on_checkpoint) return;
  checkpoints_ = std::make_unique<CheckpointAssembler>(static_cast<int>(tensors_.size()),
                                                       options_.on_checkpoint);
  checkpoints_->Attach(tensors_.all(), options_.checkpoint_every_steps,
                       policy_->VersionsPerStep(options_.cluster.num_workers()));
}

absl::Status ParameterShard::StartTrainingIfComplete() {
  if (schedule_.has_value() || members_.members() < options_.cluster.num_workers()) {
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(schedule_, ScheduleFor(members_, options_.cluster, *policy_));
  schedule_ptr_.store(&*schedule_, std::memory_order_release);
  pulls_.StartTraining();
  // A fresh job's first checkpoint, of step 0 (nothing can be applied before this), so that a
  // shard killed before its first interval's checkpoint has one to restore, and the others one to
  // roll back to.
  if (checkpoints_ != nullptr && members_.restored_step() < 0) {
    for (const auto& t : tensors_.all()) t->CaptureNow();
  }
  batch_.Start(members_.num_workers(), members_.worker(0).batch_size);
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    adaptive->SetTotalSteps(members_.worker(0).total_steps);
  }
  RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": all " << options_.cluster.num_workers()
                   << " workers registered; optimizer " << optimizer_->config().type()
                   << "; learning-rate schedule:\n"
                   << schedule_->Describe();
  return absl::OkStatus();
}

// ---- Checkpoints and recovery ----

ShardCheckpoint ParameterShard::CheckpointProto(const CapturedCheckpoint& capture) const {
  const ShardJob job{options_.shard_id, options_.num_shards, &options_.cluster,
                     &optimizer_->config()};
  absl::MutexLock lock(&mu_);
  return MakeCheckpointProto(capture, job, tensors_.all(), members_, clock_->Now());
}

absl::Status ParameterShard::Restore(const ShardCheckpoint& c) {
  const ShardJob job{options_.shard_id, options_.num_shards, &options_.cluster,
                     &optimizer_->config()};
  ASSIGN_OR_RETURN(RestoredTensors restored,
                   RestoreTensors(c, job, *policy_, *optimizer_, part_elements_));
  absl::MutexLock lock(&mu_);
  if (initialised_) {
    return absl::FailedPreconditionError("the shard has weights already; restore before training");
  }
  const int64_t versions = restored.versions;
  tensors_.Adopt(std::move(restored));
  TensorsReady();
  if (policy_->KeepsClocks()) members_.RestoreClocks(c.step());
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    adaptive->RestartAt(c.step());
  }
  members_.SetRestored(c.step());
  restored_versions_ = versions;
  return absl::OkStatus();
}

absl::StatusOr<RollbackResponse> ParameterShard::Rollback(const RollbackRequest& request) {
  RETURN_IF_ERROR(ValidateRollbackRequest(request, options_.cluster, *policy_));
  RollbackResponse response;
  if (request.recovery_id() == recovery_id_.load()) return response;  // Done already.
  {
    absl::MutexLock lock(&mu_);
    if (initialised_ && request.step() > tensors_.MinVersion() && members_.restored_step() >= 0 &&
        members_.restored_step() < request.step()) {
      response.set_behind(true);
      return response;
    }
    if (initialised_ && request.step() > tensors_.MinVersion()) {
      return absl::FailedPreconditionError(
          absl::StrCat("Rollback to step ", request.step(), ": this shard stands at step ",
                       tensors_.MinVersion(), ", and a roll-back cannot go forward"));
    }
    // Restored from that very step and nothing applied since (a whole job resumed): restarting
    // would restore the same state, so the shard joins the recovery as it stands.
    bool untouched = initialised_ && members_.restored_step() == request.step();
    for (const auto& t : tensors_.all()) untouched = untouched && t->version() == request.step();
    if (untouched) {
      recovery_id_.store(request.recovery_id());
      return response;
    }
  }
  if (!options_.on_rollback) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard_id,
                     " keeps no checkpoints (--checkpoint_dir), so it cannot roll back to step ",
                     request.step(), "; restart every shard with --restore_step=", request.step()));
  }
  ASSIGN_OR_RETURN(const int64_t agreed,
                   options_.on_rollback(request.step(), request.recovery_id()));
  if (agreed != request.step()) {  // No checkpoint of that step here: the worker picks another.
    response.set_lacks_checkpoint(true);
    response.set_newest_checkpoint_before(std::min(agreed, request.step() - 1));
    return response;
  }
  response.set_restarting(true);
  return response;
}

// ---- Pushes (server/push_pipeline.h runs them; these are its stages) ----

absl::StatusOr<PushResponse> ParameterShard::Push(const PushRequest& request) {
  WirePush wire = WirePushOf(request);
  absl::Notification done;
  absl::StatusOr<PushResponse> result;
  Push(std::move(wire), nullptr, [&](absl::StatusOr<PushResponse> r) {
    result = std::move(r);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

void ParameterShard::Push(WirePush request, std::shared_ptr<const void> keepalive, PushDone done) {
  pushes_.Push(std::move(request), std::move(keepalive), std::move(done));
}

absl::Status ParameterShard::CheckState(const WirePush& request) {
  absl::MutexLock lock(&mu_);
  const int id = request.worker_id;
  RETURN_IF_ERROR(members_.CheckMemberAt(id, request.step));
  if (!schedule_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("training has not started: ", members_.members(), " of ",
                     options_.cluster.num_workers(), " workers registered"));
  }
  RETURN_IF_ERROR(CheckStep("step", request.step));
  RETURN_IF_ERROR(batch_.CheckPush(request, members_.worker(id).batch_size));
  if (static_cast<int64_t>(request.gradients.size()) > tensors_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a push of ", request.gradients.size(),
                                                   " gradients to a shard of ", tensors_.size(),
                                                   " tensors"));
  }
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    RETURN_IF_ERROR(adaptive->CheckRelay(request, options_.cluster.num_workers()));
  }
  return policy_->CheckPushStep(id, request.step, members_.worker(id).pulled_step,
                                options_.shard_id);
}

absl::Status ParameterShard::Admit(const WirePush& request) {
  absl::MutexLock lock(&mu_);
  // A worker dropped since the push arrived is refused; nothing was applied.
  RETURN_IF_ERROR(members_.CheckMember(request.worker_id));
  Membership::Worker& worker = members_.worker(request.worker_id);
  worker.last_seen = clock_->Now();
  worker.last_step = std::max(worker.last_step, request.step);
  batch_.TakeRelay(request, *schedule_);
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    adaptive->TakeRelay(request, options_.shard_id, members_.member());
  }
  return absl::OkStatus();
}

void ParameterShard::Apply(int worker, int64_t step, const GradientTarget& target,
                           const ByteChunks* data, std::shared_ptr<const void> keepalive,
                           std::function<void(absl::Status)> on_added, GradientOutcome* outcome) {
  Released released;
  TensorAggregator::Gradient gradient{data, std::move(keepalive), std::move(on_added)};
  gradient.part = target.part;
  gradient.max_abs = target.max_abs;
  const double lr = tensors_[target.tensor].Add(Context(), worker, step, std::move(gradient),
                                                 outcome, &released);
  if (outcome->kind == GradientOutcome::kDuplicate) {
    counters_.CountDuplicate();
    return;
  }
  if (outcome->kind == GradientOutcome::kDropped) counters_.CountDroppedGradient();
  if (outcome->kind == GradientOutcome::kAccepted && outcome->first_part &&
      outcome->refused.ok()) {
    counters_.RecordStaleness(outcome->staleness);
  }
  if (outcome->applied) counters_.SetLearningRate(lr);
  std::vector<PullStatePtr> ready;
  if (policy_->KeepsClocks()) {
    // Policies without clocks skip the shard's lock here.
    absl::MutexLock lock(&mu_);
    if (members_.Pushed(worker, target.tensor, step) && policy_->ClockReleasesPulls()) {
      pulls_.ArmParked(&ready);
    }
  }
  for (const PullStatePtr& p : ready) Complete(p);
  Finish(&released);
}

void ParameterShard::Annotate(int64_t step, PushResponse* response) const {
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    ConsistencyChange newest;
    if (adaptive->Newest(&newest)) *response->mutable_consistency_change() = std::move(newest);
  }
  if (std::shared_ptr<const BatchPlan> plan = std::atomic_load(batch_.view());
      plan != nullptr && !plan->changes().empty()) {
    *response->mutable_batch_change() = plan->changes().back();
  }
  // The step before this one: complete on every shard once this worker could compute this one,
  // so every shard answers the same step's figures.
  if (policy_->MeasuresNoiseScale()) {
    if (std::optional<NoiseScaleStats> noise = noise_.StatsAt(step - 1); noise.has_value()) {
      *response->mutable_noise_scale() = std::move(*noise);
    }
  }
}

void ParameterShard::Finish(Released* released) {
  for (const absl::Status& refused : released->refused) {
    counters_.CountRefusedUpdate();
    RUBATO_LOG(WARNING) << "shard " << options_.shard_id << ": " << refused.message();
  }
  for (auto& p : released->pulls) Complete(std::static_pointer_cast<PullState>(p));
  for (auto& [ack, status] : released->acks) ack(std::move(status));
  *released = Released();
}

// ---- Pulls ----

absl::StatusOr<std::vector<int>> ParameterShard::CheckPull(const PullRequest& request) const {
  if (shutdown_) return shutdown_status_;
  RETURN_IF_ERROR(members_.CheckMemberAt(request.worker_id(), request.step()));
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  return ResolvePull(request, tensors_.index(), tensors_.size(), options_.shard_id);
}

void ParameterShard::Pull(const PullRequest& request, absl::Time deadline, PullDone done) {
  Pull(request, deadline,
       SharedPullDone(
           [done = std::move(done)](absl::Status status, std::vector<PulledTensor> tensors) {
             done(std::move(status), CopyPulled(tensors));
           }));
}

void ParameterShard::Pull(const PullRequest& request, absl::Time deadline, SharedPullDone done) {
  std::vector<std::function<void()>> superseded;
  PullStatePtr complete;
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::vector<int>> which = CheckPull(request);
    if (!which.ok()) {
      refused = which.status();
    } else {
      const absl::Time now = clock_->Now();
      members_.worker(request.worker_id()).last_seen = now;
      bool sooner = false;
      complete = pulls_.Take(request.worker_id(), request.step(), std::move(*which), deadline, now,
                             std::move(done), &superseded, &sooner);
      // A deadline earlier than the deadline thread waits for: it must look again (it scans every
      // parked pull, so not at every pull).
      if (sooner) parked_changed_.Signal();
    }
  }
  if (!refused.ok()) {
    done(refused, {});
    return;
  }
  for (auto& f : superseded) f();
  if (complete != nullptr) Complete(complete);
}

void ParameterShard::Complete(const PullStatePtr& pull) {
  {
    absl::MutexLock lock(&mu_);
    Membership::Worker& w = members_.worker(pull->worker());
    w.pulled_step = std::max(w.pulled_step, pull->step());
  }
  pull->Answer(absl::OkStatus(), tensors_.Answer(*pull));
}

// ---- Deadlines, leases, liveness ----

absl::Time ParameterShard::ExpireDue(std::vector<PullStatePtr>* ready, Released* released,
                                     std::vector<std::pair<PullStatePtr, absl::Status>>* expired) {
  absl::Time next = absl::InfiniteFuture();
  // Leases run only once training has started: before that, pulls wait for registration with
  // their own deadline.
  if (schedule_.has_value()) {
    std::vector<int> dropped;
    next = members_.ExpireLeases(clock_->Now(), &dropped);
    if (!dropped.empty()) {
      counters_.CountDroppedWorkers(static_cast<int64_t>(dropped.size()));
      MembersChanged(ready, released);
    }
  }
  const absl::Time now = clock_->Now();
  // Gradients held for their turn wait at most max_wait_ for their acknowledgement, like a pull.
  if (policy_->SumsInWorkerOrder() && initialised_) {
    next = std::min(next, tensors_.ExpireHeld(now, max_wait_, released));
  }
  return std::min(next, pulls_.Expire(now, expired));
}

bool ParameterShard::AnyDue(const std::vector<PullStatePtr>& ready, const Released& released,
                            const std::vector<std::pair<PullStatePtr, absl::Status>>& expired) {
  return !expired.empty() || !ready.empty() || !released.pulls.empty() || !released.acks.empty();
}

void ParameterShard::EndDue(const std::vector<PullStatePtr>& ready, Released* released,
                            std::vector<std::pair<PullStatePtr, absl::Status>>* expired) {
  for (const PullStatePtr& p : ready) Complete(p);
  for (auto& [p, status] : *expired) p->Answer(std::move(status), {});
  Finish(released);
}

void ParameterShard::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    // Leases first, then pull deadlines; sleep until the earliest of what is left, or a change.
    std::vector<PullStatePtr> ready;
    Released released;
    std::vector<std::pair<PullStatePtr, absl::Status>> expired;
    const absl::Time next = ExpireDue(&ready, &released, &expired);
    if (AnyDue(ready, released, expired)) {
      // Unlocked only then: a change that comes while the lock is held is not missed.
      mu_.Unlock();
      EndDue(ready, &released, &expired);
      mu_.Lock();
      continue;
    }
    clock_->WaitWithDeadline(&mu_, &parked_changed_, next);
  }
}

absl::Time ParameterShard::ExpireDeadlines() {
  for (;;) {
    std::vector<PullStatePtr> ready;
    Released released;
    std::vector<std::pair<PullStatePtr, absl::Status>> expired;
    absl::Time next;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return absl::InfiniteFuture();
      next = ExpireDue(&ready, &released, &expired);
    }
    if (!AnyDue(ready, released, expired)) return next;
    EndDue(ready, &released, &expired);
  }
}

absl::StatusOr<HeartbeatResponse> ParameterShard::Heartbeat(const HeartbeatRequest& request) {
  HeartbeatResponse response;
  std::vector<PullStatePtr> ended;
  {
    absl::MutexLock lock(&mu_);
    const int id = request.worker_id();
    RETURN_IF_ERROR(members_.CheckMemberAt(id, request.step()));
    RETURN_IF_ERROR(CheckStep("step", request.step()));
    members_.Heard(id, request.step(), clock_->Now());
    if (request.end_pulls()) pulls_.EndWorker(id, &ended);
    response.set_min_version(tensors_.MinVersion());
  }
  if (!ended.empty()) {
    RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": ended worker " << request.worker_id()
                     << "'s " << ended.size()
                     << " waiting pull(s) at its request (it is to register again)";
  }
  for (const PullStatePtr& p : ended) {
    p->Answer(absl::AbortedError(absl::StrCat(
                  "pull for step ", p->step(), " by worker ", p->worker(), " ended on shard ",
                  options_.shard_id,
                  " at the worker's request: another shard has dropped it or restarted; register "
                  "again to rejoin")),
              {});
  }
  return response;
}

absl::StatusOr<FinishResponse> ParameterShard::Finish(const FinishRequest& request) {
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const int finished,
                   members_.Finish(request.worker_id(), request.step(), clock_->Now()));
  FinishResponse response;
  response.set_finished_workers(finished);
  return response;
}

absl::StatusOr<TakeWorkResponse> ParameterShard::TakeWork(const TakeWorkRequest& request) {
  if (work_ == nullptr) {
    return absl::FailedPreconditionError(
        options_.cluster.reassign().unit_batches() > 0
            ? absl::StrCat("TakeWork: shard ", options_.shard_id,
                           " hands out no work; shard 0 does")
            : std::string("TakeWork: this job does not reassign work (--reassign is off)"));
  }
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(members_.CheckMember(request.worker_id()));
  }
  ASSIGN_OR_RETURN(TakeWorkResponse response, work_->Take(request));
  if (const WorkUnit& u = response.unit(); !response.done() && u.owner() != request.worker_id()) {
    RUBATO_LOG(INFO) << "reassign: worker " << request.worker_id() << " takes unit " << u.index()
                     << " of worker " << u.owner() << "'s share of epoch " << u.epoch() << " ("
                     << u.owner_had() << " left there)";
  }
  return response;
}

absl::StatusOr<bool> ParameterShard::JobFinished(absl::Duration idle_timeout) {
  absl::MutexLock lock(&mu_);
  return members_.JobOver(clock_->Now(), idle_timeout, &last_live_);
}

GetStatsResponse ParameterShard::Stats() const {
  absl::MutexLock lock(&mu_);
  GetStatsResponse s;
  s.set_shard_id(options_.shard_id);
  *s.mutable_consistency() = options_.cluster.consistency();
  s.set_num_workers(options_.cluster.num_workers());
  FillTensorStats(tensors_.all(), restored_versions_, &s);
  counters_.Fill(&s);
  FillWorkerStats(members_, clock_->Now(), &s);
  s.set_last_checkpoint_step(checkpoints_ != nullptr ? checkpoints_->last_step() : -1);
  if (schedule_.has_value()) s.set_lr_schedule(schedule_->Describe());
  if (const BatchPlan* plan = batch_.plan(); plan != nullptr) {
    for (const BatchChange& c : plan->changes()) *s.add_batch_plan() = c;
  }
  if (policy_->MeasuresNoiseScale()) *s.mutable_noise_scale() = noise_.Stats();
  if (AdaptivePolicy* adaptive = policy_->adaptive(); adaptive != nullptr) {
    for (ConsistencyChange& c : adaptive->Plan()) *s.add_consistency_plan() = std::move(c);
  }
  s.set_pending_pulls(pulls_.Pending());
  if (work_ != nullptr) {
    s.set_work_units(work_->handed_out());
    s.set_reassigned_units(work_->reassigned());
  }
  return s;
}

}  // namespace rubato
