#include "common/optimizer.h"

#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

OptimizerConfig Sgd(double lr, double wd = 0) {
  OptimizerConfig c;
  c.set_type("sgd");
  c.set_learning_rate(lr);
  c.set_weight_decay(wd);
  return c;
}

TEST(SgdTest, PlainStepsByHand) {
  auto opt = Optimizer::Create(Sgd(0.5));
  ASSERT_TRUE(opt.ok()) << opt.status();
  std::vector<float> w = {1.0f, -2.0f};
  const std::vector<float> g = {0.25f, -1.0f};
  TensorOptimizerState state;
  (*opt)->Update(0.5f, g, absl::MakeSpan(w), &state);
  EXPECT_FLOAT_EQ(w[0], 0.875f);  // 1 - 0.5 * 0.25
  EXPECT_FLOAT_EQ(w[1], -1.5f);   // -2 - 0.5 * -1
  (*opt)->Update(0.5f, g, absl::MakeSpan(w), &state);
  EXPECT_FLOAT_EQ(w[0], 0.75f);
  EXPECT_FLOAT_EQ(w[1], -1.0f);
  EXPECT_EQ(state.updates, 2);
}

TEST(SgdTest, WeightDecayIsCoupledL2) {
  auto opt = Optimizer::Create(Sgd(0.1, 0.01));
  ASSERT_TRUE(opt.ok());
  std::vector<float> w = {2.0f};
  const std::vector<float> g = {0.0f};
  TensorOptimizerState state;
  (*opt)->Update(0.1f, g, absl::MakeSpan(w), &state);
  EXPECT_FLOAT_EQ(w[0], 2.0f - 0.1f * 0.01f * 2.0f);
}

TEST(SgdTest, ZeroGradientLeavesWeightsBitIdentical) {
  auto opt = Optimizer::Create(Sgd(0.1));
  ASSERT_TRUE(opt.ok());
  std::vector<float> w = {0.3f, -0.0f, 1e-30f};
  const std::vector<float> before = w;
  const std::vector<float> g(3, 0.0f);
  TensorOptimizerState state;
  (*opt)->Update(0.1f, g, absl::MakeSpan(w), &state);
  EXPECT_EQ(w, before);
}

TEST(OptimizerConfigTest, RejectsBadFieldsByName) {
  OptimizerConfig unknown = Sgd(0.1);
  unknown.set_type("adagrad");
  EXPECT_EQ(Optimizer::Create(unknown).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Optimizer::Create(unknown).status().message().find("optimizer.type"), std::string::npos);

  for (double lr : {0.0, -0.1, std::numeric_limits<double>::infinity(),
                    std::numeric_limits<double>::quiet_NaN()}) {
    auto s = Optimizer::Create(Sgd(lr)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << lr;
    EXPECT_NE(s.message().find("optimizer.learning_rate"), std::string::npos) << s;
  }
  auto s = Optimizer::Create(Sgd(0.1, -1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("optimizer.weight_decay"), std::string::npos) << s;
}

}  // namespace
}  // namespace rubato
