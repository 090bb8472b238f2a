#include "worker/call_plan.h"

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
