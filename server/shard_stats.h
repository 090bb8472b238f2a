// ShardCounters: what a shard counts as it runs (pushes, refusals, duplicates, drops, the
// staleness histogram, the last learning rate), lock-free; and the parts of GetStats built from
// the tensors and the members.
#ifndef RUBATO_SERVER_SHARD_STATS_H_
#define RUBATO_SERVER_SHARD_STATS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "proto/parameter_server.pb.h"
#include "server/membership.h"
#include "server/tensor_aggregator.h"

namespace rubato {

class ShardCounters {
 public:
  void CountPush(bool accepted) { ++(accepted ? pushes_ : rejected_pushes_); }
  void CountDuplicate() { ++duplicate_gradients_; }
  void CountDroppedGradient() { ++dropped_gradients_; }
  void CountDroppedWorkers(int64_t n) { dropped_workers_ += n; }
  void CountRefusedUpdate() { ++refused_updates_; }
  // An accepted gradient of staleness `tau`, in buckets 0, 1, 2, 3, 4-7, 8-15, 16-31, 32+.
  void RecordStaleness(int64_t tau);
  void SetLearningRate(double lr) { last_learning_rate_ = lr; }

  // Fills the counters' fields of `stats`.
  void Fill(GetStatsResponse* stats) const;

 private:
  std::atomic<int64_t> pushes_{0};
  std::atomic<int64_t> rejected_pushes_{0};
  std::atomic<int64_t> duplicate_gradients_{0};
  std::atomic<int64_t> dropped_workers_{0};
  std::atomic<int64_t> dropped_gradients_{0};
  std::atomic<int64_t> refused_updates_{0};
  std::atomic<int64_t> staleness_histogram_[8] = {};
  std::atomic<double> last_learning_rate_{0};
};

// Fills the tensors' fields of `stats` (each version read once, so that min_version and
// applied_updates agree with the versions listed even while updates run): tensors, bytes,
// min_version, and applied_updates less `restored_versions`.
void FillTensorStats(const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                     int64_t restored_versions, GetStatsResponse* stats);

// Fills the members' fields of `stats` at `now`: finished_workers, restored_step and one
// WorkerStats per registered worker.
void FillWorkerStats(const Membership& members, absl::Time now, GetStatsResponse* stats);

}  // namespace rubato

#endif  // RUBATO_SERVER_SHARD_STATS_H_
