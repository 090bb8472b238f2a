// RefusingShardChannel: a ShardChannel for tests that answers every call UNIMPLEMENTED at once;
// a test overrides the calls it scripts. Diagnose() says "diagnosed <address>".
#ifndef RUBATO_WORKER_PS_REFUSING_SHARD_CHANNEL_H_
#define RUBATO_WORKER_PS_REFUSING_SHARD_CHANNEL_H_

#include <string>
#include <utility>

#include "worker/ps/shard_channel.h"

namespace rubato {

class RefusingShardChannel : public ShardChannel {
 public:
  explicit RefusingShardChannel(std::string address) : address_(std::move(address)) {}

  void Register(const RegisterRequest&, RegisterResponse*, const CallOptions&, Done d) override {
    d(Refused());
  }
  void Rollback(const RollbackRequest&, RollbackResponse*, const CallOptions&, Done d) override {
    d(Refused());
  }
  void Heartbeat(const HeartbeatRequest&, HeartbeatResponse*, const CallOptions&,
                 Done d) override {
    d(Refused());
  }
  void Finish(const FinishRequest&, FinishResponse*, const CallOptions&, Done d) override {
    d(Refused());
  }
  void Push(const grpc::ByteBuffer*, grpc::ByteBuffer*, const CallOptions&, Done d) override {
    d(Refused());
  }
  void Pull(const grpc::ByteBuffer*, grpc::ByteBuffer*, PullSink*, const CallOptions&,
            Done d) override {
    d(Refused());
  }
  const std::string& address() const override { return address_; }
  std::string Diagnose() const override { return "diagnosed " + address_; }

 private:
  static absl::Status Refused() { return absl::UnimplementedError("not scripted in this test"); }

  const std::string address_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_REFUSING_SHARD_CHANNEL_H_
