// Channel and server settings shared by every Rubato gRPC endpoint.
#ifndef RUBATO_COMMON_GRPC_OPTIONS_H_
#define RUBATO_COMMON_GRPC_OPTIONS_H_

#include <cstdint>

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace rubato {

// Largest message either end accepts. gRPC's 4 MiB default would cap one tensor at a million
// floats; protobuf cannot parse messages of 2 GiB or more. 1 GiB leaves headroom below that cap
// while letting one message hold a 256M-parameter tensor. Clients split pushes and pulls of many
// tensors into calls of about 8 MiB (see worker/ps_client.cc).
inline constexpr int64_t kMaxMessageBytes = int64_t{1} << 30;

// Arguments for client channels: message limits, and keepalive so that a vanished peer is noticed
// during a long pull rather than at the deadline only.
grpc::ChannelArguments RubatoChannelArguments();

// Applies the same message limits to a server.
void ConfigureServerBuilder(grpc::ServerBuilder* builder);

}  // namespace rubato

#endif  // RUBATO_COMMON_GRPC_OPTIONS_H_
