#include "server/parameter_shard.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::Status CheckTensorName(absl::string_view name) {
  if (name.empty() || name.size() > static_cast<size_t>(kMaxTensorNameBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("a tensor name must be 1 to ",
                                                   kMaxTensorNameBytes, " bytes, got ",
                                                   name.size()));
  }
  return absl::OkStatus();
}

}  // namespace

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
  if (options.cluster.consistency().mode() == ALLREDUCE) {
    return absl::InvalidArgumentError("mode allreduce runs without parameter servers");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   Optimizer::Create(options.cluster.optimizer()));
  return std::unique_ptr<ParameterShard>(new ParameterShard(options, std::move(optimizer)));
}

ParameterShard::ParameterShard(const ShardOptions& options, std::unique_ptr<Optimizer> optimizer)
    : options_(options),
      optimizer_(std::move(optimizer)),
      max_wait_(absl::Milliseconds(options.cluster.wait_timeout_ms())),
      workers_(options.cluster.num_workers()) {
  if (options.update_threads > 1) pool_ = std::make_unique<ThreadPool>(options.update_threads);
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

ParameterShard::~ParameterShard() {
  Shutdown();
  deadline_thread_.join();
}

void ParameterShard::Shutdown() {
  std::vector<Completion> failed;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    for (PendingPull& p : waiting_) {
      failed.push_back({std::move(p.done),
                        absl::UnavailableError(absl::StrCat(
                            "parameter server shard ", options_.shard_id, " is shutting down")),
                        PullResponse()});
    }
    waiting_.clear();
    waiting_changed_.SignalAll();
  }
  Run(&failed);
}

void ParameterShard::Run(std::vector<Completion>* completions) {
  for (Completion& c : *completions) c.done(std::move(c.status), std::move(c.response));
  completions->clear();
}

int ParameterShard::RegisteredCount() const {
  int n = 0;
  for (const Worker& w : workers_) n += w.registered ? 1 : 0;
  return n;
}

