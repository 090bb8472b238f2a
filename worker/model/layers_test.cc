// Tests for the layers in double precision: every layer's parameter and input gradients, the
// softmax cross-entropy's and a whole small CNN's against central finite differences; the order of
// the gradient callbacks. (Timing is model_benchmark's.)
#include "worker/model/layers.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "worker/model/mlp.h"
#include "worker/model/model_spec.h"

namespace rubato {
namespace {

using Tensors = std::vector<std::vector<double>>;
using Matrix = RowMajorMatrix<double>;

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& t) {
  return std::vector<absl::Span<const T>>(t.begin(), t.end());
}

template <typename T>
std::vector<absl::Span<T>> MutableSpans(std::vector<std::vector<T>>& t) {
  return std::vector<absl::Span<T>>(t.begin(), t.end());
}

Tensors ZerosLike(const std::vector<ParamSpec>& specs) {
  Tensors t;
  for (const ParamSpec& p : specs) t.emplace_back(p.elements(), 0.0);
  return t;
}

// Every parameter, biases included, uniform in +-0.8: no exact zeros, few dead ReLUs.
Tensors RandomParams(const std::vector<ParamSpec>& specs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-0.8, 0.8);
  Tensors t = ZerosLike(specs);
  for (auto& tensor : t) {
    for (double& v : tensor) v = uniform(rng);
  }
  return t;
}

// n distinct values, 0.05 apart and none within 0.025 of zero, in random order: a step of 1e-5
// cannot move an input across a ReLU's kink or change a pooling window's maximum.
std::vector<double> SeparatedInputs(int64_t n, uint64_t seed) {
  std::vector<double> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = 0.05 * (static_cast<double>(i - n / 2) + 0.5);
  std::shuffle(x.begin(), x.end(), std::mt19937_64(seed));
  return x;
}

// Compares analytic gradients with central differences of `loss` with respect to every element of
// every tensor in `wrt`, and returns the worst relative error.
//
// The bound: with step h = 1e-5, the truncation error of a central difference is h^2 f'''/6, about
// 1e-11 for these smooth (piecewise-polynomial or softmax) losses of order-one curvature, and the
// rounding error is about eps |f| / h = 1e-16 * 10 / 1e-5 = 1e-10. Relative to gradients of at
// least 1e-3 (the floor below, so that gradients that are zero up to rounding compare absolutely)
// both stay below 1e-7, so 1e-6 leaves a margin of ten while any wrong index or missing term
// (errors of order one) fails.
double CheckGradients(const std::function<double()>& loss,
                      const std::vector<std::pair<std::string, std::vector<double>*>>& wrt,
                      const std::vector<const std::vector<double>*>& analytic) {
  constexpr double kStep = 1e-5;
  constexpr double kBound = 1e-6;
  double worst = 0;
  for (size_t t = 0; t < wrt.size(); ++t) {
    std::vector<double>& values = *wrt[t].second;
    const std::vector<double>& grad = *analytic[t];
    EXPECT_EQ(values.size(), grad.size()) << wrt[t].first;
    for (size_t k = 0; k < values.size(); ++k) {
      const double saved = values[k];
      values[k] = saved + kStep;
      const double up = loss();
      values[k] = saved - kStep;
      const double down = loss();
      values[k] = saved;
      const double numeric = (up - down) / (2 * kStep);
      const double error =
          std::abs(grad[k] - numeric) / std::max({std::abs(grad[k]), std::abs(numeric), 1e-3});
      worst = std::max(worst, error);
      EXPECT_LT(error, kBound) << wrt[t].first << "[" << k << "]: analytic " << grad[k]
                               << ", numeric " << numeric;
    }
  }
  return worst;
}

void Report(const std::string& what, double worst) {
  std::printf("%-40s worst relative error %.3g\n", what.c_str(), worst);
  ::testing::Test::RecordProperty("worst_relative_error", std::to_string(worst));
}

struct LayerCase {
  std::string name;
  LayerSpec spec;
  ActivationShape in;
  int64_t batch;
};

std::string LayerCaseName(const ::testing::TestParamInfo<LayerCase>& info) {
  return info.param.name;
}

class LayerGradientTest : public ::testing::TestWithParam<LayerCase> {};

