// The Push and Pull data plane (server/data_plane.h) against a real shard, its gRPC service and a
// PsClient: the client uses it when offered and gets the same answers as over gRPC; a client
// without the job's token, a worker acting as another, an oversized or unknown request and a
// garbage hello are refused with errors that name the problem, and leave the shard serving; a
// data port that cannot be reached, or that goes away mid-job, sends the calls over gRPC; a
// channel the client stops using closes its connections at both ends.
#include "server/data_plane.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/grpc_options.h"
#include "common/socket_io.h"
#include "common/test_certificates.h"
#include "common/tls_stream.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/parameter_service.h"
#include "worker/ps/ps_client.h"
#include "worker/ps/ps_data_channel.h"

namespace rubato {
namespace {

constexpr int kElements = 3000;

std::string WriteSecret() {
  const std::string path = absl::StrCat(::testing::TempDir(), "/data_plane_secret_", ::getpid());
  std::ofstream(path) << "a job secret of more than sixteen bytes\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

class DataPlaneTest : public ::testing::Test {
 protected:
  // Mutual TLS for the next Start: a CA, the server's certificate (for 127.0.0.1) and the
  // workers', in files; client_config_ is what a worker with the CA and a certificate is given.
  void UseMutualTls() {
    const std::string dir = ::testing::TempDir();
    const TestIdentity server = ca_.Issue("shard", "IP:127.0.0.1");
    const TestIdentity client = ca_.Issue("worker", "DNS:worker");
    config_.tls.cert = WriteTestFile(dir, "server.pem", server.cert);
    config_.tls.key = WriteTestFile(dir, "server.key", server.key);
    config_.tls.ca = WriteTestFile(dir, "ca.pem", ca_.cert());
    client_config_.tls.cert = WriteTestFile(dir, "client.pem", client.cert);
    client_config_.tls.key = WriteTestFile(dir, "client.key", client.key);
    client_config_.tls.ca = config_.tls.ca;
  }

  // One shard of an async job of `workers` workers, SGD at rate 1, with or without a job secret.
  void Start(int workers, bool authenticate) {
    ShardOptions o;
    o.cluster.set_num_workers(workers);
    o.cluster.mutable_consistency()->set_mode(ASYNC);
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(1.0);
    o.cluster.set_lease_ms(10000);
    o.cluster.set_wait_timeout_ms(10000);
    auto shard = ParameterShard::Create(o);
    ASSERT_TRUE(shard.ok()) << shard.status();
    shard_ = std::move(*shard);
    if (authenticate) {
      config_.auth_secret_file = WriteSecret();
      config_.job_id = "data-plane-test-1";
      client_config_.auth_secret_file = config_.auth_secret_file;
      client_config_.job_id = config_.job_id;
    }
    auto security = ServerSecurity::Create(config_);
    ASSERT_TRUE(security.ok()) << security.status();
    service_ = std::make_unique<ParameterService>(shard_.get(), *security);
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", security->credentials(), &port);
    service_->AddTo(&builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
    DataPlaneOptions d;
    d.host = "127.0.0.1";
    d.max_message_bytes = kDefaultMaxMessageBytes;
    d.memory_budget_bytes = memory_budget_;
    d.num_workers = workers;
    auto data = DataPlaneServer::Start(d, shard_.get(), *security);
    ASSERT_TRUE(data.ok()) << data.status();
    data_ = std::move(*data);
    service_->set_data_port(data_->port());
  }

  void TearDown() override {
    if (shard_) shard_->Shutdown();
    data_.reset();
    if (server_) server_->Shutdown();
  }

  std::unique_ptr<PsClient> Client(int worker, bool use_data_plane = true) {
    return ClientOf(config_, worker, use_data_plane);
  }
  std::unique_ptr<PsClient> ClientOf(const SecurityConfig& config, int worker,
                                     bool use_data_plane = true) {
    PsClientOptions options;
    options.servers = {address_};
    options.worker_id = worker;
    options.num_workers = workers_;
    options.consistency.set_mode(ASYNC);
    options.use_data_plane = use_data_plane;
    options.retry_timeout = absl::Seconds(10);
    TensorSpec t;
    t.set_name("w");
    t.add_shape(kElements);
    options.model = {t};
    auto security = ClientSecurity::Create(config, worker);
    EXPECT_TRUE(security.ok()) << security.status();
    options.security = *security;
    auto client = CreateGrpcPsClient(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  }

  // A raw connection to the data port, its challenge read into challenge_.
  int Connect() {
    absl::StatusOr<int> fd = ConnectTcp("127.0.0.1", data_->port(), absl::Seconds(2));
    EXPECT_TRUE(fd.ok()) << fd.status();
    char opening[sizeof(kDataChallengeMagic) + kDataChallengeBytes];
    std::string why;
    EXPECT_EQ(ReadWithin(*fd, opening, sizeof(opening), absl::Now() + absl::Seconds(5), &why),
              ReadEnd::kDone)
        << why;
    EXPECT_EQ(std::string(opening, sizeof(kDataChallengeMagic)),
              std::string(kDataChallengeMagic, sizeof(kDataChallengeMagic)));
    challenge_.assign(opening + sizeof(kDataChallengeMagic), kDataChallengeBytes);
    return *fd;
  }
  // A hello as the server expects it: magic, worker, answer bytes, the answer.
  static std::string Hello(int worker, const std::string& answer) {
    std::string h(kDataHelloMagic, sizeof(kDataHelloMagic));
    const int32_t w = worker, n = static_cast<int32_t>(answer.size());
    h.append(reinterpret_cast<const char*>(&w), 4);
    h.append(reinterpret_cast<const char*>(&n), 4);
    return h + answer;
  }
  // `config`'s answer for `worker` to the last connection's challenge.
  std::string AnswerOf(const SecurityConfig& config, int worker) const {
    absl::StatusOr<ClientSecurity> security = ClientSecurity::Create(config, worker);
    EXPECT_TRUE(security.ok()) << security.status();
    return security->HelloAnswer(challenge_);
  }
  static void Send(int fd, const std::string& bytes) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    ASSERT_EQ(WriteWithin(fd, &iov, 1, absl::Now() + absl::Seconds(5)), "");
  }
  // Reads a 16-byte header (code, then a length at byte 4 for a hello answer or byte 8 for a
  // response) and its text.
  static std::pair<int32_t, std::string> Answer(int fd, bool hello) {
    char header[16];
    std::string why;
    if (ReadWithin(fd, header, 16, absl::Now() + absl::Seconds(5), &why) != ReadEnd::kDone) {
      return {-1, "no answer"};
    }
    int32_t code;
    std::memcpy(&code, header, 4);
    int64_t n = 0;
    if (hello) {
      int32_t n32;
      std::memcpy(&n32, header + 4, 4);
      n = n32;
    } else {
      std::memcpy(&n, header + 8, 8);
    }
    std::string text(static_cast<size_t>(n), '\0');
    ReadWithin(fd, text.data(), text.size(), absl::Now() + absl::Seconds(5), &why);
    return {code, text};
  }
  // True once the server has closed `fd` (a reset when it left bytes unread).
  static bool Closed(int fd) {
    char c;
    std::string why;
    const ReadEnd end = ReadWithin(fd, &c, 1, absl::Now() + absl::Seconds(5), &why);
    return end == ReadEnd::kClosed || end == ReadEnd::kError;
  }
  static std::string Request(int32_t method, int64_t timeout_ms, const std::string& body,
                             int64_t claimed_bytes = -1) {
    char header[kDataRequestHeaderBytes] = {};
    const int64_t bytes = claimed_bytes >= 0 ? claimed_bytes : static_cast<int64_t>(body.size());
    std::memcpy(header, &method, 4);
    std::memcpy(header + 8, &timeout_ms, 8);
    std::memcpy(header + 16, &bytes, 8);
    return std::string(header, sizeof(header)) + body;
  }

  // Registers a client, pushes gradient g = 0.25 everywhere twice and pulls: w = 1 - 2 x 0.25.
  void TrainTwoSteps(PsClient* client) {
    const std::vector<std::vector<float>> initial = {std::vector<float>(kElements, 1.0f)};
    auto resume = client->Register(initial, 4, 0);
    ASSERT_TRUE(resume.ok()) << resume.status();
    const std::vector<std::vector<float>> grads = {std::vector<float>(kElements, 0.25f)};
    for (int step = 0; step < 2; ++step) {
      std::vector<std::vector<float>> params(1);
      ASSERT_TRUE(client->Pull(step, absl::MakeSpan(params)).ok());
      ASSERT_TRUE(client->Push(step, grads).ok());
    }
    std::vector<std::vector<float>> params(1);
    ASSERT_TRUE(client->Pull(2, absl::MakeSpan(params)).ok());
    ASSERT_EQ(params[0].size(), static_cast<size_t>(kElements));
    for (float v : params[0]) ASSERT_EQ(v, 0.5f);
  }

  int workers_ = 1;
  int64_t memory_budget_ = int64_t{1} << 30;
  SecurityConfig config_;
  SecurityConfig client_config_;  // With TLS, the workers' (UseMutualTls).
  TestCa ca_{"data plane test CA"};
  std::string challenge_;  // The last Connect()'s.
  std::unique_ptr<ParameterShard> shard_;
  std::unique_ptr<ParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<DataPlaneServer> data_;
  std::string address_;
};

TEST_F(DataPlaneTest, AnAuthenticatedClientTrainsOverTheDataPlane) {
  Start(1, /*authenticate=*/true);
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
  EXPECT_GE(data_->connections(), 1) << "the client did not use the data plane";
  EXPECT_EQ(shard_->Stats().pushes(), 2);
}

// Issue 31, item 9: with TLS, Push and Pull stay on the data plane, encrypted with the job's
// certificates (they went over gRPC before).
TEST_F(DataPlaneTest, AMutualTlsClientTrainsOverTheDataPlane) {
  UseMutualTls();
  Start(1, /*authenticate=*/true);
  std::unique_ptr<PsClient> client = ClientOf(client_config_, 0);
  TrainTwoSteps(client.get());
  EXPECT_GE(data_->connections(), 1) << "the client did not use the data plane";
  EXPECT_EQ(shard_->Stats().pushes(), 2);
}

// What crosses the wire is TLS: a client that speaks the plaintext protocol gets no challenge
// (the server waits for a TLS ClientHello, and closes after the hello's 5 s), and a TLS client
// without a client certificate, or with one of another CA, fails its handshake; none changes the
// shard, and a real worker trains afterwards.
TEST_F(DataPlaneTest, WithTlsPlaintextOrUncertifiedConnectionsAreRefused) {
  UseMutualTls();
  Start(1, /*authenticate=*/true);
  {
    absl::StatusOr<int> fd = ConnectTcp("127.0.0.1", data_->port(), absl::Seconds(2));
    ASSERT_TRUE(fd.ok()) << fd.status();
    char opening[sizeof(kDataChallengeMagic) + kDataChallengeBytes];
    std::string why;
    const ReadEnd end =
        ReadWithin(*fd, opening, sizeof(opening), absl::Now() + absl::Seconds(10), &why);
    EXPECT_NE(end, ReadEnd::kDone) << "a plaintext challenge came";
    ::close(*fd);
  }
  TestCa other("another CA");
  const TestIdentity stranger = other.Issue("worker", "DNS:worker");
  struct Case {
    std::string name, cert, key;
  };
  for (const Case& c : {Case{"no client certificate", "", ""},
                        Case{"a certificate of another CA", stranger.cert, stranger.key}}) {
    auto tls = TlsContext::ForClient(ca_.cert(), c.cert, c.key);
    ASSERT_TRUE(tls.ok()) << tls.status();
    absl::StatusOr<int> fd = ConnectTcp("127.0.0.1", data_->port(), absl::Seconds(2));
    ASSERT_TRUE(fd.ok()) << fd.status();
    DataSocket socket(*fd);
    const std::string handshake =
        socket.HandshakeAsClient(**tls, "127.0.0.1", absl::Now() + absl::Seconds(5));
    // TLS 1.3: the server's refusal may come after the client's side of the handshake is done.
    char opening[sizeof(kDataChallengeMagic) + kDataChallengeBytes];
    std::string why;
    const ReadEnd end =
        handshake.empty()
            ? socket.Read(opening, sizeof(opening), absl::Now() + absl::Seconds(5), &why)
            : ReadEnd::kError;
    EXPECT_NE(end, ReadEnd::kDone) << c.name << ": got a challenge";
    ::close(*fd);
  }
  EXPECT_EQ(shard_->Stats().pushes(), 0);
  std::unique_ptr<PsClient> client = ClientOf(client_config_, 0);
  TrainTwoSteps(client.get());
  EXPECT_EQ(shard_->Stats().pushes(), 2);
}

TEST_F(DataPlaneTest, WithGrpcChosenNoDataConnectionIsOpened) {
  Start(1, /*authenticate=*/false);
  std::unique_ptr<PsClient> client = Client(0, /*use_data_plane=*/false);
  TrainTwoSteps(client.get());
  EXPECT_EQ(data_->connections(), 0);
}

TEST_F(DataPlaneTest, AHelloWithoutTheJobsTokenIsRefusedNamingWhy) {
  Start(1, /*authenticate=*/true);
  std::string a_token;
  {
    absl::StatusOr<ClientSecurity> security = ClientSecurity::Create(config_, 0);
    ASSERT_TRUE(security.ok()) << security.status();
    a_token = security->HelloAnswer(std::string(kDataChallengeBytes, 'x'));
  }
  for (const std::string& token : {std::string(), std::string("worker/0/abcd"), a_token}) {
    const int fd = Connect();
    Send(fd, Hello(0, token));
    auto [code, text] = Answer(fd, /*hello=*/true);
    EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) << text;
    EXPECT_FALSE(text.empty());
    EXPECT_TRUE(Closed(fd));
    ::close(fd);
  }
  // Not a Rubato hello at all, and a token length out of range.
  for (const std::string& hello :
       {std::string("GET / HTTP/1.1\r\n\r\n"), Hello(0, "").substr(0, 12) + "\xff\xff\xff\x7f"}) {
    const int fd = Connect();
    Send(fd, hello);
    auto [code, text] = Answer(fd, /*hello=*/true);
    EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_TRUE(Closed(fd));
    ::close(fd);
  }
  std::unique_ptr<PsClient> client = Client(0);  // The shard still serves.
  TrainTwoSteps(client.get());
}

TEST_F(DataPlaneTest, ACapturedHelloReplayedOnAnotherConnectionIsRefused) {
  Start(1, /*authenticate=*/true);
  int fd = Connect();
  const std::string captured = Hello(0, AnswerOf(config_, 0));
  Send(fd, captured);
  ASSERT_EQ(Answer(fd, /*hello=*/true).first, 0) << "the genuine hello";
  ::close(fd);
  fd = Connect();
  Send(fd, captured);  // Byte for byte, on a connection with a new challenge.
  auto [code, text] = Answer(fd, /*hello=*/true);
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) << text;
  EXPECT_NE(text.find("not for this connection"), std::string::npos) << text;
  EXPECT_TRUE(Closed(fd));
  ::close(fd);
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
}

// The same secret file, another job: what a job started later from a kept Kubernetes Secret
// sees. Nothing of the other job is accepted, over gRPC or the data plane, and nothing changes.
TEST_F(DataPlaneTest, AnotherJobWithTheSameSecretIsRefusedAndChangesNothing) {
  Start(1, /*authenticate=*/true);
  SecurityConfig other = config_;
  other.job_id = "data-plane-test-2";
  std::unique_ptr<PsClient> intruder = ClientOf(other, 0);
  const std::vector<std::vector<float>> chosen = {std::vector<float>(kElements, 42.0f)};
  absl::StatusOr<int64_t> registered = intruder->Register(chosen, 4, 0);
  EXPECT_TRUE(absl::IsUnauthenticated(registered.status())) << registered.status();
  EXPECT_NE(registered.status().message().find("--job_id"), std::string::npos)
      << registered.status();
  const int fd = Connect();
  Send(fd, Hello(0, AnswerOf(other, 0)));
  auto [code, text] = Answer(fd, /*hello=*/true);
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) << text;
  ::close(fd);
  EXPECT_EQ(shard_->Stats().workers_size(), 0) << "nobody registered";
  // This job's own worker trains from its own initial values (1.0), not the intruder's.
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
}

// Issue 31, item 4: connections that never say hello filled every slot, and a worker's valid
// hello was closed unanswered. Past max_pending_hellos the oldest silent one is closed instead.
TEST_F(DataPlaneTest, AFloodOfSilentConnectionsCannotLockAWorkerOut) {
  Start(1, /*authenticate=*/true);
  std::vector<int> flood;
  // Each gets its challenge and says nothing.
  for (int i = 0; i < 150; ++i) flood.push_back(Connect());
  const int fd = Connect();
  Send(fd, Hello(0, AnswerOf(config_, 0)));
  auto [code, text] = Answer(fd, /*hello=*/true);
  EXPECT_EQ(code, 0) << text;
  ::close(fd);
  int closed = 0;
  for (int f : flood) {
    closed += Closed(f) ? 1 : 0;
    ::close(f);
  }
  EXPECT_GE(closed, 150 - 64) << "the oldest silent connections were closed";
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
}

// Issue 31, item 4: a worker with a valid token could reserve the whole body budget by declaring
// large bodies and trickling them. Each worker now has a share: max(budget / workers,
// min(budget / 2, message limit)), 128 KiB of 256 KiB here.
TEST_F(DataPlaneTest, AWorkerTricklingLargeBodiesCannotStarveTheOthers) {
  workers_ = 2;
  memory_budget_ = 256 << 10;
  Start(2, /*authenticate=*/false);
  std::unique_ptr<PsClient> other = Client(1);
  const std::vector<std::vector<float>> initial = {std::vector<float>(kElements, 1.0f)};
  std::unique_ptr<PsClient> client = Client(0);
  // Worker 1 declares a body of its whole share and sends 10 bytes of it.
  const int trickle = Connect();
  Send(trickle, Hello(1, ""));
  ASSERT_EQ(Answer(trickle, /*hello=*/true).first, 0);
  Send(trickle, Request(1, 60000, "0123456789", 128 << 10));
  // Once the server has taken its header (each connection has its own thread: the next request
  // could otherwise be read first), a second such body of worker 1's is past its share, named so.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (data_->body_bytes() < (128 << 10) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(data_->body_bytes(), 128 << 10);
  const int more = Connect();
  Send(more, Hello(1, ""));
  ASSERT_EQ(Answer(more, /*hello=*/true).first, 0);
  Send(more, Request(1, 60000, "", 1 << 10));
  auto [code, text] = Answer(more, /*hello=*/false);
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << text;
  EXPECT_NE(text.find("worker 1's requests in flight past its 128 KiB share"), std::string::npos)
      << text;
  ::close(more);
  // Worker 0 trains at full speed meanwhile (12 KB calls, within its own share).
  std::thread registering([&] { ASSERT_TRUE(other->Register(initial, 4, 0).ok()); });
  TrainTwoSteps(client.get());
  registering.join();
  EXPECT_GE(data_->connections(), 2);
  ::close(trickle);
}

TEST_F(DataPlaneTest, AWorkerCannotPushOrPullAsAnother) {
  workers_ = 2;
  Start(2, /*authenticate=*/false);
  const int fd = Connect();
  Send(fd, Hello(1, ""));
  ASSERT_EQ(Answer(fd, /*hello=*/true).first, 0);
  PullRequest pull;
  pull.set_worker_id(0);
  Send(fd, Request(2, 1000, pull.SerializeAsString()));
  auto [code, text] = Answer(fd, /*hello=*/false);
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied)) << text;
  EXPECT_NE(text.find("act only as itself"), std::string::npos) << text;
  // A malformed push is answered, and the connection goes on.
  Send(fd, Request(1, 1000, "\xff\xff\xff garbage"));
  auto [code2, text2] = Answer(fd, /*hello=*/false);
  EXPECT_EQ(code2, static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) << text2;
  Send(fd, Request(2, 1000, "\xff"));
  EXPECT_EQ(Answer(fd, /*hello=*/false).first,
            static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  ::close(fd);
}