absl::Status ParameterShard::CheckMember(int id) const {
  if (id >= 0 && id < options_.cluster.num_workers()) {
    if (workers_[id].registered) return absl::OkStatus();
    if (workers_[id].dropped) {
      return absl::AbortedError(absl::StrCat(
          "worker ", id, " was dropped by shard ", options_.shard_id, " after more than ",
          options_.cluster.lease_ms(), " ms of silence; register again to rejoin"));
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat("worker ", id, " is not registered with shard ", options_.shard_id));
}

int64_t ParameterShard::MinVersion() const {
  int64_t v = tensors_.empty() ? 0 : tensors_[0].version;
  for (const Tensor& t : tensors_) v = std::min(v, t.version);
  return v;
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
                                                   kMaxBatchSize, "], got ",
                                                   request.batch_size()));
  }
  // Validate the request on its own before looking at the shard's state.
  absl::flat_hash_map<std::string, int> model_index;
  for (int i = 0; i < request.model_size(); ++i) {
    const TensorSpec& spec = request.model(i);
    RETURN_IF_ERROR(CheckTensorName(spec.name()));
    if (absl::StatusOr<int64_t> n = CheckedElementCount(spec.shape()); !n.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", id, ": tensor '", spec.name(),
                                                     "': ", n.status().message()));
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

  std::vector<Completion> ready;
  RegisterResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError("parameter server is shutting down");
    for (int other = 0; other < options_.cluster.num_workers(); ++other) {
      const Worker& w = workers_[other];
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
        return absl::FailedPreconditionError(absl::StrCat("shard ", options_.shard_id,
                                                          " has no weights yet and worker ", id,
                                                          " sent no initial values"));
      }
      tensors_.resize(request.model_size());
      for (int i = 0; i < request.model_size(); ++i) {
        Tensor& t = tensors_[i];
        t.name = request.model(i).name();
        t.shape.assign(request.model(i).shape().begin(), request.model(i).shape().end());
        t.weights.resize(ElementCount(t.shape));
        BytesToFloats(request.initial_values(i).data(), absl::MakeSpan(t.weights));
        t.role = optimizer_->RoleOf(t.name, t.shape);
        t.pending.assign(options_.cluster.num_workers(), {});
        t.received.assign(options_.cluster.num_workers(), false);
        t.last_pushed.assign(options_.cluster.num_workers(), -1);
        t.pulled_version.assign(options_.cluster.num_workers(), 0);
        index_[t.name] = i;
      }
      initialised_ = true;
    } else {
      // The model must match the adopted one exactly.
      for (const Tensor& t : tensors_) {
        auto it = model_index.find(t.name);
        if (it == model_index.end()) {
          return absl::FailedPreconditionError(
              absl::StrCat("model mismatch on shard ", options_.shard_id, ": worker ", id,
                           " has no tensor '", t.name, "' ", ShapeString(t.shape)));
        }
        const TensorSpec& theirs = request.model(it->second);
        if (!std::equal(t.shape.begin(), t.shape.end(), theirs.shape().begin(),
                        theirs.shape().end())) {
          return absl::FailedPreconditionError(
              absl::StrCat("model mismatch on shard ", options_.shard_id, ": tensor '", t.name,
                           "' is ", ShapeString(t.shape), " on the server but ",
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
    Worker& w = workers_[id];
    const Worker before = w;
    w.registered = true;
    w.finished = false;
    w.batch_size = request.batch_size();
    w.steps_per_epoch = request.steps_per_epoch();
    w.total_steps = request.total_steps();
    w.last_step = request.resume_step() - 1;
    w.last_seen = absl::Now();
    if (absl::Status s = StartTrainingIfComplete(); !s.ok()) {
      w = before;
      return s;
    }

    CollectReady(&ready);       // The last registrant may release the step-0 pulls.
    waiting_changed_.Signal();  // Leases may start (or restart) running.
    response.set_shard_id(options_.shard_id);
    response.set_num_shards(options_.num_shards);
    *response.mutable_consistency() = options_.cluster.consistency();
    response.set_num_workers(options_.cluster.num_workers());
    response.set_min_version(MinVersion());
    response.set_lease_ms(options_.cluster.lease_ms());
    // Where this worker goes on: the job's step under bsp and backup; its own clock under async
    // and ssp, whose versions count every worker's updates (a rejoined worker that took the version
    // would skip steps it never computed and, under ssp, wait on a clock no one will reach).
    const ConsistencyMode mode = options_.cluster.consistency().mode();
    response.set_resume_step(mode == BSP || mode == BACKUP ? MinVersion() : Clock(id));
  }
  Run(&ready);
  return response;
}

absl::Status ParameterShard::StartTrainingIfComplete() {
  if (schedule_.has_value() || RegisteredCount() < options_.cluster.num_workers()) {
    return absl::OkStatus();
  }
  ScheduleContext context;
  for (const Worker& w : workers_) context.global_batch += w.batch_size;
  context.steps_per_epoch = workers_[0].steps_per_epoch;
  context.total_steps = workers_[0].total_steps;
  absl::StatusOr<LearningRateScheduler> schedule = LearningRateScheduler::Create(
      options_.cluster.optimizer().learning_rate(), options_.cluster.lr_schedule(), context);
  if (!schedule.ok()) {
    return absl::Status(schedule.status().code(),
                        absl::StrCat("cannot start training: ", schedule.status().message()));
  }
  schedule_ = std::move(*schedule);
  RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": all " << options_.cluster.num_workers()
                   << " workers registered; optimizer " << optimizer_->config().type()
                   << "; learning-rate schedule:\n"
                   << schedule_->Describe();
  return absl::OkStatus();
}

absl::StatusOr<PushResponse> ParameterShard::Push(const PushRequest& request) {
  std::vector<Completion> ready;
  PushResponse response;
  {
    absl::MutexLock lock(&mu_);
    // Runs at once, under the lock (which the annotation tells the thread-safety analysis).
    absl::Status status = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
      const int id = request.worker_id();
      RETURN_IF_ERROR(CheckMember(id));
      if (!schedule_.has_value()) {
        return absl::FailedPreconditionError(
            absl::StrCat("training has not started: ", RegisteredCount(), " of ",
                         options_.cluster.num_workers(), " workers registered"));
      }
      RETURN_IF_ERROR(CheckStep("step", request.step()));
      if (request.gradients_size() > static_cast<int>(tensors_.size())) {
        return absl::InvalidArgumentError(absl::StrCat("a push of ", request.gradients_size(),
                                                       " gradients to a shard of ",
                                                       tensors_.size(), " tensors"));
      }
      const ConsistencyMode mode = options_.cluster.consistency().mode();
      // A gradient is computed on pulled weights: under async and ssp a push for a step this
      // worker has not pulled is from the future (under bsp and backup the versions say so).
      if ((mode == ASYNC || mode == SSP) && request.step() > workers_[id].pulled_step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "step ", request.step(), " from worker ", id, " is from the future: it has pulled ",
            workers_[id].pulled_step < 0 ? std::string("nothing")
                                         : absl::StrCat("up to step ", workers_[id].pulled_step),
            " from shard ", options_.shard_id));
      }
      absl::flat_hash_set<absl::string_view> seen;
      for (const TensorValue& g : request.gradients()) {
        RETURN_IF_ERROR(CheckTensorName(g.name()));  // Before it is echoed in an error.
        auto it = index_.find(g.name());
        if (it == index_.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "unknown tensor '", g.name(), "' (not on shard ", options_.shard_id, ")"));
        }
        if (!seen.insert(g.name()).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor '", g.name(), "' appears twice in one push"));
        }
        const Tensor& t = tensors_[it->second];
        RETURN_IF_ERROR(CheckFloatBytes(absl::StrCat("gradient '", g.name(), "'"), g.data(),
                                        static_cast<int64_t>(t.weights.size())));
        if ((mode == BSP || mode == BACKUP) && request.step() > t.version) {
          return absl::FailedPreconditionError(
              absl::StrCat("step ", request.step(), " from worker ", id,
                           " is from the future: tensor '", t.name, "' is at version ", t.version));
        }
      }
      return absl::OkStatus();
    }();
    if (!status.ok()) {
      ++rejected_pushes_;
      return status;
    }
    // Everything checked: apply.
    const int id = request.worker_id();
    Worker& worker = workers_[id];
    worker.last_seen = absl::Now();
    worker.last_step = std::max(worker.last_step, request.step());
    const ConsistencyMode mode = options_.cluster.consistency().mode();
    bool any_applied = false;
    for (const TensorValue& g : request.gradients()) {
      Tensor& t = tensors_[index_.at(g.name())];
      if (request.step() <= t.last_pushed[id]) {  // (worker, step, tensor) seen before.
        response.set_duplicates(response.duplicates() + 1);
        ++duplicate_gradients_;
        continue;
      }
      t.last_pushed[id] = request.step();
      if (mode == BSP || mode == BACKUP) {
        if (request.step() < t.version) {  // backup: its step was applied without it.
          response.set_dropped(response.dropped() + 1);
          ++dropped_gradients_;
          continue;
        }
        t.pending[id].resize(t.weights.size());
        BytesToFloats(g.data(), absl::MakeSpan(t.pending[id]));
        t.received[id] = true;
        ++t.received_count;
        RecordStaleness(0);
      } else {
        // async, ssp: applied now, alone.
        const int64_t tau = std::max<int64_t>(0, t.version - t.pulled_version[id]);
        RecordStaleness(tau);
        response.set_max_staleness(std::max(response.max_staleness(), tau));
        t.pending[id].resize(t.weights.size());
        BytesToFloats(g.data(), absl::MakeSpan(t.pending[id]));
        t.received[id] = true;
        t.received_count = 1;
        const int members = std::max(1, RegisteredCount());
        double lr = schedule_->At(t.version / members);
        if (options_.cluster.consistency().staleness_aware_lr() && tau > 1) lr /= tau;
        ApplyUpdate(&t, lr);
      }
      response.set_accepted(response.accepted() + 1);
      any_applied = true;
    }
    ++pushes_;
    if (any_applied) {
      ApplyCompleteSteps();
      CollectReady(&ready);
    }
  }
  Run(&ready);
  return response;
}

