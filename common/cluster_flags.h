// Command-line flags that describe the cluster, shared by rubato_server and rubato_worker.
//
// --cluster_spec=FILE loads a text-format ClusterSpec; any of the other flags given on the command
// line override the file's fields. Without a file the flags alone describe the cluster.
#ifndef RUBATO_COMMON_CLUSTER_FLAGS_H_
#define RUBATO_COMMON_CLUSTER_FLAGS_H_

#include "absl/status/statusor.h"
#include "proto/cluster.pb.h"

namespace rubato {

// Builds the spec from --cluster_spec and the override flags, fills defaults and validates it.
absl::StatusOr<ClusterSpec> ClusterSpecFromFlags(bool need_servers);

}  // namespace rubato

#endif  // RUBATO_COMMON_CLUSTER_FLAGS_H_
