#include "server/tensor_aggregator.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "common/lr_schedule.h"
#include "gtest/gtest.h"
#include "server/aggregator_test_context.h"

namespace rubato {
namespace {

// A waiter with one slot that records what it got.
class OneSlot : public PullWaiter {
 public:
  bool Fill(int, TensorSnapshot s) override {
    got = std::move(s);
    over = true;
    return true;
  }
  bool Over() const override { return over; }
  TensorSnapshot got;
  bool over = false;
};

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// SGD at rate 1 (w -= mean), with `workers` members.
struct Fixture : AggregatorTestContext {
  explicit Fixture(ConsistencyMode mode, int workers, int backup = 0)
      : AggregatorTestContext(
            [&] {
              ConsistencyConfig c;
              c.set_mode(mode);
              c.set_backup_workers(backup);
              return c;
            }(),
            workers, 1.0, 100) {}
};

GradientOutcome Add(TensorAggregator* t, const Fixture& f, int worker, int64_t step,
                    const std::string& bytes, Released* released = nullptr) {
  Released sink;
  GradientOutcome outcome;
  ByteChunks chunks(bytes);
  t->Add(f.ctx, worker, step, {&chunks, nullptr, nullptr}, &outcome, released ? released : &sink);
  return outcome;
}

TEST(TensorAggregatorTest, BspSumIsTheSameInAll24ArrivalOrders) {
  // Values whose float sum depends on the order of addition.
  const std::vector<std::vector<float>> g = {
      {1e8f, 0.1f}, {1.0f, 3e-8f}, {-1e8f, 0.2f}, {0.5f, -0.3f}};
  std::vector<float> expected(2);
  for (int i = 0; i < 2; ++i) {
    float sum = g[0][i];
    for (int w = 1; w < 4; ++w) sum += g[w][i];
    expected[i] = 0.0f - sum / 4.0f;
  }
  std::vector<int> order = {0, 1, 2, 3};
  int orders = 0;
  do {
    Fixture f(BSP, 4);
    TensorAggregator t("w", {2}, {0.0f, 0.0f}, TensorRole(), 4);
    for (int k = 0; k < 4; ++k) {
      const GradientOutcome o = Add(&t, f, order[k], 0, Bytes(g[order[k]]));
      EXPECT_EQ(o.kind, GradientOutcome::kAccepted);
      EXPECT_EQ(o.applied, k == 3);
    }
    const TensorSnapshot s = t.Snapshot();
    EXPECT_EQ(s.version, 1);
    EXPECT_EQ(Bytes(*s.values), Bytes(expected))
        << "order " << order[0] << order[1] << order[2] << order[3];
    // Nothing is held after the step: the accumulator alone.
    EXPECT_EQ(t.ExtraBytes(), 2 * static_cast<int64_t>(sizeof(float)));
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 24);
}

TEST(TensorAggregatorTest, OnlyEarlyArrivalsAreHeld) {
  Fixture f(BSP, 3);
  TensorAggregator t("w", {1000}, std::vector<float>(1000, 0.0f), TensorRole(), 3);
  const std::string g = Bytes(std::vector<float>(1000, 1.0f));
  Add(&t, f, 2, 0, g);  // early: held (copied, no keepalive)
  EXPECT_EQ(t.ExtraBytes(), 4000);
  Add(&t, f, 0, 0, g);  // its turn: into the accumulator
  EXPECT_EQ(t.ExtraBytes(), 4000 + 4000);
  Add(&t, f, 1, 0, g);  // completes the step, and the held one is added
  EXPECT_EQ(t.ExtraBytes(), 4000);
  EXPECT_EQ(t.version(), 1);
}

TEST(TensorAggregatorTest, AHeldGradientIsAcknowledgedWhenAddedOrWhenItWaitedTooLong) {
  Fixture f(BSP, 3);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 3);
  std::vector<absl::Status> acks;
  auto on_added = [&acks](absl::Status s) { acks.push_back(std::move(s)); };
  const std::string g = Bytes({1});
  ByteChunks chunks(g);
  auto keep = std::make_shared<std::string>(g);
  Released released;
  GradientOutcome o2, o1;
  t.Add(f.ctx, 2, 0, {&chunks, keep, on_added}, &o2, &released);
  t.Add(f.ctx, 1, 0, {&chunks, keep, on_added}, &o1, &released);
  EXPECT_TRUE(o2.held);
  EXPECT_TRUE(o1.held);
  EXPECT_TRUE(released.acks.empty());
  // Worker 0 is late: after the wait, both are answered with an error naming it, and stay held.
  EXPECT_EQ(t.ExpireHeld(absl::Now() - absl::Hours(1), *f.members, 5, &released),
            t.ExpireHeld(absl::Now() - absl::Hours(1), *f.members, 5, &released));
  EXPECT_TRUE(released.acks.empty()) << "not waited long enough yet";
  t.ExpireHeld(absl::InfiniteFuture(), *f.members, 5, &released);
  ASSERT_EQ(released.acks.size(), 2u);
  for (auto& [ack, status] : released.acks) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_NE(status.message().find("worker(s) 0"), std::string::npos) << status;
  }
  released = Released();
  // When worker 0's gradient comes, the step completes with all three.
  GradientOutcome o0;
  t.Add(f.ctx, 0, 0, {&chunks, keep, on_added}, &o0, &released);
  EXPECT_FALSE(o0.held);
  EXPECT_TRUE(o0.applied);
  EXPECT_TRUE(released.acks.empty()) << "the expired ones were answered already";
  EXPECT_EQ((*t.Snapshot().values)[0], -1.0f);

