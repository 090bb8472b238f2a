#include "sim/network.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

HostSpec Host(double bytes_per_second, absl::Duration latency) {
  HostSpec h;
  h.name = "h";
  h.nic_bytes_per_second = bytes_per_second;
  h.latency = latency;
  h.loopback_bytes_per_second = 4 * bytes_per_second;
  h.loopback_latency = latency / 2;
  return h;
}

TEST(Network, OneMessageTakesItsSizeOverTheRatePlusTheLatency) {
  EventLoop loop;
  Network net(&loop);
  const int a = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  const int b = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  const absl::Time t0 = loop.Now();
  absl::Time got;
  EXPECT_EQ(net.Send(a, b, 1000000, [&] { got = loop.Now(); }), t0 + absl::Milliseconds(2));
  loop.Run();
  EXPECT_EQ(got, t0 + absl::Milliseconds(2));
  EXPECT_EQ(net.stats(a).bytes_out, 1000000);
  EXPECT_EQ(net.stats(b).bytes_in, 1000000);
  EXPECT_EQ(net.stats(b).busy_in, absl::Milliseconds(1));
}

TEST(Network, IncastQueuesAtTheReceiversNic) {
  EventLoop loop;
  Network net(&loop);
  const int shard = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  std::vector<absl::Duration> got;
  const absl::Time t0 = loop.Now();
  for (int w = 0; w < 4; ++w) {
    const int h = net.AddHost(Host(1e9, absl::Milliseconds(1)));
    net.Send(h, shard, 1000000, [&] { got.push_back(loop.Now() - t0); });
  }
  loop.Run();
  // Each sender's NIC is free, so all four leave at once; the shard takes them in one by one.
  EXPECT_EQ(got, (std::vector<absl::Duration>{absl::Milliseconds(2), absl::Milliseconds(3),
                                              absl::Milliseconds(4), absl::Milliseconds(5)}));
}

TEST(Network, ASendersNicSendsOneMessageAtATime) {
  EventLoop loop;
  Network net(&loop);
  const int shard = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  std::vector<absl::Duration> got;
  const absl::Time t0 = loop.Now();
  for (int w = 0; w < 3; ++w) {
    const int h = net.AddHost(Host(1e9, absl::Milliseconds(1)));
    net.Send(shard, h, 2000000, [&] { got.push_back(loop.Now() - t0); });
  }
  loop.Run();
  EXPECT_EQ(got, (std::vector<absl::Duration>{absl::Milliseconds(3), absl::Milliseconds(5),
                                              absl::Milliseconds(7)}));
}

TEST(Network, ASlowSendersLastByteBoundsTheArrival) {
  EventLoop loop;
  Network net(&loop);
  const int slow = net.AddHost(Host(1e8, absl::Milliseconds(1)));
  const int fast = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  const absl::Time t0 = loop.Now();
  EXPECT_EQ(net.Send(slow, fast, 1000000, [] {}), t0 + absl::Milliseconds(11));
}

TEST(Network, TheSameHostGoesThroughItsLoopback) {
  EventLoop loop;
  Network net(&loop);
  const int a = net.AddHost(Host(1e9, absl::Milliseconds(1)));
  const absl::Time t0 = loop.Now();
  // 4e9 B/s and half a millisecond.
  EXPECT_EQ(net.Send(a, a, 4000000, [] {}), t0 + absl::Microseconds(1500));
  EXPECT_EQ(net.stats(a).bytes_out, 0);
}

TEST(Network, BadHostSpecsAreNamed) {
  HostSpec h = Host(0, absl::Milliseconds(1));
  h.name = "w0";
  absl::Status s = ValidateHostSpec(h);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("w0"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("NIC rate"), absl::string_view::npos) << s;
  h = Host(1e9, -absl::Milliseconds(1));
  s = ValidateHostSpec(h);
  EXPECT_NE(s.message().find("latency"), absl::string_view::npos) << s;
  EXPECT_TRUE(ValidateHostSpec(Host(1e9, absl::ZeroDuration())).ok());
}

}  // namespace
}  // namespace rubato
