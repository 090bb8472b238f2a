#include "worker/straggler_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

StragglerModel MakeOrDie(const StragglerOptions& options, int worker_id = 0) {
  auto model = StragglerModel::Create(options, worker_id);
  EXPECT_TRUE(model.ok()) << model.status();
  return *std::move(model);
}

StragglerOptions RandomOptions(DelayDistribution distribution, double p, double mean_ms) {
  StragglerOptions o;
  o.delay_distribution = distribution;
  o.delay_probability = p;
  o.delay_mean_ms = mean_ms;
  return o;
}

std::vector<double> RandomDelaysMs(const StragglerModel& model, int64_t steps) {
  std::vector<double> out;
  out.reserve(steps);
  for (int64_t s = 0; s < steps; ++s) {
    out.push_back(absl::ToDoubleMilliseconds(model.RandomDelay(s)));
  }
  return out;
}

// Checks that `status` is InvalidArgument and that its message names `flag`.
void ExpectRejected(const absl::Status& status, const std::string& flag) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("--" + flag), absl::string_view::npos) << status;
}

// ---- Defaults.

TEST(StragglerModelTest, DefaultsInjectNothing) {
  StragglerModel model = MakeOrDie(StragglerOptions());
  EXPECT_FALSE(model.enabled());
  EXPECT_EQ(model.Describe(), "none");
  for (int64_t s = 0; s < 100; ++s) {
    EXPECT_EQ(model.DelayFor(s, absl::Milliseconds(3)), absl::ZeroDuration());
    EXPECT_FALSE(model.CrashAt(s));
  }
}

// ---- Reproducibility.

TEST(StragglerModelTest, SameSeedAndWorkerGiveTheSameSequence) {
  const StragglerOptions o = RandomOptions(DelayDistribution::kExponential, 0.5, 10);
  const std::vector<double> a = RandomDelaysMs(MakeOrDie(o, 3), 1000);
  const std::vector<double> b = RandomDelaysMs(MakeOrDie(o, 3), 1000);
  EXPECT_EQ(a, b);
}

TEST(StragglerModelTest, AStepDrawsTheSameWhateverWasDrawnBefore) {
  // A step's delay depends on the step alone: not on which steps were asked for before it (steps
  // skipped or repeated around a rejoin), nor on the compute times.
  const StragglerOptions o = RandomOptions(DelayDistribution::kLognormal, 0.5, 10);
  StragglerModel in_order = MakeOrDie(o, 1);
  StragglerModel skipping = MakeOrDie(o, 1);
  std::vector<absl::Duration> expected;
  for (int64_t s = 0; s < 200; ++s) expected.push_back(in_order.DelayFor(s, absl::Milliseconds(1)));
  for (int64_t s = 199; s >= 0; s -= 7) {
    EXPECT_EQ(skipping.DelayFor(s, absl::Milliseconds(1)), expected[s]) << "step " << s;
  }
}

TEST(StragglerModelTest, TheBernoulliTrialDoesNotShiftTheDelays) {
  // Every step draws the same number of variates, so a step delayed at p = 0.3 gets the delay it
  // gets at p = 1: the delays do not depend on which earlier steps were delayed.
  const std::vector<double> always =
      RandomDelaysMs(MakeOrDie(RandomOptions(DelayDistribution::kPareto, 1, 10)), 1000);
  const std::vector<double> some =
      RandomDelaysMs(MakeOrDie(RandomOptions(DelayDistribution::kPareto, 0.3, 10)), 1000);
  int delayed = 0;
  for (int i = 0; i < 1000; ++i) {
    if (some[i] > 0) {
      ++delayed;
      EXPECT_EQ(some[i], always[i]) << "step " << i;
    }
  }
  EXPECT_GT(delayed, 200);
  EXPECT_LT(delayed, 400);
}

TEST(StragglerModelTest, DifferentWorkersAndSeedsGiveDifferentSequences) {
  StragglerOptions o = RandomOptions(DelayDistribution::kExponential, 1, 10);
  const std::vector<double> w0 = RandomDelaysMs(MakeOrDie(o, 0), 100);
  const std::vector<double> w1 = RandomDelaysMs(MakeOrDie(o, 1), 100);
  o.seed = 2;
  const std::vector<double> w0_seed2 = RandomDelaysMs(MakeOrDie(o, 0), 100);
  int same_w = 0, same_seed = 0;
  for (int i = 0; i < 100; ++i) {
    same_w += w0[i] == w1[i];
    same_seed += w0[i] == w0_seed2[i];
  }
  EXPECT_EQ(same_w, 0);
  EXPECT_EQ(same_seed, 0);
}

