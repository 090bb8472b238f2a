#include "worker/ps/call_plan.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TensorSpec Spec(const std::string& name, int64_t elements) {
  TensorSpec s;
  s.set_name(name);
  s.add_shape(elements);
  return s;
}

TEST(CallPlanTest, EachShardsTensorsAreGroupedInModelOrderUpToTheTarget) {
  // 4 KB, 4 KB, 12 KB, 2 KB, 2 KB on one shard, calls of about 8 KB.
  const std::vector<TensorSpec> model = {Spec("a", 1000), Spec("b", 1000), Spec("c", 3000),
                                         Spec("d", 500), Spec("e", 500)};
  absl::StatusOr<CallPlan> plan = PlanCalls(model, 1, 1 << 30, 8000);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->groups.size(), 3u);
  EXPECT_EQ(plan->groups[0].tensors, std::vector<int>({0, 1}));
  EXPECT_EQ(plan->groups[1].tensors, std::vector<int>({2}));  // larger than the target: alone
  EXPECT_EQ(plan->groups[2].tensors, std::vector<int>({3, 4}));
  EXPECT_EQ(plan->elements, std::vector<int64_t>({1000, 1000, 3000, 500, 500}));
}

TEST(CallPlanTest, EveryTensorIsInExactlyOneCallToItsOwnShard) {
  std::vector<TensorSpec> model;
  for (int i = 0; i < 20; ++i) model.push_back(Spec("t" + std::to_string(i), 100 * (i % 7 + 1)));
  absl::StatusOr<CallPlan> plan = PlanCalls(model, 3, 1 << 30, 1500);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int> seen(model.size(), 0);
  for (const CallGroup& g : plan->groups) {
    int64_t bytes = 0;
    for (int i : g.tensors) {
      ++seen[i];
      EXPECT_EQ(plan->placement.shard_of[i], g.shard);
      bytes += 4 * plan->elements[i];
    }
    EXPECT_TRUE(g.tensors.size() == 1 || bytes <= 1500) << bytes;
  }
  for (int n : seen) EXPECT_EQ(n, 1);
}

// With parts of 1000 elements on the shard, a tensor of 2500 goes in three calls of its own
// (1000, 1000, 500); smaller ones are grouped up to a part's bytes (4000), not the 8000 target, so
// c (1200 bytes) and d (4000) go apart.
TEST(CallPlanTest, PushCallsCutTensorsLargerThanAPartIntoParts) {
  const std::vector<TensorSpec> model = {Spec("a", 300), Spec("big", 2500), Spec("c", 300),
                                         Spec("d", 1000)};
  absl::StatusOr<CallPlan> plan = PlanCalls(model, 1, 1 << 30, 8000);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<PushCall> calls = PlanPushCalls(*plan, {3, 2, 1, 0}, {1000}, 8000);
  std::vector<std::string> got;
  for (const PushCall& c : calls) {
    std::string call;
    for (const PushPiece& p : c.pieces) {
      call += model[p.tensor].name() + "@" + std::to_string(p.offset) + "+" +
              std::to_string(p.elements) + " ";
    }
    got.push_back(call);
  }
  EXPECT_EQ(got, std::vector<std::string>({"a@0+300 ", "big@0+1000 ", "big@1000+1000 ",
                                           "big@2000+500 ", "c@0+300 ", "d@0+1000 "}));
  EXPECT_EQ(PushCallBytes(1000, 8000), 4000);
  EXPECT_EQ(PushCallBytes(0, 8000), 8000);
  EXPECT_EQ(PushCallBytes(1 << 30, 8000), 8000);
  // No parts (0): whole tensors, grouped as PlanCalls groups them.
  const std::vector<PushCall> whole = PlanPushCalls(*plan, {0, 1, 2, 3}, {0}, 8000);
  ASSERT_EQ(whole.size(), plan->groups.size());
  for (size_t c = 0; c < whole.size(); ++c) {
    std::vector<int> tensors;
    for (const PushPiece& p : whole[c].pieces) {
      tensors.push_back(p.tensor);
      EXPECT_EQ(p.offset, 0);
      EXPECT_EQ(p.elements, plan->elements[p.tensor]);
    }
    EXPECT_EQ(tensors, plan->groups[c].tensors) << "call " << c;
  }
}

TEST(CallPlanTest, BadModelsAndLimitsAreRefusedNamingTheFix) {
  EXPECT_EQ(PlanCalls({}, 1, 1 << 30).status().code(), absl::StatusCode::kInvalidArgument);
  TensorSpec bad;
  bad.set_name("bad");
  bad.add_shape(0);
  EXPECT_EQ(PlanCalls({bad}, 1, 1 << 30).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = PlanCalls({Spec("big", 4 << 20)}, 1, 8 << 20).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--max_message_mb=17"), std::string::npos) << s;
}

}  // namespace
}  // namespace rubato
