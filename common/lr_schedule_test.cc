#include "common/lr_schedule.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

ScheduleContext Context(int64_t global_batch, int64_t steps_per_epoch = 0,
                        int64_t total_steps = 0) {
  ScheduleContext c;
  c.global_batch = global_batch;
  c.steps_per_epoch = steps_per_epoch;
  c.total_steps = total_steps;
  return c;
}

LearningRateScheduler MakeOrDie(double base, const LearningRateSchedule& schedule,
                                const ScheduleContext& context) {
  auto s = LearningRateScheduler::Create(base, schedule, context);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

// ---- Scaling rules: peak = lr * f(global / reference).

TEST(LrScheduleTest, LinearScalingGoyal) {
  // ResNet-50: 0.1 at batch 256, batch 8192 -> k = 32 -> 3.2.
  LearningRateSchedule s;
  s.set_reference_batch(256);
  s.set_scaling("linear");
  const auto lr = MakeOrDie(0.1, s, Context(8192));
  EXPECT_DOUBLE_EQ(lr.peak(), 3.2);
  EXPECT_DOUBLE_EQ(lr.At(0), 3.2);
  EXPECT_DOUBLE_EQ(lr.At(1000000), 3.2);
}

TEST(LrScheduleTest, SqrtScaling) {
  LearningRateSchedule s;
  s.set_reference_batch(256);
  s.set_scaling("sqrt");
  const auto lr = MakeOrDie(0.1, s, Context(8192));
  EXPECT_NEAR(lr.peak(), 0.1 * 5.656854249492381, 1e-15);  // sqrt(32)
  // Batch 1024 = 4 x 256: exactly 2x.
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(1024)).peak(), 0.2);
  // Smaller than the reference scales down: 64 / 256 = 1/4 -> 1/2.
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(64)).peak(), 0.05);
}

TEST(LrScheduleTest, BatchFactorIsTheRuleForANewGlobalBatch) {
  // An adaptive batch: from the job's 1024, the same rule as a job started at the new batch.
  for (const char* scaling : {"none", "linear", "sqrt"}) {
    LearningRateSchedule s;
    s.set_reference_batch(256);
    s.set_scaling(scaling);
    const auto start = MakeOrDie(0.1, s, Context(1024));
    for (int64_t batch : {64, 1024, 8192}) {
      EXPECT_NEAR(start.peak() * start.BatchFactor(batch), MakeOrDie(0.1, s, Context(batch)).peak(),
                  1e-15)
          << scaling << " " << batch;
    }
  }
}

TEST(LrScheduleTest, NoScalingIsTheDefault) {
  LearningRateSchedule s;
  s.set_reference_batch(256);
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(8192)).peak(), 0.1);
  s.set_scaling("none");
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(8192)).peak(), 0.1);
}

TEST(LrScheduleTest, ReferenceBatchZeroMeansNoScaling) {
  LearningRateSchedule s;  // reference_batch 0
  s.set_scaling("linear");
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(8192)).peak(), 0.1);
  s.set_scaling("sqrt");
  EXPECT_DOUBLE_EQ(MakeOrDie(0.1, s, Context(8192)).peak(), 0.1);
}

// ---- Warmup: lr = peak * (t + 1) / W for t < W.

TEST(LrScheduleTest, WarmupEndpoints) {
  LearningRateSchedule s;
  s.set_reference_batch(256);
  s.set_scaling("linear");
  s.set_warmup_steps(4);
  const auto lr = MakeOrDie(0.1, s, Context(8192));  // peak 3.2
  EXPECT_EQ(lr.warmup_steps(), 4);
  EXPECT_DOUBLE_EQ(lr.At(0), 0.8);  // peak / W
  EXPECT_DOUBLE_EQ(lr.At(1), 1.6);
  EXPECT_DOUBLE_EQ(lr.At(2), 2.4);
  EXPECT_DOUBLE_EQ(lr.At(3), 3.2);  // t = W - 1: the peak
  EXPECT_DOUBLE_EQ(lr.At(4), 3.2);  // t = W: constant decay starts at the peak
}

