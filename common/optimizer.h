// Optimizer: the update rules a parameter server applies to one tensor, over plain float spans.
//
// Pure code: no network. The caller (a ParameterShard, later the all-reduce workers) owns the
// weights and one TensorOptimizerState per tensor, and serialises updates of a tensor; updates of
// different tensors may run concurrently. (LAMB borrows a scratch buffer with a non-blocking
// TryLock and recomputes instead when another update holds it: same result either way.)
// Notation: w weights, g gradient (already averaged over workers), lr this update's learning rate
// (from LearningRateSchedule), wd weight decay, t the update count starting at 1.
//
//   sgd    v <- mu*v + (g + wd*w); w <- w - lr*v             (heavy ball, coupled L2)
//          nesterov: w <- w - lr*(g + wd*w + mu*v)            (torch.optim.SGD's documented form)
//          mu = 0: w <- w - lr*(g + wd*w)
//   adam   m <- b1*m + (1-b1)*g'; v <- b2*v + (1-b2)*g'^2, g' = g + wd*w;
//          w <- w - lr * m_hat / (sqrt(v_hat) + eps), m_hat = m/(1-b1^t), v_hat = v/(1-b2^t)
//          (Kingma & Ba 2015, arXiv 1412.6980)
//   adamw  as adam with g' = g, then w <- w - lr*(m_hat/(sqrt(v_hat)+eps) + wd*w)
//          (Loshchilov & Hutter 2019, arXiv 1711.05101; torch.optim.AdamW applies the decay first,
//          w <- w*(1 - lr*wd), then the Adam step: the same number, as both decay the pre-update
//          w; the float grouping is discussed in the implementation and tested against torch)
//   lars   g' = g + wd*w; trust = eta*||w||/(||g'|| + eps) if both norms > 0 else 1;
//          v <- mu*v + lr*trust*g'; w <- w - v
//          (You, Gitman & Ginsburg 2017, arXiv 1708.03888; the TF/TPU reference form)
//   larc   LARS with the local rate clipped at the global one (NVIDIA's LARC, apex.parallel.LARC,
//          clip mode, from the large-batch work of You, Gitman & Ginsburg): g' = g + wd*w;
//          local = eta*||w||/(||g|| + wd*||w|| + eps) if both norms > 0, else the step is plain;
//          rate = lr * min(local/lr, 1) = min(local, lr); v <- mu*v + rate*g'; w <- w - v.
//          eta defaults to 0.02 and eps to 1e-8 (apex's). Like lars, the rate sits inside the
//          momentum buffer; apex scales the gradient by min(local/lr, 1) and multiplies the buffer
//          by lr instead, which is the same update whenever lr does not change between steps.
//   lamb   m, v, m_hat, v_hat as adam (g' = g); r = m_hat/(sqrt(v_hat) + eps); u = r + wd*w;
//          trust = ||w||/||u|| if both norms > 0 else 1; w <- w - lr*trust*u
//          (You et al. 2019, arXiv 1904.00962, Algorithm 2, phi = identity)
//
// Tensors excluded from weight decay get wd = 0; tensors excluded from layer adaptation get
// trust = 1 (lars, larc: rate lr; lamb). See OptimizerConfig in proto/cluster.proto for the
// exclusion rules. Norms are over the whole tensor: Rubato places whole tensors on shards
// (common/placement.h), so a shard always holds every element a norm needs.
#ifndef RUBATO_COMMON_OPTIMIZER_H_
#define RUBATO_COMMON_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "proto/cluster.pb.h"
#include "proto/optimizer_state.pb.h"

namespace rubato {

// Per-tensor optimizer state. Slots are sized lazily by the first Update.
struct TensorOptimizerState {
  int64_t step = 0;          // Updates applied (t after the update).
  std::vector<float> slot1;  // sgd/lars/larc: momentum buffer; adam/adamw/lamb: first moment m.
  std::vector<float> slot2;  // adam/adamw/lamb: second moment v.
};

// How the exclusion rules treat one tensor.
struct TensorRole {
  bool weight_decay = true;      // False: wd = 0 for this tensor.
  bool layer_adaptation = true;  // False: trust ratio 1 (lars, larc, lamb only).
};

// Norms are summed in float lanes of at most this many squares each (optimizer.cc), then in
// double: a lane can overflow only if this many squares can (common/update_guard.h bounds it).
inline constexpr int64_t kOptimizerSquaresPerLane = 128;

class Optimizer {
 public:
  // Fills defaults for unset optional fields, then validates. InvalidArgument naming the field for
  // an unknown type, a learning rate that is not positive and finite, a negative weight decay,
  // momentum or beta outside [0, 1), epsilon < 0 (or 0 for adam/adamw/lamb), a bad regular
  // expression, a negative clip norm, or a field that does not apply to the type (e.g. nesterov
  // without momentum).
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config);

  virtual ~Optimizer() = default;

  // The config with every default filled in (for printing and for checkpoints).
  virtual const OptimizerConfig& config() const = 0;

  // Applies the exclusion rules to a tensor's name and shape.
  virtual TensorRole RoleOf(absl::string_view name, absl::Span<const int64_t> shape) const = 0;

  // Applies one update in place. `grad` has the size of `weights` and is finite (the caller
  // checks). With a pool, large tensors are split across its threads (norms are reduced in a fixed
  // order of fixed-size blocks, so the result does not depend on the number of threads).
  virtual void Update(float lr, absl::Span<const float> grad, absl::Span<float> weights,
                      const TensorRole& role, TensorOptimizerState* state,
                      ThreadPool* pool = nullptr) const = 0;
};

// Checks and completes an OptimizerConfig without building an optimizer (see Optimizer::Create).
absl::StatusOr<OptimizerConfig> CompleteOptimizerConfig(const OptimizerConfig& config);
absl::Status ValidateOptimizerConfig(const OptimizerConfig& config);

// Exact serialization of a tensor's state, for checkpoints.
TensorOptimizerStateProto SaveOptimizerState(absl::string_view optimizer,
                                             const TensorOptimizerState& state);
// InvalidArgument if the proto is from another optimizer type or its slots are not `elements`
// floats (or empty).
absl::StatusOr<TensorOptimizerState> LoadOptimizerState(const TensorOptimizerStateProto& proto,
                                                        absl::string_view optimizer,
                                                        int64_t elements);

// Scales every gradient by min(1, max_norm / ||all grads||_2) and returns the norm before scaling.
// max_norm must be > 0.
double ClipByGlobalNorm(absl::Span<const absl::Span<float>> grads, double max_norm);

}  // namespace rubato

#endif  // RUBATO_COMMON_OPTIMIZER_H_
