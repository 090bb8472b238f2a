// What a worker checks in the shards' Register answers, and how it brings shards of different
// recoveries back to one (bsp and backup): the roll-back coordination of PsClient::Register.
//
// Under bsp and backup every shard must hold the state of one recovery (RegisterResponse's
// recovery_id). If they differ, a restored shard stands behind the others: every shard of another
// recovery is asked to roll back to the step of the one furthest behind (ParameterShard::Rollback),
// and restarts to do so; registering then starts over.
#ifndef RUBATO_WORKER_PS_RECOVERY_H_
#define RUBATO_WORKER_PS_RECOVERY_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// The smallest bsp part a server may ask for (4 KiB; rubato_server's are 1 to 8 MiB).
inline constexpr int64_t kMinPartElements = 1024;

// FAILED_PRECONDITION if the server at addresses[s] is not shard s of addresses.size(); INTERNAL
// for a resume_step outside [0, 2^48) or a part size that is neither 0 nor in
// [kMinPartElements, kMaxTensorElements] (parts smaller than that would make a tensor thousands of
// calls). Each names the server.
absl::Status CheckRegisterAnswers(const std::vector<RegisterResponse>& responses,
                                  const std::vector<std::string>& addresses);

struct RollbackPlan {
  RollbackRequest request;  // The step and recovery to roll back to (worker_id not set).
  int behind = 0;           // The shard whose checkpoint that is.
  std::vector<int> shards;  // The shards to roll back: those of another recovery.
};

// Under bsp and backup, the roll-back the answers call for; none if every shard holds the same
// recovery (or none was ever restored), or in another mode.
std::optional<RollbackPlan> PlanRollback(const std::vector<RegisterResponse>& responses);

// The recovery id of a roll-back moved back to `step` from recovery `from` because a shard had no
// checkpoint of `from`'s step: the same in every worker that finds so, never 0.
uint64_t RecoveryIdFor(uint64_t from, int64_t step);

// Under bsp, when the answers' tensor versions are not all equal, a sentence saying that a step
// was half applied and that the job is no longer bit-identical to an uninterrupted one; else "".
// (A worker that died between its pushes to different tensors left the step applied on those it
// reached; its replacement recomputes that step on weights of two versions. Not repaired: that
// would need the older version kept, or a roll-back.)
std::string DescribeSplitStep(const std::vector<RegisterResponse>& responses);

// "shard 0 at step 40, recovery 1f; shard 1 at step 60, never restored", for messages.
std::string DescribeRecoveries(const std::vector<RegisterResponse>& responses);

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_RECOVERY_H_
