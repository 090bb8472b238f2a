#include "worker/ring/ring_peer.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/security.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

// One rank's RingPeer server and mailbox on 127.0.0.1.
struct Peer {
  explicit Peer(int from_rank, ServerSecurity security = ServerSecurity())
      : mailbox(from_rank), service(&mailbox, security), credentials(security.credentials()) {}

  std::string Start(int port = 0) {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int bound = 0;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), credentials, &bound);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    return absl::StrCat("127.0.0.1:", bound);
  }

  // Ends open streams after at most 1 s (a plain Shutdown waits for them).
  void Stop() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
  ~Peer() { Stop(); }

  RingMailbox mailbox;
  RingPeerService service;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::unique_ptr<grpc::Server> server;
};

// Runs `rounds` all-reduces of `inputs` over gRPC, one thread and one server per rank.
std::vector<std::vector<float>> RunGrpcRing(const std::vector<std::vector<float>>& inputs,
                                            int rounds, std::vector<absl::Status>* statuses,
                                            int64_t segment = 0) {
  const int size = static_cast<int>(inputs.size());
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<std::string> addresses;
  for (int r = 0; r < size; ++r) {
    peers.push_back(std::make_unique<Peer>((r + size - 1) % size));
    addresses.push_back(peers.back()->Start());
  }
  std::vector<std::vector<float>> data(size);
  statuses->assign(size, absl::OkStatus());
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GrpcRingLink link(r, size, addresses[(r + 1) % size], &peers[r]->mailbox);
      for (int round = 0; round < rounds && (*statuses)[r].ok(); ++round) {
        data[r] = inputs[r];
        (*statuses)[r] = RingAllReduceMean(r, size, round, &link, absl::MakeSpan(data[r]),
                                           absl::Seconds(20), segment);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& p : peers) p->Stop();
  return data;
}

TEST(GrpcRingTest, MeanOnEveryRankBitIdenticalForOneToFiveRanks) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int size = 1; size <= 5; ++size) {
    for (int64_t n : {0, 1, 7, 1001, 300007}) {
      std::vector<std::vector<float>> inputs(size, std::vector<float>(n));
      for (auto& v : inputs) {
        for (float& x : v) x = normal(rng);
      }
      std::vector<absl::Status> statuses;
      const auto out = RunGrpcRing(inputs, /*rounds=*/3, &statuses, /*segment=*/n > 1000 ? 999 : 0);
      for (int r = 0; r < size; ++r) {
        ASSERT_TRUE(statuses[r].ok()) << "size " << size << " n " << n << ": " << statuses[r];
        ASSERT_EQ(out[r], out[0]) << "rank " << r << " differs; size " << size << ", n " << n;
      }
      for (int64_t i = 0; i < n; ++i) {
        double mean = 0;
        for (const auto& v : inputs) mean += v[i];
        mean /= size;
        ASSERT_NEAR(out[0][i], mean, 1e-5 * (1 + std::fabs(mean))) << "size " << size << " i " << i;
      }
    }
  }
}

