// ModelBackend: the compute interface the training loop runs a ModelSpec (model_spec.h) through.
// Two implementations: "cpu-eigen" (cpu_backend.h, SequentialModel<float> on Eigen, multithreaded)
// and "cuda" (cuda/cuda_backend.h, cuBLAS GEMMs and kernels of our own, weights, activations and
// gradients on the device).
//
// One training step, as data:
//   host params (pulled; layer l's awaited through `needed` just before it) --upload--> forward,
//   layer by layer --> softmax cross-entropy
//   --> backward, last layer first; after layer l's backward, its gradients are copied to the
//   host spans `grads` and `ready(first, count)` is called with layer l's tensors, while the
//   backend goes on with layer l-1. The training loop pushes them from that callback, so the
//   push of the last layer overlaps the backward of the first (see training_loop.h).
#ifndef RUBATO_WORKER_MODEL_MODEL_BACKEND_H_
#define RUBATO_WORKER_MODEL_MODEL_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/model_spec.h"

namespace rubato {

struct EvalResult {
  double loss = 0;       // mean softmax cross-entropy, nats
  double accuracy = 0;   // fraction of examples whose argmax logit is the label
  int64_t examples = 0;  // examples evaluated
};

// Time spent in one layer during the last profiled ForwardBackward (see set_profiling), with the
// floating-point operations it did (2 per multiply-add of its GEMMs; 0 for layers without).
struct LayerTime {
  std::string name;  // "conv1", "relu", "pool", "dense2", ... (the weight's prefix when it has one)
  double forward_ms = 0;
  double backward_ms = 0;
  double forward_flops = 0;
  double backward_flops = 0;
};

// Called during the backward pass as soon as one layer's gradients are computed (the CPU backend)
// or their copy to the host is enqueued behind them (CUDA), last layer first, with the layer's
// tensors as a range of ModelParamSpecs indices [first, first + count). Runs on the thread that
// called ForwardBackward and must not touch the backend there; the host copies are final once
// AwaitGradients(first, count) has returned, which may be called from another thread (the
// training loop's communication thread: worker/comm_thread.h).
using GradientsReady = std::function<void(size_t first, size_t count)>;

// Called during the forward pass just before the backend first reads one layer's weights, first
// layer first, with the layer's tensors as a range of ModelParamSpecs indices [first, first +
// count) (layers without weights are not announced). Until it returns, the host spans of those
// tensors may still be being written (the training loop waits there for the layer's pull:
// training_loop.h), so the layers before it compute while the later layers' weights arrive. A
// status other than OK ends the pass there: no gradient is computed, `ready` is not called, and
// ForwardBackward returns that status. Runs on the thread that called ForwardBackward.
using WeightsNeeded = std::function<absl::Status(size_t first, size_t count)>;

// Runs one ModelSpec's forward and backward passes. An instance keeps scratch (device memory for
// CUDA) between calls, so it is not thread-safe: use one per thread.
//
// `params` always holds one span per ModelParamSpecs entry, in that order, with the entry's
// element count; `grads` likewise. Violations, batch or n below 1, a null x or labels, and labels
// outside [0, classes) are InvalidArgument naming the tensor or label; a loss that is not finite
// is InvalidArgument too (the parameters have diverged), never a crash.
class ModelBackend {
 public:
  virtual ~ModelBackend() = default;

  // Identifies the implementation in logs and benchmarks: "cpu-eigen", "cuda (NVIDIA H200)".
  virtual std::string name() const = 0;

  // x: (batch, input size) NHWC per example; labels: (batch). Overwrites grads with
  // d(mean loss)/d(param), calls `needed` (if set) before each layer's weights are read and
  // `ready` (if set) as each layer's gradients are final, and returns the mean cross-entropy over
  // the batch. On error grads may hold partial results.
  virtual absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                                const float* x, const int32_t* labels,
                                                int64_t batch,
                                                absl::Span<const absl::Span<float>> grads,
                                                const GradientsReady& ready = nullptr,
                                                const WeightsNeeded& needed = nullptr) = 0;

  // With a `ready` callback: waits until the host gradients of the layer handed over as (first,
  // count) are final, and returns the error of their copy, if any. Thread-safe against the
  // ForwardBackward call that handed them over (and only that one: every layer handed over must
  // be awaited before the backend's next call). Without `ready`, ForwardBackward returns with
  // every gradient final. The CPU backend's gradients are final when handed over.
  virtual absl::Status AwaitGradients(size_t /*first*/, size_t /*count*/) {
    return absl::OkStatus();
  }

  // The host buffers the caller will pass to ForwardBackward as `params` and `grads` from now on
  // (empty spans: none). A backend may page-lock them (CUDA: cudaHostRegister), so that the
  // weights are copied to the device from them, and the gradients from the device into them,
  // directly: the bytes the data plane receives and sends are the ones the device reads and
  // writes, without a staging copy. Calls with other buffers still work (through staging). They
  // must stay allocated until the next call, or the backend's end. An error (the memory cannot be
  // locked) leaves the backend on staging copies. The CPU backend has nothing to do.
  virtual absl::Status UseHostBuffers(absl::Span<const absl::Span<float>> /*params*/,
                                      absl::Span<const absl::Span<float>> /*grads*/) {
    return absl::OkStatus();
  }

  // Mean loss and accuracy over x: (n, input size), labels: (n), in chunks, so that memory stays
  // bounded for any n.
  virtual absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                              const float* x, const int32_t* labels, int64_t n) = 0;

  // When on, ForwardBackward times every layer (synchronising the device after each, so it is
  // slower) and layer_times() returns the last step's figures. Off by default.
  virtual void set_profiling(bool on) = 0;
  virtual std::vector<LayerTime> layer_times() const = 0;
};

// Argument checks every backend makes first (see ModelBackend): the spans against `specs`, x and
// labels non-null, n >= 1 (`n_name` names it in the message), labels in [0, classes).
absl::Status CheckBackendInputs(absl::Span<const ParamSpec> specs,
                                absl::Span<const absl::Span<const float>> params, const float* x,
                                const int32_t* labels, int64_t n, const char* n_name,
                                int64_t classes);

// The InvalidArgument for a non-finite loss over `n` examples.
absl::Status NonFiniteLoss(double loss, int64_t n);

// Names of the layers for LayerTime: the weight name's prefix ("conv1/kernel" -> "conv1",
// "fc0.weight" -> "fc0"), else the kind ("relu", "pool", "flatten") with its index when it repeats
// ("relu1", "relu2").
std::vector<std::string> LayerNames(const ModelSpec& spec);

// Multiply-adds x 2 of one layer's forward and backward GEMMs for `batch` examples (0 and 0 for
// layers without a GEMM). The backward of the first layer computes no input gradient.
void LayerFlops(const ModelSpec& spec, size_t layer, int64_t batch, double* forward,
                double* backward);

// The CPU backend: SequentialModel<float> on Eigen with `threads` threads for its GEMMs (Eigen's
// OpenMP parallelism; 0 means one per core). InvalidArgument if the spec is invalid.
absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCpuBackend(const ModelSpec& spec,
                                                               int threads = 1);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_MODEL_BACKEND_H_
