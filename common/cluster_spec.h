// ClusterSpec helpers: parsing, defaults and validation of the cluster description in
// proto/cluster.proto. Every error names the offending field.
#ifndef RUBATO_COMMON_CLUSTER_SPEC_H_
#define RUBATO_COMMON_CLUSTER_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/cluster.pb.h"

namespace rubato {

// Defaults filled in for fields left at zero / empty.
inline constexpr double kDefaultLearningRate = 0.1;
inline constexpr int64_t kDefaultLeaseMs = 10'000;
inline constexpr int64_t kDefaultWaitTimeoutMs = 120'000;
// Adaptive consistency: steps between decisions (ConsistencyConfig.adaptive_every_steps).
inline constexpr int32_t kDefaultAdaptiveEverySteps = 20;

// "bsp", "async", "backup:B", "ssp:S" (B, S non-negative integers), "adaptive", "adaptive:K" (K
// positive: the steps between decisions), "allreduce", "allreduce:majority", "allreduce:solo".
absl::StatusOr<ConsistencyConfig> ParseConsistency(absl::string_view text);
// Inverse of ParseConsistency.
std::string FormatConsistency(const ConsistencyConfig& config);

// Reads a text-format ClusterSpec. NotFound if the file is missing, InvalidArgument with the
// parser's line and column if it does not parse.
absl::StatusOr<ClusterSpec> ReadClusterSpecFile(const std::string& path);

// Fills unset fields: mode bsp, optimizer sgd at kDefaultLearningRate, lease and wait timeout.
void FillClusterSpecDefaults(ClusterSpec* spec);

// The spec's message limit, or kDefaultMaxMessageBytes (common/limits.h) when it is unset.
int64_t MaxMessageBytes(const ClusterSpec& spec);

// Checks every field. `need_servers`: a worker needs the server list; a server does not.
absl::Status ValidateClusterSpec(const ClusterSpec& spec, bool need_servers);

// Splits "host:port"; InvalidArgument naming `field` if it is not of that form.
absl::Status ValidateHostPort(absl::string_view address, absl::string_view field);

}  // namespace rubato

#endif  // RUBATO_COMMON_CLUSTER_SPEC_H_
