#include "common/clock.h"

#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(RealClockTest, NowFollowsTheSystemClock) {
  const absl::Time before = absl::Now();
  const absl::Time now = Clock::Real()->Now();
  EXPECT_GE(now, before);
  EXPECT_LE(now, absl::Now());
}

TEST(RealClockTest, WaitWithDeadlineInThePastReturnsAtOnce) {
  absl::Mutex mu;
  absl::CondVar cv;
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(Clock::Real()->WaitWithDeadline(&mu, &cv, absl::Now() - absl::Seconds(1)));
}

TEST(SimulatedClockTest, StandsStillUntilAdvanced) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(clock.Now(), t0);
  clock.Advance(absl::Seconds(90));
  EXPECT_EQ(clock.Now(), t0 + absl::Seconds(90));
  clock.SetTime(t0);  // Never backwards.
  EXPECT_EQ(clock.Now(), t0 + absl::Seconds(90));
  clock.SetTime(t0 + absl::Hours(1));
  EXPECT_EQ(clock.Now(), t0 + absl::Hours(1));
}

TEST(SimulatedClockTest, AWaitEndsWhenTheTimeReachesItsDeadlineAndNotBefore) {
  SimulatedClock clock;
  absl::Mutex mu;
  absl::CondVar cv;
  std::atomic<bool> timed_out{false};
  const absl::Time deadline = clock.Now() + absl::Minutes(10);
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    while (!clock.WaitWithDeadline(&mu, &cv, deadline)) {
    }
    timed_out = true;
  });
  while (clock.Waiters() == 0) absl::SleepFor(absl::Milliseconds(1));
  clock.Advance(absl::Minutes(9));
  absl::SleepFor(absl::Milliseconds(20));  // Several re-checks: still before the deadline.
  EXPECT_FALSE(timed_out.load());
  clock.Advance(absl::Minutes(1));
  waiter.join();
  EXPECT_TRUE(timed_out.load());
}

TEST(SimulatedClockTest, AwaitWaitersAtNowSeesAWaiterThatHasCaughtUpWithTheTime) {
  SimulatedClock clock;
  absl::Mutex mu;
  absl::CondVar cv;
  int64_t handled_ms = 0;  // The latest time the waiter has acted on, in ms since the start.
  bool stop = false;
  const absl::Time start = clock.Now();
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    while (!stop) {
      handled_ms = absl::ToInt64Milliseconds(clock.Now() - start);
      clock.WaitWithDeadline(&mu, &cv, clock.Now() + absl::Seconds(1));
    }
  });
  ASSERT_TRUE(clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  for (int i = 1; i <= 20; ++i) {
    clock.Advance(absl::Milliseconds(250));
    ASSERT_TRUE(clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
    absl::MutexLock lock(&mu);
    EXPECT_EQ(handled_ms, 250 * i);
  }
  EXPECT_FALSE(clock.AwaitWaitersAtNow(2, absl::Milliseconds(10)));  // There is one waiter.
  {
    absl::MutexLock lock(&mu);
    stop = true;
    cv.Signal();
  }
  waiter.join();
}

TEST(SimulatedClockTest, ASignalStillWakesAWait) {
  SimulatedClock clock;
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    while (!ready) {
      ASSERT_FALSE(clock.WaitWithDeadline(&mu, &cv, clock.Now() + absl::Hours(1)));
    }
  });
  {
    absl::MutexLock lock(&mu);
    ready = true;
    cv.Signal();
  }
  waiter.join();
}

TEST(SimulatedClockTest, SleepForReturnsOnceTheClockHasMovedOn) {
  SimulatedClock clock;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::Seconds(30));
    woke = true;
  });
  while (clock.Waiters() == 0) absl::SleepFor(absl::Milliseconds(1));
  clock.Advance(absl::Seconds(29));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(woke.load());
  clock.Advance(absl::Seconds(1));
  sleeper.join();
  EXPECT_TRUE(woke.load());
}

}  // namespace
}  // namespace rubato
