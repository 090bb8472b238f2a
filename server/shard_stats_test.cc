#include "server/shard_stats.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(ShardCountersTest, StalenessFallsIntoItsBucket) {
  ShardCounters counters;
  for (int64_t tau : {0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 1000}) counters.RecordStaleness(tau);
  counters.CountPush(true);
  counters.CountPush(true);
  counters.CountPush(false);
  counters.CountDuplicate();
  counters.CountDroppedGradient();
  counters.CountDroppedWorkers(2);
  counters.SetLearningRate(0.25);
  GetStatsResponse s;
  counters.Fill(&s);
  ASSERT_EQ(s.staleness_histogram_size(), 8);
  const int64_t expected[8] = {1, 1, 1, 1, 2, 2, 2, 2};
  for (int b = 0; b < 8; ++b) EXPECT_EQ(s.staleness_histogram(b), expected[b]) << b;
  EXPECT_EQ(s.pushes(), 2);
  EXPECT_EQ(s.rejected_pushes(), 1);
  EXPECT_EQ(s.duplicate_gradients(), 1);
  EXPECT_EQ(s.dropped_gradients(), 1);
  EXPECT_EQ(s.dropped_workers(), 2);
  EXPECT_DOUBLE_EQ(s.learning_rate(), 0.25);
}

TEST(ShardStatsTest, TensorAndWorkerFields) {
  std::vector<std::unique_ptr<TensorAggregator>> tensors;
  tensors.push_back(std::make_unique<TensorAggregator>("a", std::vector<int64_t>{2, 3},
                                                       std::vector<float>(6), TensorRole(), 2));
  tensors.push_back(std::make_unique<TensorAggregator>("b", std::vector<int64_t>{4},
                                                       std::vector<float>(4), TensorRole(), 2));
  tensors[0]->Restore(7, TensorOptimizerState());
  tensors[1]->Restore(9, TensorOptimizerState());
  GetStatsResponse s;
  FillTensorStats(tensors, /*restored_versions=*/10, &s);
  EXPECT_EQ(s.bytes(), 40);
  EXPECT_EQ(s.min_version(), 7);
  EXPECT_EQ(s.applied_updates(), 6);
  ASSERT_EQ(s.tensors_size(), 2);
  EXPECT_EQ(s.tensors(1).name(), "b");
  EXPECT_EQ(s.tensors(1).version(), 9);

  Membership members(0, 3, 1000);
  const absl::Time now = absl::FromUnixSeconds(500);
  members.SetMember(1, true);
  members.worker(1).last_seen = now - absl::Milliseconds(250);
  members.worker(1).batch_size = 32;
  members.worker(2).finished = true;
  FillWorkerStats(members, now, &s);
  EXPECT_EQ(s.finished_workers(), 1);
  ASSERT_EQ(s.workers_size(), 1);
  EXPECT_EQ(s.workers(0).worker_id(), 1);
  EXPECT_EQ(s.workers(0).ms_since_seen(), 250);
  EXPECT_EQ(s.workers(0).batch_size(), 32);
  EXPECT_EQ(s.restored_step(), -1);
}

}  // namespace
}  // namespace rubato
