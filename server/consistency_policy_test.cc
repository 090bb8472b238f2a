#include "server/consistency_policy.h"

#include <memory>

#include "common/cluster_spec.h"
#include "gtest/gtest.h"
#include "server/membership.h"

namespace rubato {
namespace {

std::unique_ptr<ConsistencyPolicy> PolicyOf(const std::string& mode) {
  absl::StatusOr<ConsistencyConfig> config = ParseConsistency(mode);
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> policy = ConsistencyPolicy::Create(*config);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return std::move(*policy);
}

LearningRateScheduler Constant(double lr) {
  return *LearningRateScheduler::Create(lr, LearningRateSchedule(), {1, 1, 1000});
}

TEST(ConsistencyPolicyTest, EveryParameterServerModeHasAPolicyAndAllreduceNone) {
  for (const char* mode : {"bsp", "backup:1", "async", "ssp:2"}) {
    EXPECT_NE(PolicyOf(mode), nullptr) << mode;
  }
  ConsistencyConfig allreduce;
  allreduce.set_mode(ALLREDUCE);
  absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> none = ConsistencyPolicy::Create(allreduce);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("without parameter servers"), std::string::npos)
      << none.status();
}

TEST(BspPolicyTest, AStepIsCompleteOnlyWithEveryMember) {
  auto bsp = PolicyOf("bsp");
  EXPECT_TRUE(bsp->Synchronous());
  EXPECT_TRUE(bsp->SumsInWorkerOrder());
  EXPECT_FALSE(bsp->StepComplete(3, false, 4));
  EXPECT_TRUE(bsp->StepComplete(4, true, 4));
  EXPECT_FALSE(bsp->StepComplete(0, true, 0));  // Nothing to apply.
  EXPECT_EQ(bsp->NeededVersion(7), 7);
  EXPECT_EQ(bsp->ResumeStep(/*min_version=*/12, /*own_clock=*/3), 12);
  EXPECT_EQ(bsp->VersionsPerStep(4), 1);
  EXPECT_TRUE(bsp->RestoredVersionConsistent(5, 5));
  EXPECT_FALSE(bsp->RestoredVersionConsistent(6, 5));
  EXPECT_TRUE(bsp->RollsBack());
  EXPECT_TRUE(bsp->MeasuresNoiseScale());
  EXPECT_FALSE(bsp->KeepsClocks());
  EXPECT_TRUE(bsp->CheckPushStep(0, 100, -1, 0).ok());  // The versions decide under bsp.
}

TEST(BspPolicyTest, PartsAreTheWorkersShareOfTheBudgetBetween1And8MiB) {
  auto bsp = PolicyOf("bsp");
  constexpr int64_t kMiB = int64_t{1} << 20;
  EXPECT_EQ(bsp->PartElements(2, 32 * kMiB), 8 * kMiB / 4);   // 8 MiB each: the cap.
  EXPECT_EQ(bsp->PartElements(8, 32 * kMiB), 2 * kMiB / 4);   // 32 / (2 x 8) = 2 MiB.
  EXPECT_EQ(bsp->PartElements(64, 32 * kMiB), 1 * kMiB / 4);  // The floor.
  EXPECT_EQ(bsp->PartElements(3, 32 * kMiB) % 1024, 0);
  EXPECT_EQ(bsp->PartElements(0, 32 * kMiB), 0);
  for (const char* mode : {"backup:1", "async", "ssp:2"}) {
    EXPECT_EQ(PolicyOf(mode)->PartElements(2, 32 * kMiB), 0) << mode;
  }
  EXPECT_EQ(PushPartElements(*ParseConsistency("bsp"), 8, 32 * kMiB), 2 * kMiB / 4);
  EXPECT_EQ(PushPartElements(*ParseConsistency("async"), 8, 32 * kMiB), 0);
}

TEST(BackupPolicyTest, AStepIsCompleteWithMembersLessBackups) {
  auto backup = PolicyOf("backup:1");
  EXPECT_TRUE(backup->Synchronous());
  EXPECT_FALSE(backup->SumsInWorkerOrder());
  EXPECT_FALSE(backup->StepComplete(2, false, 4));
  EXPECT_TRUE(backup->StepComplete(3, false, 4));
  EXPECT_TRUE(backup->StepComplete(1, true, 1));
  EXPECT_FALSE(backup->StepComplete(0, false, 1));
  // With fewer members than backups, one gradient still completes the step.
  auto many = PolicyOf("backup:5");
  EXPECT_TRUE(many->StepComplete(1, false, 3));
}

TEST(AsyncPolicyTest, AppliesOnArrivalAtTheJobsStepRate) {
  auto async = PolicyOf("async");
  EXPECT_FALSE(async->Synchronous());
  EXPECT_FALSE(async->StepComplete(4, true, 4));
  EXPECT_EQ(async->NeededVersion(9), 0);
  EXPECT_TRUE(async->KeepsClocks());
  EXPECT_FALSE(async->ClockReleasesPulls());
  EXPECT_FALSE(async->RollsBack());
  EXPECT_FALSE(async->MeasuresNoiseScale());
  EXPECT_EQ(async->ResumeStep(/*min_version=*/40, /*own_clock=*/10), 10);
  EXPECT_EQ(async->VersionsPerStep(4), 4);
  const LearningRateScheduler schedule = Constant(0.5);
  EXPECT_DOUBLE_EQ(async->LearningRate(schedule, 8, 4, /*staleness=*/3), 0.5);
}

TEST(AsyncPolicyTest, AGradientFromTheFutureIsRefusedNamingWhatWasPulled) {
  auto async = PolicyOf("async");
  EXPECT_TRUE(async->CheckPushStep(1, 4, 4, 0).ok());
  absl::Status future = async->CheckPushStep(1, 5, 4, 2);
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(future.message().find("up to step 4 from shard 2"), std::string::npos) << future;
  EXPECT_NE(async->CheckPushStep(1, 0, -1, 0).message().find("pulled nothing"), std::string::npos);
}

TEST(AsyncPolicyTest, StalenessAwareRateIsDividedByTau) {
  ConsistencyConfig config = *ParseConsistency("async");
  config.set_staleness_aware_lr(true);
  auto aware = std::move(*ConsistencyPolicy::Create(config));
  const LearningRateScheduler schedule = Constant(0.6);
  EXPECT_DOUBLE_EQ(aware->LearningRate(schedule, 0, 2, 3), 0.2);
  EXPECT_DOUBLE_EQ(aware->LearningRate(schedule, 0, 2, 1), 0.6);  // tau <= 1: unchanged.
}

// --lr_scaling scales for the batch of one update: the sum of the batches where a step averages
// every worker's gradient, members - b of them under backup:b, one worker's where each gradient
// is applied alone (issue 33: async and ssp were scaled for the sum).
TEST(ConsistencyPolicyTest, TheRateIsScaledForTheBatchOfOneUpdate) {
  Membership members(/*shard_id=*/0, /*num_workers=*/4, /*lease_ms=*/1000);
  for (int w = 0; w < 4; ++w) members.Enroll(w, /*batch_size=*/64, 100, 1000, 0, absl::Now());
  LearningRateSchedule linear;
  linear.set_scaling("linear");
  linear.set_reference_batch(256);
  auto peak = [&](const std::string& mode) {
    auto policy = PolicyOf(mode);
    const int64_t batch = policy->UpdateBatch(members);
    return LearningRateScheduler::Create(0.4, linear, {batch, 100, 1000})->At(0);
  };
  EXPECT_DOUBLE_EQ(peak("bsp"), 0.4);
  EXPECT_DOUBLE_EQ(peak("backup:1"), 0.3);
  EXPECT_DOUBLE_EQ(peak("async"), 0.1);
  EXPECT_DOUBLE_EQ(peak("ssp:2"), 0.1);
  // Workers of different batches: async scales for their mean.
  Membership mixed(0, 2, 1000);
  mixed.Enroll(0, 32, 100, 1000, 0, absl::Now());
  mixed.Enroll(1, 96, 100, 1000, 0, absl::Now());
  EXPECT_EQ(PolicyOf("async")->UpdateBatch(mixed), 64);
  EXPECT_EQ(PolicyOf("bsp")->UpdateBatch(mixed), 128);
}

TEST(SspPolicyTest, APullStartsOnceEveryMemberIsWithinTheBound) {
  auto ssp = PolicyOf("ssp:2");
  Membership members(/*shard_id=*/0, /*num_workers=*/2, /*lease_ms=*/1000);
  members.SetTensorCount(1);
  members.SetMember(0, true);
  members.SetMember(1, true);
  // Both at clock 0: a pull of step 2 may start (0 >= 2 - 2), of step 3 not.
  EXPECT_TRUE(ssp->MayStartPull(2, members));
  EXPECT_FALSE(ssp->MayStartPull(3, members));
  const std::string why = ssp->DescribeBlockedPull(3, members);
  EXPECT_NE(why.find("clock >= 1"), std::string::npos) << why;
  EXPECT_NE(why.find("0 (clock 0), 1 (clock 0)"), std::string::npos) << why;
  ASSERT_TRUE(members.Pushed(0, 0, 0));
  EXPECT_FALSE(ssp->MayStartPull(3, members));  // Worker 1 is still at clock 0.
  ASSERT_TRUE(members.Pushed(1, 0, 0));
  EXPECT_TRUE(ssp->MayStartPull(3, members));
  EXPECT_TRUE(ssp->ClockReleasesPulls());
  EXPECT_TRUE(ssp->KeepsClocks());
}

}  // namespace
}  // namespace rubato
