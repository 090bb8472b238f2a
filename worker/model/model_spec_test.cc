// Tests for ModelSpec: --model parsing, validation, parameter layout and initialisation, and the
// "mlp:" spec's agreement with MlpSpec.
#include "worker/model/model_spec.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/mlp.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

void ExpectSameParamSpecs(const std::vector<ParamSpec>& got, const std::vector<ParamSpec>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].name, want[i].name) << i;
    EXPECT_EQ(got[i].shape, want[i].shape) << want[i].name;
  }
}

TEST(ParseModelSpecTest, MlpMatchesMlpSpecNamesShapesAndInit) {
  for (const char* layers : {"784-256-10", "784-10", "5-4-3-2"}) {
    SCOPED_TRACE(layers);
    const auto spec = ParseModelSpec(std::string("mlp:") + layers);
    ASSERT_TRUE(spec.ok()) << spec.status();
    ASSERT_TRUE(ValidateModelSpec(*spec).ok());
    const MlpSpec mlp = ParseMlpLayers(layers).value();
    ExpectSameParamSpecs(ModelParamSpecs(*spec), MlpParamSpecs(mlp));
    int64_t mlp_params = 0;
    for (const ParamSpec& p : MlpParamSpecs(mlp)) mlp_params += p.elements();
    EXPECT_EQ(ModelParamCount(*spec), mlp_params);
    EXPECT_EQ(ModelNumClasses(*spec), mlp.num_classes);
    EXPECT_EQ(spec->input.size(), mlp.input_dim);
    for (uint64_t seed : {0u, 1u, 12345u}) {
      EXPECT_EQ(InitModelParams(*spec, seed), InitMlpParams(mlp, seed)) << seed;
    }
  }
}

TEST(ParseModelSpecTest, CnnShapesNamesAndCount) {
  const auto spec = ParseModelSpec("cnn");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
  EXPECT_EQ(spec->input, (ActivationShape{28, 28, 1}));
  ExpectSameParamSpecs(ModelParamSpecs(*spec), {{"conv1/kernel", {5, 5, 1, 32}},
                                                {"conv1/bias", {32}},
                                                {"conv2/kernel", {5, 5, 32, 64}},
                                                {"conv2/bias", {64}},
                                                {"dense1/kernel", {3136, 128}},
                                                {"dense1/bias", {128}},
                                                {"dense2/kernel", {128, 10}},
                                                {"dense2/bias", {10}}});
  EXPECT_EQ(ModelParamCount(*spec), 832 + 51264 + 401536 + 1290);
  EXPECT_EQ(ModelNumClasses(*spec), 10);
  const std::vector<ActivationShape> shapes = ActivationShapes(*spec);
  EXPECT_EQ(shapes[3], (ActivationShape{14, 14, 32}));  // after the first pooling
  EXPECT_EQ(shapes[6], (ActivationShape{7, 7, 64}));    // after the second
  const std::string text = DescribeModel(*spec);
  EXPECT_THAT(text, HasSubstr("conv2d 5x5 32->64 same -> 14x14x64"));
  EXPECT_THAT(text, HasSubstr("parameters: 454922"));
}

TEST(ParseModelSpecTest, ResNetStagesBlocksAndCount) {
  const auto spec = ParseModelSpec("resnet");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
  const std::vector<ParamSpec> params = ModelParamSpecs(*spec);
  // stem, 3 stages of 3 blocks (2 convolutions each), 2 widening convolutions, fc: 22 layers.
  EXPECT_EQ(params.size(), 2u * 22);
  EXPECT_EQ(params[0].name, "stem/kernel");
  EXPECT_EQ(params[2].name, "res1_1a/kernel");
  EXPECT_EQ(params[4].name, "res1_1b/kernel");
  EXPECT_EQ(params.back().name, "fc/bias");
  const int64_t stage1 = 6 * (9 * 16 * 16 + 16), stage2 = 6 * (9 * 32 * 32 + 32),
                stage3 = 6 * (9 * 64 * 64 + 64);
  EXPECT_EQ(ModelParamCount(*spec), (9 * 16 + 16) + stage1 + (9 * 16 * 32 + 32) + stage2 +
                                        (9 * 32 * 64 + 64) + stage3 + (3136 * 10 + 10));
  EXPECT_EQ(ModelParamCount(*spec), 345642);
  const std::vector<ActivationShape> shapes = ActivationShapes(*spec);
  EXPECT_EQ(shapes[shapes.size() - 2], (ActivationShape{1, 1, 3136}));
  EXPECT_EQ(ModelNumClasses(*spec), 10);
  int adds = 0;
  for (size_t i = 0; i < spec->layers.size(); ++i) {
    const LayerSpec& l = spec->layers[i];
    if (l.kind != LayerKind::kAdd) continue;
    ++adds;
    // Each block adds its input (a ReLU's output, 4 layers back) to its branch.
    EXPECT_EQ(l.skip_from, static_cast<int64_t>(i) - 4);
    EXPECT_EQ(spec->layers[l.skip_from].kind, LayerKind::kReLU);
    EXPECT_EQ(spec->layers[i - 1].init, WeightInit::kZero);
  }
  EXPECT_EQ(adds, 9);
  // The branches' last convolutions start at zero, so each block starts as the identity.
  const std::vector<std::vector<float>> init = InitModelParams(*spec, 1);
  for (size_t t = 0; t < params.size(); ++t) {
    const bool zero = params[t].name.find("b/kernel") != std::string::npos ||
                      params[t].name.find("/bias") != std::string::npos;
    double sum_sq = 0;
    for (float v : init[t]) sum_sq += v * v;
    EXPECT_EQ(sum_sq == 0, zero) << params[t].name;
  }
  EXPECT_THAT(DescribeModel(*spec), HasSubstr("add layer 1 -> 28x28x16"));
  const auto two = ParseModelSpec("resnet:2");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(ModelParamSpecs(*two).size(), 2u * (6 * 2 + 4));
}