// The scalar sum(out * r) for a fixed random r has d/d(out) = r, which exercises every output
// element's backward path with a different weight.
TEST_P(LayerGradientTest, ParamAndInputGradientsMatchCentralDifferences) {
  const LayerCase& c = GetParam();
  ModelSpec one = {c.in, {c.spec}};
  const std::vector<ParamSpec> specs = ModelParamSpecs(one);
  const ActivationShape out_shape = LayerOutputShape(c.spec, c.in, 0).value();
  Tensors params = RandomParams(specs, 11);
  std::vector<double> x = SeparatedInputs(c.batch * c.in.size(), 12);
  Matrix r(c.batch, out_shape.size());
  {
    std::mt19937_64 rng(13);
    std::uniform_real_distribution<double> uniform(-1, 1);
    for (Eigen::Index i = 0; i < r.size(); ++i) r.data()[i] = uniform(rng);
  }

  auto layer = MakeLayer<double>(c.spec, c.in);
  ASSERT_EQ(static_cast<size_t>(layer->num_params()), specs.size());
  Matrix out;
  auto loss = [&] {
    const Eigen::Map<const Matrix> in(x.data(), c.batch, c.in.size());
    layer->Forward(ConstSpans(params), in, &out);
    return out.cwiseProduct(r).sum();
  };
  loss();
  EXPECT_EQ(out.rows(), c.batch);
  EXPECT_EQ(out.cols(), out_shape.size());

  Tensors grads = ZerosLike(specs);
  Matrix din;
  const Eigen::Map<const Matrix> in(x.data(), c.batch, c.in.size());
  layer->Backward(ConstSpans(params), in, out, r, MutableSpans(grads), &din);
  const std::vector<double> dx(din.data(), din.data() + din.size());

  std::vector<std::pair<std::string, std::vector<double>*>> wrt = {{"input", &x}};
  std::vector<const std::vector<double>*> analytic = {&dx};
  for (size_t t = 0; t < specs.size(); ++t) {
    wrt.push_back({specs[t].name, &params[t]});
    analytic.push_back(&grads[t]);
  }
  Report(c.name, CheckGradients(loss, wrt, analytic));
}

LayerSpec Conv(int64_t kh, int64_t kw, int64_t cin, int64_t cout, Padding padding) {
  return LayerSpec::Conv2D("conv/kernel", "conv/bias", kh, kw, cin, cout, padding,
                           WeightInit::kHeUniform);
}

INSTANTIATE_TEST_SUITE_P(
    EveryKind, LayerGradientTest,
    ::testing::Values(LayerCase{"Dense",
                                LayerSpec::Dense("d/kernel", "d/bias", 6, 4,
                                                 WeightInit::kHeUniform),
                                {1, 1, 6},
                                3},
                      LayerCase{"Conv2DSame3x3", Conv(3, 3, 2, 3, Padding::kSame), {5, 6, 2}, 2},
                      // Even kernel sizes pad more after than before.
                      LayerCase{"Conv2DSame2x4", Conv(2, 4, 3, 2, Padding::kSame), {4, 5, 3}, 2},
                      LayerCase{"Conv2DValid3x2", Conv(3, 2, 2, 3, Padding::kValid), {5, 4, 2}, 2},
                      LayerCase{"Conv2DValid1x1", Conv(1, 1, 3, 2, Padding::kValid), {3, 2, 3}, 2},
                      LayerCase{"ReLU", LayerSpec::ReLU(), {3, 4, 2}, 2},
                      // 5x7 input: the last row and column fall outside every window.
                      LayerCase{"MaxPool2D", LayerSpec::MaxPool2D(), {5, 7, 3}, 2},
                      LayerCase{"Flatten", LayerSpec::Flatten(), {3, 2, 4}, 2}),
    LayerCaseName);

// A direct convolution, independent of im2col, for one known case.
TEST(Conv2DTest, SamePaddingMatchesDirectConvolution) {
  const ActivationShape in = {4, 5, 2};
  const LayerSpec spec = Conv(3, 2, 2, 3, Padding::kSame);  // pads 1 above/below, 0 left, 1 right
  ModelSpec one = {in, {spec}};
  const Tensors params = RandomParams(ModelParamSpecs(one), 3);
  const std::vector<double> x = SeparatedInputs(in.size(), 4);
  auto layer = MakeLayer<double>(spec, in);
  Matrix out;
  layer->Forward(ConstSpans(params), Eigen::Map<const Matrix>(x.data(), 1, in.size()), &out);
  for (int64_t oh = 0; oh < 4; ++oh) {
    for (int64_t ow = 0; ow < 5; ++ow) {
      for (int64_t co = 0; co < 3; ++co) {
        double want = params[1][co];
        for (int64_t i = 0; i < 3; ++i) {
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t ih = oh + i - 1, iw = ow + j;
            if (ih < 0 || ih >= 4 || iw >= 5) continue;
            for (int64_t ci = 0; ci < 2; ++ci) {
              want += x[(ih * 5 + iw) * 2 + ci] * params[0][((i * 2 + j) * 2 + ci) * 3 + co];
            }
          }
        }
        EXPECT_NEAR(out(0, (oh * 5 + ow) * 3 + co), want, 1e-14) << oh << "," << ow << "," << co;
      }
    }
  }
}

