// Optimizer: the update rule a parameter server applies to one tensor, over plain float spans.
//
// Pure code: no network, no locking. The caller (a ParameterShard, later the all-reduce workers)
// owns the weights and one TensorOptimizerState per tensor, and serialises updates of a tensor.
//
// Implemented:
//   sgd   w <- w - lr * (g + weight_decay * w)     (plain SGD with coupled L2 decay;
//         the form documented by torch.optim.SGD with momentum 0)
#ifndef RUBATO_COMMON_OPTIMIZER_H_
#define RUBATO_COMMON_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/cluster.pb.h"

namespace rubato {

// Per-tensor optimizer state. `updates` counts the updates applied so far.
struct TensorOptimizerState {
  int64_t updates = 0;
};

class Optimizer {
 public:
  // Returns InvalidArgument naming the field for an unknown type, a learning rate that is not a
  // positive finite number, or a negative or non-finite weight decay.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config);

  virtual ~Optimizer() = default;

  virtual std::string name() const = 0;

  // Applies one update in place. `grad` is the (already averaged) gradient and has the size of
  // `weights`; the caller guarantees both and that `grad` is finite.
  virtual void Update(float learning_rate, absl::Span<const float> grad, absl::Span<float> weights,
                      TensorOptimizerState* state) const = 0;
};

// Checks an OptimizerConfig without building an optimizer (see Optimizer::Create).
absl::Status ValidateOptimizerConfig(const OptimizerConfig& config);

}  // namespace rubato

#endif  // RUBATO_COMMON_OPTIMIZER_H_
