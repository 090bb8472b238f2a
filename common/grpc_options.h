// Channel and server settings shared by every Rubato gRPC endpoint.
#ifndef RUBATO_COMMON_GRPC_OPTIONS_H_
#define RUBATO_COMMON_GRPC_OPTIONS_H_

#include <cstdint>

#include "common/limits.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace rubato {

// Message size. gRPC's 4 MiB default would cap one tensor at a million floats; protobuf cannot
// parse messages of 2 GiB or more. Every endpoint takes its limit from the job's
// ClusterSpec.max_message_bytes (common/limits.h: 64 MiB unless set, at most 1 GiB), because a
// server buffers a message whole before it can refuse it: the limit bounds what one call can make
// it hold. Clients split pushes and pulls of many tensors into calls of about 8 MiB (see
// worker/ps_client.cc).

// HTTP/2 flow control for bulk float traffic, on both ends. gRPC's default estimates the
// bandwidth-delay product with pings and grows each stream's window from 64 KiB; on loopback that
// probing throttled a ring link to about 0.4 GB/s. A fixed 64 MiB window with probing off and 16
// MiB frames doubled it (experiments/allreduce_benchmark, 16 MB on 2 ranks: 0.41 -> 0.88 GB/s). The
// window bounds what a stream can have in flight unread, per stream.
inline constexpr int kStreamWindowBytes = 64 << 20;
inline constexpr int kMaxFrameBytes = (16 << 20) - 1;  // HTTP/2's largest frame.

// Arguments for client channels: message limits, the flow control above, and keepalive so that a
// vanished peer is noticed during a long pull rather than at the deadline only.
grpc::ChannelArguments RubatoChannelArguments(int64_t max_message_bytes = kDefaultMaxMessageBytes);

// Applies the same message limits and flow control to a server, and turns SO_REUSEPORT off: gRPC
// sets it by default, so a second server could bind a port that a live one holds and take part of
// its connections. With it off, a port in use fails the bind.
//
// `stream_window_bytes` is how much of a stream's data the server takes in before the handler asks
// for it. A parameter server keeps it small (kServerStreamWindowBytes): a call waiting to be read
// (server/parameter_service.h's ReadGate) then holds at most that, while the message being read
// still gets a window of its whole size from gRPC as it is read.
void ConfigureServerBuilder(grpc::ServerBuilder* builder,
                            int64_t max_message_bytes = kDefaultMaxMessageBytes,
                            int stream_window_bytes = kStreamWindowBytes);
inline constexpr int kServerStreamWindowBytes = 1 << 20;

// gRPC 1.51 experiments that the binaries turn on (GRPC_EXPERIMENTS), unless that variable is
// already set, even to nothing: tcp_frame_size_tuning (a read completes once the size the HTTP/2
// layer expects has arrived, into buffers of that size) and tcp_rcv_lowat (SO_RCVLOWAT, so the
// poller wakes for that much, not for each segment). Interleaved, 6 runs each, medians
// (transport_benchmark --loop=serial): 1 MB with 1 worker 1.155 -> 1.264 GB/s, with 3 workers
// 0.518 -> 0.563; 16 MB, 1 worker 1.585 -> 1.667; 64 MB, 3 workers 0.522 -> 0.536.
inline constexpr char kGrpcExperiments[] = "tcp_frame_size_tuning,tcp_rcv_lowat";
// Sets GRPC_EXPERIMENTS to kGrpcExperiments unless it is set. Call first in main, before anything
// of gRPC's runs (it reads the variable once).
void UseGrpcExperiments();

// Caps the memory gRPC may use for this server's connections and calls (buffers, parsed
// messages in flight) at `bytes`, through a grpc::ResourceQuota. 0: no cap.
void SetServerMemoryBudget(grpc::ServerBuilder* builder, int64_t bytes);

}  // namespace rubato

#endif  // RUBATO_COMMON_GRPC_OPTIONS_H_
