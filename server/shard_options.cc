#include "server/shard_options.h"

#include "absl/strings/str_cat.h"
#include "common/cluster_spec.h"
#include "common/status_macros.h"

namespace rubato {

absl::Status ValidateShardOptions(const ShardOptions& options) {
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
  if (options.clock == nullptr) return absl::InvalidArgumentError("a parameter shard needs a clock");
  return absl::OkStatus();
}

int64_t PartElementsFor(const ShardOptions& options, const ConsistencyPolicy& policy) {
  const int64_t parts =
      policy.PartElements(options.cluster.num_workers(), options.push_budget_bytes);
  return options.part_elements >= 0 && parts > 0 ? options.part_elements : parts;
}

}  // namespace rubato