bool ParameterShard::StepComplete(const Tensor& t) const {
  if (t.received_count == 0) return false;
  bool all = true;
  for (int w = 0; w < options_.cluster.num_workers() && all; ++w) {
    all = !workers_[w].registered || t.received[w];
  }
  if (all) return true;
  if (options_.cluster.consistency().mode() == BACKUP) {
    const int needed = RegisteredCount() - options_.cluster.consistency().backup_workers();
    return t.received_count >= std::max(1, needed);
  }
  return false;
}

void ParameterShard::ApplyCompleteSteps() {
  const ConsistencyMode mode = options_.cluster.consistency().mode();
  if (mode != BSP && mode != BACKUP) return;  // async and ssp apply on arrival.
  for (Tensor& t : tensors_) {
    if (StepComplete(t)) ApplyUpdate(&t, schedule_->At(t.version));
  }
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

int64_t ParameterShard::Clock(int w) const {
  int64_t clock = tensors_.empty() ? 0 : tensors_[0].last_pushed[w] + 1;
  for (const Tensor& t : tensors_) clock = std::min(clock, t.last_pushed[w] + 1);
  return clock;
}

void ParameterShard::RecordPulled(const PullRequest& request) {
  const int id = request.worker_id();
  workers_[id].pulled_step = std::max(workers_[id].pulled_step, request.step());
  if (request.names().empty()) {
    for (Tensor& t : tensors_) t.pulled_version[id] = t.version;
  } else {
    for (const std::string& name : request.names()) {
      Tensor& t = tensors_[index_.at(name)];
      t.pulled_version[id] = t.version;
    }
  }
}

void ParameterShard::ApplyUpdate(Tensor* t, double learning_rate) {
  const size_t n = t->weights.size();
  const int workers = options_.cluster.num_workers();
  // The mean over the gradients received for this step (all members', plus any from a worker
  // dropped since), summed in double in worker-id order, into the first contributor's buffer.
  std::vector<int> from;
  for (int w = 0; w < workers; ++w) {
    if (t->received[w]) from.push_back(w);
  }
  std::vector<float>& mean = t->pending[from[0]];
  // A single contributor (async, ssp, or one member left) is its own mean: skip the pass.
  if (from.size() > 1) {
    const double inv = 1.0 / static_cast<double>(from.size());
    for (size_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int w : from) sum += t->pending[w][i];
      mean[i] = static_cast<float>(sum * inv);
    }
  }
  last_learning_rate_ = learning_rate;
  optimizer_->Update(static_cast<float>(last_learning_rate_), mean, absl::MakeSpan(t->weights),
                     t->role, &t->optimizer_state, pool_.get());
  ++t->version;
  ++applied_updates_;
  std::fill(t->received.begin(), t->received.end(), false);
  t->received_count = 0;
}

