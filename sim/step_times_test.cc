#include "sim/step_times.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "sim/timing_job.h"

namespace rubato {
namespace {

TEST(StepTimesTest, DrawsAreFromTheSamplesAndRepeatable) {
  absl::StatusOr<StepTimes> t = StepTimes::FromText("# measured\n10\n\n30\n", "trace.txt");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->Mean(), absl::Milliseconds(20));
  std::map<absl::Duration, int> seen;
  for (int w = 0; w < 8; ++w) {
    for (int64_t s = 0; s < 500; ++s) {
      const absl::Duration d = t->At(w, s);
      ++seen[d];
      EXPECT_EQ(d, t->At(w, s));  // The same draw whenever it is asked for.
    }
  }
  ASSERT_EQ(seen.size(), 2u);
  // Both samples, about equally often (4,000 draws: 5 standard deviations is about 160).
  EXPECT_NEAR(seen[absl::Milliseconds(10)], 2000, 160);
  // Another seed draws otherwise.
  absl::StatusOr<StepTimes> other = StepTimes::FromText("10\n30\n", "trace.txt", 2);
  ASSERT_TRUE(other.ok());
  int differ = 0;
  for (int64_t s = 0; s < 100; ++s) differ += other->At(0, s) != t->At(0, s);
  EXPECT_GT(differ, 20);
}

TEST(StepTimesTest, BadFilesAreNamed) {
  absl::StatusOr<StepTimes> t = StepTimes::FromText("10\n-3\n", "trace.txt");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("trace.txt:2: '-3'"), std::string::npos) << t.status();
  EXPECT_FALSE(StepTimes::FromText("10\nnan\n", "t").ok());
  EXPECT_FALSE(StepTimes::FromText("abc\n", "t").ok());
  t = StepTimes::FromText("# only a comment\n", "empty.txt");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("empty.txt: no step times"), std::string::npos);
  EXPECT_EQ(StepTimes::FromFile("/nonexistent/steps.txt").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(StepTimesTest, AsyncWorkersComputeForTheirDraws) {
  // Four async workers on a network all but free: each worker's time is the sum of its draws.
  absl::StatusOr<StepTimes> t = StepTimes::FromText("10\n30\n", "trace.txt");
  ASSERT_TRUE(t.ok());
  TimingJobOptions o;
  o.cluster.set_num_workers(4);
  o.cluster.mutable_consistency()->set_mode(ASYNC);
  o.cluster.mutable_optimizer()->set_type("sgd");
  o.cluster.mutable_optimizer()->set_learning_rate(0.1);
  o.cluster.set_wait_timeout_ms(60000);
  o.tensor_elements = {1000};
  o.steps = 50;
  o.step_times = &*t;
  for (HostSpec* h : {&o.worker_host, &o.server_host}) {
    h->nic_bytes_per_second = 1e15;
    h->latency = absl::ZeroDuration();
  }
  absl::StatusOr<TimingJobResult> r = RunTimingJob(o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int w = 0; w < 4; ++w) {
    absl::Duration expected;
    for (int64_t s = 0; s < 50; ++s) expected += t->At(w, s);
    EXPECT_EQ(r->workers[w].compute, expected) << w;
    EXPECT_NEAR(absl::ToDoubleMilliseconds(r->workers[w].finished),
                absl::ToDoubleMilliseconds(expected), 0.01)
        << w;
  }
}

}  // namespace
}  // namespace rubato
