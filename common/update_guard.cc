#include "common/update_guard.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

namespace rubato {
namespace {

// A trust ratio divides by a norm summed over float squares: it is 0 (no trust ratio is taken) or
// at least the square root of the smallest positive float, 1.4e-45 -> 3.7e-23. An element whose
// square was lost to underflow is below that in magnitude, so no element exceeds the norm by more
// than rounding: |scale * x_i| <= lr * (eta *) ||w|| * (1 + rounding), which the bounds below take
// twice over.
constexpr double kMinNorm = 3e-23;

// The largest of the values it is given.
class Peak {
 public:
  double operator()(double x) {
    peak_ = std::max(peak_, std::fabs(x));
    return x;
  }
  double value() const { return peak_; }

 private:
  double peak_ = 0;
};

struct AdamMoments {
  double m = 0;
  double v = 0;
};

// Adam's m and v after one step with gradient magnitude gp.
AdamMoments AdamBounds(const OptimizerConfig& c, double gp, const Magnitudes& before, Peak& p) {
  const double b1 = c.beta1();
  const double b2 = c.beta2();
  AdamMoments out;
  out.m = p(p(b1 * before.slot1) + p((1 - b1) * gp));
  out.v = p(p(b2 * before.slot2) + p(p((1 - b2) * gp) * gp));
  return out;
}

}  // namespace

double UpdateBound(const OptimizerConfig& config, float lr, int64_t elements,
                   const TensorRole& role, int64_t steps, const Magnitudes& before,
                   Magnitudes* after) {
  *after = before;
  for (double x : {before.grad, before.weights, before.slot1, before.slot2}) {
    if (!std::isfinite(x)) return Magnitudes::kUnknown;
  }
  const std::string& type = config.type();
  const double wd = role.weight_decay ? config.weight_decay() : 0.0;
  const double t = static_cast<double>(steps + 1);
  const double g = before.grad;
  const double w = before.weights;
  const double rate = lr;
  // A float lane of a norm holds at most kOptimizerSquaresPerLane squares.
  const double lane = static_cast<double>(kOptimizerSquaresPerLane);
  const double w_norm = std::sqrt(static_cast<double>(std::max<int64_t>(elements, 1))) * w;
  Peak p;
  p(g);
  p(w);
  p(rate);
  if (type == "sgd") {
    const double mu = config.momentum();
    const double gp = p(g + p(wd * w));
    if (mu == 0) {
      after->weights = p(w + p(rate * gp));
    } else {
      const double v = p(p(mu * before.slot1) + gp);
      const double step = config.nesterov() ? p(gp + p(mu * v)) : v;
      after->slot1 = v;
      after->weights = p(w + p(rate * step));
    }
  } else if (type == "adam" || type == "adamw") {
    const bool coupled = type == "adam";
    const double eps = static_cast<float>(config.epsilon());
    const double gp = coupled ? p(g + p(wd * w)) : g;
    const AdamMoments mv = AdamBounds(config, gp, before, p);
    p(p(std::sqrt(mv.v) * p(1 / std::sqrt(1 - std::pow(config.beta2(), t)))) + eps);
    // The denominator is at least eps.
    const double q = p(mv.m / eps);
    const double step = p(rate / (1 - std::pow(config.beta1(), t)));
    double dw = p(step * q);
    if (!coupled) dw = p(dw + p(p(rate * wd) * w));
    after->slot1 = mv.m;
    after->slot2 = mv.v;
    after->weights = p(w + dw);
  } else if (type == "lamb") {
    const double eps = static_cast<float>(config.epsilon());
    const AdamMoments mv = AdamBounds(config, g, before, p);
    p(p(std::sqrt(mv.v) * p(1 / std::sqrt(1 - std::pow(config.beta2(), t)))) + eps);
    const double inv_bc1 = p(1 / (1 - std::pow(config.beta1(), t)));
    const double u = p(p(p(mv.m / eps) * inv_bc1) + p(wd * w));
    double dw = p(rate * u);  // trust 1
    if (role.layer_adaptation) {
      p(lane * w * w);
      p(lane * u * u);
      p(rate * w_norm / kMinNorm);  // the scale lr * ||w|| / ||u||, a float
      dw = std::max(dw, p(2 * rate * w_norm));
    }
    after->slot1 = mv.m;
    after->slot2 = mv.v;
    after->weights = p(w + dw);
  } else if (type == "lars" || type == "larc") {
    const double mu = config.momentum();
    const double eta = config.trust_coefficient();
    const double gp = p(g + p(wd * w));
    double scaled = p(rate * gp);  // lars with trust 1; larc, whose rate is at most lr
    if (role.layer_adaptation) {
      p(lane * w * w);
      if (type == "lars") {
        p(lane * gp * gp);
        p(rate * eta * w_norm / kMinNorm);  // the scale lr * trust, a float
        scaled = std::max(scaled, p(2 * rate * eta * w_norm));
      } else {
        p(lane * g * g);
      }
    }
    const double v = p(p(mu * before.slot1) + scaled);
    after->slot1 = v;
    after->weights = p(w + v);
  } else {
    return Magnitudes::kUnknown;
  }
  return p.value();
}

double MaxAbs(absl::Span<const float> values) {
  // On the bits without the sign, a larger finite magnitude is a larger integer, and NaN and Inf
  // are above every finite one.
  uint32_t top = 0;
  for (float x : values) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    top = std::max(top, bits & 0x7fffffffu);
  }
  if (top >= 0x7f800000u) return Magnitudes::kUnknown;
  float largest;
  std::memcpy(&largest, &top, sizeof(largest));
  return largest;
}

void UpdateGuard::Measure(absl::Span<const float> weights, const TensorOptimizerState& state) {
  known_.weights = MaxAbs(weights);
  known_.slot1 = MaxAbs(state.slot1);
  known_.slot2 = MaxAbs(state.slot2);
}

bool UpdateGuard::Update(const Optimizer& optimizer, float lr, absl::Span<const float> grad,
                         double grad_bound, absl::Span<float> weights, const TensorRole& role,
                         TensorOptimizerState* state, ThreadPool* pool) {
  const OptimizerConfig& config = optimizer.config();
  const int64_t n = static_cast<int64_t>(weights.size());
  const double g = std::isfinite(grad_bound) ? grad_bound : MaxAbs(grad);
  Magnitudes before = known_;
  before.grad = g;
  Magnitudes after;
  double bound = UpdateBound(config, lr, n, role, state->step, before, &after);
  if (!(bound < kSafeMagnitude)) {
    // Bounds only grow between measurements: take the true magnitudes and try again.
    ++measured_;
    Measure(weights, *state);
    before = known_;
    before.grad = g;
    bound = UpdateBound(config, lr, n, role, state->step, before, &after);
  }
  if (bound < kSafeMagnitude) {
    optimizer.Update(lr, grad, weights, role, state, pool);
    known_ = after;
    return true;
  }
  // It may overflow: update with a copy to go back to.
  ++copied_;
  const std::vector<float> saved_weights(weights.begin(), weights.end());
  TensorOptimizerState saved_state = *state;
  optimizer.Update(lr, grad, weights, role, state, pool);
  Measure(weights, *state);
  if (std::isfinite(known_.weights) && std::isfinite(known_.slot1) &&
      std::isfinite(known_.slot2)) {
    return true;
  }
  std::copy(saved_weights.begin(), saved_weights.end(), weights.begin());
  *state = std::move(saved_state);
  known_ = before;
  return false;
}

}  // namespace rubato