// ---- Distributions: mean M over 100k draws (fixed seed, so this is deterministic).

struct DistributionCase {
  DelayDistribution distribution;
  double sigma;
  double alpha;
};

class StragglerDistributionTest : public ::testing::TestWithParam<DistributionCase> {};

TEST_P(StragglerDistributionTest, EmpiricalMeanIsTheRequestedMean) {
  StragglerOptions o = RandomOptions(GetParam().distribution, 1, 20);
  o.delay_sigma = GetParam().sigma;
  o.delay_alpha = GetParam().alpha;
  const std::vector<double> d = RandomDelaysMs(MakeOrDie(o, 2), 100000);
  double sum = 0, min = std::numeric_limits<double>::infinity();
  for (double x : d) {
    sum += x;
    min = std::min(min, x);
  }
  EXPECT_NEAR(sum / d.size(), 20, 20 * 0.03) << DelayDistributionName(GetParam().distribution);
  EXPECT_GT(min, 0);
  if (GetParam().distribution == DelayDistribution::kPareto) {
    // Nothing below the scale x_m = M (alpha - 1) / alpha.
    EXPECT_GE(min, 20 * (GetParam().alpha - 1) / GetParam().alpha - 1e-9);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Distributions, StragglerDistributionTest,
    ::testing::Values(DistributionCase{DelayDistribution::kExponential, 1.0, 2.5},
                      DistributionCase{DelayDistribution::kLognormal, 1.0, 2.5},
                      DistributionCase{DelayDistribution::kLognormal, 0.25, 2.5},
                      DistributionCase{DelayDistribution::kPareto, 1.0, 2.5},
                      DistributionCase{DelayDistribution::kPareto, 1.0, 4.0}));

TEST(StragglerModelTest, LognormalMedianIsExpOfMu) {
  // mean M = exp(mu + sigma^2 / 2), so the median exp(mu) = M exp(-sigma^2 / 2).
  StragglerOptions o = RandomOptions(DelayDistribution::kLognormal, 1, 20);
  o.delay_sigma = 1.0;
  std::vector<double> d = RandomDelaysMs(MakeOrDie(o), 100001);
  std::nth_element(d.begin(), d.begin() + d.size() / 2, d.end());
  EXPECT_NEAR(d[d.size() / 2], 20 * std::exp(-0.5), 20 * std::exp(-0.5) * 0.03);
}

TEST(StragglerModelTest, DelayProbabilityIsRespected) {
  for (double p : {0.0, 0.1, 0.5, 0.9, 1.0}) {
    const std::vector<double> d =
        RandomDelaysMs(MakeOrDie(RandomOptions(DelayDistribution::kExponential, p, 5)), 100000);
    int delayed = 0;
    for (double x : d) delayed += x > 0;
    EXPECT_NEAR(delayed / 1e5, p, 0.005) << "p=" << p;
  }
}

// ---- Slowdown, floor, pause, crash.

TEST(StragglerModelTest, SlowdownAddsFactorMinusOneTimesCompute) {
  StragglerOptions o;
  o.slowdown = 3;
  StragglerModel model = MakeOrDie(o);
  EXPECT_TRUE(model.enabled());
  EXPECT_EQ(model.DelayFor(0, absl::Milliseconds(10)), absl::Milliseconds(20));
  EXPECT_EQ(model.DelayFor(1, absl::Microseconds(1500)), absl::Microseconds(3000));
  EXPECT_EQ(model.DelayFor(2, absl::ZeroDuration()), absl::ZeroDuration());
  o.slowdown = 1.5;
  EXPECT_EQ(MakeOrDie(o).DelayFor(0, absl::Milliseconds(10)), absl::Milliseconds(5));
}

TEST(StragglerModelTest, FloorPadsShortStepsOnly) {
  StragglerOptions o;
  o.min_step_ms = 5;
  StragglerModel model = MakeOrDie(o);
  EXPECT_EQ(model.DelayFor(0, absl::Milliseconds(2)), absl::Milliseconds(3));
  EXPECT_EQ(model.DelayFor(1, absl::ZeroDuration()), absl::Milliseconds(5));
  EXPECT_EQ(model.DelayFor(2, absl::Milliseconds(5)), absl::ZeroDuration());
  EXPECT_EQ(model.DelayFor(3, absl::Milliseconds(8)), absl::ZeroDuration());
}

TEST(StragglerModelTest, SlowdownMultipliesTheFlooredComputeTime) {
  // The floor stands in for a realistic compute time, which the slowdown then stretches: a 3x
  // worker with a 5 ms floor emulates 15 ms steps however fast the real compute is.
  StragglerOptions o;
  o.min_step_ms = 5;
  o.slowdown = 3;
  StragglerModel model = MakeOrDie(o);
  EXPECT_EQ(model.DelayFor(0, absl::Milliseconds(1)), absl::Milliseconds(14));
  EXPECT_EQ(model.DelayFor(1, absl::Milliseconds(10)), absl::Milliseconds(20));
}

TEST(StragglerModelTest, RandomDelayAddsToComputeDelay) {
  StragglerOptions o = RandomOptions(DelayDistribution::kPareto, 1, 10);
  o.slowdown = 2;
  StragglerModel model = MakeOrDie(o);
  for (int64_t s = 0; s < 20; ++s) {
    EXPECT_EQ(model.DelayFor(s, absl::Milliseconds(4)),
              absl::Milliseconds(4) + model.RandomDelay(s));
  }
}

TEST(StragglerModelTest, PauseOnlyOnceAtItsStep) {
  StragglerOptions o;
  o.pause_at_step = 7;
  o.pause_ms = 250;
  StragglerModel model = MakeOrDie(o);
  for (int64_t s = 0; s < 7; ++s)
    EXPECT_EQ(model.DelayFor(s, absl::Milliseconds(1)), absl::ZeroDuration());
  EXPECT_EQ(model.DelayFor(7, absl::Milliseconds(1)), absl::Milliseconds(250));
  // Step 7 again (after a rejoin): no second pause.
  EXPECT_EQ(model.DelayFor(7, absl::Milliseconds(1)), absl::ZeroDuration());
  for (int64_t s = 8; s < 20; ++s)
    EXPECT_EQ(model.DelayFor(s, absl::Milliseconds(1)), absl::ZeroDuration());
}

TEST(StragglerModelTest, CrashAtItsStepOnly) {
  StragglerOptions o;
  o.crash_at_step = 12;
  StragglerModel model = MakeOrDie(o);
  EXPECT_TRUE(model.enabled());
  for (int64_t s = 0; s < 30; ++s) EXPECT_EQ(model.CrashAt(s), s == 12) << s;
  EXPECT_EQ(model.DelayFor(12, absl::Milliseconds(1)), absl::ZeroDuration());
  o.crash_at_step = 0;
  EXPECT_TRUE(MakeOrDie(o).CrashAt(0));
}

TEST(StragglerModelTest, DescribeNamesEachFault) {
  StragglerOptions o = RandomOptions(DelayDistribution::kPareto, 0.1, 20);
  o.slowdown = 3;
  o.min_step_ms = 5;
  o.crash_at_step = 9;
  EXPECT_EQ(MakeOrDie(o).Describe(),
            "floor 5 ms, slowdown 3, p=0.1 pareto mean 20 ms alpha 2.5 seed 1, crash at step 9");
}

// ---- Bad values, each named.

TEST(StragglerModelTest, RejectsBadValuesNamingTheFlag) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::string flag;
    void (*set)(StragglerOptions*, double);
    std::vector<double> bad;
  };
  const std::vector<Case> cases = {
      {"slowdown", [](StragglerOptions* o, double v) { o->slowdown = v; }, {0.5, 0, -2, nan, inf}},
      {"delay_probability",
       [](StragglerOptions* o, double v) { o->delay_probability = v; },
       {-0.1, 1.01, nan}},
      {"delay_mean_ms",
       [](StragglerOptions* o, double v) { o->delay_mean_ms = v; },
       {-1, nan, inf}},
      {"delay_sigma", [](StragglerOptions* o, double v) { o->delay_sigma = v; }, {-0.5, nan}},
      {"delay_alpha", [](StragglerOptions* o, double v) { o->delay_alpha = v; }, {1, 0.5, -3, nan}},
      {"min_step_ms", [](StragglerOptions* o, double v) { o->min_step_ms = v; }, {-1, nan, inf}},
  };
  for (const Case& c : cases) {
    for (double v : c.bad) {
      StragglerOptions o;
      c.set(&o, v);
      SCOPED_TRACE(c.flag + "=" + std::to_string(v));
      ExpectRejected(ValidateStragglerOptions(o), c.flag);
      ExpectRejected(StragglerModel::Create(o, 0).status(), c.flag);
    }
  }
}

