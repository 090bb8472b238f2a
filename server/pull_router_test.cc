#include "server/pull_router.h"

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/aggregator_test_context.h"

namespace rubato {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

ConsistencyConfig Mode(ConsistencyMode mode, int staleness = 0) {
  ConsistencyConfig c;
  c.set_mode(mode);
  c.set_staleness(staleness);
  return c;
}

// A shard's parts for a router: one tensor "w" of two floats, `workers` members.
struct Shard {
  Shard(ConsistencyConfig c, int workers)
      : f(c, workers, 1.0, 100), tensors(workers), members(0, workers, 10000) {
    RegisterRequest r;
    TensorSpec* w = r.add_model();
    w->set_name("w");
    w->add_shape(2);
    r.add_initial_values()->set_data(Bytes({0, 0}));
    tensors.Adopt(r, *f.optimizer, 0);
    members.SetTensorCount(1);
    for (int i = 0; i < workers; ++i) members.SetMember(i, true);
    tensors.PublishMembers(members);
    f.ctx.members = tensors.member_view();
  }
  // Worker `worker` pushes step `step` of "w".
  void Push(int worker, int64_t step) {
    Released released;
    GradientOutcome outcome;
    const std::string g = Bytes({1, 1});
    ByteChunks chunks(g);
    tensors[0].Add(f.ctx, worker, step, {&chunks, nullptr, nullptr}, &outcome, &released);
    members.Pushed(worker, 0, step);
    for (auto& p : released.pulls) Answer(std::static_pointer_cast<PullState>(p));
  }
  void Answer(const PullStatePtr& p) { p->Answer(absl::OkStatus(), tensors.Answer(*p)); }

  AggregatorTestContext f;
  ShardTensors tensors;
  Membership members;
};

// Records a pull's answer.
struct Answer {
  PullState::Done done() {
    return [this](absl::Status s, std::vector<PulledTensor> got) {
      status = std::move(s);
      if (!got.empty()) version = got[0].snapshot.version;
      ++calls;
    };
  }
  absl::Status status;
  int64_t version = -1;
  int calls = 0;
};

const absl::Time kNow = absl::FromUnixSeconds(1000);

TEST(PullRouterTest, NothingIsArmedBeforeTrainingStarts) {
  Shard s(Mode(ASYNC), 1);
  PullRouter router(0, absl::Seconds(10), s.f.policy.get(), &s.tensors, &s.members);
  Answer a;
  std::vector<std::function<void()>> superseded;
  EXPECT_EQ(router.Take(0, 0, {0}, absl::InfiniteFuture(), kNow, a.done(), &superseded), nullptr);
  EXPECT_EQ(router.Pending(), 1);
  std::vector<PullStatePtr> ready;
  router.ArmParked(&ready);
  EXPECT_TRUE(ready.empty()) << "training has not started";
  router.StartTraining();
  router.ArmParked(&ready);
  ASSERT_EQ(ready.size(), 1u) << "version 0 is there";
  s.Answer(ready[0]);
  EXPECT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.version, 0);
  EXPECT_EQ(router.Pending(), 0);
}

TEST(PullRouterTest, ABspPullWaitsForItsStepsUpdate) {
  Shard s(Mode(BSP), 2);
  PullRouter router(0, absl::Seconds(10), s.f.policy.get(), &s.tensors, &s.members);
  router.StartTraining();
  std::vector<std::function<void()>> superseded;
  Answer now;
  PullStatePtr at_once =
      router.Take(0, 0, {0}, absl::InfiniteFuture(), kNow, now.done(), &superseded);
  ASSERT_NE(at_once, nullptr) << "step 0 needs version 0";
  Answer later;
  EXPECT_EQ(router.Take(1, 1, {0}, absl::InfiniteFuture(), kNow, later.done(), &superseded),
            nullptr);
  s.Push(0, 0);
  EXPECT_EQ(later.calls, 0) << "worker 1's gradient of step 0 is missing";
  s.Push(1, 0);
  EXPECT_EQ(later.calls, 1);
  EXPECT_EQ(later.version, 1);
}

