#include "common/cluster_spec.h"

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/batch_plan.h"
#include "common/limits.h"
#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace rubato {
namespace {

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty())
      first_ = absl::StrCat("line ", line + 1, ", column ", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

}  // namespace

absl::StatusOr<ConsistencyConfig> ParseConsistency(absl::string_view text) {
  ConsistencyConfig c;
  if (text == "bsp") {
    c.set_mode(BSP);
    return c;
  }
  if (text == "async") {
    c.set_mode(ASYNC);
    return c;
  }
  if (text == "adaptive") {
    c.set_mode(ADAPTIVE);
    c.set_adaptive_every_steps(kDefaultAdaptiveEverySteps);
    return c;
  }
  if (text == "allreduce" || text == "allreduce:majority" || text == "allreduce:solo") {
    c.set_mode(ALLREDUCE);
    if (text == "allreduce:majority") c.set_allreduce_quorum(QUORUM_MAJORITY);
    if (text == "allreduce:solo") c.set_allreduce_quorum(QUORUM_SOLO);
    return c;
  }
  absl::string_view rest = text;
  int value = -1;
  if (absl::ConsumePrefix(&rest, "backup:") && absl::SimpleAtoi(rest, &value) && value >= 0) {
    c.set_mode(BACKUP);
    c.set_backup_workers(value);
    return c;
  }
  rest = text;
  if (absl::ConsumePrefix(&rest, "ssp:") && absl::SimpleAtoi(rest, &value) && value >= 0) {
    c.set_mode(SSP);
    c.set_staleness(value);
    return c;
  }
  rest = text;
  if (absl::ConsumePrefix(&rest, "adaptive:") && absl::SimpleAtoi(rest, &value) && value >= 1) {
    c.set_mode(ADAPTIVE);
    c.set_adaptive_every_steps(value);
    return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("mode: '", text,
                   "' is not one of bsp, async, backup:B, ssp:S (B, S integers >= 0), "
                   "adaptive, adaptive:K (K >= 1), allreduce, allreduce:majority, "
                   "allreduce:solo"));
}

std::string FormatConsistency(const ConsistencyConfig& config) {
  switch (config.mode()) {
    case BSP:
      return "bsp";
    case ASYNC:
      return "async";
    case ALLREDUCE:
      if (config.allreduce_quorum() == QUORUM_MAJORITY) return "allreduce:majority";
      if (config.allreduce_quorum() == QUORUM_SOLO) return "allreduce:solo";
      return "allreduce";
    case BACKUP:
      return absl::StrCat("backup:", config.backup_workers());
    case SSP:
      return absl::StrCat("ssp:", config.staleness());
    case ADAPTIVE:
      return config.adaptive_every_steps() == kDefaultAdaptiveEverySteps
                 ? "adaptive"
                 : absl::StrCat("adaptive:", config.adaptive_every_steps());
    default:
      return "unspecified";
  }
}

absl::StatusOr<ClusterSpec> ReadClusterSpecFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cluster spec file not found: ", path));
  std::stringstream text;
  text << in.rdbuf();
  ClusterSpec spec;
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text.str(), &spec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec ", path, " does not parse: ", errors.first()));
  }
  return spec;
}

int64_t MaxMessageBytes(const ClusterSpec& spec) {
  return spec.max_message_bytes() > 0 ? spec.max_message_bytes() : kDefaultMaxMessageBytes;
}

void FillClusterSpecDefaults(ClusterSpec* spec) {
  if (spec->consistency().mode() == CONSISTENCY_MODE_UNSPECIFIED) {
    spec->mutable_consistency()->set_mode(BSP);
  }
  if (spec->consistency().mode() == ADAPTIVE && spec->consistency().adaptive_every_steps() == 0) {
    spec->mutable_consistency()->set_adaptive_every_steps(kDefaultAdaptiveEverySteps);
  }
  OptimizerConfig* opt = spec->mutable_optimizer();
  if (opt->type().empty()) opt->set_type("sgd");
  if (opt->learning_rate() == 0) opt->set_learning_rate(kDefaultLearningRate);
  if (spec->lease_ms() == 0) spec->set_lease_ms(kDefaultLeaseMs);
  if (spec->wait_timeout_ms() == 0) spec->set_wait_timeout_ms(kDefaultWaitTimeoutMs);
  if (spec->max_message_bytes() == 0) spec->set_max_message_bytes(kDefaultMaxMessageBytes);
}

