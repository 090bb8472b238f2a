// Tests for MlpSpec parsing and validation, parameter layout and initialisation.
#include "worker/model/mlp.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(ParseMlpLayersTest, ParsesInputHiddenAndClasses) {
  absl::StatusOr<MlpSpec> spec = ParseMlpLayers("784-256-128-10");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->input_dim, 784);
  EXPECT_EQ(spec->hidden, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(spec->num_classes, 10);
}

TEST(ParseMlpLayersTest, NoHiddenLayersIsLogisticRegression) {
  absl::StatusOr<MlpSpec> spec = ParseMlpLayers("784-10");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->input_dim, 784);
  EXPECT_TRUE(spec->hidden.empty());
  EXPECT_EQ(spec->num_classes, 10);
}

TEST(ParseMlpLayersTest, RejectsBadStringsNamingTheToken) {
  struct Case {
    const char* text;
    const char* token;  // expected in the message
  };
  for (const Case& c :
       {Case{"", "\"\""}, Case{"784", "784"}, Case{"784-abc-10", "\"abc\""},
        Case{"784--10", "\"\""}, Case{"784-0-10", "\"0\""}, Case{"784-256-", "\"\""},
        Case{"784-2.5-10", "\"2.5\""}, Case{"784-256-x10", "\"x10\""},
        Case{"784-99999999999999999999-10", "\"99999999999999999999\""}}) {
    absl::StatusOr<MlpSpec> spec = ParseMlpLayers(c.text);
    ASSERT_FALSE(spec.ok()) << c.text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << spec.status();
    EXPECT_NE(spec.status().message().find(c.token), std::string::npos) << spec.status();
  }
}

TEST(MlpParamSpecsTest, NamesShapesAndOrder) {
  const MlpSpec spec{784, {256, 128}, 10};
  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  ASSERT_EQ(specs.size(), 6u);
  const std::vector<std::string> names = {"fc0.weight", "fc0.bias",   "fc1.weight",
                                          "fc1.bias",   "fc2.weight", "fc2.bias"};
  const std::vector<std::vector<int64_t>> shapes = {{784, 256}, {256},     {256, 128},
                                                    {128},      {128, 10}, {10}};
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(specs[i].name, names[i]);
    EXPECT_EQ(specs[i].shape, shapes[i]) << names[i];
  }
  EXPECT_EQ(specs[0].elements(), 784 * 256);
  EXPECT_EQ(specs[5].elements(), 10);
  int64_t total = 0;
  for (const ParamSpec& p : specs) total += p.elements();
  EXPECT_EQ(total, 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
}

TEST(InitMlpParamsTest, DeterministicPerSeed) {
  const MlpSpec spec{20, {16, 8}, 5};
  EXPECT_EQ(InitMlpParams(spec, 7), InitMlpParams(spec, 7));
  EXPECT_NE(InitMlpParams(spec, 7), InitMlpParams(spec, 8));
}

TEST(InitMlpParamsTest, PinnedValues) {
  // Initial values must not depend on the standard library: pin a few.
  const std::vector<std::vector<float>> params = InitMlpParams({3, {2}, 2}, 1);
  ASSERT_EQ(params.size(), 4u);
  EXPECT_EQ(params[0], (std::vector<float>{-0.165486529f, -0.485351622f, 0.691384494f,
                                           -0.306265414f, -0.695664108f, 0.809037387f}));
  EXPECT_EQ(params[1], (std::vector<float>{0, 0}));
  EXPECT_EQ(params[2],
            (std::vector<float>{0.378502011f, -0.054073073f, 0.524330854f, 0.408858031f}));
  EXPECT_EQ(params[3], (std::vector<float>{0, 0}));
}

TEST(InitMlpParamsTest, ShapesAndBounds) {
  const MlpSpec spec{784, {256}, 10};
  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  const std::vector<std::vector<float>> params = InitMlpParams(spec, 123);
  ASSERT_EQ(params.size(), specs.size());
  for (size_t t = 0; t < specs.size(); ++t) {
    ASSERT_EQ(static_cast<int64_t>(params[t].size()), specs[t].elements()) << specs[t].name;
  }
  // Hidden layer: He-uniform in +-sqrt(6/784); output layer: +-1/sqrt(256); biases zero.
  const double bounds[] = {std::sqrt(6.0 / 784), 1.0 / std::sqrt(256.0)};
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float>& w = params[2 * layer];
    double max_abs = 0, sum = 0, sum_sq = 0;
    for (float v : w) {
      max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
      sum += v;
      sum_sq += static_cast<double>(v) * v;
    }
    const double bound = bounds[layer];
    const double n = static_cast<double>(w.size());
    EXPECT_LE(max_abs, bound) << specs[2 * layer].name;
    EXPECT_GT(max_abs, 0.95 * bound) << specs[2 * layer].name;  // fills the range
    EXPECT_NEAR(sum / n, 0.0, 5 * bound / std::sqrt(3 * n)) << specs[2 * layer].name;
    // Variance of U(-b, b) is b^2 / 3.
    EXPECT_NEAR(sum_sq / n, bound * bound / 3, 0.1 * bound * bound / 3) << specs[2 * layer].name;
    for (float v : params[2 * layer + 1]) EXPECT_EQ(v, 0.0f);
  }
}

TEST(CheckTensorSpansTest, NamesTheTensor) {
  const std::vector<ParamSpec> specs = MlpParamSpecs({3, {2}, 2});
  std::vector<std::vector<float>> values = InitMlpParams({3, {2}, 2}, 1);
  std::vector<absl::Span<const float>> spans(values.begin(), values.end());
  EXPECT_TRUE(
      CheckTensorSpans(absl::MakeConstSpan(specs), absl::MakeConstSpan(spans), "params").ok());

  spans[3] = absl::MakeConstSpan(values[3]).subspan(1);
  absl::Status status =
      CheckTensorSpans(absl::MakeConstSpan(specs), absl::MakeConstSpan(spans), "params");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("fc1.bias"), std::string::npos) << status;

  spans.pop_back();
  status = CheckTensorSpans(absl::MakeConstSpan(specs), absl::MakeConstSpan(spans), "grads");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("grads"), std::string::npos) << status;
}

TEST(CheckLabelsTest, RejectsOutOfRange) {
  const int32_t good[] = {0, 4, 2};
  EXPECT_TRUE(CheckLabels(good, 3, 5).ok());
  const int32_t high[] = {0, 5};
  EXPECT_EQ(CheckLabels(high, 2, 5).code(), absl::StatusCode::kInvalidArgument);
  const int32_t negative[] = {-1};
  EXPECT_EQ(CheckLabels(negative, 1, 5).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
