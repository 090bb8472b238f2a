#include "common/consistency_plan.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

ConsistencyChange Change(int64_t from, int b, int s = 0) {
  ConsistencyChange c;
  c.set_from_step(from);
  c.set_backup_workers(b);
  c.set_staleness(s);
  return c;
}

TEST(ConsistencyPlanTest, PeriodsOfKStepsAfterTheFirstK) {
  ConsistencyPlan plan(10);
  EXPECT_EQ(plan.PeriodStart(0), 0);
  EXPECT_EQ(plan.PeriodStart(10), 0);
  EXPECT_EQ(plan.PeriodStart(11), 11);
  EXPECT_EQ(plan.PeriodStart(20), 11);
  EXPECT_EQ(plan.PeriodStart(21), 21);
  EXPECT_FALSE(plan.DecidesAt(0));
  EXPECT_FALSE(plan.DecidesAt(9));
  EXPECT_TRUE(plan.DecidesAt(10));
  EXPECT_FALSE(plan.DecidesAt(11));
  EXPECT_TRUE(plan.DecidesAt(20));
}

TEST(ConsistencyPlanTest, UnknownPeriodsRunAsBspAndKnownOnesTheirDecision) {
  ConsistencyPlan plan(10);
  bool added = false;
  ASSERT_TRUE(plan.Add(Change(21, 2), 4, &added).ok());
  EXPECT_TRUE(added);
  EXPECT_EQ(plan.BackupAt(15), 0);  // Period 11..20: not known.
  EXPECT_EQ(plan.At(15), nullptr);
  EXPECT_EQ(plan.BackupAt(21), 2);
  EXPECT_EQ(plan.BackupAt(30), 2);
  EXPECT_EQ(plan.BackupAt(31), 0);  // The next period: not known either.
  ASSERT_NE(plan.Newest(), nullptr);
  EXPECT_EQ(plan.Newest()->from_step(), 21);
  // The same decision again is no news; a different one for the period is refused.
  ASSERT_TRUE(plan.Add(Change(21, 2), 4, &added).ok());
  EXPECT_FALSE(added);
  const absl::Status s = plan.Add(Change(21, 1), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("backup:2 and backup:1"));
  EXPECT_EQ(plan.BackupAt(25), 2);
}

TEST(ConsistencyPlanTest, SspPeriodsKeepTheirStalenessAndConflictsNameBothDecisions) {
  ConsistencyPlan plan(10);
  ASSERT_TRUE(plan.Add(Change(11, 0, 2), 4).ok());
  ASSERT_TRUE(plan.Add(Change(21, 1), 4).ok());
  EXPECT_EQ(plan.StalenessAt(10), 0);
  EXPECT_EQ(plan.StalenessAt(11), 2);
  EXPECT_EQ(plan.StalenessAt(20), 2);
  EXPECT_EQ(plan.BackupAt(20), 0);
  EXPECT_EQ(plan.StalenessAt(21), 0);
  EXPECT_EQ(plan.StalenessAt(31), 0);
  EXPECT_EQ(DescribeDecision(plan.At(15)), "ssp:2");
  EXPECT_EQ(DescribeDecision(plan.At(25)), "backup:1");
  EXPECT_EQ(DescribeDecision(plan.At(35)), "bsp");
  const absl::Status s = plan.Add(Change(11, 0, 1), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("ssp:2 and ssp:1"));
  EXPECT_EQ(plan.Add(Change(11, 0), 4).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ConsistencyPlanTest, MalformedDecisionsAreRefusedNamingTheProblem) {
  ConsistencyPlan plan(10);
  EXPECT_EQ(plan.Add(Change(5, 1), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.Add(Change(1, 1), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.Add(Change(12, 1), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.Add(Change(-9, 1), 4).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status too_many = plan.Add(Change(11, 4), 4);
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_many.message(), HasSubstr("not in [0, 4)"));
  EXPECT_EQ(plan.Add(Change(11, -1), 4).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status stale = plan.Add(Change(11, 0, kMaxAdaptiveStaleness + 1), 4);
  EXPECT_EQ(stale.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stale.message(), HasSubstr("staleness 4"));
  EXPECT_EQ(plan.Add(Change(11, 0, -1), 4).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status mixed = plan.Add(Change(11, 1, 1), 4);
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.message(), HasSubstr("one of bsp, backup:b and ssp:s"));
  EXPECT_EQ(plan.size(), 0u);
}

TEST(ConsistencyPlanTest, ARollBackForgetsTheLaterPeriods) {
  ConsistencyPlan plan(5);
  ASSERT_TRUE(plan.Add(Change(6, 1), 3).ok());
  ASSERT_TRUE(plan.Add(Change(11, 2), 3).ok());
  ASSERT_TRUE(plan.Add(Change(16, 0), 3).ok());
  plan.DropAfter(10);  // Step 10 decides the period from 11 again.
  EXPECT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan.BackupAt(8), 1);
  EXPECT_EQ(plan.BackupAt(12), 0);
  ASSERT_TRUE(plan.Add(Change(11, 0), 3).ok());
}

}  // namespace
}  // namespace rubato
