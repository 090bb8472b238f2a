#include "worker/ps/recovery.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

std::vector<RegisterResponse> Answers(ConsistencyMode mode,
                                      std::vector<std::pair<int64_t, uint64_t>> step_recovery) {
  std::vector<RegisterResponse> answers;
  const int n = static_cast<int>(step_recovery.size());
  for (int s = 0; s < n; ++s) {
    RegisterResponse r;
    r.set_shard_id(s);
    r.set_num_shards(n);
    r.mutable_consistency()->set_mode(mode);
    r.set_resume_step(step_recovery[s].first);
    r.set_recovery_id(step_recovery[s].second);
    answers.push_back(r);
  }
  return answers;
}

TEST(RecoveryTest, ShardsOfOneRecoveryNeedNoRollback) {
  EXPECT_FALSE(PlanRollback(Answers(BSP, {{40, 7}, {40, 7}})).has_value());
  EXPECT_FALSE(PlanRollback(Answers(BSP, {{40, 0}, {60, 0}})).has_value());
}

TEST(RecoveryTest, UnderBspTheShardsAheadRollBackToTheRestoredOneFurthestBehind) {
  const auto plan = PlanRollback(Answers(BSP, {{60, 0}, {40, 0xab}, {50, 0xcd}, {40, 0xab}}));
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->behind, 1);
  EXPECT_EQ(plan->request.step(), 40);
  EXPECT_EQ(plan->request.recovery_id(), 0xabu);
  EXPECT_EQ(plan->shards, (std::vector<int>{0, 2}));
}

// Workers that each find a shard without the step's checkpoint move the recovery back alike: the
// same id from the same recovery and step, another for another step, never 0 (no recovery).
TEST(RecoveryTest, ARecoveryMovedBackGetsTheSameIdInEveryWorker) {
  EXPECT_EQ(RecoveryIdFor(0xab, 40), RecoveryIdFor(0xab, 40));
  EXPECT_NE(RecoveryIdFor(0xab, 40), RecoveryIdFor(0xab, 36));
  EXPECT_NE(RecoveryIdFor(0xab, 40), RecoveryIdFor(0xac, 40));
  EXPECT_NE(RecoveryIdFor(0xab, 40), 0xabu);
  for (int64_t step = 0; step < 1000; ++step) EXPECT_NE(RecoveryIdFor(0, step), 0u);
}

TEST(RecoveryTest, OutsideBspAndBackupShardsAreNeverRolledBack) {
  EXPECT_FALSE(PlanRollback(Answers(ASYNC, {{60, 0}, {40, 0xab}})).has_value());
  EXPECT_FALSE(PlanRollback(Answers(SSP, {{60, 0}, {40, 0xab}})).has_value());
  EXPECT_TRUE(PlanRollback(Answers(BACKUP, {{60, 0}, {40, 0xab}})).has_value());
}

TEST(RecoveryTest, RecoveriesAreDescribedShardByShard) {
  EXPECT_EQ(DescribeRecoveries(Answers(BSP, {{60, 0}, {40, 0xab}})),
            "shard 0 at step 60, never restored; shard 1 at step 40, recovery ab");
}

// A worker that died between its pushes to two shards left its step applied on one of them.
TEST(RecoveryTest, AHalfAppliedStepIsNamedUnderBspOnly) {
  auto answers = Answers(BSP, {{201, 0}, {201, 0}});
  answers[0].set_min_version(201);
  answers[0].set_max_version(201);
  answers[1].set_min_version(201);
  answers[1].set_max_version(201);
  EXPECT_EQ(DescribeSplitStep(answers), "");
  answers[1].set_max_version(202);  // Within one shard: some tensors a step ahead.
  EXPECT_NE(DescribeSplitStep(answers).find("step 201 is half applied (tensor versions from 201 "
                                            "to 202"),
            std::string::npos)
      << DescribeSplitStep(answers);
  answers[1].set_min_version(202);  // One shard wholly ahead of the other.
  EXPECT_NE(DescribeSplitStep(answers), "");
  for (RegisterResponse& r : answers) r.mutable_consistency()->set_mode(BACKUP);
  EXPECT_EQ(DescribeSplitStep(answers), "");  // Backup applies steps without some gradients.
}

TEST(RecoveryTest, AnswersFromTheWrongShardOrOutOfRangeAreRefusedNamingTheServer) {
  const std::vector<std::string> addresses = {"a:1", "b:2"};
  EXPECT_TRUE(CheckRegisterAnswers(Answers(BSP, {{0, 0}, {0, 0}}), addresses).ok());
  auto swapped = Answers(BSP, {{0, 0}, {0, 0}});
  swapped[1].set_shard_id(0);
  const absl::Status s = CheckRegisterAnswers(swapped, addresses);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(s.message(), "server at b:2 is shard 0 of 2, but this worker has it as shard 1 of 2");
  auto far = Answers(BSP, {{int64_t{1} << 48, 0}, {0, 0}});
  EXPECT_TRUE(absl::IsInternal(CheckRegisterAnswers(far, addresses)));
  auto tiny = Answers(BSP, {{0, 0}, {0, 0}});
  tiny[0].set_part_elements(kMinPartElements - 1);
  EXPECT_TRUE(absl::IsInternal(CheckRegisterAnswers(tiny, addresses)));
  tiny[0].set_part_elements(kMinPartElements);
  EXPECT_TRUE(CheckRegisterAnswers(tiny, addresses).ok());
}

}  // namespace
}  // namespace rubato