TEST(ParseModelSpecTest, BadStringsNameTheProblem) {
  struct Case {
    const char* model;
    const char* message;
  };
  for (const Case& c : {
           Case{"", "unknown --model \"\""},
           Case{"resnetx", "unknown --model \"resnetx\": expected \"mlp:"},
           Case{"resnet:0", "blocks per stage must be a whole number in [1, 16]"},
           Case{"resnet:17", "blocks per stage must be a whole number in [1, 16]"},
           Case{"resnet:two", "blocks per stage must be a whole number in [1, 16]"},
           Case{"MLP:784-10", "unknown --model \"MLP:784-10\""},
           Case{"mlp", "needs layer sizes after a colon"},
           Case{"mlp:", "need at least an input and a class count"},
           Case{"mlp:784", "need at least an input and a class count"},
           Case{"mlp:784-x-10", "token \"x\" is not a positive integer"},
           Case{"mlp:784--10", "token \"\" is not a positive integer"},
           Case{"mlp:784-0-10", "token \"0\" is not a positive integer"},
           Case{"cnn:32", "\"cnn\" takes no arguments"},
           Case{"cnn2", "\"cnn\" takes no arguments"},
       }) {
    const auto spec = ParseModelSpec(c.model);
    ASSERT_FALSE(spec.ok()) << c.model;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.model;
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.message)) << c.model;
  }
}

