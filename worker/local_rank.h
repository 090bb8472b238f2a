// A worker's rank among the job's processes on its host (its "local rank"), which picks its GPU
// (--cuda_device -1: local rank mod the devices), from what started it.
//
// In order: --local_rank when >= 0; else the first of these variables that is set: LOCAL_RANK
// (./rubato launch, torchrun), SLURM_LOCALID (srun, also under rubato launch --slurm),
// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI's mpirun), MPI_LOCALRANKID (MPICH's and Intel MPI's
// Hydra); else the worker id, which spreads one worker per host over its GPUs only by chance.
#ifndef RUBATO_WORKER_LOCAL_RANK_H_
#define RUBATO_WORKER_LOCAL_RANK_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace rubato {

struct LocalRank {
  int rank = 0;
  std::string source;  // "--local_rank", a variable's name, or "the worker id".
};

// The variables, in the order they are asked.
inline constexpr const char* kLocalRankVariables[] = {
    "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"};

// `flag`: --local_rank (-1: not given). `getenv`: the environment (std::getenv in the binary).
// InvalidArgument naming the flag or the variable whose value is not a rank >= 0.
absl::StatusOr<LocalRank> FindLocalRank(int flag, int worker_id,
                                        const std::function<const char*(const char*)>& getenv);

}  // namespace rubato

#endif  // RUBATO_WORKER_LOCAL_RANK_H_
