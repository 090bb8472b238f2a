#include "common/cluster_flags.h"

#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/cluster_spec.h"
#include "common/status_macros.h"

// Optional flags: a flag that is not given leaves the spec file's value (or the default) in place.
ABSL_FLAG(std::string, cluster_spec, "", "Text-format rubato.ClusterSpec file (optional).");
ABSL_FLAG(std::optional<std::string>, servers, std::nullopt,
          "Comma-separated host:port of each server shard; shard id = position.");
ABSL_FLAG(std::optional<int>, num_workers, std::nullopt, "Number of workers in the job.");
ABSL_FLAG(std::optional<std::string>, mode, std::nullopt,
          "Consistency model: bsp (default), async, backup:B, ssp:S.");
ABSL_FLAG(std::optional<std::string>, optimizer, std::nullopt, "Server-side optimizer: sgd (default).");
ABSL_FLAG(std::optional<double>, learning_rate, std::nullopt, "Learning rate (default 0.1).");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt, "L2 weight decay (default 0).");
ABSL_FLAG(std::optional<int64_t>, lease_ms, std::nullopt,
          "Worker lease in ms (default 10000). Recorded in the spec and sent to workers; dropping "
          "workers silent for longer is not implemented yet.");
ABSL_FLAG(std::optional<int64_t>, wait_timeout_ms, std::nullopt,
          "Longest a pull waits for the other workers before failing, in ms (default 120000).");

namespace rubato {

absl::StatusOr<ClusterSpec> ClusterSpecFromFlags(bool need_servers) {
  ClusterSpec spec;
  const std::string file = absl::GetFlag(FLAGS_cluster_spec);
  if (!file.empty()) {
    ASSIGN_OR_RETURN(spec, ReadClusterSpecFile(file));
  }
  // Defaults first, so that an explicit flag (even a bad one such as --learning_rate=0) is what
  // gets validated.
  FillClusterSpecDefaults(&spec);
  if (auto servers = absl::GetFlag(FLAGS_servers)) {
    spec.clear_servers();
    for (absl::string_view s : absl::StrSplit(*servers, ',', absl::SkipEmpty())) {
      spec.add_servers(std::string(s));
    }
  }
  if (auto v = absl::GetFlag(FLAGS_num_workers)) spec.set_num_workers(*v);
  if (auto v = absl::GetFlag(FLAGS_mode)) {
    ASSIGN_OR_RETURN(*spec.mutable_consistency(), ParseConsistency(*v));
  }
  OptimizerConfig* opt = spec.mutable_optimizer();
  if (auto v = absl::GetFlag(FLAGS_optimizer)) opt->set_type(*v);
  if (auto v = absl::GetFlag(FLAGS_learning_rate)) opt->set_learning_rate(*v);
  if (auto v = absl::GetFlag(FLAGS_weight_decay)) opt->set_weight_decay(*v);
  if (auto v = absl::GetFlag(FLAGS_lease_ms)) spec.set_lease_ms(*v);
  if (auto v = absl::GetFlag(FLAGS_wait_timeout_ms)) spec.set_wait_timeout_ms(*v);
  RETURN_IF_ERROR(ValidateClusterSpec(spec, need_servers));
  return spec;
}

}  // namespace rubato
