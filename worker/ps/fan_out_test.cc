#include "worker/ps/fan_out.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "worker/ps/refusing_shard_channel.h"

namespace rubato {
namespace {

// Calls whose answers the test gives: each started call waits in `held` until Answer.
class Script {
 public:
  StartCall Starter() {
    return [this](ShardChannel*, int call, const ShardChannel::CallOptions& options,
                  ShardChannel::Done done) {
      absl::MutexLock lock(&mu_);
      ++starts_[call];
      deadlines_[call].push_back(options.deadline);
      held_.push_back({call, std::move(done)});
    };
  }
  // Ends the oldest held call of `call` with `status`; false if none is held.
  bool Answer(int call, absl::Status status) {
    ShardChannel::Done done;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = held_.begin(); it != held_.end(); ++it) {
        if (it->first != call) continue;
        done = std::move(it->second);
        held_.erase(it);
        break;
      }
    }
    if (!done) return false;
    done(std::move(status));
    return true;
  }
  int held() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(held_.size());
  }
  int starts(int call) {
    absl::MutexLock lock(&mu_);
    return starts_[call];
  }
  // The deadline of each attempt of `call`, in order.
  std::vector<absl::Time> deadlines(int call) {
    absl::MutexLock lock(&mu_);
    return deadlines_[call];
  }
  // Waits (real time, 10 s at most) until `n` calls are held.
  bool AwaitHeld(int n) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(held_.size()) >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<int, ShardChannel::Done>> held_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> starts_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::vector<absl::Time>> deadlines_ ABSL_GUARDED_BY(mu_);
};

struct Fixture {
  explicit Fixture(int shards) : timer(&clock) {
    for (int s = 0; s < shards; ++s) {
      channels.push_back(std::make_unique<RefusingShardChannel>("fake:" + std::to_string(s)));
      context.channels.push_back(channels.back().get());
    }
    context.timer = &timer;
    context.retry_timeout = absl::Seconds(1);
  }
  SimulatedClock clock;
  RetryTimer timer;
  std::vector<std::unique_ptr<RefusingShardChannel>> channels;
  FanOutContext context;
};

struct Outcome {
  absl::Notification over;
  absl::Status status;
  std::function<void(absl::Status)> Done() {
    return [this](absl::Status s) {
      status = std::move(s);
      over.Notify();
    };
  }
};

FanOutSpec Calls(std::vector<int> shards, Retry retry) {
  FanOutSpec spec;
  spec.shards = std::move(shards);
  spec.timeout = absl::Seconds(30);
  spec.retry = retry;
  return spec;
}

TEST(FanOutTest, ATransportFailureIsRetriedAfterABackoffOnTheClock) {
  Fixture f(1);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0}, Retry::kWhileUnavailable), script.Starter(), outcome.Done());
  ASSERT_TRUE(script.Answer(0, absl::UnavailableError("connection refused")));
  // The retry waits for the clock: 100 ms, then 200 ms.
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  EXPECT_EQ(script.held(), 0);
  f.clock.Advance(absl::Milliseconds(99));
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  EXPECT_EQ(script.starts(0), 1);
  f.clock.Advance(absl::Milliseconds(1));
  ASSERT_TRUE(script.AwaitHeld(1));
  EXPECT_EQ(script.starts(0), 2);
  ASSERT_TRUE(script.Answer(0, absl::UnavailableError("connection reset")));
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  f.clock.Advance(absl::Milliseconds(199));
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  EXPECT_EQ(script.starts(0), 2);
  f.clock.Advance(absl::Milliseconds(1));
  ASSERT_TRUE(script.AwaitHeld(1));
  EXPECT_FALSE(outcome.over.HasBeenNotified());
  ASSERT_TRUE(script.Answer(0, absl::OkStatus()));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(outcome.status.ok()) << outcome.status;
  EXPECT_EQ(script.starts(0), 3);
}

