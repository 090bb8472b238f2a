#include "server/consistency_policy.h"

#include <cmath>
#include <memory>
#include <vector>

#include "common/cluster_spec.h"
#include "common/tensor_wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/adaptive_policy.h"
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
  for (const char* mode : {"bsp", "backup:1", "async", "ssp:2", "adaptive", "adaptive:7"}) {
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
  EXPECT_FALSE(bsp->StepComplete(/*step=*/0, 3, false, 4));
  EXPECT_TRUE(bsp->StepComplete(/*step=*/0, 4, true, 4));
  EXPECT_FALSE(bsp->StepComplete(/*step=*/0, 0, true, 0));  // Nothing to apply.
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
  EXPECT_FALSE(backup->StepComplete(/*step=*/0, 2, false, 4));
  EXPECT_TRUE(backup->StepComplete(/*step=*/0, 3, false, 4));
  EXPECT_TRUE(backup->StepComplete(/*step=*/0, 1, true, 1));
  EXPECT_FALSE(backup->StepComplete(/*step=*/0, 0, false, 1));
  // With fewer members than backups, one gradient still completes the step.
  auto many = PolicyOf("backup:5");
  EXPECT_TRUE(many->StepComplete(/*step=*/0, 1, false, 3));
}

TEST(AsyncPolicyTest, AppliesOnArrivalAtTheJobsStepRate) {
  auto async = PolicyOf("async");
  EXPECT_FALSE(async->Synchronous());
  EXPECT_FALSE(async->StepComplete(/*step=*/0, 4, true, 4));
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

namespace rubato {
namespace {

using ::testing::HasSubstr;

// One row of times: each worker's mean, as when no step was timed.
ConsistencyChange ChosenFor(std::vector<double> times, int current) {
  ConsistencyChange now, c;
  now.set_backup_workers(current);
  ChooseConsistency({std::move(times)}, now, kMaxAdaptiveStaleness, 0.1, &c);
  return c;
}

ConsistencyChange ChosenOver(const std::vector<std::vector<double>>& steps, int b, int s) {
  ConsistencyChange now, c;
  now.set_backup_workers(b);
  now.set_staleness(s);
  ChooseConsistency(steps, now, kMaxAdaptiveStaleness, 0.1, &c);
  return c;
}

TEST(AdaptiveChoiceTest, StepsSlowOnDifferentWorkersInTurnAreAbsorbedBySsp) {
  // Each step one of four workers takes 28 ms instead of 20, a different one each step. bsp waits
  // 28 ms every step (4 gradients: 0.143 a ms). backup:1 leaves the slow one out: 20 ms for 3
  // gradients (0.150). ssp lets the others run on: over 8 steps each worker computes 2 slow and 6
  // fast steps, 176 ms, so 8 steps of 4 gradients take about 176 ms (0.18).
  std::vector<std::vector<double>> steps;
  for (int t = 0; t < 8; ++t) {
    std::vector<double> row(4, 20.0);
    row[t % 4] = 28;
    steps.push_back(row);
  }
  const ConsistencyChange c = ChosenOver(steps, 0, 0);
  EXPECT_EQ(c.backup_workers(), 0);
  EXPECT_GE(c.staleness(), 1);
  EXPECT_LT(c.expected_step_ms(), 24);
  EXPECT_GT(c.gain(), 1.15);
  // A slower worker each step (60 ms): now leaving it out is better (3 / 20 against 4 / 30).
  for (int t = 0; t < 8; ++t) steps[t][t % 4] = 60;
  EXPECT_EQ(ChosenOver(steps, 0, 0).backup_workers(), 1);
  // One constant straggler: ssp's slack does not help (everyone waits for it every s steps), so
  // backup:1 is chosen.
  std::vector<std::vector<double>> constant(8, {20, 20, 20, 80});
  const ConsistencyChange k = ChosenOver(constant, 0, 0);
  EXPECT_EQ(k.backup_workers(), 1);
  EXPECT_EQ(k.staleness(), 0);
  // Equal workers: bsp stays, and a current ssp period goes back to bsp only if bsp is 10% better
  // (here it is not: the same time).
  std::vector<std::vector<double>> equal(8, {20, 20, 20, 20});
  EXPECT_EQ(ChosenOver(equal, 0, 0).staleness(), 0);
  EXPECT_EQ(ChosenOver(equal, 0, 2).staleness(), 2);
  EXPECT_EQ(ChosenOver(equal, 0, 2).gain(), 1.0);
}

TEST(AdaptiveChoiceTest, OneSlowWorkerOfFourIsLeftOutAndEqualWorkersAreAllWaitedFor) {
  // (4 - b) / c_(4-b): b = 0: 4 / 80; b = 1: 3 / 20.
  ConsistencyChange c = ChosenFor({20, 80, 21, 20}, 0);
  EXPECT_EQ(c.backup_workers(), 1);
  EXPECT_DOUBLE_EQ(c.expected_step_ms(), 21);
  EXPECT_NEAR(c.gain(), (3.0 / 21) / (4.0 / 80), 1e-12);
  // Equal workers: waiting for all of them carries the most gradients a second.
  EXPECT_EQ(ChosenFor({20, 21, 20, 22}, 0).backup_workers(), 0);
  // Two slow of four: 2 / 20 beats 4 / 100 and 3 / 100.
  EXPECT_EQ(ChosenFor({100, 20, 100, 20}, 0).backup_workers(), 2);
  // One worker: nothing to leave out.
  EXPECT_EQ(ChosenFor({50}, 0).backup_workers(), 0);
}

TEST(AdaptiveChoiceTest, TheCurrentChoiceStaysUnlessAnotherIsTenPercentBetter) {
  // b = 0 gives 4 / 22 = 0.182, b = 1 gives 3 / 20 = 0.15: 0 is better by 21%.
  EXPECT_EQ(ChosenFor({20, 20, 20, 22}, 1).backup_workers(), 0);
  // b = 0 gives 4 / 20.6 = 0.194, b = 1 (current) 3 / 20 = 0.15: 29% better, so it switches.
  EXPECT_EQ(ChosenFor({20, 20, 20, 20.6}, 1).backup_workers(), 0);
  // b = 1 gives 3 / 20 = 0.150, b = 0 gives 4 / 29 = 0.138: 1 is better by 9% only, so b = 0
  // stays when current, and 1 stays when current.
  EXPECT_EQ(ChosenFor({20, 20, 20, 29}, 0).backup_workers(), 0);
  EXPECT_EQ(ChosenFor({20, 20, 20, 29}, 1).backup_workers(), 1);
  EXPECT_DOUBLE_EQ(ChosenFor({20, 20, 20, 29}, 0).gain(), 1.0);
}

WirePush PushOf(int worker, int64_t step, double compute_ms, int64_t from = -1, int b = 0,
                int s = 0) {
  WirePush p;
  p.worker_id = worker;
  p.step = step;
  p.consistency_relay.emplace();
  p.consistency_relay->set_compute_ms(compute_ms);
  if (from >= 0) {
    p.consistency_relay->mutable_change()->set_from_step(from);
    p.consistency_relay->mutable_change()->set_backup_workers(b);
    p.consistency_relay->mutable_change()->set_staleness(s);
  }
  return p;
}

TEST(AdaptivePolicyTest, ShardZeroDecidesAtEveryKthStepAndTheStepsFollowTheDecision) {
  auto policy = PolicyOf("adaptive:10");
  AdaptivePolicy* adaptive = policy->adaptive();
  ASSERT_NE(adaptive, nullptr);
  EXPECT_EQ(PolicyOf("bsp")->adaptive(), nullptr);
  EXPECT_TRUE(policy->Synchronous());
  EXPECT_FALSE(policy->SumsInWorkerOrder());
  EXPECT_TRUE(policy->RollsBack());
  const std::vector<char> members(4, 1);
  for (int w = 0; w < 4; ++w) adaptive->TakeRelay(PushOf(w, 9, w == 3 ? 80 : 20), 0, members);
  ConsistencyChange newest;
  EXPECT_FALSE(adaptive->Newest(&newest));  // Step 9 decides nothing.
  EXPECT_FALSE(policy->StepComplete(9, 3, false, 4));
  adaptive->TakeRelay(PushOf(1, 10, 20), 0, members);  // Step 10's first push decides 11..20.
  ASSERT_TRUE(adaptive->Newest(&newest));
  EXPECT_EQ(newest.from_step(), 11);
  EXPECT_EQ(newest.backup_workers(), 1);
  ASSERT_EQ(newest.compute_ms_size(), 4);
  EXPECT_EQ(newest.compute_ms(3), 80);
  EXPECT_FALSE(policy->StepComplete(10, 3, false, 4));  // Step 10 itself is still bsp.
  EXPECT_TRUE(policy->StepComplete(11, 3, false, 4));
  EXPECT_FALSE(policy->StepComplete(11, 2, false, 4));
  EXPECT_TRUE(policy->StepComplete(20, 3, false, 4));
  EXPECT_FALSE(policy->StepComplete(21, 3, false, 4));  // Not decided yet: bsp.
  EXPECT_TRUE(policy->StepComplete(21, 4, true, 4));
  // The rate of a step of 3 of 4 gradients, linearly scaled: 3/4 of the full batch's.
  LearningRateSchedule linear;
  linear.set_scaling("linear");
  linear.set_reference_batch(256);
  const LearningRateScheduler schedule =
      *LearningRateScheduler::Create(0.1, linear, {256, 100, 1000});
  EXPECT_DOUBLE_EQ(policy->LearningRate(schedule, 15, 4, 0), 0.75 * schedule.At(15));
  EXPECT_DOUBLE_EQ(policy->LearningRate(schedule, 5, 4, 0), schedule.At(5));
  // A later push of step 10 decides nothing again; the next decision comes at step 20.
  adaptive->TakeRelay(PushOf(3, 10, 20), 0, members);
  ASSERT_TRUE(adaptive->Newest(&newest));
  EXPECT_EQ(newest.from_step(), 11);
  EXPECT_EQ(newest.backup_workers(), 1);
}

TEST(AdaptivePolicyTest, OtherShardsLearnTheDecisionFromRelaysAndCheckThem) {
  auto policy = PolicyOf("adaptive:10");
  AdaptivePolicy* adaptive = policy->adaptive();
  const std::vector<char> members(4, 1);
  // Shard 1 never decides.
  adaptive->TakeRelay(PushOf(0, 10, 20), 1, members);
  ConsistencyChange newest;
  EXPECT_FALSE(adaptive->Newest(&newest));
  // A relay of the decision governing step 12 (from 11).
  ASSERT_TRUE(adaptive->CheckRelay(PushOf(2, 12, 20, 11, 2), 4).ok());
  WirePush padded = PushOf(2, 12, 20, 11, 2);
  for (int i = 0; i < 1000; ++i) padded.consistency_relay->mutable_change()->add_compute_ms(1e6);
  adaptive->TakeRelay(padded, 1, members);
  EXPECT_TRUE(policy->StepComplete(12, 2, false, 4));
  // Only the decision is kept, not the figures a worker attached to it.
  ASSERT_EQ(adaptive->Plan().size(), 1u);
  EXPECT_EQ(adaptive->Plan()[0].compute_ms_size(), 0);
  // Relays that do not govern their step, disagree, or are out of range are refused.
  EXPECT_EQ(adaptive->CheckRelay(PushOf(2, 22, 20, 11, 2), 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(adaptive->CheckRelay(PushOf(2, 12, 20, 11, 1), 4).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(adaptive->CheckRelay(PushOf(2, 25, 20, 21, 4), 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(adaptive->CheckRelay(PushOf(2, 25, -1), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(adaptive->CheckRelay(PushOf(2, 25, std::nan("")), 4).code(),
            absl::StatusCode::kInvalidArgument);
  // A roll-back to step 10 forgets the decision from 11.
  adaptive->RestartAt(10);
  EXPECT_FALSE(adaptive->Newest(&newest));
  EXPECT_FALSE(policy->StepComplete(12, 2, false, 4));
}

TEST(AdaptivePolicyTest, AMemberNotHeardFromYetKeepsTheStepsBsp) {
  auto policy = PolicyOf("adaptive:5");
  AdaptivePolicy* adaptive = policy->adaptive();
  const std::vector<char> members(3, 1);
  adaptive->TakeRelay(PushOf(0, 5, 20), 0, members);
  adaptive->TakeRelay(PushOf(1, 5, 90), 0, members);  // After the decision: not counted in it.
  ConsistencyChange newest;
  ASSERT_TRUE(adaptive->Newest(&newest));
  EXPECT_EQ(newest.backup_workers(), 0);
  // A worker that is no member does not count; the members' times decide.
  const std::vector<char> two = {1, 1, 0};
  adaptive->TakeRelay(PushOf(0, 10, 20), 0, two);
  ASSERT_TRUE(adaptive->Newest(&newest));
  EXPECT_EQ(newest.from_step(), 11);
  EXPECT_EQ(newest.backup_workers(), 1);  // 1 / 20 beats 2 / 90.
}

TEST(AdaptivePolicyTest, PerStepTimesFromTheRelaysLeadShardZeroToSspAndPullsToOlderWeights) {
  auto policy = PolicyOf("adaptive:8");
  AdaptivePolicy* adaptive = policy->adaptive();
  const std::vector<char> members(4, 1);
  EXPECT_EQ(policy->MaxLead(), kMaxAdaptiveStaleness);
  // Steps 1..8 pushed by every worker, each relaying its previous step's time: one worker slow
  // (28 ms) in turn, every mean the same (22 ms), which alone would keep bsp.
  for (int64_t step = 1; step <= 8; ++step) {
    for (int w = 0; w < 4; ++w) {
      WirePush p = PushOf(w, step, 22);
      p.consistency_relay->set_previous_step_ms((step - 1) % 4 == w ? 28 : 20);
      ASSERT_TRUE(adaptive->CheckRelay(p, 4).ok());
      adaptive->TakeRelay(p, 0, members);
    }
  }
  ConsistencyChange newest;
  ASSERT_TRUE(adaptive->Newest(&newest));
  EXPECT_EQ(newest.from_step(), 9);
  EXPECT_EQ(newest.backup_workers(), 0);
  EXPECT_GE(newest.staleness(), 1);
  const int s = newest.staleness();
  // Steps of the period are gathered whole (no backup workers) but pulled up to s steps stale.
  EXPECT_EQ(policy->NeededVersion(8), 8);
  EXPECT_EQ(policy->NeededVersion(9), 9 - s);
  EXPECT_EQ(policy->NeededVersion(16), 16 - s);
  EXPECT_EQ(policy->NeededVersion(17), 17);  // Not decided yet.
  // The final weights of a job of 16 steps are whole.
  adaptive->SetTotalSteps(16);
  EXPECT_EQ(policy->NeededVersion(15), 15 - s);
  EXPECT_EQ(policy->NeededVersion(16), 16);
  EXPECT_FALSE(policy->StepComplete(9, 3, false, 4));
  EXPECT_TRUE(policy->StepComplete(9, 4, true, 4));
  // A relay of step times out of range is refused, naming the field.
  WirePush bad = PushOf(1, 9, 30);
  bad.consistency_relay->set_previous_step_ms(-1);
  const absl::Status refused = adaptive->CheckRelay(bad, 4);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("previous_step_ms"));
  // Another shard learns the ssp decision from a relay, staleness included.
  auto other = PolicyOf("adaptive:8");
  const WirePush relayed = PushOf(2, 10, 30, 9, 0, s);
  ASSERT_TRUE(other->adaptive()->CheckRelay(relayed, 4).ok());
  other->adaptive()->TakeRelay(relayed, 1, members);
  EXPECT_EQ(other->NeededVersion(10), 10 - s);
  EXPECT_EQ(other->adaptive()->CheckRelay(PushOf(2, 10, 30, 9, 0, s + 1), 4).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rubato
