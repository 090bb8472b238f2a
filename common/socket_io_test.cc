// WatchPeerLiveness (common/socket_io.h) asks the kernel for what it promises: keepalive probes on
// an idle connection and a user timeout of `dead_after` for unacknowledged data. What it buys, a
// worker giving up a shard whose host vanished within seconds, is tested across network
// namespaces by tests/net_errors_test.py.
#include "common/socket_io.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace rubato {
namespace {

int Option(int fd, int level, int name) {
  int value = -1;
  socklen_t size = sizeof(value);
  EXPECT_EQ(::getsockopt(fd, level, name, &value, &size), 0) << name;
  return value;
}

TEST(WatchPeerLivenessTest, ProbesAnIdleConnectionAndBoundsUnacknowledgedData) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(Option(fd, SOL_SOCKET, SO_KEEPALIVE), 0);
  WatchPeerLiveness(fd, absl::Seconds(15));
  EXPECT_EQ(Option(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(Option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), 15000);
  // The first probe comes well before the limit, and the next ones leave time for an answer.
  const int idle = Option(fd, IPPROTO_TCP, TCP_KEEPIDLE);
  const int interval = Option(fd, IPPROTO_TCP, TCP_KEEPINTVL);
  EXPECT_GE(idle, 1);
  EXPECT_LT(idle + interval, 15);
  ::close(fd);
}

TEST(WatchPeerLivenessTest, AShortLimitIsRaisedToTwoSeconds) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  WatchPeerLiveness(fd, absl::Milliseconds(10));
  EXPECT_EQ(Option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), 2000);
  EXPECT_GE(Option(fd, IPPROTO_TCP, TCP_KEEPIDLE), 1);
  ::close(fd);
}

}  // namespace
}  // namespace rubato
