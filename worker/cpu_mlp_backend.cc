// CpuMlpBackend: argument checks around MlpMath<float>.
#include "worker/cpu_mlp_backend.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/mlp_math.h"

namespace rubato {
namespace {

// Evaluate's chunk: bounds scratch to (kEvalChunk, widest layer) floats per layer.
constexpr int64_t kEvalChunk = 1024;

class CpuMlpBackend : public MlpBackend {
 public:
  explicit CpuMlpBackend(const MlpSpec& spec)
      : spec_(spec), param_specs_(MlpParamSpecs(spec)), math_(spec) {}

  std::string name() const override { return "cpu-eigen"; }

  absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                        const float* x, const int32_t* labels, int64_t batch,
                                        absl::Span<const absl::Span<float>> grads) override {
    RETURN_IF_ERROR(CheckInputs(params, x, labels, batch, "batch"));
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), grads, "grads"));
    const float loss = math_.ForwardBackward(params, x, labels, batch, grads);
    if (!std::isfinite(loss)) {
      return absl::InvalidArgumentError(absl::StrCat("non-finite loss ", loss, " over a batch of ",
                                                     batch, ": the parameters have diverged"));
    }
    return loss;
  }

  absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                      const float* x, const int32_t* labels, int64_t n) override {
    RETURN_IF_ERROR(CheckInputs(params, x, labels, n, "n"));
    double loss_sum = 0;
    int64_t correct = 0;
    for (int64_t start = 0; start < n; start += kEvalChunk) {
      const int64_t chunk = std::min(kEvalChunk, n - start);
      math_.AccumulateLossAndCorrect(params, x + start * spec_.input_dim, labels + start, chunk,
                                     &loss_sum, &correct);
    }
    if (!std::isfinite(loss_sum)) {
      return absl::InvalidArgumentError(absl::StrCat("non-finite loss ", loss_sum, " over ", n,
                                                     " examples: the parameters have diverged"));
    }
    return EvalResult{loss_sum / n, static_cast<double>(correct) / n, n};
  }

 private:
  absl::Status CheckInputs(absl::Span<const absl::Span<const float>> params, const float* x,
                           const int32_t* labels, int64_t n, const char* n_name) const {
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), params, "params"));
    if (n < 1) return absl::InvalidArgumentError(absl::StrCat(n_name, " must be >= 1, got ", n));
    if (x == nullptr) return absl::InvalidArgumentError("x must not be null");
    if (labels == nullptr) return absl::InvalidArgumentError("labels must not be null");
    return CheckLabels(labels, n, spec_.num_classes);
  }

  // Constant after construction.
  const MlpSpec spec_;
  const std::vector<ParamSpec> param_specs_;

  MlpMath<float> math_;  // scratch buffers reused across calls
};

}  // namespace

absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuMlpBackend(const MlpSpec& spec) {
  RETURN_IF_ERROR(ValidateMlpSpec(spec));
  return std::unique_ptr<MlpBackend>(new CpuMlpBackend(spec));
}

}  // namespace rubato
