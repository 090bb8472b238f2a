// CudaDevice: whether this worker can use a CUDA GPU, as absl::Status.
//
// Built two ways behind one header: with the CUDA toolkit (cuda_device.cc over the nvcc-compiled
// cuda_kernels.cu) and without it or with --config=nocuda (cuda_device_stub.cc), so the worker
// links and runs on machines without a GPU. This reports devices and runs a checked kernel, which
// proves the toolchain, link and driver path; the CUDA backend itself is cuda_backend.h.
#ifndef RUBATO_WORKER_MODEL_CUDA_CUDA_DEVICE_H_
#define RUBATO_WORKER_MODEL_CUDA_CUDA_DEVICE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rubato {

// True when this binary was compiled with the CUDA toolkit.
bool BuiltWithCuda();

// "CUDA runtime 13.0", or "built without CUDA".
std::string CudaBuildDescription();

// Number of usable devices and a description of device 0. UNAVAILABLE with the reason (no driver,
// no device, built without CUDA) when there is none.
struct CudaDevices {
  int count = 0;
  std::string device0;
};
absl::StatusOr<CudaDevices> ProbeCudaDevices();

// y <- a * x + y on device 0 (x and y are host arrays of n floats). UNAVAILABLE without a device;
// INTERNAL naming the CUDA call that failed.
absl::Status CudaAxpy(float a, const float* x, float* y, int64_t n);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_CUDA_CUDA_DEVICE_H_
