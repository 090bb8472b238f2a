// The epsilon-sharpness of a trained model: how much its loss can rise within a small box around
// its weights. Keskar, Mudigere, Nocedal, Smelyanskiy & Tang, "On Large-Batch Training for Deep
// Learning: Generalization Gap and Sharp Minima", ICLR 2017 (arXiv 1609.04836), Metric 2.1 with
// A = I (the whole space):
//
//   phi(x, eps) = 100 * (max_{y in C} f(x + y) - f(x)) / (1 + f(x)),
//   C = { y : |y_i| <= eps * (|x_i| + 1) for every weight i },
//
// f being the training loss. The paper finds the maximum with a few iterations of L-BFGS-B; here
// it is projected sign-gradient ascent, the usual ascent for a box: y <- clip(y + (b / k) *
// sign(grad f(x + y)), -b, b) at step k = 1, 2, ..., with b_i = eps * (|x_i| + 1), keeping the
// largest loss seen. Like the paper's, the result is a local maximum, so a lower bound on phi. On a
// convex separable quadratic the first step already lands on the maximising corner (sharpness_test
// checks the closed form).
#ifndef RUBATO_WORKER_MODEL_SHARPNESS_H_
#define RUBATO_WORKER_MODEL_SHARPNESS_H_

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace rubato {

// The loss at `params` (one vector per tensor); fills `grads` (resized like params) with its
// gradient.
using LossAndGradient = std::function<absl::StatusOr<double>(
    absl::Span<const std::vector<float>> params, std::vector<std::vector<float>>* grads)>;

struct SharpnessOptions {
  double epsilon = 1e-3;  // > 0
  int steps = 10;         // Ascent steps (>= 1).
};

struct SharpnessResult {
  double loss = 0;       // f(x)
  double max_loss = 0;   // The largest f(x + y) found in the box.
  double sharpness = 0;  // phi, in percent.
  int best_step = 0;     // The ascent step that found it (0: none rose above f(x)).
};

// InvalidArgument for a bad epsilon or step count; the loss function's errors as they come.
absl::StatusOr<SharpnessResult> EpsilonSharpness(const std::vector<std::vector<float>>& x,
                                                 const LossAndGradient& f,
                                                 const SharpnessOptions& options);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_SHARPNESS_H_
