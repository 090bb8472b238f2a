#include "common/update_guard.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

OptimizerConfig Config(const std::string& type, double lr) {
  OptimizerConfig c;
  c.set_type(type);
  c.set_learning_rate(lr);
  if (type == "sgd") c.set_momentum(0.9);
  if (type == "sgd_plain") {
    c.set_type("sgd");
  }
  if (type == "sgd_nesterov") {
    c.set_type("sgd");
    c.set_momentum(0.9);
    c.set_nesterov(true);
  }
  c.set_weight_decay(1e-4);
  return c;
}

std::unique_ptr<Optimizer> Make(const std::string& type, double lr = 0.1) {
  auto made = Optimizer::Create(Config(type, lr));
  EXPECT_TRUE(made.ok()) << made.status();
  return std::move(*made);
}

const char* const kTypes[] = {"sgd_plain", "sgd",   "sgd_nesterov", "adam",
                              "adamw",     "lamb", "lars",         "larc"};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// In ordinary training the guard neither copies nor changes a bit of what Update computes.
TEST(UpdateGuardTest, OrdinaryTrainingIsUpdateItselfWithoutCopies) {
  for (const char* type : kTypes) {
    SCOPED_TRACE(type);
    auto opt = Make(type);
    TensorRole role;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> w(10000), g(w.size());
    for (float& x : w) x = 0.05f * normal(rng);
    std::vector<float> plain = w;
    TensorOptimizerState plain_state, guarded_state;
    UpdateGuard guard;
    for (int step = 0; step < 300; ++step) {
      for (float& x : g) x = normal(rng);
      const double bound = MaxAbs(g);
      opt->Update(0.1f, g, absl::MakeSpan(plain), role, &plain_state);
      ASSERT_TRUE(guard.Update(*opt, 0.1f, g, bound, absl::MakeSpan(w), role, &guarded_state,
                               nullptr));
    }
    EXPECT_TRUE(SameBits(w, plain));
    EXPECT_TRUE(SameBits(guarded_state.slot1, plain_state.slot1));
    EXPECT_TRUE(SameBits(guarded_state.slot2, plain_state.slot2));
    EXPECT_EQ(guarded_state.step, 300);
    EXPECT_EQ(guard.copied(), 0);
    // The first update measures (nothing is known yet); more do as bounds grow loose: at worst
    // (adam's L2 term over eps, LAMB's and LARS's trust ratio over sqrt(n)) every few updates.
    EXPECT_GE(guard.measured(), 1);
    EXPECT_LE(guard.measured(), 300 / 4);
    std::printf("%s: measured %lld of 300 updates\n", type,
                static_cast<long long>(guard.measured()));
  }
}

// The case: finite values near -FLT_MAX push weights to Inf; refused, nothing changed.
TEST(UpdateGuardTest, AnUpdateThatWouldOverflowIsRefusedWithNothingChanged) {
  for (const char* type : kTypes) {
    SCOPED_TRACE(type);
    auto opt = Make(type, 1.0);
    // With a trust ratio, LARS and LARC scale a huge gradient down to nothing (a finite update).
    TensorRole role;
    role.layer_adaptation = false;
    std::vector<float> w = {0.5f, -0.25f, 1.0f, 2.0f};
    std::vector<float> g = {0.1f, 0.1f, -0.1f, 0.2f};
    TensorOptimizerState state;
    UpdateGuard guard;
    ASSERT_TRUE(guard.Update(*opt, 1.0f, g, MaxAbs(g), absl::MakeSpan(w), role, &state, nullptr));
    const std::vector<float> w_before = w;
    const TensorOptimizerState state_before = state;
    // Adam and LAMB: g^2 overflows v (their weights move by about lr whatever g is). The others:
    // the weights themselves.
    std::vector<float> huge = {-3.4e38f, -3.4e38f, 1e30f, -3.3e38f};
    EXPECT_FALSE(guard.Update(*opt, 10.0f, huge, MaxAbs(huge), absl::MakeSpan(w), role, &state,
                              nullptr));
    EXPECT_TRUE(SameBits(w, w_before));
    EXPECT_TRUE(SameBits(state.slot1, state_before.slot1));
    EXPECT_TRUE(SameBits(state.slot2, state_before.slot2));
    EXPECT_EQ(state.step, state_before.step);
    EXPECT_EQ(guard.copied(), 1);
    // And the tensor trains on afterwards.
    EXPECT_TRUE(guard.Update(*opt, 1.0f, g, MaxAbs(g), absl::MakeSpan(w), role, &state, nullptr));
    EXPECT_EQ(state.step, state_before.step + 1);
  }
}

