// Dataset: an in-memory classification set (Fashion-MNIST), and ShardedBatcher, which deals each
// worker a disjoint shard of it in reshuffled minibatches.
#ifndef RUBATO_WORKER_DATA_DATASET_H_
#define RUBATO_WORKER_DATA_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rubato {

// Dense features and integer labels, held in memory.
struct Dataset {
  int64_t size = 0;             // number of examples
  int64_t dim = 0;              // features per example
  int num_classes = 0;          // labels lie in [0, num_classes)
  std::vector<float> features;  // (size, dim), pixel/255 in [0, 1]
  std::vector<int32_t> labels;  // (size)
};

enum class Split { kTrain, kTest };

// Fashion-MNIST has 10 classes of 28x28 grayscale images.
inline constexpr int kFashionMnistClasses = 10;

// Debian's dataset-fashion-mnist package installs the four .gz files here.
inline constexpr char kFashionMnistDefaultDir[] = "/usr/share/datasets/fashion-mnist";

// Loads {dir}/train-images-idx3-ubyte.gz and {dir}/train-labels-idx1-ubyte.gz (kTrain: 60000
// examples) or the t10k-* pair (kTest: 10000). With limit > 0, keeps the first `limit` examples
// (all of them if there are fewer). The result has dim = rows * cols and num_classes = 10.
//
// Errors (each naming the file): those of ReadIdxImages/ReadIdxLabels (NotFound for a missing dir
// or file); DataLoss if the image and label counts differ or a label is not below 10;
// InvalidArgument for a negative limit.
absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, Split split, int64_t limit = 0);

// Rank `rank` of `num_ranks`'s shard of a data set of `data_size` examples (the indices i with
// i % num_ranks == rank) in epoch `epoch`'s order: a permutation that is a pure function of (seed,
// rank, epoch), computed with std::mt19937_64 and a portable Fisher-Yates shuffle. ShardedBatcher
// and UnitBatcher (worker/data/unit_batcher.h) both draw from it.
std::vector<int64_t> ShardOrder(int64_t data_size, int rank, int num_ranks, uint64_t seed,
                                int64_t epoch);

// Deals one worker's shard of a Dataset as an endless stream of minibatches.
//
// Rank r of n owns the examples i with i % n == r, so the shards of all ranks are disjoint and
// together cover the dataset. Each epoch visits the shard in a fresh order: a permutation that is a
// pure function of (seed, rank, epoch), computed with std::mt19937_64 and a portable Fisher-Yates
// shuffle, so runs are reproducible across machines and standard libraries.
//
// Batches are cut from the concatenation of the epochs' orders: when an epoch runs out mid-batch,
// the batch continues with the start of the next epoch. So the stream splits into consecutive runs
// of shard_size() examples, one per epoch, each holding every shard example exactly once; and a
// batch never comes up short.
//
// Not thread-safe. Holds a pointer to the Dataset, which must outlive it.
class ShardedBatcher {
 public:
  // InvalidArgument (naming the field) unless data is non-null and consistent (features and labels
  // sized to size * dim and size), 0 <= rank < num_ranks, batch_size >= 1 and the shard is not
  // empty (rank < data->size).
  static absl::StatusOr<ShardedBatcher> Create(const Dataset* data, int rank, int num_ranks,
                                               int batch_size, uint64_t seed);

  // Copies the next batch_size examples: features into x (batch_size, dim), labels into y
  // (batch_size). Reshuffles whenever an epoch's permutation is used up, possibly mid-batch.
  void Next(float* x, int32_t* y);

  // Positions the batcher after `consumed` examples from the start, where it stands after
  // consumed / batch_size calls of Next (a job resumed from a checkpoint draws the same examples
  // as one that never stopped, also under an adaptive batch, whose steps drew different numbers).
  void SeekToExample(int64_t consumed);
  // The following calls of Next draw `batch_size` (>= 1) examples each.
  void SetBatchSize(int batch_size) { batch_size_ = batch_size; }

  // Number of epochs completed, i.e. the epoch the next example is drawn from (0 at first).
  int64_t epoch() const { return epoch_; }
  // Examples in this rank's shard.
  int64_t shard_size() const { return static_cast<int64_t>(order_.size()); }
  // Batches per pass over the shard: ceil(shard_size / batch_size).
  int64_t steps_per_epoch() const { return (shard_size() + batch_size_ - 1) / batch_size_; }
  int batch_size() const { return batch_size_; }

 private:
  ShardedBatcher(const Dataset* data, int rank, int num_ranks, int batch_size, uint64_t seed);

  // Sets order_ to epoch_'s permutation of the shard and rewinds to its start.
  void Shuffle();

  // Constant after construction.
  const Dataset* data_;
  int rank_;
  int num_ranks_;
  int batch_size_;
  uint64_t seed_;

  int64_t epoch_ = 0;
  std::vector<int64_t> order_;  // (shard_size) dataset indices of the shard, in epoch_'s order
  int64_t position_ = 0;        // next index into order_
};

}  // namespace rubato

#endif  // RUBATO_WORKER_DATA_DATASET_H_
