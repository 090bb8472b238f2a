#include "server/parameter_shard.h"

#include <algorithm>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/cluster_spec.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"

namespace rubato {
namespace {

// Steps, versions and resume points are in [0, kMaxStep): clock arithmetic on them cannot overflow.
absl::Status CheckStep(absl::string_view field, int64_t step) {
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [0, ", kMaxStep, "), got ", step));
  }
  return absl::OkStatus();
}

// How long the registrant asked for a shard's initial values has to send them before another is
// asked.
constexpr absl::Duration kInitialValuesGrant = absl::Seconds(10);

absl::Status CheckTensorName(absl::string_view name) {
  if (name.empty() || name.size() > static_cast<size_t>(kMaxTensorNameBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a tensor name must be 1 to ", kMaxTensorNameBytes, " bytes, got ", name.size()));
  }
  return absl::OkStatus();
}

// A name as it may be echoed in an error: printable ASCII as is, anything else escaped.
std::string Printable(absl::string_view name) { return absl::CHexEscape(name); }

}  // namespace

// A fixed set of threads that run tasks in order of submission.
class ParameterShard::UpdatePool {
 public:
  explicit UpdatePool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  // Runs what is queued, then stops.
  ~UpdatePool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }
  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](UpdatePool* p)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stop_ || !p->tasks_.empty(); },
            this));
        if (tasks_.empty()) return;  // stop_
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// A pull in progress: which tensors, and the snapshots they have given it so far.
class ParameterShard::PullState final : public PullWaiter {
 public:
  PullState(int worker, int64_t step, std::vector<int> tensors, absl::Time deadline,
            SharedPullDone done)
      : worker_(worker),
        step_(step),
        tensors_(std::move(tensors)),
        deadline_(deadline),
        done_(std::move(done)),
        got_(tensors_.size()),
        missing_(static_cast<int>(tensors_.size())) {}

  bool Fill(int slot, TensorSnapshot snapshot) override {
    absl::MutexLock lock(&mu_);
    if (over_) return false;
    got_[slot] = std::move(snapshot);
    if (--missing_ > 0) return false;
    over_ = true;
    return true;
  }
  bool Over() const override {
    absl::MutexLock lock(&mu_);
    return over_;
  }
  // Ends the pull without an answer; false if it was already over.
  bool End() {
    absl::MutexLock lock(&mu_);
    if (over_) return false;
    over_ = true;
    return true;
  }
  bool Overlaps(const PullState& other) const {
    for (int a : tensors_) {
      if (std::find(other.tensors_.begin(), other.tensors_.end(), a) != other.tensors_.end()) {
        return true;
      }
    }
    return false;
  }

  const int worker_;
  const int64_t step_;
  const std::vector<int> tensors_;
  const absl::Time deadline_;
  SharedPullDone done_;
  bool armed_ = false;  // Under the shard's lock: the tensors have been asked.

  mutable absl::Mutex mu_;
  std::vector<TensorSnapshot> got_ ABSL_GUARDED_BY(mu_);
  int missing_ ABSL_GUARDED_BY(mu_);
  bool over_ ABSL_GUARDED_BY(mu_) = false;

  std::vector<TensorSnapshot> TakeSnapshots() {
    absl::MutexLock lock(&mu_);
    return std::move(got_);
  }
};

int64_t PushPartElements(const ConsistencyConfig& consistency, int num_workers,
                         int64_t push_budget_bytes) {
  if (consistency.mode() != BSP || num_workers < 1) return 0;
  constexpr int64_t kMin = (int64_t{1} << 20) / sizeof(float);
  constexpr int64_t kMax = (int64_t{8} << 20) / sizeof(float);
  const int64_t share = std::max<int64_t>(push_budget_bytes, 0) / (2 * int64_t{num_workers});
  return std::clamp<int64_t>(share / sizeof(float), kMin, kMax) / 1024 * 1024;
}

absl::StatusOr<std::unique_ptr<ParameterShard>> ParameterShard::Create(
    const ShardOptions& options) {
  if (options.num_shards < 1 || options.shard_id < 0 || options.shard_id >= options.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_id ", options.shard_id, " is not in [0, num_shards=", options.num_shards, ")"));
  }
  RETURN_IF_ERROR(ValidateClusterSpec(options.cluster, /*need_servers=*/false));
  if (options.update_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("update_threads must be >= 1, got ", options.update_threads));
  }
  if (options.apply_threads < 1 || options.apply_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("apply_threads must be in [1, 256], got ", options.apply_threads));
  }
  if (options.cluster.consistency().mode() == ALLREDUCE) {
    return absl::InvalidArgumentError("mode allreduce runs without parameter servers");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   Optimizer::Create(options.cluster.optimizer()));
  return std::unique_ptr<ParameterShard>(new ParameterShard(options, std::move(optimizer)));
}

ParameterShard::ParameterShard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer)
    : options_(options),
      policy_(options.cluster.consistency()),
      optimizer_(std::move(optimizer)),
      max_wait_(absl::Milliseconds(options.cluster.wait_timeout_ms())),
      part_elements_(options.part_elements >= 0 && options.cluster.consistency().mode() == BSP
                         ? options.part_elements
                         : PushPartElements(options.cluster.consistency(),
                                            options.cluster.num_workers(),
                                            options.push_budget_bytes)),
      members_(options.shard_id, options.cluster.num_workers(), options.cluster.lease_ms()),
      noise_(options.shard_id, options.noise_ema_decay) {
  auto view = std::make_shared<TensorAggregator::Members>();
  view->member.assign(options.cluster.num_workers(), 0);
  member_view_ = std::move(view);
  if (options.update_threads > 1) pool_ = std::make_unique<ThreadPool>(options.update_threads);
  update_pool_ = std::make_unique<UpdatePool>(options.apply_threads);
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

ParameterShard::~ParameterShard() {
  Shutdown();
  deadline_thread_.join();
  update_pool_.reset();  // Applies what was queued; pulls it completes fail as shut down.
  Shutdown();
}

void ParameterShard::Shutdown() {
  std::vector<PullStatePtr> failed;
  Released released;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    for (auto& t : tensors_) {
      t->ReleaseHeld(absl::UnavailableError(absl::StrCat("parameter server shard ",
                                                         options_.shard_id, " is shutting down")),
                     &released);
    }
    for (PullStatePtr& p : parked_) {
      if (p->End()) failed.push_back(std::move(p));
    }
    parked_.clear();
    parked_changed_.SignalAll();
  }
  for (const PullStatePtr& p : failed) {
    p->done_(absl::UnavailableError(
                 absl::StrCat("parameter server shard ", options_.shard_id, " is shutting down")),
             {});
  }
  Finish(&released);
}

TensorAggregator::Context ParameterShard::Context() const {
  TensorAggregator::Context ctx;
  ctx.policy = &policy_;
  ctx.optimizer = optimizer_.get();
  ctx.pool = pool_.get();
  ctx.members = &member_view_;
  ctx.schedule = schedule_ptr_.load(std::memory_order_acquire);
  ctx.noise = &noise_;
  ctx.plan = &plan_view_;
  return ctx;
}

