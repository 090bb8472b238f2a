// The layers' forward and backward passes, the loss, and the sequential model.
#include "worker/model/layers.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

namespace rubato {
namespace {

template <typename T>
using Matrix = RowMajorMatrix<T>;
template <typename T>
using ConstMatrixMap = Eigen::Map<const Matrix<T>>;
template <typename T>
using MatrixMap = Eigen::Map<Matrix<T>>;
template <typename T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;

// out = in x weight + bias; weight (in, out), bias (out).
template <typename T>
class DenseLayer : public Layer<T> {
 public:
  explicit DenseLayer(const LayerSpec& spec) : in_(spec.in), out_(spec.out) {}

  int num_params() const override { return 2; }

  void Forward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap<T>& in,
               Matrix<T>* out) override {
    const ConstMatrixMap<T> w(params[0].data(), in_, out_);
    const Eigen::Map<const RowVector<T>> b(params[1].data(), out_);
    out->resize(in.rows(), out_);
    out->noalias() = in * w;
    out->rowwise() += b;
  }

  void Backward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap<T>& in,
                const Matrix<T>& /*out*/, const Matrix<T>& dout,
                absl::Span<const absl::Span<T>> grads, Matrix<T>* din) override {
    MatrixMap<T> dw(grads[0].data(), in_, out_);
    Eigen::Map<RowVector<T>> db(grads[1].data(), out_);
    dw.noalias() = in.transpose() * dout;
    db = dout.colwise().sum();
    if (din != nullptr) {
      const ConstMatrixMap<T> w(params[0].data(), in_, out_);
      din->resize(dout.rows(), in_);
      din->noalias() = dout * w.transpose();
    }
  }

 private:
  const int64_t in_;
  const int64_t out_;
};

// Stride-1 convolution as im2col + one GEMM. Kernel HWIO (kh, kw, cin, cout), bias (cout).
template <typename T>
class Conv2DLayer : public Layer<T> {
 public:
  Conv2DLayer(const LayerSpec& spec, const ActivationShape& in)
      : in_(in),
        kh_(spec.kernel_h),
        kw_(spec.kernel_w),
        cout_(spec.out_channels),
        pad_top_(spec.padding == Padding::kSame ? (spec.kernel_h - 1) / 2 : 0),
        pad_left_(spec.padding == Padding::kSame ? (spec.kernel_w - 1) / 2 : 0),
        out_h_(spec.padding == Padding::kSame ? in.h : in.h - spec.kernel_h + 1),
        out_w_(spec.padding == Padding::kSame ? in.w : in.w - spec.kernel_w + 1),
        patch_(spec.kernel_h * spec.kernel_w * in.c) {}

  int num_params() const override { return 2; }