TEST(StragglerModelTest, AcceptsBoundaryValues) {
  StragglerOptions o;
  o.slowdown = 1;
  o.delay_probability = 1;
  o.delay_mean_ms = 0;
  o.delay_sigma = 0;
  o.delay_alpha = 1.0001;
  o.min_step_ms = 0;
  EXPECT_TRUE(ValidateStragglerOptions(o).ok());
  o.delay_probability = 0;
  EXPECT_TRUE(ValidateStragglerOptions(o).ok());
}

TEST(StragglerModelTest, RejectsBadStepFlags) {
  StragglerOptions o;
  o.crash_at_step = -1;
  ExpectRejected(ValidateStragglerOptions(o), "crash_at_step");

  o = StragglerOptions();
  o.pause_at_step = -3;
  o.pause_ms = 10;
  ExpectRejected(ValidateStragglerOptions(o), "pause_at_step");

  o = StragglerOptions();
  o.pause_at_step = 3;
  o.pause_ms = -10;
  ExpectRejected(ValidateStragglerOptions(o), "pause_ms");

  // One without the other is a mistake.
  o = StragglerOptions();
  o.pause_at_step = 3;
  ExpectRejected(ValidateStragglerOptions(o), "pause_ms");
  o = StragglerOptions();
  o.pause_ms = 10;
  ExpectRejected(ValidateStragglerOptions(o), "pause_at_step");
}