void ParameterShard::MembersChanged(std::vector<PullStatePtr>* ready, Released* released) {
  auto view = std::make_shared<TensorAggregator::Members>();
  view->member = members_.member();
  view->count = members_.members();
  std::atomic_store(&member_view_, std::shared_ptr<const TensorAggregator::Members>(view));
  if (schedule_ptr_.load() == nullptr) return;
  const TensorAggregator::Context ctx = Context();
  for (auto& t : tensors_) {
    double lr = 0;
    if (t->ApplyIfComplete(ctx, released, &lr)) {
      last_learning_rate_ = lr;
    }
  }
  ArmParked(ready);
}

int64_t ParameterShard::MinVersion() const {
  int64_t v = kMaxStep;
  for (const auto& t : tensors_) v = std::min(v, t->version());
  return tensors_.empty() ? 0 : v;
}

absl::StatusOr<RegisterResponse> ParameterShard::Register(const RegisterRequest& request) {
  const int id = request.worker_id();
  if (id < 0 || id >= options_.cluster.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id ", id, " is not in [0, num_workers=", options_.cluster.num_workers(), ")"));
  }
  if (request.num_workers() != options_.cluster.num_workers() ||
      FormatConsistency(request.consistency()) !=
          FormatConsistency(options_.cluster.consistency())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job mismatch: shard ", options_.shard_id, " runs ", options_.cluster.num_workers(),
        " workers in mode ", FormatConsistency(options_.cluster.consistency()), ", but worker ", id,
        " was started with ", request.num_workers(), " workers in mode ",
        FormatConsistency(request.consistency())));
  }
  RETURN_IF_ERROR(CheckStep("steps_per_epoch", request.steps_per_epoch()));
  RETURN_IF_ERROR(CheckStep("total_steps", request.total_steps()));
  RETURN_IF_ERROR(CheckStep("resume_step", request.resume_step()));
  if (request.model().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", id, " registered with an empty model"));
  }
  if (request.model_size() > kMaxTensors) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", id, ": model of ",
                                                   request.model_size(), " tensors (at most ",
                                                   kMaxTensors, ")"));
  }
  if (request.batch_size() < 1 || request.batch_size() > kMaxBatchSize) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", id, ": batch_size must be in [1, ",
                                                   kMaxBatchSize, "], got ", request.batch_size()));
  }
  // Validate the request on its own before looking at the shard's state.
  absl::flat_hash_map<std::string, int> model_index;
  for (int i = 0; i < request.model_size(); ++i) {
    const TensorSpec& spec = request.model(i);
    RETURN_IF_ERROR(CheckTensorName(spec.name()));
    if (absl::StatusOr<int64_t> n = CheckedElementCount(spec.shape()); !n.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", id, ": tensor '", spec.name(), "': ", n.status().message()));
    }
    if (!model_index.emplace(spec.name(), i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", id, ": tensor '", spec.name(), "' appears twice in the model"));
    }
  }
  if (request.initial_values_size() != 0 && request.initial_values_size() != request.model_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", id, ": ", request.initial_values_size(), " initial values for ",
                     request.model_size(), " tensors"));
  }
  for (int i = 0; i < request.initial_values_size(); ++i) {
    const TensorValue& v = request.initial_values(i);
    const TensorSpec& spec = request.model(i);
    RETURN_IF_ERROR(CheckTensorName(v.name()));
    if (v.name() != spec.name()) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", id, ": initial value ", i, " is '",
                                                     v.name(), "' but model tensor ", i, " is '",
                                                     spec.name(), "'"));
    }
    RETURN_IF_ERROR(CheckFloatBytes(absl::StrCat("initial value of '", v.name(), "'"), v.data(),
                                    *CheckedElementCount(spec.shape())));
  }

  std::vector<PullStatePtr> ready;
  Released released;
  RegisterResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError("parameter server is shutting down");
    for (int other = 0; other < options_.cluster.num_workers(); ++other) {
      const Membership::Worker& w = members_.worker(other);
      if (other == id || !w.registered) continue;
      if (w.steps_per_epoch != request.steps_per_epoch() ||
          w.total_steps != request.total_steps()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job mismatch: worker ", other, " runs ", w.total_steps, " steps of ",
            w.steps_per_epoch, " per epoch, but worker ", id, " was started for ",
            request.total_steps(), " steps of ", request.steps_per_epoch(), " per epoch"));
      }
    }
    if (!initialised_) {
      if (request.initial_values().empty()) {
        // Ask one registrant for the values; the others come back once they are in. Another
        // is asked if the first has not sent them within kInitialValuesGrant (it may have died).
        response.set_shard_id(options_.shard_id);
        response.set_num_shards(options_.num_shards);
        *response.mutable_consistency() = options_.cluster.consistency();
        response.set_num_workers(options_.cluster.num_workers());
        response.set_lease_ms(options_.cluster.lease_ms());
        const absl::Time now = absl::Now();
        if (values_asked_of_ < 0 || values_asked_of_ == id ||
            now - values_asked_at_ > kInitialValuesGrant) {
          values_asked_of_ = id;
          values_asked_at_ = now;
          response.set_needs_initial_values(true);
        } else {
          response.set_initialising(true);
        }
        return response;
      }
      for (int i = 0; i < request.model_size(); ++i) {
        const TensorSpec& spec = request.model(i);
        std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
        std::vector<float> values(ElementCount(shape));
        BytesToFloats(request.initial_values(i).data(), absl::MakeSpan(values));
        const TensorRole role = optimizer_->RoleOf(spec.name(), shape);
        tensors_.push_back(std::make_unique<TensorAggregator>(
            spec.name(), std::move(shape), std::move(values), role, options_.cluster.num_workers(),
            part_elements_));
        index_[spec.name()] = i;
      }
      members_.SetTensorCount(static_cast<int>(tensors_.size()));
      noise_.SetTensors(static_cast<int>(tensors_.size()));
      SetUpCheckpointing();
      initialised_ = true;
    } else {
      // The model must match the adopted one exactly.
      for (const auto& t : tensors_) {
        auto it = model_index.find(t->name());
        if (it == model_index.end()) {
          return absl::FailedPreconditionError(
              absl::StrCat("model mismatch on shard ", options_.shard_id, ": worker ", id,
                           " has no tensor '", t->name(), "' ", ShapeString(t->shape())));
        }
        const TensorSpec& theirs = request.model(it->second);
        if (!std::equal(t->shape().begin(), t->shape().end(), theirs.shape().begin(),
                        theirs.shape().end())) {
          return absl::FailedPreconditionError(
              absl::StrCat("model mismatch on shard ", options_.shard_id, ": tensor '", t->name(),
                           "' is ", ShapeString(t->shape()), " on the server but ",
                           ShapeString(theirs.shape()), " on worker ", id));
        }
      }
      if (request.model_size() != static_cast<int>(tensors_.size())) {
        for (const TensorSpec& spec : request.model()) {
          if (!index_.contains(spec.name())) {
            return absl::FailedPreconditionError(
                absl::StrCat("model mismatch on shard ", options_.shard_id, ": worker ", id,
                             " has tensor '", spec.name(), "' which the server does not"));
          }
        }
      }
    }
    if (options_.cluster.adaptive_batch().max_global_batch() > 0) {
      // The plan starts from one batch for every worker (BatchPlan); a worker that joins later
      // registers with that first batch and takes the changes from the response.
      int first = plan_.has_value() ? plan_->initial_batch() : 0;  // 0: no other registrant.
      for (int other = 0; other < members_.num_workers() && first == 0; ++other) {
        const Membership::Worker& o = members_.worker(other);
        if (o.registered && other != id) first = o.batch_size;
      }
      if (first != 0 && request.batch_size() != first) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job mismatch: under an adaptive batch every worker starts from the same batch; "
            "worker ",
            id, " registered with ", request.batch_size(), " but the job's is ", first));
      }
    }
    Membership::Worker& w = members_.worker(id);
    const Membership::Worker before = w;
    members_.SetMember(id, true);
    w.finished = false;
    w.batch_size = request.batch_size();
    noise_.SetBatch(request.batch_size());
    w.steps_per_epoch = request.steps_per_epoch();
    w.total_steps = request.total_steps();
    w.last_step = request.resume_step() - 1;
    w.last_seen = absl::Now();
    if (absl::Status s = StartTrainingIfComplete(); !s.ok()) {
      members_.SetMember(id, before.registered);
      w = before;
      return s;
    }
    // Under async and ssp a worker goes on from its own step, so the steps before it count as
    // pushed. Otherwise a worker that rejoins a shard restored from an older checkpoint would
    // hold that checkpoint's clock, and under ssp its own next pull would wait on it for ever
    // (every worker's clock must be within the staleness of the pulled step).
    if (!policy_.Synchronous()) members_.SkipTo(id, request.resume_step());
    MembersChanged(&ready, &released);  // The last registrant may release the step-0 pulls.
    parked_changed_.Signal();           // Leases may start (or restart) running.
    response.set_shard_id(options_.shard_id);
    response.set_num_shards(options_.num_shards);
    *response.mutable_consistency() = options_.cluster.consistency();
    response.set_num_workers(options_.cluster.num_workers());
    response.set_min_version(MinVersion());
    response.set_lease_ms(options_.cluster.lease_ms());
    // Where this worker goes on: the job's step under bsp and backup; its own clock under async
    // and ssp, whose versions count every worker's updates (a rejoined worker that took the version
    // would skip steps it never computed and, under ssp, wait on a clock no one will reach).
    response.set_resume_step(policy_.Synchronous() ? MinVersion() : members_.Clock(id));
    response.set_restored_step(members_.restored_step());
    response.set_recovery_id(recovery_id_.load());
    response.set_part_elements(part_elements_);
    if (plan_.has_value()) {
      for (const BatchChange& c : plan_->changes()) *response.add_batch_plan() = c;
    }
  }
  for (const PullStatePtr& p : ready) Complete(p);
  Finish(&released);
  return response;
}

