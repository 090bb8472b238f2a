// ShardOptions: how a parameter-server shard (server/parameter_shard.h) is set up, and the checks
// of them.
#ifndef RUBATO_SERVER_SHARD_OPTIONS_H_
#define RUBATO_SERVER_SHARD_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "common/clock.h"
#include "proto/cluster.pb.h"
#include "server/checkpoint_capture.h"
#include "server/consistency_policy.h"

namespace rubato {

struct ShardOptions {
  int shard_id = 0;
  int num_shards = 1;
  // num_workers, consistency, optimizer, lr_schedule, lease_ms and wait_timeout_ms are used;
  // servers is not.
  ClusterSpec cluster;
  // Threads that share one tensor's update (large tensors only); 1 = the calling thread alone.
  int update_threads = 1;
  // Threads that apply pushed gradients, one tensor each at a time (>= 1).
  int apply_threads = 2;
  // Checkpoints every this many job steps (0: none), and at step 0 when a fresh job's training
  // starts, handed to on_checkpoint (see
  // CapturedCheckpoint), which must return quickly: it runs on the thread that applied the last
  // update of the step, with that tensor's lock held.
  int64_t checkpoint_every_steps = 0;
  std::function<void(std::shared_ptr<const CapturedCheckpoint>)> on_checkpoint;
  // Rolls this shard back to its checkpoint of `step`, as recovery `recovery_id` (see Rollback):
  // `step` once that is arranged (the server restarts from it); when the shard has no checkpoint
  // of `step` (its writer skipped it: server/checkpoint_writer.h), nothing is arranged and the
  // answer is the newest step before it that it has (-1: none); an error names why it cannot be.
  // Null: the shard keeps no checkpoints and refuses roll-backs.
  std::function<absl::StatusOr<int64_t>(int64_t step, uint64_t recovery_id)> on_rollback;
  // bsp, backup: decay of the noise scale's moving averages, in [0, 1) (server/noise_scale.h).
  double noise_ema_decay = 0.95;
  // bsp: what all the workers together should have in flight to this shard. Each worker's share
  // holds two calls (a client's limit), so tensors larger than share / 2 are pushed in parts of
  // that size (RegisterResponse.part_elements; ConsistencyPolicy::PartElements).
  int64_t push_budget_bytes = int64_t{32} << 20;
  // >= 0: this bsp part size (elements; 0 whole tensors) instead of the policy's (tests and
  // fuzzing, which use tensors far smaller than a 1 MiB part).
  int64_t part_elements = -1;
  // What every lease, deadline and idle timeout reads; must outlive the shard.
  Clock* clock = Clock::Real();
  // Where the shard's tasks run (checking and applying large pushes' gradients): empty for an
  // UpdatePool of apply_threads threads; a simulator's event loop (sim/event_loop.h), which must
  // run every task posted before the shard is destroyed.
  std::function<void(std::function<void()>)> post;
  // Whether the shard watches its deadlines (leases, held gradients, pulls' timeouts) on a thread
  // of its own; false: its owner calls ParameterShard::ExpireDeadlines when they are due (a
  // simulator, in simulated time).
  bool deadline_thread = true;
};

// INVALID_ARGUMENT naming the first bad option (shard id and count, the cluster spec, thread
// counts, a missing clock).
absl::Status ValidateShardOptions(const ShardOptions& options);

// The size of the parts bsp's tensors are pushed in (elements; 0 whole tensors): the policy's
// (ConsistencyPolicy::PartElements), or the options' where they set one and the policy pushes in
// parts.
int64_t PartElementsFor(const ShardOptions& options, const ConsistencyPolicy& policy);

}  // namespace rubato

#endif  // RUBATO_SERVER_SHARD_OPTIONS_H_
