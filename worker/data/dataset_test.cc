// Tests for LoadFashionMnist and ShardedBatcher.
#include "worker/data/dataset.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/data/counting_dataset.h"

namespace rubato {
namespace {

// Draws `steps` batches and returns the example indices in order, checking each row's contents.
std::vector<int64_t> Draw(ShardedBatcher& batcher, const Dataset& data, int64_t steps) {
  std::vector<float> x(batcher.batch_size() * data.dim);
  std::vector<int32_t> y(batcher.batch_size());
  std::vector<int64_t> examples;
  for (int64_t s = 0; s < steps; ++s) {
    batcher.Next(x.data(), y.data());
    for (int b = 0; b < batcher.batch_size(); ++b) {
      const int64_t example = static_cast<int64_t>(x[b * data.dim]);
      EXPECT_EQ(x[b * data.dim + data.dim - 1], static_cast<float>(example));
      EXPECT_EQ(y[b], data.labels[example]);
      examples.push_back(example);
    }
  }
  return examples;
}

TEST(ShardedBatcherTest, ShardSizesAndSteps) {
  const Dataset data = CountingDataset(103, 3);
  const int64_t expected_sizes[] = {26, 26, 26, 25};
  for (int rank = 0; rank < 4; ++rank) {
    absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, rank, 4, 8, 1);
    ASSERT_TRUE(batcher.ok()) << batcher.status();
    EXPECT_EQ(batcher->shard_size(), expected_sizes[rank]);
    EXPECT_EQ(batcher->steps_per_epoch(), 4);  // ceil(26/8) = ceil(25/8) = 4
    EXPECT_EQ(batcher->epoch(), 0);
  }
  absl::StatusOr<ShardedBatcher> whole = ShardedBatcher::Create(&data, 0, 1, 10, 1);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->shard_size(), 103);
  EXPECT_EQ(whole->steps_per_epoch(), 11);
}

TEST(ShardedBatcherTest, ShardsAreDisjointAndCoverTheData) {
  const Dataset data = CountingDataset(103, 3);
  constexpr int kRanks = 4;
  std::set<int64_t> all;
  int64_t total = 0;
  for (int rank = 0; rank < kRanks; ++rank) {
    absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, rank, kRanks, 1, 7);
    ASSERT_TRUE(batcher.ok()) << batcher.status();
    for (int64_t example : Draw(*batcher, data, batcher->shard_size())) {
      EXPECT_EQ(example % kRanks, rank);
      EXPECT_TRUE(all.insert(example).second) << "example " << example << " seen twice";
      ++total;
    }
  }
  EXPECT_EQ(total, data.size);
  EXPECT_EQ(all.size(), static_cast<size_t>(data.size));
}

TEST(ShardedBatcherTest, EveryExampleOncePerEpochAcrossBatchBoundaries) {
  const Dataset data = CountingDataset(50, 2);
  // Shard of rank 1 of 3: 17 examples; batches of 5 straddle every epoch boundary.
  absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, 1, 3, 5, 42);
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  ASSERT_EQ(batcher->shard_size(), 17);
  const std::vector<int64_t> stream = Draw(*batcher, data, 17);  // 85 examples = 5 epochs
  EXPECT_EQ(batcher->epoch(), 5);
  std::vector<int64_t> shard;
  for (int64_t i = 1; i < 50; i += 3) shard.push_back(i);
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 5; ++e) {
    std::vector<int64_t> epoch(stream.begin() + 17 * e, stream.begin() + 17 * (e + 1));
    epochs.push_back(epoch);
    std::sort(epoch.begin(), epoch.end());
    EXPECT_EQ(epoch, shard) << "epoch " << e;
  }
  // Reshuffled each epoch.
  for (int e = 1; e < 5; ++e) EXPECT_NE(epochs[e], epochs[e - 1]) << "epoch " << e;
}

TEST(ShardedBatcherTest, EpochCountsCompletedPasses) {
  const Dataset data = CountingDataset(10, 1);
  absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, 0, 1, 4, 3);
  ASSERT_TRUE(batcher.ok());
  const int64_t expected[] = {0, 0, 1, 1, 2, 2};  // after 4, 8, 12, 16, 20, 24 examples
  for (int64_t e : expected) {
    Draw(*batcher, data, 1);
    EXPECT_EQ(batcher->epoch(), e);
  }
}

