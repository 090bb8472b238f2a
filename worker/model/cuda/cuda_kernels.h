// The raw CUDA entry points, compiled by nvcc (cuda_kernels.cu). Plain C++ without Abseil so that
// nvcc sees only CUDA and the standard library; worker/model/cuda/cuda_device.h wraps them in Status.
// Each returns 0 on success, or a nonzero CUDA error code with its description in `error`.
#ifndef RUBATO_WORKER_MODEL_CUDA_CUDA_KERNELS_H_
#define RUBATO_WORKER_MODEL_CUDA_CUDA_KERNELS_H_

#include <cstdint>
#include <string>

namespace rubato::cuda {

// Number of visible devices, and "name (sm_XY, N GiB)" of device 0.
int DeviceCount(int* count, std::string* device0, std::string* error);

// y <- a * x + y for n floats, through device memory: x and y are host pointers.
int Axpy(float a, const float* x, float* y, int64_t n, std::string* error);

// The CUDA runtime version this was built against, e.g. 13000.
int RuntimeVersion();

}  // namespace rubato::cuda

#endif  // RUBATO_WORKER_MODEL_CUDA_CUDA_KERNELS_H_
