#include "common/tls_stream.h"

#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "common/socket_io.h"
#include "common/test_certificates.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

class TlsStreamTest : public testing::Test {
 protected:

  // A connected pair of non-blocking sockets over 127.0.0.1: {server end, client end}.
  std::pair<int, int> Connect() {
    absl::StatusOr<Listening> l = ListenTcp("127.0.0.1", 0, 4);
    EXPECT_TRUE(l.ok()) << l.status();
    absl::StatusOr<int> client = ConnectTcp("127.0.0.1", l->port, absl::Seconds(5));
    EXPECT_TRUE(client.ok()) << client.status();
    int server = -1;
    for (int i = 0; i < 500 && server < 0; ++i) {
      server = ::accept4(l->fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (server < 0) ::usleep(1000);
    }
    ::close(l->fd);
    EXPECT_GE(server, 0);
    return {server, *client};
  }

  // Both handshakes at once; {server's error, client's error}.
  std::pair<std::string, std::string> Handshake(DataSocket* server, const TlsContext& server_tls,
                                                DataSocket* client, const TlsContext& client_tls,
                                                const std::string& host = "127.0.0.1") {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    std::string server_error;
    std::thread t([&] { server_error = server->HandshakeAsServer(server_tls, deadline); });
    std::string client_error = client->HandshakeAsClient(client_tls, host, deadline);
    t.join();
    return {server_error, client_error};
  }

  TestCa ca_{"test CA"};
  TestIdentity server_ = ca_.Issue("server", "IP:127.0.0.1");
  TestIdentity client_ = ca_.Issue("client", "DNS:worker");
};

TEST_F(TlsStreamTest, MutualTlsCarriesBytesExactlyEachWay) {
  auto server_tls = TlsContext::ForServer(server_.cert, server_.key, ca_.cert());
  auto client_tls = TlsContext::ForClient(ca_.cert(), client_.cert, client_.key);
  ASSERT_TRUE(server_tls.ok()) << server_tls.status();
  ASSERT_TRUE(client_tls.ok()) << client_tls.status();
  auto [sfd, cfd] = Connect();
  DataSocket server(sfd), client(cfd);
  auto [se, ce] = Handshake(&server, **server_tls, &client, **client_tls);
  ASSERT_EQ(se, "");
  ASSERT_EQ(ce, "");
  EXPECT_TRUE(server.encrypted());

  // A request as the data plane writes one: a small header, small pieces and a large one.
  std::string header(24, 'h'), small(100, 's'), large(5 << 20, 'x');
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<char>(i * 131 + 7);
  std::vector<iovec> iov = {{header.data(), header.size()},
                            {small.data(), small.size()},
                            {large.data(), large.size()},
                            {small.data(), 3}};
  const std::string want = header + small + large + small.substr(0, 3);
  std::string got(want.size(), '\0');
  std::string why;
  ReadEnd end = ReadEnd::kError;
  std::thread reader([&] {
    end = server.Read(got.data(), got.size(), absl::Now() + absl::Seconds(20), &why,
                      absl::Microseconds(50));
  });
  EXPECT_EQ(client.Write(iov.data(), static_cast<int>(iov.size()),
                         absl::Now() + absl::Seconds(20)),
            "");
  reader.join();
  ASSERT_EQ(end, ReadEnd::kDone) << why;
  EXPECT_TRUE(got == want) << "the bytes read differ from the bytes written";

  // And back, then an orderly close is kClosed, not an error.
  std::vector<iovec> answer = {{small.data(), small.size()}};
  EXPECT_EQ(server.Write(answer.data(), 1, absl::Now() + absl::Seconds(5)), "");
  std::string back(small.size(), '\0');
  ASSERT_EQ(client.Read(back.data(), back.size(), absl::Now() + absl::Seconds(5), &why),
            ReadEnd::kDone)
      << why;
  EXPECT_EQ(back, small);
  ::close(sfd);
  char byte;
  EXPECT_EQ(client.Read(&byte, 1, absl::Now() + absl::Seconds(5), &why), ReadEnd::kClosed) << why;
  ::close(cfd);
}

TEST_F(TlsStreamTest, AReadWaitsNoLongerThanItsDeadline) {
  auto server_tls = TlsContext::ForServer(server_.cert, server_.key, "");
  auto client_tls = TlsContext::ForClient(ca_.cert(), "", "");
  ASSERT_TRUE(server_tls.ok() && client_tls.ok());
  auto [sfd, cfd] = Connect();
  DataSocket server(sfd), client(cfd);
  auto [se, ce] = Handshake(&server, **server_tls, &client, **client_tls);
  ASSERT_EQ(se + ce, "");
  char byte;
  std::string why;
  const absl::Time start = absl::Now();
  EXPECT_EQ(server.Read(&byte, 1, start + absl::Milliseconds(200), &why), ReadEnd::kTimedOut);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ::close(sfd);
  ::close(cfd);
}

TEST_F(TlsStreamTest, ACertificateOfAnotherCaOrAnotherHostIsRefused) {
  TestCa other_ca("another CA");
  const TestIdentity impostor = other_ca.Issue("server", "IP:127.0.0.1");
  auto client_tls = TlsContext::ForClient(ca_.cert(), "", "");
  ASSERT_TRUE(client_tls.ok());
  {
    auto server_tls = TlsContext::ForServer(impostor.cert, impostor.key, "");
    ASSERT_TRUE(server_tls.ok());
    auto [sfd, cfd] = Connect();
    DataSocket server(sfd), client(cfd);
    auto [se, ce] = Handshake(&server, **server_tls, &client, **client_tls);
    EXPECT_NE(ce.find("certificate verify failed"), std::string::npos) << ce;
    EXPECT_NE(se, "");
    ::close(sfd);
    ::close(cfd);
  }
  {
    // The right CA, but the certificate names 127.0.0.1 and the client dialled "shard-0".
    auto server_tls = TlsContext::ForServer(server_.cert, server_.key, "");
    ASSERT_TRUE(server_tls.ok());
    auto [sfd, cfd] = Connect();
    DataSocket server(sfd), client(cfd);
    auto [se, ce] = Handshake(&server, **server_tls, &client, **client_tls, "shard-0");
    EXPECT_NE(ce.find("certificate verify failed"), std::string::npos) << ce;
    EXPECT_NE(ce.find("mismatch"), std::string::npos) << ce;
    ::close(sfd);
    ::close(cfd);
  }
}

TEST_F(TlsStreamTest, MutualTlsRefusesAClientWithoutACertificate) {
  auto server_tls = TlsContext::ForServer(server_.cert, server_.key, ca_.cert());
  auto client_tls = TlsContext::ForClient(ca_.cert(), "", "");
  ASSERT_TRUE(server_tls.ok() && client_tls.ok());
  auto [sfd, cfd] = Connect();
  DataSocket server(sfd), client(cfd);
  auto [se, ce] = Handshake(&server, **server_tls, &client, **client_tls);
  EXPECT_NE(se.find("certificate"), std::string::npos) << se;
  // TLS 1.3: the client learns of it at its first read at the latest.
  char byte;
  std::string why;
  if (ce.empty()) {
    EXPECT_NE(client.Read(&byte, 1, absl::Now() + absl::Seconds(5), &why), ReadEnd::kDone);
  }
  ::close(sfd);
  ::close(cfd);
}

TEST_F(TlsStreamTest, APlaintextOrSilentClientEndsTheHandshakeByItsDeadline) {
  auto server_tls = TlsContext::ForServer(server_.cert, server_.key, "");
  ASSERT_TRUE(server_tls.ok());
  {
    auto [sfd, cfd] = Connect();
    DataSocket server(sfd);
    const std::string hello = "RBPSDAT2 and some plaintext that is not a TLS record at all";
    ASSERT_EQ(::write(cfd, hello.data(), hello.size()), static_cast<ssize_t>(hello.size()));
    const std::string e = server.HandshakeAsServer(**server_tls, absl::Now() + absl::Seconds(5));
    EXPECT_NE(e, "");
    ::close(sfd);
    ::close(cfd);
  }
  {
    auto [sfd, cfd] = Connect();
    DataSocket server(sfd);
    const absl::Time start = absl::Now();
    const std::string e =
        server.HandshakeAsServer(**server_tls, start + absl::Milliseconds(300));
    EXPECT_EQ(e, "the TLS handshake timed out");
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
    ::close(sfd);
    ::close(cfd);
  }
}

TEST_F(TlsStreamTest, BadPemIsRefusedNamingWhatIsWrong) {
  auto no_cert = TlsContext::ForServer("not a certificate", server_.key, "");
  EXPECT_FALSE(no_cert.ok());
  EXPECT_NE(no_cert.status().message().find("certificate file holds no PEM certificate"),
            std::string::npos)
      << no_cert.status();
  auto wrong_key = TlsContext::ForServer(server_.cert, client_.key, "");
  EXPECT_FALSE(wrong_key.ok());
  EXPECT_NE(wrong_key.status().message().find("does not go with the certificate"),
            std::string::npos)
      << wrong_key.status();
  auto no_ca = TlsContext::ForClient("garbage", "", "");
  EXPECT_FALSE(no_ca.ok());
  EXPECT_NE(no_ca.status().message().find("CA file holds no PEM certificate"), std::string::npos)
      << no_ca.status();
}

}  // namespace
}  // namespace rubato
