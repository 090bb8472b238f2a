#include "worker/ring/ring_tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/security.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/ring.grpc.pb.h"
#include "worker/ring/allreduce_client.h"
#include "worker/ring/ring_peer.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<TcpRingListener> Listen(int from_rank) {
  absl::StatusOr<std::unique_ptr<TcpRingListener>> l =
      TcpRingListener::Create("127.0.0.1", 0, from_rank);
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? std::move(*l) : nullptr;
}

// One rank's RingPeer server, mailbox and TCP data listener on 127.0.0.1.
struct Peer {
  explicit Peer(int from_rank, ServerSecurity security = ServerSecurity())
      : mailbox(from_rank),
        listener(Listen(from_rank)),
        service(&mailbox, security, listener.get()),
        credentials(security.credentials()) {}

  std::string Start(int port = 0) {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int bound = 0;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), credentials, &bound);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    return absl::StrCat("127.0.0.1:", bound);
  }
  void Stop() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
  ~Peer() { Stop(); }

  RingMailbox mailbox;
  std::unique_ptr<TcpRingListener> listener;
  RingPeerService service;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::unique_ptr<grpc::Server> server;
};

// `rounds` all-reduces of `inputs` over TcpRingLinks, one thread and one Peer per rank.
std::vector<std::vector<float>> RunTcpRing(const std::vector<std::vector<float>>& inputs,
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
      TcpRingLink link(r, size, addresses[(r + 1) % size], peers[r]->listener.get());
      for (int round = 0; round < rounds && (*statuses)[r].ok(); ++round) {
        data[r] = inputs[r];
        (*statuses)[r] = RingAllReduceMean(r, size, round, &link, absl::MakeSpan(data[r]),
                                           absl::Seconds(20), segment);
      }
    });
  }
  for (auto& t : threads) t.join();
  return data;
}

// A data connection opened by hand, as rank `from` (OpenData with `security`, then the hello with
// the ticket, or with `ticket` instead when given). -1 if OpenData failed (`status` says why).
int OpenRaw(const std::string& address, int from, absl::Status* status,
            const ClientSecurity& security = ClientSecurity(),
            const std::string* ticket = nullptr) {
  auto stub = RingPeer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  security.Attach(&context);
  OpenDataRequest request;
  request.set_from_rank(from);
  OpenDataReply reply;
  const grpc::Status s = stub->OpenData(&context, request, &reply);
  *status = absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  if (!s.ok()) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(reply.port());
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  char hello[kRingHelloBytes] = {'R', 'B', 'R', 'I', 'N', 'G', '1', '\0'};
  const int32_t from32 = from, size = 2;
  std::memcpy(hello + 8, &from32, 4);
  std::memcpy(hello + 12, &size, 4);
  const std::string& t = ticket != nullptr ? *ticket : reply.ticket();
  std::memcpy(hello + 16, t.data(), std::min(t.size(), kRingTicketBytes));
  EXPECT_EQ(::send(fd, hello, sizeof(hello), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(hello)));
  return fd;
}

void WriteFrame(int fd, int64_t tag, const std::vector<float>& data, int64_t bytes = -1) {
  char header[16];
  const int64_t n = bytes >= 0 ? bytes : static_cast<int64_t>(data.size() * 4);
  std::memcpy(header, &tag, 8);
  std::memcpy(header + 8, &n, 8);
  ASSERT_EQ(::send(fd, header, 16, MSG_NOSIGNAL), 16);
  if (!data.empty()) {
    ASSERT_EQ(::send(fd, data.data(), data.size() * 4, MSG_NOSIGNAL),
              static_cast<ssize_t>(data.size() * 4));
  }
}

