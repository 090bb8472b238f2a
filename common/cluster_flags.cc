#include "common/cluster_flags.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cluster_spec.h"
#include "common/limits.h"
#include "common/status_macros.h"

// Optional flags: a flag that is not given leaves the spec file's value (or the default) in place.
ABSL_FLAG(std::string, cluster_spec, "", "Text-format rubato.ClusterSpec file (optional).");
ABSL_FLAG(std::optional<std::string>, servers, std::nullopt,
          "Comma-separated host:port of each server shard; shard id = position.");
ABSL_FLAG(std::optional<std::string>, peers, std::nullopt,
          "allreduce: comma-separated host:port of every worker; rank = position.");
ABSL_FLAG(std::optional<int>, num_workers, std::nullopt, "Number of workers in the job.");
ABSL_FLAG(std::optional<std::string>, mode, std::nullopt,
          "Consistency model: bsp (default), async, backup:B, ssp:S, adaptive[:K] (bsp, "
          "backup:b or ssp:s in steps, chosen every K steps, default 20, from the workers' "
          "compute times); or, with no servers, "
          "allreduce (the synchronous ring), allreduce:majority or allreduce:solo (a ring round "
          "goes on once half of the workers, or one, have a gradient ready; eager-SGD).");
ABSL_FLAG(std::optional<bool>, staleness_aware_lr, std::nullopt,
          "async, ssp: divide each gradient's learning rate by its staleness (Zhang et al. 2016).");
ABSL_FLAG(std::optional<std::string>, optimizer, std::nullopt,
          "Server-side optimizer: sgd (default), adam, adamw, lars, larc, lamb "
          "(common/optimizer.h).");
ABSL_FLAG(std::optional<double>, learning_rate, std::nullopt, "Learning rate (default 0.1).");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "Weight decay (default 0): L2 for sgd, adam, lars, larc; decoupled for adamw, lamb.");
ABSL_FLAG(std::optional<double>, momentum, std::nullopt,
          "sgd (default 0), lars, larc (default 0.9).");
ABSL_FLAG(std::optional<bool>, nesterov, std::nullopt, "sgd: Nesterov momentum.");
ABSL_FLAG(std::optional<double>, beta1, std::nullopt, "adam, adamw, lamb (default 0.9).");
ABSL_FLAG(std::optional<double>, beta2, std::nullopt, "adam, adamw, lamb (default 0.999).");
ABSL_FLAG(std::optional<double>, epsilon, std::nullopt,
          "adam, adamw, larc (default 1e-8); lamb (default 1e-6); lars (default 0).");
ABSL_FLAG(std::optional<double>, trust_coefficient, std::nullopt,
          "lars: eta (default 0.001); larc: eta (default 0.02).");
ABSL_FLAG(std::optional<std::string>, exclude_from_weight_decay, std::nullopt,
          "Comma-separated regular expressions of tensor names without weight decay "
          "(default: every tensor of rank <= 1).");
ABSL_FLAG(
    std::optional<std::string>, exclude_from_layer_adaptation, std::nullopt,
    "lars, larc, lamb: comma-separated regular expressions of tensor names with trust ratio 1 "
    "(default: every tensor of rank <= 1).");
ABSL_FLAG(std::optional<double>, clip_global_norm, std::nullopt,
          "> 0: each worker clips its gradient to this global L2 norm before pushing.");
ABSL_FLAG(std::optional<int64_t>, lr_reference_batch, std::nullopt,
          "Batch at which --learning_rate is tuned (default: the job's update batch; no scaling).");
ABSL_FLAG(std::optional<std::string>, lr_scaling, std::nullopt,
          "none (default), linear or sqrt: scale the LR by one update's batch over the reference: "
          "the global batch in bsp and allreduce, members - b workers' in backup:b, one "
          "worker's in async and ssp.");
ABSL_FLAG(std::optional<int64_t>, warmup_steps, std::nullopt, "Linear warmup, in updates.");
ABSL_FLAG(std::optional<double>, warmup_epochs, std::nullopt, "Linear warmup, in epochs.");
ABSL_FLAG(std::optional<std::string>, lr_decay, std::nullopt,
          "constant (default), step, cosine or polynomial.");
ABSL_FLAG(std::optional<int64_t>, lr_decay_steps, std::nullopt,
          "step: period; cosine, polynomial: horizon in updates (default: the whole job).");
ABSL_FLAG(std::optional<double>, lr_decay_factor, std::nullopt, "step decay factor (default 0.1).");
ABSL_FLAG(std::optional<double>, lr_power, std::nullopt, "polynomial decay power (default 1).");
ABSL_FLAG(std::optional<double>, final_lr_fraction, std::nullopt,
          "cosine, polynomial: final LR as a fraction of the peak (default 0).");
