#include "sim/ring_job.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

HostSpec Host(double bytes_per_second, absl::Duration latency) {
  HostSpec h;
  h.nic_bytes_per_second = bytes_per_second;
  h.latency = latency;
  return h;
}

TEST(RingAllReduceEndsTest, OneSegmentPerChunkTakesTwoNMinusTwoHops) {
  const HostSpec host = Host(1e9, absl::Microseconds(10));
  const std::vector<double> start(4, 0.0);
  int64_t blocks = 0;
  // 4,000 floats over 4 ranks: chunks of 1,000 floats, one block each per step.
  const std::vector<double> end = RingAllReduceEnds(start, 4000, 0, host, &blocks);
  const double hop = (4000.0 + kRingBlockOverheadBytes) / 1e9 + 10e-6;
  for (double e : end) EXPECT_NEAR(e, 6 * hop, 1e-12);
  EXPECT_EQ(blocks, 6 * 4);
}

TEST(RingAllReduceEndsTest, SegmentsPipelineAcrossSteps) {
  const HostSpec host = Host(1e9, absl::Microseconds(1));
  // Two ranks, chunks of 4,000 floats in four segments of 1,000: the second step's segments
  // follow the first's on the wire instead of waiting for the whole chunk.
  const std::vector<double> end = RingAllReduceEnds({0.0, 0.0}, 8000, 1000, host);
  const double wire = (4000.0 + kRingBlockOverheadBytes) / 1e9;
  for (double e : end) EXPECT_NEAR(e, 8 * wire + 1e-6, 1e-12);
  // Unpipelined it would be two whole chunks' times, each with its latency.
  EXPECT_LT(end[0], 2 * (4 * wire + 1e-6));
}

TEST(RingAllReduceEndsTest, EveryRankWaitsForTheLastToStart) {
  const HostSpec host = Host(1e9, absl::Microseconds(10));
  const std::vector<double> end = RingAllReduceEnds({0.0, 0.0, 1.0, 0.0}, 4000, 0, host);
  const double hop = (4000.0 + kRingBlockOverheadBytes) / 1e9 + 10e-6;
  for (double e : end) {
    EXPECT_GT(e, 1.0);
    EXPECT_LE(e, 1.0 + 6 * hop + 1e-12);
  }
}

TEST(RingAllReduceEndsTest, OneRankIsDoneAtOnce) {
  EXPECT_EQ(RingAllReduceEnds({2.5}, 100, 0, HostSpec()), std::vector<double>({2.5}));
}

RingJobOptions Job(int workers, int quorum, bool partial) {
  RingJobOptions o;
  o.workers = workers;
  o.quorum = quorum;
  o.partial = partial;
  o.elements = 1 << 20;
  o.steps = 20;
  o.step_time = absl::Milliseconds(10);
  o.host = Host(100e9 / 8, absl::Microseconds(10));
  return o;
}

std::vector<StragglerOptions> OneSlow(int workers, double slowdown) {
  std::vector<StragglerOptions> s(workers);
  s[0].slowdown = slowdown;
  return s;
}

TEST(RunRingJobTest, SynchronousRingWaitsForItsStragglerEveryStep) {
  RingJobOptions o = Job(8, 8, false);
  absl::StatusOr<TimingJobResult> even = RunRingJob(o);
  ASSERT_TRUE(even.ok()) << even.status();
  o.stragglers = OneSlow(8, 4);
  absl::StatusOr<TimingJobResult> slow = RunRingJob(o);
  ASSERT_TRUE(slow.ok()) << slow.status();
  // Every step costs the straggler's 40 ms plus the all-reduce.
  const double per_step = absl::ToDoubleSeconds(even->wall) / 20 - 0.010;
  EXPECT_GT(per_step, 0);
  EXPECT_NEAR(absl::ToDoubleSeconds(slow->wall), 20 * (0.040 + per_step), 1e-6);
  for (const TimingJobResult::Worker& w : slow->workers) EXPECT_EQ(w.computed_steps, 20);
  // The fast workers wait 30 ms a step for it; it waits only for the ring.
  EXPECT_NEAR(absl::ToDoubleSeconds(slow->workers[1].waiting), 20 * (0.030 + per_step), 1e-6);
  EXPECT_NEAR(absl::ToDoubleSeconds(slow->workers[0].waiting), 20 * per_step, 1e-6);
  EXPECT_EQ(slow->dropped_gradients, 0);
}

TEST(RunRingJobTest, SoloRoundsGoOnWithoutTheStraggler) {
  RingJobOptions sync = Job(8, 8, false);
  sync.stragglers = OneSlow(8, 4);
  absl::StatusOr<TimingJobResult> s = RunRingJob(sync);
  ASSERT_TRUE(s.ok()) << s.status();
  RingJobOptions solo = Job(8, 1, true);
  solo.stragglers = OneSlow(8, 4);
  absl::StatusOr<TimingJobResult> p = RunRingJob(solo);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_LT(absl::ToDoubleSeconds(p->wall), 0.6 * absl::ToDoubleSeconds(s->wall));
  int64_t done = 0;
  for (const TimingJobResult::Worker& w : p->workers) done += w.computed_steps;
  EXPECT_GE(done, 20 * 8);  // The synchronous job's gradients, carried.
  EXPECT_LT(p->workers[0].computed_steps, p->workers[1].computed_steps / 2);
}

TEST(RunRingJobTest, MajorityPollsBeforeEveryRound) {
  RingJobOptions sync = Job(8, 8, false);
  absl::StatusOr<TimingJobResult> s = RunRingJob(sync);
  ASSERT_TRUE(s.ok()) << s.status();
  RingJobOptions majority = Job(8, 4, true);
  absl::StatusOr<TimingJobResult> m = RunRingJob(majority);
  ASSERT_TRUE(m.ok()) << m.status();
  // Without stragglers every rank is ready at once: the same rounds as the synchronous steps,
  // each after a poll, which costs 14 hops of a small block.
  for (const TimingJobResult::Worker& w : m->workers) EXPECT_EQ(w.computed_steps, 20);
  EXPECT_EQ(m->dropped_gradients, 0);
  const double poll = 14 * (kRingBlockOverheadBytes + 4.0) / (100e9 / 8) + 14 * 10e-6;
  EXPECT_GT(absl::ToDoubleSeconds(m->wall), absl::ToDoubleSeconds(s->wall) + 20 * poll * 0.99);
}

TEST(RunRingJobTest, BadOptionsAreNamed) {
  RingJobOptions o = Job(8, 4, false);
  EXPECT_EQ(RunRingJob(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Job(8, 9, true);
  EXPECT_NE(RunRingJob(o).status().message().find("quorum 9"), std::string::npos);
  o = Job(8, 8, false);
  o.stragglers.resize(3);
  EXPECT_NE(RunRingJob(o).status().message().find("straggler options for 3"), std::string::npos);
  o = Job(8, 8, false);
  o.host.nic_bytes_per_second = 0;
  EXPECT_EQ(RunRingJob(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