TEST(LrScheduleTest, WarmupThenCosineStartsAtPeak) {
  LearningRateSchedule s;
  s.set_warmup_steps(10);
  s.set_decay("cosine");
  s.set_decay_steps(110);  // D = 100
  const auto lr = MakeOrDie(2.0, s, Context(32));
  EXPECT_DOUBLE_EQ(lr.At(0), 0.2);
  EXPECT_DOUBLE_EQ(lr.At(9), 2.0);
  EXPECT_DOUBLE_EQ(lr.At(10), 2.0);    // cos(0) = 1
  EXPECT_NEAR(lr.At(60), 1.0, 1e-15);  // half-way through the decay
  EXPECT_DOUBLE_EQ(lr.At(110), 0.0);
}

TEST(LrScheduleTest, WarmupInEpochsRoundsToNearestUpdate) {
  LearningRateSchedule s;
  s.set_reference_batch(256);
  s.set_scaling("linear");
  s.set_warmup_epochs(5);
  // ImageNet at batch 8192: 1281167 / 8192 -> 156 updates per epoch; 5 epochs = 780 updates.
  const auto lr = MakeOrDie(0.1, s, Context(8192, 156));
  EXPECT_EQ(lr.warmup_steps(), 780);
  EXPECT_DOUBLE_EQ(lr.At(0), 3.2 / 780);
  EXPECT_DOUBLE_EQ(lr.At(779), 3.2);

  s.set_warmup_epochs(1.26);  // 12.6 -> 13
  EXPECT_EQ(MakeOrDie(0.1, s, Context(8192, 10)).warmup_steps(), 13);
  s.set_warmup_epochs(1.24);  // 12.4 -> 12
  EXPECT_EQ(MakeOrDie(0.1, s, Context(8192, 10)).warmup_steps(), 12);
}

TEST(LrScheduleTest, WarmupFillingTheHorizonDropsToTheFloor) {
  LearningRateSchedule s;
  s.set_warmup_steps(10);
  s.set_decay("cosine");
  s.set_decay_steps(10);
  s.set_final_lr_fraction(0.25);
  const auto lr = MakeOrDie(1.0, s, Context(32));
  EXPECT_DOUBLE_EQ(lr.At(9), 1.0);
  EXPECT_DOUBLE_EQ(lr.At(10), 0.25);
}

// ---- Decay after warmup, s = t - W.

TEST(LrScheduleTest, CosineEndpointsAndMidpoint) {
  LearningRateSchedule s;
  s.set_decay("cosine");
  s.set_decay_steps(100);
  s.set_final_lr_fraction(0.1);
  const auto lr = MakeOrDie(1.0, s, Context(32));
  EXPECT_EQ(lr.decay_horizon(), 100);
  EXPECT_DOUBLE_EQ(lr.At(0), 1.0);
  // 0.1 + 0.9 * (1 + cos(pi/4)) / 2 = 0.1 + 0.9 * 0.8535533905932737
  EXPECT_NEAR(lr.At(25), 0.8681980515339464, 1e-15);
  EXPECT_NEAR(lr.At(50), 0.55, 1e-15);  // (peak + floor) / 2
  EXPECT_DOUBLE_EQ(lr.At(100), 0.1);    // the floor at the horizon
  EXPECT_DOUBLE_EQ(lr.At(101), 0.1);    // and beyond
  EXPECT_DOUBLE_EQ(lr.At(100000), 0.1);
}

