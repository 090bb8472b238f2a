// InProcessShardChannel: a ShardChannel (worker/ps/shard_channel.h) straight into a ParameterShard
// of the same process, so that the one PsClient, the training loop and the shard's consistency
// modes run together without sockets or processes: in tests, and in a simulator.
//
// Push and Pull carry the same bytes as over gRPC and are read as the gRPC service reads them
// (server/parameter_service.h): a push is parsed over the client's slices, which reference the
// caller's gradients, and the shard holds them as long as it needs them; a pull's answer is the
// shard's weights as slices. Calls end on the shard's threads (an update pool thread, its deadline
// thread), or at once on the caller's for a refused call, as the ShardChannel contract allows.
// A call's deadline is read on the shard's clock (ShardOptions.clock): give the client the same.
#ifndef RUBATO_INPROCESS_IN_PROCESS_SHARD_CHANNEL_H_
#define RUBATO_INPROCESS_IN_PROCESS_SHARD_CHANNEL_H_

#include <memory>
#include <string>
#include <vector>

#include "server/parameter_shard.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

class InProcessShardChannel final : public ShardChannel {
 public:
  // `shard` must outlive the channel; `address` names it in messages.
  InProcessShardChannel(ParameterShard* shard, std::string address)
      : shard_(shard), address_(std::move(address)) {}

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
  std::string Diagnose() const override { return "a shard in this process"; }

 private:
  ParameterShard* const shard_;
  const std::string address_;
};

// One channel per shard, named "in-process shard <s>".
std::vector<std::unique_ptr<ShardChannel>> InProcessChannels(
    const std::vector<ParameterShard*>& shards);

}  // namespace rubato

#endif  // RUBATO_INPROCESS_IN_PROCESS_SHARD_CHANNEL_H_