  void Forward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap<T>& in,
               Matrix<T>* out) override {
    const int64_t batch = in.rows();
    const int64_t pixels = batch * out_h_ * out_w_;
    Im2Col(in.data(), batch);
    const ConstMatrixMap<T> kernel(params[0].data(), patch_, cout_);
    const Eigen::Map<const RowVector<T>> b(params[1].data(), cout_);
    out->resize(batch, out_h_ * out_w_ * cout_);
    MatrixMap<T> out2d(out->data(), pixels, cout_);  // one row per output pixel
    out2d.noalias() = cols_ * kernel;
    out2d.rowwise() += b;
  }

  void Backward(absl::Span<const absl::Span<const T>> params, const ConstMatrixMap<T>& in,
                const Matrix<T>& /*out*/, const Matrix<T>& dout,
                absl::Span<const absl::Span<T>> grads, Matrix<T>* din) override {
    const int64_t batch = in.rows();
    const ConstMatrixMap<T> dout2d(dout.data(), batch * out_h_ * out_w_, cout_);
    MatrixMap<T> dkernel(grads[0].data(), patch_, cout_);
    Eigen::Map<RowVector<T>> db(grads[1].data(), cout_);
    dkernel.noalias() = cols_.transpose() * dout2d;
    db = dout2d.colwise().sum();
    if (din != nullptr) {
      const ConstMatrixMap<T> kernel(params[0].data(), patch_, cout_);
      dcols_.resize(cols_.rows(), patch_);
      dcols_.noalias() = dout2d * kernel.transpose();
      din->resize(batch, in_.size());
      din->setZero();
      Col2ImAdd(batch, din->data());
    }
  }

 private:
  // Calls f(offset into cols_, offset into the input or -1 where the kernel overhangs the padding)
  // for each run of cin values: every output pixel (the rows of cols_), every (i, j) of the kernel.
  template <typename F>
  void ForEachRun(int64_t batch, F f) const {
    const int64_t c = in_.c;
    int64_t col = 0;  // offset into the (pixels, patch_) matrix
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t example = n * in_.size();
      for (int64_t oh = 0; oh < out_h_; ++oh) {
        for (int64_t ow = 0; ow < out_w_; ++ow) {
          for (int64_t i = 0; i < kh_; ++i) {
            const int64_t ih = oh + i - pad_top_;
            const bool row_inside = ih >= 0 && ih < in_.h;
            for (int64_t j = 0; j < kw_; ++j, col += c) {
              const int64_t iw = ow + j - pad_left_;
              const bool inside = row_inside && iw >= 0 && iw < in_.w;
              f(col, inside ? example + (ih * in_.w + iw) * c : int64_t{-1});
            }
          }
        }
      }
    }
  }

  // cols_ (batch*out_h*out_w, kh*kw*cin): row (n, oh, ow) holds the input patch under the kernel
  // at that output pixel, zero where it overhangs the padding.
  void Im2Col(const T* x, int64_t batch) {
    cols_.resize(batch * out_h_ * out_w_, patch_);
    T* cols = cols_.data();
    const int64_t c = in_.c;
    ForEachRun(batch, [&](int64_t col, int64_t src) {
      if (src < 0) {
        std::fill(cols + col, cols + col + c, T(0));
      } else {
        std::copy(x + src, x + src + c, cols + col);
      }
    });
  }

  // The adjoint of Im2Col: adds each row of dcols_ back onto the input pixels it was copied from.
  void Col2ImAdd(int64_t batch, T* dx) const {
    const T* dcols = dcols_.data();
    const int64_t c = in_.c;
    ForEachRun(batch, [&](int64_t col, int64_t dst) {
      if (dst < 0) return;
      for (int64_t k = 0; k < c; ++k) dx[dst + k] += dcols[col + k];
    });
  }

  // Constant after construction.
  const ActivationShape in_;
  const int64_t kh_, kw_, cout_;
  const int64_t pad_top_, pad_left_;
  const int64_t out_h_, out_w_;
  const int64_t patch_;  // kh * kw * cin

  Matrix<T> cols_;   // from Forward, for the kernel gradient
  Matrix<T> dcols_;  // Backward's scratch, same shape as cols_
};

template <typename T>
class ReLULayer : public Layer<T> {
 public:
  int num_params() const override { return 0; }

  void Forward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& in,
               Matrix<T>* out) override {
    *out = in.cwiseMax(T(0));
  }

  // Zero where the output was zero (the input was <= 0).
  void Backward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& /*in*/,
                const Matrix<T>& out, const Matrix<T>& dout, absl::Span<const absl::Span<T>>,
                Matrix<T>* din) override {
    if (din == nullptr) return;
    din->resize(dout.rows(), dout.cols());
    *din = (out.array() > T(0)).select(dout, T(0));
  }
};

// 2x2 max pooling with stride 2; remembers which input won each window.
template <typename T>
class MaxPool2DLayer : public Layer<T> {
 public:
  explicit MaxPool2DLayer(const ActivationShape& in)
      : in_(in), out_h_(in.h / 2), out_w_(in.w / 2) {}

  int num_params() const override { return 0; }

  void Forward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& in,
               Matrix<T>* out) override {
    const int64_t batch = in.rows();
    const int64_t c = in_.c;
    out->resize(batch, out_h_ * out_w_ * c);
    argmax_.resize(static_cast<size_t>(out->size()));
    for (int64_t n = 0; n < batch; ++n) {
      const T* x = in.data() + n * in_.size();
      T* y = out->data() + n * out->cols();
      int32_t* arg = argmax_.data() + n * out->cols();
      for (int64_t oh = 0; oh < out_h_; ++oh) {
        for (int64_t ow = 0; ow < out_w_; ++ow) {
          const int64_t corner = ((2 * oh) * in_.w + 2 * ow) * c;
          const int64_t offsets[4] = {corner, corner + c, corner + in_.w * c,
                                      corner + (in_.w + 1) * c};
          const int64_t o = (oh * out_w_ + ow) * c;
          for (int64_t k = 0; k < c; ++k) {
            int64_t best = offsets[0] + k;
            for (int q = 1; q < 4; ++q) {
              if (x[offsets[q] + k] > x[best]) best = offsets[q] + k;  // first maximum wins ties
            }
            y[o + k] = x[best];
            arg[o + k] = static_cast<int32_t>(best);
          }
        }
      }
    }
  }

  void Backward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& /*in*/,
                const Matrix<T>& /*out*/, const Matrix<T>& dout, absl::Span<const absl::Span<T>>,
                Matrix<T>* din) override {
    if (din == nullptr) return;
    din->resize(dout.rows(), in_.size());
    din->setZero();
    for (int64_t n = 0; n < dout.rows(); ++n) {
      const T* dy = dout.data() + n * dout.cols();
      T* dx = din->data() + n * in_.size();
      const int32_t* arg = argmax_.data() + n * dout.cols();
      for (int64_t o = 0; o < dout.cols(); ++o) dx[arg[o]] += dy[o];
    }
  }

 private:
  // Constant after construction.
  const ActivationShape in_;
  const int64_t out_h_, out_w_;

  std::vector<int32_t> argmax_;  // (batch, out size): offset of the winner within its example
};

