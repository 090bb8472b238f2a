#include "server/tensor_aggregator.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
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
              if (mode == ADAPTIVE) c.set_adaptive_every_steps(10);
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

// A tensor of 10 elements in parts of 4 (4, 4 and 2) under bsp: whatever the order in which the
// three workers' parts arrive, and whether a worker pushes its gradient whole or part by part, the
// result is the whole-tensor one bit for bit (each element summed in worker-id order).
TEST(TensorAggregatorTest, BspPartsGiveTheWholeTensorsResultInEveryArrivalOrder) {
  constexpr int kWorkers = 3;
  std::mt19937 rng(7);
  std::vector<std::vector<float>> g(kWorkers, std::vector<float>(10));
  std::uniform_real_distribution<float> value(-1, 1);
  for (auto& v : g) {
    for (float& x : v) x = value(rng) * (rng() % 2 == 0 ? 1e7f : 1e-3f);  // order-sensitive sums
  }
  std::vector<float> expected(10, 0.0f);
  {
    Fixture f(BSP, kWorkers);
    TensorAggregator whole("w", {10}, std::vector<float>(10, 0.0f), TensorRole(), kWorkers);
    for (int w = kWorkers - 1; w >= 0; --w) Add(&whole, f, w, 0, Bytes(g[w]));
    expected = *whole.Snapshot().values;
  }
  for (int trial = 0; trial < 300; ++trial) {
    Fixture f(BSP, kWorkers);
    TensorAggregator t("w", {10}, std::vector<float>(10, 0.0f), TensorRole(), kWorkers, 4);
    ASSERT_EQ(t.parts(), 3);
    ASSERT_EQ(t.part_size(2), 2);
    // Each worker pushes whole (-1) or as its three parts; all the pieces in a random order.
    std::vector<std::pair<int, int>> pieces;  // (worker, part)
    for (int w = 0; w < kWorkers; ++w) {
      if (rng() % 3 == 0) {
        pieces.push_back({w, -1});
      } else {
        for (int k = 0; k < 3; ++k) pieces.push_back({w, k});
      }
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    int applied = 0;
    for (const auto& [w, k] : pieces) {
      const std::vector<float> part =
          k < 0 ? g[w]
                : std::vector<float>(g[w].begin() + 4 * k, g[w].begin() + std::min(10, 4 * k + 4));
      const std::string bytes = Bytes(part);
      ByteChunks chunks(bytes);
      Released released;
      GradientOutcome outcome;
      TensorAggregator::Gradient gradient{&chunks, nullptr, nullptr};
      gradient.part = k;
      t.Add(f.ctx, w, 0, gradient, &outcome, &released);
      EXPECT_EQ(outcome.kind, GradientOutcome::kAccepted);
      applied += outcome.applied ? 1 : 0;
    }
    ASSERT_EQ(applied, 1) << "trial " << trial;
    EXPECT_EQ(*t.Snapshot().values, expected) << "trial " << trial;
    EXPECT_EQ(t.version(), 1);
  }
}

// A worker's push of its whole gradient is held part by part; it is acknowledged once, when its
// last held part is added, and a repeated part is a duplicate.
TEST(TensorAggregatorTest, APushHeldInPartsIsAcknowledgedOnceItsLastPartIsAdded) {
  Fixture f(BSP, 2);
  TensorAggregator t("w", {4}, std::vector<float>(4, 0.0f), TensorRole(), 2, 2);
  std::vector<absl::Status> acks;
  auto on_added = [&acks](absl::Status s) { acks.push_back(std::move(s)); };
  const std::string whole = Bytes({1, 2, 3, 4});
  const std::string half = Bytes({10, 20});
  ByteChunks whole_chunks(whole), half_chunks(half);
  auto keep = std::make_shared<std::string>("keep");
  Released released;
  GradientOutcome o1;
  t.Add(f.ctx, 1, 0, {&whole_chunks, keep, on_added}, &o1, &released);
  EXPECT_TRUE(o1.held);
  // Worker 0's part 0: worker 1's part 0 is added, its part 1 still waits: no answer yet.
  GradientOutcome o0;
  TensorAggregator::Gradient part0{&half_chunks, keep, on_added};
  part0.part = 0;
  t.Add(f.ctx, 0, 0, part0, &o0, &released);
  EXPECT_FALSE(o0.held);
  EXPECT_FALSE(o0.applied);
  EXPECT_TRUE(released.acks.empty());
  GradientOutcome again;
  t.Add(f.ctx, 0, 0, part0, &again, &released);
  EXPECT_EQ(again.kind, GradientOutcome::kDuplicate);
  // Worker 0's part 1: worker 1's last held part is added, the step applies.
  GradientOutcome o0b;
  TensorAggregator::Gradient part1{&half_chunks, keep, on_added};
  part1.part = 1;
  t.Add(f.ctx, 0, 0, part1, &o0b, &released);
  EXPECT_TRUE(o0b.applied);
  ASSERT_EQ(released.acks.size(), 1u);
  EXPECT_TRUE(released.acks[0].second.ok());
  // SGD at rate 1: w = -(g0 + g1) / 2.
  EXPECT_EQ(*t.Snapshot().values, std::vector<float>({-5.5f, -11.0f, -6.5f, -12.0f}));
}

// A part pushed again inside a whole gradient of the same step is not added twice: the whole
// gradient brings only the parts still missing.
TEST(TensorAggregatorTest, AWholeGradientAfterOneOfItsPartsAddsOnlyTheRest) {
  Fixture f(BSP, 1);
  TensorAggregator t("w", {4}, std::vector<float>(4, 0.0f), TensorRole(), 1, 2);
  const std::string part = Bytes({10, 20});
  ByteChunks part_chunks(part);
  Released released;
  GradientOutcome o;
  TensorAggregator::Gradient first{&part_chunks, nullptr, nullptr};
  first.part = 0;
  t.Add(f.ctx, 0, 0, first, &o, &released);
  EXPECT_FALSE(o.applied);
  EXPECT_EQ(Add(&t, f, 0, 0, Bytes({1, 2, 3, 4})).applied, true);
  EXPECT_EQ(*t.Snapshot().values, std::vector<float>({-10, -20, -3, -4}));
  EXPECT_EQ(Add(&t, f, 0, 0, Bytes({1, 2, 3, 4})).kind, GradientOutcome::kDuplicate);
}

// A push held in two parts that waits too long is answered once, not once per part.
TEST(TensorAggregatorTest, APushHeldInPartsExpiresWithOneAnswer) {
  Fixture f(BSP, 2);
  TensorAggregator t("w", {4}, std::vector<float>(4, 0.0f), TensorRole(), 2, 2);
  std::vector<absl::Status> acks;
  auto on_added = [&acks](absl::Status s) { acks.push_back(std::move(s)); };
  const std::string whole = Bytes({1, 2, 3, 4});
  ByteChunks chunks(whole);
  auto keep = std::make_shared<std::string>("keep");
  Released released;
  GradientOutcome o1;
  t.Add(f.ctx, 1, 0, {&chunks, keep, on_added}, &o1, &released);
  ASSERT_TRUE(o1.held);
  t.ExpireHeld(absl::InfiniteFuture(), *f.members, 5, &released);
  ASSERT_EQ(released.acks.size(), 1u);
  EXPECT_EQ(released.acks[0].second.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(released.acks[0].second.message().find("part 0 of 2"), std::string::npos)
      << released.acks[0].second;
  released = Released();
  t.ReleaseHeld(absl::CancelledError("shutdown"), &released);
  EXPECT_TRUE(released.acks.empty()) << "answered already";
  // Still held: worker 0's gradient completes the step with both.
  GradientOutcome o0;
  t.Add(f.ctx, 0, 0, {&chunks, keep, on_added}, &o0, &released);
  EXPECT_TRUE(o0.applied);
  EXPECT_TRUE(released.acks.empty());
  EXPECT_EQ(*t.Snapshot().values, std::vector<float>({-1, -2, -3, -4}));
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

TEST(TensorAggregatorTest, GradientsAheadOfTheVersionWaitForTheirStepAndAreAppliedOnceInOrder) {
  // adaptive: a worker that pulled older weights (an ssp:s period) may push up to MaxLead steps
  // past the version. Its gradient is acknowledged at once and added when its step comes.
  Fixture f(ADAPTIVE, 2);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 2);
  const int lead = f.policy->MaxLead();
  ASSERT_GE(lead, 2);
  EXPECT_TRUE(t.CheckStep(f.ctx, 0, lead).ok());
  const absl::Status future = t.CheckStep(f.ctx, 0, lead + 1);
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(future.message().find("lead it by"), absl::string_view::npos) << future;
  EXPECT_FALSE(Add(&t, f, 0, 0, Bytes({2})).applied);
  // Worker 0 runs two steps ahead of worker 1.
  for (int64_t step : {1, 2}) {
    const GradientOutcome o = Add(&t, f, 0, step, Bytes({float(2 << step)}));
    EXPECT_EQ(o.kind, GradientOutcome::kAccepted);
    EXPECT_FALSE(o.applied);
    EXPECT_FALSE(o.held);  // Acknowledged now.
  }
  EXPECT_EQ(Add(&t, f, 0, 2, Bytes({99})).kind, GradientOutcome::kDuplicate);
  EXPECT_EQ(t.version(), 0);
  EXPECT_EQ(t.ExtraBytes(), 3 * static_cast<int64_t>(sizeof(float)));  // Accumulator + 2 ahead.
  // A pull that accepts version 0 is answered now; one for version 2 waits.
  auto stale = std::make_shared<OneSlot>(), fresh = std::make_shared<OneSlot>();
  EXPECT_TRUE(t.Pull(1, 0, stale, 0));
  EXPECT_FALSE(t.Pull(1, 2, fresh, 0));
  // Worker 1's step 0 completes step 0 only: step 1 still lacks worker 1.
  Released ready;
  EXPECT_TRUE(Add(&t, f, 1, 0, Bytes({6}), &ready).applied);
  EXPECT_EQ(t.version(), 1);
  EXPECT_EQ((*t.Snapshot().values)[0], -4.0f);  // mean(2, 6)
  EXPECT_TRUE(Add(&t, f, 1, 1, Bytes({8}), &ready).applied);
  EXPECT_EQ(t.version(), 2);
  EXPECT_EQ((*t.Snapshot().values)[0], -10.0f);  // - mean(4, 8)
  ASSERT_EQ(ready.pulls.size(), 1u);
  EXPECT_EQ(fresh->got.version, 2);
  // Worker 0 ahead on step 3; worker 1's step 2 completes step 2 (worker 0's came ahead).
  EXPECT_FALSE(Add(&t, f, 0, 3, Bytes({4})).applied);
  EXPECT_TRUE(Add(&t, f, 1, 2, Bytes({16})).applied);
  EXPECT_EQ(t.version(), 3);
  EXPECT_EQ((*t.Snapshot().values)[0], -22.0f);  // - mean(8, 16)
  EXPECT_TRUE(Add(&t, f, 1, 3, Bytes({12})).applied);
  EXPECT_EQ(t.version(), 4);
  EXPECT_EQ((*t.Snapshot().values)[0], -30.0f);                    // - mean(4, 12)
  EXPECT_EQ(t.ExtraBytes(), static_cast<int64_t>(sizeof(float)));  // Nothing left ahead.
  EXPECT_EQ(Add(&t, f, 0, 3, Bytes({4})).kind, GradientOutcome::kDuplicate);
}

TEST(TensorAggregatorTest, StepsCompletedByGradientsAheadAreAppliedTogether) {
  // Workers 0 and 1 ahead on step 1 while worker 2 has not pushed step 0; when worker 2 leaves,
  // step 0 completes without it and step 1, whose gradients are all in, follows at once.
  Fixture f(ADAPTIVE, 3);
  TensorAggregator t("w", {1}, {0}, TensorRole(), 3);
  for (int w : {0, 1}) {
    Add(&t, f, w, 0, Bytes({float(2 + 2 * w)}));
    EXPECT_FALSE(Add(&t, f, w, 1, Bytes({float(10 + 10 * w)})).applied);
  }
  Released ready;
  double lr = 0;
  EXPECT_FALSE(t.ApplyIfComplete(f.ctx, &ready, &lr));
  f.SetMember(2, false);
  EXPECT_TRUE(t.ApplyIfComplete(f.ctx, &ready, &lr));
  EXPECT_EQ(t.version(), 2);
  EXPECT_EQ((*t.Snapshot().values)[0], -18.0f);  // - mean(2, 4) - mean(10, 20)
}

}  // namespace
}  // namespace rubato
