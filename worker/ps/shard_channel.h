// ShardChannel: how a PsClient reaches one parameter-server shard.
//
// Every call is asynchronous: it returns at once and ends by calling `done(status)` exactly once,
// on whatever thread the channel answers on (possibly the caller's, before the call returns). The
// request, response and sink must stay valid until then. A channel honours the call's deadline:
// every call ends by it, so nothing that waits for a call waits forever.
//
// Push and Pull carry protobuf's wire format as bytes (a PushRequest or PullRequest in, a
// PushResponse or PullResponse out), so that gradients are sent from the caller's memory in place
// and every channel carries what the servers see (common/tensor_wire.h); the small control calls
// carry messages.
//
// The implementations:
//   GrpcShardChannel       (worker/ps/grpc_shard_channel.h) every call over the shard's gRPC
//                          service;
//   DataPlaneShardChannel  (worker/ps/data_plane_shard_channel.h) Push and Pull over the shard's
//                          plain-TCP data plane while it offers one that works, the rest over gRPC;
//   InProcessShardChannel  (inprocess/in_process_shard_channel.h) straight into a ParameterShard of
//                          the same process, for tests and simulators.
// A new transport is a new implementation; PsClient (worker/ps/ps_client.h) does not change.
//
// Failures come back as statuses with gRPC's codes (common/grpc_status.h): UNAVAILABLE with a
// message that does not say "shutting down" means the transport failed (refused, reset, cut), and
// PsClient retries it; anything else is the shard's answer.
#ifndef RUBATO_WORKER_PS_SHARD_CHANNEL_H_
#define RUBATO_WORKER_PS_SHARD_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// Where a pull's answer may be read straight into the model, without a copy: the tensors the
// answer should hold, in order, each with its name and a destination of exactly its size. A channel
// that can (the data plane) reads an answer laid out as the shard writes it into place and sets
// `stored`; otherwise (another layout, another tensor, another size, or a channel that cannot) the
// answer comes back whole as bytes, for PsClient to parse and judge. Either way the destinations
// may have been written (a call that then fails leaves them half-filled).
struct PullSink {
  struct Tensor {
    const std::string* name;
    float* data;
    int64_t elements;
    int64_t version = 0;  // Set when stored.
  };
  std::vector<Tensor> tensors;
  bool stored = false;
};

class ShardChannel {
 public:
  using Done = std::function<void(absl::Status)>;
  struct CallOptions {
    absl::Time deadline = absl::InfiniteFuture();
    // Wait for a shard that is not up yet until the deadline, instead of failing with UNAVAILABLE
    // at once (gRPC's wait_for_ready). Register uses it.
    bool wait_for_ready = false;
  };

  virtual ~ShardChannel() = default;

  virtual void Register(const RegisterRequest& request, RegisterResponse* response,
                        const CallOptions& options, Done done) = 0;
  virtual void Rollback(const RollbackRequest& request, RollbackResponse* response,
                        const CallOptions& options, Done done) = 0;
  virtual void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                         const CallOptions& options, Done done) = 0;
  virtual void Finish(const FinishRequest& request, FinishResponse* response,
                      const CallOptions& options, Done done) = 0;
  // Work reassignment (server/work_queue.h). A channel that cannot answers UNIMPLEMENTED.
  virtual void TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                        const CallOptions& options, Done done) {
    done(absl::UnimplementedError(
        absl::StrCat("TakeWork: this channel to ", address(), " does not carry it")));
  }
  virtual void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                    const CallOptions& options, Done done) = 0;
  // `sink` may be null; see PullSink.
  virtual void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
                    const CallOptions& options, Done done) = 0;

  // The shard's answer to this worker's Register was `response` (ok): a channel may switch
  // transports on what it offers (RegisterResponse.data_port).
  virtual void Registered(const RegisterResponse& /*response*/) {}

  // How messages name the shard: its address.
  virtual const std::string& address() const = 0;
  // Why the shard may be unreachable, for an error message (e.g. what a plain TCP connect to its
  // address says). May block for a few seconds; called only on failure.
  virtual std::string Diagnose() const = 0;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_SHARD_CHANNEL_H_
