#include "common/net_diagnose.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

// A loopback TCP socket bound to a kernel-chosen port; listening or not.
class LoopbackSocket {
 public:
  explicit LoopbackSocket(bool listen, int backlog = 16) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    if (listen) {
      EXPECT_EQ(::listen(fd_, backlog), 0);
    }
  }
  ~LoopbackSocket() { ::close(fd_); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(DiagnoseEndpointTest, MalformedAddresses) {
  for (const char* bad :
       {"", "nohost", "host:", ":5000", "host:0", "host:70000", "[::1]5000", "host:12ab"}) {
    EXPECT_EQ(DiagnoseEndpoint(bad, absl::Seconds(1)).kind, Reachability::kBadAddress) << bad;
  }
}

TEST(DiagnoseEndpointTest, ListeningPortConnects) {
  LoopbackSocket server(/*listen=*/true);
  for (const std::string& address : {server.address(), absl::StrCat("ipv4:", server.address()),
                                     absl::StrCat("dns:///", server.address())}) {
    const EndpointDiagnosis d = DiagnoseEndpoint(address, absl::Seconds(2));
    EXPECT_EQ(d.kind, Reachability::kConnects) << address << ": " << d.detail;
  }
}

// A proxy whose backend has exited: it accepts, then closes without a word. Told apart from a
// listener that keeps the connection (ListeningPortConnects) and from TLS or credentials.
TEST(DiagnoseEndpointTest, AnEndpointThatHangsUpAtOnceIsAProxyWithoutItsServer) {
  LoopbackSocket proxy(/*listen=*/true);
  std::atomic<bool> stop{false};
  std::thread closer([&] {
    while (!stop) {
      pollfd p{proxy.fd(), POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) {
        const int c = ::accept(proxy.fd(), nullptr, nullptr);
        if (c >= 0) ::close(c);
      }
    }
  });
  const EndpointDiagnosis d = DiagnoseEndpoint(proxy.address(), absl::Seconds(2));
  stop = true;
  closer.join();
  EXPECT_EQ(d.kind, Reachability::kHangsUp) << d.detail;
  EXPECT_NE(d.detail.find("closes it at once"), std::string::npos) << d.detail;
  EXPECT_EQ(d.detail.find("TLS"), std::string::npos) << d.detail;
}

TEST(DiagnoseEndpointTest, PortWithoutListenerIsRefused) {
  std::string address;
  {
    LoopbackSocket bound(/*listen=*/false);  // Bound, never listening: the kernel refuses.
    address = bound.address();
    const EndpointDiagnosis d = DiagnoseEndpoint(address, absl::Seconds(2));
    EXPECT_EQ(d.kind, Reachability::kRefused) << d.detail;
    EXPECT_NE(d.detail.find("connection refused by " + address), std::string::npos) << d.detail;
    EXPECT_NE(d.detail.find("nothing listens"), std::string::npos) << d.detail;
    // A numeric address is not named again.
    EXPECT_EQ(d.detail.find(" at 127.0.0.1"), std::string::npos) << d.detail;
    // A host name is followed by the address that refused.
    const std::string named = "localhost" + address.substr(address.rfind(':'));
    const EndpointDiagnosis n = DiagnoseEndpoint(named, absl::Seconds(2));
    EXPECT_EQ(n.kind, Reachability::kRefused) << n.detail;
    EXPECT_NE(n.detail.find("connection refused by " + named + " at "), std::string::npos)
        << n.detail;
  }
}

TEST(DiagnoseEndpointTest, FullAcceptQueueTimesOut) {
  // With a backlog of 0 and nobody accepting, Linux completes one or two handshakes and then drops
  // further SYNs: a connect gets no answer, as from a host that is down.
  LoopbackSocket server(/*listen=*/true, /*backlog=*/0);
  std::vector<int> fill;
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(server.address().substr(10))));
    ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    fill.push_back(fd);
  }
  ::usleep(100000);
  const EndpointDiagnosis d = DiagnoseEndpoint(server.address(), absl::Milliseconds(300));
  for (int fd : fill) ::close(fd);
  EXPECT_EQ(d.kind, Reachability::kTimedOut) << d.detail;
  EXPECT_NE(d.detail.find("no answer from"), std::string::npos) << d.detail;
}

TEST(DiagnoseEndpointTest, LocalhostResolvesFromTheHostsFile) {
  LoopbackSocket server(/*listen=*/true);
  const std::string address = "localhost:" + server.address().substr(10);
  const EndpointDiagnosis d = DiagnoseEndpoint(address, absl::Seconds(2));
  // localhost may also resolve to ::1, where nothing listens: the IPv4 connect still wins.
  EXPECT_EQ(d.kind, Reachability::kConnects) << d.detail;
}

}  // namespace
}  // namespace rubato

namespace rubato {
namespace {

TEST(DiagnoseListenTest, AFreePortBindsAndAnInUseOneIsNamed) {
  EXPECT_EQ(DiagnoseListen("127.0.0.1:0"), "");
  LoopbackSocket held(/*listen=*/true);
  const std::string why = DiagnoseListen(held.address());
  EXPECT_NE(why.find(" is in use on this host"), std::string::npos) << why;
  EXPECT_NE(why.find(held.address().substr(held.address().rfind(':') + 1)), std::string::npos)
      << why;
}

TEST(DiagnoseListenTest, AnAddressOfAnotherHostIsNamed) {
  // 192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this machine; a bind sends nothing.
  const std::string why = DiagnoseListen("192.0.2.1:5000");
  EXPECT_EQ(why,
            "192.0.2.1 is not an address of this host (listen on one of its own addresses, "
            "or on 0.0.0.0 for all of them)");
}

TEST(DiagnoseListenTest, MalformedAddresses) {
  for (const char* bad : {"5000", "host:", "host:port", "host:70000", "host:-1"}) {
    EXPECT_NE(DiagnoseListen(bad).find("is not host:port"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace rubato
