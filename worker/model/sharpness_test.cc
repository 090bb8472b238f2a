#include "worker/model/sharpness.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

// f(x) = c + sum_i a_i x_i^2 / 2 over every weight of every tensor (a_i from `curvature`).
struct Quadratic {
  std::vector<std::vector<double>> a;
  double c = 0.5;
  int calls = 0;
  absl::StatusOr<double> operator()(absl::Span<const std::vector<float>> x,
                                    std::vector<std::vector<float>>* grads) {
    ++calls;
    grads->resize(x.size());
    double f = c;
    for (size_t t = 0; t < x.size(); ++t) {
      (*grads)[t].resize(x[t].size());
      for (size_t i = 0; i < x[t].size(); ++i) {
        f += 0.5 * a[t][i] * x[t][i] * x[t][i];
        (*grads)[t][i] = static_cast<float>(a[t][i] * x[t][i]);
      }
    }
    return f;
  }
};

TEST(SharpnessTest, ConvexQuadraticMatchesTheClosedForm) {
  // On a convex separable quadratic the box's maximum is the corner away from 0 in every
  // coordinate: f_max = c + sum_i a_i (|x_i| + eps (|x_i| + 1))^2 / 2.
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> curvature(0.1, 50.0);
  std::normal_distribution<float> weight(0.0f, 0.7f);
  std::vector<std::vector<float>> x = {std::vector<float>(300), std::vector<float>(17)};
  Quadratic q;
  for (auto& t : x) {
    q.a.emplace_back();
    for (float& v : t) {
      v = weight(rng);
      q.a.back().push_back(curvature(rng));
    }
  }
  x[1][3] = 0.0f;  // A zero weight (a bias, say): flat in its direction at x, still maximised.
  for (double eps : {1e-3, 5e-4, 0.05}) {
    double f = q.c, f_max = q.c;
    for (size_t t = 0; t < x.size(); ++t) {
      for (size_t i = 0; i < x[t].size(); ++i) {
        const double xi = x[t][i], b = eps * (std::fabs(xi) + 1);
        f += 0.5 * q.a[t][i] * xi * xi;
        f_max += 0.5 * q.a[t][i] * (std::fabs(xi) + b) * (std::fabs(xi) + b);
      }
    }
    const double expected = 100 * (f_max - f) / (1 + f);
    absl::StatusOr<SharpnessResult> r = EpsilonSharpness(x, std::ref(q), {eps, 5});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->loss, f, 1e-9 * f);
    EXPECT_NEAR(r->max_loss, f_max, 1e-5 * f_max) << "eps " << eps;
    EXPECT_NEAR(r->sharpness, expected, 1e-4 * expected + 1e-9) << "eps " << eps;
    EXPECT_EQ(r->best_step, 1);  // The first step lands on the corner; later ones stay there.
  }
  EXPECT_EQ(q.calls, 3 * 6);  // f(x) and one evaluation per step.
}

TEST(SharpnessTest, ALocalSearchNeverOverstatesTheMaximum) {
  // A saddle: convex in x0, concave in x1 (a = -4), whose maximum over the box in x1 is at
  // x1 + y1 = 0 when the box reaches 0. Ascent gets close from below, never above.
  Quadratic q;
  q.a = {{2.0, -4.0}};
  q.c = 1.0;
  const std::vector<std::vector<float>> x = {{1.0f, 0.004f}};
  const double eps = 0.01;  // b = (0.02, 0.01004): x1 = 0.004 is inside the box.
  const double f = 1.0 + 0.5 * 2 * 1 - 0.5 * 4 * 0.004 * 0.004;
  const double f_max = 1.0 + 0.5 * 2 * (1.02 * 1.02);  // x0 at its corner, x1 at 0.
  absl::StatusOr<SharpnessResult> r = EpsilonSharpness(x, std::ref(q), {eps, 20});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->loss, f, 1e-6);
  EXPECT_LE(r->max_loss, f_max + 1e-6);
  EXPECT_GT(r->max_loss - f, 0.99 * (f_max - f));
}

TEST(SharpnessTest, BadOptionsAndLossErrorsAreErrors) {
  Quadratic q;
  q.a = {{1.0}};
  const std::vector<std::vector<float>> x = {{1.0f}};
  EXPECT_EQ(EpsilonSharpness(x, std::ref(q), {0.0, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpsilonSharpness(x, std::ref(q), {NAN, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpsilonSharpness(x, std::ref(q), {1e-3, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  int calls = 0;
  LossAndGradient failing = [&](absl::Span<const std::vector<float>>,
                                std::vector<std::vector<float>>* g) -> absl::StatusOr<double> {
    g->assign(1, std::vector<float>(1, 1.0f));
    if (++calls == 3) return absl::InvalidArgumentError("loss is not finite");
    return 1.0;
  };
  absl::StatusOr<SharpnessResult> r = EpsilonSharpness(x, failing, {1e-3, 5});
  EXPECT_EQ(r.status().message(), "loss is not finite");
}

}  // namespace
}  // namespace rubato