absl::Status ParameterShard::StartTrainingIfComplete() {
  if (schedule_.has_value() || members_.members() < options_.cluster.num_workers()) {
    return absl::OkStatus();
  }
  ScheduleContext context;
  for (int w = 0; w < members_.num_workers(); ++w) {
    context.global_batch += members_.worker(w).batch_size;
  }
  context.steps_per_epoch = members_.worker(0).steps_per_epoch;
  context.total_steps = members_.worker(0).total_steps;
  absl::StatusOr<LearningRateScheduler> schedule = LearningRateScheduler::Create(
      options_.cluster.optimizer().learning_rate(), options_.cluster.lr_schedule(), context);
  if (!schedule.ok()) {
    return absl::Status(schedule.status().code(),
                        absl::StrCat("cannot start training: ", schedule.status().message()));
  }
  schedule_ = std::move(*schedule);
  schedule_ptr_.store(&*schedule_, std::memory_order_release);
  if (options_.cluster.adaptive_batch().max_global_batch() > 0 && !plan_.has_value()) {
    plan_.emplace(members_.num_workers(), members_.worker(0).batch_size);
    std::atomic_store(&plan_view_,
                      std::shared_ptr<const BatchPlan>(std::make_shared<const BatchPlan>(*plan_)));
  }
  RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": all " << options_.cluster.num_workers()
                   << " workers registered; optimizer " << optimizer_->config().type()
                   << "; learning-rate schedule:\n"
                   << schedule_->Describe();
  return absl::OkStatus();
}

void ParameterShard::SetUpCheckpointing() {
  if (options_.checkpoint_every_steps <= 0 || !options_.on_checkpoint) return;
  // Under async and ssp a version counts every worker's updates.
  const int64_t every = options_.checkpoint_every_steps *
                        (policy_.Synchronous() ? 1 : options_.cluster.num_workers());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    tensors_[i]->SetCheckpointing(
        every, [this, i](int64_t version, TensorSnapshot weights, TensorOptimizerState state) {
          OnCaptured(static_cast<int>(i), version, std::move(weights), std::move(state));
        });
  }
}

void ParameterShard::OnCaptured(int tensor, int64_t version, TensorSnapshot weights,
                                TensorOptimizerState optimizer_state) {
  const int64_t step = policy_.Synchronous() ? version : version / options_.cluster.num_workers();
  std::shared_ptr<CapturedCheckpoint> complete;
  {
    absl::MutexLock lock(&checkpoint_mu_);
    PendingCheckpoint& p = pending_checkpoints_[step];
    if (p.weights.empty()) {
      p.weights.resize(tensors_.size());
      p.optimizer_states.resize(tensors_.size());
    }
    if (p.weights[tensor].values != nullptr) return;  // Taken already (cannot happen twice).
    p.weights[tensor] = std::move(weights);
    p.optimizer_states[tensor] = std::move(optimizer_state);
    if (++p.filled < tensors_.size()) return;
    complete = std::make_shared<CapturedCheckpoint>();
    complete->step = step;
    complete->weights = std::move(p.weights);
    complete->optimizer_states = std::move(p.optimizer_states);
    // Older steps can no longer complete (every tensor is past them); drop them.
    pending_checkpoints_.erase(pending_checkpoints_.begin(),
                               pending_checkpoints_.upper_bound(step));
  }
  last_checkpoint_step_.store(step);
  options_.on_checkpoint(std::move(complete));
}

