// ShardTensors: one shard's tensors (server/tensor_aggregator.h), their index by name, and the
// member set they read. Not thread-safe for setting up: the shard adopts or restores them once,
// under its lock, before training starts, and they are constant after, so a push or pull that
// passed the shard's checks uses them without that lock (each tensor has its own).
//
// What the façade (server/parameter_shard.h) asks of all its tensors at once lives here: the
// lowest version, the steps a change of members completes, arming a pull, answering it, the held
// gradients' deadlines.
#ifndef RUBATO_SERVER_SHARD_TENSORS_H_
#define RUBATO_SERVER_SHARD_TENSORS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/optimizer.h"
#include "proto/parameter_server.pb.h"
#include "server/checkpoint_capture.h"
#include "server/membership.h"
#include "server/parked_pulls.h"
#include "server/tensor_aggregator.h"

namespace rubato {

class ShardTensors {
 public:
  using Tensors = std::vector<std::unique_ptr<TensorAggregator>>;
  using Index = absl::flat_hash_map<std::string, int>;

  // The member view starts with no members among `num_workers`.
  explicit ShardTensors(int num_workers);

  ShardTensors(const ShardTensors&) = delete;
  ShardTensors& operator=(const ShardTensors&) = delete;

  // The first registrant's model and initial values (checked by ValidateRegisterRequest), each
  // tensor in parts of `part_elements` (0: whole) with the optimizer's role for it.
  void Adopt(const RegisterRequest& request, const Optimizer& optimizer, int64_t part_elements);
  // Tensors restored from a checkpoint (server/checkpoint_capture.h).
  void Adopt(RestoredTensors restored);

  bool empty() const { return tensors_.empty(); }
  int size() const { return static_cast<int>(tensors_.size()); }
  TensorAggregator& operator[](int slot) const { return *tensors_[slot]; }
  // Both stay at the same address for the shard's life (PushPipeline keeps pointers to them).
  const Tensors& all() const { return tensors_; }
  const Index& index() const { return index_; }

  // The lowest version among the tensors; 0 for none.
  int64_t MinVersion() const;
  int64_t MaxVersion() const;

  // Publishes the members for the tensors to read (TensorAggregator::Context.members) before
  // anything is asked of them again.
  void PublishMembers(const Membership& members);
  const std::shared_ptr<const TensorAggregator::Members>* member_view() const {
    return &member_view_;
  }

  // Applies each tensor's step that is complete with the members published (after one left); the
  // learning rate of the last update applied, if any was.
  std::optional<double> ApplyCompleted(const TensorAggregator::Context& ctx, Released* released);

  // Asks each tensor of `pull` for its snapshot of version `need` (queueing where it is not there
  // yet); true if that completed the pull.
  bool Arm(const PullStatePtr& pull, int64_t need) const;
  // The answer to a completed pull: its tensors' names and snapshots, in its order.
  std::vector<PulledTensor> Answer(PullState& pull) const;

  // Held gradients (bsp's worker order) wait at most `max_wait` for their acknowledgement: answers
  // those past it (DEADLINE_EXCEEDED, into *released) and returns when to look again, at the
  // latest one second from `now`. Checks nothing before the time it last returned.
  absl::Time ExpireHeld(absl::Time now, absl::Duration max_wait, Released* released);
  // Fails every held gradient with `status` (a shutdown).
  void ReleaseHeld(const absl::Status& status, Released* released);

 private:
  Tensors tensors_;
  Index index_;
  // Membership's member set, published for the tensors (std::atomic_load / atomic_store).
  std::shared_ptr<const TensorAggregator::Members> member_view_;
  absl::Time next_held_check_ = absl::InfinitePast();
};

}  // namespace rubato

#endif  // RUBATO_SERVER_SHARD_TENSORS_H_