TEST(ShardedBatcherTest, SeekingToAStepsFirstExampleDrawsWhatAnUninterruptedBatcherDraws) {
  const Dataset data = CountingDataset(23, 1);
  for (int64_t step : {0, 1, 5, 6, 11, 40}) {  // Within, at and across epoch ends (7 ranks' shard).
    absl::StatusOr<ShardedBatcher> straight = ShardedBatcher::Create(&data, 2, 3, 3, 9);
    absl::StatusOr<ShardedBatcher> resumed = ShardedBatcher::Create(&data, 2, 3, 3, 9);
    ASSERT_TRUE(straight.ok() && resumed.ok());
    Draw(*straight, data, step);
    resumed->SeekToExample(step * 3);  // Batches of 3.
    EXPECT_EQ(resumed->epoch(), straight->epoch()) << "step " << step;
    EXPECT_EQ(Draw(*resumed, data, 10), Draw(*straight, data, 10)) << "step " << step;
  }
}

TEST(ShardedBatcherTest, OrderIsAFunctionOfSeedRankAndEpoch) {
  const Dataset data = CountingDataset(200, 1);
  auto stream = [&](int rank, uint64_t seed) {
    absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, rank, 2, 10, seed);
    EXPECT_TRUE(batcher.ok());
    return Draw(*batcher, data, 20);  // two epochs of 100
  };
  const std::vector<int64_t> a = stream(0, 123);
  EXPECT_EQ(a, stream(0, 123));
  EXPECT_NE(a, stream(0, 124));
  const std::vector<int64_t> first(a.begin(), a.begin() + 100);
  const std::vector<int64_t> second(a.begin() + 100, a.end());
  EXPECT_NE(first, second);
  // Not simply the ascending shard.
  EXPECT_FALSE(std::is_sorted(first.begin(), first.end()));
  // Rank 1 does not walk rank 0's order shifted by one.
  std::vector<int64_t> b = stream(1, 123);
  for (int64_t& example : b) example -= 1;
  EXPECT_NE(a, b);
}

TEST(ShardedBatcherTest, KnownOrderIsStableAcrossBuilds) {
  // The order must not depend on the standard library or the build; pin one epoch's order.
  const Dataset data = CountingDataset(8, 1);
  absl::StatusOr<ShardedBatcher> batcher = ShardedBatcher::Create(&data, 0, 1, 8, 2024);
  ASSERT_TRUE(batcher.ok());
  const std::vector<int64_t> first = Draw(*batcher, data, 1);
  EXPECT_EQ(first, (std::vector<int64_t>{6, 3, 2, 4, 1, 5, 7, 0}));
}

TEST(ShardedBatcherTest, InvalidArguments) {
  const Dataset data = CountingDataset(3, 2);
  struct Case {
    const Dataset* data;
    int rank, num_ranks, batch_size;
    const char* field;
  };
  Dataset broken = data;
  broken.labels.pop_back();
  for (const Case& c : {Case{nullptr, 0, 1, 1, "data"}, Case{&broken, 0, 1, 1, "data"},
                        Case{&data, 0, 0, 1, "num_ranks"}, Case{&data, -1, 2, 1, "rank"},
                        Case{&data, 2, 2, 1, "rank"}, Case{&data, 0, 2, 0, "batch_size"},
                        Case{&data, 3, 5, 1, "shard"}}) {
    const absl::Status status =
        ShardedBatcher::Create(c.data, c.rank, c.num_ranks, c.batch_size, 0).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(c.field), std::string::npos) << status;
  }
}

// --- LoadFashionMnist ---

TEST(LoadFashionMnistTest, MissingDirIsNotFound) {
  const std::string dir = ::testing::TempDir() + "/no_such_dataset_dir";
  const absl::Status status = LoadFashionMnist(dir, Split::kTrain).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_NE(status.message().find(dir + "/train-images-idx3-ubyte.gz"), std::string::npos)
      << status;
}

