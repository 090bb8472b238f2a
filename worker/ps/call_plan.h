// CallPlan: how a worker's pushes and pulls are cut into calls, shared by every PsClient.
//
// Each tensor lives on the shard PlaceTensors (common/placement.h) picks. A shard's tensors, in
// model order, are grouped into calls of about `target_call_bytes` (a larger tensor goes alone),
// so that calls to one shard can overlap on its connection and no message is tensor-of-the-model
// sized. Register still sends a shard's initial values in one message, so each shard's bytes must
// fit the job's message limit.
#ifndef RUBATO_WORKER_PS_CALL_PLAN_H_
#define RUBATO_WORKER_PS_CALL_PLAN_H_

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

// One tensor's gradient in a push, or a part of it: elements [offset, offset + elements).
struct PushPiece {
  int tensor = 0;
  int64_t offset = 0;
  int64_t elements = 0;
};

// One push call: its shard and what it carries.
struct PushCall {
  int shard = 0;
  std::vector<PushPiece> pieces;
};

// The size of a push call to a shard whose bsp part size is `part_elements` (0: whole tensors):
// kTargetCallBytes, or a part's bytes when smaller.
int64_t PushCallBytes(int64_t part_elements, int64_t target_call_bytes = kTargetCallBytes);

// The push calls for `tensors` (model indices, each at most once, in any order): by shard, then in
// model order, whole tensors grouped into calls of about PushCallBytes (target_call_bytes, as
// PlanCalls groups them, or a part's bytes when smaller); a tensor of more than
// part_elements[shard] elements (when that is > 0: the shard cuts bsp gradients into parts,
// RegisterResponse.part_elements) goes in parts of that many elements, each part a call of its
// own.
std::vector<PushCall> PlanPushCalls(const CallPlan& plan, const std::vector<int>& tensors,
                                    const std::vector<int64_t>& part_elements,
                                    int64_t target_call_bytes = kTargetCallBytes);

// InvalidArgument for an empty model, a bad shape, a tensor past kMaxTensorElements, or a shard
// whose bytes cannot fit in one message of `max_message_bytes` (naming the --max_message_mb that
// would).
absl::StatusOr<CallPlan> PlanCalls(const std::vector<TensorSpec>& model, int num_shards,
                                   int64_t max_message_bytes,
                                   int64_t target_call_bytes = kTargetCallBytes);

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_CALL_PLAN_H_