TEST(MaxPool2DTest, PicksTheWindowMaximumPerChannelAndRoutesTheGradient) {
  // One 2x2x2 example: channel 0 holds 1 4 / 3 2, channel 1 holds 8 5 / 6 7 (NHWC interleaved).
  const std::vector<double> x = {1, 8, 4, 5, 3, 6, 2, 7};
  auto layer = MakeLayer<double>(LayerSpec::MaxPool2D(), {2, 2, 2});
  Matrix out;
  const Eigen::Map<const Matrix> in(x.data(), 1, 8);
  layer->Forward({}, in, &out);
  ASSERT_EQ(out.cols(), 2);
  EXPECT_EQ(out(0, 0), 4);
  EXPECT_EQ(out(0, 1), 8);
  Matrix dout(1, 2);
  dout << 10, 20;
  Matrix din;
  layer->Backward({}, in, out, dout, {}, &din);
  Matrix want(1, 8);
  want << 0, 20, 10, 0, 0, 0, 0, 0;
  EXPECT_EQ(din, want);
}

TEST(SoftmaxCrossEntropyTest, GradientMatchesCentralDifferences) {
  const int64_t batch = 5, classes = 4;
  std::vector<double> z(batch * classes);
  std::mt19937_64 rng(21);
  std::normal_distribution<double> normal(0, 2);
  for (double& v : z) v = normal(rng);
  const std::vector<int32_t> labels = {0, 3, 1, 1, 2};
  SoftmaxCrossEntropy<double> ce;
  auto loss = [&] {
    Matrix dz;
    return ce.LossAndGradient(Eigen::Map<const Matrix>(z.data(), batch, classes), labels.data(),
                              &dz);
  };
  Matrix dz;
  const double mean =
      ce.LossAndGradient(Eigen::Map<const Matrix>(z.data(), batch, classes), labels.data(), &dz);
  double loss_sum = 0;
  int64_t correct = 0;
  ce.AccumulateLossAndCorrect(Eigen::Map<const Matrix>(z.data(), batch, classes), labels.data(),
                              &loss_sum, &correct);
  EXPECT_NEAR(mean, loss_sum / batch, 1e-15);
  const std::vector<double> dz_flat(dz.data(), dz.data() + dz.size());
  Report("SoftmaxCrossEntropy", CheckGradients(loss, {{"logits", &z}}, {&dz_flat}));
}

TEST(SoftmaxCrossEntropyTest, StableForHugeLogits) {
  Matrix z(2, 2);
  z << 1e4, -1e4, 1e4, -1e4;
  const std::vector<int32_t> labels = {0, 1};
  SoftmaxCrossEntropy<double> ce;
  Matrix dz;
  EXPECT_NEAR(ce.LossAndGradient(z, labels.data(), &dz), (0.0 + 2e4) / 2, 1e-9);
  EXPECT_TRUE(dz.allFinite());
  EXPECT_NEAR(dz(1, 1), -0.5, 1e-15);  // (softmax 0 - 1) / batch
}

// Two convolutions (same, then valid), pooling, two dense layers: every layer kind in one graph.
ModelSpec SmallCnn() {
  return {{6, 6, 2},
          {LayerSpec::Conv2D("conv1/kernel", "conv1/bias", 3, 3, 2, 3, Padding::kSame,
                             WeightInit::kHeUniform),
           LayerSpec::ReLU(), LayerSpec::MaxPool2D(),
           LayerSpec::Conv2D("conv2/kernel", "conv2/bias", 2, 2, 3, 4, Padding::kValid,
                             WeightInit::kHeUniform),
           LayerSpec::ReLU(), LayerSpec::Flatten(),
           LayerSpec::Dense("dense1/kernel", "dense1/bias", 16, 5, WeightInit::kHeUniform),
           LayerSpec::ReLU(),
           LayerSpec::Dense("dense2/kernel", "dense2/bias", 5, 3, WeightInit::kGlorotUniform)}};
}

// Residual connections: two blocks (the second's branch a single convolution), an Add whose skip
// starts before a ReLU, and two Adds from the same layer's neighbourhood, so that gradients meet
// from several paths.
ModelSpec SmallResNet() {
  auto conv = [](const std::string& name, int64_t cin, int64_t cout) {
    return LayerSpec::Conv2D(name + "/kernel", name + "/bias", 3, 3, cin, cout, Padding::kSame,
                             WeightInit::kHeUniform);
  };
  return {{6, 6, 2},
          {conv("c0", 2, 3), LayerSpec::ReLU(),                      // 0, 1: x
           conv("r1a", 3, 3), LayerSpec::ReLU(), conv("r1b", 3, 3),  // 2, 3, 4
           LayerSpec::Add(1), LayerSpec::ReLU(),                     // 5, 6
           conv("r2a", 3, 3), LayerSpec::Add(6), LayerSpec::Add(5),  // 7, 8, 9
           LayerSpec::MaxPool2D(), LayerSpec::Flatten(),             // 10, 11
           LayerSpec::Dense("d/kernel", "d/bias", 27, 4, WeightInit::kGlorotUniform)}};
}

