#include "server/batch_coordinator.h"

#include <cmath>

#include "gtest/gtest.h"

namespace rubato {
namespace {

AdaptiveBatchConfig Adaptive() {
  AdaptiveBatchConfig config;
  config.set_min_global_batch(8);
  config.set_max_global_batch(1024);
  config.set_every_steps(4);
  return config;
}

WirePush PushOf(int worker, int64_t step, int batch) {
  WirePush p;
  p.worker_id = worker;
  p.step = step;
  p.batch_size = batch;
  return p;
}

NoiseScaleRelay Relay(int64_t step, double g2, double trace) {
  NoiseScaleRelay r;
  r.set_step(step);
  r.set_g2_ema(g2);
  r.set_trace_ema(trace);
  return r;
}

TEST(BatchCoordinatorTest, WithoutAnAdaptiveBatchAPushMustKeepItsRegisteredBatch) {
  BatchCoordinator fixed(0, AdaptiveBatchConfig(), nullptr);
  EXPECT_FALSE(fixed.enabled());
  EXPECT_TRUE(fixed.CheckPush(PushOf(0, 3, 16), 16).ok());
  EXPECT_TRUE(fixed.CheckPush(PushOf(0, 3, 0), 16).ok());  // 0: not declared.
  absl::Status s = fixed.CheckPush(PushOf(1, 3, 8), 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("this job's batch is fixed"), std::string::npos) << s;
  WirePush bad = PushOf(0, 3, 16);
  bad.noise_relay = Relay(2, std::nan(""), 1);
  EXPECT_EQ(fixed.CheckPush(bad, 16).code(), absl::StatusCode::kInvalidArgument);
  bad.noise_relay = Relay(-1, 1, 1);
  EXPECT_EQ(fixed.CheckPush(bad, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fixed.plan(), nullptr);
}

TEST(BatchCoordinatorTest, EveryWorkerStartsFromTheSameBatch) {
  BatchCoordinator coordinator(0, Adaptive(), nullptr);
  Membership members(0, 2, 1000);
  EXPECT_TRUE(coordinator.CheckRegistration(0, 16, members).ok());
  members.SetMember(0, true);
  members.worker(0).batch_size = 16;
  EXPECT_TRUE(coordinator.CheckRegistration(1, 16, members).ok());
  absl::Status s = coordinator.CheckRegistration(1, 32, members);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("registered with 32 but the job's is 16"), std::string::npos) << s;
}

TEST(BatchCoordinatorTest, DecidesFromTheLowestWorkersRelayOnceALaterStepArrives) {
  BatchCoordinator coordinator(0, Adaptive(), nullptr);
  coordinator.Start(/*workers=*/2, /*initial_batch=*/8);
  ASSERT_NE(coordinator.plan(), nullptr);
  const LearningRateScheduler schedule =
      *LearningRateScheduler::Create(0.1, LearningRateSchedule(), {16, 10, 1000});
  // Step 4 is a decision step; worker 1's relay comes first, worker 0's counts.
  WirePush p1 = PushOf(1, 4, 8);
  p1.noise_relay = Relay(3, /*g2=*/1.0, /*trace=*/1000.0);  // B_simple 1000: grow.
  WirePush p0 = PushOf(0, 4, 8);
  p0.noise_relay = Relay(3, /*g2=*/1.0, /*trace=*/10.0);  // B_simple 10: stay near 16.
  coordinator.TakeRelay(p1, schedule);
  coordinator.TakeRelay(p0, schedule);
  EXPECT_TRUE(coordinator.plan()->changes().empty());  // Not decided before step 5.
  coordinator.TakeRelay(PushOf(0, 5, 8), schedule);
  const int expected = ProposeBatch(Adaptive(), 2, 8, 10.0);
  if (expected == 8) {
    EXPECT_TRUE(coordinator.plan()->changes().empty());
  } else {
    ASSERT_EQ(coordinator.plan()->changes().size(), 1u);
    EXPECT_EQ(coordinator.plan()->changes()[0].from_step(), 6);
    EXPECT_EQ(coordinator.plan()->changes()[0].batch_size(), expected);
  }
  // A push of step 6 must then carry the plan's batch.
  const int at6 = coordinator.plan()->BatchAt(6);
  EXPECT_TRUE(coordinator.CheckPush(PushOf(1, 6, at6), 8).ok());
  EXPECT_EQ(coordinator.CheckPush(PushOf(1, 6, at6 + 1), 8).code(),
            absl::StatusCode::kFailedPrecondition);
  std::shared_ptr<const BatchPlan> view = std::atomic_load(coordinator.view());
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(view->BatchAt(6), at6);
}

TEST(BatchCoordinatorTest, ALargeNoiseScaleGrowsTheBatchTwoStepsAfterTheDecisionStep) {
  BatchCoordinator coordinator(0, Adaptive(), nullptr);
  coordinator.Start(2, 8);
  const LearningRateScheduler schedule =
      *LearningRateScheduler::Create(0.1, LearningRateSchedule(), {16, 10, 1000});
  WirePush p = PushOf(0, 8, 8);
  p.noise_relay = Relay(7, 1.0, 1000.0);
  coordinator.TakeRelay(p, schedule);
  coordinator.TakeRelay(PushOf(1, 9, 8), schedule);
  ASSERT_EQ(coordinator.plan()->changes().size(), 1u);
  const BatchChange& c = coordinator.plan()->changes()[0];
  EXPECT_EQ(c.from_step(), 10);
  EXPECT_GT(c.batch_size(), 8);
  EXPECT_EQ(c.global_batch(), 2 * int64_t{c.batch_size()});
  EXPECT_DOUBLE_EQ(c.b_simple(), 1000.0);
  EXPECT_DOUBLE_EQ(c.learning_rate(), schedule.At(10) * schedule.BatchFactor(c.global_batch()));
}

}  // namespace
}  // namespace rubato
