#include "server/registration.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "server/request_checks.h"

namespace rubato {

absl::Status ValidateRegisterRequest(const RegisterRequest& request, const ClusterSpec& cluster,
                                     int shard_id,
                                     absl::flat_hash_map<std::string, int>* model_index) {
  const int id = request.worker_id();
  if (id < 0 || id >= cluster.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id ", id, " is not in [0, num_workers=", cluster.num_workers(), ")"));
  }
  if (request.num_workers() != cluster.num_workers() ||
      FormatConsistency(request.consistency()) != FormatConsistency(cluster.consistency())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job mismatch: shard ", shard_id, " runs ", cluster.num_workers(), " workers in mode ",
        FormatConsistency(cluster.consistency()), ", but worker ", id, " was started with ",
        request.num_workers(), " workers in mode ", FormatConsistency(request.consistency())));
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
  for (int i = 0; i < request.model_size(); ++i) {
    const TensorSpec& spec = request.model(i);
    RETURN_IF_ERROR(CheckTensorName(spec.name()));
    if (absl::StatusOr<int64_t> n = CheckedElementCount(spec.shape()); !n.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", id, ": tensor '", spec.name(), "': ", n.status().message()));
    }
    if (!model_index->emplace(spec.name(), i).second) {
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
  return absl::OkStatus();
}

absl::Status CheckModelMatches(const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                               const absl::flat_hash_map<std::string, int>& index,
                               const RegisterRequest& request,
                               const absl::flat_hash_map<std::string, int>& model_index,
                               int shard_id) {
  const int id = request.worker_id();
  for (const auto& t : tensors) {
    auto it = model_index.find(t->name());
    if (it == model_index.end()) {
      return absl::FailedPreconditionError(absl::StrCat("model mismatch on shard ", shard_id,
                                                        ": worker ", id, " has no tensor '",
                                                        t->name(), "' ", ShapeString(t->shape())));
    }
    const TensorSpec& theirs = request.model(it->second);
    if (!std::equal(t->shape().begin(), t->shape().end(), theirs.shape().begin(),
                    theirs.shape().end())) {
      return absl::FailedPreconditionError(
          absl::StrCat("model mismatch on shard ", shard_id, ": tensor '", t->name(), "' is ",
                       ShapeString(t->shape()), " on the server but ", ShapeString(theirs.shape()),
                       " on worker ", id));
    }
  }
  if (request.model_size() != static_cast<int>(tensors.size())) {
    for (const TensorSpec& spec : request.model()) {
      if (!index.contains(spec.name())) {
        return absl::FailedPreconditionError(
            absl::StrCat("model mismatch on shard ", shard_id, ": worker ", id, " has tensor '",
                         spec.name(), "' which the server does not"));
      }
    }
  }
  return absl::OkStatus();
}

bool InitialValuesElection::Ask(int worker, absl::Time now) {
  if (asked_ >= 0 && asked_ != worker && now - asked_at_ <= grant_) return false;
  asked_ = worker;
  asked_at_ = now;
  return true;
}

absl::Status ValidateRollbackRequest(const RollbackRequest& request, const ClusterSpec& cluster,
                                     const ConsistencyPolicy& policy) {
  if (request.worker_id() < 0 || request.worker_id() >= cluster.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("Rollback from worker ", request.worker_id(),
                                                   ", not in [0, ", cluster.num_workers(), ")"));
  }
  RETURN_IF_ERROR(CheckStep("step", request.step()));
  if (request.recovery_id() == 0) {
    return absl::InvalidArgumentError("Rollback with recovery id 0 (the id of a fresh start)");
  }
  if (!policy.RollsBack()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Rollback under ", FormatConsistency(cluster.consistency()),
        ": only bsp and backup shards roll back (a restored async or ssp shard goes on)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LearningRateScheduler> ScheduleFor(const Membership& members,
                                                  const ClusterSpec& cluster,
                                                  const ConsistencyPolicy& policy) {
  ScheduleContext context;
  context.global_batch = policy.UpdateBatch(members);
  context.steps_per_epoch = members.worker(0).steps_per_epoch;
  context.total_steps = members.worker(0).total_steps;
  absl::StatusOr<LearningRateScheduler> schedule = LearningRateScheduler::Create(
      cluster.optimizer().learning_rate(), cluster.lr_schedule(), context);
  if (!schedule.ok()) {
    return absl::Status(schedule.status().code(),
                        absl::StrCat("cannot start training: ", schedule.status().message()));
  }
  return schedule;
}

}  // namespace rubato
