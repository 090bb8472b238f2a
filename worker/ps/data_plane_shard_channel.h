// DataPlaneShardChannel: Push and Pull to one shard over its plain-TCP data plane
// (server/data_plane.h, worker/ps/ps_data_channel.h) while the shard offers one that works; every
// other call, and Push and Pull whenever the data plane is not offered or could not connect, over
// another channel (gRPC).
//
// The data plane is offered in the shard's Register answer (RegisterResponse.data_port): each
// answer that names a new port replaces the data channel; one that names none retires it. A data
// channel that could not open a connection is dropped with a warning, and its shard's calls go over
// gRPC until the next registration offers a port again. A retired data channel closes each
// connection as soon as its call ends, and is destroyed with this channel (a call's callback, which
// runs on the data channel's own thread, may be what retires it).
#ifndef RUBATO_WORKER_PS_DATA_PLANE_SHARD_CHANNEL_H_
#define RUBATO_WORKER_PS_DATA_PLANE_SHARD_CHANNEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/data_plane_wire.h"
#include "common/limits.h"
#include "worker/ps/ps_data_channel.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

class DataPlaneShardChannel final : public ShardChannel {
 public:
  struct Options {
    int worker_id = 0;
    // The worker's answer to a data connection's challenge (PsDataChannel::Options).
    std::function<std::string(absl::string_view challenge)> answer_challenge;
    std::string description;  // "shard 1 at host:port", for messages.
    int64_t max_message_bytes = kDefaultMaxMessageBytes;
    std::shared_ptr<const TlsContext> tls;  // With TLS (PsDataChannel::Options).
  };
  // `control` carries everything the data plane does not (and Push and Pull when it is down).
  DataPlaneShardChannel(std::unique_ptr<ShardChannel> control, Options options)
      : control_(std::move(control)), options_(std::move(options)) {}

  void Register(const RegisterRequest& request, RegisterResponse* response,
                const CallOptions& options, Done done) override {
    control_->Register(request, response, options, std::move(done));
  }
  void Rollback(const RollbackRequest& request, RollbackResponse* response,
                const CallOptions& options, Done done) override {
    control_->Rollback(request, response, options, std::move(done));
  }
  void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                 const CallOptions& options, Done done) override {
    control_->Heartbeat(request, response, options, std::move(done));
  }
  void Finish(const FinishRequest& request, FinishResponse* response, const CallOptions& options,
              Done done) override {
    control_->Finish(request, response, options, std::move(done));
  }
  void TakeWork(const TakeWorkRequest& request, TakeWorkResponse* response,
                const CallOptions& options, Done done) override {
    control_->TakeWork(request, response, options, std::move(done));
  }
  void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
            const CallOptions& options, Done done) override;
  void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
            const CallOptions& options, Done done) override;
  // Opens a data channel to response.data_port on the host of address(), or retires the one in
  // use if the answer offers none.
  void Registered(const RegisterResponse& response) override;

  const std::string& address() const override { return control_->address(); }
  std::string Diagnose() const override { return control_->Diagnose(); }

  // Whether Push and Pull go over the data plane now (tests).
  bool uses_data_plane() const;

 private:
  // Over the data channel while there is one that works, else over control_.
  void Call(DataMethod method, const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
            PullSink* sink, const CallOptions& options, Done done);
  void Retire() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `data` could not connect: calls go over control_ from now on.
  void Drop(const PsDataChannel* data, const absl::Status& why);

  const std::unique_ptr<ShardChannel> control_;
  const Options options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<PsDataChannel> data_ ABSL_GUARDED_BY(mu_);  // null: none in use.
  std::vector<std::shared_ptr<PsDataChannel>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_DATA_PLANE_SHARD_CHANNEL_H_
