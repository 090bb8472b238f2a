// The one place where gRPC and Abseil statuses are converted into each other.
#ifndef RUBATO_COMMON_GRPC_STATUS_H_
#define RUBATO_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpc/impl/codegen/connectivity_state.h"
#include "grpcpp/support/status.h"

namespace rubato {

// Same code and message. The numeric codes of the two libraries are identical by design.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// A channel's connectivity state as gRPC's documentation spells it ("TRANSIENT_FAILURE").
absl::string_view ChannelStateName(grpc_connectivity_state state);

}  // namespace rubato

#endif  // RUBATO_COMMON_GRPC_STATUS_H_