// NHWC rows are already flat: a copy each way. Also an Add's own part (SequentialModel adds the
// skipped layer's output after it, and routes the gradient back to that layer).
template <typename T>
class FlattenLayer : public Layer<T> {
 public:
  int num_params() const override { return 0; }

  void Forward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& in,
               Matrix<T>* out) override {
    *out = in;
  }

  void Backward(absl::Span<const absl::Span<const T>>, const ConstMatrixMap<T>& /*in*/,
                const Matrix<T>& /*out*/, const Matrix<T>& dout, absl::Span<const absl::Span<T>>,
                Matrix<T>* din) override {
    if (din != nullptr) *din = dout;
  }
};

}  // namespace

template <typename T>
std::unique_ptr<Layer<T>> MakeLayer(const LayerSpec& spec, const ActivationShape& in) {
  switch (spec.kind) {
    case LayerKind::kDense:
      return std::make_unique<DenseLayer<T>>(spec);
    case LayerKind::kConv2D:
      return std::make_unique<Conv2DLayer<T>>(spec, in);
    case LayerKind::kReLU:
      return std::make_unique<ReLULayer<T>>();
    case LayerKind::kMaxPool2D:
      return std::make_unique<MaxPool2DLayer<T>>(in);
    case LayerKind::kFlatten:
    case LayerKind::kAdd:
      return std::make_unique<FlattenLayer<T>>();
  }
  return nullptr;
}

// ---- SoftmaxCrossEntropy ----

template <typename T>
void SoftmaxCrossEntropy<T>::Statistics(const Matrix& z) {
  row_max_.resize(z.rows());
  row_max_ = z.rowwise().maxCoeff();
  row_sum_exp_.resize(z.rows());
  row_sum_exp_ = (z.colwise() - row_max_).array().exp().rowwise().sum().matrix();
}

template <typename T>
T SoftmaxCrossEntropy<T>::LossAndGradient(const Matrix& z, const int32_t* labels, Matrix* dlogits) {
  // loss_i = log(sum exp(z_i - m_i)) - (z_iy - m_i); d(mean loss)/dz_i = (softmax(z_i) -
  // onehot(y_i)) / batch; "mlp:" models give bit for bit what the fixed MLP always gave.
  Statistics(z);
  const int64_t batch = z.rows();
  Matrix& delta = *dlogits;
  delta.resize(batch, z.cols());
  delta = (z.colwise() - row_max_).array().exp();
  delta.array().colwise() /= row_sum_exp_.array();
  double loss_sum = 0;  // in double even for float, so the mean does not drift with the batch size
  for (int64_t i = 0; i < batch; ++i) {
    loss_sum += static_cast<double>(std::log(row_sum_exp_(i)) - (z(i, labels[i]) - row_max_(i)));
    delta(i, labels[i]) -= T(1);
  }
  delta *= T(1) / static_cast<T>(batch);
  return static_cast<T>(loss_sum / static_cast<double>(batch));
}

template <typename T>
void SoftmaxCrossEntropy<T>::AccumulateLossAndCorrect(const Matrix& z, const int32_t* labels,
                                                      double* loss_sum, int64_t* correct) {
  Statistics(z);
  for (int64_t i = 0; i < z.rows(); ++i) {
    *loss_sum += static_cast<double>(std::log(row_sum_exp_(i)) - (z(i, labels[i]) - row_max_(i)));
    Eigen::Index predicted = 0;
    z.row(i).maxCoeff(&predicted);
    if (predicted == labels[i]) ++*correct;
  }
}

// ---- SequentialModel ----