absl::Status ParameterShard::CheckPull(const PullRequest& request) const {
  const int id = request.worker_id();
  if (shutdown_) {
    return absl::UnavailableError(
        absl::StrCat("parameter server shard ", options_.shard_id, " is shutting down"));
  }
  RETURN_IF_ERROR(CheckMember(id));
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  if (request.names_size() > static_cast<int>(tensors_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("a pull of ", request.names_size(),
                                                   " tensors from a shard of ", tensors_.size()));
  }
  // Each name once: a name repeated n times would make the response n tensors large.
  absl::flat_hash_set<absl::string_view> seen;
  for (const std::string& name : request.names()) {
    RETURN_IF_ERROR(CheckTensorName(name));  // Before it is echoed in an error.
    if (!index_.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor '", name, "' (not on shard ", options_.shard_id, ")"));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' appears twice in one pull"));
    }
  }
  return absl::OkStatus();
}

bool ParameterShard::PullReady(const PullRequest& request) const {
  if (!schedule_.has_value()) return false;  // Training has not started.
  const ConsistencyConfig& c = options_.cluster.consistency();
  if (c.mode() == ASYNC) return true;
  if (c.mode() == SSP) {
    // The SSP bound, enforced here: step c may start once every member has pushed step c - s - 1.
    const int64_t need = request.step() - c.staleness();
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (workers_[w].registered && Clock(w) < need) return false;
    }
    return true;
  }
  if (request.names().empty()) return MinVersion() >= request.step();
  for (const std::string& name : request.names()) {
    if (tensors_[index_.at(name)].version < request.step()) return false;
  }
  return true;
}

PullResponse ParameterShard::Snapshot(const PullRequest& request) const {
  PullResponse response;
  auto add = [&response](const Tensor& t) {
    TensorValue* v = response.add_tensors();
    v->set_name(t.name);
    v->set_version(t.version);
    FloatsToBytes(t.weights, v->mutable_data());
  };
  if (request.names().empty()) {
    for (const Tensor& t : tensors_) add(t);
  } else {
    for (const std::string& name : request.names()) add(tensors_[index_.at(name)]);
  }
  return response;
}

