// TensorAggregator: one tensor of a parameter shard, with its own lock. It gathers the workers'
// gradients for the tensor's current step, hands their mean to the optimizer when the consistency
// policy says the step is complete, and answers the pulls that wait for a version.
//
// Gradients arrive as views into the receive buffers (common/tensor_wire.h) and are added into one
// float accumulator straight from them, with no copy of their own. Under bsp the sum is taken in
// worker-id order whatever the arrival order, so that the result is bit-exact in every order: a
// gradient that arrives before those of lower-numbered workers is held (the view, and what keeps
// its buffer alive) until their turn. So the tensor costs its weights, one accumulator and the
// optimizer's slots, plus the held early arrivals, which are the received messages themselves.
// Under backup:b the set of contributors depends on the order of arrival anyway, and gradients are
// added as they come. Under adaptive consistency's ssp:s periods a worker may push a step up to
// ConsistencyPolicy::MaxLead() steps past the version (it pulled older weights): that gradient is
// kept (the received message, or a copy) and acknowledged at once, and added when its step comes;
// a step it completes is applied then. Each worker has at most MaxLead() of them per part.
//
// Under bsp a tensor of more than `part_elements` elements is also kept in parts of that many
// elements (the last one shorter): a worker may push its gradient part by part (each part a call
// of its own, so that what it has in flight stays within the shard's share for it), and each part
// is summed in worker-id order on its own, so a part that comes early is held alone, not the
// whole gradient. The step is complete once every member's every part is in; the sum of each
// element is the same whichever way its gradient arrived, so parts change no bit of the result.
//
// Weights are copy-on-write: a pull takes a reference to the current weights, shared by every pull
// of that version and sent from by the gRPC layer without a copy; an update writes in place unless
// such a reference is still alive, and then into a fresh copy.
//
// Thread-safe. Lock order: the shard's lock, then a tensor's; never two tensors' at once.
#ifndef RUBATO_SERVER_TENSOR_AGGREGATOR_H_
#define RUBATO_SERVER_TENSOR_AGGREGATOR_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/batch_plan.h"
#include "common/clock.h"
#include "common/optimizer.h"
#include "common/tensor_wire.h"
#include "common/update_guard.h"
#include "common/thread_pool.h"
#include "server/consistency_policy.h"
#include "server/noise_scale.h"

namespace rubato {

// The weights of one version, shared by the pulls that read it.
struct TensorSnapshot {
  std::shared_ptr<const std::vector<float>> values;
  int64_t version = 0;
};

// A pull in progress, shared by the tensors it waits on (defined by the shard).
class PullWaiter {
 public:
  virtual ~PullWaiter() = default;
  // Gives slot `slot` its snapshot; true when that was the last missing one (the caller then
  // completes the pull, outside the tensor's lock). Ignored (false) once the pull is over.
  virtual bool Fill(int slot, TensorSnapshot snapshot) = 0;
  virtual bool Over() const = 0;
};

// What one gradient did.
struct GradientOutcome {
  enum Kind { kAccepted, kDuplicate, kDropped } kind = kAccepted;
  int64_t staleness = 0;
  bool applied = false;  // An update was applied (this gradient completed a step, or async).
  bool held = false;     // Held for its turn; its on_added is called once it is added.
  // An update this gradient completed was refused: it would have made a weight or an optimizer
  // slot non-finite (INVALID_ARGUMENT naming the tensor; the tensor is unchanged).
  absl::Status refused;
  // kAccepted: the first of the gradient's parts for this (worker, step) to come (always, for a
  // gradient pushed whole). The staleness histogram counts gradients by it, so that a gradient in
  // parts is one gradient there (a push's response counts each part it carries).
  bool first_part = true;
};

// What a call set free, for the caller to finish once it holds no lock: pulls whose every tensor
// is in, and held gradients that were added (OK) or waited too long (DEADLINE_EXCEEDED); and, for
// each synchronous step applied, the step and the tensor's noise-scale terms
// (server/noise_scale.h).
struct Released {
  std::vector<std::shared_ptr<PullWaiter>> pulls;
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> acks;
  std::vector<std::pair<int64_t, NoiseTerms>> noise;
  // Updates refused (see GradientOutcome::refused), each with what it says.
  std::vector<absl::Status> refused;
};

class TensorAggregator {
 public:
  // A gradient's bytes (already checked: right size, all finite) and what keeps them alive while
  // it is held; with a null keepalive the bytes are copied if they must be held. With on_added, a
  // held gradient is acknowledged only once it is added (on_added(OK)), so that a worker holds at
  // most the calls it has in flight on the shard: the sender waits, instead of the shard buffering
  // whatever it sends meanwhile.
  struct Gradient {
    const ByteChunks* data = nullptr;
    std::shared_ptr<const void> keepalive;
    std::function<void(absl::Status)> on_added;
    // bsp: the part of the tensor `data` holds (part_size(part) floats); -1, the whole
    // gradient.
    int part = -1;
    // A bound on the magnitudes of its values (from the finiteness check); unknown: measured.
    double max_abs = Magnitudes::kUnknown;
  };
  // The job's members: member[w] != 0 for each, and how many.
  struct Members {
    std::vector<char> member;
    int count = 0;
  };
  // What the shard lends each call: the policy, the optimizer, the schedule, and where it
  // publishes its members. The members are read under the tensor's lock, so that a change of
  // membership published before the shard re-checks this tensor is seen by every later push.
  struct Context {
    const ConsistencyPolicy* policy = nullptr;
    const Optimizer* optimizer = nullptr;
    ThreadPool* pool = nullptr;  // Splits one large update; may be null.
    const std::shared_ptr<const Members>* members = nullptr;  // std::atomic_load it
    const LearningRateScheduler* schedule = nullptr;
    // bsp, backup: gets each applied step's noise-scale terms, before the new version is visible
    // (so a worker that has pulled version s + 1 of every tensor finds step s measured). May be
    // null.
    NoiseScaleMonitor* noise = nullptr;
    // An adaptive batch's plan (std::atomic_load it; may be null): each step's rate is scaled by
    // the schedule's rule for that step's global batch.
    const std::shared_ptr<const BatchPlan>* plan = nullptr;
    // When a held gradient arrived is read on it (ExpireHeld's `before` is on the same clock).
    Clock* clock = Clock::Real();
  };