ShardCheckpoint ParameterShard::CheckpointProto(const CapturedCheckpoint& capture) const {
  ShardCheckpoint c;
  c.set_shard_id(options_.shard_id);
  c.set_num_shards(options_.num_shards);
  c.set_step(capture.step);
  *c.mutable_cluster() = options_.cluster;
  *c.mutable_cluster()->mutable_optimizer() = optimizer_->config();
  const std::string& type = optimizer_->config().type();
  for (size_t i = 0; i < tensors_.size() && i < capture.weights.size(); ++i) {
    TensorCheckpoint* t = c.add_tensors();
    t->set_name(tensors_[i]->name());
    for (int64_t d : tensors_[i]->shape()) t->add_shape(d);
    const std::vector<float>& values = *capture.weights[i].values;
    t->set_values(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    t->set_version(capture.weights[i].version);
    *t->mutable_optimizer_state() = SaveOptimizerState(type, capture.optimizer_states[i]);
  }
  absl::MutexLock lock(&mu_);
  for (int w = 0; w < members_.num_workers(); ++w) {
    const Membership::Worker& worker = members_.worker(w);
    WorkerCheckpoint* wc = c.add_workers();
    wc->set_worker_id(w);
    wc->set_batch_size(worker.batch_size);
    wc->set_clock(capture.step);
    c.set_global_batch(c.global_batch() + worker.batch_size);
  }
  c.set_steps_per_epoch(members_.worker(0).steps_per_epoch);
  c.set_total_steps(members_.worker(0).total_steps);
  c.set_written_unix_ms(absl::ToUnixMillis(absl::Now()));
  return c;
}

absl::Status ParameterShard::Restore(const ShardCheckpoint& c) {
  auto mismatch = [&](absl::string_view what, const auto& theirs, const auto& ours) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint is of another job: its ", what, " is ", theirs, ", this shard's ", ours));
  };
  if (c.shard_id() != options_.shard_id) return mismatch("shard", c.shard_id(), options_.shard_id);
  if (c.num_shards() != options_.num_shards) {
    return mismatch("shard count", c.num_shards(), options_.num_shards);
  }
  if (c.cluster().num_workers() != options_.cluster.num_workers()) {
    return mismatch("worker count", c.cluster().num_workers(), options_.cluster.num_workers());
  }
  if (FormatConsistency(c.cluster().consistency()) !=
      FormatConsistency(options_.cluster.consistency())) {
    return mismatch("mode", FormatConsistency(c.cluster().consistency()),
                    FormatConsistency(options_.cluster.consistency()));
  }
  const std::string& type = optimizer_->config().type();
  if (c.cluster().optimizer().type() != type) {
    return mismatch("optimizer", c.cluster().optimizer().type(), type);
  }
  if (c.tensors().empty() || c.tensors_size() > kMaxTensors) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of step ", c.step(), " holds ", c.tensors_size(), " tensors"));
  }
  std::vector<std::unique_ptr<TensorAggregator>> tensors;
  absl::flat_hash_map<std::string, int> index;
  int64_t versions = 0;
  for (const TensorCheckpoint& t : c.tensors()) {
    const std::string what = absl::StrCat("checkpoint tensor '", t.name(), "'");
    if (absl::Status s = CheckTensorName(t.name()); !s.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint: ", s.message()));
    }
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    absl::StatusOr<int64_t> n = CheckedElementCount(t.shape());
    if (!n.ok()) return absl::DataLossError(absl::StrCat(what, ": ", n.status().message()));
    if (absl::Status s = CheckFloatBytes(what, t.values(), *n); !s.ok()) {
      return absl::DataLossError(s.message());
    }
    const bool consistent = policy_.Synchronous() ? t.version() == c.step() : t.version() >= 0;
    if (!consistent) {
      return absl::DataLossError(absl::StrCat(what, " is at version ", t.version(),
                                              ", not the checkpoint's step ", c.step()));
    }
    absl::StatusOr<TensorOptimizerState> state = LoadOptimizerState(t.optimizer_state(), type, *n);
    if (!state.ok()) return absl::DataLossError(absl::StrCat(what, ": ", state.status().message()));
    if (!index.emplace(t.name(), static_cast<int>(tensors.size())).second) {
      return absl::DataLossError(absl::StrCat(what, " appears twice"));
    }
    std::vector<float> values(*n);
    BytesToFloats(t.values(), absl::MakeSpan(values));
    const TensorRole role = optimizer_->RoleOf(t.name(), shape);
    tensors.push_back(
        std::make_unique<TensorAggregator>(t.name(), std::move(shape), std::move(values), role,
                                           options_.cluster.num_workers(), part_elements_));
    tensors.back()->Restore(t.version(), std::move(*state));
    versions += t.version();
  }
  absl::MutexLock lock(&mu_);
  if (initialised_) {
    return absl::FailedPreconditionError("the shard has weights already; restore before training");
  }
  tensors_ = std::move(tensors);
  index_ = std::move(index);
  members_.SetTensorCount(static_cast<int>(tensors_.size()));
  noise_.SetTensors(static_cast<int>(tensors_.size()));
  if (!policy_.Synchronous()) members_.RestoreClocks(c.step());
  members_.SetRestored(c.step());
  SetUpCheckpointing();
  initialised_ = true;
  restored_versions_ = versions;
  return absl::OkStatus();
}

absl::StatusOr<RollbackResponse> ParameterShard::Rollback(const RollbackRequest& request) {
  if (request.worker_id() < 0 || request.worker_id() >= options_.cluster.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("Rollback from worker ", request.worker_id(),
                                                   ", not in [0, ", options_.cluster.num_workers(),
                                                   ")"));
  }
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  if (request.recovery_id() == 0) {
    return absl::InvalidArgumentError("Rollback with recovery id 0 (the id of a fresh start)");
  }
  if (!policy_.Synchronous()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Rollback under ", FormatConsistency(options_.cluster.consistency()),
        ": only bsp and backup shards roll back (a restored async or ssp shard goes on)"));
  }
  RollbackResponse response;
  if (request.recovery_id() == recovery_id_.load()) return response;  // Done already.
  {
    absl::MutexLock lock(&mu_);
    if (initialised_ && request.step() > MinVersion()) {
      return absl::FailedPreconditionError(
          absl::StrCat("Rollback to step ", request.step(), ": this shard stands at step ",
                       MinVersion(), ", and a roll-back cannot go forward"));
    }
    // Restored from that very step and nothing applied since (a whole job resumed): restarting
    // would restore the same state, so the shard joins the recovery as it stands.
    bool untouched = initialised_ && members_.restored_step() == request.step();
    for (const auto& t : tensors_) untouched = untouched && t->version() == request.step();
    if (untouched) {
      recovery_id_.store(request.recovery_id());
      return response;
    }
  }
  if (!options_.on_rollback) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard_id,
                     " keeps no checkpoints (--checkpoint_dir), so it cannot roll "
                     "back to step ",
                     request.step(), "; restart every shard with --restore_step=", request.step()));
  }
  RETURN_IF_ERROR(options_.on_rollback(request.step(), request.recovery_id()));
  response.set_restarting(true);
  return response;
}

