#include "common/batch_plan.h"

#include <cmath>

#include "gtest/gtest.h"

namespace rubato {
namespace {

BatchChange Change(int64_t from, int batch, int workers) {
  BatchChange c;
  c.set_from_step(from);
  c.set_batch_size(batch);
  c.set_global_batch(int64_t{batch} * workers);
  return c;
}

TEST(BatchPlanTest, BatchAndExamplesFollowTheChanges) {
  BatchPlan plan(4, 16);                          // Global 64.
  ASSERT_TRUE(plan.Add(Change(10, 64, 4)).ok());  // Global 256 from step 10.
  ASSERT_TRUE(plan.Add(Change(12, 32, 4)).ok());  // 128 from step 12.
  EXPECT_EQ(plan.BatchAt(0), 16);
  EXPECT_EQ(plan.BatchAt(9), 16);
  EXPECT_EQ(plan.BatchAt(10), 64);
  EXPECT_EQ(plan.BatchAt(11), 64);
  EXPECT_EQ(plan.BatchAt(12), 32);
  EXPECT_EQ(plan.BatchAt(1000), 32);
  EXPECT_EQ(plan.ExamplesBefore(0), 0);
  EXPECT_EQ(plan.ExamplesBefore(10), 640);
  EXPECT_EQ(plan.ExamplesBefore(11), 640 + 256);
  EXPECT_EQ(plan.ExamplesBefore(12), 640 + 512);
  EXPECT_EQ(plan.ExamplesBefore(15), 640 + 512 + 3 * 128);
}

TEST(BatchPlanTest, TotalStepsDrawTheExamplesUnderThePlan) {
  BatchPlan fixed(4, 16);
  EXPECT_EQ(fixed.TotalSteps(6400), 100);
  EXPECT_EQ(fixed.TotalSteps(6401), 101);
  BatchPlan plan(4, 16);
  ASSERT_TRUE(plan.Add(Change(10, 64, 4)).ok());
  // 640 in the first 10 steps, then 256 a step: 6400 needs ceil(5760 / 256) = 23 more.
  EXPECT_EQ(plan.TotalSteps(6400), 33);
  EXPECT_GE(plan.ExamplesBefore(33), 6400);
  EXPECT_LT(plan.ExamplesBefore(32), 6400);
  // Fewer examples than the steps before the change drew: the job ends before it.
  EXPECT_EQ(plan.TotalSteps(320), 5);
}

TEST(BatchPlanTest, RefusesChangesThatCannotBeApplied) {
  BatchPlan plan(4, 16);
  EXPECT_FALSE(plan.Add(Change(0, 32, 4)).ok());  // Step 0 is the initial batch.
  EXPECT_FALSE(plan.Add(Change(5, 16, 4)).ok());  // No change.
  EXPECT_FALSE(plan.Add(Change(5, 0, 4)).ok());   // Empty batch.
  BatchChange wrong = Change(5, 32, 4);
  wrong.set_global_batch(100);
  EXPECT_FALSE(plan.Add(wrong).ok());
  ASSERT_TRUE(plan.Add(Change(5, 32, 4)).ok());
  EXPECT_FALSE(plan.Add(Change(5, 64, 4)).ok());  // Not after the last change.
  EXPECT_EQ(plan.changes().size(), 1u);
}

TEST(ProposeBatchTest, FollowsTheNoiseScaleWithinBoundsAndHysteresis) {
  AdaptiveBatchConfig c;
  c.set_min_global_batch(64);
  c.set_max_global_batch(4096);
  // B_simple 1000 over 4 workers: 250 each.
  EXPECT_EQ(ProposeBatch(c, 4, 16, 1000), 250);
  // Beyond the bounds: clamped.
  EXPECT_EQ(ProposeBatch(c, 4, 16, 1e9), 1024);
  EXPECT_EQ(ProposeBatch(c, 4, 256, 1), 16);
  // Within a factor of 1.5 of the current batch: kept.
  EXPECT_EQ(ProposeBatch(c, 4, 200, 1000), 200);
  EXPECT_EQ(ProposeBatch(c, 4, 300, 1000), 300);
  EXPECT_EQ(ProposeBatch(c, 4, 100, 1000), 250);
  // No estimate: kept.
  EXPECT_EQ(ProposeBatch(c, 4, 16, std::nan("")), 16);
  EXPECT_EQ(ProposeBatch(c, 4, 16, -5), 16);
  EXPECT_EQ(ProposeBatch(c, 4, 16, INFINITY), 16);
  // Off.
  EXPECT_EQ(ProposeBatch(AdaptiveBatchConfig(), 4, 16, 1000), 16);
}

TEST(ValidateAdaptiveBatchTest, NamesTheBadField) {
  AdaptiveBatchConfig c;
  EXPECT_TRUE(ValidateAdaptiveBatch(c, 4).ok());
  c.set_min_global_batch(64);
  c.set_max_global_batch(32);
  EXPECT_NE(ValidateAdaptiveBatch(c, 4).message().find("min_global_batch"), std::string::npos);
  c.set_min_global_batch(2);
  c.set_max_global_batch(4096);
  EXPECT_FALSE(ValidateAdaptiveBatch(c, 4).ok());  // Below one example per worker.
  c.set_min_global_batch(64);
  EXPECT_TRUE(ValidateAdaptiveBatch(c, 4).ok());
  c.set_every_steps(1);
  EXPECT_NE(ValidateAdaptiveBatch(c, 4).message().find("every_steps"), std::string::npos);
  c.set_every_steps(2);
  EXPECT_TRUE(ValidateAdaptiveBatch(c, 4).ok());
  EXPECT_EQ(AdaptiveBatchEvery(c), 2);
  EXPECT_EQ(AdaptiveBatchEvery(AdaptiveBatchConfig()), 50);
}

}  // namespace
}  // namespace rubato