TEST(GrpcRingTest, StartUpOrderDoesNotMatter) {
  // Rank 0 starts sending before rank 1 listens; rank 1 comes up 700 ms later on the port
  // rank 0 was given.
  Peer p0(1), p1(0);
  const std::string a0 = p0.Start();
  Peer probe(0);
  const std::string a1 = probe.Start();  // Reserve a free port, then free it for p1.
  probe.Stop();
  probe.server.reset();
  std::vector<float> d0 = {1, 2, 3}, d1 = {3, 4, 5};
  absl::Status s0, s1;
  std::thread t0([&] {
    GrpcRingLink link(0, 2, a1, &p0.mailbox);
    s0 = RingAllReduceMean(0, 2, 0, &link, absl::MakeSpan(d0), absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(700));
  const int port = std::stoi(a1.substr(a1.rfind(':') + 1));
  ASSERT_EQ(p1.Start(port), a1);
  std::thread t1([&] {
    GrpcRingLink link(1, 2, a0, &p1.mailbox);
    s1 = RingAllReduceMean(1, 2, 0, &link, absl::MakeSpan(d1), absl::Seconds(20));
  });
  t0.join();
  t1.join();
  ASSERT_TRUE(s0.ok()) << s0;
  ASSERT_TRUE(s1.ok()) << s1;
  EXPECT_EQ(d0, (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(d1, d0);
}

TEST(GrpcRingTest, AnUnreachableNextRankIsADeadlineNamingIt) {
  Peer p0(1);
  p0.Start();
  Peer probe(0);
  const std::string nobody = probe.Start();
  probe.Stop();
  std::vector<float> d = {1, 2, 3, 4};
  const absl::Time start = absl::Now();
  absl::Status s;
  {
    GrpcRingLink link(0, 2, nobody, &p0.mailbox, /*close_timeout=*/absl::Seconds(1));
    s = RingAllReduceMean(0, 2, 0, &link, absl::MakeSpan(d), absl::Seconds(1));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1")) << s;
}

TEST(GrpcRingTest, ADeadNextRankFailsTheSenderAtOnceEvenWhileItWaitsToReceive) {
  Peer p0(1), p1(0);
  p0.Start();
  const std::string a1 = p1.Start();
  // Before the link, so destroyed after it: the link sends from this memory without copying it,
  // and after the failure below a block may still be on its way until the link's destructor ends.
  std::vector<float> block(1000, 1.0f);
  GrpcRingLink link(0, 2, a1, &p0.mailbox, absl::Seconds(1));
  ASSERT_TRUE(link.Send(0, block).ok());
  ASSERT_TRUE(link.Flush(absl::Now() + absl::Seconds(10)).ok());
  // Rank 1 goes away while rank 0 waits for a block that will never come.
  std::thread stop([&] {
    absl::SleepFor(absl::Milliseconds(300));
    p1.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(10)));
  });
  const absl::Time start = absl::Now();
  std::vector<float> out(5);
  const absl::Status s = link.Receive(7, absl::MakeSpan(out), RingLink::Combine::kCopy,
                                      absl::Now() + absl::Seconds(30));
  stop.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(15)) << "waited for the deadline instead";
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1")) << s;
  EXPECT_FALSE(link.Send(1, block).ok());
}

// A next rank that is frozen but keeps its connection (as under SIGSTOP): it accepts the stream and
// never reads from it, so once HTTP/2 flow control's window is full, no write completes.
class FrozenRank final : public grpc::CallbackGenericService {
 public:
  std::string Start() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterCallbackGenericService(this);
    server_ = builder.BuildAndStart();
    return absl::StrCat("127.0.0.1:", port);
  }
  ~FrozenRank() override {
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      void OnCancel() override { Finish(grpc::Status::CANCELLED); }
      void OnDone() override { delete this; }
    };
    return new Reactor;
  }

 private:
  std::unique_ptr<grpc::Server> server_;
};

TEST(GrpcRingTest, TheDestructorCancelsAStreamToAFrozenRankAtItsCloseTimeout) {
  FrozenRank frozen;
  const std::string address = frozen.Start();
  RingMailbox mailbox(1);
  // 16 blocks of 256 KiB, far past the 64 KiB window (each under gRPC's default 4 MiB limit, so
  // that nothing refuses them); declared before the link, which sends from it.
  const std::vector<float> block(1 << 16, 1.0f);
  const absl::Time start = absl::Now();
  {
    GrpcRingLink link(0, 2, address, &mailbox, /*close_timeout=*/absl::Milliseconds(500));
    for (int64_t tag = 0; tag < 16; ++tag) ASSERT_TRUE(link.Send(tag, block).ok());
    // The rank never ends the call, whatever the transport buffered: the destructor must cancel
    // it at its close timeout and return once gRPC is done with the stream.
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(500)) << "gave up before the close timeout";
  EXPECT_LT(took, absl::Seconds(5)) << "the destructor did not cancel the stream promptly";
}