absl::StatusOr<PushResponse> ParameterShard::Push(const PushRequest& request) {
  WirePush wire;
  wire.worker_id = request.worker_id();
  wire.step = request.step();
  wire.batch_size = request.batch_size();
  if (request.has_noise_relay()) wire.noise_relay = request.noise_relay();
  for (const TensorValue& g : request.gradients()) {
    WireTensor t;
    t.name = g.name();
    t.data = ByteChunks(g.data());
    t.offset = g.offset();
    wire.gradients.push_back(std::move(t));
  }
  absl::Notification done;
  absl::StatusOr<PushResponse> result;
  Push(wire, nullptr, [&](absl::StatusOr<PushResponse> r) {
    result = std::move(r);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

namespace {
// Pushes of at most this many bytes of gradients are checked and applied without the update pool.
constexpr size_t kInlinePushBytes = size_t{1} << 20;
}  // namespace

void ParameterShard::Push(const WirePush& request, std::shared_ptr<const void> keepalive,
                          PushDone done) {
  const int id = request.worker_id;
  const int64_t step = request.step;
  std::vector<int> which;  // The tensor of each gradient.
  std::vector<int> part;   // and its part (-1: the whole gradient)
  // Checks that need the shard's state.
  absl::Status status = [&]() -> absl::Status {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(members_.CheckMember(id));
    if (!schedule_.has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat("training has not started: ", members_.members(), " of ",
                       options_.cluster.num_workers(), " workers registered"));
    }
    RETURN_IF_ERROR(CheckStep("step", step));
    RETURN_IF_ERROR(CheckPushBatch(request));
    if (request.gradients.size() > tensors_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a push of ", request.gradients.size(),
                                                     " gradients to a shard of ", tensors_.size(),
                                                     " tensors"));
    }
    // A gradient is computed on pulled weights: under async and ssp a push for a step this
    // worker has not pulled is from the future (under bsp and backup the versions say so).
    const int64_t pulled = members_.worker(id).pulled_step;
    if (!policy_.Synchronous() && step > pulled) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, " from worker ", id, " is from the future: it has pulled ",
                       pulled < 0 ? std::string("nothing") : absl::StrCat("up to step ", pulled),
                       " from shard ", options_.shard_id));
    }
    return absl::OkStatus();
  }();
  // Checks of the request alone, and of each tensor's version, without the shard's lock. The
  // values (sizes, finiteness: a read of every byte) are checked on the update pool below.
  if (status.ok()) {
    status = [&]() -> absl::Status {
      absl::flat_hash_set<int> seen;
      for (const WireTensor& g : request.gradients) {
        RETURN_IF_ERROR(CheckTensorName(g.name));  // Before it is echoed in an error.
        auto it = index_.find(g.name);
        if (it == index_.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "unknown tensor '", Printable(g.name), "' (not on shard ", options_.shard_id, ")"));
        }
        if (!seen.insert(it->second).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor '", g.name, "' appears twice in one push"));
        }
        which.push_back(it->second);
        // A part: bsp only, at a part's first element, of that part's size (checked with the
        // values below).
        const TensorAggregator& t = *tensors_[it->second];
        if (g.offset == 0 &&
            (t.parts() < 2 || g.data.size() == static_cast<size_t>(t.elements()) * 4)) {
          part.push_back(-1);  // the whole gradient (its size is checked below)
          continue;
        }
        if (t.parts() < 2) {
          return absl::InvalidArgumentError(absl::StrCat("gradient '", g.name, "' at offset ",
                                                         g.offset, ": tensor '", g.name,
                                                         "' is pushed whole (offset 0)"));
        }
        if (g.offset < 0 || g.offset >= t.elements() || g.offset % t.part_elements() != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "gradient '", g.name, "' at offset ", g.offset, " does not start a part of '", g.name,
              "' (", t.elements(), " elements in parts of ", t.part_elements(), ")"));
        }
        part.push_back(static_cast<int>(g.offset / t.part_elements()));
      }
      for (size_t k = 0; k < request.gradients.size(); ++k) {
        RETURN_IF_ERROR(tensors_[which[k]]->CheckStep(Context(), id, step));
      }
      return absl::OkStatus();
    }();
  }
  if (!status.ok()) {
    ++rejected_pushes_;
    done(status);
    return;
  }
  if (request.gradients.empty()) {
    status = AdmitPush(request);
    if (!status.ok()) {
      ++rejected_pushes_;
      done(status);
      return;
    }
    ++pushes_;
    done(PushResponse());
    return;
  }
  // Two rounds of tasks on the update pool, off the caller's (gRPC's) thread: each gradient's
  // values are checked, in parallel; once all are, the last check admits the push (nothing is
  // applied unless every gradient is valid and the worker still a member), and then one task per
  // gradient applies it; the last gradient to be done answers. With a keepalive (the gRPC path), a
  // bsp gradient that is held for its turn is done only once it is added, so that a worker's held
  // gradients are bounded by the calls it has in flight.
  struct Progress {
    absl::Mutex mu;
    int to_check;
    int left;
    std::vector<absl::Status> checks;  // Per gradient; the first error in request order answers.
    std::vector<GradientOutcome> outcomes;
    PushDone done;
    absl::Status error;
    bool over = false;  // Answered: the caller's request is no longer read.
  };
  auto progress = std::make_shared<Progress>();
  progress->to_check = static_cast<int>(which.size());
  progress->left = static_cast<int>(which.size());
  progress->checks.resize(which.size());
  progress->outcomes.resize(which.size());
  progress->done = std::move(done);
  // Answers once; a caller without a keepalive returns only after that.
  auto finish = [progress](absl::StatusOr<PushResponse> answer) {
    PushDone d = std::move(progress->done);
    d(std::move(answer));
    absl::MutexLock lock(&progress->mu);
    progress->over = true;
  };
  auto gradient_done = [this, progress, step, finish](absl::Status status) {
    {
      absl::MutexLock lock(&progress->mu);
      if (!status.ok() && progress->error.ok()) progress->error = std::move(status);
      if (--progress->left > 0) return;
    }
    if (!progress->error.ok()) {
      finish(progress->error);
      return;
    }
    PushResponse response;
    if (std::shared_ptr<const BatchPlan> plan = std::atomic_load(&plan_view_);
        plan != nullptr && !plan->changes().empty()) {
      *response.mutable_batch_change() = plan->changes().back();
    }
    // The step before this one: complete on every shard once this worker could compute this
    // one (bsp, backup), so every shard answers the same step's figures.
    if (policy_.Synchronous()) {
      if (std::optional<NoiseScaleStats> noise = noise_.StatsAt(step - 1); noise.has_value()) {
        *response.mutable_noise_scale() = std::move(*noise);
      }
    }
    for (const GradientOutcome& o : progress->outcomes) {
      switch (o.kind) {
        case GradientOutcome::kAccepted:
          response.set_accepted(response.accepted() + 1);
          response.set_max_staleness(std::max(response.max_staleness(), o.staleness));
          break;
        case GradientOutcome::kDuplicate:
          response.set_duplicates(response.duplicates() + 1);
          break;
        case GradientOutcome::kDropped:
          response.set_dropped(response.dropped() + 1);
          break;
      }
    }
    finish(response);
  };
  // A small push is checked and applied on the calling thread: for it, the hand-offs to the pool
  // and back would cost more than its work.
  size_t bytes = 0;
  for (const WireTensor& g : request.gradients) bytes += g.data.size();
  const bool on_pool = bytes > kInlinePushBytes;
  auto run = [this, on_pool](std::function<void()> task) {
    if (on_pool) {
      update_pool_->Post(std::move(task));
    } else {
      task();
    }
  };
  // Once every value is checked: admit the push, then apply each gradient. Shared by the check
  // tasks, the last of which runs it.
  auto admit = std::make_shared<std::function<void()>>(
      [this, progress, gradient_done, finish, which, part, id, step, &request, keepalive, run] {
        absl::Status verdict;
        for (const absl::Status& c : progress->checks) {
          if (!c.ok()) {
            verdict = c;
            break;
          }
        }
        if (verdict.ok()) verdict = AdmitPush(request);
        if (!verdict.ok()) {
          ++rejected_pushes_;
          finish(verdict);
          return;
        }
        ++pushes_;
        for (size_t k = 0; k < which.size(); ++k) {
          const ByteChunks* data = &request.gradients[k].data;
          const int tensor = which[k];
          const int p = part[k];
          run([this, progress, gradient_done, k, id, step, tensor, p, data, keepalive] {
            std::function<void(absl::Status)> on_added;
            if (keepalive != nullptr) on_added = gradient_done;
            GradientOutcome& outcome = progress->outcomes[k];
            ApplyGradient(id, step, tensor, p, data, keepalive, std::move(on_added), &outcome);
            if (!outcome.held) gradient_done(absl::OkStatus());
          });
        }
      });
  // `request` (and the views in it) must stay valid until the tasks have read it: the caller
  // waits below, unless its keepalive holds it (then the tasks hold the keepalive).
  for (size_t k = 0; k < which.size(); ++k) {
    const WireTensor* g = &request.gradients[k];
    const TensorAggregator& t = *tensors_[which[k]];
    const int64_t elements = part[k] < 0 ? t.elements() : t.part_size(part[k]);
    run([progress, admit, k, g, elements, keepalive] {
      absl::Status check =
          CheckFloatChunks(absl::StrCat("gradient '", g->name, "'"), g->data, elements);
      {
        absl::MutexLock lock(&progress->mu);
        progress->checks[k] = std::move(check);
        if (--progress->to_check > 0) return;
      }
      (*admit)();
    });
  }
  if (keepalive == nullptr) {
    absl::MutexLock lock(&progress->mu);
    progress->mu.Await(absl::Condition(
        +[](Progress* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) { return p->over; }, progress.get()));
  }
}

