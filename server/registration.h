// Registration: the checks of a RegisterRequest that need no shard state, the check that a later
// registrant's model is the adopted one, and the election of the one registrant who sends a
// shard's initial values.
#ifndef RUBATO_SERVER_REGISTRATION_H_
#define RUBATO_SERVER_REGISTRATION_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"
#include "common/lr_schedule.h"
#include "server/consistency_policy.h"
#include "server/membership.h"
#include "server/tensor_aggregator.h"

namespace rubato {

// The request on its own, against the job: INVALID_ARGUMENT for a bad worker id, step counts,
// model (empty, too many tensors, bad names or shapes, a name twice), batch, or initial values
// (count, names, sizes, non-finite values); FAILED_PRECONDITION when its worker count or mode is
// not the job's. Fills *model_index (name -> position in request.model()).
absl::Status ValidateRegisterRequest(const RegisterRequest& request, const ClusterSpec& cluster,
                                     int shard_id,
                                     absl::flat_hash_map<std::string, int>* model_index);

// FAILED_PRECONDITION naming the first difference when the request's model (indexed by
// `model_index`) is not exactly the shard's tensors (`index`: the shard's name -> slot).
absl::Status CheckModelMatches(const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                               const absl::flat_hash_map<std::string, int>& index,
                               const RegisterRequest& request,
                               const absl::flat_hash_map<std::string, int>& model_index,
                               int shard_id);

// Who sends a shard's initial values: the first registrant without them is asked; the others are
// told the shard is initialising and come back. If the one asked has not sent them within
// `grant` (it may have died), the next registrant is asked instead. Under the shard's lock.
class InitialValuesElection {
 public:
  explicit InitialValuesElection(absl::Duration grant) : grant_(grant) {}
  // True: `worker` is asked for the values (again, if it was already).
  bool Ask(int worker, absl::Time now);

 private:
  const absl::Duration grant_;
  int asked_ = -1;  // -1: nobody yet.
  absl::Time asked_at_;
};

// INVALID_ARGUMENT for a Rollback from a worker outside the job, to a step out of range or to
// recovery 0 (a fresh start's); FAILED_PRECONDITION under a policy that does not roll back.
absl::Status ValidateRollbackRequest(const RollbackRequest& request, const ClusterSpec& cluster,
                                     const ConsistencyPolicy& policy);

// The job's learning-rate schedule once every worker has registered: for the batch of one update
// under `policy` (ConsistencyPolicy::UpdateBatch: the sum of the workers' batches in bsp and
// backup, one worker's in async and ssp), their steps per epoch and total steps. The scheduler's
// error, prefixed "cannot start training: ", for a schedule the job cannot run.
absl::StatusOr<LearningRateScheduler> ScheduleFor(const Membership& members,
                                                  const ClusterSpec& cluster,
                                                  const ConsistencyPolicy& policy);

}  // namespace rubato

#endif  // RUBATO_SERVER_REGISTRATION_H_