TEST(PullRouterTest, ASecondPullOfTheSameTensorSupersedesTheFirst) {
  Shard s(Mode(BSP), 2);
  PullRouter router(0, absl::Seconds(10), s.f.policy.get(), &s.tensors, &s.members);
  router.StartTraining();
  Answer first, second;
  std::vector<std::function<void()>> superseded;
  EXPECT_EQ(router.Take(0, 1, {0}, absl::InfiniteFuture(), kNow, first.done(), &superseded),
            nullptr);
  EXPECT_EQ(router.Take(0, 1, {0}, absl::InfiniteFuture(), kNow, second.done(), &superseded),
            nullptr);
  ASSERT_EQ(superseded.size(), 1u);
  superseded[0]();
  EXPECT_TRUE(absl::IsAborted(first.status)) << first.status;
  EXPECT_EQ(second.calls, 0);
}

TEST(PullRouterTest, AnSspPullPastTheBoundTimesOutNamingTheSlowWorker) {
  Shard s(Mode(SSP, 1), 2);
  PullRouter router(3, absl::Seconds(10), s.f.policy.get(), &s.tensors, &s.members);
  router.StartTraining();
  s.Push(0, 0);
  s.Push(0, 1);
  Answer a;
  std::vector<std::function<void()>> superseded;
  // Worker 0 at step 2 is 2 ahead of worker 1 (clock 0) with a bound of 1; its own deadline is
  // 30 s away, the router's cap 10 s.
  EXPECT_EQ(router.Take(0, 2, {0}, kNow + absl::Seconds(30), kNow, a.done(), &superseded), nullptr);
  std::vector<std::pair<PullStatePtr, absl::Status>> expired;
  EXPECT_EQ(router.Expire(kNow + absl::Seconds(9), &expired), kNow + absl::Seconds(10));
  EXPECT_TRUE(expired.empty());
  EXPECT_EQ(router.Expire(kNow + absl::Seconds(10), &expired), absl::InfiniteFuture());
  ASSERT_EQ(expired.size(), 1u);
  const absl::Status& why = expired[0].second;
  EXPECT_TRUE(absl::IsDeadlineExceeded(why)) << why;
  EXPECT_EQ(why.message(),
            "pull for step 2 by worker 0 timed out on shard 3: ssp: step 2 needs every worker at "
            "clock >= 1; waiting for worker(s) 1 (clock 0)");
}

// The deadline thread is asked to look again only for a deadline earlier than it knows of; a
// worker's new pull supersedes its own parked pull of the tensor and no other worker's.
TEST(PullRouterTest, OnlyAnEarlierDeadlineAsksForAnotherLookAndPullsSupersedeTheirOwn) {
  Shard s(Mode(ASYNC), 3);
  PullRouter router(0, absl::Seconds(10), s.f.policy.get(), &s.tensors, &s.members);
  Answer a0, a1, a2, again;
  std::vector<std::function<void()>> superseded;
  bool sooner = false;
  // Before training starts every pull parks.
  EXPECT_EQ(router.Take(0, 0, {0}, kNow + absl::Seconds(5), kNow, a0.done(), &superseded, &sooner),
            nullptr);
  EXPECT_TRUE(sooner);
  EXPECT_EQ(router.Take(1, 0, {0}, kNow + absl::Seconds(8), kNow, a1.done(), &superseded, &sooner),
            nullptr);
  EXPECT_FALSE(sooner);
  EXPECT_EQ(router.Take(2, 0, {0}, kNow + absl::Seconds(2), kNow, a2.done(), &superseded, &sooner),
            nullptr);
  EXPECT_TRUE(sooner);
  std::vector<std::pair<PullStatePtr, absl::Status>> expired;
  EXPECT_EQ(router.Expire(kNow + absl::Seconds(1), &expired), kNow + absl::Seconds(2));
  EXPECT_TRUE(expired.empty());
  // Worker 0 pulls again: its first pull is superseded, the others stay.
  EXPECT_EQ(router.Take(0, 0, {0}, kNow + absl::Seconds(3), kNow + absl::Seconds(1), again.done(),
                        &superseded, &sooner),
            nullptr);
  EXPECT_FALSE(sooner) << "3 s is later than the 2 s the last Expire left";
  ASSERT_EQ(superseded.size(), 1u);
  superseded[0]();
  EXPECT_TRUE(absl::IsAborted(a0.status)) << a0.status;
  EXPECT_EQ(a1.calls + a2.calls + again.calls, 0);
  EXPECT_EQ(router.Pending(), 3);
}

}  // namespace
}  // namespace rubato
