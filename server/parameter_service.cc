#include "server/parameter_service.h"

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"

namespace rubato {
namespace {

// Finishes `context`'s default reactor with `result`, copying the value into `response` when OK.
template <typename Response>
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                 absl::StatusOr<Response> result, Response* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (result.ok()) *response = std::move(*result);
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* ParameterService::Register(grpc::CallbackServerContext* context,
                                                     const RegisterRequest* request,
                                                     RegisterResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Register(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::Push(grpc::CallbackServerContext* context,
                                                 const PushRequest* request,
                                                 PushResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Push(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::Heartbeat(grpc::CallbackServerContext* context,
                                                      const HeartbeatRequest* request,
                                                      HeartbeatResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::Finish(grpc::CallbackServerContext* context,
                                                   const FinishRequest* request,
                                                   FinishResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Finish(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::GetStats(grpc::CallbackServerContext* context,
                                                     const GetStatsRequest* /*request*/,
                                                     GetStatsResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, std::nullopt); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, absl::StatusOr<GetStatsResponse>(shard_->Stats()), response);
}

grpc::ServerUnaryReactor* ParameterService::Pull(grpc::CallbackServerContext* context,
                                                 const PullRequest* request,
                                                 PullResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The client's deadline, if any; the shard caps it with the cluster's wait timeout. A cancelled
  // call stays queued until that deadline, which is bounded; finishing it then is harmless.
  const absl::Time deadline = absl::FromChrono(context->deadline());
  shard_->Pull(*request, deadline, [reactor, response](absl::Status status, PullResponse result) {
    if (status.ok()) *response = std::move(result);
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

}  // namespace rubato