std::string ParameterShard::DescribeWait(const PullRequest& request) const {
  const int registered = RegisteredCount();
  if (!schedule_.has_value()) {
    std::vector<int> missing;
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (!workers_[w].registered) missing.push_back(w);
    }
    return absl::StrCat("waiting for worker(s) ", absl::StrJoin(missing, ", "), " to register (",
                        registered, " of ", options_.cluster.num_workers(), " registered)");
  }
  if (options_.cluster.consistency().mode() == SSP) {
    const int64_t need = request.step() - options_.cluster.consistency().staleness();
    std::vector<std::string> behind;
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (workers_[w].registered && Clock(w) < need) {
        behind.push_back(absl::StrCat(w, " (clock ", Clock(w), ")"));
      }
    }
    return absl::StrCat("ssp: step ", request.step(), " needs every worker at clock >= ", need,
                        "; waiting for worker(s) ", absl::StrJoin(behind, ", "));
  }
  // The first tensor that is behind, and whose gradients it lacks.
  for (const Tensor& t : tensors_) {
    if (t.version >= request.step()) continue;
    if (!request.names().empty() && std::find(request.names().begin(), request.names().end(),
                                              t.name) == request.names().end()) {
      continue;
    }
    std::vector<int> missing;
    for (int w = 0; w < options_.cluster.num_workers(); ++w) {
      if (workers_[w].registered && !t.received[w]) missing.push_back(w);
    }
    return absl::StrCat("tensor '", t.name, "' is at version ", t.version, "; waiting for step ",
                        t.version, " gradients from worker(s) ", absl::StrJoin(missing, ", "));
  }
  return "nothing (ready)";
}

void ParameterShard::CollectReady(std::vector<Completion>* out) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (PullReady(it->request)) {
      RecordPulled(it->request);
      out->push_back({std::move(it->done), absl::OkStatus(), Snapshot(it->request)});
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

void ParameterShard::Pull(const PullRequest& request, absl::Time deadline, PullDone done) {
  absl::Status status;
  PullResponse response;
  std::vector<Completion> superseded;
  bool parked = false;
  {
    absl::MutexLock lock(&mu_);
    status = CheckPull(request);
    if (status.ok()) {
      workers_[request.worker_id()].last_seen = absl::Now();
      if (PullReady(request)) {
        RecordPulled(request);
        response = Snapshot(request);
      } else {
        SupersedePulls(request, &superseded);
        waiting_.push_back({request, std::min(deadline, absl::Now() + max_wait_), std::move(done)});
        waiting_changed_.Signal();
        parked = true;
      }
    }
  }
  Run(&superseded);
  if (!parked) done(std::move(status), std::move(response));
}

void ParameterShard::SupersedePulls(const PullRequest& request, std::vector<Completion>* out) {
  auto overlaps = [&request](const PullRequest& other) {
    if (request.names().empty() || other.names().empty()) return true;
    for (const std::string& a : request.names()) {
      for (const std::string& b : other.names()) {
        if (a == b) return true;
      }
    }
    return false;
  };
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->request.worker_id() == request.worker_id() && overlaps(it->request)) {
      out->push_back({std::move(it->done),
                      absl::AbortedError(absl::StrCat(
                          "pull for step ", it->request.step(), " by worker ",
                          request.worker_id(), " superseded by its pull for step ", request.step())),
                      PullResponse()});
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

void ParameterShard::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    // Leases first, then pull deadlines; sleep until the earliest of what is left, or a change.
    std::vector<Completion> expired;
    absl::Time next = ExpireLeases(&expired);
    const absl::Time now = absl::Now();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->deadline <= now) {
        expired.push_back(
            {std::move(it->done),
             absl::DeadlineExceededError(absl::StrCat(
                 "pull for step ", it->request.step(), " by worker ", it->request.worker_id(),
                 " timed out on shard ", options_.shard_id, ": ", DescribeWait(it->request))),
             PullResponse()});
        it = waiting_.erase(it);
      } else {
        next = std::min(next, it->deadline);
        ++it;
      }
    }
    if (!expired.empty()) {
      mu_.Unlock();
      Run(&expired);
      mu_.Lock();
      continue;
    }
    waiting_changed_.WaitWithDeadline(&mu_, next);
  }
}

