#include "worker/ps/heartbeats.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "worker/ps/refusing_shard_channel.h"

namespace rubato {
namespace {

// A shard that answers heartbeats at once and records the steps they report.
class HeartbeatCounter final : public RefusingShardChannel {
 public:
  HeartbeatCounter() : RefusingShardChannel("counter") {}
  void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse*, const CallOptions&,
                 Done d) override {
    {
      absl::MutexLock lock(&mu_);
      steps_.push_back(request.step());
    }
    d(absl::OkStatus());
  }

  std::vector<int64_t> steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> steps_ ABSL_GUARDED_BY(mu_);
};

TEST(HeartbeatsTest, EveryQuarterLeaseOnTheClockEachShardHearsTheCurrentStep) {
  SimulatedClock clock;
  std::vector<std::unique_ptr<ShardChannel>> channels;
  channels.push_back(std::make_unique<HeartbeatCounter>());
  channels.push_back(std::make_unique<HeartbeatCounter>());
  auto* a = static_cast<HeartbeatCounter*>(channels[0].get());
  auto* b = static_cast<HeartbeatCounter*>(channels[1].get());
  PsClientOptions options;
  TensorSpec t;
  t.set_name("w");
  t.add_shape(4);
  options.model = {t};
  options.clock = &clock;
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreatePsClient(options, std::move(channels));
  ASSERT_TRUE(client.ok()) << client.status();
  std::atomic<int64_t> step{7};
  {
    Heartbeats heartbeats(client->get(), /*lease_ms=*/1000, &step, &clock);
    // Two threads wait on the clock: the heartbeats' and the client's retry timer.
    ASSERT_TRUE(clock.AwaitWaitersAtNow(2, absl::Seconds(10)));
    clock.Advance(absl::Milliseconds(249));
    ASSERT_TRUE(clock.AwaitWaitersAtNow(2, absl::Seconds(10)));
    EXPECT_EQ(heartbeats.sent(), 0);
    clock.Advance(absl::Milliseconds(1));
    ASSERT_TRUE(clock.AwaitWaitersAtNow(2, absl::Seconds(10)));
    EXPECT_EQ(heartbeats.sent(), 1);
    EXPECT_EQ(a->steps(), std::vector<int64_t>{7});
    EXPECT_EQ(b->steps(), std::vector<int64_t>{7});
    step.store(8);
    clock.Advance(absl::Milliseconds(250));
    ASSERT_TRUE(clock.AwaitWaitersAtNow(2, absl::Seconds(10)));
    EXPECT_EQ(heartbeats.sent(), 2);
    EXPECT_EQ(a->steps(), (std::vector<int64_t>{7, 8}));
  }
  // Stopped at once, without the clock moving.
  EXPECT_EQ(a->steps().size(), 2u);
}

}  // namespace
}  // namespace rubato
