#include "worker/push_buckets.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

using Range = PushBuckets::Range;

// A model of four layers (kernel, bias) as the backward pass hands them over: last layer first.
std::vector<Range> Backward(PushBuckets* buckets) {
  std::vector<Range> pushes;
  for (size_t first : {6, 4, 2, 0}) {
    for (const Range& r : buckets->Add(first, 2)) pushes.push_back(r);
  }
  for (const Range& r : buckets->Flush()) pushes.push_back(r);
  return pushes;
}

TEST(PushBucketsTest, LayersAreGatheredUntilABucketIsFull) {
  // Kernels of 3, 1, 2 and 5 MB (layers 1 to 4), biases of 1 KB.
  const std::vector<int64_t> bytes = {3 << 20, 1 << 10, 1 << 20, 1 << 10,
                                      2 << 20, 1 << 10, 5 << 20, 1 << 10};
  PushBuckets buckets(bytes, 4 << 20);
  // Layer 4 (5 MB) fills a bucket alone; layers 3 and 2 (3 MB) do not, layer 1 tops them up.
  EXPECT_EQ(Backward(&buckets), (std::vector<Range>{{6, 2}, {0, 6}}));
  // The next step starts with an empty bucket.
  EXPECT_EQ(Backward(&buckets), (std::vector<Range>{{6, 2}, {0, 6}}));
}

TEST(PushBucketsTest, WhatIsLeftGoesInALastPush) {
  const std::vector<int64_t> bytes(8, 1 << 10);
  PushBuckets buckets(bytes, 4 << 20);
  EXPECT_EQ(Backward(&buckets), (std::vector<Range>{{0, 8}}));
  EXPECT_TRUE(buckets.Flush().empty());
}

TEST(PushBucketsTest, NoMinimumPushesEveryLayerAlone) {
  const std::vector<int64_t> bytes(8, 1 << 10);
  PushBuckets buckets(bytes, 0);
  EXPECT_EQ(Backward(&buckets), (std::vector<Range>{{6, 2}, {4, 2}, {2, 2}, {0, 2}}));
}

TEST(PushBucketsTest, ALayerThatIsNotNextToTheBucketClosesItFirst) {
  const std::vector<int64_t> bytes(8, 1 << 20);
  PushBuckets buckets(bytes, 4 << 20);
  EXPECT_TRUE(buckets.Add(6, 2).empty());
  EXPECT_EQ(buckets.Add(0, 2), (std::vector<Range>{{6, 2}}));  // not next to [6, 8)
  EXPECT_TRUE(buckets.Add(2, 1).empty());                      // just after [0, 2)
  // [0, 3) and then [3, 4): 4 MB, full.
  EXPECT_EQ(buckets.Add(3, 1), (std::vector<Range>{{0, 4}}));
  EXPECT_TRUE(buckets.Flush().empty());
}

}  // namespace
}  // namespace rubato