TEST_F(DataPlaneTest, AnOversizedOrUnknownRequestIsRefusedAndTheConnectionClosed) {
  Start(1, /*authenticate=*/false);
  struct Case {
    int32_t method;
    int64_t timeout_ms;
    int64_t bytes;
    absl::StatusCode code;
    const char* names;
  };
  for (const Case& c :
       {Case{1, 1000, int64_t{1} << 40, absl::StatusCode::kResourceExhausted, "limit"},
        Case{7, 1000, 0, absl::StatusCode::kInvalidArgument, "method 7"},
        Case{2, -5, 0, absl::StatusCode::kInvalidArgument, "negative"}}) {
    const int fd = Connect();
    Send(fd, Hello(0, ""));
    ASSERT_EQ(Answer(fd, /*hello=*/true).first, 0);
    Send(fd, Request(c.method, c.timeout_ms, "", c.bytes));
    auto [code, text] = Answer(fd, /*hello=*/false);
    EXPECT_EQ(code, static_cast<int32_t>(c.code)) << text;
    EXPECT_NE(text.find(c.names), std::string::npos) << text;
    EXPECT_TRUE(Closed(fd));
    ::close(fd);
  }
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
}

TEST_F(DataPlaneTest, RequestsPastTheMemoryBudgetAreRefused) {
  memory_budget_ = 256 << 10;
  Start(1, /*authenticate=*/false);
  const int fd = Connect();
  Send(fd, Hello(0, ""));
  ASSERT_EQ(Answer(fd, /*hello=*/true).first, 0);
  Send(fd, Request(1, 1000, "", 1 << 20));  // Within the message limit, past the budget.
  auto [code, text] = Answer(fd, /*hello=*/false);
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << text;
  EXPECT_NE(text.find("memory budget"), std::string::npos) << text;
  EXPECT_TRUE(Closed(fd));
  ::close(fd);
  std::unique_ptr<PsClient> client = Client(0);  // 12 KB calls fit: the budget was given back.
  TrainTwoSteps(client.get());
  EXPECT_GE(data_->connections(), 1);
}

