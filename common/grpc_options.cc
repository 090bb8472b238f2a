#include "common/grpc_options.h"

#include <cstdlib>

#include "grpcpp/resource_quota.h"

namespace rubato {

grpc::ChannelArguments RubatoChannelArguments(int64_t max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect quickly after a server restart instead of backing off for up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  return args;
}

void ConfigureServerBuilder(grpc::ServerBuilder* builder, int64_t max_message_bytes,
                            int stream_window_bytes) {
  builder->SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder->SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, stream_window_bytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
}

void SetServerMemoryBudget(grpc::ServerBuilder* builder, int64_t bytes) {
  if (bytes <= 0) return;
  grpc::ResourceQuota quota("rubato-server");
  quota.Resize(static_cast<size_t>(bytes));
  builder->SetResourceQuota(quota);
}

void UseGrpcExperiments() { ::setenv("GRPC_EXPERIMENTS", kGrpcExperiments, /*overwrite=*/0); }

}  // namespace rubato
