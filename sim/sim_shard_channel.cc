#include "sim/sim_shard_channel.h"

#include <memory>
#include <utility>
#include <vector>

#include "common/grpc_bytes.h"
#include "server/parameter_service.h"

namespace rubato {
namespace {

// What an answer that carries only a status costs on the wire (a gRPC trailer's order).
constexpr int64_t kStatusBytes = 64;

}  // namespace

void SimShardChannel::Register(const RegisterRequest& request, RegisterResponse* response,
                               const CallOptions& options, Done done) {
  direct_.Register(request, response, options, std::move(done));
}

void SimShardChannel::Rollback(const RollbackRequest& request, RollbackResponse* response,
                               const CallOptions& options, Done done) {
  direct_.Rollback(request, response, options, std::move(done));
}

void SimShardChannel::Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                                const CallOptions& options, Done done) {
  direct_.Heartbeat(request, response, options, std::move(done));
}

void SimShardChannel::Finish(const FinishRequest& request, FinishResponse* response,
                             const CallOptions& options, Done done) {
  direct_.Finish(request, response, options, std::move(done));
}

void SimShardChannel::TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                               const CallOptions& options, Done done) {
  direct_.TakeWork(request, response, options, std::move(done));
}

void SimShardChannel::Answer(int64_t bytes, absl::Status status, Done done) {
  route_.network->Send(route_.shard_host, route_.worker_host, bytes,
                       [status = std::move(status), done = std::move(done)] { done(status); });
}

void SimShardChannel::Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                           const CallOptions&, Done done) {
  absl::StatusOr<std::shared_ptr<ReceivedPush>> received = ReceivePush(*request);
  if (!received.ok()) {
    done(received.status());
    return;
  }
  int64_t payload = 0;
  for (const WireTensor& g : (*received)->push.gradients) {
    payload += static_cast<int64_t>(g.data.size());
  }
  const int64_t bytes = WireBytes(static_cast<int64_t>(request->Length()), payload);
  std::shared_ptr<ReceivedPush> push = *std::move(received);
  auto apply = [this, push, response, done]() {
    WirePush wire = std::move(push->push);  // Views of its slices, which the keepalive holds.
    shard_->Push(std::move(wire), push,
                 [this, response, done](absl::StatusOr<PushResponse> result) {
                   if (!result.ok()) {
                     Answer(kStatusBytes, result.status(), done);
                     return;
                   }
                   *response = SerializedMessage(*result);
                   Answer(static_cast<int64_t>(response->Length()), absl::OkStatus(), done);
                 });
  };
  Network* network = route_.network;
  Queue* processor = route_.shard_processor;
  const int64_t work = payload * route_.scale;
  network->Send(route_.worker_host, route_.shard_host, bytes, [network, processor, work, apply] {
    if (processor == nullptr) {
      apply();
      return;
    }
    EventLoop* loop = network->loop();
    loop->At(processor->Take(loop->Now(), work), apply);
  });
}

void SimShardChannel::Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink*,
                           const CallOptions& options, Done done) {
  absl::StatusOr<PullRequest> pull = ReceivePull(*request);
  if (!pull.ok()) {
    done(pull.status());
    return;
  }
  const absl::Time deadline = options.deadline;
  route_.network->Send(
      route_.worker_host, route_.shard_host, static_cast<int64_t>(request->Length()),
      [this, pull = *std::move(pull), deadline, response, done] {
        shard_->Pull(
            pull, deadline,
            ParameterShard::SharedPullDone(
                [this, response, done](absl::Status status, std::vector<PulledTensor> tensors) {
                  if (!status.ok()) {
                    Answer(kStatusBytes, std::move(status), done);
                    return;
                  }
                  int64_t payload = 0;
                  for (const PulledTensor& t : tensors) {
                    payload += static_cast<int64_t>(t.snapshot.values->size() * sizeof(float));
                  }
                  *response = EncodePullResponse(tensors);
                  Answer(WireBytes(static_cast<int64_t>(response->Length()), payload),
                         absl::OkStatus(), done);
                }));
      });
}

}  // namespace rubato