TEST_F(DataPlaneTest, APortThatDoesNotAnswerAsADataPlaneSendsTheCallsOverGrpc) {
  Start(1, /*authenticate=*/false);
  absl::StatusOr<Listening> l = ListenTcp("127.0.0.1", 0, 4);
  ASSERT_TRUE(l.ok());
  // Some other service: it answers every connection with 16 bytes that are not a status.
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop.load()) {
      pollfd p{l->fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int fd = ::accept(l->fd, nullptr, nullptr);
      if (fd < 0) continue;
      const char reply[] = "\x39\x05\0\0HTTP/1.0 400 x";
      ::send(fd, reply, 16, MSG_NOSIGNAL);
      ::close(fd);
    }
  });
  service_->set_data_port(l->port);
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
  stop.store(true);
  other.join();
  ::close(l->fd);
  EXPECT_EQ(data_->connections(), 0);
}

TEST_F(DataPlaneTest, AnUnreachableDataPortSendsTheCallsOverGrpc) {
  Start(1, /*authenticate=*/false);
  // A port where nothing listens.
  absl::StatusOr<Listening> l = ListenTcp("127.0.0.1", 0, 1);
  ASSERT_TRUE(l.ok());
  const int dead_port = l->port;
  ::close(l->fd);
  service_->set_data_port(dead_port);
  std::unique_ptr<PsClient> client = Client(0);
  TrainTwoSteps(client.get());
  EXPECT_EQ(data_->connections(), 0);
}

