#include "common/placement.h"

#include <random>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(PlacementTest, OneShardHoldsEverything) {
  const std::vector<TensorSize> t = {{"a", 10}, {"b", 20}};
  auto p = PlaceTensors(t, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->shard_of, (std::vector<int>{0, 0}));
  EXPECT_EQ(p->shard_bytes, (std::vector<int64_t>{30}));
  EXPECT_DOUBLE_EQ(p->imbalance(), 1.0);
}

TEST(PlacementTest, MlpLayersSplitByBytes) {
  // 784-256-10: the big weight alone on one shard, everything else on the other.
  const std::vector<TensorSize> t = {{"fc0.weight", 784 * 256 * 4},
                                     {"fc0.bias", 256 * 4},
                                     {"fc1.weight", 256 * 10 * 4},
                                     {"fc1.bias", 10 * 4}};
  auto p = PlaceTensors(t, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->shard_of, (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(p->shard_bytes[1], (256 + 2560 + 10) * 4);
}

TEST(PlacementTest, DeterministicAndBalancedOnRandomModels) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int shards = 1 + trial % 5;
    std::vector<TensorSize> t;
    int64_t total = 0, largest = 0;
    for (int i = 0; i < 40; ++i) {
      const int64_t bytes = 4 * (1 + rng() % 10000);
      t.push_back({"t" + std::to_string(i), bytes});
      total += bytes;
      largest = std::max(largest, bytes);
    }
    auto a = PlaceTensors(t, shards);
    auto b = PlaceTensors(t, shards);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->shard_of, b->shard_of);
    // Greedy LPT bound: no shard exceeds the mean by more than the largest tensor.
    for (int64_t bytes : a->shard_bytes) EXPECT_LE(bytes, total / shards + largest);
    int64_t sum = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      ASSERT_GE(a->shard_of[i], 0);
      ASSERT_LT(a->shard_of[i], shards);
    }
    for (int64_t bytes : a->shard_bytes) sum += bytes;
    EXPECT_EQ(sum, total);
  }
}

TEST(PlacementTest, RejectsBadInput) {
  const std::vector<TensorSize> dup = {{"a", 1}, {"a", 2}};
  EXPECT_EQ(PlaceTensors(dup, 2).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<TensorSize> ok = {{"a", 1}};
  EXPECT_EQ(PlaceTensors(ok, 0).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<TensorSize> neg = {{"a", -1}};
  EXPECT_EQ(PlaceTensors(neg, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