TEST(LoadFashionMnistTest, NegativeLimitIsInvalidArgument) {
  EXPECT_EQ(LoadFashionMnist(kFashionMnistDefaultDir, Split::kTest, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

void WriteGzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

// Writes a t10k-* pair of `images` 2x2 images and the given labels into a fresh directory.
std::string WriteTestSplit(const std::string& name, uint8_t images,
                           const std::vector<uint8_t>& labels) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  mkdir(dir.c_str(), 0755);
  std::vector<uint8_t> image_file = {0, 0, 8, 3, 0, 0, 0, images, 0, 0, 0, 2, 0, 0, 0, 2};
  image_file.resize(image_file.size() + 4 * images, 255);
  WriteGzip(dir + "/t10k-images-idx3-ubyte.gz", image_file);
  std::vector<uint8_t> label_file = {0, 0, 8, 1, 0, 0, 0, static_cast<uint8_t>(labels.size())};
  label_file.insert(label_file.end(), labels.begin(), labels.end());
  WriteGzip(dir + "/t10k-labels-idx1-ubyte.gz", label_file);
  return dir;
}

TEST(LoadFashionMnistTest, SmallSplitRoundTrip) {
  const std::string dir = WriteTestSplit("tiny_ok", 3, {4, 0, 9});
  absl::StatusOr<Dataset> data = LoadFashionMnist(dir, Split::kTest);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->size, 3);
  EXPECT_EQ(data->dim, 4);
  EXPECT_EQ(data->num_classes, 10);
  EXPECT_EQ(data->labels, (std::vector<int32_t>{4, 0, 9}));
  EXPECT_EQ(data->features, std::vector<float>(12, 1.0f));
}

TEST(LoadFashionMnistTest, CountMismatchIsDataLoss) {
  const std::string dir = WriteTestSplit("tiny_mismatch", 3, {1, 2});
  const absl::Status status = LoadFashionMnist(dir, Split::kTest).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find(dir + "/t10k-labels-idx1-ubyte.gz"), std::string::npos) << status;
}

TEST(LoadFashionMnistTest, LabelOutOfRangeIsDataLoss) {
  const std::string dir = WriteTestSplit("tiny_bad_label", 2, {1, 10});
  const absl::Status status = LoadFashionMnist(dir, Split::kTest).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find(dir + "/t10k-labels-idx1-ubyte.gz"), std::string::npos) << status;
}

bool HaveRealData() {
  struct stat st;
  return stat(kFashionMnistDefaultDir, &st) == 0 && S_ISDIR(st.st_mode);
}

void ExpectWellFormed(const Dataset& data, int64_t size) {
  EXPECT_EQ(data.size, size);
  EXPECT_EQ(data.dim, 784);
  EXPECT_EQ(data.num_classes, 10);
  ASSERT_EQ(data.features.size(), static_cast<size_t>(size * 784));
  ASSERT_EQ(data.labels.size(), static_cast<size_t>(size));
  const auto [lo, hi] = std::minmax_element(data.features.begin(), data.features.end());
  EXPECT_EQ(*lo, 0.0f);
  EXPECT_EQ(*hi, 1.0f);
  std::map<int32_t, int64_t> counts;
  for (int32_t label : data.labels) ++counts[label];
  ASSERT_EQ(counts.size(), 10u);
  EXPECT_EQ(counts.begin()->first, 0);
  EXPECT_EQ(counts.rbegin()->first, 9);
  for (const auto& [label, count] : counts) EXPECT_EQ(count, size / 10) << "class " << label;
}

TEST(LoadFashionMnistTest, RealTrainSplit) {
  if (!HaveRealData()) {
    GTEST_SKIP() << kFashionMnistDefaultDir << " missing (Debian package dataset-fashion-mnist)";
  }
  absl::StatusOr<Dataset> data = LoadFashionMnist(kFashionMnistDefaultDir, Split::kTrain);
  ASSERT_TRUE(data.ok()) << data.status();
  ExpectWellFormed(*data, 60000);
}

TEST(LoadFashionMnistTest, RealTestSplitAndLimit) {
  if (!HaveRealData()) {
    GTEST_SKIP() << kFashionMnistDefaultDir << " missing (Debian package dataset-fashion-mnist)";
  }
  absl::StatusOr<Dataset> data = LoadFashionMnist(kFashionMnistDefaultDir, Split::kTest);
  ASSERT_TRUE(data.ok()) << data.status();
  ExpectWellFormed(*data, 10000);

  absl::StatusOr<Dataset> head = LoadFashionMnist(kFashionMnistDefaultDir, Split::kTest, 100);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->size, 100);
  EXPECT_EQ(head->labels, std::vector<int32_t>(data->labels.begin(), data->labels.begin() + 100));
  EXPECT_EQ(head->features,
            std::vector<float>(data->features.begin(), data->features.begin() + 100 * 784));

  absl::StatusOr<Dataset> all = LoadFashionMnist(kFashionMnistDefaultDir, Split::kTest, 20000);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size, 10000);
}

}  // namespace
}  // namespace rubato