// A raw client of RingPeer.Stream, to send what a GrpcRingLink never would.
class RawSender {
 public:
  explicit RawSender(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub_(channel_),
        stream_(stub_.PrepareCall(&context_, "/rubato.RingPeer/Stream", &cq_)) {
    stream_->StartCall(Tag(1));
    Next();
  }
  ~RawSender() {
    context_.TryCancel();
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // Sends a RingBlock serialized by protobuf (so data may be empty or any bytes).
  void Send(int from, int64_t tag, const std::string& data) {
    RingBlock block;
    block.set_from_rank(from);
    block.set_tag(tag);
    block.set_data(data);
    const std::string bytes = block.SerializeAsString();
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    stream_->Write(buffer, Tag(2));
    Next();
  }
  void Cancel() { context_.TryCancel(); }

 private:
  static void* Tag(intptr_t i) { return reinterpret_cast<void*>(i); }
  void Next() {
    void* tag;
    bool ok;
    cq_.Next(&tag, &ok);
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
};

std::string FloatBytes(std::vector<float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

TEST(GrpcRingTest, MalformedBlocksAreNamedAndEndTheStream) {
  struct Case {
    int from;
    int64_t tag;
    std::string data;
    std::string error;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Case> cases = {
      {2, 0, FloatBytes({1, 2}), "came from rank 2, but this rank receives from rank 0 only"},
      {0, 0, std::string(5, 'x'), "has 5 bytes, not whole floats"},
      {0, -5, FloatBytes({1, 2}), "negative tag -5"},
  };
  for (const Case& c : cases) {
    Peer peer(0);
    const std::string address = peer.Start();
    RawSender sender(address);
    sender.Send(c.from, c.tag, c.data);
    std::vector<float> out(2);
    const absl::Status s = peer.mailbox.Take(0, absl::MakeSpan(out), RingLink::Combine::kCopy,
                                             absl::Now() + absl::Seconds(10));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.error)) << s;
    peer.Stop();
  }
  {
    Peer peer(0);
    RawSender sender(peer.Start());
    sender.Send(0, 4, FloatBytes({1, nan, 3}));
    sender.Send(0, 5, FloatBytes({1, 2}));
    std::vector<float> out(3, 0.0f);
    absl::Status s = peer.mailbox.Take(4, absl::MakeSpan(out), RingLink::Combine::kAdd,
                                       absl::Now() + absl::Seconds(10));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("non-finite value (nan) at element 1")) << s;
    s = peer.mailbox.Take(5, absl::MakeSpan(out), RingLink::Combine::kAdd,
                          absl::Now() + absl::Seconds(10));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("has 2 floats, expected 3")) << s;
    peer.Stop();
  }
  {
    Peer peer(0);
    RawSender sender(peer.Start());
    sender.Send(0, 9, FloatBytes({1}));
    sender.Send(0, 9, FloatBytes({1}));
    std::vector<float> out(1);
    ASSERT_TRUE(
        peer.mailbox
            .Take(9, absl::MakeSpan(out), RingLink::Combine::kCopy, absl::Now() + absl::Seconds(10))
            .ok());
    const absl::Status s = peer.mailbox.Take(10, absl::MakeSpan(out), RingLink::Combine::kCopy,
                                             absl::Now() + absl::Seconds(10));
    EXPECT_THAT(s.message(),
                HasSubstr("ring block 9 came after block 9 (repeated or out of order)"))
        << s;
    peer.Stop();
  }
}

TEST(GrpcRingTest, AStreamThatBreaksFailsTheReceiverAtOnceButKeepsWhatCame) {
  Peer peer(0);
  RawSender sender(peer.Start());
  sender.Send(0, 1, FloatBytes({5, 6}));
  absl::SleepFor(absl::Milliseconds(200));
  sender.Cancel();  // As if rank 0 was killed: no closing block.
  std::vector<float> out(2, 1.0f);
  ASSERT_TRUE(
      peer.mailbox
          .Take(1, absl::MakeSpan(out), RingLink::Combine::kAdd, absl::Now() + absl::Seconds(10))
          .ok());
  EXPECT_EQ(out, (std::vector<float>{6, 7}));
  const absl::Time start = absl::Now();
  const absl::Status s = peer.mailbox.Take(2, absl::MakeSpan(out), RingLink::Combine::kAdd,
                                           absl::Now() + absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("stream from rank 0")) << s;
  peer.Stop();
}

TEST(GrpcRingTest, PayloadsSplitAcrossSlicesAtAnyByte) {
  // The transport may cut a message anywhere; floats straddling slices must still add up.
  const std::vector<float> values = {1.5f, -2.25f, 3.0f, 1e-3f, 7.0f};
  RingBlock block;
  block.set_from_rank(0);
  block.set_tag(3);
  block.set_data(FloatBytes(values));
  const std::string bytes = block.SerializeAsString();
  for (size_t piece : {1, 2, 3, 5, 7, 64}) {
    std::vector<grpc::Slice> slices;
    for (size_t at = 0; at < bytes.size(); at += piece) {
      slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
    }
    grpc::ByteBuffer message(slices.data(), slices.size());
    int from = -1;
    int64_t tag = -1;
    RingPayload payload;
    ASSERT_TRUE(ParseRingBlock(message, &from, &tag, &payload).ok());
    EXPECT_EQ(from, 0);
    EXPECT_EQ(tag, 3);
    RingMailbox mailbox(0);
    ASSERT_TRUE(mailbox.Put(from, tag, std::move(payload)).ok());
    std::vector<float> out = {1, 1, 1, 1, 1};
    ASSERT_TRUE(mailbox.Take(3, absl::MakeSpan(out), RingLink::Combine::kAdd, absl::Now()).ok());
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(out[i], 1.0f + values[i]) << "pieces of " << piece << ", element " << i;
    }
  }
  // Not a RingBlock: data before the end, an unknown field, a data length of 2^48 in a 7-byte
  // varint (once read as 32 bits, i.e. 0: an empty block protobuf refuses; found by the fuzzer).
  RingBlock wrong = block;
  const std::string trailing = wrong.SerializeAsString() + std::string("\x08\x01", 2);
  const std::string huge_length("\x08\x02\x10\x03\x1a\x80\x80\x80\x80\x80\x80\x40", 12);
  ASSERT_FALSE(RingBlock().ParseFromString(huge_length));
  for (const std::string& text : {trailing, std::string("\x22\x01x", 3), huge_length}) {
    grpc::Slice slice(text);
    grpc::ByteBuffer message(&slice, 1);
    int from;
    int64_t tag;
    RingPayload payload;
    const absl::Status s = ParseRingBlock(message, &from, &tag, &payload);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
}

// Issue 9: with a job secret, a rank accepts a stream only from its previous rank, proven by that
// rank's token; anything else is refused before it reaches the mailbox.
TEST(GrpcRingTest, OnlyThePreviousRanksTokenOpensAStream) {
  const std::string path = ::testing::TempDir() + "/ring_test.secret";
  std::ofstream(path) << "a ring secret of thirty-two bytes";
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  SecurityConfig config;
  config.auth_secret_file = path;
  config.job_id = "ring-test";
  absl::StatusOr<ServerSecurity> server_security = ServerSecurity::Create(config);
  ASSERT_TRUE(server_security.ok()) << server_security.status();
  Peer receiver(/*from_rank=*/0, *server_security);  // Rank 1: its previous rank is 0.
  const std::string address = receiver.Start();
  const std::vector<float> block = {1, 2, 3};

  SecurityConfig other = config;
  other.auth_secret_file = ::testing::TempDir() + "/ring_test_other.secret";
  std::ofstream(other.auth_secret_file) << "some other job's secret, also long";
  ASSERT_EQ(chmod(other.auth_secret_file.c_str(), 0600), 0);
  const std::vector<std::pair<std::string, ClientSecurity>> refused = {
      {"no token", ClientSecurity()},
      {"rank 1's token", *ClientSecurity::Create(config, 1)},
      {"another job's token", *ClientSecurity::Create(other, 0)},
  };
  for (const auto& [what, security] : refused) {
    RingMailbox own(1);
    GrpcRingLink link(0, 2, address, &own, absl::Seconds(1), security);
    // The refusal may come back before the first Send, which then fails at once with it.
    absl::Status s = link.Send(0, block);
    if (s.ok()) s = link.Flush(absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(absl::IsUnauthenticated(s) || absl::IsPermissionDenied(s)) << what << ": " << s;
  }
  std::vector<float> out(3, 0.0f);
  EXPECT_TRUE(absl::IsDeadlineExceeded(receiver.mailbox.Take(
      0, absl::MakeSpan(out), RingLink::Combine::kCopy, absl::Now() + absl::Milliseconds(100))))
      << "a refused stream delivered a block";

  RingMailbox own(1);
  GrpcRingLink link(0, 2, address, &own, absl::Seconds(1), *ClientSecurity::Create(config, 0));
  ASSERT_TRUE(link.Send(0, block).ok());
  ASSERT_TRUE(link.Flush(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE(
      receiver.mailbox
          .Take(0, absl::MakeSpan(out), RingLink::Combine::kCopy, absl::Now() + absl::Seconds(10))
          .ok());
  EXPECT_EQ(out, block);
}

}  // namespace
}  // namespace rubato
