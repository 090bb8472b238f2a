// The gRPC PsClient against fake shards on 127.0.0.1:0: heartbeats reach every shard at once.
#include "worker/ps_client.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/parameter_server.grpc.pb.h"

namespace rubato {
namespace {

// A shard that only answers heartbeats, after `delay`, and remembers when each arrived.
class HeartbeatShard final : public ParameterServer::CallbackService {
 public:
  explicit HeartbeatShard(absl::Duration delay) : delay_(delay) {}
  ~HeartbeatShard() override {
    for (std::thread& t : answers_) t.join();
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const HeartbeatRequest* /*request*/,
                                      HeartbeatResponse* /*response*/) override {
    {
      absl::MutexLock lock(&mu_);
      arrivals_.push_back(absl::Now());
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (delay_ == absl::ZeroDuration()) {
      reactor->Finish(grpc::Status::OK);
    } else {
      answers_.emplace_back([reactor, d = delay_] {
        absl::SleepFor(d);
        reactor->Finish(grpc::Status::OK);
      });
    }
    return reactor;
  }

  std::vector<absl::Time> arrivals() {
    absl::MutexLock lock(&mu_);
    return arrivals_;
  }

 private:
  const absl::Duration delay_;
  absl::Mutex mu_;
  std::vector<absl::Time> arrivals_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> answers_;
};

struct FakeShard {
  explicit FakeShard(absl::Duration delay) : service(delay) {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~FakeShard() { server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5))); }

  HeartbeatShard service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

// Issue 9, finding 8: heartbeats went to the shards one after another, each with a 5 s deadline,
// so one slow shard kept a live worker's heartbeats from the others long enough to be dropped.
TEST(GrpcPsClientTest, HeartbeatsReachEveryShardAtOnceDespiteASlowOne) {
  FakeShard slow(absl::Seconds(3));
  FakeShard fast(absl::ZeroDuration());
  PsClientOptions options;
  options.servers = {slow.address, fast.address};  // The slow shard first.
  options.num_workers = 1;
  TensorSpec t;
  t.set_name("w");
  t.add_shape(4);
  options.model = {t, t};
  options.model[1].set_name("b");
  options.heartbeat_timeout = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreateGrpcPsClient(options);
  ASSERT_TRUE(client.ok()) << client.status();

  const absl::Time start = absl::Now();
  const absl::Status s = (*client)->Heartbeat(7);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find(slow.address), std::string::npos) << s;
  EXPECT_LT(took, absl::Milliseconds(2500)) << "the heartbeat waited for the slow shard";
  const std::vector<absl::Time> fast_arrivals = fast.service.arrivals();
  ASSERT_EQ(fast_arrivals.size(), 1u);
  EXPECT_LT(fast_arrivals[0] - start, absl::Milliseconds(500))
      << "the fast shard's heartbeat waited behind the slow one";
}

}  // namespace
}  // namespace rubato
