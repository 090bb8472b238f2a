#include "server/noise_scale.h"

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/lr_schedule.h"
#include "common/tensor_wire.h"
#include "gtest/gtest.h"
#include "server/aggregator_test_context.h"
#include "server/tensor_aggregator.h"

namespace rubato {
namespace {

TEST(NoiseScaleTest, TermsAreExactOnTheExpectations) {
  // E|G_B|^2 = |G|^2 + tr/B: with |G|^2 = 2, tr = 64, B = 8, n = 4 the expectations are
  // small = 2 + 8 = 10 and big = 2 + 2 = 4, and the estimators return |G|^2 and tr/B exactly.
  const NoiseTerms t = EstimateNoiseTerms(4, 10.0, 4.0);
  EXPECT_DOUBLE_EQ(t.g2, 2.0);
  EXPECT_DOUBLE_EQ(t.trace_over_batch, 8.0);
  EXPECT_EQ(t.workers, 4);
  const NoiseTerms one = EstimateNoiseTerms(1, 10.0, 10.0);
  EXPECT_EQ(one.workers, 1);
  EXPECT_EQ(one.g2, 0);
}

TEST(NoiseScaleTest, MovingAveragesAreBiasCorrected) {
  NoiseScaleEma ema(0.9);
  ema.Add(4.0, 40.0);
  EXPECT_DOUBLE_EQ(ema.g2(), 4.0);  // Not 0.4: the first value stands for itself.
  EXPECT_DOUBLE_EQ(ema.trace(), 40.0);
  ema.Add(2.0, 20.0);
  // (0.9 * 0.4 + 0.1 * 2) / (1 - 0.81) = 0.56 / 0.19.
  EXPECT_NEAR(ema.g2(), 0.56 / 0.19, 1e-12);
  EXPECT_EQ(ema.steps(), 2);
}

TEST(NoiseScaleTest, MonitorSumsTensorsAndMeasuresStepsInOrder) {
  NoiseScaleMonitor m(3, 0.0);  // Decay 0: the averages are the newest step.
  m.SetTensors(2);
  m.SetBatch(16);
  EXPECT_EQ(m.Stats().step(), -1);
  m.Add(5, {1.0, 2.0, 4});
  EXPECT_EQ(m.Stats().step(), -1);  // Half the tensors.
  m.Add(6, {10.0, 20.0, 4});        // Step 6 before step 5 is complete: waits.
  m.Add(6, {10.0, 20.0, 4});
  EXPECT_EQ(m.Stats().step(), -1);
  m.Add(5, {3.0, 1.0, 3});
  NoiseScaleStats s = m.Stats();
  EXPECT_EQ(s.step(), 6);
  EXPECT_EQ(s.shard_id(), 3);
  EXPECT_DOUBLE_EQ(s.g2(), 20.0);
  EXPECT_DOUBLE_EQ(s.trace(), 40.0 * 16);
  EXPECT_EQ(s.steps(), 2);
  EXPECT_EQ(s.workers(), 4);
  EXPECT_EQ(s.batch_small(), 16);
  m.Add(5, {1.0, 1.0, 4});  // Late: passed over.
  EXPECT_EQ(m.Stats().steps(), 2);
  // A step where one tensor's mean was of a single gradient measures nothing.
  m.Add(7, {1.0, 1.0, 4});
  m.Add(7, EstimateNoiseTerms(1, 1.0, 1.0));
  EXPECT_EQ(m.Stats().step(), 6);
  m.Add(8, {1.0, 1.0, 2});
  m.Add(8, {1.0, 1.0, 2});
  EXPECT_EQ(m.Stats().step(), 8);
  EXPECT_EQ(m.Stats().workers(), 2);
  // A step whose squares overflowed is passed over, and the averages stay finite.
  m.Add(9, {INFINITY, 1.0, 2});
  m.Add(9, {1.0, -INFINITY, 2});
  EXPECT_EQ(m.Stats().step(), 8);
  EXPECT_TRUE(std::isfinite(m.Stats().g2_ema()));
  // Workers with different batches: B_small is not defined; the stats say so.
  m.SetBatch(32);
  EXPECT_EQ(m.Stats().batch_small(), 0);
}

TEST(NoiseScaleTest, StepsThatNeverCompleteArePassedOver) {
  NoiseScaleMonitor m(0, 0.5);
  m.SetTensors(2);
  m.SetBatch(1);
  m.Add(0, {1.0, 1.0, 2});  // Tensor B never gives step 0.
  for (int64_t step = 1; step <= 20; ++step) {
    m.Add(step, {1.0, 1.0, 2});
    m.Add(step, {1.0, 1.0, 2});
  }
  EXPECT_EQ(m.Stats().step(), 20);
  EXPECT_GE(m.Stats().steps(), 20 - 16);
}

// A bsp tensor fed through TensorAggregator, so that the server's own sums are what is tested;
// its terms go to `monitor`.
struct BspTensor : AggregatorTestContext {
  BspTensor(int workers, int64_t elements, NoiseScaleMonitor* monitor)
      : AggregatorTestContext(
            [] {
              ConsistencyConfig c;
              c.set_mode(BSP);
              return c;
            }(),
            workers, 1e-9, 1000),
        tensor("t", {elements}, std::vector<float>(elements, 0.0f), TensorRole(), workers) {
    ctx.noise = monitor;
  }
  // One step's gradients, in reverse worker order (so that most are held).
  void Step(int64_t step, const std::vector<std::vector<float>>& g) {
    Released released;
    for (int w = static_cast<int>(g.size()) - 1; w >= 0; --w) {
      const std::string bytes(reinterpret_cast<const char*>(g[w].data()), g[w].size() * 4);
      ByteChunks chunks(bytes);
      GradientOutcome outcome;
      tensor.Add(ctx, w, step, {&chunks, nullptr, nullptr}, &outcome, &released);
      EXPECT_EQ(outcome.applied, w == 0) << "worker " << w;
    }
  }
  TensorAggregator tensor;
};

TEST(NoiseScaleTest, AggregatorTermsMatchADoubleComputation) {
  // Decay 0 and B = 1: the monitor's figures are the step's terms themselves.
  NoiseScaleMonitor monitor(0, 0.0);
  monitor.SetTensors(1);
  monitor.SetBatch(1);
  BspTensor t(3, 1001, &monitor);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> g(3, std::vector<float>(1001));
    for (auto& v : g) {
      for (float& x : v) x = 0.3f + normal(rng);
    }
    double small = 0, big = 0;
    for (size_t j = 0; j < 1001; ++j) {
      double sum = 0;
      for (const auto& v : g) {
        small += static_cast<double>(v[j]) * v[j] / 3;
        sum += v[j];
      }
      big += (sum / 3) * (sum / 3);
    }
    const NoiseTerms expected = EstimateNoiseTerms(3, small, big);
    t.Step(step, g);
    const std::optional<NoiseScaleStats> s = monitor.StatsAt(step);
    ASSERT_TRUE(s.has_value()) << step;
    EXPECT_EQ(t.tensor.version(), step + 1);
    EXPECT_NEAR(s->g2(), expected.g2, 1e-5 * std::fabs(small));
    EXPECT_NEAR(s->trace(), expected.trace_over_batch, 1e-5 * std::fabs(small));
    EXPECT_EQ(s->workers(), 3);
  }
  // async applies each gradient alone: no terms.
  ConsistencyConfig async;
  async.set_mode(ASYNC);
  const std::unique_ptr<ConsistencyPolicy> async_policy = *ConsistencyPolicy::Create(async);
  t.ctx.policy = async_policy.get();
  Released released;
  const std::string bytes(1001 * 4, '\0');
  ByteChunks chunks(bytes);
  GradientOutcome outcome;
  t.tensor.Add(t.ctx, 0, 3, {&chunks, nullptr, nullptr}, &outcome, &released);
  EXPECT_TRUE(outcome.applied);
  EXPECT_EQ(monitor.Stats().step(), 2);
  EXPECT_EQ(monitor.Stats().steps(), 3);
}

// Synthetic gradients with a known |G|^2 and tr(Sigma): each worker's gradient of a batch of B is
// G + e, e_j ~ N(0, v_j / B) independently. The estimators (through two real bsp tensors and a
// monitor) must be unbiased, their step-to-step spread must be what noise_scale.h says, and the
// moving averages' B_simple must land near the true one.
TEST(NoiseScaleTest, RecoversAKnownNoiseScaleOnSyntheticGradients) {
  constexpr int kWorkers = 4;
  constexpr int kBatch = 32;
  constexpr int kSteps = 400;
  const std::vector<int64_t> sizes = {3000, 1096};
  const int64_t d = sizes[0] + sizes[1];
  std::vector<double> G(d), var(d);
  double g2 = 0, trace = 0;
  for (int64_t j = 0; j < d; ++j) {
    G[j] = 0.05 * std::sin(0.37 * j);
    var[j] = 0.5 + (j % 3);  // Per-example variance of coordinate j.
    g2 += G[j] * G[j];
    trace += var[j];
  }
  // Scale the noise so that B_simple = tr/|G|^2 = 8 B: the noise dominates, as in training.
  const double scale = 8.0 * kBatch * g2 / trace;
  for (double& v : var) v *= scale;
  trace *= scale;
  const double b_simple = trace / g2;
  ASSERT_NEAR(b_simple, 8.0 * kBatch, 1e-9);

  NoiseScaleMonitor monitor(0, 0.95);
  monitor.SetTensors(2);
  monitor.SetBatch(kBatch);
  std::vector<std::unique_ptr<BspTensor>> tensors;
  for (int64_t n : sizes) tensors.push_back(std::make_unique<BspTensor>(kWorkers, n, &monitor));
  std::mt19937_64 rng(2024);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g2_steps, trace_steps;
  for (int64_t step = 0; step < kSteps; ++step) {
    int64_t offset = 0;
    for (size_t k = 0; k < tensors.size(); ++k) {
      std::vector<std::vector<float>> g(kWorkers, std::vector<float>(sizes[k]));
      for (auto& v : g) {
        for (int64_t j = 0; j < sizes[k]; ++j) {
          v[j] =
              static_cast<float>(G[offset + j] + std::sqrt(var[offset + j] / kBatch) * normal(rng));
        }
      }
      tensors[k]->Step(step, g);
      offset += sizes[k];
    }
    // Both tensors' terms, summed by the monitor.
    const std::optional<NoiseScaleStats> s = monitor.StatsAt(step);
    ASSERT_TRUE(s.has_value()) << step;
    g2_steps.push_back(s->g2());
    trace_steps.push_back(s->trace());
  }
  auto mean_sd = [](const std::vector<double>& x) {
    double m = 0, s = 0;
    for (double v : x) m += v;
    m /= x.size();
    for (double v : x) s += (v - m) * (v - m);
    return std::make_pair(m, std::sqrt(s / (x.size() - 1)));
  };
  // The spreads noise_scale.h gives, with sigma_j^2 = v_j / B per coordinate and n workers.
  double sum_g2_sigma2 = 0, sum_sigma4 = 0;
  for (int64_t j = 0; j < d; ++j) {
    const double s2 = var[j] / kBatch;
    sum_g2_sigma2 += G[j] * G[j] * s2;
    sum_sigma4 += s2 * s2;
  }
  const double n = kWorkers;
  const double g2_sd = std::sqrt(4 * sum_g2_sigma2 / n + 2 * sum_sigma4 / (n * (n - 1)));
  const double trace_sd = std::sqrt(2.0 * kBatch * kBatch * sum_sigma4 / (n - 1));
  const auto [g2_mean, g2_spread] = mean_sd(g2_steps);
  const auto [trace_mean, trace_spread] = mean_sd(trace_steps);
  // Unbiased: the mean of 400 steps within 4 standard errors of the truth.
  EXPECT_NEAR(g2_mean, g2, 4 * g2_sd / std::sqrt(kSteps));
  EXPECT_NEAR(trace_mean, trace, 4 * trace_sd / std::sqrt(kSteps));
  // The spread of one step's estimates, as derived (the sample sd of 400 is within ~4% of it).
  EXPECT_NEAR(g2_spread / g2_sd, 1.0, 0.2);
  EXPECT_NEAR(trace_spread / trace_sd, 1.0, 0.2);
  EXPECT_FALSE(monitor.StatsAt(kSteps - 1 - NoiseScaleMonitor::kHistory).has_value());
  // One step's B_simple is far off (|G|^2's relative error is about 8x sqrt(2/(d n (n-1))) plus
  // its cross term); the moving averages' ratio is close.
  const NoiseScaleStats stats = monitor.Stats();
  EXPECT_EQ(stats.step(), kSteps - 1);
  EXPECT_EQ(stats.steps(), kSteps);
  EXPECT_EQ(stats.workers(), kWorkers);
  const double measured = stats.trace_ema() / stats.g2_ema();
  // About 39 steps averaged: g2's relative error ~ (g2_sd / g2) / sqrt(39) ~ 1%; allow 5%.
  EXPECT_NEAR(measured / b_simple, 1.0, 0.05)
      << "B_simple measured " << measured << ", true " << b_simple << "; one step's g2 sd is "
      << g2_sd / g2 << " of g2";
}

}  // namespace
}  // namespace rubato
