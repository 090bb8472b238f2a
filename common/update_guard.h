// UpdateGuard: applies an optimizer update to one tensor only if it leaves every weight and every
// optimizer slot finite; otherwise nothing changes and the update is refused.
//
// Finite gradients can still overflow: a push of values near -3.4e38 times a learning rate, the
// square of a gradient above 1.8e19 in Adam's second moment, a trust ratio over a tiny norm. Copying
// a tensor before each update to be able to undo it would cost a pass over its weights and slots on
// every step, so the guard first bounds the update instead. It keeps upper bounds on the magnitudes
// of the tensor's weights and slots; with the gradient's (from the finiteness check every push
// goes through, common/tensor_wire.h) UpdateBound gives an upper bound on every value the update
// computes or writes, from the rules in common/optimizer.h. Below kSafeMagnitude (FLT_MAX / 34,
// far more than the rounding of a few float operations can add) nothing can overflow and the update
// runs as it is. Otherwise the guard measures the true magnitudes (one read of weights and slots),
// which resets bounds that had only grown loose, and bounds again; only if the bound is still too
// large does it copy the weights and state, update, and put the copy back if any value came out
// NaN or Inf. Normal training measures rarely (LARS at a large rate every few tens of steps, as
// the bound grows by the trust ratio's worst case each step) and never copies.
//
// Not thread-safe: one guard per tensor, used under the tensor's lock.
#ifndef RUBATO_COMMON_UPDATE_GUARD_H_
#define RUBATO_COMMON_UPDATE_GUARD_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "common/optimizer.h"
#include "common/thread_pool.h"
#include "proto/cluster.pb.h"

namespace rubato {

// Upper bounds on magnitudes (absolute values); infinity means unknown.
struct Magnitudes {
  static constexpr double kUnknown = std::numeric_limits<double>::infinity();
  double grad = kUnknown;
  double weights = kUnknown;
  double slot1 = kUnknown;  // sgd, lars, larc: momentum; adam, adamw, lamb: m
  double slot2 = kUnknown;  // adam, adamw, lamb: v
};

// Below this, a bound guarantees a finite float result.
inline constexpr double kSafeMagnitude = 1e37;

// An upper bound on the magnitude of every value Optimizer::Update(lr, g, w, role, state) computes
// or writes for a tensor of `elements` values, given `before`, when the state has taken `steps`
// updates so far; `after` gets bounds on the new weights and slots. `config` is complete
// (Optimizer::config()). Infinite when an input is unknown.
double UpdateBound(const OptimizerConfig& config, float lr, int64_t elements,
                   const TensorRole& role, int64_t steps, const Magnitudes& before,
                   Magnitudes* after);

// The largest magnitude in `values` (0 if empty), or infinity if one is NaN or Inf.
double MaxAbs(absl::Span<const float> values);

class UpdateGuard {
 public:
  // Applies optimizer.Update(lr, grad, weights, role, state, pool) and returns true, unless a
  // weight or a slot would come out non-finite: then returns false with weights and state as they
  // were. `grad_bound` bounds |grad| (Magnitudes::kUnknown: measured here).
  bool Update(const Optimizer& optimizer, float lr, absl::Span<const float> grad,
              double grad_bound, absl::Span<float> weights, const TensorRole& role,
              TensorOptimizerState* state, ThreadPool* pool);

  // The weights or state were replaced (restored from a checkpoint): bounds are unknown again.
  void Forget() { known_ = Magnitudes(); }

  // For tests and stats: updates for which the guard measured the tensor, and those it copied.
  int64_t measured() const { return measured_; }
  int64_t copied() const { return copied_; }

 private:
  void Measure(absl::Span<const float> weights, const TensorOptimizerState& state);

  Magnitudes known_;  // grad unused
  int64_t measured_ = 0;
  int64_t copied_ = 0;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_UPDATE_GUARD_H_
