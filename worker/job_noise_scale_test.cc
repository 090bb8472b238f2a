#include "worker/job_noise_scale.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

NoiseScaleStats Report(int shard, int64_t step, double g2, double trace, double g2_ema,
                       double trace_ema) {
  NoiseScaleStats s;
  s.set_shard_id(shard);
  s.set_step(step);
  s.set_g2(g2);
  s.set_trace(trace);
  s.set_g2_ema(g2_ema);
  s.set_trace_ema(trace_ema);
  s.set_steps(step + 1);
  s.set_batch_small(32);
  s.set_workers(4);
  return s;
}

TEST(JobNoiseScaleTest, AddsTheShardsOfOneStepOnce) {
  JobNoiseScale job(2);
  EXPECT_EQ(job.Update(0, {Report(0, 5, 1.0, 10.0, 2.0, 20.0)}), "");  // Shard 1 not yet.
  EXPECT_TRUE(std::isnan(job.b_simple_ema()));
  EXPECT_EQ(job.relay(), nullptr);
  const std::string record = job.Update(0, {Report(1, 5, 3.0, 30.0, 2.0, 60.0)});
  EXPECT_EQ(record,
            "{\"event\":\"noise\",\"worker\":0,\"step\":5,\"b_small\":32,\"b_big\":128,"
            "\"g2\":4,\"trace\":40,\"g2_ema\":4,\"trace_ema\":80,\"steps\":6,"
            "\"b_simple\":10,\"b_simple_ema\":20}");
  EXPECT_EQ(job.b_simple_ema(), 20.0);
  // What the worker relays to the servers for an adaptive batch: the sums of the averages.
  ASSERT_NE(job.relay(), nullptr);
  EXPECT_EQ(job.relay()->step(), 5);
  EXPECT_EQ(job.relay()->g2_ema(), 4.0);
  EXPECT_EQ(job.relay()->trace_ema(), 80.0);
  // The same step again writes nothing; an older one is not taken.
  EXPECT_EQ(job.Update(0, {Report(0, 5, 1, 1, 1, 1), Report(1, 5, 1, 1, 1, 1)}), "");
  EXPECT_EQ(job.Update(0, {Report(0, 4, 1, 1, 1, 1), Report(1, 4, 1, 1, 1, 1)}), "");
  // A step whose |G|^2 estimate is not positive has no ratio (no b_simple), and the average is
  // kept.
  const std::string negative =
      job.Update(0, {Report(0, 6, -1.0, 5.0, 1.0, 5.0), Report(1, 6, 0.5, 5.0, 1.0, 5.0)});
  EXPECT_EQ(negative.find("\"b_simple\":"), std::string::npos) << negative;
  EXPECT_NE(negative.find(",\"b_simple_ema\":5}"), std::string::npos) << negative;
}

TEST(JobNoiseScaleTest, ReportsThatCannotComeFromTheJobAreIgnored) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<NoiseScaleStats> bad = {
      Report(2, 7, 1, 1, 1, 1),             // no such shard
      Report(-1, 7, 1, 1, 1, 1),            // no such shard
      Report(0, 7, std::nan(""), 1, 1, 1),  // not finite
      Report(0, 7, 1, inf, 1, 1),           // not finite
      Report(0, 7, 1, 1, 1, -inf),          // not finite
  };
  NoiseScaleStats huge_batch = Report(0, 7, 1, 1, 1, 1);
  huge_batch.set_batch_small(std::numeric_limits<int32_t>::max());  // b_big would overflow int32
  bad.push_back(huge_batch);
  NoiseScaleStats one_worker = Report(0, 7, 1, 1, 1, 1);
  one_worker.set_workers(1);
  bad.push_back(one_worker);
  JobNoiseScale job(1);
  for (const NoiseScaleStats& r : bad) EXPECT_EQ(job.Update(0, {r}), "") << r.DebugString();
  EXPECT_TRUE(std::isnan(job.b_simple_ema()));
  // Finite reports whose sum leaves the double range are not written either.
  JobNoiseScale two(2);
  const double big = std::numeric_limits<double>::max();
  EXPECT_EQ(two.Update(0, {Report(0, 1, big, 1, 1, 1), Report(1, 1, big, 1, 1, 1)}), "");
  // And a good report still counts afterwards.
  EXPECT_NE(job.Update(3, {Report(0, 8, 1, 2, 1, 2)}), "");
  EXPECT_EQ(job.b_simple_ema(), 2.0);
}

}  // namespace
}  // namespace rubato
