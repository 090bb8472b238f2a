// The gRPC service against a real server on 127.0.0.1:0: errors cross the wire with their codes,
// a malformed push leaves the parameters bit-for-bit unchanged, parked pulls are released by a
// push from another client, and tensors larger than gRPC's 4 MiB default travel.
#include "server/parameter_service.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <vector>

#include "common/auth.h"
#include "common/grpc_options.h"
#include "common/security.h"
#include "common/tensor_bytes.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/create_channel.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

class ServiceTest : public ::testing::Test {
 protected:
  void Start(int workers, ServerSecurity security = ServerSecurity()) {
    workers_ = workers;
    ShardOptions o;
    o.cluster.set_num_workers(workers);
    o.cluster.mutable_consistency()->set_mode(BSP);
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(0.1);
    o.cluster.set_lease_ms(10000);
    o.cluster.set_wait_timeout_ms(10000);
    auto shard = ParameterShard::Create(o);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = std::move(*shard);
    service_ = std::make_unique<ParameterService>(shard_.get(), std::move(security));
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    service_->AddTo(&builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel =
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                  grpc::InsecureChannelCredentials(), RubatoChannelArguments());
    stub_ = ParameterServer::NewStub(channel);
    channel_ = channel;
  }

  // A call of `method` ("/rubato.ParameterServer/Pull") with `body` as its bytes, whatever they
  // are, and the token `token` ("": none).
  grpc::Status RawCall(const std::string& method, const std::string& body,
                       const std::string& token) {
    grpc::GenericStub generic(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx.AddMetadata(kAuthMetadataKey, token);
    grpc::Slice slice(body);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    return status;
  }

  void TearDown() override {
    if (shard_) shard_->Shutdown();
    if (server_) server_->Shutdown();
  }

  grpc::Status Register(int worker, int64_t elements) {
    RegisterRequest req;
    req.set_worker_id(worker);
    req.set_batch_size(4);
    req.set_num_workers(workers_);
    req.mutable_consistency()->set_mode(BSP);
    TensorSpec* spec = req.add_model();
    spec->set_name("w");
    spec->add_shape(elements);
    TensorValue* init = req.add_initial_values();
    init->set_name("w");
    std::vector<float> values(elements);
    for (int64_t i = 0; i < elements; ++i) values[i] = 0.001f * static_cast<float>(i % 1000);
    FloatsToBytes(values, init->mutable_data());
    RegisterResponse resp;
    grpc::ClientContext ctx;
    Attach(&ctx, worker);
    return stub_->Register(&ctx, req, &resp);
  }

  grpc::Status Pull(int worker, int64_t step, PullResponse* resp) {
    PullRequest req;
    req.set_worker_id(worker);
    req.set_step(step);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    Attach(&ctx, worker);
    return stub_->Pull(&ctx, req, resp);
  }

  grpc::Status Push(int worker, int64_t step, const std::vector<float>& grad,
                    const std::string& name = "w") {
    PushRequest req;
    req.set_worker_id(worker);
    req.set_step(step);
    TensorValue* g = req.add_gradients();
    g->set_name(name);
    FloatsToBytes(grad, g->mutable_data());
    PushResponse resp;
    grpc::ClientContext ctx;
    Attach(&ctx, worker);
    return stub_->Push(&ctx, req, &resp);
  }

  // Writes a job secret to `path` (mode 0600) and returns the security of job "service-test" with
  // it.
  static absl::StatusOr<ServerSecurity> JobSecurity(const std::string& path) {
    std::ofstream(path) << "the job secret for this test, 40 bytes...";
    if (chmod(path.c_str(), 0600) != 0) return absl::InternalError("chmod " + path);
    SecurityConfig config;
    config.auth_secret_file = path;
    config.job_id = "service-test";
    return ServerSecurity::Create(config);
  }

  // The token each call carries: `token_for_` of the request's worker, or none.
  void Attach(grpc::ClientContext* ctx, int worker) {
    if (token_for_) ctx->AddMetadata(kAuthMetadataKey, token_for_(worker));
  }

  std::function<std::string(int)> token_for_;
  int workers_ = 0;
  std::unique_ptr<ParameterShard> shard_;
  std::unique_ptr<ParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ServiceTest, MalformedPushIsRejectedOverTheWireAndLeavesParametersUnchanged) {
  Start(2);
  ASSERT_TRUE(Register(0, 8).ok());
  ASSERT_TRUE(Register(1, 8).ok());
  PullResponse before;
  ASSERT_TRUE(Pull(0, 0, &before).ok());

  std::vector<float> nan_grad(8, 1.0f);
  nan_grad[5] = std::numeric_limits<float>::quiet_NaN();
  grpc::Status s = Push(0, 0, nan_grad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("non-finite"), std::string::npos) << s.error_message();
  EXPECT_EQ(Push(0, 0, std::vector<float>(7, 1.0f)).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push(0, 0, std::vector<float>(8, 1.0f), "bogus").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push(0, 5, std::vector<float>(8, 1.0f)).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  PullResponse after;
  ASSERT_TRUE(Pull(0, 0, &after).ok());
  ASSERT_EQ(after.tensors_size(), 1);
  EXPECT_EQ(after.tensors(0).data(), before.tensors(0).data());  // Bit for bit.
  EXPECT_EQ(after.tensors(0).version(), 0);

  // The server kept running and still trains.
  ASSERT_TRUE(Push(0, 0, std::vector<float>(8, 1.0f)).ok());
  ASSERT_TRUE(Push(1, 0, std::vector<float>(8, 1.0f)).ok());
  PullResponse next;
  ASSERT_TRUE(Pull(1, 1, &next).ok());
  EXPECT_EQ(next.tensors(0).version(), 1);
  EXPECT_NE(next.tensors(0).data(), before.tensors(0).data());
}

TEST_F(ServiceTest, ParkedPullIsReleasedByAnotherClientsPush) {
  Start(2);
  ASSERT_TRUE(Register(0, 4).ok());
  ASSERT_TRUE(Register(1, 4).ok());
  ASSERT_TRUE(Push(0, 0, {1, 2, 3, 4}).ok());
  PullResponse resp;
  auto pulled = std::async(std::launch::async, [&] { return Pull(0, 1, &resp); });
  EXPECT_EQ(pulled.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  ASSERT_TRUE(Push(1, 0, {3, 2, 1, 0}).ok());
  ASSERT_EQ(pulled.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  ASSERT_TRUE(pulled.get().ok());
  std::vector<float> w(4);
  BytesToFloats(resp.tensors(0).data(), absl::MakeSpan(w));
  EXPECT_FLOAT_EQ(w[1], 0.001f - 0.1f * 2.0f);
}

TEST_F(ServiceTest, PullDeadlineComesBackAsDeadlineExceeded) {
  Start(2);
  ASSERT_TRUE(Register(0, 4).ok());
  PullRequest req;
  req.set_worker_id(0);
  req.set_step(0);
  PullResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  grpc::Status s = stub_->Pull(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(ServiceTest, TensorsLargerThanFourMebibytesTravel) {
  Start(1);
  const int64_t n = 3 << 20;  // 12 MiB of float32.
  ASSERT_TRUE(Register(0, n).ok());
  ASSERT_TRUE(Push(0, 0, std::vector<float>(n, 0.5f)).ok());
  PullResponse resp;
  ASSERT_TRUE(Pull(0, 1, &resp).ok());
  ASSERT_EQ(resp.tensors(0).data().size(), static_cast<size_t>(4 * n));
  std::vector<float> w(n);
  BytesToFloats(resp.tensors(0).data(), absl::MakeSpan(w));
  EXPECT_FLOAT_EQ(w[n - 1], 0.001f * ((n - 1) % 1000) - 0.05f);
}

// Issue 9, finding 7: with a job secret, every call needs a token, and a worker's token works only
// for that worker. Refused calls change nothing.
// Issue 31, item 3: a Push or Pull without a valid token is refused from its metadata, before
// any of its body is read: a call that sends no message at all (as a client trickling or
// withholding a large body would) is answered UNAUTHENTICATED at once. A unary handler would wait
// for the whole message first, and this call would run into its deadline instead.
TEST_F(ServiceTest, ACallWithoutATokenIsRefusedBeforeItsBodyArrives) {
  const std::string path = ::testing::TempDir() + "/service_test_body.secret";
  absl::StatusOr<ServerSecurity> security = JobSecurity(path);
  ASSERT_TRUE(security.ok()) << security.status();
  Start(1, *security);
  const JobAuth other_job = *JobAuth::FromFile(path, "service-test-2");
  for (const char* method : {"/rubato.ParameterServer/Push", "/rubato.ParameterServer/Pull"}) {
    for (const std::string& token : {std::string(), other_job.WorkerToken(0)}) {
      SCOPED_TRACE(absl::StrCat(method, token.empty() ? " without a token" : " with another job's"));
      grpc::GenericStub generic(channel_);
      grpc::CompletionQueue cq;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      if (!token.empty()) ctx.AddMetadata(kAuthMetadataKey, token);
      const absl::Time start = absl::Now();
      std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
          generic.PrepareCall(&ctx, method, &cq);
      void* tag;
      bool ok;
      call->StartCall(reinterpret_cast<void*>(1));
      ASSERT_TRUE(cq.Next(&tag, &ok));
      // No message, no half-close: the body never comes.
      grpc::Status status;
      call->Finish(&status, reinterpret_cast<void*>(2));
      ASSERT_TRUE(cq.Next(&tag, &ok));
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
      EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "answered only at the deadline";
      cq.Shutdown();
      while (cq.Next(&tag, &ok)) {
      }
    }
  }
}

// Issue 31, item 3, for token holders: a caller has at most kReadsPerCaller bodies received at
// once; its further calls wait unread (so what gRPC holds of bodies in flight is bounded by
// callers x reads x the message limit), and other workers are not held up by them.
TEST_F(ServiceTest, ACallerHasAtMostTwoBodiesReceivedAtOnceAndOthersAreNotHeldUp) {
  const std::string path = ::testing::TempDir() + "/service_test_gate.secret";
  absl::StatusOr<ServerSecurity> security = JobSecurity(path);
  ASSERT_TRUE(security.ok()) << security.status();
  Start(2, *security);
  const JobAuth auth = *JobAuth::FromFile(path, "service-test");
  token_for_ = [&](int w) { return auth.WorkerToken(w); };
  ASSERT_TRUE(Register(0, 8).ok());
  ASSERT_TRUE(Register(1, 8).ok());
  // Worker 0 opens three Push calls and sends none of their bodies (a trickle that never comes).
  grpc::GenericStub generic(channel_);
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::GenericClientAsyncReaderWriter>> calls;
  void* tag;
  bool ok;
  for (int i = 0; i < 3; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    contexts.back()->AddMetadata(kAuthMetadataKey, auth.WorkerToken(0));
    calls.push_back(generic.PrepareCall(contexts.back().get(), "/rubato.ParameterServer/Push", &cq));
    calls.back()->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(cq.Next(&tag, &ok));
  }
  ReadGate& gate = service_->read_gate();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((gate.reading(0) < 2 || gate.waiting(0) < 1) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(gate.reading(0), 2);
  EXPECT_EQ(gate.waiting(0), 1);
  // Worker 1's Pull (through the same gate, on the same connection) is answered meanwhile.
  PullResponse first;
  ASSERT_TRUE(Pull(1, 0, &first).ok());
  EXPECT_EQ(gate.reading(0), 2);
  // Worker 0 trains once its calls are gone.
  for (auto& c : contexts) c->TryCancel();
  for (auto& call : calls) {
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(2));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  }
  const absl::Time drained = absl::Now() + absl::Seconds(10);
  while ((gate.reading(0) > 0 || gate.waiting(0) > 0) && absl::Now() < drained) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(gate.reading(0), 0);
  EXPECT_EQ(gate.waiting(0), 0);
  // (bsp holds worker 1's gradient, and its answer, until worker 0's is in.)
  ASSERT_TRUE(Push(0, 0, std::vector<float>(8, 1.0f)).ok());
  ASSERT_TRUE(Push(1, 0, std::vector<float>(8, 1.0f)).ok());
  PullResponse pulled;
  ASSERT_TRUE(Pull(1, 1, &pulled).ok());
  EXPECT_EQ(pulled.tensors(0).version(), 1);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_F(ServiceTest, WithASecretEveryCallNeedsTheCallersOwnToken) {
  const std::string path = ::testing::TempDir() + "/service_test.secret";
  absl::StatusOr<ServerSecurity> security = JobSecurity(path);
  ASSERT_TRUE(security.ok()) << security.status();
  Start(2, *security);
  const JobAuth auth = *JobAuth::FromFile(path, "service-test");
  const JobAuth wrong = *JobAuth::FromSecret("not the job secret at all", "service-test");

  // No token, a token from another secret, another worker's token: nothing registers.
  EXPECT_EQ(Register(0, 8).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  token_for_ = [&](int w) { return wrong.WorkerToken(w); };
  EXPECT_EQ(Register(0, 8).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // The same secret, another job: what a job started later from a kept secret file holds.
  const JobAuth other_job = *JobAuth::FromFile(path, "service-test-2");
  token_for_ = [&](int w) { return other_job.WorkerToken(w); };
  EXPECT_EQ(Register(0, 8).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  token_for_ = [&](int w) { return auth.WorkerToken(1 - w); };
  grpc::Status impostor = Register(0, 8);
  EXPECT_EQ(impostor.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(impostor.error_message().find("can act only as itself"), std::string::npos)
      << impostor.error_message();
  token_for_ = [&](int) { return auth.OperatorToken(); };
  EXPECT_EQ(Register(0, 8).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(shard_->Stats().workers_size(), 0);
  EXPECT_EQ(shard_->Stats().tensors_size(), 0) << "an impostor chose the model";

  token_for_ = [&](int w) { return auth.WorkerToken(w); };
  ASSERT_TRUE(Register(0, 8).ok());
  ASSERT_TRUE(Register(1, 8).ok());
  PullResponse before;
  ASSERT_TRUE(Pull(0, 0, &before).ok());
  // Worker 1 pushing as worker 0: refused, and worker 0's own push then counts (it is no
  // duplicate).
  token_for_ = [&](int w) { return auth.WorkerToken(1 - w); };
  EXPECT_EQ(Push(0, 0, std::vector<float>(8, 1.0f)).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  PullResponse stolen;
  EXPECT_EQ(Pull(0, 0, &stolen).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(stolen.tensors_size(), 0);
  token_for_ = [&](int w) { return auth.WorkerToken(w); };
  ASSERT_TRUE(Push(0, 0, std::vector<float>(8, 1.0f)).ok());
  EXPECT_EQ(shard_->Stats().duplicate_gradients(), 0);

  // Bytes that are no Push or Pull: a caller without a valid token learns only that it has none
  // (the token is checked before the body is parsed); one with a token, what is wrong with them.
  for (const char* method : {"/rubato.ParameterServer/Push", "/rubato.ParameterServer/Pull"}) {
    const std::string garbage = "\xff\xff\xff not a message";
    grpc::Status none = RawCall(method, garbage, "");
    EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method << ": "
                                                                     << none.error_message();
    EXPECT_EQ(RawCall(method, garbage, other_job.WorkerToken(0)).error_code(),
              grpc::StatusCode::UNAUTHENTICATED)
        << method;
    grpc::Status bad = RawCall(method, garbage, auth.WorkerToken(0));
    EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(bad.error_message().find("malformed"), std::string::npos) << bad.error_message();
  }

  // GetStats and Heartbeat: no token, no answer; the operator may read stats.
  GetStatsResponse stats;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub_->GetStats(&ctx, GetStatsRequest(), &stats).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kAuthMetadataKey, auth.OperatorToken());
    ASSERT_TRUE(stub_->GetStats(&ctx, GetStatsRequest(), &stats).ok());
    EXPECT_EQ(stats.workers_size(), 2);
  }
  {
    HeartbeatRequest hb;
    hb.set_worker_id(1);
    HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.AddMetadata(kAuthMetadataKey, auth.WorkerToken(0));
    EXPECT_EQ(stub_->Heartbeat(&ctx, hb, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << "a worker kept another's lease alive";
  }
  {
    FinishRequest finish;
    finish.set_worker_id(1);
    FinishResponse resp;
    grpc::ClientContext ctx;
    ctx.AddMetadata(kAuthMetadataKey, auth.WorkerToken(0));
    EXPECT_EQ(stub_->Finish(&ctx, finish, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << "a worker finished another's training";
    grpc::ClientContext none;
    EXPECT_EQ(stub_->Finish(&none, finish, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(shard_->Stats().finished_workers(), 0);
    grpc::ClientContext own;
    own.AddMetadata(kAuthMetadataKey, auth.WorkerToken(1));
    ASSERT_TRUE(stub_->Finish(&own, finish, &resp).ok());
    EXPECT_EQ(resp.finished_workers(), 1);
  }
  {
    // Rollback: only with the requesting worker's own token (and this shard, which keeps no
    // checkpoints, then refuses it, naming what to do instead).
    RollbackRequest rollback;
    rollback.set_worker_id(1);
    rollback.set_step(0);
    rollback.set_recovery_id(42);
    RollbackResponse resp;
    grpc::ClientContext none;
    EXPECT_EQ(stub_->Rollback(&none, rollback, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext other;
    other.AddMetadata(kAuthMetadataKey, auth.WorkerToken(0));
    EXPECT_EQ(stub_->Rollback(&other, rollback, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    grpc::ClientContext own;
    own.AddMetadata(kAuthMetadataKey, auth.WorkerToken(1));
    const grpc::Status refused = stub_->Rollback(&own, rollback, &resp);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(refused.error_message().find("--checkpoint_dir"), std::string::npos)
        << refused.error_message();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace rubato
