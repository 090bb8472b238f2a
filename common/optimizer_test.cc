#include "common/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

// ----------------------------------------------------------------------------------------------
// Helpers.

OptimizerConfig Config(const std::string& type, double lr, double wd = 0) {
  OptimizerConfig c;
  c.set_type(type);
  c.set_learning_rate(lr);
  c.set_weight_decay(wd);
  return c;
}

std::unique_ptr<Optimizer> Make(const OptimizerConfig& config) {
  auto opt = Optimizer::Create(config);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

constexpr TensorRole kFull;                       // decay and adaptation
constexpr TensorRole kNoDecay{false, true};       // excluded from weight decay
constexpr TensorRole kNoAdaptation{true, false};  // excluded from the trust ratio
constexpr TensorRole kExcluded{false, false};     // both (a bias under the default rule)

// One step on a fresh or given state.
std::vector<float> Step(const Optimizer& opt, float lr, std::vector<float> w,
                        const std::vector<float>& g, const TensorRole& role = kFull,
                        TensorOptimizerState* state = nullptr) {
  TensorOptimizerState local;
  opt.Update(lr, g, absl::MakeSpan(w), role, state != nullptr ? state : &local);
  return w;
}

// ----------------------------------------------------------------------------------------------
// Hand-derived cases, one or two elements.

TEST(SgdTest, PlainStepsByHand) {
  auto opt = Make(Config("sgd", 0.5));
  std::vector<float> w = {1.0f, -2.0f};
  const std::vector<float> g = {0.25f, -1.0f};
  TensorOptimizerState state;
  opt->Update(0.5f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_EQ(w, std::vector<float>({0.875f, -1.5f}));  // 1 - 0.5*0.25, -2 - 0.5*-1 (exact)
  opt->Update(0.5f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_EQ(w, std::vector<float>({0.75f, -1.0f}));
  EXPECT_EQ(state.step, 2);
  EXPECT_TRUE(state.slot1.empty());  // no momentum, no buffer
}

TEST(SgdTest, WeightDecayIsCoupledL2AndExcludable) {
  auto opt = Make(Config("sgd", 0.1, 0.01));
  EXPECT_FLOAT_EQ(Step(*opt, 0.1f, {2.0f}, {0.0f})[0], 2.0f - 0.1f * 0.01f * 2.0f);
  EXPECT_EQ(Step(*opt, 0.1f, {2.0f}, {0.0f}, kNoDecay)[0], 2.0f);
}

TEST(SgdTest, ZeroGradientLeavesWeightsBitIdentical) {
  auto opt = Make(Config("sgd", 0.1));
  const std::vector<float> w = {0.3f, -0.0f, 1e-30f};
  EXPECT_EQ(Step(*opt, 0.1f, w, {0, 0, 0}), w);
}

TEST(SgdTest, HeavyBallMomentumByHand) {
  OptimizerConfig c = Config("sgd", 0.1);
  c.set_momentum(0.9);
  auto opt = Make(c);
  std::vector<float> w = {1.0f};
  TensorOptimizerState state;
  // v: 1, 1.9, 2.71; w: 1 - 0.1, then - 0.19, then - 0.271.
  const double expected[] = {0.9, 0.71, 0.439};
  for (double e : expected) {
    opt->Update(0.1f, std::vector<float>{1.0f}, absl::MakeSpan(w), kFull, &state);
    EXPECT_NEAR(w[0], e, 1e-6);
  }
  EXPECT_NEAR(state.slot1[0], 2.71, 1e-6);
}

TEST(SgdTest, NesterovByHand) {
  OptimizerConfig c = Config("sgd", 0.1);
  c.set_momentum(0.9);
  c.set_nesterov(true);
  auto opt = Make(c);
  std::vector<float> w = {1.0f};
  TensorOptimizerState state;
  // v1 = 1: w = 1 - 0.1*(1 + 0.9*1) = 0.81. v2 = 1.9: w = 0.81 - 0.1*(1 + 1.71) = 0.539.
  opt->Update(0.1f, std::vector<float>{1.0f}, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(w[0], 0.81, 1e-6);
  opt->Update(0.1f, std::vector<float>{1.0f}, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(w[0], 0.539, 1e-6);
}

TEST(AdamTest, BiasCorrectedStepIsLrTimesSignOfAConstantGradient) {
  // With a constant g, m_hat = g and v_hat = g^2 at every t, so each step is lr*g/(|g| + eps):
  // lr*sign(g) up to eps/|g|; an element with g = 0 gets 0/(0 + eps) = 0.
  auto opt = Make(Config("adam", 0.01));
  std::vector<float> w = {1.0f, 1.0f, 1.0f};
  const std::vector<float> g = {3.0f, -0.5f, 0.0f};
  TensorOptimizerState state;
  for (int t = 1; t <= 5; ++t) {
    opt->Update(0.01f, g, absl::MakeSpan(w), kFull, &state);
    EXPECT_NEAR(w[0], 1 - 0.01 * t, 1e-6) << t;
    EXPECT_NEAR(w[1], 1 + 0.01 * t, 1e-6) << t;
    EXPECT_EQ(w[2], 1.0f) << t;
  }
  EXPECT_EQ(state.step, 5);
  ASSERT_EQ(state.slot1.size(), 3u);
  ASSERT_EQ(state.slot2.size(), 3u);
  EXPECT_NEAR(state.slot1[0], 3 * (1 - std::pow(0.9, 5)), 1e-6);
  EXPECT_NEAR(state.slot2[0], 9 * (1 - std::pow(0.999, 5)), 1e-6);
}

// A moment decaying toward 0 under a zero gradient is flushed to 0 once it would be denormal
// (below FLT_MIN), instead of entering the slow denormal range; the caller's floating-point mode
// is left as it was.
TEST(AdamTest, DecayingMomentsFlushToZeroInsteadOfGoingDenormal) {
  auto opt = Make(Config("adam", 0.01));
  std::vector<float> w = {1.0f, 1.0f};
  TensorOptimizerState state;
  state.step = 100;
  // FLT_MIN is 1.1755e-38: m 1.4e-38 -> 1.26e-38 -> 1.134e-38 (denormal), v 1.177e-38 ->
  // 1.1758e-38 -> 1.1746e-38 (denormal).
  state.slot1 = {1.4e-38f, 1e-3f};
  state.slot2 = {1.177e-38f, 1e-6f};
  const std::vector<float> zero = {0.0f, 0.0f};
  volatile float tiny = 1e-38f;
  const bool caller_flushes = tiny * 0.5f == 0.0f;  // the test process's own mode
  opt->Update(0.01f, zero, absl::MakeSpan(w), kFull, &state);
  EXPECT_GT(state.slot1[0], 0.0f);  // still normal
  EXPECT_GT(state.slot2[0], 0.0f);
  opt->Update(0.01f, zero, absl::MakeSpan(w), kFull, &state);
  EXPECT_EQ(state.slot1[0], 0.0f);
  EXPECT_EQ(state.slot2[0], 0.0f);
  EXPECT_GT(state.slot1[1], 0.0f);  // ordinary values are untouched
  EXPECT_TRUE(std::isfinite(w[0]) && std::isfinite(w[1]));
  EXPECT_EQ(tiny * 0.5f == 0.0f, caller_flushes);
}

TEST(AdamTest, EpsilonIsAddedToTheCorrectedRoot) {
  OptimizerConfig c = Config("adam", 0.1);
  c.set_epsilon(1.0);
  auto opt = Make(c);
  // t = 1, g = 1: m_hat = v_hat = 1, step = lr * 1/(1 + 1).
  EXPECT_NEAR(Step(*opt, 0.1f, {0.0f}, {1.0f})[0], -0.05, 1e-7);
}

TEST(AdamTest, WeightDecayIsAddedToTheGradient) {
  // g = 0, wd*w = 0.5*2 = 1: the first step is lr*sign(1), not lr*wd*w.
  auto opt = Make(Config("adam", 0.1, 0.5));
  EXPECT_NEAR(Step(*opt, 0.1f, {2.0f}, {0.0f})[0], 1.9, 1e-6);
  // Excluded: nothing moves.
  EXPECT_EQ(Step(*opt, 0.1f, {2.0f}, {0.0f}, kNoDecay)[0], 2.0f);
}

TEST(AdamWTest, WeightDecayIsDecoupled) {
  // g = 0: the Adam part is 0/(0 + eps) = 0 and only w <- w - lr*wd*w remains.
  auto opt = Make(Config("adamw", 0.1, 0.5));
  EXPECT_NEAR(Step(*opt, 0.1f, {2.0f}, {0.0f})[0], 2 - 0.1 * 0.5 * 2, 1e-6);
  EXPECT_EQ(Step(*opt, 0.1f, {2.0f}, {0.0f}, kNoDecay)[0], 2.0f);
  // g = 1, t = 1: lr*sign(g) plus the decay of the old w.
  EXPECT_NEAR(Step(*opt, 0.1f, {2.0f}, {1.0f})[0], 2 - 0.1 - 0.1, 1e-6);
}

TEST(AdamWTest, TorchOrderEqualsHeaderFormula) {
  // torch: w*(1 - lr*wd) - lr*r; optimizer.h: w - lr*(r + wd*w). Same pre-update w, so the same
  // number; in float they may differ by rounding only.
  auto opt = Make(Config("adamw", 0.05, 0.3));
  const std::vector<float> w = {1.5f, -0.25f, 3.0f};
  const std::vector<float> g = {0.2f, 0.7f, -1.0f};
  const std::vector<float> out = Step(*opt, 0.05f, w, g);
  for (size_t i = 0; i < w.size(); ++i) {
    const double r = g[i] / (std::fabs(g[i]) + 1e-8);  // t = 1
    EXPECT_NEAR(out[i], w[i] - 0.05 * (r + 0.3 * w[i]), 1e-6);
  }
}

TEST(LambTest, TrustRatioIsWeightNormOverUpdateNorm) {
  // w = (3, 4), ||w|| = 5. t = 1, g = (1, 0): u = (1/(1 + 1e-6), 0), trust = 5/||u||, so the
  // step is lr*5 along u's direction: w = (3 - 0.5, 4).
  auto opt = Make(Config("lamb", 0.1));
  const std::vector<float> out = Step(*opt, 0.1f, {3.0f, 4.0f}, {1.0f, 0.0f});
  EXPECT_NEAR(out[0], 2.5, 1e-6);
  EXPECT_EQ(out[1], 4.0f);
}

TEST(LambTest, DecoupledDecayIsInsideTheRatio) {
  // g = 0: u = wd*w, ||u|| = wd*||w||, trust = 1/wd, so w <- w - lr*w whatever wd is.
  auto opt = Make(Config("lamb", 0.1, 0.1));
  const std::vector<float> out = Step(*opt, 0.1f, {3.0f, 4.0f}, {0.0f, 0.0f});
  EXPECT_NEAR(out[0], 2.7, 1e-6);
  EXPECT_NEAR(out[1], 3.6, 1e-6);
}

TEST(LambTest, RatioIsOneForZeroWeightsOrZeroUpdate) {
  auto opt = Make(Config("lamb", 0.1));
  // ||w|| = 0: plain Adam-like step of lr*u, u ~ sign(g).
  const std::vector<float> from_zero = Step(*opt, 0.1f, {0.0f, 0.0f}, {1.0f, -2.0f});
  EXPECT_NEAR(from_zero[0], -0.1, 1e-6);
  EXPECT_NEAR(from_zero[1], 0.1, 1e-6);
  // ||u|| = 0 (no gradient, no decay): nothing moves, and nothing divides by zero.
  const std::vector<float> still = Step(*opt, 0.1f, {3.0f, 4.0f}, {0.0f, 0.0f});
  EXPECT_EQ(still, std::vector<float>({3.0f, 4.0f}));
}

TEST(LambTest, ExcludedTensorsGetRatioOneAndNoDecay) {
  auto opt = Make(Config("lamb", 0.1, 0.5));
  // No adaptation: w <- w - lr*u with u = (~1, 0) + 0.5*w.
  const std::vector<float> no_adapt = Step(*opt, 0.1f, {3.0f, 4.0f}, {1.0f, 0.0f}, kNoAdaptation);
  EXPECT_NEAR(no_adapt[0], 3 - 0.1 * (1 + 1.5), 1e-6);
  EXPECT_NEAR(no_adapt[1], 4 - 0.1 * 2, 1e-6);
  // Neither: a bias under the default rule moves by lr*sign(g) only.
  const std::vector<float> bias = Step(*opt, 0.1f, {3.0f, 4.0f}, {1.0f, 0.0f}, kExcluded);
  EXPECT_NEAR(bias[0], 2.9, 1e-6);
  EXPECT_EQ(bias[1], 4.0f);
}

TEST(LambTest, EpsilonAndBiasCorrectionAtStepOne) {
  // g = 1e-6 = eps: m_hat = 1e-6, sqrt(v_hat) = 1e-6, r = 1e-6/(1e-6 + 1e-6) = 0.5.
  auto opt = Make(Config("lamb", 0.1));
  const std::vector<float> out = Step(*opt, 0.1f, {3.0f}, {1e-6f}, kNoAdaptation);
  EXPECT_NEAR(out[0], 3 - 0.1 * 0.5, 1e-6);
  // Without the correction m would be 1e-7 and v 1e-15 and r about 0.1/1.03, not 0.5; at t = 2
  // with the same g the corrected moments are unchanged and r is still 0.5.
  TensorOptimizerState state;
  std::vector<float> w = {3.0f};
  opt->Update(0.1f, std::vector<float>{1e-6f}, absl::MakeSpan(w), kNoAdaptation, &state);
  opt->Update(0.1f, std::vector<float>{1e-6f}, absl::MakeSpan(w), kNoAdaptation, &state);
  EXPECT_NEAR(w[0], 3 - 2 * 0.05, 1e-6);
}

// lars or larc with the given momentum and epsilon.
OptimizerConfig TrustRatioConfig(const char* type, double lr, double wd, double momentum,
                                 double epsilon) {
  OptimizerConfig c = Config(type, lr, wd);
  c.set_momentum(momentum);
  c.set_epsilon(epsilon);
  return c;
}

OptimizerConfig Lars(double lr, double wd, double momentum, double epsilon = 0) {
  return TrustRatioConfig("lars", lr, wd, momentum, epsilon);
}

TEST(LarsTest, TrustRatioAndMomentumByHand) {
  // ||w|| = 5, ||g|| = 1, eta = 0.001: trust = 0.005; v = 0.005*g; w = w - v.
  auto opt = Make(Lars(1.0, 0, 0.9));
  std::vector<float> w = {3.0f, 4.0f};
  const std::vector<float> g = {0.6f, 0.8f};
  TensorOptimizerState state;
  opt->Update(1.0f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(w[0], 2.997, 1e-6);
  EXPECT_NEAR(w[1], 3.996, 1e-6);
  // Step 2: ||w|| = 4.995, trust = 0.004995, v = 0.9*v + trust*g.
  opt->Update(1.0f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(state.slot1[0], 0.9 * 0.003 + 0.004995 * 0.6, 1e-8);
  EXPECT_NEAR(w[0], 2.997 - (0.9 * 0.003 + 0.004995 * 0.6), 1e-6);
  EXPECT_NEAR(w[1], 3.996 - (0.9 * 0.004 + 0.004995 * 0.8), 1e-6);
}

TEST(LarsTest, WeightDecayEntersTheGradientAndTheNorm) {
  // g = 0, wd = 0.5: g' = 0.5*w, ||g'|| = 2.5, trust = 0.001*5/2.5 = 0.002, step 0.002*0.5*w.
  auto opt = Make(Lars(1.0, 0.5, 0.0));
  const std::vector<float> out = Step(*opt, 1.0f, {3.0f, 4.0f}, {0.0f, 0.0f});
  EXPECT_NEAR(out[0], 3 * 0.999, 1e-6);
  EXPECT_NEAR(out[1], 4 * 0.999, 1e-6);
}

TEST(LarsTest, RatioIsOneForZeroWeightsOrZeroGradient) {
  auto opt = Make(Lars(0.1, 0, 0.9));
  const std::vector<float> from_zero = Step(*opt, 0.1f, {0.0f, 0.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(from_zero[0], -0.06, 1e-7);
  EXPECT_NEAR(from_zero[1], -0.08, 1e-7);
  EXPECT_EQ(Step(*opt, 0.1f, {3.0f, 4.0f}, {0.0f, 0.0f}), std::vector<float>({3.0f, 4.0f}));
}

TEST(LarsTest, ExcludedTensorsGetRatioOne) {
  auto opt = Make(Lars(0.1, 0.5, 0.9));
  const std::vector<float> out = Step(*opt, 0.1f, {3.0f, 4.0f}, {0.6f, 0.8f}, kExcluded);
  EXPECT_NEAR(out[0], 3 - 0.06, 1e-6);
  EXPECT_NEAR(out[1], 4 - 0.08, 1e-6);
  // Adaptation off but decay on: v = lr*(g + wd*w).
  const std::vector<float> decayed = Step(*opt, 0.1f, {3.0f, 4.0f}, {0.6f, 0.8f}, kNoAdaptation);
  EXPECT_NEAR(decayed[0], 3 - 0.1 * (0.6 + 1.5), 1e-6);
}

TEST(LarsTest, EpsilonGuardsTheDenominator) {
  // trust = 0.001*5/(1 + 1) = 0.0025.
  auto opt = Make(Lars(1.0, 0, 0.9, 1.0));
  const std::vector<float> out = Step(*opt, 1.0f, {3.0f, 4.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(out[0], 3 - 0.0025 * 0.6, 3e-7);  // an ulp of 3 is 2.4e-7
}

OptimizerConfig Larc(double lr, double wd, double momentum, double epsilon = 0) {
  return TrustRatioConfig("larc", lr, wd, momentum, epsilon);
}

TEST(LarcTest, LocalRateBelowTheGlobalOneIsKept) {
  // ||w|| = 5, ||g|| = 1, eta = 0.02 (the default): local = 0.1 < lr = 1, so rate 0.1.
  auto opt = Make(Larc(1.0, 0, 0.9));
  ASSERT_EQ(opt->config().trust_coefficient(), 0.02);
  std::vector<float> w = {3.0f, 4.0f};
  const std::vector<float> g = {0.6f, 0.8f};
  TensorOptimizerState state;
  opt->Update(1.0f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(w[0], 3 - 0.06, 1e-6);
  EXPECT_NEAR(w[1], 4 - 0.08, 1e-6);
  // Step 2: ||w|| = 4.9, local = 0.098; v = 0.9*v + 0.098*g.
  opt->Update(1.0f, g, absl::MakeSpan(w), kFull, &state);
  EXPECT_NEAR(state.slot1[0], 0.9 * 0.06 + 0.098 * 0.6, 1e-7);
  EXPECT_NEAR(w[0], 2.94 - (0.9 * 0.06 + 0.098 * 0.6), 1e-6);
}

TEST(LarcTest, LocalRateAboveTheGlobalOneIsClipped) {
  // local = 0.1 > lr = 0.05: the step is plain momentum SGD at 0.05 (min(local/lr, 1) = 1).
  auto opt = Make(Larc(0.05, 0, 0.9));
  const std::vector<float> out = Step(*opt, 0.05f, {3.0f, 4.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(out[0], 3 - 0.05 * 0.6, 1e-6);
  EXPECT_NEAR(out[1], 4 - 0.05 * 0.8, 1e-6);
  // Unlike lars, whose rate would be 0.05 * 0.001 * 5 / 1 = 2.5e-4 here.
  auto lars = Make(Lars(0.05, 0, 0.9));
  EXPECT_NEAR(Step(*lars, 0.05f, {3.0f, 4.0f}, {0.6f, 0.8f})[0], 3 - 2.5e-4 * 0.6, 1e-6);
}

TEST(LarcTest, WeightDecayEntersTheGradientAndTheDenominator) {
  // wd = 0.5: local = 0.02*5/(1 + 0.5*5) = 0.1/3.5; g' = g + 0.5*w = (2.1, 2.8).
  auto opt = Make(Larc(1.0, 0.5, 0.0));
  const std::vector<float> out = Step(*opt, 1.0f, {3.0f, 4.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(out[0], 3 - 0.1 / 3.5 * 2.1, 1e-6);
  EXPECT_NEAR(out[1], 4 - 0.1 / 3.5 * 2.8, 1e-6);
}

TEST(LarcTest, PlainRateForZeroNormsAndExcludedTensors) {
  auto opt = Make(Larc(0.1, 0, 0.9));
  const std::vector<float> from_zero = Step(*opt, 0.1f, {0.0f, 0.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(from_zero[0], -0.06, 1e-7);
  EXPECT_EQ(Step(*opt, 0.1f, {3.0f, 4.0f}, {0.0f, 0.0f}), std::vector<float>({3.0f, 4.0f}));
  // Excluded: lr 0.1 although local would be 0.02*5/1 = 0.1 too; use lr 1 to tell them apart.
  auto big = Make(Larc(1.0, 0, 0.9));
  EXPECT_NEAR(Step(*big, 1.0f, {3.0f, 4.0f}, {0.6f, 0.8f}, kExcluded)[0], 3 - 0.6, 1e-6);
  EXPECT_NEAR(Step(*big, 1.0f, {3.0f, 4.0f}, {0.6f, 0.8f}, kFull)[0], 3 - 0.06, 1e-6);
}

TEST(LarcTest, EpsilonGuardsTheDenominator) {
  // local = 0.02*5/(1 + 1) = 0.05.
  auto opt = Make(Larc(1.0, 0, 0.9, 1.0));
  const std::vector<float> out = Step(*opt, 1.0f, {3.0f, 4.0f}, {0.6f, 0.8f});
  EXPECT_NEAR(out[0], 3 - 0.05 * 0.6, 3e-7);
}

TEST(RoleTest, DefaultExcludesRankAtMostOne) {
  for (const char* type : {"sgd", "adam", "adamw", "lars", "larc", "lamb"}) {
    auto opt = Make(Config(type, 0.1, 0.01));
    const TensorRole kernel = opt->RoleOf("dense/kernel", {784, 256});
    EXPECT_TRUE(kernel.weight_decay && kernel.layer_adaptation) << type;
    const TensorRole bias = opt->RoleOf("dense/kernel", {256});  // rank only, not the name
    EXPECT_FALSE(bias.weight_decay || bias.layer_adaptation) << type;
    const TensorRole scalar = opt->RoleOf("temperature", {});
    EXPECT_FALSE(scalar.weight_decay || scalar.layer_adaptation) << type;
  }
}

TEST(RoleTest, PatternsAreSearchedAndReplaceTheDefault) {
  OptimizerConfig c = Config("lamb", 0.1, 0.01);
  c.add_exclude_from_weight_decay("bias");
  c.add_exclude_from_weight_decay("LayerNorm");
  c.add_exclude_from_layer_adaptation("^embeddings\\.");
  auto opt = Make(c);
  TensorRole r = opt->RoleOf("encoder/layer_3/attention/bias", {768});
  EXPECT_FALSE(r.weight_decay);     // found anywhere in the name
  EXPECT_TRUE(r.layer_adaptation);  // the list is not empty, so rank 1 alone does not exclude
  r = opt->RoleOf("encoder/LayerNorm/gamma", {768});
  EXPECT_FALSE(r.weight_decay);
  r = opt->RoleOf("embeddings.word", {30522, 768});
  EXPECT_TRUE(r.weight_decay);
  EXPECT_FALSE(r.layer_adaptation);
  r = opt->RoleOf("x.embeddings.word", {30522, 768});  // anchored by the pattern itself
  EXPECT_TRUE(r.layer_adaptation);
  r = opt->RoleOf("dense/kernel", {768, 768});
  EXPECT_TRUE(r.weight_decay && r.layer_adaptation);
}

// ----------------------------------------------------------------------------------------------
// A double-precision reference, written from the formulas in optimizer.h and nothing else.

struct RefState {
  int64_t t = 0;
  std::vector<double> m, v;  // sgd/lars/larc use m as the momentum buffer
};

double RefNorm(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

void RefUpdate(const OptimizerConfig& c, double lr, const std::vector<float>& grad,
               const TensorRole& role, std::vector<double>* weights, RefState* s) {
  std::vector<double>& w = *weights;
  const size_t n = w.size();
  const std::string& type = c.type();
  const double wd = role.weight_decay ? c.weight_decay() : 0;
  s->t += 1;
  if (s->m.empty()) s->m.assign(n, 0.0);
  if (s->v.empty()) s->v.assign(n, 0.0);
  if (type == "sgd") {
    const double mu = c.momentum();
    for (size_t i = 0; i < n; ++i) {
      const double gp = grad[i] + wd * w[i];
      if (mu == 0) {
        w[i] -= lr * gp;
        continue;
      }
      s->m[i] = mu * s->m[i] + gp;
      w[i] -= lr * (c.nesterov() ? gp + mu * s->m[i] : s->m[i]);
    }
  } else if (type == "adam" || type == "adamw" || type == "lamb") {
    const double b1 = c.beta1(), b2 = c.beta2(), eps = c.epsilon();
    const bool coupled = type == "adam";
    std::vector<double> u(n);
    for (size_t i = 0; i < n; ++i) {
      const double gp = coupled ? grad[i] + wd * w[i] : grad[i];
      s->m[i] = b1 * s->m[i] + (1 - b1) * gp;
      s->v[i] = b2 * s->v[i] + (1 - b2) * gp * gp;
      const double m_hat = s->m[i] / (1 - std::pow(b1, s->t));
      const double v_hat = s->v[i] / (1 - std::pow(b2, s->t));
      u[i] = m_hat / (std::sqrt(v_hat) + eps);
      if (!coupled) u[i] += wd * w[i];
    }
    double trust = 1;
    if (type == "lamb" && role.layer_adaptation) {
      const double wn = RefNorm(w), un = RefNorm(u);
      if (wn > 0 && un > 0) trust = wn / un;
    }
    for (size_t i = 0; i < n; ++i) w[i] -= lr * trust * u[i];
  } else if (type == "lars") {
    std::vector<double> gp(n);
    for (size_t i = 0; i < n; ++i) gp[i] = grad[i] + wd * w[i];
    double trust = 1;
    if (role.layer_adaptation) {
      const double wn = RefNorm(w), gn = RefNorm(gp);
      if (wn > 0 && gn > 0) trust = c.trust_coefficient() * wn / (gn + c.epsilon());
    }
    for (size_t i = 0; i < n; ++i) {
      s->m[i] = c.momentum() * s->m[i] + lr * trust * gp[i];
      w[i] -= s->m[i];
    }
  } else if (type == "larc") {
    double rate = lr;
    if (role.layer_adaptation) {
      std::vector<double> g(grad.begin(), grad.end());
      const double wn = RefNorm(w), gn = RefNorm(g);
      if (wn > 0 && gn > 0) {
        rate = std::min(lr, c.trust_coefficient() * wn / (gn + wd * wn + c.epsilon()));
      }
    }
    for (size_t i = 0; i < n; ++i) {
      s->m[i] = c.momentum() * s->m[i] + rate * (grad[i] + wd * w[i]);
      w[i] -= s->m[i];
    }
  } else {
    ADD_FAILURE() << "reference has no " << type;
  }
}

// max_i |w_i - ref_i| / scale, scale = the largest |ref_i| the tensor held at any step: the error
// measured against the tensor's scale. A per-element relative error means nothing for an element
// that ends near zero: float rounding is relative to the values an element was computed from, so
// it still carries the absolute error of the larger values it held. The norms that LARS and LAMB
// take, and the loss, see errors at the tensor's scale too.
double MaxAbs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

double ScaledError(const std::vector<float>& w, const std::vector<double>& ref, double scale) {
  double err = 0;
  for (size_t i = 0; i < w.size(); ++i) err = std::max(err, std::fabs(w[i] - ref[i]));
  return err / std::max(scale, 1e-30);
}

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Sizes across the 4096-element norm blocks: whole blocks, a tail, a single element, a bias.
const std::vector<TensorSpec>& TestTensors() {
  static const auto* specs = new std::vector<TensorSpec>{
      {"dense/kernel", {3, 4099}}, {"dense/bias", {1000}},  {"embedding", {2, 4096}},
      {"scale", {1, 1}},           {"head/kernel", {7, 5}},
  };
  return *specs;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct RandomCase {
  std::string label;
  OptimizerConfig config;
  float lr;
};

std::vector<RandomCase> RandomCases() {
  std::vector<RandomCase> cases;
  auto add = [&](std::string label, OptimizerConfig c, float lr) {
    cases.push_back({label + "_no_wd", c, lr});
    c.set_weight_decay(0.05);
    cases.push_back({label + "_wd", c, lr});
    // Exclusions by name instead of the rank default: the kernels keep decay, everything else
    // (bias, embedding, scale) loses it; only "embedding" loses the trust ratio.
    c.add_exclude_from_weight_decay("bias|embedding|scale");
    if (c.type() == "lars" || c.type() == "larc" || c.type() == "lamb") {
      c.add_exclude_from_layer_adaptation("^embed");
    }
    cases.push_back({label + "_wd_excluded", c, lr});
  };
  add("sgd", Config("sgd", 0.05), 0.05f);
  OptimizerConfig momentum = Config("sgd", 0.05);
  momentum.set_momentum(0.9);
  add("momentum", momentum, 0.05f);
  momentum.set_nesterov(true);
  add("nesterov", momentum, 0.05f);
  add("adam", Config("adam", 0.01), 0.01f);
  add("adamw", Config("adamw", 0.01), 0.01f);
  add("lars", Config("lars", 1.0), 1.0f);
  // lr 0.05: some tensors' local rate is above it (clipped), others' below.
  add("larc", Config("larc", 0.05), 0.05f);
  add("lamb", Config("lamb", 0.01), 0.01f);
  return cases;
}

TEST(ReferenceTest, HundredRandomStepsMatchDoubleReference) {
  constexpr int kSteps = 100;
  double worst_overall = 0;
  for (const RandomCase& rc : RandomCases()) {
    SCOPED_TRACE(rc.label);
    auto opt = Make(rc.config);
    ASSERT_NE(opt, nullptr);
    const OptimizerConfig& c = opt->config();
    double worst = 0;
    for (const TensorSpec& spec : TestTensors()) {
      SCOPED_TRACE(spec.name);
      const int64_t n = Elements(spec.shape);
      const TensorRole role = opt->RoleOf(spec.name, spec.shape);
      std::mt19937 rng(static_cast<uint32_t>(n * 7919 + rc.label.size()));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> w(n);
      for (float& x : w) x = normal(rng);
      if (spec.name == "dense/bias") std::fill(w.begin(), w.end(), 0.0f);  // zero-initialised
      std::vector<double> ref(w.begin(), w.end());
      double scale = MaxAbs(ref);
      TensorOptimizerState state;
      RefState ref_state;
      std::vector<float> g(n);
      for (int t = 0; t < kSteps; ++t) {
        // Gradient scale varies by step so that Adam's moments see a non-stationary signal.
        const float g_scale = 0.1f + static_cast<float>(t % 7) * 0.3f;
        for (float& x : g) x = g_scale * normal(rng);
        opt->Update(rc.lr, g, absl::MakeSpan(w), role, &state);
        RefUpdate(c, rc.lr, g, role, &ref, &ref_state);
        scale = std::max(scale, MaxAbs(ref));
      }
      const double err = ScaledError(w, ref, scale);
      EXPECT_LE(err, 1e-6);
      worst = std::max(worst, err);
    }
    worst_overall = std::max(worst_overall, worst);
    std::printf("%-24s max scaled error vs double reference %.3g\n", rc.label.c_str(), worst);
  }
  std::printf("overall max scaled error vs double reference %.3g\n", worst_overall);
}

// ----------------------------------------------------------------------------------------------
// Adam's moments at step t as a plain float loop updates them (beta1 0.9, beta2 0.999), with the
// float scalars optimizer.cc derives in double.
struct PlainMoments {
  float b1 = 0.9f, one_minus_b1 = static_cast<float>(1 - 0.9), b2 = 0.999f,
        one_minus_b2 = static_cast<float>(1 - 0.999);
  float inv_bc2_sqrt;  // 1/sqrt(1 - b2^t)
  explicit PlainMoments(int t)
      : inv_bc2_sqrt(static_cast<float>(1 / std::sqrt(1 - std::pow(0.999, t)))) {}
  // m, v <- the moments after gradient g; returns m / (sqrt(v_hat) + eps) * (1 - b1^t).
  float Update(float g, float eps, float* m, float* v) const {
    *m = b1 * *m + one_minus_b1 * g;
    *v = b2 * *v + one_minus_b2 * g * g;
    return *m / (std::sqrt(*v) * inv_bc2_sqrt + eps);
  }
};

// The weights and both moments are the plain loop's, bit for bit (memcmp: -0 is not +0).
void ExpectSameBits(const std::vector<float>& w, const std::vector<float>& want,
                    const TensorOptimizerState& state, const std::vector<float>& m,
                    const std::vector<float>& v) {
  ASSERT_EQ(w.size(), want.size());
  int64_t differ = 0;
  for (size_t i = 0; i < w.size(); ++i) differ += std::memcmp(&w[i], &want[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0) << "of " << w.size() << " weights";
  EXPECT_EQ(state.slot1, m);
  EXPECT_EQ(state.slot2, v);
}

// Adam and AdamW give, bit for bit, what one plain float loop gives with the same operations in
// the same order: so does whichever of the kernels' versions (SSE2, AVX2, AVX-512F) this
// processor runs, none of which may fuse a multiply and an add or reorder a sum.
TEST(MultiversionTest, AdamKernelsDoTheSameIeeeOperationsAsAPlainLoop) {
  constexpr int64_t kN = 3 * 4096 + 77;  // several blocks and a tail
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  for (const char* type : {"adam", "adamw"}) {
    SCOPED_TRACE(type);
    const bool coupled = std::string(type) == "adam";
    auto opt = Make(Config(type, 0.01, 0.02));
    std::vector<float> w(kN), m(kN, 0.0f), v(kN, 0.0f);
    for (float& x : w) x = normal(rng);
    std::vector<float> want = w;
    TensorOptimizerState state;
    for (int t = 1; t <= 4; ++t) {
      std::vector<float> g(kN);
      for (float& x : g) x = normal(rng);
      const float lr = 0.01f / static_cast<float>(t);
      opt->Update(lr, g, absl::MakeSpan(w), kFull, &state);
      const PlainMoments moments(t);
      const float wd = 0.02f;
      const float step = static_cast<float>(lr / (1 - std::pow(0.9, t)));
      const float lr_wd = static_cast<float>(static_cast<double>(lr) * wd);
      for (int64_t i = 0; i < kN; ++i) {
        const float wi = want[i];
        const float q = moments.Update(coupled ? g[i] + wd * wi : g[i], 1e-8f, &m[i], &v[i]);
        want[i] = coupled ? wi - step * q : wi - (step * q + lr_wd * wi);
      }
    }
    ExpectSameBits(w, want, state, m, v);
  }
}

// LAMB likewise, with its norms summed as optimizer.cc sums them: per block of 4096, 32 float
// lanes (lane j takes elements j, j + 32, ...), the lanes added in double, then the blocks.
TEST(MultiversionTest, LambKernelsDoTheSameIeeeOperationsAsAPlainLoop) {
  constexpr int64_t kN = 2 * 4096 + 1000;
  constexpr int64_t kBlock = 4096;
  std::mt19937_64 rng(6);
  std::normal_distribution<float> normal;
  OptimizerConfig config = Config("lamb", 0.01, 0.02);
  config.set_beta1(0.9);
  config.set_beta2(0.999);
  config.set_epsilon(1e-6);
  auto opt = Make(config);
  std::vector<float> w(kN), m(kN, 0.0f), v(kN, 0.0f), u(kN);
  for (float& x : w) x = normal(rng);
  std::vector<float> want = w;
  auto sum_squares = [](const float* x, int64_t count) {
    float acc[32] = {};
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
      for (int j = 0; j < 32; ++j) acc[j] += x[i + j] * x[i + j];
    }
    for (int j = 0; i < count; ++i, ++j) acc[j] += x[i] * x[i];
    double total = 0;
    for (int j = 0; j < 32; ++j) total += acc[j];
    return total;
  };
  TensorOptimizerState state;
  for (int t = 1; t <= 3; ++t) {
    std::vector<float> g(kN);
    for (float& x : g) x = normal(rng);
    const float lr = 0.01f;
    opt->Update(lr, g, absl::MakeSpan(w), kFull, &state);
    const PlainMoments moments(t);
    const float wd = 0.02f;
    const float inv_bc1 = static_cast<float>(1 / (1 - std::pow(0.9, t)));
    for (int64_t i = 0; i < kN; ++i) {
      u[i] = moments.Update(g[i], 1e-6f, &m[i], &v[i]) * inv_bc1 + wd * want[i];
    }
    double a = 0, b = 0;
    for (int64_t begin = 0; begin < kN; begin += kBlock) {
      const int64_t count = std::min(kBlock, kN - begin);
      a += sum_squares(want.data() + begin, count);
      b += sum_squares(u.data() + begin, count);
    }
    const float scale = static_cast<float>(lr * (std::sqrt(a) / std::sqrt(b)));
    for (int64_t i = 0; i < kN; ++i) want[i] = want[i] - scale * u[i];
  }
  ExpectSameBits(w, want, state, m, v);
}

// The same update with no pool and with 1, 2 and 4 threads is bit-identical.

TEST(ThreadCountTest, ResultsDoNotDependOnThePool) {
  // 300001 elements: 74 blocks (enough to be split) and a tail.
  constexpr int64_t kN = 300001;
  ThreadPool pool1(1), pool2(2), pool4(4);
  ThreadPool* pools[] = {nullptr, &pool1, &pool2, &pool4};
  for (const RandomCase& rc : RandomCases()) {
    SCOPED_TRACE(rc.label);
    auto opt = Make(rc.config);
    ASSERT_NE(opt, nullptr);
    std::vector<std::vector<float>> results;
    std::vector<TensorOptimizerState> states;
    for (ThreadPool* pool : pools) {
      std::mt19937 rng(42);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> w(kN), g(kN);
      for (float& x : w) x = normal(rng);
      TensorOptimizerState state;
      for (int t = 0; t < 3; ++t) {
        for (float& x : g) x = normal(rng);
        opt->Update(rc.lr, g, absl::MakeSpan(w), kFull, &state, pool);
      }
      results.push_back(std::move(w));
      states.push_back(std::move(state));
    }
    for (size_t p = 1; p < results.size(); ++p) {
      EXPECT_EQ(std::memcmp(results[p].data(), results[0].data(), kN * sizeof(float)), 0) << p;
      EXPECT_EQ(states[p].slot1, states[0].slot1) << p;
      EXPECT_EQ(states[p].slot2, states[0].slot2) << p;
    }
  }
}

TEST(ThreadCountTest, ConcurrentUpdatesOfDifferentTensorsMatchSequentialOnes) {
  // LAMB keeps u between its passes in one buffer per optimizer; an update that finds it taken
  // recomputes u instead. Either way the bits are the same.
  for (const char* type : {"lamb", "lars", "larc", "adamw"}) {
    SCOPED_TRACE(type);
    auto opt = Make(Config(type, 0.01, 0.01));
    ASSERT_NE(opt, nullptr);
    constexpr int kTensors = 4;
    constexpr int64_t kN = 200003;
    std::vector<std::vector<float>> w0(kTensors), g(kTensors);
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int k = 0; k < kTensors; ++k) {
      w0[k].resize(kN);
      g[k].resize(kN);
      for (float& x : w0[k]) x = normal(rng);
      for (float& x : g[k]) x = normal(rng);
    }
    auto run = [&](int k, std::vector<float>* w, TensorOptimizerState* state) {
      for (int t = 0; t < 5; ++t) opt->Update(0.01f, g[k], absl::MakeSpan(*w), kFull, state);
    };
    std::vector<std::vector<float>> sequential = w0, concurrent = w0;
    std::vector<TensorOptimizerState> s1(kTensors), s2(kTensors);
    for (int k = 0; k < kTensors; ++k) run(k, &sequential[k], &s1[k]);
    std::vector<std::thread> threads;
    for (int k = 0; k < kTensors; ++k) threads.emplace_back(run, k, &concurrent[k], &s2[k]);
    for (std::thread& t : threads) t.join();
    for (int k = 0; k < kTensors; ++k) {
      EXPECT_EQ(std::memcmp(sequential[k].data(), concurrent[k].data(), kN * sizeof(float)), 0)
          << k;
      EXPECT_EQ(s1[k].slot1, s2[k].slot1) << k;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// PyTorch's trajectories (testdata/make_optimizer_vectors.py).

struct TorchRun {
  std::string name;
  std::map<std::string, std::string> fields;
  std::vector<float> init;
  std::vector<std::vector<float>> grads, after;
};

std::vector<float> ParseFloats(const std::vector<std::string>& tokens, size_t from) {
  std::vector<float> out;
  for (size_t i = from; i < tokens.size(); ++i) {
    float f;
    EXPECT_TRUE(absl::SimpleAtof(tokens[i], &f)) << tokens[i];
    out.push_back(f);
  }
  return out;
}

std::vector<TorchRun> ReadTorchVectors() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string path =
      srcdir != nullptr && workspace != nullptr
          ? absl::StrCat(srcdir, "/", workspace, "/common/testdata/optimizer_torch_vectors.txt")
          : "common/testdata/optimizer_torch_vectors.txt";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<TorchRun> runs;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> tok = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (tok[0] == "config") {
      runs.emplace_back();
      runs.back().name = tok.at(1);
      for (size_t i = 2; i < tok.size(); ++i) {
        const std::vector<std::string> kv = absl::StrSplit(tok[i], absl::MaxSplits('=', 1));
        runs.back().fields[kv.at(0)] = kv.at(1);
      }
    } else if (tok[0] == "init") {
      runs.back().init = ParseFloats(tok, 1);
    } else if (tok[0] == "grad") {
      runs.back().grads.push_back(ParseFloats(tok, 2));
    } else if (tok[0] == "after") {
      runs.back().after.push_back(ParseFloats(tok, 2));
    } else if (tok[0] != "end") {
      ADD_FAILURE() << "unexpected line: " << line;
    }
  }
  return runs;
}

double Field(const TorchRun& run, const std::string& key) {
  double v = 0;
  EXPECT_TRUE(absl::SimpleAtod(run.fields.at(key), &v)) << key;
  return v;
}

TEST(TorchTest, MatchesPyTorchTrajectories) {
  const std::vector<TorchRun> runs = ReadTorchVectors();
  ASSERT_EQ(runs.size(), 5u);
  double worst_overall = 0;
  for (const TorchRun& run : runs) {
    SCOPED_TRACE(run.name);
    OptimizerConfig c = Config(run.fields.at("type"), Field(run, "lr"), Field(run, "weight_decay"));
    if (c.type() == "sgd") {
      c.set_momentum(Field(run, "momentum"));
      c.set_nesterov(Field(run, "nesterov") != 0);
    }
    auto opt = Make(c);
    ASSERT_NE(opt, nullptr);
    std::vector<float> w = run.init;
    TensorOptimizerState state;
    ASSERT_EQ(run.grads.size(), run.after.size());
    ASSERT_GE(run.grads.size(), 10u);
    double worst = 0;
    for (size_t t = 0; t < run.grads.size(); ++t) {
      ASSERT_EQ(run.grads[t].size(), w.size());
      opt->Update(static_cast<float>(c.learning_rate()), run.grads[t], absl::MakeSpan(w), kFull,
                  &state);
      for (size_t i = 0; i < w.size(); ++i) {
        // Both sides are float32 with one rounding per operation, in a slightly different order
        // (torch's vector kernels, scalars as double in Python): a few ulps per step, growing
        // over the steps. 2e-6 of max(1, |w|) is about 16 ulps at |w| = 1.
        const double expected = run.after[t][i];
        const double diff = std::fabs(w[i] - expected);
        EXPECT_LE(diff, 2e-6 * std::max(1.0, std::fabs(expected)))
            << "step " << t + 1 << " element " << i << ": " << w[i] << " vs torch " << expected;
        worst = std::max(worst, diff / std::max(1.0, std::fabs(expected)));
      }
    }
    worst_overall = std::max(worst_overall, worst);
    std::printf("%-14s max |w - torch| / max(1, |torch|) %.3g\n", run.name.c_str(), worst);
  }
  std::printf("overall vs torch %.3g\n", worst_overall);
}

// ----------------------------------------------------------------------------------------------
// Config: defaults and rejections.

TEST(ConfigTest, FillsDefaultsPerType) {
  auto sgd = CompleteOptimizerConfig(Config("sgd", 0.1));
  ASSERT_TRUE(sgd.ok()) << sgd.status();
  EXPECT_TRUE(sgd->has_momentum());
  EXPECT_EQ(sgd->momentum(), 0);
  EXPECT_FALSE(sgd->has_beta1() || sgd->has_epsilon() || sgd->has_trust_coefficient());

  auto larc = CompleteOptimizerConfig(Config("larc", 0.1));
  ASSERT_TRUE(larc.ok()) << larc.status();
  EXPECT_EQ(larc->momentum(), 0.9);
  EXPECT_EQ(larc->epsilon(), 1e-8);
  EXPECT_EQ(larc->trust_coefficient(), 0.02);
  auto lars = CompleteOptimizerConfig(Config("lars", 0.1));
  ASSERT_TRUE(lars.ok()) << lars.status();
  EXPECT_EQ(lars->momentum(), 0.9);
  EXPECT_EQ(lars->epsilon(), 0);
  EXPECT_TRUE(lars->has_epsilon());
  EXPECT_EQ(lars->trust_coefficient(), 0.001);
  EXPECT_FALSE(lars->has_beta1());

  for (const char* type : {"adam", "adamw"}) {
    auto adam = CompleteOptimizerConfig(Config(type, 0.1));
    ASSERT_TRUE(adam.ok()) << adam.status();
    EXPECT_EQ(adam->beta1(), 0.9);
    EXPECT_EQ(adam->beta2(), 0.999);
    EXPECT_EQ(adam->epsilon(), 1e-8);
    EXPECT_FALSE(adam->has_momentum() || adam->has_trust_coefficient());
  }
  auto lamb = CompleteOptimizerConfig(Config("lamb", 0.1));
  ASSERT_TRUE(lamb.ok()) << lamb.status();
  EXPECT_EQ(lamb->epsilon(), 1e-6);
  EXPECT_EQ(lamb->beta1(), 0.9);
  EXPECT_EQ(lamb->beta2(), 0.999);

  // Set values are kept; the optimizer reports the completed config.
  OptimizerConfig custom = Config("lamb", 0.1);
  custom.set_beta2(0.98);
  auto opt = Make(custom);
  EXPECT_EQ(opt->config().beta2(), 0.98);
  EXPECT_EQ(opt->config().beta1(), 0.9);
}

void ExpectRejected(const OptimizerConfig& c, const std::string& field_and_more) {
  const absl::Status s = Optimizer::Create(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.ShortDebugString();
  EXPECT_NE(s.message().find(field_and_more), std::string::npos)
      << "'" << s.message() << "' lacks '" << field_and_more << "'";
  EXPECT_EQ(ValidateOptimizerConfig(c), s);
  EXPECT_EQ(CompleteOptimizerConfig(c).status(), s);
}

TEST(ConfigTest, RejectsBadFieldsByName) {
  ExpectRejected(Config("adagrad", 0.1), "optimizer.type: unknown optimizer 'adagrad'");
  ExpectRejected(Config("", 0.1), "optimizer.type");
  for (double lr : {0.0, -0.1, std::numeric_limits<double>::infinity(),
                    std::numeric_limits<double>::quiet_NaN()}) {
    ExpectRejected(Config("sgd", lr), "optimizer.learning_rate");
  }
  ExpectRejected(Config("sgd", 0.1, -1), "optimizer.weight_decay");

  OptimizerConfig c = Config("adam", 0.1);
  c.set_beta1(1.5);
  ExpectRejected(c, "optimizer.beta1 must be in [0, 1), got 1.5");
  c = Config("lamb", 0.1);
  c.set_beta2(1.0);
  ExpectRejected(c, "optimizer.beta2 must be in [0, 1), got 1");
  c.set_beta2(-0.1);
  ExpectRejected(c, "optimizer.beta2");

  c = Config("sgd", 0.1);
  c.set_momentum(-0.5);
  ExpectRejected(c, "optimizer.momentum must be in [0, 1), got -0.5");
  c = Config("lars", 0.1);
  c.set_momentum(1.0);
  ExpectRejected(c, "optimizer.momentum");

  c = Config("sgd", 0.1);
  c.set_nesterov(true);
  ExpectRejected(c, "optimizer.nesterov needs optimizer.momentum > 0");
  c = Config("adam", 0.1);
  c.set_nesterov(true);
  ExpectRejected(c, "optimizer.nesterov does not apply");

  c = Config("adamw", 0.1);
  c.set_epsilon(-1e-8);
  ExpectRejected(c, "optimizer.epsilon");
  c.set_epsilon(0);
  ExpectRejected(c, "optimizer.epsilon must be > 0");
  c = Config("lars", 0.1);
  c.set_trust_coefficient(0);
  ExpectRejected(c, "optimizer.trust_coefficient");
  c = Config("larc", 0.1);
  c.set_trust_coefficient(-0.02);
  ExpectRejected(c, "optimizer.trust_coefficient");

  c = Config("lamb", 0.1);
  c.add_exclude_from_weight_decay("bias");
  c.add_exclude_from_weight_decay("(unclosed");
  ExpectRejected(c, "optimizer.exclude_from_weight_decay[1]: '(unclosed' is not a regular");
  c = Config("lars", 0.1);
  c.add_exclude_from_layer_adaptation("[z-a]");
  ExpectRejected(c, "optimizer.exclude_from_layer_adaptation[0]");

  c = Config("sgd", 0.1);
  c.set_clip_global_norm(-1);
  ExpectRejected(c, "optimizer.clip_global_norm");
}

TEST(ConfigTest, RejectsFieldsThatDoNotApply) {
  OptimizerConfig c = Config("adam", 0.1);
  c.set_momentum(0.9);
  ExpectRejected(c, "optimizer.momentum does not apply to optimizer type 'adam'");
  c = Config("sgd", 0.1);
  c.set_beta1(0.9);
  ExpectRejected(c, "optimizer.beta1 does not apply");
  c = Config("sgd", 0.1);
  c.set_epsilon(1e-8);
  ExpectRejected(c, "optimizer.epsilon does not apply");
  c = Config("lamb", 0.1);
  c.set_trust_coefficient(0.001);
  ExpectRejected(c, "optimizer.trust_coefficient does not apply");
  c = Config("adamw", 0.1);
  c.add_exclude_from_layer_adaptation("bias");
  ExpectRejected(c, "optimizer.exclude_from_layer_adaptation does not apply");
}

TEST(ConfigTest, CompletedConfigIsValidAndStable) {
  for (const char* type : {"sgd", "adam", "adamw", "lars", "lamb"}) {
    auto once = CompleteOptimizerConfig(Config(type, 0.1, 0.01));
    ASSERT_TRUE(once.ok()) << type << ": " << once.status();
    auto twice = CompleteOptimizerConfig(*once);
    ASSERT_TRUE(twice.ok()) << type << ": " << twice.status();
    EXPECT_EQ(once->SerializeAsString(), twice->SerializeAsString()) << type;
  }
}

// ----------------------------------------------------------------------------------------------
// State save/load.

TEST(StateTest, RoundTripContinuesBitIdentically) {
  for (const RandomCase& rc : RandomCases()) {
    SCOPED_TRACE(rc.label);
    auto opt = Make(rc.config);
    ASSERT_NE(opt, nullptr);
    constexpr int64_t kN = 5000;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(kN);
    for (float& x : w) x = normal(rng);
    std::vector<std::vector<float>> grads(8, std::vector<float>(kN));
    for (auto& g : grads) {
      for (float& x : g) x = normal(rng);
    }
    // Never saved.
    std::vector<float> straight = w;
    TensorOptimizerState s1;
    for (const auto& g : grads) opt->Update(rc.lr, g, absl::MakeSpan(straight), kFull, &s1);
    // Saved after 4 steps, through the wire form, and restored into a new state.
    std::vector<float> resumed = w;
    TensorOptimizerState s2;
    for (int t = 0; t < 4; ++t) opt->Update(rc.lr, grads[t], absl::MakeSpan(resumed), kFull, &s2);
    TensorOptimizerStateProto saved;
    ASSERT_TRUE(
        saved.ParseFromString(SaveOptimizerState(rc.config.type(), s2).SerializeAsString()));
    EXPECT_EQ(saved.optimizer(), rc.config.type());
    EXPECT_EQ(saved.step(), 4);
    auto loaded = LoadOptimizerState(saved, rc.config.type(), kN);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->step, 4);
    EXPECT_EQ(loaded->slot1, s2.slot1);
    EXPECT_EQ(loaded->slot2, s2.slot2);
    TensorOptimizerState s3 = std::move(*loaded);
    for (int t = 4; t < 8; ++t) opt->Update(rc.lr, grads[t], absl::MakeSpan(resumed), kFull, &s3);
    EXPECT_EQ(std::memcmp(resumed.data(), straight.data(), kN * sizeof(float)), 0);
    EXPECT_EQ(s3.slot1, s1.slot1);
    EXPECT_EQ(s3.slot2, s1.slot2);
    EXPECT_EQ(s3.step, 8);
  }
}

TEST(StateTest, FreshStateRoundTrips) {
  auto loaded = LoadOptimizerState(SaveOptimizerState("adam", TensorOptimizerState()), "adam", 10);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 0);
  EXPECT_TRUE(loaded->slot1.empty() && loaded->slot2.empty());
}

TEST(StateTest, RejectsWrongTypeOrSize) {
  TensorOptimizerState s;
  s.step = 3;
  s.slot1.assign(10, 0.5f);
  s.slot2.assign(10, 0.25f);
  const TensorOptimizerStateProto adam = SaveOptimizerState("adam", s);

  absl::Status st = LoadOptimizerState(adam, "lamb", 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'adam', not 'lamb'"), std::string::npos) << st;

  st = LoadOptimizerState(adam, "adam", 11).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("slot1 has 40 bytes, expected 44"), std::string::npos) << st;

  TensorOptimizerStateProto bad = adam;
  bad.mutable_slot2()->resize(39);
  st = LoadOptimizerState(bad, "adam", 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("slot2"), std::string::npos) << st;

  bad = adam;
  bad.clear_slot2();
  st = LoadOptimizerState(bad, "adam", 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lacks its moment buffers"), std::string::npos) << st;

  bad = adam;
  bad.set_step(-1);
  EXPECT_EQ(LoadOptimizerState(bad, "adam", 10).status().code(),
            absl::StatusCode::kInvalidArgument);

  bad = adam;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&(*bad.mutable_slot1())[8], &nan, 4);
  st = LoadOptimizerState(bad, "adam", 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("non-finite"), std::string::npos) << st;

  // sgd keeps no second moment.
  TensorOptimizerState sgd_state = s;
  st = LoadOptimizerState(SaveOptimizerState("sgd", sgd_state), "sgd", 10).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  sgd_state.slot2.clear();
  EXPECT_TRUE(LoadOptimizerState(SaveOptimizerState("sgd", sgd_state), "sgd", 10).ok());
  sgd_state.slot1.clear();  // momentum 0 keeps no buffer at all
  EXPECT_TRUE(LoadOptimizerState(SaveOptimizerState("sgd", sgd_state), "sgd", 10).ok());
}

// ----------------------------------------------------------------------------------------------
// ClipByGlobalNorm.

TEST(ClipTest, ScalesToTheBoundAndReturnsThePreClipNorm) {
  std::vector<float> a = {3.0f, 0.0f}, b = {4.0f};
  const std::vector<absl::Span<float>> grads = {absl::MakeSpan(a), absl::MakeSpan(b)};
  EXPECT_DOUBLE_EQ(ClipByGlobalNorm(grads, 1.0), 5.0);
  EXPECT_FLOAT_EQ(a[0], 0.6f);
  EXPECT_EQ(a[1], 0.0f);
  EXPECT_FLOAT_EQ(b[0], 0.8f);
  // The clipped norm is the bound, to float rounding.
  EXPECT_NEAR(ClipByGlobalNorm(grads, 1.0), 1.0, 1e-6);
}

TEST(ClipTest, LeavesSmallGradientsBitIdentical) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(10000), b(77);
  for (float& x : a) x = normal(rng);
  for (float& x : b) x = normal(rng);
  const std::vector<float> a0 = a, b0 = b;
  const std::vector<absl::Span<float>> grads = {absl::MakeSpan(a), absl::MakeSpan(b)};
  double expected = 0;
  for (float x : a0) expected += double{x} * x;
  for (float x : b0) expected += double{x} * x;
  expected = std::sqrt(expected);
  // Squares are summed in float lanes of at most 128 terms per block (optimizer.cc, SumSquares):
  // well within 1e-6 of the double sum, and the norm only decides whether and how much to scale.
  EXPECT_NEAR(ClipByGlobalNorm(grads, 1e6), expected, 1e-6 * expected);
  EXPECT_EQ(a, a0);
  EXPECT_EQ(b, b0);
  // Exactly at the bound is not above it.
  std::vector<float> c = {3.0f, 4.0f};
  const std::vector<absl::Span<float>> exact = {absl::MakeSpan(c)};
  EXPECT_EQ(ClipByGlobalNorm(exact, 5.0), 5.0);
  EXPECT_EQ(c, std::vector<float>({3.0f, 4.0f}));
}

TEST(ClipTest, LargeTensorsScaleToTheBound) {
  std::vector<float> a(100000, 1.0f);  // norm sqrt(1e5)
  const std::vector<absl::Span<float>> grads = {absl::MakeSpan(a)};
  EXPECT_NEAR(ClipByGlobalNorm(grads, 2.0), std::sqrt(1e5), 1e-9);
  EXPECT_NEAR(ClipByGlobalNorm(grads, 2.0), 2.0, 2e-6);
}

TEST(ClipTest, NoGradientsHaveNormZero) { EXPECT_EQ(ClipByGlobalNorm({}, 1.0), 0.0); }

}  // namespace
}  // namespace rubato
