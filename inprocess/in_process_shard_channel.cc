#include "inprocess/in_process_shard_channel.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/parameter_service.h"

namespace rubato {
namespace {

// Ends a control call with the shard's answer.
template <typename Response>
void Answer(absl::StatusOr<Response> result, Response* response, const ShardChannel::Done& done) {
  if (result.ok()) *response = *std::move(result);
  done(result.status());
}

}  // namespace

void InProcessShardChannel::Register(const RegisterRequest& request, RegisterResponse* response,
                                     const CallOptions&, Done done) {
  Answer(shard_->Register(request), response, done);
}

void InProcessShardChannel::Rollback(const RollbackRequest& request, RollbackResponse* response,
                                     const CallOptions&, Done done) {
  Answer(shard_->Rollback(request), response, done);
}

void InProcessShardChannel::Heartbeat(const HeartbeatRequest& request,
                                      HeartbeatResponse* response, const CallOptions&,
                                      Done done) {
  Answer(shard_->Heartbeat(request), response, done);
}

void InProcessShardChannel::Finish(const FinishRequest& request, FinishResponse* response,
                                   const CallOptions&, Done done) {
  Answer(shard_->Finish(request), response, done);
}

void InProcessShardChannel::TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                                     const CallOptions&, Done done) {
  Answer(shard_->TakeWork(request), response, done);
}

void InProcessShardChannel::Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                 const CallOptions&, Done done) {
  absl::StatusOr<std::shared_ptr<ReceivedPush>> received = ReceivePush(*request);
  if (!received.ok()) {
    done(received.status());
    return;
  }
  WirePush push = std::move((*received)->push);
  shard_->Push(std::move(push), *std::move(received),
               [response, done = std::move(done)](absl::StatusOr<PushResponse> result) {
                 if (result.ok()) *response = SerializedMessage(*result);
                 done(result.status());
               });
}

void InProcessShardChannel::Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                 PullSink*, const CallOptions& options, Done done) {
  absl::StatusOr<PullRequest> pull = ReceivePull(*request);
  if (!pull.ok()) {
    done(pull.status());
    return;
  }
  shard_->Pull(*pull, options.deadline,
               ParameterShard::SharedPullDone(
                   [response, done = std::move(done)](absl::Status status,
                                                      std::vector<PulledTensor> tensors) {
                     if (status.ok()) *response = EncodePullResponse(tensors);
                     done(std::move(status));
                   }));
}

std::vector<std::unique_ptr<ShardChannel>> InProcessChannels(
    const std::vector<ParameterShard*>& shards) {
  std::vector<std::unique_ptr<ShardChannel>> channels;
  for (size_t s = 0; s < shards.size(); ++s) {
    channels.push_back(
        std::make_unique<InProcessShardChannel>(shards[s], absl::StrCat("in-process shard ", s)));
  }
  return channels;
}

}  // namespace rubato