TEST(LrScheduleTest, CosineHorizonDefaultsToTotalSteps) {
  LearningRateSchedule s;
  s.set_decay("cosine");
  const auto lr = MakeOrDie(1.0, s, Context(32, 0, 200));
  EXPECT_EQ(lr.decay_horizon(), 200);
  EXPECT_NEAR(lr.At(100), 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(lr.At(200), 0.0);
}

TEST(LrScheduleTest, PolynomialPowerOne) {
  LearningRateSchedule s;
  s.set_decay("polynomial");  // power defaults to 1: linear decay
  s.set_decay_steps(100);
  const auto lr = MakeOrDie(2.0, s, Context(32));
  EXPECT_DOUBLE_EQ(lr.At(0), 2.0);
  EXPECT_DOUBLE_EQ(lr.At(50), 1.0);
  EXPECT_DOUBLE_EQ(lr.At(75), 0.5);
  EXPECT_DOUBLE_EQ(lr.At(100), 0.0);
  EXPECT_DOUBLE_EQ(lr.At(150), 0.0);
}

TEST(LrScheduleTest, PolynomialPowerTwoWithFloorAndWarmup) {
  LearningRateSchedule s;
  s.set_warmup_steps(20);
  s.set_decay("polynomial");
  s.set_power(2);
  s.set_decay_steps(120);  // D = 100
  s.set_final_lr_fraction(0.5);
  const auto lr = MakeOrDie(2.0, s, Context(32));  // floor 1
  EXPECT_DOUBLE_EQ(lr.At(19), 2.0);
  EXPECT_DOUBLE_EQ(lr.At(20), 2.0);
  EXPECT_DOUBLE_EQ(lr.At(70), 1.25);   // 1 + 1 * (1/2)^2
  EXPECT_DOUBLE_EQ(lr.At(110), 1.01);  // 1 + 1 * (1/10)^2
  EXPECT_DOUBLE_EQ(lr.At(120), 1.0);
  EXPECT_DOUBLE_EQ(lr.At(121), 1.0);
}

TEST(LrScheduleTest, StepDecayAtEachBoundary) {
  LearningRateSchedule s;
  s.set_warmup_steps(10);
  s.set_decay("step");
  s.set_decay_steps(30);  // default factor 0.1
  const auto lr = MakeOrDie(1.0, s, Context(32));
  EXPECT_DOUBLE_EQ(lr.At(10), 1.0);
  EXPECT_DOUBLE_EQ(lr.At(39), 1.0);
  EXPECT_DOUBLE_EQ(lr.At(40), 0.1);
  EXPECT_DOUBLE_EQ(lr.At(69), 0.1);
  EXPECT_DOUBLE_EQ(lr.At(70), 0.01);
  EXPECT_DOUBLE_EQ(lr.At(100), 0.001);

  s.set_decay_factor(0.5);
  const auto half = MakeOrDie(1.0, s, Context(32));
  EXPECT_DOUBLE_EQ(half.At(39), 1.0);
  EXPECT_DOUBLE_EQ(half.At(40), 0.5);
  EXPECT_DOUBLE_EQ(half.At(70), 0.25);
}

TEST(LrScheduleTest, DescribeNamesEveryPart) {
  LearningRateSchedule s;
  s.set_reference_batch(256);
  s.set_scaling("linear");
  s.set_warmup_epochs(5);
  s.set_decay("cosine");
  const auto lr = MakeOrDie(0.1, s, Context(8192, 156, 14040));
  const std::string d = lr.Describe();
  for (const char* part : {"base 0.1", "reference batch 256", "update batch 8192", "linear",
                           "peak 3.2", "780 updates", "5 epochs", "cosine", "update 14040", "t=0 ",
                           "(t=779) 3.2", "half-way (t=7410) 1.6", "last (t=14039)"}) {
    EXPECT_NE(d.find(part), std::string::npos) << "missing '" << part << "' in\n" << d;
  }
}

// ---- Bad configurations: InvalidArgument naming the field.

struct BadCase {
  const char* what;
  LearningRateSchedule schedule;
  ScheduleContext context;
  const char* field;  // Must appear in the message.
};

TEST(LrScheduleTest, RejectsBadConfigsNamingTheField) {
  std::vector<BadCase> cases;
  // A job of 1000 updates, 100 per epoch, unless the case gives another context.
  auto add_in = [&](const ScheduleContext& context, const char* what, const char* field,
                    auto edit) {
    LearningRateSchedule s;
    edit(s);
    cases.push_back({what, s, context, field});
  };
  auto add = [&](const char* what, const char* field, auto edit) {
    add_in(Context(256, 100, 1000), what, field, edit);
  };
  using S = LearningRateSchedule;
  add("unknown scaling", "lr_schedule.scaling: unknown 'cubic' (none, linear, sqrt)",
      [](S& s) { s.set_scaling("cubic"); });
  add("unknown decay", "lr_schedule.decay: unknown 'exp'", [](S& s) { s.set_decay("exp"); });
  add("negative reference batch", "lr_schedule.reference_batch",
      [](S& s) { s.set_reference_batch(-1); });
  add("negative warmup steps", "lr_schedule.warmup_steps", [](S& s) { s.set_warmup_steps(-1); });
  add("negative warmup epochs", "lr_schedule.warmup_epochs",
      [](S& s) { s.set_warmup_epochs(-0.5); });
  add("NaN warmup epochs", "lr_schedule.warmup_epochs",
      [](S& s) { s.set_warmup_epochs(std::numeric_limits<double>::quiet_NaN()); });
  add("both warmups", "lr_schedule.warmup_epochs", [](S& s) {
    s.set_warmup_steps(10);
    s.set_warmup_epochs(1);
  });
  add_in(Context(256, 0, 1000), "epochs without steps per epoch", "lr_schedule.warmup_epochs",
         [](S& s) { s.set_warmup_epochs(1); });
  add("warmup steps past the decay horizon", "lr_schedule.warmup_steps", [](S& s) {
    s.set_warmup_steps(101);
    s.set_decay("cosine");
    s.set_decay_steps(100);
  });
  add("warmup epochs past the job", "lr_schedule.warmup_epochs",
      [](S& s) { s.set_warmup_epochs(11); });  // 1100 updates > 1000
  add("negative decay steps", "lr_schedule.decay_steps", [](S& s) {
    s.set_decay("cosine");
    s.set_decay_steps(-5);
  });
  add("step decay without decay_steps", "lr_schedule.decay_steps",
      [](S& s) { s.set_decay("step"); });
  add_in(Context(256, 100, 0), "cosine without a horizon", "lr_schedule.decay_steps",
         [](S& s) { s.set_decay("cosine"); });
  add_in(Context(256, 100, 0), "polynomial without a horizon", "lr_schedule.decay_steps",
         [](S& s) { s.set_decay("polynomial"); });
  add("floor above the peak", "lr_schedule.final_lr_fraction", [](S& s) {
    s.set_decay("cosine");
    s.set_final_lr_fraction(1.5);
  });
  add("negative floor", "lr_schedule.final_lr_fraction", [](S& s) {
    s.set_decay("polynomial");
    s.set_final_lr_fraction(-0.1);
  });
  add("zero step factor", "lr_schedule.decay_factor", [](S& s) {
    s.set_decay("step");
    s.set_decay_steps(10);
    s.set_decay_factor(0);
  });
  add("growing step factor", "lr_schedule.decay_factor", [](S& s) {
    s.set_decay("step");
    s.set_decay_steps(10);
    s.set_decay_factor(1.5);
  });
  add("zero power", "lr_schedule.power", [](S& s) {
    s.set_decay("polynomial");
    s.set_power(0);
  });
  add("negative power", "lr_schedule.power", [](S& s) {
    s.set_decay("polynomial");
    s.set_power(-1);
  });
  // Fields for another decay: most likely a forgotten `decay`.
  add("decay_factor without step", "lr_schedule.decay_factor", [](S& s) {
    s.set_decay("cosine");
    s.set_decay_factor(0.5);
  });
  add("power without polynomial", "lr_schedule.power", [](S& s) { s.set_power(2); });
  add("floor with constant", "lr_schedule.final_lr_fraction",
      [](S& s) { s.set_final_lr_fraction(0.1); });
  add("decay_steps with constant", "lr_schedule.decay_steps", [](S& s) { s.set_decay_steps(100); });
  add_in(Context(0, 100, 1000), "no global batch", "global batch", [](S&) {});

  for (const BadCase& c : cases) {
    auto s = LearningRateScheduler::Create(0.1, c.schedule, c.context);
    ASSERT_FALSE(s.ok()) << c.what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.status().message().find(c.field), absl::string_view::npos)
        << c.what << ": " << s.status().message();
  }
}

TEST(LrScheduleTest, RejectsBadBaseLearningRate) {
  for (double base : {0.0, -0.1, std::numeric_limits<double>::infinity()}) {
    auto s = LearningRateScheduler::Create(base, LearningRateSchedule(), Context(256));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("learning_rate"), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace rubato
