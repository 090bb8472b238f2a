#include "sim/timing_job.h"

#include <limits>

#include "gtest/gtest.h"

namespace rubato {
namespace {

constexpr int64_t kElements = 1000000;  // 4 MB of floats: 4 ms at 1 GB/s.
constexpr double kRate = 1e9;
constexpr absl::Duration kLatency = absl::Microseconds(10);
constexpr absl::Duration kCompute = absl::Milliseconds(10);

// Four workers and one shard, each on a host of its own with a 1 GB/s NIC.
TimingJobOptions Job(ConsistencyMode mode, int64_t steps) {
  TimingJobOptions o;
  o.cluster.set_num_workers(4);
  o.cluster.mutable_consistency()->set_mode(mode);
  if (mode == BACKUP) o.cluster.mutable_consistency()->set_backup_workers(1);
  if (mode == SSP) o.cluster.mutable_consistency()->set_staleness(2);
  o.cluster.mutable_optimizer()->set_type("sgd");
  o.cluster.mutable_optimizer()->set_learning_rate(0.1);
  o.cluster.set_wait_timeout_ms(60000);
  o.shards = 1;
  o.tensor_elements = {kElements};
  o.steps = steps;
  o.step_time = kCompute;
  for (HostSpec* h : {&o.worker_host, &o.server_host}) {
    h->nic_bytes_per_second = kRate;
    h->latency = kLatency;
  }
  return o;
}

absl::Duration Transfer() { return absl::Seconds(4.0 * kElements / kRate); }

// Under bsp a step cannot take less than the shard sending the new weights to all four workers
// one after another, the last worker's compute, and its push: (4 + 1) transfers plus the compute.
// The simulated job must meet that bound and come within latencies and framing of it.
TEST(TimingJob, BspStepIsTheShardsNicBoundPlusCompute) {
  const int64_t steps = 20;
  absl::StatusOr<TimingJobResult> r = RunTimingJob(Job(BSP, steps));
  ASSERT_TRUE(r.ok()) << r.status();
  const absl::Duration bound = steps * (5 * Transfer() + kCompute);
  EXPECT_GE(r->wall, bound);
  EXPECT_LE(r->wall, bound * 1.01) << "bound " << bound;
  ASSERT_EQ(r->workers.size(), 4u);
  for (const TimingJobResult::Worker& w : r->workers) {
    EXPECT_EQ(w.computed_steps, steps);
    EXPECT_EQ(w.skipped_steps, 0);
    EXPECT_EQ(w.compute, steps * kCompute);
    EXPECT_GT(w.waiting, absl::ZeroDuration());
  }
  EXPECT_EQ(r->dropped_gradients, 0);
  // The shard's NIC sends 4 of every ~5.3 transfer times.
  EXPECT_GT(r->max_shard_nic_out, 0.5);
  EXPECT_LE(r->max_shard_nic_out, 1.0);
  EXPECT_GT(r->events, 0);
}

// Tensors held at 1/1000 of their size cost the same simulated time: the network counts the bytes
// they stand for.
TEST(TimingJob, ScaledTensorsTakeTheTimeOfTheirFullSize) {
  absl::StatusOr<TimingJobResult> full = RunTimingJob(Job(BSP, 10));
  TimingJobOptions o = Job(BSP, 10);
  o.scale = 1000;
  absl::StatusOr<TimingJobResult> scaled = RunTimingJob(o);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_NEAR(absl::ToDoubleSeconds(scaled->wall), absl::ToDoubleSeconds(full->wall),
              0.002 * absl::ToDoubleSeconds(full->wall));
}

TEST(TimingJob, BackupWorkersDoNotWaitForAConstantStraggler) {
  TimingJobOptions o = Job(BACKUP, 30);
  o.scale = 1000;
  o.stragglers.resize(4);
  o.stragglers[3].slowdown = 4;
  absl::StatusOr<TimingJobResult> backup = RunTimingJob(o);
  ASSERT_TRUE(backup.ok()) << backup.status();
  TimingJobOptions b = o;
  b.cluster.mutable_consistency()->set_mode(BSP);
  b.cluster.mutable_consistency()->set_backup_workers(0);
  absl::StatusOr<TimingJobResult> bsp = RunTimingJob(b);
  ASSERT_TRUE(bsp.ok()) << bsp.status();
  EXPECT_LT(backup->wall, bsp->wall * 0.8) << "backup " << backup->wall << ", bsp " << bsp->wall;
  for (int w = 0; w < 3; ++w) EXPECT_EQ(backup->workers[w].computed_steps, 30) << w;
  EXPECT_LT(backup->workers[3].computed_steps, 30);
  EXPECT_GT(backup->workers[3].skipped_steps + backup->dropped_gradients, 0);
  // Only the straggler's pushes come late; a push is dropped whole or not at all.
  for (int w = 0; w < 3; ++w) EXPECT_EQ(backup->workers[w].dropped_pushes, 0) << w;
  EXPECT_EQ(backup->workers[3].dropped_pushes > 0, backup->dropped_gradients > 0);
  EXPECT_LE(backup->workers[3].dropped_pushes, backup->workers[3].computed_steps);
  // bsp waits for the straggler's 4 x 10 ms every step.
  EXPECT_GE(bsp->wall, 30 * 4 * kCompute);
}

TEST(TimingJob, AsyncWorkersRunTheirOwnSteps) {
  TimingJobOptions o = Job(ASYNC, 10);
  o.stragglers.resize(4);
  o.stragglers[0].slowdown = 3;
  absl::StatusOr<TimingJobResult> r = RunTimingJob(o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const TimingJobResult::Worker& w : r->workers) {
    EXPECT_EQ(w.computed_steps, 10);
    // Each step pulls and pushes the whole model through the worker's own NIC.
    EXPECT_GE(w.finished, 10 * (kCompute + 2 * Transfer()));
  }
  // The slow worker finishes last, the others without waiting for it.
  EXPECT_EQ(r->wall, r->workers[0].finished);
  EXPECT_LT(r->workers[1].finished, r->workers[0].finished * 0.8);
}

TEST(TimingJob, SspRunsAndBoundsTheLead) {
  TimingJobOptions o = Job(SSP, 12);
  o.scale = 1000;
  o.stragglers.resize(4);
  o.stragglers[2].slowdown = 4;
  absl::StatusOr<TimingJobResult> r = RunTimingJob(o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const TimingJobResult::Worker& w : r->workers) EXPECT_EQ(w.computed_steps, 12);
  // A fast worker may lead by at most the staleness (2), so it cannot finish before the straggler
  // has done at least 12 - 2 - 2 steps of 40 ms (alone it would take 12 x 18 ms).
  EXPECT_GE(r->workers[0].finished, 8 * 4 * kCompute);
}

TEST(TimingJob, AWaitTimeoutEndsTheRunNamingWhomItWaitedFor) {
  TimingJobOptions o = Job(BSP, 10);
  o.scale = 1000;
  o.cluster.set_wait_timeout_ms(2000);
  o.stragglers.resize(4);
  o.stragglers[1].pause_at_step = 3;
  o.stragglers[1].pause_ms = 60000;
  absl::StatusOr<TimingJobResult> r = RunTimingJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("worker"), absl::string_view::npos) << r.status();
  EXPECT_NE(r.status().message().find("1"), absl::string_view::npos) << r.status();
}

TEST(TimingJob, AdaptiveConsistencyLeavesAConstantStragglerBehind) {
  // Decisions every 10 steps from the relayed compute times (server/adaptive_policy.h): bsp for
  // the first period, then backup:1 for a worker 4x slower all along.
  TimingJobOptions o = Job(ADAPTIVE, 60);
  o.cluster.mutable_consistency()->set_adaptive_every_steps(10);
  o.scale = 1000;
  o.stragglers.resize(4);
  o.stragglers[3].slowdown = 4;
  absl::StatusOr<TimingJobResult> adaptive = RunTimingJob(o);
  ASSERT_TRUE(adaptive.ok()) << adaptive.status();
  TimingJobOptions b = o;
  b.cluster.mutable_consistency()->set_mode(BSP);
  b.cluster.mutable_consistency()->clear_adaptive_every_steps();
  absl::StatusOr<TimingJobResult> bsp = RunTimingJob(b);
  ASSERT_TRUE(bsp.ok()) << bsp.status();
  EXPECT_LT(adaptive->wall, bsp->wall * 0.6) << adaptive->wall << " vs " << bsp->wall;
  // The first period ran at the straggler's pace.
  EXPECT_GE(adaptive->wall, 10 * 4 * kCompute);
  for (int w = 0; w < 3; ++w) EXPECT_EQ(adaptive->workers[w].computed_steps, 60) << w;
  EXPECT_GT(adaptive->workers[3].skipped_steps, 0);
}

TEST(TimingJob, ReassignmentHandsTheStragglersUnitsToTheOthers) {
  // One epoch of 40 batches a worker in units of 4 (server/work_queue.h): the fast workers take
  // the slow one's units once theirs are done, so the job's 160 batches are each trained once.
  // A model of 40 kB: transfers of microseconds, so compute sets the pace.
  TimingJobOptions o = Job(ASYNC, 40);
  o.tensor_elements = {10000};
  o.stragglers.resize(4);
  o.stragglers[3].slowdown = 4;
  absl::StatusOr<TimingJobResult> plain = RunTimingJob(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_GE(plain->wall, 40 * 4 * kCompute);  // Worker 3's share, at its pace.
  o.cluster.mutable_reassign()->set_unit_batches(4);
  absl::StatusOr<TimingJobResult> moved = RunTimingJob(o);
  ASSERT_TRUE(moved.ok()) << moved.status();
  int64_t batches = 0;
  for (const TimingJobResult::Worker& w : moved->workers) batches += w.computed_steps;
  EXPECT_EQ(batches, 160);
  EXPECT_LT(moved->workers[3].computed_steps, 40);
  for (int w = 0; w < 3; ++w) EXPECT_GT(moved->workers[w].computed_steps, 40) << w;
  // 160 batches at 3.25 workers' pace (10 ms a batch, 40 ms for worker 3), plus at most one of
  // worker 3's units (160 ms) still running when the rest is done, plus transfers.
  EXPECT_GE(moved->wall, 160 / 3.25 * kCompute);
  EXPECT_LT(moved->wall, 160 / 3.25 * kCompute + 4 * 4 * kCompute + 20 * kCompute);
}

TEST(TimingJob, RefusesWhatItDoesNotSimulate) {
  TimingJobOptions o = Job(BSP, 10);
  o.cluster.mutable_reassign()->set_unit_batches(4);
  EXPECT_EQ(RunTimingJob(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Job(BSP, 10);
  o.stragglers.resize(3);
  absl::Status s = RunTimingJob(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("straggler"), absl::string_view::npos) << s;
  o = Job(BSP, 10);
  o.worker_host.nic_bytes_per_second = 0;
  EXPECT_EQ(RunTimingJob(o).status().code(), absl::StatusCode::kInvalidArgument);
  // bsp pushes a tensor larger than its part size (1 Mi elements for 4 workers) in parts, and a
  // held part may not fall below 1,024 elements: the scale is bounded, and the error says by what.
  o = Job(BSP, 10);
  o.tensor_elements = {4 * kElements};
  EXPECT_EQ(MaxScale(o), 1024);
  o.scale = 2000;
  s = RunTimingJob(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("scale must be at most 1024, got 2000"), absl::string_view::npos) << s;
  o.tensor_elements = {kElements};  // Whole tensors: no bound.
  EXPECT_EQ(MaxScale(o), std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace rubato
