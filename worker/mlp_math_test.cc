// Tests for MlpMath in double precision: gradients against central finite differences, and the
// loss of known networks.
#include "worker/mlp_math.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/mlp.h"

namespace rubato {
namespace {

using Tensors = std::vector<std::vector<double>>;

std::vector<absl::Span<const double>> ConstSpans(const Tensors& t) {
  return std::vector<absl::Span<const double>>(t.begin(), t.end());
}

std::vector<absl::Span<double>> MutableSpans(Tensors& t) {
  return std::vector<absl::Span<double>>(t.begin(), t.end());
}

Tensors ZerosLike(const MlpSpec& spec) {
  Tensors t;
  for (const ParamSpec& p : MlpParamSpecs(spec)) t.emplace_back(p.elements(), 0.0);
  return t;
}

// Every parameter, biases included, uniform in +-0.8: no exact zeros, few dead ReLUs.
Tensors RandomParams(const MlpSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-0.8, 0.8);
  Tensors t = ZerosLike(spec);
  for (auto& tensor : t) {
    for (double& v : tensor) v = uniform(rng);
  }
  return t;
}

std::vector<double> RandomInputs(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> x(n);
  for (double& v : x) v = normal(rng);
  return x;
}

double MeanLoss(MlpMath<double>& math, const Tensors& params, const std::vector<double>& x,
                const std::vector<int32_t>& labels) {
  double loss_sum = 0;
  int64_t correct = 0;
  const int64_t batch = static_cast<int64_t>(labels.size());
  math.AccumulateLossAndCorrect(ConstSpans(params), x.data(), labels.data(), batch, &loss_sum,
                                &correct);
  return loss_sum / batch;
}

struct GradCheckCase {
  MlpSpec spec;
  int64_t batch;
};

std::string CaseName(const ::testing::TestParamInfo<GradCheckCase>& info) {
  std::string name = std::to_string(info.param.spec.input_dim);
  for (int64_t h : info.param.spec.hidden) name += "_" + std::to_string(h);
  return name + "_" + std::to_string(info.param.spec.num_classes) + "_batch" +
         std::to_string(info.param.batch);
}

class GradientCheckTest : public ::testing::TestWithParam<GradCheckCase> {};

TEST_P(GradientCheckTest, MatchesCentralDifferencesForEveryElement) {
  const MlpSpec& spec = GetParam().spec;
  const int64_t batch = GetParam().batch;
  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  Tensors params = RandomParams(spec, 17);
  const std::vector<double> x = RandomInputs(batch * spec.input_dim, 18);
  std::vector<int32_t> labels(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = static_cast<int32_t>(i % spec.num_classes);

  MlpMath<double> math(spec);
  Tensors grads = ZerosLike(spec);
  const double loss =
      math.ForwardBackward(ConstSpans(params), x.data(), labels.data(), batch, MutableSpans(grads));
  EXPECT_NEAR(loss, MeanLoss(math, params, x, labels), 1e-14);

  // Central differences: truncation error ~h^2, rounding ~1e-16/h; both far below 1e-6 here.
  constexpr double kStep = 1e-5;
  double worst = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    for (size_t k = 0; k < params[t].size(); ++k) {
      const double saved = params[t][k];
      params[t][k] = saved + kStep;
      const double up = MeanLoss(math, params, x, labels);
      params[t][k] = saved - kStep;
      const double down = MeanLoss(math, params, x, labels);
      params[t][k] = saved;
      const double numeric = (up - down) / (2 * kStep);
      const double analytic = grads[t][k];
      // Relative error, with a floor so that gradients that are zero (up to rounding) compare
      // absolutely.
      const double error =
          std::abs(analytic - numeric) / std::max({std::abs(analytic), std::abs(numeric), 1e-3});
      worst = std::max(worst, error);
      EXPECT_LT(error, 1e-6) << specs[t].name << "[" << k << "]: analytic " << analytic
                             << ", numeric " << numeric;
    }
  }
  std::ostringstream worst_text;
  worst_text << worst;
  RecordProperty("worst_relative_error", worst_text.str());
}

INSTANTIATE_TEST_SUITE_P(SmallNets, GradientCheckTest,
                         ::testing::Values(GradCheckCase{{5, {4, 3}, 3}, 4},  // two hidden layers
                                           GradCheckCase{{6, {}, 4}, 3},      // logistic regression
                                           GradCheckCase{{3, {7}, 2}, 1},     // single example
                                           GradCheckCase{{4, {5, 6, 3}, 5}, 9}),
                         CaseName);

TEST(MlpMathTest, ZeroWeightsGiveLogOfClassCount) {
  const MlpSpec spec{5, {4, 3}, 7};
  Tensors params = ZerosLike(spec);
  const std::vector<double> x = RandomInputs(4 * 5, 3);
  const std::vector<int32_t> labels = {0, 6, 3, 3};
  MlpMath<double> math(spec);
  Tensors grads = ZerosLike(spec);
  const double loss =
      math.ForwardBackward(ConstSpans(params), x.data(), labels.data(), 4, MutableSpans(grads));
  EXPECT_NEAR(loss, std::log(7.0), 1e-15);
  // Only the output bias sees a gradient: mean of (1/7 - onehot).
  const std::vector<double>& output_bias_grad = grads.back();
  EXPECT_NEAR(output_bias_grad[0], 1.0 / 7 - 1.0 / 4, 1e-15);
  EXPECT_NEAR(output_bias_grad[3], 1.0 / 7 - 2.0 / 4, 1e-15);
  EXPECT_NEAR(output_bias_grad[1], 1.0 / 7, 1e-15);
}

TEST(MlpMathTest, StableForHugeLogits) {
  // Logits of +-1e4: a naive exp overflows; subtracting the row max keeps the loss exact.
  const MlpSpec spec{1, {}, 2};
  const Tensors params = {{1e4, -1e4}, {0, 0}};
  const std::vector<double> x = {1.0, 1.0};
  const std::vector<int32_t> labels = {0, 1};
  MlpMath<double> math(spec);
  Tensors grads = ZerosLike(spec);
  const double loss =
      math.ForwardBackward(ConstSpans(params), x.data(), labels.data(), 2, MutableSpans(grads));
  EXPECT_NEAR(loss, (0.0 + 2e4) / 2, 1e-9);
  EXPECT_TRUE(std::isfinite(grads[0][0]));
}

TEST(MlpMathTest, ScratchReuseAcrossBatchSizes) {
  const MlpSpec spec{5, {4, 3}, 3};
  const Tensors params = RandomParams(spec, 5);
  const std::vector<double> x = RandomInputs(7 * 5, 6);
  const std::vector<int32_t> labels = {0, 1, 2, 0, 1, 2, 0};
  auto run = [&](MlpMath<double>& math, int64_t batch) {
    Tensors grads = ZerosLike(spec);
    math.ForwardBackward(ConstSpans(params), x.data(), labels.data(), batch, MutableSpans(grads));
    return grads;
  };
  MlpMath<double> fresh7(spec), fresh3(spec), reused(spec);
  const Tensors want7 = run(fresh7, 7);
  const Tensors want3 = run(fresh3, 3);
  EXPECT_EQ(run(reused, 7), want7);
  EXPECT_EQ(run(reused, 3), want3);
  EXPECT_EQ(run(reused, 7), want7);
}

}  // namespace
}  // namespace rubato
