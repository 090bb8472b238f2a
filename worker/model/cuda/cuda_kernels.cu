// nvcc-compiled half of worker/cuda: device queries and an axpy kernel that exercises the whole
// path (allocation, copies, launch, synchronisation). The backend's kernels are layer_kernels.cu.
#include <cuda_runtime.h>

#include <cstdio>

#include "worker/model/cuda/cuda_kernels.h"

namespace rubato::cuda {
namespace {

int Fail(cudaError_t e, const char* what, std::string* error) {
  *error = std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  return static_cast<int>(e);
}

__global__ void AxpyKernel(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = a * x[i] + y[i];
  }
}

// Owns one device allocation.
struct DeviceBuffer {
  float* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

}  // namespace

int DeviceCount(int* count, std::string* device0, std::string* error) {
  cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    *count = 0;
    return Fail(e, "cudaGetDeviceCount", error);
  }
  if (*count > 0) {
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, 0);
    if (e != cudaSuccess) return Fail(e, "cudaGetDeviceProperties", error);
    char text[256];
    std::snprintf(text, sizeof(text), "%s (sm_%d%d, %.0f GiB)", p.name, p.major, p.minor,
                  p.totalGlobalMem / double(1 << 30));
    *device0 = text;
  }
  return 0;
}

int Axpy(float a, const float* x, float* y, int64_t n, std::string* error) {
  if (n == 0) return 0;
  DeviceBuffer dx, dy;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  cudaError_t e;
  if ((e = cudaMalloc(&dx.ptr, bytes)) != cudaSuccess) return Fail(e, "cudaMalloc", error);
  if ((e = cudaMalloc(&dy.ptr, bytes)) != cudaSuccess) return Fail(e, "cudaMalloc", error);
  if ((e = cudaMemcpy(dx.ptr, x, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
    return Fail(e, "cudaMemcpy to device", error);
  }
  if ((e = cudaMemcpy(dy.ptr, y, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
    return Fail(e, "cudaMemcpy to device", error);
  }
  const int threads = 256;
  const int64_t blocks64 = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(blocks64 < 65535 ? blocks64 : 65535);
  AxpyKernel<<<blocks, threads>>>(a, dx.ptr, dy.ptr, n);
  if ((e = cudaGetLastError()) != cudaSuccess) return Fail(e, "AxpyKernel launch", error);
  if ((e = cudaMemcpy(y, dy.ptr, bytes, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return Fail(e, "cudaMemcpy to host", error);
  }
  return 0;
}

int RuntimeVersion() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

}  // namespace rubato::cuda