absl::Time ParameterShard::ExpireLeases(std::vector<Completion>* ready) {
  // Leases run only once training has started: before that, pulls wait for registration with
  // their own deadline.
  if (!schedule_.has_value()) return absl::InfiniteFuture();
  const absl::Duration lease = absl::Milliseconds(options_.cluster.lease_ms());
  const absl::Time now = absl::Now();
  absl::Time next = absl::InfiniteFuture();
  bool dropped = false;
  for (int id = 0; id < options_.cluster.num_workers(); ++id) {
    Worker& w = workers_[id];
    if (!w.registered || w.finished) continue;  // A finished worker no longer heartbeats.
    if (now - w.last_seen > lease) {
      w.registered = false;
      w.dropped = true;
      dropped = true;
      ++dropped_workers_;
      RUBATO_LOG(WARNING) << "shard " << options_.shard_id << ": dropped worker " << id
                          << ", silent for " << absl::FormatDuration(now - w.last_seen)
                          << " (lease " << absl::FormatDuration(lease) << "); " << RegisteredCount()
                          << " member(s) left";
    } else {
      next = std::min(next, w.last_seen + lease + absl::Milliseconds(1));
    }
  }
  if (dropped) {
    ApplyCompleteSteps();
    CollectReady(ready);
  }
  return next;
}

absl::StatusOr<HeartbeatResponse> ParameterShard::Heartbeat(const HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  const int id = request.worker_id();
  RETURN_IF_ERROR(CheckMember(id));
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  workers_[id].last_seen = absl::Now();
  workers_[id].last_step = std::max(workers_[id].last_step, request.step());
  HeartbeatResponse response;
  response.set_min_version(MinVersion());
  return response;
}

absl::StatusOr<FinishResponse> ParameterShard::Finish(const FinishRequest& request) {
  absl::MutexLock lock(&mu_);
  const int id = request.worker_id();
  if (id < 0 || id >= options_.cluster.num_workers() ||
      !(workers_[id].registered || workers_[id].dropped)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", id, " is not registered with shard ", options_.shard_id));
  }
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  Worker& w = workers_[id];
  if (!w.finished) {
    RUBATO_LOG(INFO) << "shard " << options_.shard_id << ": worker " << id << " finished after "
                     << request.step() << " steps";
  }
  w.finished = true;
  w.last_step = std::max(w.last_step, request.step() - 1);
  w.last_seen = absl::Now();
  FinishResponse response;
  for (const Worker& other : workers_) response.set_finished_workers(
      response.finished_workers() + (other.finished ? 1 : 0));
  return response;
}

absl::StatusOr<bool> ParameterShard::JobFinished(absl::Duration idle_timeout) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const absl::Duration lease = absl::Milliseconds(options_.cluster.lease_ms());
  int finished = 0;
  int live = 0;
  for (const Worker& w : workers_) {
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
    (workers_[id].registered || workers_[id].dropped ? gone : never).push_back(id);
  }
  std::string who;
  if (!never.empty()) absl::StrAppend(&who, "never registered: ", absl::StrJoin(never, ","));
  if (!gone.empty()) {
    absl::StrAppend(&who, who.empty() ? "" : "; ", "registered, then silent: ",
                    absl::StrJoin(gone, ","));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("shard ", options_.shard_id, ": no worker has been live for ",
                   absl::FormatDuration(now - last_live_), " and none has finished (", who,
                   ")"));
}

GetStatsResponse ParameterShard::Stats() const {
  absl::MutexLock lock(&mu_);
  GetStatsResponse s;
  s.set_shard_id(options_.shard_id);
  *s.mutable_consistency() = options_.cluster.consistency();
  s.set_num_workers(options_.cluster.num_workers());
  s.set_min_version(MinVersion());
  int64_t bytes = 0;
  for (const Tensor& t : tensors_) {
    bytes += static_cast<int64_t>(t.weights.size() * sizeof(float));
    TensorStats* ts = s.add_tensors();
    ts->set_name(t.name);
    ts->set_elements(static_cast<int64_t>(t.weights.size()));
    ts->set_version(t.version);
  }
  s.set_bytes(bytes);
  s.set_pushes(pushes_);
  s.set_rejected_pushes(rejected_pushes_);
  s.set_duplicate_gradients(duplicate_gradients_);
  s.set_applied_updates(applied_updates_);
  s.set_dropped_workers(dropped_workers_);
  s.set_dropped_gradients(dropped_gradients_);
  for (const Worker& w : workers_) s.set_finished_workers(s.finished_workers() + (w.finished ? 1 : 0));
  for (int64_t n : staleness_histogram_) s.add_staleness_histogram(n);
  s.set_learning_rate(last_learning_rate_);
  if (schedule_.has_value()) s.set_lr_schedule(schedule_->Describe());
  s.set_pending_pulls(static_cast<int64_t>(waiting_.size()));
  const absl::Time now = absl::Now();
  for (int id = 0; id < static_cast<int>(workers_.size()); ++id) {
    const Worker& w = workers_[id];
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
