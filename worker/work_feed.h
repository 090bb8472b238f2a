// WorkFeed: where a worker's batches come from under work reassignment (ClusterSpec.reassign).
//
// Without reassignment a worker draws its own shard forever (ShardedBatcher) and stops after the
// job's steps. With it, a feed hands it units of data (worker/data/unit_batcher.h) until the job's
// data is done: from shard 0 as the servers assign them (server/work_queue.h), or replayed from a
// job's unit records (proto/progress.proto UnitRecord), so that a run's assignment can be run
// again.
#ifndef RUBATO_WORKER_WORK_FEED_H_
#define RUBATO_WORKER_WORK_FEED_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/parameter_server.pb.h"
#include "worker/data/unit_batcher.h"
#include "worker/ps/ps_client.h"

namespace rubato {

class WorkFeed {
 public:
  virtual ~WorkFeed() = default;

  // Copies the next batch into x (room for the batcher's batch_size rows) and y, and returns its
  // rows; 0 once the job's data is done for this worker. Sets `began` when the batch is the first
  // of a new unit.
  virtual absl::StatusOr<int> Next(float* x, int32_t* y, std::optional<WorkUnit>* began) = 0;

  // The job's progress as this worker last saw it, in epochs: the units handed out (by the
  // newest seq) over the units of one epoch.
  double epochs() const { return epochs_; }
  // The epoch of the unit being drawn.
  int64_t epoch() const { return epoch_; }

 protected:
  // Bookkeeping of a unit begun.
  void Began(const WorkUnit& unit, int64_t units_per_epoch) {
    epoch_ = unit.epoch();
    epochs_ = static_cast<double>(unit.seq() + 1) / static_cast<double>(units_per_epoch);
  }

 private:
  double epochs_ = 0;
  int64_t epoch_ = 0;
};

// Units from shard 0 (PsClient::TakeWork) for worker `worker` of a job of `epochs` epochs.
std::unique_ptr<WorkFeed> ServerWorkFeed(PsClient* client, UnitBatcher* batcher, int worker,
                                         int64_t epochs);

// The units of worker `worker` in the unit records of `path` (a worker's progress lines, or
// several workers' together; other lines are skipped), in seq order. NotFound for a missing file;
// InvalidArgument, naming the line, for a unit record that does not parse or names a unit that
// does not exist or comes twice; InvalidArgument when the file holds no unit of this worker.
absl::StatusOr<std::unique_ptr<WorkFeed>> ReplayWorkFeed(const std::string& path,
                                                         UnitBatcher* batcher, int worker);

}  // namespace rubato

#endif  // RUBATO_WORKER_WORK_FEED_H_
