#include "sim/event_loop.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(EventLoop, RunsInOrderOfTimeThenOfScheduling) {
  EventLoop loop;
  const absl::Time t0 = loop.Now();
  std::vector<int> order;
  std::vector<absl::Duration> at;
  auto note = [&](int i) {
    order.push_back(i);
    at.push_back(loop.Now() - t0);
  };
  loop.After(absl::Milliseconds(5), [&] { note(1); });
  loop.After(absl::Milliseconds(2), [&] { note(2); });
  loop.After(absl::Milliseconds(5), [&] { note(3); });
  loop.After(absl::Milliseconds(2), [&] {
    note(4);
    // Scheduled from an event: after those already due at the same time.
    loop.After(absl::ZeroDuration(), [&] { note(5); });
  });
  EXPECT_EQ(loop.pending(), 4);
  EXPECT_EQ(loop.Run(), 5);
  EXPECT_EQ(order, (std::vector<int>{2, 4, 5, 1, 3}));
  EXPECT_EQ(at, (std::vector<absl::Duration>{absl::Milliseconds(2), absl::Milliseconds(2),
                                             absl::Milliseconds(2), absl::Milliseconds(5),
                                             absl::Milliseconds(5)}));
  EXPECT_EQ(loop.pending(), 0);
}

TEST(EventLoop, APastTimeRunsNowAndTheClockNeverGoesBack) {
  EventLoop loop;
  const absl::Time t0 = loop.Now();
  absl::Time seen;
  loop.After(absl::Seconds(1), [&] { loop.At(t0, [&] { seen = loop.Now(); }); });
  loop.Run();
  EXPECT_EQ(seen, t0 + absl::Seconds(1));
  EXPECT_EQ(loop.clock()->Now(), t0 + absl::Seconds(1));
}

TEST(EventLoop, RunStopsBeforeEventsAfterUntil) {
  EventLoop loop;
  const absl::Time t0 = loop.Now();
  int ran = 0;
  for (int i = 1; i <= 4; ++i) loop.After(absl::Seconds(i), [&] { ++ran; });
  EXPECT_EQ(loop.Run(t0 + absl::Seconds(2)), 2);
  EXPECT_EQ(ran, 2);
  EXPECT_EQ(loop.pending(), 2);
  EXPECT_EQ(loop.Run(), 2);
  EXPECT_EQ(ran, 4);
}

}  // namespace
}  // namespace rubato
