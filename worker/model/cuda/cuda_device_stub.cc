// CudaDevice for builds without the CUDA toolkit (or with --config=nocuda).
#include "worker/model/cuda/cuda_device.h"

namespace rubato {

bool BuiltWithCuda() { return false; }

std::string CudaBuildDescription() { return "built without CUDA"; }

absl::StatusOr<CudaDevices> ProbeCudaDevices() {
  return absl::UnavailableError("this binary was built without CUDA");
}

absl::Status CudaAxpy(float, const float*, float*, int64_t) {
  return absl::UnavailableError("this binary was built without CUDA");
}

}  // namespace rubato
