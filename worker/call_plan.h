// CallPlan: how a worker's pushes and pulls are cut into calls, shared by every PsClient.
//
// Each tensor lives on the shard PlaceTensors (common/placement.h) picks. A shard's tensors, in
// model order, are grouped into calls of about `target_call_bytes` (a larger tensor goes alone),
// so that calls to one shard can overlap on its connection and no message is tensor-of-the-model
// sized. Register still sends a shard's initial values in one message, so each shard's bytes must
// fit the job's message limit.
#ifndef RUBATO_WORKER_CALL_PLAN_H_
#define RUBATO_WORKER_CALL_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/placement.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// A shard's tensors are sent in calls of about this many bytes.
inline constexpr int64_t kTargetCallBytes = int64_t{8} << 20;
// Room in a message for framing, names and the other fields, beyond the tensors' bytes.
inline constexpr int64_t kMessageOverheadBytes = int64_t{1} << 20;

// One RPC's worth of tensors on one shard.
struct CallGroup {
  int shard = 0;
  std::vector<int> tensors;  // Indices into the model, in model order.
};

struct CallPlan {
  Placement placement;
  std::vector<CallGroup> groups;  // By shard, then model order.
  std::vector<int64_t> elements;  // Per tensor.
};

// InvalidArgument for an empty model, a bad shape, a tensor past kMaxTensorElements, or a shard
// whose bytes cannot fit in one message of `max_message_bytes` (naming the --max_message_mb that
// would).
absl::StatusOr<CallPlan> PlanCalls(const std::vector<TensorSpec>& model, int num_shards,
                                   int64_t max_message_bytes,
                                   int64_t target_call_bytes = kTargetCallBytes);

}  // namespace rubato

#endif  // RUBATO_WORKER_CALL_PLAN_H_
