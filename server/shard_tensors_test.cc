#include "server/shard_tensors.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/aggregator_test_context.h"

namespace rubato {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// Two tensors, "w" (2 x 2) and "b" (2), with the values 1, 2, 3, ...
RegisterRequest TwoTensors() {
  RegisterRequest r;
  TensorSpec* w = r.add_model();
  w->set_name("w");
  w->add_shape(2);
  w->add_shape(2);
  TensorSpec* b = r.add_model();
  b->set_name("b");
  b->add_shape(2);
  r.add_initial_values()->set_data(Bytes({1, 2, 3, 4}));
  r.add_initial_values()->set_data(Bytes({5, 6}));
  return r;
}

ConsistencyConfig Mode(ConsistencyMode mode) {
  ConsistencyConfig c;
  c.set_mode(mode);
  return c;
}

GradientOutcome Add(ShardTensors& t, const TensorAggregator::Context& ctx, int slot, int worker,
                    const std::string& bytes) {
  Released released;
  GradientOutcome outcome;
  ByteChunks chunks(bytes);
  t[slot].Add(ctx, worker, 0, {&chunks, nullptr, nullptr}, &outcome, &released);
  return outcome;
}

TEST(ShardTensorsTest, AdoptsTheRegistrantsModelInItsOrder) {
  AggregatorTestContext f(Mode(BSP), 2, 1.0, 10);
  ShardTensors t(2);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.MinVersion(), 0);
  t.Adopt(TwoTensors(), *f.optimizer, 0);
  ASSERT_EQ(t.size(), 2);
  EXPECT_EQ(t.index().at("w"), 0);
  EXPECT_EQ(t.index().at("b"), 1);
  EXPECT_EQ(t[0].shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Bytes(*t[1].Snapshot().values), Bytes({5, 6}));
  EXPECT_EQ(t.MinVersion(), 0);
}

TEST(ShardTensorsTest, MinVersionIsTheLaggingTensors) {
  AggregatorTestContext f(Mode(ASYNC), 1, 1.0, 10);
  ShardTensors t(1);
  t.Adopt(TwoTensors(), *f.optimizer, 0);
  EXPECT_TRUE(Add(t, f.ctx, 0, 0, Bytes({1, 1, 1, 1})).applied);
  EXPECT_EQ(t[0].version(), 1);
  EXPECT_EQ(t.MinVersion(), 0);  // "b" is still at 0.
  EXPECT_TRUE(Add(t, f.ctx, 1, 0, Bytes({1, 1})).applied);
  EXPECT_EQ(t.MinVersion(), 1);
}

TEST(ShardTensorsTest, AMemberLeavingCompletesTheStepItWasAwaitedFor) {
  AggregatorTestContext f(Mode(BSP), 2, 1.0, 10);
  ShardTensors t(2);
  t.Adopt(TwoTensors(), *f.optimizer, 0);
  Membership members(0, 2, 1000);
  members.SetMember(0, true);
  members.SetMember(1, true);
  t.PublishMembers(members);
  TensorAggregator::Context ctx = f.ctx;
  ctx.members = t.member_view();
  EXPECT_EQ((*t.member_view())->count, 2);
  EXPECT_FALSE(Add(t, ctx, 0, 0, Bytes({2, 2, 2, 2})).applied);
  Released released;
  EXPECT_FALSE(t.ApplyCompleted(ctx, &released).has_value());  // Worker 1 is awaited.
  members.SetMember(1, false);
  t.PublishMembers(members);
  EXPECT_EQ((*t.member_view())->count, 1);
  const std::optional<double> lr = t.ApplyCompleted(ctx, &released);
  ASSERT_TRUE(lr.has_value());
  EXPECT_EQ(*lr, 1.0);
  EXPECT_EQ(t[0].version(), 1);
  EXPECT_EQ(Bytes(*t[0].Snapshot().values), Bytes({-1, 0, 1, 2}));  // w - 2 / 1
  EXPECT_EQ(t[1].version(), 0);  // Nothing pushed to "b".
}

TEST(ShardTensorsTest, APullIsArmedOnItsTensorsAndAnsweredWithTheirNames) {
  AggregatorTestContext f(Mode(ASYNC), 1, 1.0, 10);
  ShardTensors t(1);
  t.Adopt(TwoTensors(), *f.optimizer, 0);
  std::vector<PulledTensor> answered;
  auto pull = std::make_shared<PullState>(
      0, 0, std::vector<int>{1, 0}, absl::InfiniteFuture(),
      [&](absl::Status s, std::vector<PulledTensor> got) {
        ASSERT_TRUE(s.ok()) << s;
        answered = std::move(got);
      });
  EXPECT_FALSE(t.Arm(pull, 1));  // Neither tensor has version 1 yet.
  EXPECT_TRUE(pull->armed);
  EXPECT_TRUE(Add(t, f.ctx, 0, 0, Bytes({1, 1, 1, 1})).applied);
  EXPECT_FALSE(pull->Over());
  EXPECT_TRUE(Add(t, f.ctx, 1, 0, Bytes({1, 1})).applied);
  ASSERT_TRUE(pull->Over());
  pull->Answer(absl::OkStatus(), t.Answer(*pull));
  ASSERT_EQ(answered.size(), 2u);
  EXPECT_EQ(*answered[0].name, "b");
  EXPECT_EQ(*answered[1].name, "w");
  EXPECT_EQ(answered[0].snapshot.version, 1);
  EXPECT_EQ(Bytes(*answered[0].snapshot.values), Bytes({4, 5}));
}

TEST(ShardTensorsTest, HeldGradientsAreCheckedAtMostOnceASecondWhenNoneWaits) {
  AggregatorTestContext f(Mode(BSP), 2, 1.0, 10);
  ShardTensors t(2);
  t.Adopt(TwoTensors(), *f.optimizer, 0);
  const absl::Time now = absl::FromUnixSeconds(1000);
  Released released;
  EXPECT_EQ(t.ExpireHeld(now, absl::Seconds(5), &released), now + absl::Seconds(1));
  // Before that time nothing is looked at again.
  EXPECT_EQ(t.ExpireHeld(now + absl::Milliseconds(500), absl::Seconds(5), &released),
            now + absl::Seconds(1));
  EXPECT_EQ(t.ExpireHeld(now + absl::Seconds(2), absl::Seconds(5), &released),
            now + absl::Seconds(3));
  EXPECT_TRUE(released.acks.empty());
}

}  // namespace
}  // namespace rubato
