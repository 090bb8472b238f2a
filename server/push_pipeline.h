// PushPipeline: one push through a shard, in three stages.
//   validate  the request against the shard's state (PushStages::CheckState, under the shard's
//             lock), then its names, parts and steps against the tensors, then every gradient's
//             values (sizes, finiteness: a read of every byte), the latter in parallel;
//   admit     once every value is checked: the worker must still be a member (PushStages::Admit);
//             nothing is applied unless every gradient is valid and the push admitted;
//   apply     one task per gradient (PushStages::Apply); the last to be done answers.
// A push of more than kInlinePushBytes runs its tasks on the shard's update pool, off the
// transport's thread; a smaller one on the calling thread, where the hand-offs would cost more
// than its work. Each push is a PushOperation that owns its request (the gradients' bytes stay the
// caller's: valid while `keepalive` is held, or until `done` without one). Under bsp a gradient
// held for its turn, with a keepalive, counts as done only once it is added, so that a worker's
// held gradients are bounded by the calls it has in flight.
#ifndef RUBATO_SERVER_PUSH_PIPELINE_H_
#define RUBATO_SERVER_PUSH_PIPELINE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor_wire.h"
#include "proto/parameter_server.pb.h"
#include "server/tensor_aggregator.h"

namespace rubato {

// Where one gradient of a push goes.
struct GradientTarget {
  int tensor = 0;        // The shard's slot.
  int part = -1;         // bsp: the part it holds; -1: the whole gradient.
  int64_t elements = 0;  // Floats it must hold.
  // Once its values are checked: a bound on their magnitudes (common/tensor_wire.h's ScanFloats).
  double max_abs = 0;
};

// What the pipeline asks of the shard.
class PushStages {
 public:
  virtual ~PushStages() = default;
  // Under the shard's lock: the worker is a member, training has started, the step, batch and
  // gradient count are acceptable.
  virtual absl::Status CheckState(const WirePush& request) = 0;
  // What the tensors are lent for a check of a push's step.
  virtual TensorAggregator::Context Context() const = 0;
  // Once every value is checked: OK to apply (the worker is still a member, its lease renewed);
  // an error and nothing is applied.
  virtual absl::Status Admit(const WirePush& request) = 0;
  // Adds one gradient to its tensor. With on_added, a gradient held for its turn reports
  // outcome->held and calls on_added once it is added.
  virtual void Apply(int worker, int64_t step, const GradientTarget& target, const ByteChunks* data,
                     std::shared_ptr<const void> keepalive,
                     std::function<void(absl::Status)> on_added, GradientOutcome* outcome) = 0;
  // What the shard adds to every accepted push's response for `step`.
  virtual void Annotate(int64_t step, PushResponse* response) const = 0;
  virtual void Count(bool accepted) = 0;
  // Runs `task` on the update pool.
  virtual void Post(std::function<void()> task) = 0;
};

class PushPipeline {
 public:
  using Done = std::function<void(absl::StatusOr<PushResponse>)>;
  // Pushes of at most this many bytes of gradients are checked and applied on the calling thread.
  static constexpr size_t kInlinePushBytes = size_t{1} << 20;

  // The tensors and their index are the shard's, constant once it has weights; `stages` outlives
  // every push.
  PushPipeline(int shard_id, const std::vector<std::unique_ptr<TensorAggregator>>* tensors,
               const absl::flat_hash_map<std::string, int>* index, PushStages* stages)
      : shard_id_(shard_id), tensors_(tensors), index_(index), stages_(stages) {}

  // Runs the push; `done` is called once, on a pool thread or the caller's.
  void Push(WirePush request, std::shared_ptr<const void> keepalive, Done done);

 private:
  // Each gradient's tensor and part, after checking names, repeats, offsets and each tensor's
  // step (INVALID_ARGUMENT or FAILED_PRECONDITION naming the gradient).
  absl::StatusOr<std::vector<GradientTarget>> Resolve(const WirePush& request) const;

  const int shard_id_;
  const std::vector<std::unique_ptr<TensorAggregator>>* const tensors_;
  const absl::flat_hash_map<std::string, int>* const index_;
  PushStages* const stages_;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PUSH_PIPELINE_H_