TEST_F(DataPlaneTest, ADataPlaneThatGoesAwayMidJobLeavesTheCallsToGrpc) {
  Start(1, /*authenticate=*/false);
  std::unique_ptr<PsClient> client = Client(0);
  const std::vector<std::vector<float>> initial = {std::vector<float>(kElements, 1.0f)};
  ASSERT_TRUE(client->Register(initial, 4, 0).ok());
  const std::vector<std::vector<float>> grads = {std::vector<float>(kElements, 0.25f)};
  std::vector<std::vector<float>> params(1);
  ASSERT_TRUE(client->Pull(0, absl::MakeSpan(params)).ok());
  absl::Status pushed = client->Push(0, grads);
  ASSERT_TRUE(pushed.ok()) << pushed;
  ASSERT_GE(data_->connections(), 1);
  data_.reset();  // Its connections close; its port refuses from now on.
  absl::Status pulled = client->Pull(1, absl::MakeSpan(params));
  ASSERT_TRUE(pulled.ok()) << pulled;
  pushed = client->Push(1, grads);
  ASSERT_TRUE(pushed.ok()) << pushed;
  ASSERT_TRUE(client->Pull(2, absl::MakeSpan(params)).ok());
  for (float v : params[0]) ASSERT_EQ(v, 0.5f);
}

