// Layer<T> and SequentialModel<T>: forward and backward passes of a ModelSpec (model_spec.h) on
// the CPU with Eigen, templated on the scalar type: float for training, double for the gradient
// checks in tests. Instantiated for float and double in layers.cc.
//
// Activations are row-major (batch, h*w*c) matrices, each row one example in NHWC order. Every
// GEMM is one Eigen product: Dense is (B, in) x (in, out); Conv2D lays its input out as im2col
// rows (B*Ho*Wo, kh*kw*cin) times the HWIO kernel viewed as (kh*kw*cin, cout), which gives the
// NHWC output directly; its input gradient is the transposed product folded back by col2im.
//
// Nothing here validates its arguments: the spec must be valid (ValidateModelSpec) and callers (the
// backends) check spans, labels and batch sizes first.
#ifndef RUBATO_WORKER_MODEL_LAYERS_H_
#define RUBATO_WORKER_MODEL_LAYERS_H_

#include <Eigen/Dense>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "worker/model/model_spec.h"

namespace rubato {

template <typename T>
using RowMajorMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// One layer of a sequential model. An instance keeps scratch between Forward and Backward (the
// im2col matrix, the pooling argmax), so it is not thread-safe.
template <typename T>
class Layer {
 public:
  using Matrix = RowMajorMatrix<T>;
  using ConstMatrixMap = Eigen::Map<const Matrix>;

  virtual ~Layer() = default;

  // 2 (weight, then bias, shaped as in ModelParamSpecs) for Dense and Conv2D, 0 otherwise.
  virtual int num_params() const = 0;

  // in: (batch, in_shape.size()). Resizes *out to (batch, out_shape.size()) and fills it.
  // `params` holds this layer's num_params() tensors.
  virtual void Forward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap& in,
                       Matrix* out) = 0;

  // After Forward(params, in, out): given dout = d(loss)/d(out), overwrites `grads` (this layer's
  // num_params() tensors) with d(loss)/d(param) and, unless din is null, sets *din (resized to
  // in's shape) to d(loss)/d(in). din must not alias dout.
  virtual void Backward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap& in,
                        const Matrix& out, const Matrix& dout,
                        absl::Span<const absl::Span<T>> grads, Matrix* din) = 0;
};

// The layer `spec` applied to inputs of shape `in`; the pair must be valid (LayerOutputShape).
template <typename T>
std::unique_ptr<Layer<T>> MakeLayer(const LayerSpec& spec, const ActivationShape& in);

// The mean softmax cross-entropy of logits (batch, classes) against labels, computed with each
// row's maximum subtracted so that no exp overflows.
template <typename T>
class SoftmaxCrossEntropy {
 public:
  using Matrix = RowMajorMatrix<T>;

  // Returns the mean loss over the rows (accumulated in double) and sets *dlogits to its gradient,
  // (softmax(z) - onehot(label)) / batch. NaN or infinite if the logits are.
  T LossAndGradient(const Matrix& logits, const int32_t* labels, Matrix* dlogits);

  // Adds the summed loss of the rows to *loss_sum and the number of rows whose argmax (the first,
  // on ties) is the label to *correct.
  void AccumulateLossAndCorrect(const Matrix& logits, const int32_t* labels, double* loss_sum,
                                int64_t* correct);

 private:
  void Statistics(const Matrix& logits);

  // Scratch, (batch) each: the row maxima and the sums of exp(logit - row max).
  Eigen::Matrix<T, Eigen::Dynamic, 1> row_max_;
  Eigen::Matrix<T, Eigen::Dynamic, 1> row_sum_exp_;
};

// A ModelSpec's layers in sequence, then the mean softmax cross-entropy. Not thread-safe: one per
// thread. Scratch is resized only when the batch size changes.
//
// `params` and `grads` hold one span per ModelParamSpecs entry, in that order. Inputs x are
// (batch, spec.input.size()) row-major, NHWC per example.
template <typename T>
class SequentialModel {
 public:
  using Matrix = RowMajorMatrix<T>;

