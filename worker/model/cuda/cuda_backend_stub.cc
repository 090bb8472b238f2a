// The CUDA backend for builds without the CUDA toolkit (or with --config=nocuda).
#include "absl/status/status.h"
#include "worker/model/cuda/cuda_backend.h"

namespace rubato {

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(const ModelSpec&, int) {
  return absl::UnavailableError("this binary was built without CUDA");
}

absl::StatusOr<double> CublasSgemmGflops(int64_t, int64_t, int64_t, int) {
  return absl::UnavailableError("this binary was built without CUDA");
}

}  // namespace rubato
