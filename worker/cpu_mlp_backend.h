// The CPU MlpBackend: MlpMath<float> on Eigen, single-threaded.
#ifndef RUBATO_WORKER_CPU_MLP_BACKEND_H_
#define RUBATO_WORKER_CPU_MLP_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/mlp.h"
#include "worker/mlp_backend.h"

namespace rubato {

// A backend named "cpu-eigen" for `spec`; InvalidArgument if the spec is invalid.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuMlpBackend(const MlpSpec& spec);

}  // namespace rubato

#endif  // RUBATO_WORKER_CPU_MLP_BACKEND_H_