// A channel that PsClient retires (the shard restarted, or its data port could not be reached
// once) must not keep its connections: each holds a thread at both ends, and the shard counts
// them against the worker's kMaxConnectionsPerWorker, so a few retirements would lock the worker
// out of a live shard's data plane.
TEST_F(DataPlaneTest, ADrainedChannelClosesItsConnectionsAtBothEnds) {
  Start(1, /*authenticate=*/false);
  PsDataChannel::Options o;
  o.host = "127.0.0.1";
  o.port = data_->port();
  o.worker_id = 0;
  o.description = "the test's shard";
  PsDataChannel channel(o);
  PullRequest pull;
  pull.set_worker_id(0);
  pull.add_names("w");
  const grpc::ByteBuffer request = SerializedMessage(pull);
  // Calls at once take connections of their own; each is answered (an unregistered worker's pull
  // is refused), and its connection stays open for the next call.
  auto call_all = [&](int calls) {
    std::vector<grpc::ByteBuffer> responses(calls);
    absl::BlockingCounter done(calls);
    std::atomic<int> answered{0};
    for (int i = 0; i < calls; ++i) {
      channel.Call(2, &request, absl::Now() + absl::Seconds(5), &responses[i],
                   [&](grpc::Status status) {
                     answered += status.error_code() != grpc::StatusCode::UNAVAILABLE &&
                                 status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
                     done.DecrementCount();
                   });
    }
    done.Wait();
    return answered.load();
  };
  EXPECT_EQ(call_all(3), 3);
  const int opened = channel.open_connections();
  EXPECT_GE(opened, 1);
  EXPECT_LE(opened, 3);
  auto server_connections_become = [&](int n) {
    for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
      if (data_->connections() == n) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  };
  EXPECT_TRUE(server_connections_become(opened)) << data_->connections();
  channel.Drain();
  EXPECT_TRUE(server_connections_become(0)) << data_->connections() << " still open at the shard";
  EXPECT_EQ(channel.open_connections(), 0);
  // A call that reaches a drained channel is still carried, and its connection closes after it.
  EXPECT_EQ(call_all(1), 1);
  EXPECT_TRUE(server_connections_become(0)) << data_->connections() << " still open at the shard";
  EXPECT_EQ(channel.open_connections(), 0);
  EXPECT_FALSE(channel.broken());
}

}  // namespace
}  // namespace rubato
