// RAII owners of CUDA runtime resources for the CUDA backend: device and pinned host buffers,
// streams and events, each movable and not copyable, plus CudaCheck, which turns a cudaError_t
// into an INTERNAL status naming the call. Business logic never calls cudaFree and friends.
#ifndef RUBATO_WORKER_MODEL_CUDA_CUDA_HANDLES_H_
#define RUBATO_WORKER_MODEL_CUDA_CUDA_HANDLES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace rubato {

// OK, or INTERNAL "<what>: cudaErrorX (description)".
inline absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// A cudaMalloc'd array of T, or empty.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  static absl::StatusOr<DeviceArray> Allocate(size_t count, const char* what) {
    DeviceArray a;
    if (count == 0) return a;
    void* p = nullptr;
    absl::Status s = CudaCheck(cudaMalloc(&p, count * sizeof(T)), what);
    if (!s.ok()) return s;
    a.ptr_ = static_cast<T*>(p);
    a.count_ = count;
    return a;
  }
  ~DeviceArray() { Reset(); }
  DeviceArray(DeviceArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  void Reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// A cudaMallocHost'd (page-locked) host array of T, for asynchronous copies; or empty.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  static absl::StatusOr<PinnedArray> Allocate(size_t count, const char* what) {
    PinnedArray a;
    if (count == 0) return a;
    void* p = nullptr;
    absl::Status s = CudaCheck(cudaMallocHost(&p, count * sizeof(T)), what);
    if (!s.ok()) return s;
    a.ptr_ = static_cast<T*>(p);
    a.count_ = count;
    return a;
  }
  ~PinnedArray() { Reset(); }
  PinnedArray(PinnedArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  PinnedArray& operator=(PinnedArray&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  void Reset() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// A non-blocking stream (no implicit synchronisation with the legacy default stream).
class CudaStream {
 public:
  CudaStream() = default;
  static absl::StatusOr<CudaStream> Create() {
    CudaStream s;
    absl::Status st =
        CudaCheck(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (!st.ok()) return st;
    return s;
  }
  ~CudaStream() { Reset(); }
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      Reset();
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  void Reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

// An event; with timing for profiling, without (cheaper) for ordering streams.
class CudaEvent {
 public:
  CudaEvent() = default;
  static absl::StatusOr<CudaEvent> Create(bool timing) {
    CudaEvent e;
    absl::Status st = CudaCheck(
        cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming),
        "cudaEventCreate");
    if (!st.ok()) return st;
    return e;
  }
  ~CudaEvent() { Reset(); }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      Reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }

 private:
  void Reset() {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_CUDA_CUDA_HANDLES_H_