// A large but harmless update goes through (the guard copies, checks, and keeps it).
TEST(UpdateGuardTest, AnUpdateTheBoundCannotClearIsKeptWhenItStaysFinite) {
  auto opt = Make("sgd_plain", 1.0);
  TensorRole role;
  role.weight_decay = false;
  std::vector<float> w = {1.0f, 2.0f};
  std::vector<float> g = {-2e37f, 3.0f};  // bound 2e37 > kSafeMagnitude, result 2e37
  TensorOptimizerState state;
  UpdateGuard guard;
  ASSERT_TRUE(guard.Update(*opt, 1.0f, g, MaxAbs(g), absl::MakeSpan(w), role, &state, nullptr));
  EXPECT_EQ(guard.copied(), 1);
  EXPECT_TRUE(AllFinite(w));
  EXPECT_FLOAT_EQ(w[0], 2e37f);
  EXPECT_FLOAT_EQ(w[1], -1.0f);
}

// The bounds themselves, over magnitudes spread across float's range: whenever UpdateBound says an
// update is safe, every weight and slot Update writes is finite and within the bounds it gave.
// (A bound that missed a case would let an overflow through unchecked.)
TEST(UpdateGuardTest, BoundsHoldOverRandomMagnitudes) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-30, 38.5);
  std::uniform_real_distribution<float> unit(-1, 1);
  int safe = 0;
  int unsafe = 0;
  for (const char* type : kTypes) {
    auto opt = Make(type);
    for (int trial = 0; trial < 400; ++trial) {
      SCOPED_TRACE(std::string(type) + " trial " + std::to_string(trial));
      const int n = 1 + static_cast<int>(rng() % 300);
      const double wmag = std::pow(10.0, exponent(rng));
      const double gmag = std::pow(10.0, exponent(rng));
      const float lr = static_cast<float>(std::pow(10.0, exponent(rng) / 4));
      std::vector<float> w(n), g(n);
      for (float& x : w) x = static_cast<float>(unit(rng) * wmag);
      for (float& x : g) x = static_cast<float>(unit(rng) * gmag);
      if (trial % 5 == 0) g.assign(n, 0.0f);  // zero norms: no trust ratio
      if (trial % 7 == 0) g[0] = static_cast<float>(1e-30 * unit(rng));
      if (!AllFinite(w) || !AllFinite(g)) continue;
      TensorRole role;
      role.layer_adaptation = trial % 3 != 0;
      role.weight_decay = trial % 4 != 0;
      TensorOptimizerState state;
      // Some history in the slots first.
      if (trial % 2 == 0) {
        std::vector<float> w0 = w;
        std::vector<float> g0(n);
        for (float& x : g0) x = unit(rng);
        opt->Update(0.01f, g0, absl::MakeSpan(w0), role, &state);
        if (!AllFinite(state.slot1) || !AllFinite(state.slot2)) continue;
      }
      Magnitudes before;
      before.grad = MaxAbs(g);
      before.weights = MaxAbs(w);
      before.slot1 = MaxAbs(state.slot1);
      before.slot2 = MaxAbs(state.slot2);
      Magnitudes after;
      const double bound =
          UpdateBound(opt->config(), lr, n, role, state.step, before, &after);
      if (!(bound < kSafeMagnitude)) {
        ++unsafe;
        continue;
      }
      ++safe;
      opt->Update(lr, g, absl::MakeSpan(w), role, &state);
      ASSERT_TRUE(AllFinite(w) && AllFinite(state.slot1) && AllFinite(state.slot2))
          << "bound " << bound;
      EXPECT_LE(MaxAbs(w), after.weights * (1 + 1e-5) + 1e-30);
      EXPECT_LE(MaxAbs(state.slot1), after.slot1 * (1 + 1e-5) + 1e-30);
      EXPECT_LE(MaxAbs(state.slot2), after.slot2 * (1 + 1e-5) + 1e-30);
    }
  }
  // Both kinds were tried.
  EXPECT_GT(safe, 500);
  EXPECT_GT(unsafe, 200);
}

TEST(UpdateGuardTest, MaxAbsSeesNaNAndInf) {
  EXPECT_EQ(MaxAbs({}), 0);
  EXPECT_EQ(MaxAbs(std::vector<float>{1.0f, -3.0f, 2.0f}), 3.0);
  EXPECT_TRUE(std::isinf(MaxAbs(std::vector<float>{1.0f, NAN})));
  EXPECT_TRUE(std::isinf(MaxAbs(std::vector<float>{-INFINITY, 0.0f})));
}

}  // namespace
}  // namespace rubato
