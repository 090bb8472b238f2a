#include "worker/data/unit_batcher.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rubato {

absl::StatusOr<UnitBatcher> UnitBatcher::Create(const Dataset* data, int num_workers,
                                                int batch_size, int unit_batches, uint64_t seed) {
  if (data == nullptr) return absl::InvalidArgumentError("data must not be null");
  if (num_workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_workers must be >= 1, got ", num_workers));
  }
  if (data->size < num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("data has ", data->size, " examples, fewer than ", num_workers, " workers"));
  }
  if (batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", batch_size));
  }
  if (unit_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit_batches must be >= 1, got ", unit_batches));
  }
  return UnitBatcher(data, num_workers, batch_size, unit_batches, seed);
}

UnitBatcher::UnitBatcher(const Dataset* data, int num_workers, int batch_size, int unit_batches,
                         uint64_t seed)
    : data_(data),
      num_workers_(num_workers),
      batch_size_(batch_size),
      unit_batches_(unit_batches),
      seed_(seed) {
  const int64_t unit = int64_t{unit_batches} * batch_size;
  for (int w = 0; w < num_workers; ++w) {
    const int64_t share = (data->size - w + num_workers - 1) / num_workers;
    units_.push_back((share + unit - 1) / unit);
  }
}

void UnitBatcher::Order(int64_t epoch, int owner) {
  if (epoch == order_epoch_ && owner == order_owner_) return;
  order_ = ShardOrder(data_->size, owner, num_workers_, seed_, epoch);
  order_epoch_ = epoch;
  order_owner_ = owner;
}

absl::Status UnitBatcher::Begin(int64_t epoch, int owner, int64_t index) {
  if (epoch < 0 || owner < 0 || owner >= num_workers_ || index < 0 || index >= units_[owner]) {
    position_ = end_ = 0;
    return absl::InvalidArgumentError(
        absl::StrCat("no unit ", index, " of worker ", owner, "'s share of epoch ", epoch, " (",
                     num_workers_, " workers",
                     owner >= 0 && owner < num_workers_
                         ? absl::StrCat(", ", units_[owner], " units in that share")
                         : std::string(),
                     ")"));
  }
  Order(epoch, owner);
  const int64_t unit = int64_t{unit_batches_} * batch_size_;
  position_ = index * unit;
  end_ = std::min<int64_t>(position_ + unit, static_cast<int64_t>(order_.size()));
  return absl::OkStatus();
}

int UnitBatcher::Next(float* x, int32_t* y) {
  const int rows = static_cast<int>(std::min<int64_t>(batch_size_, end_ - position_));
  const int64_t dim = data_->dim;
  for (int b = 0; b < rows; ++b) {
    const int64_t example = order_[position_++];
    std::memcpy(x + b * dim, data_->features.data() + example * dim, dim * sizeof(float));
    y[b] = data_->labels[example];
  }
  return std::max(rows, 0);
}

std::vector<int64_t> UnitBatcher::Examples(int64_t epoch, int owner, int64_t index) {
  std::vector<int64_t> out;
  if (!Begin(epoch, owner, index).ok()) return out;
  out.assign(order_.begin() + position_, order_.begin() + end_);
  position_ = end_;
  return out;
}

}  // namespace rubato