namespace {
double MillisecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

template <typename T>
SequentialModel<T>::SequentialModel(const ModelSpec& spec) : input_size_(spec.input.size()) {
  const std::vector<ActivationShape> shapes = ActivationShapes(spec);
  size_t param = 0;
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    layers_.push_back(MakeLayer<T>(spec.layers[l], shapes[l]));
    skip_from_.push_back(spec.layers[l].kind == LayerKind::kAdd ? spec.layers[l].skip_from : -1);
    first_param_.push_back(param);
    param += static_cast<size_t>(layers_.back()->num_params());
  }
  acts_.resize(layers_.size());
  dacts_.resize(layers_.size());
  skip_grads_.resize(layers_.size());
  skip_pending_.assign(layers_.size(), false);
}

template <typename T>
typename SequentialModel<T>::ConstMatrixMap SequentialModel<T>::LayerInput(size_t l, const T* x,
                                                                           int64_t batch) const {
  if (l == 0) return ConstMatrixMap(x, batch, input_size_);
  return ConstMatrixMap(acts_[l - 1].data(), batch, acts_[l - 1].cols());
}

template <typename T>
bool SequentialModel<T>::Forward(absl::Span<const absl::Span<const T>> params, const T* x,
                                 int64_t batch, const WeightsNeeded& needed) {
  if (timing_) forward_ms_.assign(layers_.size(), 0.0);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const size_t count = static_cast<size_t>(layers_[l]->num_params());
    if (needed && count > 0 && !needed(first_param_[l], count)) return false;
    const auto t0 = std::chrono::steady_clock::now();
    layers_[l]->Forward(params.subspan(first_param_[l], layers_[l]->num_params()),
                        LayerInput(l, x, batch), &acts_[l]);
    if (skip_from_[l] >= 0) acts_[l] += acts_[skip_from_[l]];
    if (timing_) forward_ms_[l] = MillisecondsSince(t0);
  }
  return true;
}

template <typename T>
T SequentialModel<T>::ForwardBackward(absl::Span<const absl::Span<const T>> params, const T* x,
                                      const int32_t* labels, int64_t batch,
                                      absl::Span<const absl::Span<T>> grads,
                                      const GradientsReady& ready, const WeightsNeeded& needed) {
  if (!Forward(params, x, batch, needed)) return std::numeric_limits<T>::quiet_NaN();
  if (timing_) backward_ms_.assign(layers_.size(), 0.0);
  auto t0 = std::chrono::steady_clock::now();
  const T loss = loss_.LossAndGradient(logits(), labels, &dacts_.back());
  for (size_t l = layers_.size(); l-- > 0;) {
    const size_t first = first_param_[l];
    const size_t count = static_cast<size_t>(layers_[l]->num_params());
    // Each layer's input gradient has a buffer of its own, so none is reallocated between layers
    // of different sizes; the first layer's is never needed.
    layers_[l]->Backward(params.subspan(first, count), LayerInput(l, x, batch), acts_[l], dacts_[l],
                         grads.subspan(first, count), l > 0 ? &dacts_[l - 1] : nullptr);
    // An Add's output gradient also flows to the layer it skipped from, whose own output gradient
    // is complete once the layer after it has passed its input gradient back.
    if (const int64_t from = skip_from_[l]; from >= 0) {
      if (skip_pending_[from]) {
        skip_grads_[from] += dacts_[l];
      } else {
        skip_grads_[from] = dacts_[l];
        skip_pending_[from] = true;
      }
    }
    if (l > 0 && skip_pending_[l - 1]) {
      dacts_[l - 1] += skip_grads_[l - 1];
      skip_pending_[l - 1] = false;
    }
    if (timing_) {
      backward_ms_[l] = MillisecondsSince(t0);
    }
    if (count > 0 && ready) ready(first, count);
    if (timing_) t0 = std::chrono::steady_clock::now();
  }
  return loss;
}

template <typename T>
void SequentialModel<T>::AccumulateLossAndCorrect(absl::Span<const absl::Span<const T>> params,
                                                  const T* x, const int32_t* labels, int64_t batch,
                                                  double* loss_sum, int64_t* correct) {
  Forward(params, x, batch);
  loss_.AccumulateLossAndCorrect(logits(), labels, loss_sum, correct);
}

template std::unique_ptr<Layer<float>> MakeLayer<float>(const LayerSpec&, const ActivationShape&);
template std::unique_ptr<Layer<double>> MakeLayer<double>(const LayerSpec&, const ActivationShape&);
template class SoftmaxCrossEntropy<float>;
template class SoftmaxCrossEntropy<double>;
template class SequentialModel<float>;
template class SequentialModel<double>;

}  // namespace rubato
