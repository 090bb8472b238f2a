#include "worker/ps/grpc_shard_channel.h"

#include <utility>

#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/net_diagnose.h"
#include "grpcpp/create_channel.h"

namespace rubato {
namespace {

constexpr char kPushMethod[] = "/rubato.ParameterServer/Push";
constexpr char kPullMethod[] = "/rubato.ParameterServer/Pull";

}  // namespace

GrpcShardChannel::GrpcShardChannel(std::string address, const ClientSecurity& security,
                                   int64_t max_message_bytes)
    : address_(std::move(address)), security_(security) {
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      address_, security_.credentials(), RubatoChannelArguments(max_message_bytes));
  stub_ = ParameterServer::NewStub(channel);
  generic_ = std::make_unique<grpc::GenericStub>(channel);
}

grpc::ClientContext* GrpcShardChannel::NewContext(const CallOptions& options) const {
  auto* context = new grpc::ClientContext;
  context->set_deadline(absl::ToChronoTime(options.deadline));
  context->set_wait_for_ready(options.wait_for_ready);
  security_.Attach(context);
  return context;
}

std::function<void(grpc::Status)> GrpcShardChannel::Ending(grpc::ClientContext* context,
                                                           Done done) {
  return [context, done = std::move(done)](grpc::Status status) {
    delete context;
    done(FromGrpcStatus(status));
  };
}

void GrpcShardChannel::Register(const RegisterRequest& request, RegisterResponse* response,
                                const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  stub_->async()->Register(context, &request, response, Ending(context, std::move(done)));
}

void GrpcShardChannel::Rollback(const RollbackRequest& request, RollbackResponse* response,
                                const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  stub_->async()->Rollback(context, &request, response, Ending(context, std::move(done)));
}

void GrpcShardChannel::Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                                 const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  stub_->async()->Heartbeat(context, &request, response, Ending(context, std::move(done)));
}

void GrpcShardChannel::Finish(const FinishRequest& request, FinishResponse* response,
                              const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  stub_->async()->Finish(context, &request, response, Ending(context, std::move(done)));
}

void GrpcShardChannel::TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                                const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  stub_->async()->TakeWork(context, &request, response, Ending(context, std::move(done)));
}

void GrpcShardChannel::Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                            const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  generic_->UnaryCall(context, kPushMethod, grpc::StubOptions(), request, response,
                      Ending(context, std::move(done)));
}

void GrpcShardChannel::Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                            PullSink* /*sink*/, const CallOptions& options, Done done) {
  grpc::ClientContext* context = NewContext(options);
  generic_->UnaryCall(context, kPullMethod, grpc::StubOptions(), request, response,
                      Ending(context, std::move(done)));
}

std::string GrpcShardChannel::Diagnose() const {
  return DiagnoseEndpoint(address_, absl::Seconds(2)).detail;
}

}  // namespace rubato
