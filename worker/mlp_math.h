// MlpMath<T>: the MLP's forward pass, softmax cross-entropy and backward pass with Eigen, as a
// template on the scalar type. The CPU backend runs it in float; tests run it in double as the
// reference for finite differences and for other backends.
//
// Layout follows MlpParamSpecs: params[2i] is fc{i}.weight (in_i, out_i) row-major, params[2i+1]
// is fc{i}.bias (out_i). Inputs are (batch, input_dim) row-major. Nothing here validates its
// arguments: callers (the backends) check spans, labels and batch sizes first.
#ifndef RUBATO_WORKER_MLP_MATH_H_
#define RUBATO_WORKER_MLP_MATH_H_

#include <Eigen/Dense>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "worker/mlp.h"

namespace rubato {

template <typename T>
class MlpMath {
 public:
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;
  using ColVector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

  // `spec` must be valid (ValidateMlpSpec).
  explicit MlpMath(const MlpSpec& spec);

  // Computes the logits of `batch` examples x (batch, input_dim) into logits().
  void Forward(absl::Span<const absl::Span<const T>> params, const T* x, int64_t batch);

  // (batch, num_classes) from the last Forward.
  const Matrix& logits() const { return acts_.back(); }

  // Forward, then backward through the mean softmax cross-entropy over the batch. Overwrites
  // grads (shaped like params) with d(mean loss)/d(param) and returns the mean loss, which is
  // NaN or infinite if the logits overflowed.
  T ForwardBackward(absl::Span<const absl::Span<const T>> params, const T* x, const int32_t* labels,
                    int64_t batch, absl::Span<const absl::Span<T>> grads);

  // Forward, then adds the summed cross-entropy of the batch to *loss_sum and the number of
  // examples whose argmax logit (the first, on ties) is the label to *correct.
  void AccumulateLossAndCorrect(absl::Span<const absl::Span<const T>> params, const T* x,
                                const int32_t* labels, int64_t batch, double* loss_sum,
                                int64_t* correct);

 private:
  using ConstMatrixMap = Eigen::Map<const Matrix>;

  // Input of layer l: x for l = 0, else the ReLU output of layer l - 1. (batch, sizes_[l])
  ConstMatrixMap LayerInput(int l, const T* x, int64_t batch) const {
    return ConstMatrixMap(l == 0 ? x : acts_[l - 1].data(), batch, sizes_[l]);
  }

  // Sets row_max_ (batch) and row_sum_exp_ (batch), the sum of exp(logit - row max), from logits().
  void SoftmaxStatistics();

  // Constant after construction.
  std::vector<int64_t> sizes_;  // layer l maps sizes_[l] -> sizes_[l + 1]
  int num_layers_;

  // Scratch, resized only when the batch size changes, so steady-state steps do not allocate.
  std::vector<Matrix> acts_;    // acts_[l]: (batch, sizes_[l+1]); ReLU output, logits for the last
  std::vector<Matrix> deltas_;  // deltas_[l]: (batch, sizes_[l+1]); d(mean loss)/d(pre-activation)
  ColVector row_max_;           // (batch) max logit per example
  ColVector row_sum_exp_;       // (batch) sum_c exp(logit_c - row max)
};

// ---- Implementation ----

template <typename T>
MlpMath<T>::MlpMath(const MlpSpec& spec) {
  sizes_.push_back(spec.input_dim);
  sizes_.insert(sizes_.end(), spec.hidden.begin(), spec.hidden.end());
  sizes_.push_back(spec.num_classes);
  num_layers_ = static_cast<int>(sizes_.size()) - 1;
  acts_.resize(num_layers_);
  deltas_.resize(num_layers_);
}

template <typename T>
void MlpMath<T>::Forward(absl::Span<const absl::Span<const T>> params, const T* x, int64_t batch) {
  for (int l = 0; l < num_layers_; ++l) {
    const ConstMatrixMap w(params[2 * l].data(), sizes_[l], sizes_[l + 1]);
    const Eigen::Map<const RowVector> b(params[2 * l + 1].data(), sizes_[l + 1]);
    Matrix& out = acts_[l];
    out.resize(batch, sizes_[l + 1]);
    out.noalias() = LayerInput(l, x, batch) * w;
    out.rowwise() += b;
    if (l + 1 < num_layers_) out = out.cwiseMax(T(0));
  }
}

template <typename T>
void MlpMath<T>::SoftmaxStatistics() {
  const Matrix& z = logits();
  row_max_.resize(z.rows());
  row_max_ = z.rowwise().maxCoeff();
  row_sum_exp_.resize(z.rows());
  row_sum_exp_ = (z.colwise() - row_max_).array().exp().rowwise().sum().matrix();
}

template <typename T>
T MlpMath<T>::ForwardBackward(absl::Span<const absl::Span<const T>> params, const T* x,
                              const int32_t* labels, int64_t batch,
                              absl::Span<const absl::Span<T>> grads) {
  Forward(params, x, batch);
  SoftmaxStatistics();

  // Output layer: loss_i = log(sum exp(z_i - m_i)) - (z_iy - m_i);
  // d(mean loss)/dz_i = (softmax(z_i) - onehot(y_i)) / batch.
  const Matrix& z = logits();
  Matrix& delta = deltas_[num_layers_ - 1];
  delta.resize(batch, sizes_[num_layers_]);
  delta = (z.colwise() - row_max_).array().exp();
  delta.array().colwise() /= row_sum_exp_.array();
  double loss_sum = 0;  // in double even for float, so the mean does not drift with the batch size
  for (int64_t i = 0; i < batch; ++i) {
    loss_sum += static_cast<double>(std::log(row_sum_exp_(i)) - (z(i, labels[i]) - row_max_(i)));
    delta(i, labels[i]) -= T(1);
  }
  delta *= T(1) / static_cast<T>(batch);

  for (int l = num_layers_ - 1; l >= 0; --l) {
    Eigen::Map<Matrix> dw(grads[2 * l].data(), sizes_[l], sizes_[l + 1]);
    Eigen::Map<RowVector> db(grads[2 * l + 1].data(), sizes_[l + 1]);
    dw.noalias() = LayerInput(l, x, batch).transpose() * deltas_[l];
    db = deltas_[l].colwise().sum();
    if (l > 0) {
      // Through the weights, then through the ReLU of layer l - 1 (zero where it was inactive).
      const ConstMatrixMap w(params[2 * l].data(), sizes_[l], sizes_[l + 1]);
      Matrix& below = deltas_[l - 1];
      below.resize(batch, sizes_[l]);
      below.noalias() = deltas_[l] * w.transpose();
      below = (acts_[l - 1].array() > T(0)).select(below, T(0));
    }
  }
  return static_cast<T>(loss_sum / static_cast<double>(batch));
}

template <typename T>
void MlpMath<T>::AccumulateLossAndCorrect(absl::Span<const absl::Span<const T>> params, const T* x,
                                          const int32_t* labels, int64_t batch, double* loss_sum,
                                          int64_t* correct) {
  Forward(params, x, batch);
  SoftmaxStatistics();
  const Matrix& z = logits();
  for (int64_t i = 0; i < batch; ++i) {
    *loss_sum += static_cast<double>(std::log(row_sum_exp_(i)) - (z(i, labels[i]) - row_max_(i)));
    Eigen::Index predicted = 0;
    z.row(i).maxCoeff(&predicted);
    if (predicted == labels[i]) ++*correct;
  }
}

}  // namespace rubato

#endif  // RUBATO_WORKER_MLP_MATH_H_
