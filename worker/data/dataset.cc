// Fashion-MNIST loading and per-rank shuffled minibatching.
#include "worker/data/dataset.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "worker/data/idx_reader.h"

namespace rubato {
namespace {

// Uniform in [0, bound), unbiased by rejection. std::uniform_int_distribution would do, but its
// algorithm differs between standard libraries, and the order must not.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  while (true) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

std::vector<int64_t> ShardOrder(int64_t data_size, int rank, int num_ranks, uint64_t seed,
                                int64_t epoch) {
  std::vector<int64_t> order((data_size - rank + num_ranks - 1) / num_ranks);
  const int64_t n = static_cast<int64_t>(order.size());
  for (int64_t k = 0; k < n; ++k) order[k] = rank + k * num_ranks;
  std::mt19937_64 rng(
      Mix64(Mix64(Mix64(seed) ^ static_cast<uint64_t>(rank)) ^ static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[i], order[UniformBelow(rng, static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, Split split, int64_t limit) {
  if (limit < 0) {
    return absl::InvalidArgumentError(absl::StrCat("limit must be >= 0, got ", limit));
  }
  const std::string prefix = absl::StrCat(dir, "/", split == Split::kTrain ? "train" : "t10k");
  const std::string images_path = prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = prefix + "-labels-idx1-ubyte.gz";
  ASSIGN_OR_RETURN(const IdxImages images, ReadIdxImages(images_path));
  ASSIGN_OR_RETURN(const std::vector<uint8_t> labels, ReadIdxLabels(labels_path));

  if (static_cast<int64_t>(labels.size()) != images.count) {
    return absl::DataLossError(absl::StrCat(images_path, " has ", images.count, " images but ",
                                            labels_path, " has ", labels.size(), " labels"));
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] >= kFashionMnistClasses) {
      return absl::DataLossError(absl::StrCat(labels_path, ": label ", labels[i], " of example ", i,
                                              " is not below ", kFashionMnistClasses));
    }
  }

  Dataset data;
  data.size = limit > 0 ? std::min(limit, images.count) : images.count;
  data.dim = int64_t{images.rows} * images.cols;
  data.num_classes = kFashionMnistClasses;
  data.features.resize(data.size * data.dim);
  for (size_t i = 0; i < data.features.size(); ++i) {
    data.features[i] = images.pixels[i] * (1.0f / 255.0f);
  }
  data.labels.assign(labels.begin(), labels.begin() + data.size);
  return data;
}

absl::StatusOr<ShardedBatcher> ShardedBatcher::Create(const Dataset* data, int rank, int num_ranks,
                                                      int batch_size, uint64_t seed) {
  if (data == nullptr) return absl::InvalidArgumentError("data must not be null");
  if (data->size < 0 || data->dim < 1 ||
      static_cast<int64_t>(data->features.size()) != data->size * data->dim ||
      static_cast<int64_t>(data->labels.size()) != data->size) {
    return absl::InvalidArgumentError(absl::StrCat("data is inconsistent: size ", data->size,
                                                   ", dim ", data->dim, ", ", data->features.size(),
                                                   " features, ", data->labels.size(), " labels"));
  }
  if (num_ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_ranks must be >= 1, got ", num_ranks));
  }
  if (rank < 0 || rank >= num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be in [0, num_ranks=", num_ranks, "), got ", rank));
  }
  if (batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", batch_size));
  }
  if (rank >= data->size) {
    return absl::InvalidArgumentError(absl::StrCat("shard of rank ", rank, " of ", num_ranks,
                                                   " is empty: data has ", data->size,
                                                   " examples"));
  }
  return ShardedBatcher(data, rank, num_ranks, batch_size, seed);
}

ShardedBatcher::ShardedBatcher(const Dataset* data, int rank, int num_ranks, int batch_size,
                               uint64_t seed)
    : data_(data), rank_(rank), num_ranks_(num_ranks), batch_size_(batch_size), seed_(seed) {
  Shuffle();
}

void ShardedBatcher::Shuffle() {
  order_ = ShardOrder(data_->size, rank_, num_ranks_, seed_, epoch_);
  position_ = 0;
}

void ShardedBatcher::SeekToExample(int64_t consumed) {
  const int64_t n = static_cast<int64_t>(order_.size());
  epoch_ = consumed / n;
  Shuffle();
  position_ = consumed % n;
}

void ShardedBatcher::Next(float* x, int32_t* y) {
  const int64_t dim = data_->dim;
  for (int b = 0; b < batch_size_; ++b) {
    const int64_t example = order_[position_];
    std::memcpy(x + b * dim, data_->features.data() + example * dim, dim * sizeof(float));
    y[b] = data_->labels[example];
    if (++position_ == static_cast<int64_t>(order_.size())) {
      ++epoch_;
      Shuffle();
    }
  }
}

}  // namespace rubato