  // Held and then added in turn: acknowledged OK.
  GradientOutcome a, b;
  t.Add(f.ctx, 1, 1, {&chunks, keep, on_added}, &a, &released);
  EXPECT_TRUE(a.held);
  t.Add(f.ctx, 0, 1, {&chunks, keep, on_added}, &b, &released);
  ASSERT_EQ(released.acks.size(), 1u);
  EXPECT_TRUE(released.acks[0].second.ok());
}

TEST(TensorAggregatorTest, WeightsAreCopiedOnWriteOnlyWhileAPullHoldsThem) {
  Fixture f(ASYNC, 1);
  TensorAggregator t("w", {3}, {1, 2, 3}, TensorRole(), 1);
  const std::string g = Bytes({1, 1, 1});
  const float* before = t.Snapshot().values->data();
  Add(&t, f, 0, 0, g);
  EXPECT_EQ(t.Snapshot().values->data(), before) << "nobody held version 0: updated in place";
  const TensorSnapshot held = t.Snapshot();
  Add(&t, f, 0, 1, g);
  EXPECT_EQ(*held.values, std::vector<float>({0, 1, 2})) << "a held version never changes";
  EXPECT_EQ(held.version, 1);
  EXPECT_EQ(*t.Snapshot().values, std::vector<float>({-1, 0, 1}));
  EXPECT_NE(t.Snapshot().values->data(), held.values->data());
}

TEST(TensorAggregatorTest, PullsWaitForTheirVersionAndStalenessIsCounted) {
  Fixture f(BSP, 2);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 2);
  auto waiter = std::make_shared<OneSlot>();
  EXPECT_FALSE(t.Pull(1, 1, waiter, 0));
  EXPECT_FALSE(waiter->over);
  Released ready;
  Add(&t, f, 1, 0, Bytes({2}), &ready);
  EXPECT_TRUE(ready.pulls.empty());
  Add(&t, f, 0, 0, Bytes({4}), &ready);
  ASSERT_EQ(ready.pulls.size(), 1u);
  EXPECT_EQ(waiter->got.version, 1);
  EXPECT_EQ((*waiter->got.values)[0], -3.0f);
  // A duplicate and a step from the future.
  EXPECT_EQ(Add(&t, f, 0, 0, Bytes({4})).kind, GradientOutcome::kDuplicate);
  EXPECT_EQ(t.CheckStep(f.ctx, 0, 2).code(), absl::StatusCode::kFailedPrecondition);

  Fixture a(ASYNC, 2);
  TensorAggregator u("u", {1}, {0}, TensorRole(), 2);
  Add(&u, a, 0, 0, Bytes({1}));
  Add(&u, a, 0, 1, Bytes({1}));
  // Worker 1 pulled nothing since version 0: its gradient is two updates stale.
  EXPECT_EQ(Add(&u, a, 1, 0, Bytes({1})).staleness, 2);
}

TEST(TensorAggregatorTest, AStepWaitingOnAMemberWhoLeftCompletesWithoutIt) {
  Fixture f(BSP, 3);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 3);
  Add(&t, f, 2, 0, Bytes({6}));
  Add(&t, f, 1, 0, Bytes({3}));
  Released ready;
  double lr = 0;
  EXPECT_FALSE(t.ApplyIfComplete(f.ctx, &ready, &lr));
  EXPECT_EQ(t.Missing(f.members->member), std::vector<int>({0}));
  f.SetMember(0, false);
  EXPECT_TRUE(t.ApplyIfComplete(f.ctx, &ready, &lr));
  EXPECT_EQ((*t.Snapshot().values)[0], -4.5f);  // mean of 3 and 6
}

TEST(TensorAggregatorTest, BackupAppliesAfterNMinusBAndDropsTheRest) {
  Fixture f(BACKUP, 3, /*backup=*/1);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 3);
  EXPECT_FALSE(Add(&t, f, 1, 0, Bytes({2})).applied);
  EXPECT_TRUE(Add(&t, f, 2, 0, Bytes({4})).applied);
  EXPECT_EQ(Add(&t, f, 0, 0, Bytes({100})).kind, GradientOutcome::kDropped);
  EXPECT_EQ((*t.Snapshot().values)[0], -3.0f);
}

}  // namespace
}  // namespace rubato