// Every parameter's gradient of `spec` against central differences of the mean loss, in double.
void ExpectModelGradientsMatchCentralDifferences(const std::string& name, const ModelSpec& spec) {
  ASSERT_TRUE(ValidateModelSpec(spec).ok()) << ValidateModelSpec(spec);
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const int64_t batch = 3;
  Tensors params = RandomParams(specs, 31);
  std::vector<double> x(batch * spec.input.size());
  {
    std::mt19937_64 rng(32);
    std::normal_distribution<double> normal;
    for (double& v : x) v = normal(rng);
  }
  const std::vector<int32_t> labels = {2, 0, 1};
  SequentialModel<double> model(spec);
  Tensors grads = ZerosLike(specs);
  const double loss = model.ForwardBackward(ConstSpans(params), x.data(), labels.data(), batch,
                                            MutableSpans(grads));
  auto mean_loss = [&] {
    double sum = 0;
    int64_t correct = 0;
    model.AccumulateLossAndCorrect(ConstSpans(params), x.data(), labels.data(), batch, &sum,
                                   &correct);
    return sum / batch;
  };
  EXPECT_NEAR(loss, mean_loss(), 1e-14);
  std::vector<std::pair<std::string, std::vector<double>*>> wrt;
  std::vector<const std::vector<double>*> analytic;
  for (size_t t = 0; t < specs.size(); ++t) {
    wrt.push_back({specs[t].name, &params[t]});
    analytic.push_back(&grads[t]);
  }
  Report(name + " (all parameters)", CheckGradients(mean_loss, wrt, analytic));
}

TEST(SequentialModelTest, SmallCnnGradientsMatchCentralDifferences) {
  ExpectModelGradientsMatchCentralDifferences("SmallCnn", SmallCnn());
}

TEST(SequentialModelTest, ResidualGradientsMatchCentralDifferences) {
  ExpectModelGradientsMatchCentralDifferences("SmallResNet", SmallResNet());
}

TEST(SequentialModelTest, GradientCallbacksComeLastLayerFirstWithFinalValues) {
  const ModelSpec spec = SmallCnn();
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const Tensors params = RandomParams(specs, 41);
  const std::vector<double> x = SeparatedInputs(2 * spec.input.size(), 42);
  const std::vector<int32_t> labels = {1, 2};
  SequentialModel<double> model(spec);
  Tensors grads = ZerosLike(specs);
  std::vector<std::pair<size_t, size_t>> calls;
  Tensors seen(specs.size());
  model.ForwardBackward(ConstSpans(params), x.data(), labels.data(), 2, MutableSpans(grads),
                        [&](size_t first, size_t count) {
                          calls.push_back({first, count});
                          for (size_t t = first; t < first + count; ++t) seen[t] = grads[t];
                        });
  const std::vector<std::pair<size_t, size_t>> want = {{6, 2}, {4, 2}, {2, 2}, {0, 2}};
  EXPECT_EQ(calls, want);
  EXPECT_EQ(seen, grads);
}

TEST(SequentialModelTest, ScratchReuseAcrossBatchSizes) {
  const ModelSpec spec = SmallCnn();
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const Tensors params = RandomParams(specs, 51);
  const std::vector<double> x = SeparatedInputs(5 * spec.input.size(), 52);
  const std::vector<int32_t> labels = {0, 1, 2, 0, 1};
  auto run = [&](SequentialModel<double>& model, int64_t batch) {
    Tensors grads = ZerosLike(specs);
    model.ForwardBackward(ConstSpans(params), x.data(), labels.data(), batch, MutableSpans(grads));
    return grads;
  };
  // Equal up to rounding: Eigen's vector kernels take a buffer's unaligned head apart, so a
  // reused scratch buffer of another alignment may round differently (it does in the AVX2 build,
  // where vectors are 32 bytes); a scratch buffer left stale would be off by far more.
  auto expect_close = [](const Tensors& got, const Tensors& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t].size(), want[t].size());
      for (size_t k = 0; k < got[t].size(); ++k) {
        EXPECT_NEAR(got[t][k], want[t][k], 1e-12 * (1 + std::abs(want[t][k])))
            << t << "[" << k << "]";
      }
    }
  };
  SequentialModel<double> fresh5(spec), fresh2(spec), reused(spec);
  const Tensors want5 = run(fresh5, 5);
  const Tensors want2 = run(fresh2, 2);
  expect_close(run(reused, 5), want5);
  expect_close(run(reused, 2), want2);
  expect_close(run(reused, 5), want5);
}

}  // namespace
}  // namespace rubato
