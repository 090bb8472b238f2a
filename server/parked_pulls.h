// PullState and ParkedPulls: a shard's pulls in progress, and those it has not answered yet.
//
// A PullState is shared by the tensors it waits on (TensorAggregator::Pull fills its slots). A
// pull that cannot be answered at once is parked: ParkedPulls keeps it until it is armed (its
// tensors asked, once the policy lets it start), superseded by the same worker's next pull of an
// overlapping set of tensors, past its deadline, or ended by a shutdown. ParkedPulls is not
// thread-safe: the shard holds it under its lock. Callbacks are never run by it; what must be
// answered is handed back for the caller to answer without the lock.
#ifndef RUBATO_SERVER_PARKED_PULLS_H_
#define RUBATO_SERVER_PARKED_PULLS_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "proto/parameter_server.pb.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/tensor_aggregator.h"

namespace rubato {

// One tensor of a pull's answer: its name and the shared weights of one version.
struct PulledTensor {
  const std::string* name;  // Owned by the shard.
  TensorSnapshot snapshot;
};

class PullState final : public PullWaiter {
 public:
  // Called exactly once per pull, never with the shard's lock held.
  using Done = std::function<void(absl::Status, std::vector<PulledTensor>)>;

  // `tensors`: the shard's slots of the tensors pulled, in the answer's order.
  PullState(int worker, int64_t step, std::vector<int> tensors, absl::Time deadline, Done done);

  bool Fill(int slot, TensorSnapshot snapshot) override;
  bool Over() const override;
  // Ends the pull without an answer; false if it was already over.
  bool End();
  // Whether the two pulls ask for a tensor in common.
  bool Overlaps(const PullState& other) const;
  // The snapshots filled, once the pull is over.
  std::vector<TensorSnapshot> TakeSnapshots();

  int worker() const { return worker_; }
  int64_t step() const { return step_; }
  const std::vector<int>& tensors() const { return tensors_; }
  absl::Time deadline() const { return deadline_; }
  // Answers the pull (once, by whoever ended or completed it).
  void Answer(absl::Status status, std::vector<PulledTensor> tensors) {
    done_(std::move(status), std::move(tensors));
  }

  // Under the shard's lock: its tensors have been asked.
  bool armed = false;

 private:
  const int worker_;
  const int64_t step_;
  const std::vector<int> tensors_;
  const absl::Time deadline_;
  Done done_;

  mutable absl::Mutex mu_;
  std::vector<TensorSnapshot> got_ ABSL_GUARDED_BY(mu_);
  int missing_ ABSL_GUARDED_BY(mu_);
  bool over_ ABSL_GUARDED_BY(mu_) = false;
};

using PullStatePtr = std::shared_ptr<PullState>;

class ParkedPulls {
 public:
  // Returns true when its deadline is earlier than any the last Expire left, or any parked since
  // (whoever keeps the deadlines must look again sooner).
  bool Park(PullStatePtr pull);

  // Ends the same worker's parked pulls that share a tensor with `pull` (an honest worker has one
  // pull per tensor in flight, and a retry replaces a pull whose call broke), and appends to *out
  // what answers them ABORTED. This bounds a worker's parked pulls by the shard's tensors. It
  // looks at that worker's pulls only: with thousands of workers, a scan of all of them on every
  // pull made each step quadratic in the workers.
  void Supersede(const PullState& pull, std::vector<std::function<void()>>* out);

  // Arms every parked pull not yet armed that `may_start` allows, with `arm` (true: that
  // completed it, and it moves to *ready).
  void ArmWhere(const std::function<bool(const PullState&)>& may_start,
                const std::function<bool(const PullStatePtr&)>& arm,
                std::vector<PullStatePtr>* ready);

  // Ends the pulls whose deadline is at or before `now`, appending each with the status `why`
  // gives it to *expired, and returns the earliest deadline of those left (InfiniteFuture if
  // none).
  absl::Time Expire(absl::Time now, const std::function<absl::Status(const PullState&)>& why,
                    std::vector<std::pair<PullStatePtr, absl::Status>>* expired);

  // Ends every parked pull, appending those that were not over yet to *ended.
  void EndAll(std::vector<PullStatePtr>* ended);
  // The same for worker `worker`'s parked pulls only.
  void EndWorker(int worker, std::vector<PullStatePtr>* ended);

  // Parked pulls not yet over.
  int64_t Pending() const;

 private:
  using List = std::list<PullStatePtr>;
  // Removes `it` from the list and from its worker's index; returns the next.
  List::iterator Erase(List::iterator it);

  List parked_;  // In order of arrival.
  // Each worker's entries in parked_ (a few: one per tensor in flight).
  absl::flat_hash_map<int, std::vector<List::iterator>> of_worker_;
  // The earliest deadline the last Expire left, or of a pull parked since.
  absl::Time due_ = absl::InfiniteFuture();
};

// The shard's slots of the tensors `request` asks for, in its order: every tensor (of
// `tensor_count`) for no names, else each name once. INVALID_ARGUMENT for more names than the
// shard has tensors, a bad or unknown name (not on shard `shard_id`), or a name given twice (a
// name repeated n times would make the answer n tensors large).
absl::StatusOr<std::vector<int>> ResolvePull(const PullRequest& request,
                                             const absl::flat_hash_map<std::string, int>& index,
                                             int tensor_count, int shard_id);

// A pull's answer with the weights copied into a PullResponse.
PullResponse CopyPulled(const std::vector<PulledTensor>& tensors);

// What `pull` waits for, for its timeout's message: workers yet to register (before training has
// `started`), the policy's reason it may not start, or the first tensor that is behind and whose
// gradients it lacks.
std::string DescribePullWait(const PullState& pull, bool started, const Membership& members,
                             const ConsistencyPolicy& policy,
                             const std::vector<std::unique_ptr<TensorAggregator>>& tensors);

}  // namespace rubato

#endif  // RUBATO_SERVER_PARKED_PULLS_H_