ABSL_FLAG(std::optional<std::string>, adaptive_batch, std::nullopt,
          "MIN:MAX (bsp): the servers move the global batch towards the measured gradient noise "
          "scale within [MIN, MAX], every --adaptive_batch_every steps (common/batch_plan.h). "
          "--batch_size is where it starts.");
ABSL_FLAG(std::optional<bool>, reassign, std::nullopt,
          "async: hand each epoch's data out in units through shard 0, so that workers done with "
          "their own share take units from the slowest's (server/work_queue.h).");
ABSL_FLAG(std::optional<int32_t>, reassign_unit_batches, std::nullopt,
          "With --reassign: batches per unit (default 4).");
ABSL_FLAG(std::optional<int64_t>, adaptive_batch_every, std::nullopt,
          "With --adaptive_batch: steps between decisions (default 50, at least 2).");
ABSL_FLAG(std::optional<int64_t>, lease_ms, std::nullopt,
          "Worker lease in ms (default 10000): once training has started, a worker silent for "
          "longer is dropped from the barriers; workers heartbeat every lease/4.");
ABSL_FLAG(std::optional<int64_t>, max_message_mb, std::nullopt,
          "Largest gRPC message either end accepts, in MiB (default 64; ./rubato launch derives it "
          "from the model). A server holds a message whole before it can refuse it.");
ABSL_FLAG(std::optional<int64_t>, wait_timeout_ms, std::nullopt,
          "Longest a pull waits for the other workers before failing, in ms (default 120000).");

namespace rubato {

namespace {

// Replaces `field` with the non-empty items of the comma-separated `list`.
void SetFromCommaList(absl::string_view list,
                      google::protobuf::RepeatedPtrField<std::string>* field) {
  field->Clear();
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    field->Add(std::string(item));
  }
}

// --servers, --num_workers, --peers: who takes part.
void ApplyMembershipFlags(ClusterSpec* spec) {
  if (auto servers = absl::GetFlag(FLAGS_servers)) {
    SetFromCommaList(*servers, spec->mutable_servers());
  }
  if (auto v = absl::GetFlag(FLAGS_num_workers)) spec->set_num_workers(*v);
  if (auto peers = absl::GetFlag(FLAGS_peers)) SetFromCommaList(*peers, spec->mutable_workers());
}

// --mode, --staleness_aware_lr; InvalidArgument for a mode that does not parse.
absl::Status ApplyConsistencyFlags(ClusterSpec* spec) {
  if (auto v = absl::GetFlag(FLAGS_mode)) {
    ASSIGN_OR_RETURN(*spec->mutable_consistency(), ParseConsistency(*v));
  }
  if (auto v = absl::GetFlag(FLAGS_staleness_aware_lr)) {
    spec->mutable_consistency()->set_staleness_aware_lr(*v);
  }
  return absl::OkStatus();
}

// --optimizer and its hyperparameters, --clip_global_norm.
void ApplyOptimizerFlags(OptimizerConfig* opt) {
  if (auto v = absl::GetFlag(FLAGS_optimizer)) opt->set_type(*v);
  if (auto v = absl::GetFlag(FLAGS_learning_rate)) opt->set_learning_rate(*v);
  if (auto v = absl::GetFlag(FLAGS_weight_decay)) opt->set_weight_decay(*v);
  if (auto v = absl::GetFlag(FLAGS_momentum)) opt->set_momentum(*v);
  if (auto v = absl::GetFlag(FLAGS_nesterov)) opt->set_nesterov(*v);
  if (auto v = absl::GetFlag(FLAGS_beta1)) opt->set_beta1(*v);
  if (auto v = absl::GetFlag(FLAGS_beta2)) opt->set_beta2(*v);
  if (auto v = absl::GetFlag(FLAGS_epsilon)) opt->set_epsilon(*v);
  if (auto v = absl::GetFlag(FLAGS_trust_coefficient)) opt->set_trust_coefficient(*v);
  if (auto v = absl::GetFlag(FLAGS_exclude_from_weight_decay)) {
    SetFromCommaList(*v, opt->mutable_exclude_from_weight_decay());
  }
  if (auto v = absl::GetFlag(FLAGS_exclude_from_layer_adaptation)) {
    SetFromCommaList(*v, opt->mutable_exclude_from_layer_adaptation());
  }
  if (auto v = absl::GetFlag(FLAGS_clip_global_norm)) opt->set_clip_global_norm(*v);
}

// The learning-rate schedule's flags (--lr_*, --warmup_*, --final_lr_fraction).
void ApplyLrScheduleFlags(LearningRateSchedule* lr) {
  if (auto v = absl::GetFlag(FLAGS_lr_reference_batch)) lr->set_reference_batch(*v);
  if (auto v = absl::GetFlag(FLAGS_lr_scaling)) lr->set_scaling(*v);
  if (auto v = absl::GetFlag(FLAGS_warmup_steps)) lr->set_warmup_steps(*v);
  if (auto v = absl::GetFlag(FLAGS_warmup_epochs)) lr->set_warmup_epochs(*v);
  if (auto v = absl::GetFlag(FLAGS_lr_decay)) lr->set_decay(*v);
  if (auto v = absl::GetFlag(FLAGS_lr_decay_steps)) lr->set_decay_steps(*v);
  if (auto v = absl::GetFlag(FLAGS_lr_decay_factor)) lr->set_decay_factor(*v);
  if (auto v = absl::GetFlag(FLAGS_lr_power)) lr->set_power(*v);
  if (auto v = absl::GetFlag(FLAGS_final_lr_fraction)) lr->set_final_lr_fraction(*v);
}

// --adaptive_batch MIN:MAX, --adaptive_batch_every; InvalidArgument for bounds that do not parse.
absl::Status ApplyAdaptiveBatchFlags(ClusterSpec* spec) {
  if (auto v = absl::GetFlag(FLAGS_adaptive_batch)) {
    const std::vector<std::string> bounds = absl::StrSplit(*v, ':');
    int64_t lo = 0, hi = 0;
    if (bounds.size() != 2 || !absl::SimpleAtoi(bounds[0], &lo) ||
        !absl::SimpleAtoi(bounds[1], &hi) || lo < 1 || hi < lo) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--adaptive_batch: expected MIN:MAX global batches with 1 <= MIN <= MAX, got '", *v,
          "'"));
    }
    spec->mutable_adaptive_batch()->set_min_global_batch(lo);
    spec->mutable_adaptive_batch()->set_max_global_batch(hi);
  }
  if (auto v = absl::GetFlag(FLAGS_adaptive_batch_every)) {
    spec->mutable_adaptive_batch()->set_every_steps(*v);
  }
  return absl::OkStatus();
}