TEST(StragglerModelTest, RejectsANegativeWorkerId) {
  EXPECT_EQ(StragglerModel::Create(StragglerOptions(), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StragglerModelTest, ParsesDistributionNames) {
  for (DelayDistribution d : {DelayDistribution::kExponential, DelayDistribution::kLognormal,
                              DelayDistribution::kPareto}) {
    auto parsed = ParseDelayDistribution(DelayDistributionName(d));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, d);
  }
  for (const char* bad : {"", "normal", "Exponential", "pareto "}) {
    SCOPED_TRACE(bad);
    ExpectRejected(ParseDelayDistribution(bad).status(), "delay_distribution");
  }
}

// ---- Straggler patterns.

// The steps in [0, n) at which the slowdown applies.
std::vector<int64_t> SlowSteps(const StragglerModel& model, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < n; ++s) {
    if (model.SlowAt(s)) out.push_back(s);
  }
  return out;
}

TEST(StragglerPatternTest, ConstantAndMidRun) {
  StragglerOptions o;
  o.slowdown = 4;
  EXPECT_EQ(SlowSteps(MakeOrDie(o), 4), (std::vector<int64_t>{0, 1, 2, 3}));
  o.slow_from_step = 2;
  StragglerModel model = MakeOrDie(o);
  EXPECT_EQ(SlowSteps(model, 4), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(model.DelayFor(1, absl::Milliseconds(10)), absl::ZeroDuration());
  EXPECT_EQ(model.DelayFor(2, absl::Milliseconds(10)), absl::Milliseconds(30));
  EXPECT_NE(model.Describe().find("slowdown 4 from step 2"), std::string::npos)
      << model.Describe();
}

TEST(StragglerPatternTest, TransientSlowForPartOfEveryPeriod) {
  StragglerOptions o;
  o.slowdown = 4;
  o.slow_from_step = 1;
  o.slow_period_steps = 5;
  o.slow_for_steps = 2;
  EXPECT_EQ(SlowSteps(MakeOrDie(o), 13), (std::vector<int64_t>{1, 2, 6, 7, 11, 12}));
  // The floor still pads every step; the slowdown only the slow ones.
  o.min_step_ms = 10;
  StragglerModel model = MakeOrDie(o);
  EXPECT_EQ(model.DelayFor(3, absl::Milliseconds(4)), absl::Milliseconds(6));
  EXPECT_EQ(model.DelayFor(6, absl::Milliseconds(4)), absl::Milliseconds(36));
}

TEST(StragglerPatternTest, RotatingEachWorkerSlowInTurn) {
  StragglerOptions o;
  o.slowdown = 2;
  o.slow_period_steps = 3;
  o.slow_for_steps = 3;
  o.rotate_slow = true;
  o.num_workers = 3;
  // Period k (steps 3k..3k+2) is worker k mod 3's; every step has exactly one slow worker.
  for (int64_t s = 0; s < 30; ++s) {
    int slow = 0;
    for (int w = 0; w < 3; ++w) slow += MakeOrDie(o, w).SlowAt(s) ? 1 : 0;
    EXPECT_EQ(slow, 1) << "step " << s;
  }
  EXPECT_EQ(SlowSteps(MakeOrDie(o, 1), 12), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(SlowSteps(MakeOrDie(o, 2), 20), (std::vector<int64_t>{6, 7, 8, 15, 16, 17}));
}

TEST(StragglerPatternTest, RejectsPatternsThatCannotBe) {
  StragglerOptions o;
  o.slow_from_step = -1;
  ExpectRejected(ValidateStragglerOptions(o), "slow_from_step");
  o = StragglerOptions();
  o.slow_period_steps = 4;
  ExpectRejected(ValidateStragglerOptions(o), "slow_for_steps");  // 0 of every 4.
  o.slow_for_steps = 5;
  ExpectRejected(ValidateStragglerOptions(o), "slow_for_steps");
  o = StragglerOptions();
  o.slow_for_steps = 2;
  ExpectRejected(ValidateStragglerOptions(o), "slow_period_steps");
  o = StragglerOptions();
  o.rotate_slow = true;
  o.num_workers = 3;
  ExpectRejected(ValidateStragglerOptions(o), "rotate_slow");
}

TEST(StragglerPatternTest, DelayTraceRowsOfThisWorker) {
  const std::string trace =
      "# step worker delay_ms\n"
      "0 1 250\n"
      "\n"
      "3 0 12.5   # worker 0's\n"
      "3\t1\t0\n"
      "7 1 1e3\n";
  auto mine = ParseDelayTrace(trace, "t.txt", 1, 2);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(*mine, (std::map<int64_t, double>{{0, 250}, {3, 0}, {7, 1000}}));
  StragglerOptions o;
  o.trace_ms = *mine;
  StragglerModel model = MakeOrDie(o, 1);
  EXPECT_TRUE(model.enabled());
  EXPECT_EQ(model.DelayFor(0, absl::Milliseconds(5)), absl::Milliseconds(250));
  EXPECT_EQ(model.DelayFor(1, absl::Milliseconds(5)), absl::ZeroDuration());
  EXPECT_EQ(model.DelayFor(7, absl::Milliseconds(5)), absl::Seconds(1));
  auto other = ParseDelayTrace(trace, "t.txt", 0, 2);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(*other, (std::map<int64_t, double>{{3, 12.5}}));
}

TEST(StragglerPatternTest, DelayTraceErrorsNameTheLine) {
  const struct {
    const char* text;
    const char* says;
  } cases[] = {
      {"0 0 1\n1 0\n", "t.txt:2: cannot read '1 0'"},
      {"x 0 1\n", "t.txt:1: cannot read"},
      {"-1 0 1\n", "t.txt:1: step -1 < 0"},
      {"0 2 1\n", "t.txt:1: worker 2 is not in [0, 2)"},
      {"0 0 -5\n", "t.txt:1: delay -5 ms"},
      {"0 0 nan\n", "t.txt:1: delay nan ms"},
      {"0 0 1\n0 0 2\n", "t.txt:2: step 0 of worker 0 given twice"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    auto parsed = ParseDelayTrace(c.text, "t.txt", 0, 2);
    ASSERT_FALSE(parsed.ok());
    EXPECT_NE(parsed.status().message().find(c.says), std::string::npos) << parsed.status();
    EXPECT_NE(parsed.status().message().find("--delay_trace"), std::string::npos);
  }
}

}  // namespace
}  // namespace rubato