TEST(ValidateModelSpecTest, NamesTheLayerThatDoesNotFit) {
  struct Case {
    ModelSpec spec;
    const char* message;
  };
  const auto dense = [](int64_t in, int64_t out, const char* name) {
    return LayerSpec::Dense(std::string(name) + "/kernel", std::string(name) + "/bias", in, out,
                            WeightInit::kHeUniform);
  };
  const auto conv = [](int64_t k, int64_t cin, int64_t cout, Padding p, const char* name) {
    return LayerSpec::Conv2D(std::string(name) + "/kernel", std::string(name) + "/bias", k, k, cin,
                             cout, p, WeightInit::kHeUniform);
  };
  const std::vector<Case> cases = {
      {{{0, 28, 1}, {dense(784, 10, "d")}}, "input shape must be at least 1x1x1, got 0x28x1"},
      {{{1, 1, 4}, {}}, "at least one layer"},
      {{{1, 1, 784}, {dense(700, 10, "d")}},
       "layer 0 (dense d/kernel): expects 700 inputs, the previous layer gives 784"},
      {{{28, 28, 1}, {dense(784, 10, "d")}}, "needs a flat input, got 28x28x1 (add a flatten"},
      {{{28, 28, 1}, {conv(5, 3, 8, Padding::kSame, "c"), LayerSpec::Flatten()}},
       "layer 0 (conv2d c/kernel): expects 3 input channels, got 28x28x1"},
      {{{4, 4, 1}, {conv(5, 1, 8, Padding::kValid, "c"), LayerSpec::Flatten()}},
       "a 5x5 \"valid\" kernel does not fit input 4x4x1"},
      {{{3, 3, 1}, {LayerSpec::MaxPool2D(), LayerSpec::MaxPool2D(), LayerSpec::Flatten()}},
       "layer 1 (maxpool2d): 2x2 pooling needs an input of at least 2x2, got 1x1x1"},
      {{{4, 4, 1}, {conv(3, 1, 2, Padding::kSame, "c")}}, "must give flat logits, got 4x4x2"},
      {{{1, 1, 4}, {dense(4, 4, "d"), LayerSpec::ReLU(), dense(4, 2, "d")}},
       "layer 2 (dense d/kernel): parameter name \"d/kernel\" is used twice"},
      {{{1, 1, 4}, {dense(4, 0, "d")}}, "in and out must be >= 1"},
      {{{1 << 16, 1 << 16, 1}, {LayerSpec::Flatten()}},
       "input shape 65536x65536x1 exceeds 2^31-1 values"},
      {{{1 << 15, 1 << 15, 1}, {conv(1, 1, 2, Padding::kSame, "c"), LayerSpec::Flatten()}},
       "layer 0 (conv2d c/kernel): output 32768x32768x2 exceeds 2^31-1 values"},
      {{{1, 1, 4}, {dense(4, 4, "d"), LayerSpec::Add(1), dense(4, 2, "e")}},
       "layer 1 (add): skip_from must name an earlier layer, got 1"},
      {{{1, 1, 4}, {LayerSpec::Add(-1), dense(4, 2, "e")}},
       "layer 0 (add): skip_from must name an earlier layer, got -1"},
      {{{1, 1, 4}, {dense(4, 4, "d"), dense(4, 3, "e"), LayerSpec::Add(0), dense(3, 2, "f")}},
       "layer 2 (add): adds layer 0's output 1x1x4 to an input of 1x1x3"},
  };
  for (const Case& c : cases) {
    const absl::Status status = ValidateModelSpec(c.spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

TEST(ActivationShapesTest, SameAndValidPaddingAndOddPooling) {
  const ModelSpec spec = {
      {7, 6, 2},
      {LayerSpec::Conv2D("a/k", "a/b", 4, 3, 2, 5, Padding::kSame, WeightInit::kHeUniform),
       LayerSpec::Conv2D("b/k", "b/b", 3, 2, 5, 4, Padding::kValid, WeightInit::kHeUniform),
       LayerSpec::MaxPool2D(), LayerSpec::Flatten()}};
  ASSERT_TRUE(ValidateModelSpec(spec).ok()) << ValidateModelSpec(spec);
  const std::vector<ActivationShape> shapes = ActivationShapes(spec);
  EXPECT_EQ(shapes[1], (ActivationShape{7, 6, 5}));
  EXPECT_EQ(shapes[2], (ActivationShape{5, 5, 4}));
  EXPECT_EQ(shapes[3], (ActivationShape{2, 2, 4}));
  EXPECT_EQ(shapes[4], (ActivationShape{1, 1, 16}));
}

TEST(InitModelParamsTest, HeForReluLayersGlorotForTheOutputBiasesZero) {
  const ModelSpec spec = CnnModelSpec();
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const std::vector<std::vector<float>> params = InitModelParams(spec, 7);
  ASSERT_EQ(params.size(), specs.size());
  // Bounds from the papers: He sqrt(6 / fan_in), Glorot sqrt(6 / (fan_in + fan_out)).
  const double bounds[] = {std::sqrt(6.0 / 25), std::sqrt(6.0 / 800), std::sqrt(6.0 / 3136),
                           std::sqrt(6.0 / (128 + 10))};
  for (size_t t = 0; t < params.size(); ++t) {
    ASSERT_EQ(static_cast<int64_t>(params[t].size()), specs[t].elements());
    double max_abs = 0, sum_sq = 0;
    for (float v : params[t]) {
      max_abs = std::max(max_abs, static_cast<double>(std::abs(v)));
      sum_sq += static_cast<double>(v) * v;
    }
    if (t % 2 == 1) {
      EXPECT_EQ(max_abs, 0) << specs[t].name;
      continue;
    }
    const double bound = bounds[t / 2];
    EXPECT_LE(max_abs, bound) << specs[t].name;
    EXPECT_GT(max_abs, 0.9 * bound) << specs[t].name;
    // Uniform in +-bound has variance bound^2 / 3.
    const double variance = sum_sq / static_cast<double>(params[t].size());
    EXPECT_NEAR(variance, bound * bound / 3, 0.25 * bound * bound / 3) << specs[t].name;
  }
  EXPECT_EQ(InitModelParams(spec, 7), params);
  EXPECT_NE(InitModelParams(spec, 8)[0], params[0]);
}

}  // namespace
}  // namespace rubato