absl::Status ParameterShard::AdmitPush(const WirePush& request) {
  absl::MutexLock lock(&mu_);
  // A worker dropped since the push arrived is refused; nothing was applied.
  RETURN_IF_ERROR(members_.CheckMember(request.worker_id));
  Membership::Worker& worker = members_.worker(request.worker_id);
  worker.last_seen = absl::Now();
  worker.last_step = std::max(worker.last_step, request.step);
  if (plan_.has_value()) TakeRelay(request);
  return absl::OkStatus();
}

void ParameterShard::ApplyGradient(int worker, int64_t step, int tensor, int part,
                                   const ByteChunks* data, std::shared_ptr<const void> keepalive,
                                   std::function<void(absl::Status)> on_added,
                                   GradientOutcome* outcome) {
  Released released;
  TensorAggregator::Gradient gradient{data, std::move(keepalive), std::move(on_added)};
  gradient.part = part;
  const double lr =
      tensors_[tensor]->Add(Context(), worker, step, std::move(gradient), outcome, &released);
  if (outcome->kind == GradientOutcome::kDuplicate) {
    ++duplicate_gradients_;
    return;
  }
  if (outcome->kind == GradientOutcome::kDropped) ++dropped_gradients_;
  if (outcome->kind == GradientOutcome::kAccepted && outcome->first_part) {
    RecordStaleness(outcome->staleness);
  }
  if (outcome->applied) {
    last_learning_rate_ = lr;
  }
  std::vector<PullStatePtr> ready;
  if (!policy_.Synchronous()) {
    // Clocks matter only to async (a rejoining worker's resume step) and ssp, where a tick may
    // release parked pulls: bsp and backup skip the shard's lock here.
    absl::MutexLock lock(&mu_);
    if (members_.Pushed(worker, tensor, step) && policy_.mode() == SSP) ArmParked(&ready);
  }
  for (const PullStatePtr& p : ready) Complete(p);
  Finish(&released);
}

void ParameterShard::Finish(Released* released) {
  for (auto& p : released->pulls) Complete(std::static_pointer_cast<PullState>(p));
  for (auto& [ack, status] : released->acks) ack(std::move(status));
  *released = Released();
}

void ParameterShard::RecordStaleness(int64_t tau) {
  int bucket = 0;
  if (tau < 4) {
    bucket = static_cast<int>(tau);
  } else if (tau < 8) {
    bucket = 4;
  } else if (tau < 16) {
    bucket = 5;
  } else if (tau < 32) {
    bucket = 6;
  } else {
    bucket = 7;
  }
  ++staleness_histogram_[bucket];
}

absl::StatusOr<std::vector<int>> ParameterShard::CheckPull(const PullRequest& request) const {
  const int id = request.worker_id();
  if (shutdown_) {
    return absl::UnavailableError(
        absl::StrCat("parameter server shard ", options_.shard_id, " is shutting down"));
  }
  RETURN_IF_ERROR(members_.CheckMember(id));
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  if (request.names_size() > static_cast<int>(tensors_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("a pull of ", request.names_size(),
                                                   " tensors from a shard of ", tensors_.size()));
  }
  std::vector<int> which;
  if (request.names().empty()) {
    for (size_t i = 0; i < tensors_.size(); ++i) which.push_back(static_cast<int>(i));
    return which;
  }
  // Each name once: a name repeated n times would make the response n tensors large.
  absl::flat_hash_set<int> seen;
  for (const std::string& name : request.names()) {
    RETURN_IF_ERROR(CheckTensorName(name));  // Before it is echoed in an error.
    auto it = index_.find(name);
    if (it == index_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown tensor '", Printable(name),
                                                     "' (not on shard ", options_.shard_id, ")"));
    }
    if (!seen.insert(it->second).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' appears twice in one pull"));
    }
    which.push_back(it->second);
  }
  return which;
}

bool ParameterShard::Arm(const PullStatePtr& pull) {
  pull->armed_ = true;
  const int64_t need = policy_.NeededVersion(pull->step_);
  bool complete = false;
  for (size_t k = 0; k < pull->tensors_.size(); ++k) {
    complete = tensors_[pull->tensors_[k]]->Pull(pull->worker_, need, pull, static_cast<int>(k)) ||
               complete;
  }
  return complete;
}

void ParameterShard::ArmParked(std::vector<PullStatePtr>* ready) {
  if (!schedule_.has_value()) return;
  const int64_t min_clock = policy_.mode() == SSP ? members_.MinMemberClock() : 0;
  for (auto it = parked_.begin(); it != parked_.end();) {
    PullState& p = **it;
    if (p.Over()) {
      it = parked_.erase(it);
      continue;
    }
    if (!p.armed_ && (policy_.mode() != SSP || min_clock >= policy_.SspNeededClock(p.step_))) {
      if (Arm(*it)) {
        ready->push_back(*it);
        it = parked_.erase(it);
        continue;
      }
    }
    ++it;
  }
}

std::string ParameterShard::DescribeWait(const PullState& pull) const {
  if (!schedule_.has_value()) {
    std::vector<int> missing;
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (!members_.worker(w).registered) missing.push_back(w);
    }
    return absl::StrCat("waiting for worker(s) ", absl::StrJoin(missing, ", "), " to register (",
                        members_.members(), " of ", options_.cluster.num_workers(), " registered)");
  }
  if (policy_.mode() == SSP) {
    const int64_t need = policy_.SspNeededClock(pull.step_);
    std::vector<std::string> behind;
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (members_.worker(w).registered && members_.Clock(w) < need) {
        behind.push_back(absl::StrCat(w, " (clock ", members_.Clock(w), ")"));
      }
    }
    return absl::StrCat("ssp: step ", pull.step_, " needs every worker at clock >= ", need,
                        "; waiting for worker(s) ", absl::StrJoin(behind, ", "));
  }
  // The first tensor that is behind, and whose gradients it lacks.
  for (int i : pull.tensors_) {
    const TensorAggregator& t = *tensors_[i];
    const int64_t version = t.version();
    if (version >= pull.step_) continue;
    return absl::StrCat("tensor '", t.name(), "' is at version ", version, "; waiting for step ",
                        version, " gradients from worker(s) ",
                        absl::StrJoin(t.Missing(members_.member()), ", "));
  }
  return "nothing (ready)";
}

