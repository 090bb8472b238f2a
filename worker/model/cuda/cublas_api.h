// CublasApi: the few cuBLAS functions the CUDA backend calls, loaded at run time with dlopen().
//
// The worker links no cuBLAS (there is no static libcublas, and a link-time libcublas.so.13 would
// stop the binary from starting on machines without CUDA libraries), so it opens
// libcublas.so.13 when a CUDA backend is created, and a missing library is an UNAVAILABLE status
// rather than a loader error. CublasHandle owns one cublasHandle_t made through it.
#ifndef RUBATO_WORKER_MODEL_CUDA_CUBLAS_API_H_
#define RUBATO_WORKER_MODEL_CUDA_CUBLAS_API_H_

#include <cublas_v2.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rubato {

// One dlopen() of libcublas; dlclose() on destruction, so everything made through it (handles)
// must be destroyed first. Immutable after Load, so it may be shared between threads.
class CublasApi {
 public:
  // Tries, in order: $RUBATO_CUBLAS_DIR/libcublas.so.13 (if set), libcublas.so.13 through the
  // dynamic loader's search path, $CUDA_PATH/lib64/libcublas.so.13 (if set), then
  // /usr/local/cuda/lib64/libcublas.so.13. UNAVAILABLE naming every path tried with its
  // dlerror() when none loads or a symbol is missing.
  static absl::StatusOr<std::unique_ptr<CublasApi>> Load();

  ~CublasApi();
  CublasApi(const CublasApi&) = delete;
  CublasApi& operator=(const CublasApi&) = delete;

  // The path that was loaded.
  const std::string& path() const { return path_; }

  // "CUBLAS_STATUS_NOT_INITIALIZED" (from cublasGetStatusName when the library has it).
  std::string StatusName(cublasStatus_t s) const;

  // OK, or INTERNAL "<what>: <status name>".
  absl::Status Check(cublasStatus_t s, const char* what) const;

  // The entry points, with their cuBLAS signatures.
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*set_math_mode)(cublasHandle_t, cublasMath_t) = nullptr;
  cublasStatus_t (*sgemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                          const float*, const float*, int, const float*, int, const float*, float*,
                          int) = nullptr;
  const char* (*get_status_name)(cublasStatus_t) = nullptr;  // optional: may stay null

 private:
  CublasApi() = default;

  void* library_ = nullptr;  // from dlopen
  std::string path_;
};

// Owns a cublasHandle_t. Movable, not copyable; the CublasApi must outlive it.
class CublasHandle {
 public:
  CublasHandle() = default;
  // cublasCreate, bound to `stream`, in CUBLAS_DEFAULT_MATH mode (plain FP32: no TF32).
  static absl::StatusOr<CublasHandle> Create(const CublasApi* api, cudaStream_t stream);

  ~CublasHandle() { Reset(); }
  CublasHandle(CublasHandle&& o) noexcept : api_(o.api_), handle_(o.handle_) {
    o.handle_ = nullptr;
  }
  CublasHandle& operator=(CublasHandle&& o) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t get() const { return handle_; }
  const CublasApi* api() const { return api_; }

  // Row-major C (m, n) = op(A) (m, k) x op(B) (k, n), where op(X) is X or, when the flag is set, X
  // stored transposed: A is stored (m, k), or (k, m) when transpose_a; B (k, n), or (n, k).
  // INVALID_ARGUMENT when a dimension exceeds cuBLAS's int; INTERNAL naming `what` on failure.
  absl::Status RowMajorGemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                            const float* a, const float* b, float* c, const char* what) const;

 private:
  void Reset();

  const CublasApi* api_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_CUDA_CUBLAS_API_H_
