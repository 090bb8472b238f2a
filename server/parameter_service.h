// ParameterService: the gRPC face of one ParameterShard, on the callback API.
//
// Each RPC is translated to a ParameterShard call. A Pull that must wait is not parked on a thread:
// the reactor is finished from whichever thread later satisfies it (a Push that applies the update,
// or the shard's deadline thread).
#ifndef RUBATO_SERVER_PARAMETER_SERVICE_H_
#define RUBATO_SERVER_PARAMETER_SERVICE_H_

#include "proto/parameter_server.grpc.pb.h"
#include "server/parameter_shard.h"

namespace rubato {

class ParameterService final : public ParameterServer::CallbackService {
 public:
  // `shard` must outlive the service.
  explicit ParameterService(ParameterShard* shard) : shard_(shard) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const RegisterRequest* request,
                                     RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context, const PullRequest* request,
                                 PullResponse* response) override;
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context, const PushRequest* request,
                                 PushResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const HeartbeatRequest* request,
                                      HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const GetStatsRequest* request,
                                     GetStatsResponse* response) override;

 private:
  ParameterShard* const shard_;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PARAMETER_SERVICE_H_