absl::Status ValidateHostPort(absl::string_view address, absl::string_view field) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", address, "' is not host:port with a port in 0..65535"));
  }
  return absl::OkStatus();
}

namespace {

// The addresses: allreduce's one per worker, and the servers' (needed unless allreduce).
absl::Status ValidateAddresses(const ClusterSpec& spec, bool need_servers) {
  if (spec.consistency().mode() == ALLREDUCE) {
    need_servers = false;
    if (spec.workers_size() != spec.num_workers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("workers: allreduce needs one address per worker (", spec.num_workers(),
                       "), got ", spec.workers_size()));
    }
    for (int i = 0; i < spec.workers_size(); ++i) {
      RETURN_IF_ERROR(ValidateHostPort(spec.workers(i), absl::StrCat("workers[", i, "]")));
    }
  }
  if (need_servers && spec.servers().empty()) {
    return absl::InvalidArgumentError("servers: at least one server address is needed");
  }
  for (int i = 0; i < spec.servers_size(); ++i) {
    RETURN_IF_ERROR(ValidateHostPort(spec.servers(i), absl::StrCat("servers[", i, "]")));
  }
  return absl::OkStatus();
}

// The job's sizes: workers, shards and the message limit within the system's limits.
absl::Status ValidateSizes(const ClusterSpec& spec) {
  if (spec.num_workers() == 0) {
    return absl::InvalidArgumentError("num_workers is required (--num_workers or the spec file)");
  }
  if (spec.num_workers() < 1 || spec.num_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be in [1, ", kMaxWorkers, "], got ", spec.num_workers()));
  }
  if (spec.servers_size() > kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat("servers: at most ", kMaxShards, " shards, got ", spec.servers_size()));
  }
  if (spec.max_message_bytes() != 0 && (spec.max_message_bytes() < (int64_t{1} << 20) ||
                                        spec.max_message_bytes() > kMaxMessageBytesLimit)) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1 MiB, ",
                                                   kMaxMessageBytesLimit, "], got ",
                                                   spec.max_message_bytes()));
  }
  return absl::OkStatus();
}

// The consistency mode, its parameter, and staleness_aware_lr only where staleness exists.
absl::Status ValidateConsistencyConfig(const ConsistencyConfig& c, int num_workers) {
  switch (c.mode()) {
    case BSP:
    case ASYNC:
    case ALLREDUCE:
      break;
    case BACKUP:
      if (c.backup_workers() < 0 || c.backup_workers() >= num_workers) {
        return absl::InvalidArgumentError(
            absl::StrCat("consistency.backup_workers must be in [0, num_workers), got ",
                         c.backup_workers(), " with ", num_workers, " workers"));
      }
      break;
    case ADAPTIVE:
      if (c.adaptive_every_steps() < 1 || c.adaptive_every_steps() > kMaxAdaptiveEverySteps) {
        return absl::InvalidArgumentError(
            absl::StrCat("consistency.adaptive_every_steps must be in [1, ", kMaxAdaptiveEverySteps,
                         "], got ", c.adaptive_every_steps()));
      }
      break;
    case SSP:
      if (c.staleness() < 0 || c.staleness() > kMaxStaleness) {
        return absl::InvalidArgumentError(absl::StrCat("consistency.staleness must be in [0, ",
                                                       kMaxStaleness, "], got ", c.staleness()));
      }
      break;
    default:
      return absl::InvalidArgumentError("consistency.mode is not set");
  }
  if (c.allreduce_quorum() != QUORUM_ALL && c.mode() != ALLREDUCE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "consistency.allreduce_quorum applies to allreduce, not ", FormatConsistency(c)));
  }
  if (c.allreduce_quorum() < QUORUM_ALL || c.allreduce_quorum() > QUORUM_SOLO) {
    return absl::InvalidArgumentError(
        absl::StrCat("consistency.allreduce_quorum ", c.allreduce_quorum(), " is unknown"));
  }
  if (c.adaptive_every_steps() != 0 && c.mode() != ADAPTIVE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "consistency.adaptive_every_steps applies to adaptive, not ", FormatConsistency(c)));
  }
  if (c.staleness_aware_lr() && c.mode() != ASYNC && c.mode() != SSP) {
    return absl::InvalidArgumentError(absl::StrCat(
        "consistency.staleness_aware_lr applies to async and ssp, not ", FormatConsistency(c)));
  }
  return absl::OkStatus();
}