  // Called during the backward pass as soon as the gradients of one layer are final, last layer
  // first, with the layer's tensors as a range of ModelParamSpecs indices [first, first + count).
  using GradientsReady = std::function<void(size_t first, size_t count)>;
  // Called in the forward pass just before a layer's tensors [first, first + count) are first
  // read, first layer first; false stops the pass there (see ForwardBackward).
  using WeightsNeeded = std::function<bool(size_t first, size_t count)>;

  // `spec` must be valid (ValidateModelSpec).
  explicit SequentialModel(const ModelSpec& spec);

  // Computes the logits of `batch` examples into logits(), keeping what the backward pass needs;
  // false if `needed` stopped it (the logits are then incomplete).
  bool Forward(absl::Span<const absl::Span<const T>> params, const T* x, int64_t batch,
               const WeightsNeeded& needed = nullptr);

  // (batch, num_classes) from the last Forward.
  const Matrix& logits() const { return acts_.back(); }

  // When on, Forward and ForwardBackward record each layer's wall time (ms) in forward_ms() and
  // backward_ms(), one entry per layer; the loss is counted in the last layer's.
  void set_timing(bool on) { timing_ = on; }
  const std::vector<double>& forward_ms() const { return forward_ms_; }
  const std::vector<double>& backward_ms() const { return backward_ms_; }

  // Forward, then backward through the mean softmax cross-entropy. Overwrites grads with
  // d(mean loss)/d(param), calling `ready` (if set) after each layer's tensors are written, and
  // returns the mean loss, which is NaN or infinite if the logits overflowed. If `needed` stops
  // the forward pass, returns NaN at once, without a backward pass or a call to `ready`.
  T ForwardBackward(absl::Span<const absl::Span<const T>> params, const T* x, const int32_t* labels,
                    int64_t batch, absl::Span<const absl::Span<T>> grads,
                    const GradientsReady& ready = nullptr, const WeightsNeeded& needed = nullptr);

  // Forward, then adds the summed cross-entropy to *loss_sum and the number of examples whose
  // argmax logit (the first, on ties) is the label to *correct.
  void AccumulateLossAndCorrect(absl::Span<const absl::Span<const T>> params, const T* x,
                                const int32_t* labels, int64_t batch, double* loss_sum,
                                int64_t* correct);

 private:
  using ConstMatrixMap = Eigen::Map<const Matrix>;

  // Input of layer l: x for l = 0, else the output of layer l - 1.
  ConstMatrixMap LayerInput(size_t l, const T* x, int64_t batch) const;

  // Constant after construction.
  std::vector<std::unique_ptr<Layer<T>>> layers_;
  std::vector<size_t> first_param_;  // layers_[l]'s tensors start at params[first_param_[l]]
  std::vector<int64_t> skip_from_;   // An Add's skip_from, else -1
  int64_t input_size_;               // h*w*c of one input example

  // Scratch.
  std::vector<Matrix> acts_;   // acts_[l]: output of layer l, (batch, its shape's size)
  std::vector<Matrix> dacts_;  // dacts_[l]: d(loss)/d(acts_[l]), each kept at its size
  // During the backward pass: the gradient that Adds send to acts_[l] past the layers between.
  std::vector<Matrix> skip_grads_;
  std::vector<bool> skip_pending_;
  SoftmaxCrossEntropy<T> loss_;
  bool timing_ = false;
  std::vector<double> forward_ms_, backward_ms_;
};

extern template std::unique_ptr<Layer<float>> MakeLayer<float>(const LayerSpec&,
                                                               const ActivationShape&);
extern template std::unique_ptr<Layer<double>> MakeLayer<double>(const LayerSpec&,
                                                                 const ActivationShape&);
extern template class SoftmaxCrossEntropy<float>;
extern template class SoftmaxCrossEntropy<double>;
extern template class SequentialModel<float>;
extern template class SequentialModel<double>;

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_LAYERS_H_