void ParameterShard::Pull(const PullRequest& request, absl::Time deadline, PullDone done) {
  Pull(request, deadline,
       SharedPullDone(
           [done = std::move(done)](absl::Status status, std::vector<PulledTensor> tensors) {
             PullResponse response;
             for (const PulledTensor& t : tensors) {
               TensorValue* v = response.add_tensors();
               v->set_name(*t.name);
               v->set_version(t.snapshot.version);
               FloatsToBytes(*t.snapshot.values, v->mutable_data());
             }
             done(std::move(status), std::move(response));
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
      members_.worker(request.worker_id()).last_seen = absl::Now();
      auto pull =
          std::make_shared<PullState>(request.worker_id(), request.step(), std::move(*which),
                                      std::min(deadline, absl::Now() + max_wait_), std::move(done));
      SupersedePulls(*pull, &superseded);
      const bool may_start = schedule_.has_value() &&
                             (policy_.mode() != SSP ||
                              members_.MinMemberClock() >= policy_.SspNeededClock(request.step()));
      if (may_start && Arm(pull)) {
        complete = std::move(pull);
      } else {
        parked_.push_back(std::move(pull));
        parked_changed_.Signal();
      }
    }
  }
  if (!refused.ok()) {
    done(refused, {});
    return;
  }
  for (auto& f : superseded) f();
  if (complete != nullptr) Complete(complete);
}

void ParameterShard::SupersedePulls(const PullState& pull,
                                    std::vector<std::function<void()>>* out) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    PullStatePtr& p = *it;
    if (p->Over()) {
      it = parked_.erase(it);
      continue;
    }
    if (p->worker_ == pull.worker_ && p->Overlaps(pull) && p->End()) {
      out->push_back([p = std::move(p), step = pull.step_] {
        p->done_(
            absl::AbortedError(absl::StrCat("pull for step ", p->step_, " by worker ", p->worker_,
                                            " superseded by its pull for step ", step)),
            {});
      });
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
}

void ParameterShard::Complete(const PullStatePtr& pull) {
  {
    absl::MutexLock lock(&mu_);
    Membership::Worker& w = members_.worker(pull->worker_);
    w.pulled_step = std::max(w.pulled_step, pull->step_);
  }
  std::vector<TensorSnapshot> got = pull->TakeSnapshots();
  std::vector<PulledTensor> answer;
  answer.reserve(got.size());
  for (size_t k = 0; k < got.size(); ++k) {
    answer.push_back({&tensors_[pull->tensors_[k]]->name(), std::move(got[k])});
  }
  pull->done_(absl::OkStatus(), std::move(answer));
}

absl::Status ParameterShard::CheckPushBatch(const WirePush& request) const {
  if (request.noise_relay.has_value()) {
    const NoiseScaleRelay& r = *request.noise_relay;
    if (!std::isfinite(r.g2_ema()) || !std::isfinite(r.trace_ema())) {
      return absl::InvalidArgumentError("noise_relay: its figures must be finite");
    }
    RETURN_IF_ERROR(CheckStep("noise_relay.step", r.step()));
  }
  if (!plan_.has_value()) {
    const int registered = members_.worker(request.worker_id).batch_size;
    if (request.batch_size != 0 && request.batch_size != registered) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", request.worker_id, " pushed gradients of a batch of ", request.batch_size,
          " but registered a batch of ", registered, " (this job's batch is fixed)"));
    }
    return absl::OkStatus();
  }
  const int expected = plan_->BatchAt(request.step);
  if (request.batch_size != expected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", request.worker_id, " pushed step ", request.step, " computed on a batch of ",
        request.batch_size, " but the job's adaptive batch at that step is ", expected,
        " per worker (announced in the push responses)"));
  }
  return absl::OkStatus();
}

void ParameterShard::TakeRelay(const WirePush& request) {
  const int64_t every = AdaptiveBatchEvery(options_.cluster.adaptive_batch());
  if (relay_step_ >= 0 && request.step > relay_step_) DecideBatch();
  if (request.step <= decided_through_ || request.step % every != 0 ||
      !request.noise_relay.has_value()) {
    return;
  }
  if (relay_step_ != request.step) {
    relays_.clear();
    relay_step_ = request.step;
  }
  relays_.emplace(request.worker_id, *request.noise_relay);  // A worker's first relay counts.
}

void ParameterShard::DecideBatch() {
  const int64_t step = relay_step_;
  const NoiseScaleRelay relay = relays_.begin()->second;
  relays_.clear();
  relay_step_ = -1;
  decided_through_ = step;
  const double b_simple = relay.g2_ema() > 0 ? relay.trace_ema() / relay.g2_ema() : std::nan("");
  const int workers = plan_->workers();
  const int current = plan_->BatchAt(step + 2);
  const int batch = ProposeBatch(options_.cluster.adaptive_batch(), workers, current, b_simple);
  if (batch == current) return;
  BatchChange change;
  change.set_from_step(step + 2);
  change.set_batch_size(batch);
  change.set_global_batch(int64_t{batch} * workers);
  change.set_b_simple(b_simple);
  change.set_learning_rate(schedule_->At(step + 2) * schedule_->BatchFactor(change.global_batch()));
  if (absl::Status s = plan_->Add(change); !s.ok()) {
    RUBATO_LOG(WARNING) << "shard " << options_.shard_id << ": adaptive batch kept at " << current
                        << ": " << s.message();
    return;
  }
  noise_.SetBatchFrom(change.from_step(), batch);
  std::atomic_store(&plan_view_,
                    std::shared_ptr<const BatchPlan>(std::make_shared<const BatchPlan>(*plan_)));
  RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": adaptive batch: B_simple " << b_simple
                   << " (relayed at step " << step << ", moving averages of step " << relay.step()
                   << "); global batch " << int64_t{current} * workers << " -> "
                   << change.global_batch() << " from step " << change.from_step()
                   << ", learning rate " << change.learning_rate();
}

