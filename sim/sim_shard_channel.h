// SimShardChannel: a ShardChannel (worker/ps/shard_channel.h) into a ParameterShard of the same
// process across a simulated network (sim/network.h), for the simulator (sim/README.md).
//
// Push and Pull carry the bytes a real client sends and are read as the gRPC service reads them,
// as InProcessShardChannel does; on the way each is a message of the network from the worker's host
// to the shard's and back. A push is then applied on the shard's processor, a first-in-first-out
// Queue at the shard's apply rate. Where the simulation holds each tensor at 1 / `scale` of its
// size (sim/timing_job.h), the network and the processor count every tensor byte `scale` times,
// the framing once.
//
// The control calls (Register, Heartbeat, Finish, Rollback, TakeWork) go straight to the shard, as
// InProcessShardChannel's do, and are answered at once, taking no simulated time: the simulator
// registers every worker before its clock starts and models no failures, and the client waits for
// them. Messages are never lost, so a call's deadline is the shard's to keep (its pull deadlines
// and wait timeout, on the simulated clock).
#ifndef RUBATO_SIM_SIM_SHARD_CHANNEL_H_
#define RUBATO_SIM_SIM_SHARD_CHANNEL_H_

#include <cstdint>
#include <string>

#include "inprocess/in_process_shard_channel.h"
#include "server/parameter_shard.h"
#include "sim/network.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

struct SimRoute {
  Network* network = nullptr;
  int worker_host = 0;
  int shard_host = 0;
  Queue* shard_processor = nullptr;  // Null: applying takes no time.
  int64_t scale = 1;                 // >= 1
};

class SimShardChannel final : public ShardChannel {
 public:
  // `shard`, the route's network and processor must outlive the channel.
  SimShardChannel(ParameterShard* shard, std::string address, SimRoute route)
      : shard_(shard), address_(address), route_(route), direct_(shard, std::move(address)) {}

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
  void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, const CallOptions& options,
            Done done) override;
  // Never stores into the sink: the answer comes back as bytes.
  void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
            const CallOptions& options, Done done) override;

  const std::string& address() const override { return address_; }
  std::string Diagnose() const override { return "a simulated shard"; }

 private:
  // The bytes a message of `length` bytes, `payload` of them tensor values, stands for.
  int64_t WireBytes(int64_t length, int64_t payload) const {
    return length + payload * (route_.scale - 1);
  }
  // Sends `bytes` from the shard back to the worker, then ends the call with `status`.
  void Answer(int64_t bytes, absl::Status status, Done done);

  ParameterShard* const shard_;
  const std::string address_;
  const SimRoute route_;
  InProcessShardChannel direct_;  // The control calls, answered at once.
};

}  // namespace rubato

#endif  // RUBATO_SIM_SIM_SHARD_CHANNEL_H_
