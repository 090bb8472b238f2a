#include "server/membership.h"

#include <algorithm>
#include <random>
#include <vector>

#include "common/limits.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(MembershipTest, IncrementalClocksEqualTheMinimumOverTensors) {
  // Random pushes (steps only grow per worker and tensor, some tensors jump ahead): after each one,
  // the incremental clock is min over tensors of (last step + 1), recomputed from scratch.
  constexpr int kWorkers = 3;
  constexpr int kTensors = 5;
  Membership m(0, kWorkers, 1000);
  m.SetTensorCount(kTensors);
  std::vector<std::vector<int64_t>> last(kWorkers, std::vector<int64_t>(kTensors, -1));
  std::mt19937 rng(7);
  for (int i = 0; i < 5000; ++i) {
    const int w = static_cast<int>(rng() % kWorkers);
    const int t = static_cast<int>(rng() % kTensors);
    const int64_t step = last[w][t] + 1 + (rng() % 4 == 0 ? static_cast<int64_t>(rng() % 3) : 0);
    const int64_t before = m.Clock(w);
    const bool advanced = m.Pushed(w, t, step);
    last[w][t] = std::max(last[w][t], step);
    const int64_t expected = *std::min_element(last[w].begin(), last[w].end()) + 1;
    ASSERT_EQ(m.Clock(w), expected) << "push " << i;
    ASSERT_EQ(advanced, expected > before);
  }
  // A repeated or older step changes nothing.
  const int64_t clock = m.Clock(0);
  EXPECT_FALSE(m.Pushed(0, 0, 0));
  EXPECT_EQ(m.Clock(0), clock);
}

TEST(MembershipTest, MinMemberClockSkipsNonMembers) {
  Membership m(0, 2, 1000);
  m.SetTensorCount(1);
  m.SetMember(0, true);
  m.SetMember(1, true);
  m.Pushed(0, 0, 4);
  EXPECT_EQ(m.MinMemberClock(), 0);  // worker 1 has pushed nothing
  m.SetMember(1, false);
  EXPECT_EQ(m.members(), 1);
  EXPECT_EQ(m.MinMemberClock(), 5);
}

TEST(MembershipTest, SkippedStepsCountAsPushed) {
  Membership m(0, 2, 1000);
  m.SetTensorCount(3);
  m.RestoreClocks(4);
  m.Pushed(0, 2, 12);  // One tensor already ahead.
  EXPECT_FALSE(m.SkipTo(0, 3)) << "behind the clock";
  EXPECT_EQ(m.Clock(0), 4);
  EXPECT_TRUE(m.SkipTo(0, 10));
  EXPECT_EQ(m.Clock(0), 10);
  EXPECT_EQ(m.Clock(1), 4);
  EXPECT_FALSE(m.Pushed(0, 0, 9)) << "a skipped step is a repeat";
  EXPECT_FALSE(m.Pushed(0, 0, 10));
  EXPECT_TRUE(m.Pushed(0, 1, 10)) << "every tensor is past 10 now (tensor 2 was at 12)";
  EXPECT_EQ(m.Clock(0), 11);
  EXPECT_FALSE(m.Pushed(0, 0, 11));
  EXPECT_TRUE(m.Pushed(0, 1, 11));
  EXPECT_EQ(m.Clock(0), 12);
}

