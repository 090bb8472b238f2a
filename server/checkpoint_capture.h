// A shard's checkpoints in memory: the capture of every tensor at one job step, assembled as the
// tensors hand in their parts; the checkpoint proto built from it; and the way back (a restored
// checkpoint's tensors, after checking it belongs to this job). server/checkpoint.h writes and
// reads the proto; server/checkpoint_writer.h writes it off the update path.
#ifndef RUBATO_SERVER_CHECKPOINT_CAPTURE_H_
#define RUBATO_SERVER_CHECKPOINT_CAPTURE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/optimizer.h"
#include "proto/checkpoint.pb.h"
#include "proto/cluster.pb.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/tensor_aggregator.h"

namespace rubato {

// Every tensor of a shard at one job step. Under bsp and backup each tensor was taken right after
// the update that brought it to version `step`, so the cut is consistent even though tensors
// update independently; under async and ssp, when its own update count reached step x workers.
// The weights are shared with the shard (copy-on-write), the optimizer states copied.
struct CapturedCheckpoint {
  int64_t step = 0;
  std::vector<TensorSnapshot> weights;  // In the shard's tensor order.
  std::vector<TensorOptimizerState> optimizer_states;
};

// Gathers the tensors' captures by step and hands each complete one to its sink. Thread-safe;
// locked after a tensor's lock (Add runs in a tensor's capture sink), never before.
class CheckpointAssembler {
 public:
  using Sink = std::function<void(std::shared_ptr<const CapturedCheckpoint>)>;

  // `sink` must return quickly: it runs on the thread that applied the step's last update, with
  // that tensor's lock held.
  CheckpointAssembler(int tensors, Sink sink) : tensors_(tensors), sink_(std::move(sink)) {}

  // Tensor `tensor`'s capture at job step `step`.
  void Add(int tensor, int64_t step, TensorSnapshot weights, TensorOptimizerState state);
  // The step of the last complete capture (-1: none).
  int64_t last_step() const { return last_step_.load(); }

  // Has each of `tensors` capture its state every `every_steps` job steps (`versions_per_step`
  // versions each: the policy's VersionsPerStep) into this assembler, which must outlive them.
  void Attach(const std::vector<std::unique_ptr<TensorAggregator>>& tensors, int64_t every_steps,
              int64_t versions_per_step);

 private:
  struct Pending {
    std::vector<TensorSnapshot> weights;
    std::vector<TensorOptimizerState> optimizer_states;
    size_t filled = 0;
  };

  const size_t tensors_;
  const Sink sink_;
  absl::Mutex mu_;
  std::map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);  // By step.
  std::atomic<int64_t> last_step_{-1};
};

// The job a shard belongs to, which a checkpoint must match.
struct ShardJob {
  int shard_id = 0;
  int num_shards = 1;
  const ClusterSpec* cluster = nullptr;
  const OptimizerConfig* optimizer = nullptr;  // As the optimizer resolved it.
};

// The proto for `capture`: it plus the job, the tensors' names and shapes, and the workers'
// batches and clocks (from `members`, under the shard's lock), written at `now`.
ShardCheckpoint MakeCheckpointProto(const CapturedCheckpoint& capture, const ShardJob& job,
                                    const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                                    const Membership& members, absl::Time now);

// A checkpoint's tensors, rebuilt as the shard keeps them.
struct RestoredTensors {
  std::vector<std::unique_ptr<TensorAggregator>> tensors;
  absl::flat_hash_map<std::string, int> index;  // name -> slot
  int64_t versions = 0;                         // Their sum.
};

// FAILED_PRECONDITION naming the difference for another job's checkpoint (shard, shard count,
// workers, mode, optimizer type); DATA_LOSS for one that is inconsistent (names, sizes, values,
// versions that are not the checkpoint's step under `policy`, optimizer states).
absl::StatusOr<RestoredTensors> RestoreTensors(const ShardCheckpoint& checkpoint,
                                               const ShardJob& job, const ConsistencyPolicy& policy,
                                               const Optimizer& optimizer, int64_t part_elements);

}  // namespace rubato

#endif  // RUBATO_SERVER_CHECKPOINT_CAPTURE_H_
