// MlpBackend: the compute interface the training loop runs the MLP through, so that a CUDA backend
// can replace the CPU one (cpu_mlp_backend.h) without touching the loop.
#ifndef RUBATO_WORKER_MLP_BACKEND_H_
#define RUBATO_WORKER_MLP_BACKEND_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace rubato {

struct EvalResult {
  double loss = 0;       // mean softmax cross-entropy, nats
  double accuracy = 0;   // fraction of examples whose argmax logit is the label
  int64_t examples = 0;  // examples evaluated
};

// Runs one MlpSpec's forward and backward passes. An instance keeps scratch buffers between
// calls, so it is not thread-safe: use one per thread.
//
// `params` always holds one span per MlpParamSpecs entry, in that order, with the entry's element
// count; `grads` likewise. Violations, batch or n below 1, and labels outside [0, num_classes) are
// InvalidArgument (naming the tensor or label); a loss that is not finite is InvalidArgument too
// (the parameters have diverged), never a crash.
class MlpBackend {
 public:
  virtual ~MlpBackend() = default;

  // Identifies the implementation in logs and benchmarks, e.g. "cpu-eigen".
  virtual std::string name() const = 0;

  // x: (batch, input_dim); labels: (batch). Overwrites grads with d(mean loss)/d(param) and
  // returns the mean cross-entropy loss over the batch. On error grads may hold partial results.
  virtual absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                                const float* x, const int32_t* labels,
                                                int64_t batch,
                                                absl::Span<const absl::Span<float>> grads) = 0;

  // Mean loss and accuracy over x: (n, input_dim), labels: (n). Works through the examples in
  // chunks, so memory stays bounded for any n.
  virtual absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                              const float* x, const int32_t* labels, int64_t n) = 0;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_MLP_BACKEND_H_
