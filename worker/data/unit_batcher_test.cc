#include "worker/data/unit_batcher.h"

#include <vector>

#include "gtest/gtest.h"
#include "worker/data/counting_dataset.h"

namespace rubato {
namespace {

TEST(UnitBatcherTest, SharesAreCutIntoUnitsOfWholeBatches) {
  const Dataset data = CountingDataset(103, 2);
  // Shares of 26, 26, 26, 25 examples; units of 2 batches of 4 = 8 examples.
  UnitBatcher b = *UnitBatcher::Create(&data, 4, 4, 2, 7);
  EXPECT_EQ(b.units_per_worker(), (std::vector<int64_t>{4, 4, 4, 4}));
  std::vector<float> x(4 * 2);
  std::vector<int32_t> y(4);
  ASSERT_TRUE(b.Begin(0, 3, 3).ok());  // Worker 3's last unit: 1 example (25 = 3 * 8 + 1).
  EXPECT_EQ(b.Next(x.data(), y.data()), 1);
  EXPECT_EQ(static_cast<int64_t>(x[0]) % 4, 3);
  EXPECT_EQ(y[0], static_cast<int32_t>(x[0]) % 10);
  EXPECT_EQ(b.Next(x.data(), y.data()), 0);
  ASSERT_TRUE(b.Begin(1, 0, 0).ok());
  EXPECT_EQ(b.Next(x.data(), y.data()), 4);
  EXPECT_EQ(b.Next(x.data(), y.data()), 4);
  EXPECT_EQ(b.Next(x.data(), y.data()), 0);
}

// Units handed out in any order to any worker: every epoch's units together draw every example
// exactly once, and each unit draws what a ShardedBatcher of its owner would at those positions.
TEST(UnitBatcherTest, AnEpochsUnitsUseEveryExampleExactlyOnce) {
  const Dataset data = CountingDataset(1000, 1);
  for (int workers : {1, 3, 4, 7}) {
    for (int unit_batches : {1, 3}) {
      UnitBatcher b = *UnitBatcher::Create(&data, workers, 16, unit_batches, 42);
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::vector<int> used(data.size, 0);
        for (int owner = workers - 1; owner >= 0; --owner) {
          std::vector<int64_t> share;
          for (int64_t k = b.units_per_worker()[owner]; k-- > 0;) {  // Back to front.
            std::vector<int64_t> unit = b.Examples(epoch, owner, k);
            ASSERT_FALSE(unit.empty());
            for (int64_t e : unit) ++used[e];
            share.insert(share.begin(), unit.begin(), unit.end());
          }
          EXPECT_EQ(share, ShardOrder(data.size, owner, workers, 42, epoch));
        }
        for (int64_t e = 0; e < data.size; ++e) {
          ASSERT_EQ(used[e], 1) << "example " << e << ", " << workers << " workers, epoch "
                                << epoch;
        }
      }
    }
  }
}

TEST(UnitBatcherTest, InvalidArgumentsNameTheProblem) {
  const Dataset data = CountingDataset(10, 1);
  EXPECT_FALSE(UnitBatcher::Create(nullptr, 1, 1, 1, 0).ok());
  EXPECT_FALSE(UnitBatcher::Create(&data, 0, 1, 1, 0).ok());
  EXPECT_FALSE(UnitBatcher::Create(&data, 11, 1, 1, 0).ok());
  EXPECT_FALSE(UnitBatcher::Create(&data, 2, 0, 1, 0).ok());
  EXPECT_FALSE(UnitBatcher::Create(&data, 2, 1, 0, 0).ok());
  UnitBatcher b = *UnitBatcher::Create(&data, 2, 2, 1, 0);
  absl::Status s = b.Begin(0, 1, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no unit 3 of worker 1's share of epoch 0"), std::string::npos) << s;
  EXPECT_FALSE(b.Begin(0, 2, 0).ok());
  EXPECT_FALSE(b.Begin(-1, 0, 0).ok());
  std::vector<float> x(2);
  std::vector<int32_t> y(2);
  EXPECT_EQ(b.Next(x.data(), y.data()), 0);  // Nothing begun after a refused Begin.
}

}  // namespace
}  // namespace rubato