TEST(MembershipTest, SilentMembersAreDroppedAndFinishedOnesAreNot) {
  Membership m(3, 3, 100);
  const absl::Time t0 = absl::Now();
  for (int w = 0; w < 3; ++w) {
    m.SetMember(w, true);
    m.worker(w).last_seen = t0;
  }
  m.worker(1).finished = true;
  m.worker(2).last_seen = t0 + absl::Milliseconds(80);
  std::vector<int> dropped;
  const absl::Time next = m.ExpireLeases(t0 + absl::Milliseconds(150), &dropped);
  EXPECT_EQ(dropped, std::vector<int>({0}));
  EXPECT_EQ(m.members(), 2);
  EXPECT_EQ(next, t0 + absl::Milliseconds(181));  // worker 2's lease ends next
  EXPECT_EQ(m.CheckMember(0).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(m.CheckMember(1).ok());
  EXPECT_EQ(m.CheckMember(7).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MembershipTest, EnrollMakesAMemberAndUnenrollPutsItBackAsItWas) {
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  Membership m(0, 2, 1000);
  m.SetMember(1, true);
  ASSERT_TRUE(m.Finish(1, 7, t0).ok());
  const Membership::Worker before = m.Enroll(1, 32, 100, 500, 40, t0 + absl::Seconds(1));
  EXPECT_TRUE(before.registered);
  EXPECT_TRUE(before.finished);
  EXPECT_EQ(before.last_step, 6);
  const Membership::Worker& w = m.worker(1);
  EXPECT_FALSE(w.finished) << "registering again makes it live";
  EXPECT_EQ(w.batch_size, 32);
  EXPECT_EQ(w.steps_per_epoch, 100);
  EXPECT_EQ(w.total_steps, 500);
  EXPECT_EQ(w.last_step, 39);
  EXPECT_EQ(w.last_seen, t0 + absl::Seconds(1));
  EXPECT_EQ(m.Enroll(0, 16, 100, 500, 0, t0).registered, false);
  EXPECT_EQ(m.members(), 2);
  m.Unenroll(0, Membership::Worker());
  EXPECT_EQ(m.members(), 1);
  EXPECT_FALSE(m.worker(0).registered);
  EXPECT_EQ(m.worker(0).batch_size, 0);
  EXPECT_FALSE(m.CheckMember(0).ok());
  m.Unenroll(1, before);
  EXPECT_TRUE(m.worker(1).finished);
  EXPECT_EQ(m.worker(1).last_step, 6);
  EXPECT_EQ(m.members(), 1);
}

TEST(MembershipTest, ACallPastStep0FromAWorkerUnknownHereSaysTheShardStartedAfresh) {
  Membership m(2, 2, 1000);
  EXPECT_EQ(m.CheckMemberAt(0, 0).message(), "worker 0 is not registered with shard 2")
      << "at step 0 it may simply not have registered yet";
  const absl::Status lost = m.CheckMemberAt(1, 17);
  EXPECT_TRUE(absl::IsFailedPrecondition(lost)) << lost;
  EXPECT_NE(lost.message().find("worker 1 (at step 17) is not registered with shard 2: the shard "
                                "started afresh"),
            std::string::npos)
      << lost;
  EXPECT_NE(lost.message().find("--checkpoint_dir"), std::string::npos) << lost;
  EXPECT_EQ(m.CheckMemberAt(7, 17).message(), "worker 7 is not registered with shard 2")
      << "no such worker in this job";
  m.SetRestored(10);  // A restored shard says that instead (ABORTED: register again).
  EXPECT_TRUE(absl::IsAborted(m.CheckMemberAt(1, 17)));
  m.SetMember(0, true);
  EXPECT_TRUE(m.CheckMemberAt(0, 17).ok());
}

TEST(MembershipTest, AWorkerOfAnotherJobLengthIsRefusedNamingBoth) {
  Membership m(0, 2, 1000);
  m.SetMember(0, true);
  m.worker(0).steps_per_epoch = 100;
  m.worker(0).total_steps = 500;
  EXPECT_TRUE(m.CheckSameJob(1, 100, 500).ok());
  const absl::Status s = m.CheckSameJob(1, 100, 400);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(s.message(),
            "job mismatch: worker 0 runs 500 steps of 100 per epoch, but worker 1 was started for "
            "400 steps of 100 per epoch");
  EXPECT_TRUE(m.CheckSameJob(0, 1, 1).ok()) << "a worker is not compared with itself";
}

TEST(MembershipTest, FinishCountsTheFinishedAndRefusesAWorkerThatNeverRegistered) {
  const absl::Time now = absl::UnixEpoch() + absl::Hours(1);
  Membership m(3, 2, 1000);
  EXPECT_EQ(m.Finish(0, 10, now).status().message(), "worker 0 is not registered with shard 3");
  EXPECT_FALSE(m.Finish(2, 10, now).ok());
  m.SetMember(0, true);
  m.SetMember(1, true);
  EXPECT_EQ(*m.Finish(0, 10, now), 1);
  EXPECT_EQ(*m.Finish(0, 10, now), 1) << "repeating it changes nothing";
  EXPECT_EQ(m.worker(0).last_step, 9);
  EXPECT_EQ(*m.Finish(1, 10, now), 2);
}

TEST(MembershipTest, TheJobIsOverWhenEveryWorkerFinishedOrALeaseAfterTheLastLiveOne) {
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  const absl::Duration idle = absl::Minutes(10);
  Membership m(0, 2, 1000);  // 1 s leases.
  absl::Time last_live = t0;
  EXPECT_FALSE(*m.JobOver(t0 + absl::Minutes(9), idle, &last_live)) << "nobody yet, not idle";
  const absl::StatusOr<bool> idle_over = m.JobOver(t0 + absl::Minutes(10), idle, &last_live);
  EXPECT_TRUE(absl::IsDeadlineExceeded(idle_over.status())) << idle_over.status();
  EXPECT_NE(idle_over.status().message().find("never registered: 0,1"), std::string::npos)
      << idle_over.status();
  m.SetMember(0, true);
  m.SetMember(1, true);
  m.Heard(0, 5, t0);
  m.Heard(1, 5, t0);
  last_live = t0;
  EXPECT_FALSE(*m.JobOver(t0 + absl::Milliseconds(500), idle, &last_live));
  ASSERT_TRUE(m.Finish(0, 6, t0 + absl::Milliseconds(500)).ok());
  // Worker 1 is silent (its lease ran out at 1 s): the job ends one lease after the last time a
  // worker was seen live (0.5 s), not at the idle timeout.
  EXPECT_FALSE(*m.JobOver(t0 + absl::Milliseconds(1200), idle, &last_live));
  EXPECT_TRUE(*m.JobOver(t0 + absl::Milliseconds(1600), idle, &last_live));
  ASSERT_TRUE(m.Finish(1, 6, t0 + absl::Seconds(3)).ok());
  EXPECT_TRUE(*m.JobOver(t0 + absl::Seconds(3), idle, &last_live));
}

TEST(MembershipTest, TheKeptMinimumClockFollowsPushesSkipsAndMembership) {
  constexpr int kWorkers = 4;
  constexpr int kTensors = 3;
  Membership m(0, kWorkers, 1000);
  m.SetTensorCount(kTensors);
  for (int w = 0; w < kWorkers; ++w) m.SetMember(w, true);
  std::mt19937 rng(11);
  for (int i = 0; i < 3000; ++i) {
    const int w = static_cast<int>(rng() % kWorkers);
    switch (rng() % 10) {
      case 0:
        m.SetMember(w, !m.worker(w).registered);
        break;
      case 1:
        m.SkipTo(w, m.Clock(w) + static_cast<int64_t>(rng() % 3));
        break;
      default:
        m.Pushed(w, static_cast<int>(rng() % kTensors),
                 m.Clock(w) + static_cast<int64_t>(rng() % 2));
    }
    int64_t expected = kMaxStep;
    for (int v = 0; v < kWorkers; ++v) {
      if (m.worker(v).registered) expected = std::min(expected, m.Clock(v));
    }
    ASSERT_EQ(m.MinMemberClock(), expected) << "operation " << i;
  }
}

}  // namespace
}  // namespace rubato