  // part_elements: bsp's part size (see above); 0 or at least the tensor's elements, one part.
  TensorAggregator(std::string name, std::vector<int64_t> shape, std::vector<float> initial,
                   TensorRole role, int num_workers, int64_t part_elements = 0);

  const std::string& name() const { return name_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t elements() const { return elements_; }
  int parts() const { return parts_; }
  int64_t part_elements() const { return part_elements_; }
  // The elements of part `k` in [0, parts()).
  int64_t part_size(int k) const {
    return std::min(part_elements_, elements_ - int64_t{k} * part_elements_);
  }

  int64_t version() const;
  // FailedPrecondition if `step` is from the future for this tensor (bsp, backup, adaptive: more
  // than the policy's MaxLead() past the version).
  absl::Status CheckStep(const Context& ctx, int worker, int64_t step) const;

  // Takes worker `worker`'s gradient for `step` (or one part of it, gradient.part). Returns the
  // learning rate used if an update was applied (outcome->applied). A part that was pushed
  // already (or a whole gradient whose first part was) is a duplicate.
  double Add(const Context& ctx, int worker, int64_t step, Gradient gradient,
             GradientOutcome* outcome, Released* released);

  // Applies the current step if it is complete with the given members (after a member left).
  bool ApplyIfComplete(const Context& ctx, Released* released, double* learning_rate);

  // Answers (DEADLINE_EXCEEDED, naming whom they wait for) the held gradients acknowledged on
  // addition that have waited since before `cutoff`; they stay held, to be added in their turn.
  // Returns the earliest time a remaining one started waiting (InfiniteFuture if none).
  absl::Time ExpireHeld(absl::Time cutoff, const Members& members, int64_t waited_ms,
                        Released* released);
  // Answers every held gradient's acknowledgement with `status` (shutdown).
  void ReleaseHeld(const absl::Status& status, Released* released);

  // Fills `slot` of `waiter` now if the tensor is at version >= `need` (recording what `worker`
  // pulled, for staleness), or queues it until then. Returns true if that filled the waiter's
  // last slot.
  bool Pull(int worker, int64_t need, const std::shared_ptr<PullWaiter>& waiter, int slot);

  // The workers (among members) whose gradient for the current step is missing.
  std::vector<int> Missing(const std::vector<char>& member) const;

  // Bytes held beyond the weights: accumulator, held early arrivals and gradients ahead (for
  // Stats).
  int64_t ExtraBytes() const;
  TensorSnapshot Snapshot() const;

  // Checkpoints. After each update that brings the version to a multiple of `every_versions`
  // (> 0), `sink` gets that version's weights (shared, so the next update copies them, as it does
  // while a pull sends them) and a copy of the optimizer state: the update stalls for that copy
  // only. `sink` runs under the tensor's lock and must not call back into it. Set before training.
  using CaptureSink = std::function<void(int64_t version, TensorSnapshot weights,
                                         TensorOptimizerState optimizer_state)>;
  void SetCheckpointing(int64_t every_versions, CaptureSink sink);
  // Hands the current version to the sink now, if it is a multiple of every_versions (version 0
  // always is): a fresh job's first checkpoint, taken when training starts.
  void CaptureNow();
  // Puts back a checkpointed version and optimizer state (the weights were given to the
  // constructor), before training.
  void Restore(int64_t version, TensorOptimizerState optimizer_state);

 private:
  // One part of a worker's gradient, held for its turn.
  struct Held {
    ByteChunks data;
    std::shared_ptr<const void> keepalive;
    std::string owned;  // When there was no keepalive: a copy.
    double max_abs = Magnitudes::kUnknown;
    // Called once the last held part of the Add that held this one is added (shared by them).
    std::shared_ptr<std::function<void(absl::Status)>> on_added;
    absl::Time since;
    int64_t step = 0;
    bool present = false;
  };

  // A gradient part pushed for a step past the version (MaxLead), kept until that step comes.
  struct Ahead {
    int worker = 0;
    int part = 0;
    int64_t step = 0;
    ByteChunks data;
    std::shared_ptr<const void> keepalive;  // The message, or a copy of the part's bytes.
    double max_abs = Magnitudes::kUnknown;
  };

  // Part `k` of a gradient that holds `count` parts (1: the part itself, else all of them).
  ByteChunks PartOf(const Gradient& gradient, int k, int count) const;
  // Keeps worker `w`'s part `k` of `step` until its step comes.
  void KeepAhead(int w, int k, int64_t step, const ByteChunks& data, double max_abs,
                 const std::shared_ptr<const void>& keepalive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the parts kept ahead for the current step (after an update); drops older ones.
  void TakeAheadDue(const Context& ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the current step while it is complete (after an update: with parts that came ahead).
  void ApplyDueSteps(const Context& ctx, const Members& members, Released* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the held parts that are next in worker-id order for part `k`, skipping non-members.
  void DrainInOrder(int k, const Members& members, Released* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds worker `w`'s held part `k`, and acknowledges its Add if that was its last held part.
  void AddHeld(int w, int k, Released* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands the current version to the checkpoint sink if it is a multiple of checkpoint_every_.
  void CaptureIfDue() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `w`'s part `k` is in: added now if it is its turn (or no turn is kept), else held.
  void TakePart(int w, int k, int64_t step, const ByteChunks& data, double max_abs,
                const std::shared_ptr<const void>& keepalive,
                const std::shared_ptr<std::function<void(absl::Status)>>& on_added,
                const Context& ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (or copies, for the first) part `k`'s bytes, of magnitudes below max_abs, into the
  // accumulator; `measure`: also their squares into squared_norms_.
  void Accumulate(int k, const ByteChunks& data, double max_abs, bool measure = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Held& held(int w, int k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_[w * parts_ + k]; }
  bool StepComplete(const Context& ctx, const Members& members) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Mean of the accumulated gradients, one optimizer step, version + 1, waiters released. An
  // update that would make a value non-finite is refused (the error in released->refused, and
  // returned): the weights stay; under async and ssp the version too, while a synchronous step
  // is skipped (the version advances, so that the pulls waiting for it are answered).
  absl::Status Apply(const Context& ctx, double learning_rate, int64_t step, int worker,
                     Released* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  const std::vector<int64_t> shape_;
  const int64_t elements_;
  const TensorRole role_;
  const int num_workers_;
  const int64_t part_elements_;  // elements_ when the tensor is one part
  const int parts_;

  mutable absl::Mutex mu_;
  int64_t checkpoint_every_ ABSL_GUARDED_BY(mu_) = 0;
  CaptureSink checkpoint_sink_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<std::vector<float>> weights_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  TensorOptimizerState optimizer_state_ ABSL_GUARDED_BY(mu_);
  // The current step's gradients: the sum of those added so far (allocated at first use), and the
  // sum of their squared norms (bsp, backup: for the noise scale).
  std::vector<float> sum_ ABSL_GUARDED_BY(mu_);
  double squared_norms_ ABSL_GUARDED_BY(mu_) = 0;
  double max_abs_ ABSL_GUARDED_BY(mu_) = 0;  // bounds every gradient added (so their mean)
  UpdateGuard guard_ ABSL_GUARDED_BY(mu_);
  std::vector<int> added_ ABSL_GUARDED_BY(mu_);        // (parts) gradients added into each part
  std::vector<int> next_worker_ ABSL_GUARDED_BY(mu_);  // (parts) bsp: lower ids added or skipped
  std::vector<char> got_ ABSL_GUARDED_BY(mu_);         // (workers x parts) for the current step
  std::vector<int> parts_in_ ABSL_GUARDED_BY(mu_);     // (workers) parts received this step
  std::vector<char> received_ ABSL_GUARDED_BY(mu_);    // (workers) every part received
  int received_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Held> held_ ABSL_GUARDED_BY(mu_);            // (workers x parts) early arrivals, bsp
  std::vector<Ahead> ahead_ ABSL_GUARDED_BY(mu_);          // Parts of steps past the version.
  std::vector<int64_t> last_pushed_ ABSL_GUARDED_BY(mu_);  // (workers x parts)
  std::vector<int64_t> pulled_version_ ABSL_GUARDED_BY(mu_);  // (workers)
  struct Waiting {
    std::shared_ptr<PullWaiter> waiter;
    int slot;
    int64_t need;
    int worker;
  };
  std::vector<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_SERVER_TENSOR_AGGREGATOR_H_