// An adaptive batch (when on) with what it works with: bsp and no decay horizon in steps.
absl::Status ValidateAdaptiveBatchPairing(const ClusterSpec& spec) {
  if (spec.adaptive_batch().max_global_batch() <= 0) return absl::OkStatus();
  // The servers measure the noise scale only where every worker's gradient meets (bsp), and a
  // decay horizon in steps has no meaning when the steps' batches change.
  const ConsistencyConfig& c = spec.consistency();
  if (c.mode() != BSP) {
    return absl::InvalidArgumentError(
        absl::StrCat("adaptive_batch needs the bsp consistency mode, not ", FormatConsistency(c)));
  }
  const std::string& decay = spec.lr_schedule().decay();
  if (!decay.empty() && decay != "constant") {
    return absl::InvalidArgumentError(absl::StrCat(
        "adaptive_batch works with a constant learning rate after warmup (lr_schedule.decay "
        "constant), not '",
        decay, "': a decay horizon in steps moves when the batch changes"));
  }
  return absl::OkStatus();
}

// Work reassignment (when on): async only, and units of a sane size.
absl::Status ValidateReassign(const ClusterSpec& spec) {
  const int32_t unit = spec.reassign().unit_batches();
  if (unit == 0) return absl::OkStatus();
  if (unit < 0 || unit > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reassign.unit_batches must be in [1, 2^20] (0: off), got ", unit));
  }
  // Under bsp and backup every step takes one batch from every worker, so there is no work to
  // move; under ssp the bound counts each worker's own steps, so the fast workers that took the
  // slow one's units would wait for it at the bound.
  if (spec.consistency().mode() != ASYNC) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reassign needs the async consistency mode, not ", FormatConsistency(spec.consistency()),
        ": under bsp and backup every step takes a batch from every worker, and under ssp the "
        "bound counts each worker's own steps, which reassignment makes unequal"));
  }
  return absl::OkStatus();  // adaptive_batch needs bsp: ValidateAdaptiveBatchPairing refuses it.
}

// The schedule's own fields; what depends on the job (warmup within the horizon, a horizon for
// cosine decay) is checked again when the servers know the job (ParameterShard).
absl::Status ValidateScheduleFields(const ClusterSpec& spec) {
  ScheduleContext context;
  context.global_batch = 1;
  context.steps_per_epoch = 1;
  context.total_steps = int64_t{1} << 40;
  return LearningRateScheduler::Create(spec.optimizer().learning_rate(), spec.lr_schedule(),
                                       context)
      .status();
}

// The lease and the pull wait: positive, and a day at most.
absl::Status ValidateTimeouts(const ClusterSpec& spec) {
  // A day at most: longer would be a typo, and durations built from these must not overflow.
  constexpr int64_t kMaxTimeoutMs = int64_t{24} * 3600 * 1000;
  if (spec.lease_ms() <= 0 || spec.lease_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must be in [1, ", kMaxTimeoutMs, "], got ", spec.lease_ms()));
  }
  if (spec.wait_timeout_ms() <= 0 || spec.wait_timeout_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrCat("wait_timeout_ms must be in [1, ", kMaxTimeoutMs,
                                                   "], got ", spec.wait_timeout_ms()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateClusterSpec(const ClusterSpec& spec, bool need_servers) {
  RETURN_IF_ERROR(ValidateAddresses(spec, need_servers));
  RETURN_IF_ERROR(ValidateSizes(spec));
  RETURN_IF_ERROR(ValidateConsistencyConfig(spec.consistency(), spec.num_workers()));
  RETURN_IF_ERROR(ValidateOptimizerConfig(spec.optimizer()));
  RETURN_IF_ERROR(ValidateAdaptiveBatch(spec.adaptive_batch(), spec.num_workers()));
  RETURN_IF_ERROR(ValidateAdaptiveBatchPairing(spec));
  RETURN_IF_ERROR(ValidateReassign(spec));
  RETURN_IF_ERROR(ValidateScheduleFields(spec));
  return ValidateTimeouts(spec);
}

}  // namespace rubato