// --reassign, --reassign_unit_batches (which needs reassignment on).
absl::Status ApplyReassignFlags(ClusterSpec* spec) {
  const std::optional<bool> on = absl::GetFlag(FLAGS_reassign);
  const std::optional<int32_t> unit = absl::GetFlag(FLAGS_reassign_unit_batches);
  if (on.has_value()) spec->mutable_reassign()->set_unit_batches(*on ? unit.value_or(4) : 0);
  if (!unit.has_value()) return absl::OkStatus();
  if (spec->reassign().unit_batches() == 0) {
    return absl::InvalidArgumentError("--reassign_unit_batches needs --reassign");
  }
  spec->mutable_reassign()->set_unit_batches(*unit);
  return absl::OkStatus();
}

// --lease_ms, --wait_timeout_ms, --max_message_mb; InvalidArgument for a bad message limit.
absl::Status ApplyLimitFlags(ClusterSpec* spec) {
  if (auto v = absl::GetFlag(FLAGS_lease_ms)) spec->set_lease_ms(*v);
  if (auto v = absl::GetFlag(FLAGS_wait_timeout_ms)) spec->set_wait_timeout_ms(*v);
  if (auto v = absl::GetFlag(FLAGS_max_message_mb)) {
    if (*v < 1 || *v > (kMaxMessageBytesLimit >> 20)) {
      return absl::InvalidArgumentError(absl::StrCat("--max_message_mb must be in [1, ",
                                                     kMaxMessageBytesLimit >> 20, "], got ", *v));
    }
    spec->set_max_message_bytes(*v << 20);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ClusterSpec> ClusterSpecFromFlags(bool need_servers) {
  ClusterSpec spec;
  const std::string file = absl::GetFlag(FLAGS_cluster_spec);
  if (!file.empty()) {
    ASSIGN_OR_RETURN(spec, ReadClusterSpecFile(file));
  }
  // Defaults first, so that an explicit flag (even a bad one such as --learning_rate=0) is what
  // gets validated.
  FillClusterSpecDefaults(&spec);
  ApplyMembershipFlags(&spec);
  RETURN_IF_ERROR(ApplyConsistencyFlags(&spec));
  ApplyOptimizerFlags(spec.mutable_optimizer());
  ApplyLrScheduleFlags(spec.mutable_lr_schedule());
  RETURN_IF_ERROR(ApplyAdaptiveBatchFlags(&spec));
  RETURN_IF_ERROR(ApplyReassignFlags(&spec));
  RETURN_IF_ERROR(ApplyLimitFlags(&spec));
  RETURN_IF_ERROR(ValidateClusterSpec(spec, need_servers));
  return spec;
}

}  // namespace rubato