TEST(FanOutTest, AShardUnreachableForTheRetryTimeoutFailsNamingItAndWhy) {
  Fixture f(2);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0, 1}, Retry::kWhileUnavailable), script.Starter(),
              outcome.Done());
  ASSERT_TRUE(script.Answer(0, absl::OkStatus()));
  // Shard 1 refuses every connection; the clock moves 100 ms at a time.
  for (int tick = 0; tick < 100 && !outcome.over.HasBeenNotified(); ++tick) {
    if (script.held() > 0) {
      ASSERT_TRUE(script.Answer(1, absl::UnavailableError("connection refused")));
      if (outcome.over.HasBeenNotified()) break;
    }
    ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
    f.clock.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  }
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsUnavailable(outcome.status)) << outcome.status;
  const std::string message(outcome.status.message());
  EXPECT_NE(message.find("shard 1 at fake:1 unreachable for"), std::string::npos) << message;
  EXPECT_NE(message.find("diagnosed fake:1"), std::string::npos) << message;
  EXPECT_NE(message.find("connection refused"), std::string::npos) << message;
  // Attempts at 0, 0.1, 0.3, 0.7 and 1.5 s (backoffs of 0.1, 0.2, 0.4, 0.8 s); the last is past
  // the 1 s retry timeout.
  EXPECT_EQ(script.starts(1), 5);
}

// A shard stopped (SIGSTOP), frozen or cut off without a reset answers nothing: the call ends at
// its own deadline, and is retried with a deadline of its own, within the retry timeout.
TEST(FanOutTest, ACallWithNoAnswerByItsDeadlineIsRetriedWithAFreshDeadline) {
  Fixture f(1);
  f.context.retry_timeout = absl::Seconds(60);
  Script script;
  Outcome outcome;
  const absl::Time start = f.clock.Now();
  StartFanOut(&f.context, Calls({0}, Retry::kWhileUnavailable), script.Starter(), outcome.Done());
  ASSERT_TRUE(script.AwaitHeld(1));
  f.clock.Advance(absl::Seconds(30));  // The call's deadline: nothing came.
  ASSERT_TRUE(script.Answer(0, absl::DeadlineExceededError("Deadline Exceeded")));
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  f.clock.Advance(absl::Milliseconds(100));
  ASSERT_TRUE(script.AwaitHeld(1));
  ASSERT_TRUE(script.Answer(0, absl::OkStatus()));  // The shard is back.
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(outcome.status.ok()) << outcome.status;
  const std::vector<absl::Time> deadlines = script.deadlines(0);
  ASSERT_EQ(deadlines.size(), 2u);
  EXPECT_EQ(deadlines[0], start + absl::Seconds(30));
  EXPECT_EQ(deadlines[1], start + absl::Seconds(30) + absl::Milliseconds(100) + absl::Seconds(30))
      << "the retry has the operation's timeout from its own start";
}

TEST(FanOutTest, AShardSilentForTheRetryTimeoutFailsSayingItGaveNoAnswer) {
  Fixture f(1);
  f.context.retry_timeout = absl::Seconds(40);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0}, Retry::kWhileUnavailable), script.Starter(), outcome.Done());
  // Each attempt waits out its 30 s. The first fails at 30 s; retries start at 30.1 s and 60.3 s
  // (backoffs 0.1 and 0.2 s), within the 40 s retry timeout; the third fails at 90.3 s, past it.
  for (const absl::Duration backoff : {absl::Milliseconds(100), absl::Milliseconds(200)}) {
    ASSERT_TRUE(script.AwaitHeld(1));
    f.clock.Advance(absl::Seconds(30));
    ASSERT_TRUE(script.Answer(0, absl::DeadlineExceededError("Deadline Exceeded")));
    ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
    EXPECT_FALSE(outcome.over.HasBeenNotified());
    f.clock.Advance(backoff);
  }
  ASSERT_TRUE(script.AwaitHeld(1));
  f.clock.Advance(absl::Seconds(30));
  ASSERT_TRUE(script.Answer(0, absl::DeadlineExceededError("Deadline Exceeded")));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsUnavailable(outcome.status)) << outcome.status;
  EXPECT_NE(outcome.status.message().find("shard 0 at fake:0 gave no answer for"),
            std::string::npos)
      << outcome.status;
  EXPECT_EQ(script.starts(0), 3);
}

