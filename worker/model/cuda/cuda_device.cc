#include "worker/model/cuda/cuda_device.h"

#include "absl/strings/str_cat.h"
#include "worker/model/cuda/cuda_kernels.h"

namespace rubato {

bool BuiltWithCuda() { return true; }

std::string CudaBuildDescription() {
  const int v = cuda::RuntimeVersion();
  return absl::StrCat("CUDA runtime ", v / 1000, ".", (v % 1000) / 10);
}

absl::StatusOr<CudaDevices> ProbeCudaDevices() {
  CudaDevices d;
  std::string error;
  if (cuda::DeviceCount(&d.count, &d.device0, &error) != 0) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", error));
  }
  if (d.count == 0) return absl::UnavailableError("no CUDA device found");
  return d;
}

absl::Status CudaAxpy(float a, const float* x, float* y, int64_t n) {
  auto devices = ProbeCudaDevices();
  if (!devices.ok()) return devices.status();
  std::string error;
  if (cuda::Axpy(a, x, y, n, &error) != 0) return absl::InternalError(error);
  return absl::OkStatus();
}

}  // namespace rubato
