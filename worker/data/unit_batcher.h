// UnitBatcher: the data of work reassignment (ClusterSpec.reassign; server/work_queue.h).
//
// Worker w's share of an epoch is what ShardedBatcher would deal it: the examples i with
// i % num_workers == w, in ShardOrder(seed, w, epoch)'s order. The share is cut into units of
// unit_batches consecutive batches of batch_size examples: unit k holds positions
// [k * unit_batches * batch_size, (k + 1) * unit_batches * batch_size) of that order, the last unit
// of a share possibly fewer batches and its last batch fewer examples (nothing is dropped and
// nothing is drawn twice). Any worker can draw any worker's unit: so the units of an epoch, each
// handed out once, use every example of the data set exactly once.
//
// Not thread-safe. Holds a pointer to the Dataset, which must outlive it.
#ifndef RUBATO_WORKER_DATA_UNIT_BATCHER_H_
#define RUBATO_WORKER_DATA_UNIT_BATCHER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/dataset.h"

namespace rubato {

class UnitBatcher {
 public:
  // InvalidArgument (naming the field) unless data is non-null and has at least num_workers
  // examples, num_workers >= 1, batch_size >= 1 and unit_batches >= 1.
  static absl::StatusOr<UnitBatcher> Create(const Dataset* data, int num_workers, int batch_size,
                                            int unit_batches, uint64_t seed);

  // Units in each worker's share of an epoch (TakeWorkRequest.units_per_worker).
  const std::vector<int64_t>& units_per_worker() const { return units_; }

  // Starts drawing unit `index` of worker `owner`'s share of epoch `epoch`. InvalidArgument for a
  // unit that does not exist (naming it).
  absl::Status Begin(int64_t epoch, int owner, int64_t index);
  // Copies the current unit's next batch (features into x, room for batch_size rows; labels into
  // y) and returns its rows; 0 once the unit is done (or none was begun).
  int Next(float* x, int32_t* y);

  // The data set's indices of a unit, in the order Next draws them (for tests and checks).
  std::vector<int64_t> Examples(int64_t epoch, int owner, int64_t index);

  int batch_size() const { return batch_size_; }

 private:
  UnitBatcher(const Dataset* data, int num_workers, int batch_size, int unit_batches,
              uint64_t seed);
  // order_ := owner's share in epoch's order (kept while they stay the same).
  void Order(int64_t epoch, int owner);

  const Dataset* data_;
  int num_workers_;
  int batch_size_;
  int unit_batches_;
  uint64_t seed_;
  std::vector<int64_t> units_;

  int64_t order_epoch_ = -1;
  int order_owner_ = -1;
  std::vector<int64_t> order_;
  int64_t position_ = 0;  // Next index into order_.
  int64_t end_ = 0;       // The current unit's end in order_.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_DATA_UNIT_BATCHER_H_
