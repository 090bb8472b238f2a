// An in-process PsClient: the same contract as the gRPC one (worker/ps_client.h), over
// ParameterShard objects in this process instead of servers, so that the training loop, the call
// plan (worker/call_plan.h) and the shard's consistency modes can be tested together without
// sockets or processes.
//
// Calls go to the shards the plan says, grouped as the gRPC client groups them, through the
// shards' zero-copy entry points: a push hands each gradient to the shard as a view of the
// caller's vector, and a pull copies the shared weights into the caller's. Pulls wait up to
// options.rpc_timeout. StartPush runs each ticket on a thread of its own, as the gRPC client does.
#ifndef RUBATO_INPROCESS_IN_PROCESS_PS_CLIENT_H_
#define RUBATO_INPROCESS_IN_PROCESS_PS_CLIENT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/parameter_shard.h"
#include "worker/call_plan.h"
#include "worker/ps_client.h"

namespace rubato {

// `shards[s]` is shard s (options.servers is ignored); the shards must outlive the client.
// InvalidArgument as CreateGrpcPsClient, or for no shards.
absl::StatusOr<std::unique_ptr<PsClient>> CreateInProcessPsClient(
    const PsClientOptions& options, std::vector<ParameterShard*> shards,
    int64_t target_call_bytes = kTargetCallBytes);

}  // namespace rubato

#endif  // RUBATO_INPROCESS_IN_PROCESS_PS_CLIENT_H_
