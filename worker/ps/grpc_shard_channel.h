// GrpcShardChannel: every call to one shard over its gRPC service (proto/parameter_server.proto),
// Push and Pull as raw bytes so that tensors are not copied (common/tensor_wire.h).
#ifndef RUBATO_WORKER_PS_GRPC_SHARD_CHANNEL_H_
#define RUBATO_WORKER_PS_GRPC_SHARD_CHANNEL_H_

#include <memory>
#include <string>

#include "common/limits.h"
#include "common/security.h"
#include "grpcpp/generic/generic_stub.h"
#include "proto/parameter_server.grpc.pb.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

class GrpcShardChannel final : public ShardChannel {
 public:
  // `address` is host:port; every call carries `security`'s token, over its credentials.
  GrpcShardChannel(std::string address, const ClientSecurity& security, int64_t max_message_bytes);

  void Register(const RegisterRequest& request, RegisterResponse* response,
                const CallOptions& options, Done done) override;
  void Rollback(const RollbackRequest& request, RollbackResponse* response,
                const CallOptions& options, Done done) override;
  void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                 const CallOptions& options, Done done) override;
  void Finish(const FinishRequest& request, FinishResponse* response, const CallOptions& options,
              Done done) override;
  void TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                const CallOptions& options, Done done) override;
  void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
            const CallOptions& options, Done done) override;
  // Never stores into the sink: the answer comes back as bytes.
  void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
            const CallOptions& options, Done done) override;

  const std::string& address() const override { return address_; }
  // What a plain TCP connect to the address says (common/net_diagnose.h).
  std::string Diagnose() const override;

 private:
  // A context for one call, deleted when it ends; `done` as an absl::Status.
  grpc::ClientContext* NewContext(const CallOptions& options) const;
  static std::function<void(grpc::Status)> Ending(grpc::ClientContext* context, Done done);

  const std::string address_;
  const ClientSecurity security_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;  // The same channel, for Push and Pull as bytes.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_GRPC_SHARD_CHANNEL_H_
