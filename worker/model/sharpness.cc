#include "worker/model/sharpness.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace rubato {

absl::StatusOr<SharpnessResult> EpsilonSharpness(const std::vector<std::vector<float>>& x,
                                                 const LossAndGradient& f,
                                                 const SharpnessOptions& options) {
  if (!(options.epsilon > 0) || !std::isfinite(options.epsilon)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharpness: epsilon must be a positive number, got ", options.epsilon));
  }
  if (options.steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharpness: steps must be >= 1, got ", options.steps));
  }
  std::vector<std::vector<float>> grads;
  SharpnessResult r;
  ASSIGN_OR_RETURN(r.loss, f(x, &grads));
  r.max_loss = r.loss;
  // The box's half-widths, and the point x + y being moved within it.
  std::vector<std::vector<float>> bound(x.size()), y(x.size()), point = x;
  for (size_t t = 0; t < x.size(); ++t) {
    bound[t].resize(x[t].size());
    y[t].assign(x[t].size(), 0.0f);
    for (size_t i = 0; i < x[t].size(); ++i) {
      bound[t][i] = static_cast<float>(options.epsilon * (std::fabs(x[t][i]) + 1.0));
    }
  }
  for (int k = 1; k <= options.steps; ++k) {
    if (grads.size() != x.size()) {
      return absl::InternalError("sharpness: the loss function gave gradients of another model");
    }
    const float scale = 1.0f / static_cast<float>(k);
    for (size_t t = 0; t < x.size(); ++t) {
      if (grads[t].size() != x[t].size()) {
        return absl::InternalError(absl::StrCat("sharpness: gradient ", t, " has ", grads[t].size(),
                                                " values, not ", x[t].size()));
      }
      for (size_t i = 0; i < x[t].size(); ++i) {
        const float g = grads[t][i];
        const float b = bound[t][i];
        // A coordinate where the loss is flat (a zero bias on a convex loss, say) is still moved:
        // upwards, as good a direction as any.
        const float step = g >= 0 ? b * scale : -b * scale;
        y[t][i] = std::clamp(y[t][i] + step, -b, b);
        point[t][i] = x[t][i] + y[t][i];
      }
    }
    ASSIGN_OR_RETURN(const double loss, f(point, &grads));
    if (loss > r.max_loss) {
      r.max_loss = loss;
      r.best_step = k;
    }
  }
  r.sharpness = 100.0 * (r.max_loss - r.loss) / (1.0 + r.loss);
  return r;
}

}  // namespace rubato
