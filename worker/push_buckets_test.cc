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
  const std::vector<int64_t> bytes(8, 256 << 10);
  PushBuckets buckets(bytes, 1 << 20);
  EXPECT_TRUE(buckets.Add(6, 2).empty());
  EXPECT_EQ(buckets.Add(0, 2), (std::vector<Range>{{6, 2}}));  // not next to [6, 8)
  EXPECT_TRUE(buckets.Add(2, 1).empty());                      // just after [0, 2)
  // [0, 3) and then [3, 4): 1 MiB, full.
  EXPECT_EQ(buckets.Add(3, 1), (std::vector<Range>{{0, 4}}));
  EXPECT_TRUE(buckets.Flush().empty());
}

// The pass's first bucket closes at 1 MiB: the CNN's dense layers (1.6 MB) go before its
// convolutions finish, then the rest; each pass starts over. Later buckets take min_bytes.
TEST(PushBucketsTest, TheFirstBucketOfEachPassClosesAtOneMebibyte) {
  // The CNN: conv1 3.2 KB, conv2 205 KB, dense1 1.6 MB, dense2 5 KB (kernels; small biases).
  const std::vector<int64_t> cnn = {3200, 128, 204800, 256, 1605632, 512, 5120, 40};
  PushBuckets buckets(cnn, 4 << 20);
  for (int pass = 0; pass < 2; ++pass) {
    EXPECT_EQ(Backward(&buckets), (std::vector<Range>{{4, 4}, {0, 4}})) << pass;
  }
  // Layers of 600 KB: the first bucket closes at two (1.2 MB >= 1 MiB), later ones at 4 MiB.
  const std::vector<int64_t> even = {600 << 10, 0, 600 << 10, 0, 600 << 10, 0, 600 << 10, 0};
  PushBuckets more(even, 1 << 20);
  EXPECT_EQ(Backward(&more), (std::vector<Range>{{4, 4}, {0, 4}}));
  PushBuckets fewer(even, 4 << 20);
  EXPECT_EQ(Backward(&fewer), (std::vector<Range>{{4, 4}, {0, 4}}));
  // A bucket smaller than 1 MiB is used as it is, from the first on.
  PushBuckets small(even, 512 << 10);
  EXPECT_EQ(Backward(&small), (std::vector<Range>{{6, 2}, {4, 2}, {2, 2}, {0, 2}}));
  // The demo's MLP (784-256-10, 0.8 MB) stays one push.
  PushBuckets mlp({784 * 256 * 4, 256 * 4, 256 * 10 * 4, 10 * 4}, 4 << 20);
  std::vector<Range> pushes = mlp.Add(2, 2);
  for (const Range& r : mlp.Add(0, 2)) pushes.push_back(r);
  for (const Range& r : mlp.Flush()) pushes.push_back(r);
  EXPECT_EQ(pushes, (std::vector<Range>{{0, 4}}));
}

}  // namespace
}  // namespace rubato