TEST(FanOutTest, AShardsOwnDeadlineExceededIsAnAnswerAndNotRetried) {
  Fixture f(1);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0}, Retry::kWhileUnavailable), script.Starter(), outcome.Done());
  ASSERT_TRUE(script.AwaitHeld(1));
  f.clock.Advance(absl::Seconds(20));  // Before the call's 30 s deadline.
  ASSERT_TRUE(script.Answer(0, absl::DeadlineExceededError(
                                   "pull for step 3 by worker 0 timed out on shard 0: waiting "
                                   "for worker 1")));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsDeadlineExceeded(outcome.status)) << outcome.status;
  EXPECT_NE(outcome.status.message().find("waiting for worker 1"), std::string::npos);
  EXPECT_EQ(script.starts(0), 1);
}

TEST(FanOutTest, AShardsRefusalIsNotRetriedAndTheOperationEndsAfterEveryCall) {
  Fixture f(2);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0, 1}, Retry::kWhileUnavailable), script.Starter(),
              outcome.Done());
  ASSERT_TRUE(script.Answer(0, absl::FailedPreconditionError("worker 3 is not registered")));
  // Call 1 still holds its buffers: the operation is not over until it ends.
  EXPECT_FALSE(outcome.over.HasBeenNotified());
  ASSERT_TRUE(script.Answer(1, absl::OkStatus()));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsFailedPrecondition(outcome.status)) << outcome.status;
  EXPECT_EQ(outcome.status.message(), "server fake:0: worker 3 is not registered");
  EXPECT_EQ(script.starts(0), 1);
}

TEST(FanOutTest, AfterAnErrorAWaitingRetryIsNotStarted) {
  Fixture f(2);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0, 1}, Retry::kWhileUnavailable), script.Starter(),
              outcome.Done());
  ASSERT_TRUE(script.Answer(0, absl::UnavailableError("connection reset")));
  ASSERT_TRUE(script.Answer(1, absl::InvalidArgumentError("bad tensor")));
  ASSERT_TRUE(f.clock.AwaitWaitersAtNow(1, absl::Seconds(10)));
  EXPECT_FALSE(outcome.over.HasBeenNotified());
  f.clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsInvalidArgument(outcome.status)) << outcome.status;
  EXPECT_EQ(script.starts(0), 1);
}

TEST(FanOutTest, NotReachingAShardThatIsNotUpFailsAsUnavailable) {
  Fixture f(1);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0}, Retry::kWaitForReady), script.Starter(), outcome.Done());
  ASSERT_TRUE(script.Answer(0, absl::DeadlineExceededError("Deadline Exceeded")));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsUnavailable(outcome.status)) << outcome.status;
  EXPECT_NE(outcome.status.message().find("cannot reach parameter server shard 0 at fake:0"),
            std::string::npos)
      << outcome.status;
}

TEST(FanOutTest, EachShardRunsAtMostTwoCallsOfAnOperationAtOnce) {
  Fixture f(2);
  Script script;
  Outcome outcome;
  StartFanOut(&f.context, Calls({0, 0, 0, 1, 0}, Retry::kNever), script.Starter(),
              outcome.Done());
  EXPECT_EQ(script.held(), 3);  // Calls 0 and 1 to shard 0, call 3 to shard 1.
  EXPECT_EQ(script.starts(2), 0);
  ASSERT_TRUE(script.Answer(1, absl::OkStatus()));
  EXPECT_EQ(script.starts(2), 1);  // Started by the end of call 1.
  EXPECT_EQ(script.starts(4), 0);
  ASSERT_TRUE(script.Answer(0, absl::OkStatus()));
  ASSERT_TRUE(script.Answer(2, absl::OkStatus()));
  ASSERT_TRUE(script.Answer(3, absl::OkStatus()));
  EXPECT_FALSE(outcome.over.HasBeenNotified());
  ASSERT_TRUE(script.Answer(4, absl::OkStatus()));
  ASSERT_TRUE(outcome.over.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(outcome.status.ok()) << outcome.status;
}

TEST(FanOutTest, AnOperationOfNoCallsEndsAtOnce) {
  Fixture f(1);
  Script script;
  EXPECT_TRUE(RunFanOut(&f.context, Calls({}, Retry::kNever), script.Starter()).ok());
}

}  // namespace
}  // namespace rubato
