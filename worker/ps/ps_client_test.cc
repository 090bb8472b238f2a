// The gRPC PsClient against fake shards on 127.0.0.1:0: heartbeats reach every shard at once;
// asynchronous partial pushes carry exactly their tensors, to the right shard.
#include "worker/ps/ps_client.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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
                                      const HeartbeatRequest* request,
                                      HeartbeatResponse* /*response*/) override {
    grpc::Status answer;
    {
      absl::MutexLock lock(&mu_);
      arrivals_.push_back(absl::Now());
      end_pulls_.push_back(request->end_pulls());
      answer = heartbeat_answer_;
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (delay_ == absl::ZeroDuration()) {
      reactor->Finish(answer);
    } else {
      answers_.emplace_back([reactor, d = delay_] {
        absl::SleepFor(d);
        reactor->Finish(grpc::Status::OK);
      });
    }
    return reactor;
  }

  // Remembers each push's tensor names and first values; acknowledges each as accepted.
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context, const PushRequest* request,
                                 PushResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      std::string names;
      for (const TensorValue& v : request->gradients()) {
        float first = 0;
        if (v.data().size() >= 4) std::memcpy(&first, v.data().data(), 4);
        names += v.name() + "=" + std::to_string(static_cast<int>(first)) + ";";
      }
      pushes_.push_back(absl::StrCat("step ", request->step(), ": ", names));
    }
    response->set_accepted(request->gradients_size());
    response->set_max_staleness(request->step() % 3);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    {
      absl::MutexLock lock(&mu_);
      if (hold_pushes_) {  // As a bsp shard holds an early gradient until its turn.
        held_.push_back(reactor);
        max_held_ = std::max(max_held_, static_cast<int>(held_.size()));
        return reactor;
      }
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // From now on pushes are answered only by ReleasePushes.
  void HoldPushes() {
    absl::MutexLock lock(&mu_);
    hold_pushes_ = true;
  }
  // Answers the held pushes and every later one.
  void ReleasePushes() {
    std::vector<grpc::ServerUnaryReactor*> held;
    {
      absl::MutexLock lock(&mu_);
      hold_pushes_ = false;
      held.swap(held_);
    }
    for (grpc::ServerUnaryReactor* r : held) r->Finish(grpc::Status::OK);
  }
  // Waits up to `timeout` for `count` held pushes; returns how many are held.
  int AwaitHeld(int count, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(held_.size()) >= count;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return static_cast<int>(held_.size());
  }
  int max_held() {
    absl::MutexLock lock(&mu_);
    return max_held_;
  }

  // Answers a pull with each named tensor of 4 floats, all 7, at version = the requested step.
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context, const PullRequest* request,
                                 PullResponse* response) override {
    for (const std::string& name : request->names()) {
      TensorValue* v = response->add_tensors();
      v->set_name(name);
      v->set_version(request->step());
      const float sevens[4] = {7, 7, 7, 7};
      v->set_data(reinterpret_cast<const char*>(sevens), sizeof(sevens));
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // Registration: answers as shard `shard_id` of `shards` in `mode`, at `resume_step`, of
  // recovery `recovery_id`. A Rollback is recorded and then taken as done (the shard "restarted"
  // from that step as that recovery).
  void SetRegistration(int shard_id, int shards, ConsistencyMode mode, int64_t resume_step,
                       uint64_t recovery_id, int64_t part_elements = 0) {
    absl::MutexLock lock(&mu_);
    shard_id_ = shard_id;
    shards_ = shards;
    mode_ = mode;
    resume_step_ = resume_step;
    recovery_id_ = recovery_id;
    part_elements_ = part_elements;
  }

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const RegisterRequest* /*request*/,
                                     RegisterResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      response->set_shard_id(shard_id_);
      response->set_num_shards(shards_);
      response->mutable_consistency()->set_mode(mode_);
      response->set_resume_step(resume_step_);
      response->set_recovery_id(recovery_id_);
      response->set_part_elements(part_elements_);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Rollback(grpc::CallbackServerContext* context,
                                     const RollbackRequest* request,
                                     RollbackResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      rollbacks_.push_back(absl::StrCat("worker ", request->worker_id(), " to step ",
                                        request->step(), " as ", request->recovery_id()));
      resume_step_ = request->step();
      recovery_id_ = request->recovery_id();
    }
    response->set_restarting(true);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  std::vector<std::string> rollbacks() {
    absl::MutexLock lock(&mu_);
    return rollbacks_;
  }

  std::vector<std::string> pushes() {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }

  std::vector<absl::Time> arrivals() {
    absl::MutexLock lock(&mu_);
    return arrivals_;
  }
  // Each heartbeat's end_pulls, in arrival order.
  std::vector<bool> end_pulls() {
    absl::MutexLock lock(&mu_);
    return end_pulls_;
  }
  // What heartbeats are answered (without a delay) from now on.
  void AnswerHeartbeatsWith(grpc::Status answer) {
    absl::MutexLock lock(&mu_);
    heartbeat_answer_ = std::move(answer);
  }

 private:
  const absl::Duration delay_;
  absl::Mutex mu_;
  std::vector<absl::Time> arrivals_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> end_pulls_ ABSL_GUARDED_BY(mu_);
  grpc::Status heartbeat_answer_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pushes_ ABSL_GUARDED_BY(mu_);
  int shard_id_ ABSL_GUARDED_BY(mu_) = 0;
  int shards_ ABSL_GUARDED_BY(mu_) = 1;
  ConsistencyMode mode_ ABSL_GUARDED_BY(mu_) = BSP;
  int64_t resume_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t recovery_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t part_elements_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> rollbacks_ ABSL_GUARDED_BY(mu_);
  bool hold_pushes_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ServerUnaryReactor*> held_ ABSL_GUARDED_BY(mu_);
  int max_held_ ABSL_GUARDED_BY(mu_) = 0;
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
  ~FakeShard() {
    service.ReleasePushes();
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }

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

// A shard that says ABORTED (it restarted, or dropped this worker) makes the heartbeat ask the
// other shards to end this worker's waiting pulls, so that its loop stops waiting there and
// registers again; the heartbeat's own answer is that ABORTED, and a heartbeat that every shard
// answers asks nothing.
TEST(GrpcPsClientTest, AnAbortedHeartbeatAsksTheOtherShardsToEndThisWorkersPulls) {
  FakeShard restarted(absl::ZeroDuration());
  FakeShard other(absl::ZeroDuration());
  PsClientOptions options;
  options.servers = {other.address, restarted.address};
  options.num_workers = 1;
  TensorSpec t;
  t.set_name("w");
  t.add_shape(4);
  options.model = {t, t};
  options.model[1].set_name("b");
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreateGrpcPsClient(options);
  ASSERT_TRUE(client.ok()) << client.status();

  ASSERT_TRUE((*client)->Heartbeat(3).ok());
  EXPECT_EQ(other.service.end_pulls(), std::vector<bool>({false}));

  restarted.service.AnswerHeartbeatsWith(
      grpc::Status(grpc::StatusCode::ABORTED,
                   "shard 1 restarted from its checkpoint of step 0; register again to rejoin"));
  const absl::Status s = (*client)->Heartbeat(4);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("restarted from its checkpoint"), absl::string_view::npos) << s;
  EXPECT_EQ(other.service.end_pulls(), std::vector<bool>({false, false, true}));
  EXPECT_EQ(restarted.service.end_pulls(), std::vector<bool>({false, false}))
      << "the shard that refused is not asked again";
}

// One worker of a model of two layers (l1, l2), each a kernel and a bias of 4 floats.
PsClientOptions TwoLayerOptions(const std::vector<std::string>& servers) {
  PsClientOptions options;
  options.servers = servers;
  options.num_workers = 1;
  for (const char* name : {"l1/kernel", "l1/bias", "l2/kernel", "l2/bias"}) {
    TensorSpec t;
    t.set_name(name);
    t.add_shape(4);
    options.model.push_back(t);
  }
  return options;
}

// Issue 13: under bsp, a shard restored from its checkpoint of step 10 (recovery 77) stands behind
// one that went on to step 12. Registering rolls the one ahead back to step 10 as recovery 77,
// registers again, and continues from step 10. Under async the same answers roll nothing back.
TEST(GrpcPsClientTest, RegisteringUnderBspRollsTheShardsAheadBackToTheRestoredOne) {
  for (ConsistencyMode mode : {BSP, ASYNC}) {
    SCOPED_TRACE(mode == BSP ? "bsp" : "async");
    FakeShard ahead(absl::ZeroDuration());
    FakeShard restored(absl::ZeroDuration());
    ahead.service.SetRegistration(0, 2, mode, 12, 0);
    restored.service.SetRegistration(1, 2, mode, 10, 77);
    PsClientOptions options = TwoLayerOptions({ahead.address, restored.address});
    options.worker_id = 0;
    options.consistency.set_mode(mode);
    absl::StatusOr<std::unique_ptr<PsClient>> client = CreateGrpcPsClient(options);
    ASSERT_TRUE(client.ok()) << client.status();
    const std::vector<std::vector<float>> initial(4, std::vector<float>(4, 0.0f));
    absl::StatusOr<int64_t> resume = (*client)->Register(initial, 8, 12);
    ASSERT_TRUE(resume.ok()) << resume.status();
    EXPECT_EQ(*resume, 10);
    EXPECT_TRUE(restored.service.rollbacks().empty());
    if (mode == BSP) {
      EXPECT_EQ(ahead.service.rollbacks(), std::vector<std::string>{"worker 0 to step 10 as 77"});
    } else {
      EXPECT_TRUE(ahead.service.rollbacks().empty());
    }
  }
}

// A server's resume_step is where the worker seeks its data: one out of range is refused.
TEST(GrpcPsClientTest, AResumeStepOutOfRangeIsRefusedNamingTheServer) {
  FakeShard shard(absl::ZeroDuration());
  shard.service.SetRegistration(0, 1, BSP, -5, 0);
  PsClientOptions options = TwoLayerOptions({shard.address});
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreateGrpcPsClient(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::vector<float>> initial(4, std::vector<float>(4, 0.0f));
  absl::StatusOr<int64_t> resume = (*client)->Register(initial, 8, 0);
  ASSERT_FALSE(resume.ok());
  EXPECT_NE(resume.status().message().find(shard.address), std::string::npos) << resume.status();
  EXPECT_NE(resume.status().message().find("resume_step -5"), std::string::npos) << resume.status();
}

// A part size that would cut a tensor into thousands of calls, or that no tensor can have, is a
// malformed answer naming the server.
TEST(GrpcPsClientTest, APartSizeOutOfRangeIsRefusedNamingTheServer) {
  for (int64_t part : {int64_t{1}, int64_t{1023}, int64_t{-1}, (int64_t{1} << 28) + 1}) {
    SCOPED_TRACE(part);
    FakeShard shard(absl::ZeroDuration());
    shard.service.SetRegistration(0, 1, BSP, 0, 0, part);
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        CreateGrpcPsClient(TwoLayerOptions({shard.address}));
    ASSERT_TRUE(client.ok()) << client.status();
    const std::vector<std::vector<float>> initial(4, std::vector<float>(4, 0.0f));
    absl::StatusOr<int64_t> resume = (*client)->Register(initial, 8, 0);
    ASSERT_FALSE(resume.ok());
    EXPECT_NE(resume.status().message().find(shard.address), std::string::npos) << resume.status();
    EXPECT_NE(resume.status().message().find("part_elements"), std::string::npos)
        << resume.status();
  }
}

// A layer's push carries only its tensors, to their shards, sent from the caller's vectors (which
// must not change until WaitPush).
TEST(GrpcPsClientTest, PartialPushesCarryTheirTensorsOnly) {
  FakeShard a(absl::ZeroDuration());
  FakeShard b(absl::ZeroDuration());
  absl::StatusOr<std::unique_ptr<PsClient>> client =
      CreateGrpcPsClient(TwoLayerOptions({a.address, b.address}));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->supports_partial_push());
  std::vector<std::vector<float>> grads = {{1, 0, 0, 0}, {2, 0, 0, 0}, {3, 0, 0, 0}, {4, 0, 0, 0}};
  const std::vector<int> last = {2, 3}, first = {0, 1};
  absl::StatusOr<int64_t> t1 = (*client)->StartPush(5, last, grads);
  ASSERT_TRUE(t1.ok()) << t1.status();
  absl::StatusOr<int64_t> t2 = (*client)->StartPush(5, first, grads);
  ASSERT_TRUE(t2.ok()) << t2.status();
  PsClient::PushResult result;
  PsClient::PushTiming timing;
  ASSERT_TRUE((*client)->WaitPush(*t2, &result, &timing).ok());
  EXPECT_LE(timing.started, timing.acknowledged);
  ASSERT_TRUE((*client)->WaitPush(*t1, &result, nullptr).ok());
  EXPECT_EQ(result.max_staleness, 2);  // the fake's step % 3
  // Each tensor reached exactly one shard, once, in a push of its own layer.
  std::string all;
  for (const std::string& p : a.service.pushes()) all += "[a " + p + "]";
  for (const std::string& p : b.service.pushes()) all += "[b " + p + "]";
  for (const char* want : {"l1/kernel=1;", "l1/bias=2;", "l2/kernel=3;", "l2/bias=4;"}) {
    size_t count = 0;
    for (size_t at = all.find(want); at != std::string::npos; at = all.find(want, at + 1)) ++count;
    EXPECT_EQ(count, 1u) << want << " in " << all;
  }
  EXPECT_EQ(all.find("l1/kernel=1;l2"), std::string::npos) << all;
  EXPECT_EQ(all.find("l2/bias=4;l1"), std::string::npos) << all;
  // A ticket is waited for once; bad indices and sizes are refused before anything is sent.
  EXPECT_EQ((*client)->WaitPush(*t1, &result).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int> bad_index = {4};
  EXPECT_EQ((*client)->StartPush(6, bad_index, grads).status().code(),
            absl::StatusCode::kInvalidArgument);
  grads[1].resize(3);
  const std::vector<int> short_tensor = {1};
  absl::Status s = (*client)->StartPush(6, short_tensor, grads).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("l1/bias"), std::string::npos) << s;
}

// With pull_into, a ticket pulls its tensors for the next step once the push is acknowledged.
TEST(GrpcPsClientTest, APartialPushPullsItsTensorsForTheNextStep) {
  FakeShard a(absl::ZeroDuration());
  absl::StatusOr<std::unique_ptr<PsClient>> client =
      CreateGrpcPsClient(TwoLayerOptions({a.address}));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::vector<float>> grads(4, std::vector<float>(4, 1));
  std::vector<std::vector<float>> params(4, std::vector<float>(4, 0));
  const std::vector<int> last = {2, 3};
  absl::StatusOr<int64_t> ticket = (*client)->StartPush(9, last, grads, &params);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  PsClient::PushResult result;
  PsClient::PushTiming timing;
  ASSERT_TRUE((*client)->WaitPush(*ticket, &result, &timing).ok());
  EXPECT_EQ(result.min_version, 10);
  EXPECT_LE(timing.acknowledged, timing.pulled);
  EXPECT_EQ(params[2], std::vector<float>(4, 7));
  EXPECT_EQ(params[3], std::vector<float>(4, 7));
  EXPECT_EQ(params[0], std::vector<float>(4, 0));  // not pushed, not pulled
  std::vector<std::vector<float>> wrong(3);
  EXPECT_EQ((*client)->StartPush(9, last, grads, &wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A shard that holds pushes unanswered (as bsp holds a gradient that came before a lower-numbered
// worker's) gets at most two calls' worth (2 x 8 MiB) of one worker's pushes, however many layers'
// pushes the worker has started: the limit is the client's, not one push's. With tensors of 6 MiB
// that is two calls; the rest are sent as the held ones are answered. Small pushes go together.
TEST(GrpcPsClientTest, PushBytesInFlightToAShardAreLimitedAcrossEveryPartialPush) {
  for (const int64_t elements : {int64_t{6} << 18, int64_t{4}}) {  // 6 MiB, 16 bytes
    SCOPED_TRACE(elements);
    FakeShard a(absl::ZeroDuration());
    a.service.HoldPushes();
    PsClientOptions options = TwoLayerOptions({a.address});
    for (TensorSpec& t : options.model) t.set_shape(0, elements);
    absl::StatusOr<std::unique_ptr<PsClient>> client = CreateGrpcPsClient(options);
    ASSERT_TRUE(client.ok()) << client.status();
    const std::vector<std::vector<float>> grads(4, std::vector<float>(elements, 1));
    std::vector<int64_t> tickets;
    for (int i = 3; i >= 0; --i) {  // One push per tensor, as a backward pass of four layers.
      const std::vector<int> one = {i};
      absl::StatusOr<int64_t> ticket = (*client)->StartPush(4, one, grads);
      ASSERT_TRUE(ticket.ok()) << ticket.status();
      tickets.push_back(*ticket);
    }
    const int together = elements > 4 ? 2 : 4;
    EXPECT_EQ(a.service.AwaitHeld(together, absl::Seconds(10)), together);
    // Time for one more call to arrive, if the client sent one.
    EXPECT_EQ(a.service.AwaitHeld(together + 1, absl::Milliseconds(300)), together);
    a.service.ReleasePushes();
    for (int64_t t : tickets) EXPECT_TRUE((*client)->WaitPush(t, nullptr).ok());
    EXPECT_EQ(a.service.max_held(), together);
    EXPECT_EQ(a.service.pushes().size(), 4u);
  }
}

}  // namespace
}  // namespace rubato
