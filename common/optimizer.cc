#include "common/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

class SgdOptimizer final : public Optimizer {
 public:
  explicit SgdOptimizer(float weight_decay) : weight_decay_(weight_decay) {}

  std::string name() const override { return "sgd"; }

  void Update(float learning_rate, absl::Span<const float> grad, absl::Span<float> weights,
              TensorOptimizerState* state) const override {
    const float lr = learning_rate;
    const float wd = weight_decay_;
    float* w = weights.data();
    const float* g = grad.data();
    const size_t n = weights.size();
    if (wd == 0.0f) {
      for (size_t i = 0; i < n; ++i) w[i] -= lr * g[i];
    } else {
      for (size_t i = 0; i < n; ++i) w[i] -= lr * (g[i] + wd * w[i]);
    }
    ++state->updates;
  }

 private:
  const float weight_decay_;
};

}  // namespace

absl::Status ValidateOptimizerConfig(const OptimizerConfig& config) {
  if (config.type() != "sgd") {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.type: unknown optimizer '", config.type(), "' (known: sgd)"));
  }
  if (!std::isfinite(config.learning_rate()) || config.learning_rate() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.learning_rate must be a positive finite number, got ", config.learning_rate()));
  }
  if (!std::isfinite(config.weight_decay()) || config.weight_decay() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.weight_decay must be a finite number >= 0, got ", config.weight_decay()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config) {
  RETURN_IF_ERROR(ValidateOptimizerConfig(config));
  return std::unique_ptr<Optimizer>(new SgdOptimizer(static_cast<float>(config.weight_decay())));
}

}  // namespace rubato
