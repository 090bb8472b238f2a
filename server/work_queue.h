// WorkQueue: shard 0's hand-out of data units under work reassignment (ClusterSpec.reassign).
//
// FlexRR's RapidReassignment (Harlap et al., SoCC 2016, "Addressing the straggler problem for
// iterative convergent parallel ML") moves work from slow workers to fast ones at run time, so that
// every worker ends an iteration at about the same time. Here the unit of work is a run of
// mini-batches: each worker's share of an epoch (worker/data/unit_batches.h) is cut into units, and
// every worker asks for its next one (TakeWork). A worker gets the front unit of its own share;
// once that is done, the back unit of the share with the most units left (ties: the lowest worker
// id), so the owner keeps working through its share from the front while others eat it from the
// back. When every unit of the current epoch has been handed out, the next epoch begins; after the
// last, every answer is `done`. So each unit of each epoch is handed out exactly once, whatever the
// workers' speeds, and the job ends when the data is done.
//
// A request that repeats the worker's last request number gets the last answer again (a retry after
// a lost answer hands out nothing new). Its state is a few integers per worker (nothing grows with
// the data or the calls). It is not checkpointed: a shard 0 that restarts starts the hand-out over
// (documented in docs/straggler.md). Thread-safe.
#ifndef RUBATO_SERVER_WORK_QUEUE_H_
#define RUBATO_SERVER_WORK_QUEUE_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

class WorkQueue {
 public:
  explicit WorkQueue(int num_workers);

  // The next unit for request.worker_id, or done. INVALID_ARGUMENT for a worker id out of range or
  // a layout out of bounds (see TakeWorkRequest); FAILED_PRECONDITION for a layout that differs
  // from the one the first request fixed (workers started for different jobs), naming both.
  absl::StatusOr<TakeWorkResponse> Take(const TakeWorkRequest& request);

  int64_t handed_out() const;  // Units handed out so far.
  int64_t reassigned() const;  // Of those, units taken from another worker's share.

 private:
  absl::Status CheckLayout(const TakeWorkRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BeginEpoch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int num_workers_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> units_ ABSL_GUARDED_BY(mu_);  // Per share; empty until the first request.
  int64_t epochs_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // The current epoch's units not yet handed out: [front_[w], back_[w]) of worker w's share.
  std::vector<int64_t> front_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> back_ ABSL_GUARDED_BY(mu_);
  // Per worker: the number of its last request and the answer, for a retry (request.request).
  std::vector<int64_t> last_request_ ABSL_GUARDED_BY(mu_);
  std::vector<TakeWorkResponse> last_answer_ ABSL_GUARDED_BY(mu_);
  int64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reassigned_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_WORK_QUEUE_H_