void ParameterShard::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    // Leases first, then pull deadlines; sleep until the earliest of what is left, or a change.
    std::vector<PullStatePtr> ready;
    Released released;
    std::vector<std::pair<PullStatePtr, absl::Status>> expired;
    absl::Time next = absl::InfiniteFuture();
    // Leases run only once training has started: before that, pulls wait for registration with
    // their own deadline.
    if (schedule_.has_value()) {
      std::vector<int> dropped;
      next = members_.ExpireLeases(absl::Now(), &dropped);
      if (!dropped.empty()) {
        dropped_workers_ += static_cast<int64_t>(dropped.size());
        MembersChanged(&ready, &released);
      }
    }
    const absl::Time now = absl::Now();
    // bsp gradients held for their turn wait at most max_wait_ for their acknowledgement, like a
    // pull; checked at least every second.
    if (policy_.SumsInWorkerOrder() && initialised_ && now >= next_held_check_) {
      absl::Time earliest = absl::InfiniteFuture();
      const std::shared_ptr<const TensorAggregator::Members> view = std::atomic_load(&member_view_);
      for (auto& t : tensors_) {
        earliest = std::min(
            earliest,
            t->ExpireHeld(now - max_wait_, *view, absl::ToInt64Milliseconds(max_wait_), &released));
      }
      next_held_check_ = std::min(now + absl::Seconds(1), earliest + max_wait_);
    }
    if (policy_.SumsInWorkerOrder() && initialised_) next = std::min(next, next_held_check_);
    for (auto it = parked_.begin(); it != parked_.end();) {
      PullState& p = **it;
      if (p.Over()) {
        it = parked_.erase(it);
      } else if (p.deadline_ <= now) {
        absl::Status status = absl::DeadlineExceededError(
            absl::StrCat("pull for step ", p.step_, " by worker ", p.worker_,
                         " timed out on shard ", options_.shard_id, ": ", DescribeWait(p)));
        if (p.End()) expired.emplace_back(*it, std::move(status));
        it = parked_.erase(it);
      } else {
        next = std::min(next, p.deadline_);
        ++it;
      }
    }
    if (!expired.empty() || !ready.empty() || !released.pulls.empty() || !released.acks.empty()) {
      mu_.Unlock();
      for (const PullStatePtr& p : ready) Complete(p);
      for (auto& [p, status] : expired) p->done_(std::move(status), {});
      Finish(&released);
      mu_.Lock();
      continue;
    }
    parked_changed_.WaitWithDeadline(&mu_, next);
  }
}

absl::StatusOr<HeartbeatResponse> ParameterShard::Heartbeat(const HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  const int id = request.worker_id();
  RETURN_IF_ERROR(members_.CheckMember(id));
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  Membership::Worker& w = members_.worker(id);
  w.last_seen = absl::Now();
  w.last_step = std::max(w.last_step, request.step());
  HeartbeatResponse response;
  response.set_min_version(MinVersion());
  return response;
}

absl::StatusOr<FinishResponse> ParameterShard::Finish(const FinishRequest& request) {
  absl::MutexLock lock(&mu_);
  const int id = request.worker_id();
  if (id < 0 || id >= options_.cluster.num_workers() ||
      !(members_.worker(id).registered || members_.worker(id).dropped)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", id, " is not registered with shard ", options_.shard_id));
  }
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  Membership::Worker& w = members_.worker(id);
  if (!w.finished) {
    RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": worker " << id << " finished after "
                     << request.step() << " steps";
  }
  w.finished = true;
  w.last_step = std::max(w.last_step, request.step() - 1);
  w.last_seen = absl::Now();
  FinishResponse response;
  for (int other = 0; other < members_.num_workers(); ++other) {
    response.set_finished_workers(response.finished_workers() +
                                  (members_.worker(other).finished ? 1 : 0));
  }
  return response;
}

absl::StatusOr<bool> ParameterShard::JobFinished(absl::Duration idle_timeout) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const absl::Duration lease = absl::Milliseconds(options_.cluster.lease_ms());
  int finished = 0;
  int live = 0;
  for (int id = 0; id < members_.num_workers(); ++id) {
    const Membership::Worker& w = members_.worker(id);
    if (w.finished) {
      ++finished;
    } else if (w.registered && now - w.last_seen <= lease) {
      ++live;
    }
  }
  if (finished == options_.cluster.num_workers()) return true;
  if (live > 0) {
    last_live_ = now;
    return false;
  }
  if (finished > 0) return now - last_live_ >= lease;
  if (now - last_live_ < idle_timeout) return false;
  std::vector<int> never, gone;
  for (int id = 0; id < options_.cluster.num_workers(); ++id) {
    const Membership::Worker& w = members_.worker(id);
    (w.registered || w.dropped ? gone : never).push_back(id);
  }
  std::string who;
  if (!never.empty()) absl::StrAppend(&who, "never registered: ", absl::StrJoin(never, ","));
  if (!gone.empty()) {
    absl::StrAppend(&who, who.empty() ? "" : "; ",
                    "registered, then silent: ", absl::StrJoin(gone, ","));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("shard ", options_.shard_id, ": no worker has been live for ",
                   absl::FormatDuration(now - last_live_), " and none has finished (", who, ")"));
}

GetStatsResponse ParameterShard::Stats() const {
  absl::MutexLock lock(&mu_);
  GetStatsResponse s;
  s.set_shard_id(options_.shard_id);
  *s.mutable_consistency() = options_.cluster.consistency();
  s.set_num_workers(options_.cluster.num_workers());
  // Each tensor's version is read once, so that min_version and applied_updates (every update
  // adds one to one version) agree with the versions listed even while updates run.
  int64_t bytes = 0;
  int64_t applied = 0;
  int64_t min_version = tensors_.empty() ? 0 : kMaxStep;
  for (const auto& t : tensors_) {
    bytes += t->elements() * static_cast<int64_t>(sizeof(float));
    const int64_t version = t->version();
    TensorStats* ts = s.add_tensors();
    ts->set_name(t->name());
    ts->set_elements(t->elements());
    ts->set_version(version);
    applied += version;  // Less the restored versions, below.
    min_version = std::min(min_version, version);
  }
  s.set_min_version(min_version);
  s.set_bytes(bytes);
  s.set_pushes(pushes_);
  s.set_rejected_pushes(rejected_pushes_);
  s.set_duplicate_gradients(duplicate_gradients_);
  s.set_applied_updates(applied - restored_versions_);
  s.set_restored_step(members_.restored_step());
  s.set_last_checkpoint_step(last_checkpoint_step_);
  s.set_dropped_workers(dropped_workers_);
  s.set_dropped_gradients(dropped_gradients_);
  for (int id = 0; id < members_.num_workers(); ++id) {
    s.set_finished_workers(s.finished_workers() + (members_.worker(id).finished ? 1 : 0));
  }
  for (const auto& n : staleness_histogram_) s.add_staleness_histogram(n);
  s.set_learning_rate(last_learning_rate_);
  if (schedule_.has_value()) s.set_lr_schedule(schedule_->Describe());
  if (plan_.has_value()) {
    for (const BatchChange& c : plan_->changes()) *s.add_batch_plan() = c;
  }
  if (policy_.Synchronous()) *s.mutable_noise_scale() = noise_.Stats();
  int64_t pending = 0;
  for (const PullStatePtr& p : parked_) pending += p->Over() ? 0 : 1;
  s.set_pending_pulls(pending);
  const absl::Time now = absl::Now();
  for (int id = 0; id < members_.num_workers(); ++id) {
    const Membership::Worker& w = members_.worker(id);
    if (!w.registered) continue;
    WorkerStats* ws = s.add_workers();
    ws->set_worker_id(id);
    ws->set_last_step(w.last_step);
    ws->set_ms_since_seen(absl::ToInt64Milliseconds(now - w.last_seen));
    ws->set_batch_size(w.batch_size);
  }
  return s;
}

}  // namespace rubato