// True once the peer closed `fd` (EOF or reset) within 5 s.
bool ClosedByPeer(int fd) {
  timeval t{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  char c;
  const ssize_t n = ::recv(fd, &c, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

TEST(TcpRingTest, MeanOnEveryRankBitIdenticalForOneToFourRanks) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int size = 1; size <= 4; ++size) {
    for (int64_t n : {0, 1, 7, 1001, 300007}) {
      std::vector<std::vector<float>> inputs(size, std::vector<float>(n));
      for (auto& v : inputs) {
        for (float& x : v) x = normal(rng);
      }
      const int64_t segment = n > 1000 ? 999 : 0;
      std::vector<absl::Status> statuses;
      const auto out = RunTcpRing(inputs, /*rounds=*/3, &statuses, segment);
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

// Rank 0 sends toward rank 1's port at once; rank 1 comes up on that port `delay` later. Each
// rank's status of the mean of `d0` and `d1` (in place).
std::pair<absl::Status, absl::Status> SecondRankLate(absl::Duration delay, std::vector<float>* d0,
                                                     std::vector<float>* d1) {
  Peer p0(1);
  const std::string a0 = p0.Start();
  Peer probe(0);
  const std::string a1 = probe.Start();
  const int port1 = std::stoi(a1.substr(a1.rfind(':') + 1));
  probe.Stop();
  probe.server.reset();
  absl::Status s0, s1;
  std::thread rank0([&] {
    TcpRingLink link(0, 2, a1, p0.listener.get());
    s0 = RingAllReduceMean(0, 2, 0, &link, absl::MakeSpan(*d0), absl::Seconds(30));
  });
  absl::SleepFor(delay);
  Peer p1(0);
  EXPECT_EQ(p1.Start(port1), a1);
  {
    TcpRingLink link(1, 2, a0, p1.listener.get());
    s1 = RingAllReduceMean(1, 2, 0, &link, absl::MakeSpan(*d1), absl::Seconds(30));
  }
  rank0.join();
  return {s0, s1};
}

TEST(TcpRingTest, StartUpOrderDoesNotMatter) {
  std::vector<float> d0 = {1, 2, 3, 4, 5}, d1 = {5, 4, 3, 2, 1};
  const auto [s0, s1] = SecondRankLate(absl::Milliseconds(700), &d0, &d1);
  ASSERT_TRUE(s0.ok()) << s0;
  ASSERT_TRUE(s1.ok()) << s1;
  EXPECT_EQ(d0, std::vector<float>(5, 3.0f));
  EXPECT_EQ(d1, d0);
}

TEST(TcpRingTest, ANextRankUpOnlyAfterSeveralSecondsIsStillFound) {
  // Past the first 5 s of refused attempts the sender makes its channel anew (a subchannel of
  // its own); the next rank that comes up after that is found all the same.
  std::vector<float> d0 = {1, 2}, d1 = {3, 4};
  const auto [s0, s1] = SecondRankLate(absl::Milliseconds(6500), &d0, &d1);
  ASSERT_TRUE(s0.ok()) << s0;
  ASSERT_TRUE(s1.ok()) << s1;
  EXPECT_EQ(d0, std::vector<float>({2.0f, 3.0f}));
  EXPECT_EQ(d1, d0);
}

TEST(TcpRingTest, AnUnreachableNextRankIsADeadlineNamingIt) {
  Peer p0(1);
  p0.Start();
  Peer probe(0);
  const std::string nobody = probe.Start();
  probe.Stop();
  std::vector<float> d = {1, 2, 3, 4};
  const absl::Time start = absl::Now();
  absl::Status s;
  {
    TcpRingLink link(0, 2, nobody, p0.listener.get(), absl::Seconds(1));
    s = RingAllReduceMean(0, 2, 0, &link, absl::MakeSpan(d), absl::Seconds(1));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1")) << s;
  // What gRPC answered the newest attempt, beside the probe's own finding.
  EXPECT_THAT(s.message(), HasSubstr("connection refused")) << s;
  EXPECT_THAT(s.message(), HasSubstr("its newest OpenData attempt: ")) << s;
}

TEST(TcpRingTest, OnlyThePreviousRanksTokenGetsATicket) {
  const std::string path = ::testing::TempDir() + "/ring_tcp_test.secret";
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
  for (const auto& [what, security] : std::vector<std::pair<std::string, ClientSecurity>>{
           {"no token", ClientSecurity()},
           {"rank 1's token", *ClientSecurity::Create(config, 1)}}) {
    Peer own(1);
    TcpRingLink link(0, 2, address, own.listener.get(), absl::Seconds(1), security);
    absl::Status s = link.Send(0, block);
    if (s.ok()) s = link.Flush(absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(absl::IsUnauthenticated(s) || absl::IsPermissionDenied(s)) << what << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("refused a data connection")) << what;
  }
  // Rank 0's token, but a request that says it is rank 1.
  absl::Status open;
  EXPECT_EQ(OpenRaw(address, 1, &open, *ClientSecurity::Create(config, 0)), -1);
  EXPECT_TRUE(absl::IsPermissionDenied(open)) << open;

  Peer own(1);
  std::vector<float> out(3, 0.0f);
  TcpRingLink link(0, 2, address, own.listener.get(), absl::Seconds(1),
                   *ClientSecurity::Create(config, 0));
  TcpRingLink receiving(1, 2, "127.0.0.1:1", receiver.listener.get(), absl::Seconds(1));
  ASSERT_TRUE(link.Send(0, block).ok());
  ASSERT_TRUE(link.Flush(absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE(receiving
                  .Receive(0, absl::MakeSpan(out), RingLink::Combine::kCopy,
                           absl::Now() + absl::Seconds(10))
                  .ok());
  EXPECT_EQ(out, block);
}

TEST(TcpRingTest, ConnectionsWithoutTheTicketAreRefusedAndTheRightOneStillGetsIn) {
  Peer receiver(0);
  const std::string address = receiver.Start();
  absl::Status open;
  // Garbage, a wrong ticket, a replayed ticket, and one that says nothing at all.
  const int port = receiver.listener->port();
  std::vector<int> refused;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n and then some more bytes...";
    ASSERT_GT(::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL), 0);
    refused.push_back(fd);
  }
  const std::string wrong(kRingTicketBytes, 'x');
  refused.push_back(OpenRaw(address, 0, &open, ClientSecurity(), &wrong));
  ASSERT_TRUE(open.ok()) << open;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    refused.push_back(fd);  // Silent: dropped after the hello timeout.
  }
  // The sender's OpenData retries can be answered out of order (one it gave up on, after the one
  // it used): a ticket issued before later ones still opens the connection.
  const int good = OpenRaw(address, 0, &open);
  ASSERT_TRUE(open.ok()) << open;
  ASSERT_TRUE(receiver.listener->IssueTicket().ok());

  TcpRingLink receiving(1, 2, "127.0.0.1:1", receiver.listener.get(), absl::Seconds(1));
  WriteFrame(good, 0, {7, 8, 9});
  std::vector<float> out(3, 1.0f);
  const absl::Status s = receiving.Receive(0, absl::MakeSpan(out), RingLink::Combine::kAdd,
                                           absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out, std::vector<float>({8, 9, 10}));
  for (size_t i = 0; i < refused.size(); ++i) {
    EXPECT_TRUE(ClosedByPeer(refused[i])) << "connection " << i << " was not refused";
    ::close(refused[i]);
  }
  WriteFrame(good, kRingClosingTag, {});
  ::close(good);
}

TEST(TcpRingTest, OnlyTheLastFewTicketsAreHonouredAndTheFirstConnectionUsesThemUp) {
  absl::StatusOr<std::unique_ptr<TcpRingListener>> listener =
      TcpRingListener::Create("127.0.0.1", 0, 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::vector<std::string> tickets;
  for (size_t i = 0; i < kRingOutstandingTickets + 1; ++i) {
    absl::StatusOr<std::string> t = (*listener)->IssueTicket();
    ASSERT_TRUE(t.ok()) << t.status();
    tickets.push_back(*t);
  }
  auto hello = [&](const std::string& ticket) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons((*listener)->port());
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    char bytes[kRingHelloBytes] = {'R', 'B', 'R', 'I', 'N', 'G', '1', '\0'};
    const int32_t from = 0, size = 2;
    std::memcpy(bytes + 8, &from, 4);
    std::memcpy(bytes + 12, &size, 4);
    std::memcpy(bytes + 16, ticket.data(), kRingTicketBytes);
    EXPECT_EQ(::send(fd, bytes, sizeof(bytes), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(bytes)));
    return fd;
  };
  // The oldest ticket has been pushed out by the newer ones; the second oldest still opens.
  const int evicted = hello(tickets[0]);
  const int second = hello(tickets[1]);
  absl::StatusOr<int> accepted = (*listener)->Accept(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE(ClosedByPeer(evicted));
  // It was the second connection that got in: the accepted socket reads what `second` writes.
  ASSERT_EQ(::send(second, "x", 1, MSG_NOSIGNAL), 1);
  char c = 0;
  timeval t{5, 0};
  ::setsockopt(*accepted, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  ::fcntl(*accepted, F_SETFL, 0);
  EXPECT_EQ(::recv(*accepted, &c, 1, 0), 1);
  EXPECT_EQ(c, 'x');
  // The listener is done: nothing else is accepted, with any ticket.
  EXPECT_EQ((*listener)->Accept(absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ::close(evicted);
  ::close(second);
  ::close(*accepted);
}

TEST(TcpRingTest, ConnectWaitsForBothNeighboursAndNamesTheOneMissing) {
  // Rank 0 of 2 whose next (rank 1) is up but never connects back: Connect gets its outgoing
  // connection and then times out naming rank 1 as the one that did not open its own.
  Peer zero(1), one(0);
  const std::string zero_address = zero.Start();
  const std::string one_address = one.Start();
  {
    TcpRingLink link(0, 2, one_address, zero.listener.get(), absl::Seconds(1));
    const absl::Time began = absl::Now();
    const absl::Status s = link.Connect(absl::Now() + absl::Milliseconds(1500));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("from rank 1"));
    EXPECT_THAT(s.message(), HasSubstr("did not open its data connection"));
    EXPECT_LT(absl::Now() - began, absl::Seconds(5));
  }
  // Both ranks up, started a second apart: both Connects succeed, and an all-reduce follows.
  std::vector<float> a = {1, 2, 3}, b = {3, 4, 5};
  absl::Status sa, sb;
  Peer zero2(1), one2(0);
  const std::string z2 = zero2.Start();
  const std::string o2 = one2.Start();
  std::thread late([&] {
    absl::SleepFor(absl::Seconds(1));
    TcpRingLink link(1, 2, z2, one2.listener.get());
    sb = link.Connect(absl::Now() + absl::Seconds(10));
    if (sb.ok()) sb = RingAllReduceMean(1, 2, 0, &link, absl::MakeSpan(b), absl::Seconds(10));
  });
  {
    TcpRingLink link(0, 2, o2, zero2.listener.get());
    sa = link.Connect(absl::Now() + absl::Seconds(10));
    if (sa.ok()) sa = RingAllReduceMean(0, 2, 0, &link, absl::MakeSpan(a), absl::Seconds(10));
    late.join();
  }
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;
  EXPECT_EQ(a, std::vector<float>({2, 3, 4}));
  EXPECT_EQ(b, a);
}

// A receiving rank fed by hand through a valid data connection.
struct FedRank {
  FedRank() : peer(0), address(peer.Start()) {
    absl::Status open;
    fd = OpenRaw(address, 0, &open);
    EXPECT_TRUE(open.ok()) << open;
    link =
        std::make_unique<TcpRingLink>(1, 2, "127.0.0.1:1", peer.listener.get(), absl::Seconds(1));
  }
  ~FedRank() {
    link.reset();
    if (fd >= 0) ::close(fd);
  }
  absl::Status Receive(int64_t tag, size_t n, absl::Duration wait = absl::Seconds(10)) {
    std::vector<float> out(n);
    return link->Receive(tag, absl::MakeSpan(out), RingLink::Combine::kAdd, absl::Now() + wait);
  }
  Peer peer;
  std::string address;
  int fd = -1;
  std::unique_ptr<TcpRingLink> link;
};

TEST(TcpRingTest, MalformedFramesAreNamedAndEndTheLink) {
  {
    FedRank r;
    WriteFrame(r.fd, 5, {1, 2});
    const absl::Status s = r.Receive(4, 2);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("block 5 from rank 0 came when block 4 was expected"));
    EXPECT_EQ(r.Receive(5, 2).code(), s.code()) << "the link went on after a bad frame";
  }
  {
    FedRank r;
    WriteFrame(r.fd, 0, {1, 2, 3});
    const absl::Status s = r.Receive(0, 2);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("has 12 bytes, expected 8"));
  }
  {
    FedRank r;
    WriteFrame(r.fd, 0, {1, std::numeric_limits<float>::quiet_NaN(), 3});
    const absl::Status s = r.Receive(0, 3);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("non-finite"));
  }
  {
    FedRank r;
    WriteFrame(r.fd, 0, {}, /*bytes=*/int64_t{1} << 40);  // A huge claimed size allocates nothing.
    const absl::Status s = r.Receive(0, 3);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  }
  {
    FedRank r;
    WriteFrame(r.fd, kRingClosingTag, {});
    const absl::Status s = r.Receive(0, 3);
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 0 closed its link before sending block 0"));
  }
  {
    // A give-up note: its code and text (made printable) become the receiver's error.
    FedRank r;
    const int32_t code = static_cast<int32_t>(absl::StatusCode::kResourceExhausted);
    std::string note(reinterpret_cast<const char*>(&code), 4);
    note += "out of\nmemory";
    WriteFrame(r.fd, kRingGiveUpTag, {}, note.size());
    ASSERT_EQ(::send(r.fd, note.data(), note.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(note.size()));
    const absl::Status s = r.Receive(0, 3);
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 0 gave up: out of?memory"));
  }
  for (int64_t bytes : {int64_t{2}, int64_t{5000}}) {
    FedRank r;
    WriteFrame(r.fd, kRingGiveUpTag, {}, bytes);
    const absl::Status s = r.Receive(0, 3);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bytes << ": " << s;
  }
}

TEST(TcpRingTest, APreviousRankThatDiesFailsTheReceiverAtOnceButWhatCameCounts) {
  FedRank r;
  WriteFrame(r.fd, 0, {1, 2});
  ASSERT_TRUE(r.Receive(0, 2).ok());
  WriteFrame(r.fd, 1, {1, 2, 3, 4}, /*bytes=*/32);  // Half a block, then nothing.
  std::thread die([&] {
    absl::SleepFor(absl::Milliseconds(200));
    ::close(r.fd);
    r.fd = -1;
  });
  const absl::Time start = absl::Now();
  std::vector<float> out(8);
  const absl::Status s = r.link->Receive(1, absl::MakeSpan(out), RingLink::Combine::kCopy,
                                         absl::Now() + absl::Seconds(30));
  die.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "waited for the deadline instead";
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("from rank 0 broke"));
}

TEST(TcpRingTest, ASpinningReceiveTakesBlocksThatComeDuringOrAfterItsSpinAndKeepsItsDeadline) {
  {
    FedRank r;
    r.link->SetReceiveSpin(absl::Milliseconds(50));
    std::thread feed([&] {
      absl::SleepFor(absl::Milliseconds(5));  // Within the spin.
      WriteFrame(r.fd, 0, {1, 2, 3});
      absl::SleepFor(absl::Milliseconds(300));  // Past it: the receiver sleeps in poll by then.
      WriteFrame(r.fd, 1, {4, 5, 6});
    });
    std::vector<float> out(3);
    const absl::Status s0 = r.link->Receive(0, absl::MakeSpan(out), RingLink::Combine::kCopy,
                                            absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(s0.ok()) << s0;
    EXPECT_EQ(out, std::vector<float>({1, 2, 3}));
    const absl::Status s1 = r.link->Receive(1, absl::MakeSpan(out), RingLink::Combine::kAdd,
                                            absl::Now() + absl::Seconds(10));
    feed.join();
    EXPECT_TRUE(s1.ok()) << s1;
    EXPECT_EQ(out, std::vector<float>({5, 7, 9}));
  }
  {
    // A spin longer than the wait ends at the deadline, naming whom it waited for.
    FedRank r;
    r.link->SetReceiveSpin(absl::Seconds(30));
    const absl::Time start = absl::Now();
    const absl::Status s = r.Receive(0, 3, absl::Milliseconds(100));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "spun past the deadline";
    EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("from rank 0"));
  }
}

TEST(TcpRingTest, ADeadNextRankFailsSendsToItAtOnceNamingIt) {
  Peer p0(1);
  p0.Start();
  auto p1 = std::make_unique<Peer>(0);
  const std::string a1 = p1->Start();
  std::vector<float> block(1000, 1.0f);
  TcpRingLink link(0, 2, a1, p0.listener.get(), absl::Seconds(1));
  ASSERT_TRUE(link.Send(0, block).ok());
  ASSERT_TRUE(link.Flush(absl::Now() + absl::Seconds(10)).ok());
  {
    // Rank 1 takes the connection, then goes away.
    absl::StatusOr<int> fd = p1->listener->Accept(absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(fd.ok()) << fd.status();
    ::close(*fd);
    p1.reset();
  }
  // The first write after the close may still be taken by the kernel; the reset follows at once.
  absl::Status s;
  const absl::Time start = absl::Now();
  for (int64_t tag = 1; s.ok() && absl::Now() - start < absl::Seconds(5); ++tag) {
    s = link.Send(tag, block);
    if (s.ok()) s = link.Flush(absl::Now() + absl::Seconds(1));
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1")) << s;
  EXPECT_FALSE(link.Send(99, block).ok()) << "a failed link took another block";
}

TEST(TcpRingTest, ARankThatGivesUpTellsTheNextWhySoEveryErrorNamesTheCause) {
  // Ranks 0 and 2 of 3 all-reduce; rank 1 is up (its server answers) but never takes part, as if
  // stopped. Rank 2 waits for rank 1 until its 1 s deadline, then gives up and tells rank 0, which
  // would otherwise wait 20 s: rank 0's error names rank 1 too, with the same code.
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<std::string> addresses;
  for (int r = 0; r < 3; ++r) {
    peers.push_back(std::make_unique<Peer>((r + 2) % 3));
    addresses.push_back(peers.back()->Start());
  }
  std::vector<float> d0(1000, 1.0f), d2(1000, 2.0f);
  absl::Status s0, s2;
  const absl::Time start = absl::Now();
  absl::Duration took0;
  std::thread rank0([&] {
    TcpRingLink link(0, 3, addresses[1], peers[0]->listener.get());
    s0 = RingAllReduceMean(0, 3, 0, &link, absl::MakeSpan(d0), absl::Seconds(20));
    took0 = absl::Now() - start;
  });
  {
    TcpRingLink link(2, 3, addresses[0], peers[2]->listener.get());
    s2 = RingAllReduceMean(2, 3, 0, &link, absl::MakeSpan(d2), absl::Seconds(1));
  }
  rank0.join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s2)) << s2;
  EXPECT_THAT(s2.message(), HasSubstr("from rank 1"));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s0)) << s0;
  EXPECT_THAT(s0.message(), HasSubstr("rank 2 gave up"));
  EXPECT_THAT(s0.message(), HasSubstr("from rank 1"));
  EXPECT_LT(took0, absl::Seconds(10)) << "rank 0 waited for its own deadline instead";
}

TEST(TcpRingTest, AFrozenNextRankIsAFlushDeadlineAndTheDestructorDoesNotWaitForIt) {
  Peer p0(1);
  p0.Start();
  Peer p1(0);
  const std::string a1 = p1.Start();
  std::vector<float> block(16 << 20, 1.0f);  // 64 MiB: more than the sockets can hold.
  const absl::Time start = absl::Now();
  {
    TcpRingLink link(0, 2, a1, p0.listener.get(), absl::Seconds(5));
    ASSERT_TRUE(link.Send(0, block).ok());
    const absl::Status s = link.Flush(absl::Now() + absl::Seconds(1));  // Rank 1 never reads.
    EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 1"));
    EXPECT_THAT(s.message(), HasSubstr("not taken"));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << "the destructor waited for the frozen rank";
}

TEST(TcpRingTest, TransportChoice) {
  EXPECT_EQ(*ResolveRingTransport(RingTransport::kAuto, /*tls=*/false), RingTransport::kTcp);
  EXPECT_EQ(*ResolveRingTransport(RingTransport::kAuto, /*tls=*/true), RingTransport::kGrpc);
  EXPECT_EQ(*ResolveRingTransport(RingTransport::kGrpc, /*tls=*/false), RingTransport::kGrpc);
  const absl::StatusOr<RingTransport> tcp_tls = ResolveRingTransport(RingTransport::kTcp, true);
  EXPECT_TRUE(absl::IsInvalidArgument(tcp_tls.status())) << tcp_tls.status();
  EXPECT_EQ(*ParseRingTransport("tcp"), RingTransport::kTcp);
  const absl::StatusOr<RingTransport> bad = ParseRingTransport("udp");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(bad.status().message(), HasSubstr("--ring_transport"));
}

TEST(TcpRingTest, AGrpcOnlyRankRefusesOpenDataNamingTheFlag) {
  RingMailbox mailbox(0);
  RingPeerService service(&mailbox);  // No data listener.
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  Peer own(1);
  TcpRingLink link(0, 2, absl::StrCat("127.0.0.1:", port), own.listener.get(), absl::Seconds(1));
  absl::Status s = link.Send(0, std::vector<float>{1});
  if (s.ok()) s = link.Flush(absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("--ring_transport"));
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

}  // namespace
}  // namespace rubato
