// The CUDA ModelBackend (model_backend.h): cuBLAS FP32 GEMMs for Dense and Conv2D (im2col) and
// kernels of our own (layer_kernels.h) for the rest, with weights, activations and gradients on
// the device between layers. Each layer's gradients are copied back on a second stream while the
// device goes on with the next layer's backward pass, so the caller's `ready` callback (the push)
// overlaps the rest of the backward pass.
//
// Built two ways behind this header: with the CUDA toolkit (cuda_backend.cc, cuBLAS loaded at run
// time by cublas_api.h, so the binary starts without CUDA libraries) and without it or with
// --config=nocuda (cuda_backend_stub.cc, where everything is UNAVAILABLE).
#ifndef RUBATO_WORKER_MODEL_CUDA_CUDA_BACKEND_H_
#define RUBATO_WORKER_MODEL_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"

namespace rubato {

// A backend on CUDA device `device`, named "cuda (<device name>)". InvalidArgument if the spec is
// invalid or `device` is not a visible device's index; UNAVAILABLE with the reason when the binary
// was built without CUDA, there is no driver or device, or libcublas.so.13 cannot be loaded;
// INTERNAL naming the CUDA call that failed otherwise. Not thread-safe, like every ModelBackend.
absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(const ModelSpec& spec,
                                                                int device = 0);

// The speed of cuBLAS's FP32 SGEMM on device 0 for a row-major (m, k) x (k, n) product of random
// data, in GFLOP/s (2*m*n*k per product): one warm-up product, then `reps` timed with CUDA events.
// The benchmark's "fraction of cuBLAS peak" divides by it. InvalidArgument unless m, n, k and reps
// are >= 1; UNAVAILABLE as for CreateCudaBackend.
absl::StatusOr<double> CublasSgemmGflops(int64_t m, int64_t n, int64_t k, int reps);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_CUDA_CUDA_BACKEND_H_
