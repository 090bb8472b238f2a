#include "server/push_pipeline.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor_bytes.h"
#include "gtest/gtest.h"
#include "proto/cluster.pb.h"
#include "server/aggregator_test_context.h"

namespace rubato {
namespace {

// The shard's side, faked: two tensors under async (each gradient applied on arrival), SGD at
// rate 1, and what the pipeline asked recorded.
class FakeStages : public PushStages {
 public:
  FakeStages() : test_(Async(), 2, /*learning_rate=*/1.0, /*total_steps=*/100) {
    tensors.push_back(std::make_unique<TensorAggregator>("a", std::vector<int64_t>{4},
                                                         std::vector<float>(4), TensorRole(), 2));
    tensors.push_back(std::make_unique<TensorAggregator>(
        "big", std::vector<int64_t>{kBig}, std::vector<float>(kBig), TensorRole(), 2));
    index = {{"a", 0}, {"big", 1}};
  }
  static constexpr int64_t kBig = (int64_t{1} << 20) / 4 + 1;  // Just over the inline limit.

  static ConsistencyConfig Async() {
    ConsistencyConfig c;
    c.set_mode(ASYNC);
    return c;
  }

  absl::Status CheckState(const WirePush&) override { return state; }
  TensorAggregator::Context Context() const override { return test_.ctx; }
  absl::Status Admit(const WirePush&) override {
    ++admitted;
    return admit;
  }
  void Apply(int worker, int64_t step, const GradientTarget& target, const ByteChunks* data,
             std::shared_ptr<const void> keepalive, std::function<void(absl::Status)> on_added,
             GradientOutcome* outcome) override {
    Released released;
    tensors[target.tensor]->Add(test_.ctx, worker, step,
                                {data, std::move(keepalive), std::move(on_added)}, outcome,
                                &released);
    ++applied;
  }
  void Annotate(int64_t step, PushResponse* response) const override {
    response->set_max_staleness(0);
  }
  void Count(bool accepted) override { ++(accepted ? accepted_count : rejected_count); }
  void Post(std::function<void()> task) override {
    ++posted;
    task();
  }

  std::vector<std::unique_ptr<TensorAggregator>> tensors;
  absl::flat_hash_map<std::string, int> index;
  absl::Status state;
  absl::Status admit;
  int admitted = 0, applied = 0, posted = 0, accepted_count = 0, rejected_count = 0;

 private:
  AggregatorTestContext test_;
};

struct Gradient {
  std::string name;
  std::string bytes;
};

absl::StatusOr<PushResponse> RunPush(FakeStages* stages, const std::vector<Gradient>& gradients) {
  PushPipeline pipeline(0, &stages->tensors, &stages->index, stages);
  WirePush push;
  push.worker_id = 0;
  push.step = 0;
  for (const Gradient& g : gradients) {
    WireTensor t;
    t.name = g.name;
    t.data = ByteChunks(g.bytes);
    push.gradients.push_back(std::move(t));
  }
  absl::StatusOr<PushResponse> answer = absl::UnknownError("not answered");
  int answers = 0;
  pipeline.Push(std::move(push), nullptr, [&](absl::StatusOr<PushResponse> r) {
    answer = std::move(r);
    ++answers;
  });
  EXPECT_EQ(answers, 1);  // Inline or on the (inline) fake pool: answered before Push returns.
  return answer;
}

std::string Floats(std::vector<float> values) {
  std::string bytes;
  FloatsToBytes(values, &bytes);
  return bytes;
}

TEST(PushPipelineTest, ChecksAdmitsAndAppliesEveryGradientOnTheCallingThread) {
  FakeStages stages;
  absl::StatusOr<PushResponse> r = RunPush(&stages, {{"a", Floats({1, 2, 3, 4})}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->accepted(), 1);
  EXPECT_EQ(stages.applied, 1);
  EXPECT_EQ(stages.posted, 0);
  EXPECT_EQ(stages.accepted_count, 1);
  EXPECT_EQ(*stages.tensors[0]->Snapshot().values, (std::vector<float>{-1, -2, -3, -4}));
}

TEST(PushPipelineTest, ALargePushRunsOnThePool) {
  FakeStages stages;
  std::vector<float> big(FakeStages::kBig, 1.0f);
  absl::StatusOr<PushResponse> r =
      RunPush(&stages, {{"a", Floats({1, 1, 1, 1})}, {"big", Floats(big)}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->accepted(), 2);
  EXPECT_EQ(stages.posted, 4);  // Two checks, two applications.
}

TEST(PushPipelineTest, ABadValueAnywhereAppliesNothing) {
  FakeStages stages;
  absl::StatusOr<PushResponse> r = RunPush(
      &stages,
      {{"a", Floats({1, 1, 1, 1})}, {"big", Floats(std::vector<float>(FakeStages::kBig, NAN))}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("gradient 'big'"), std::string::npos) << r.status();
  EXPECT_EQ(stages.applied, 0);
  EXPECT_EQ(stages.admitted, 0);
  EXPECT_EQ(stages.rejected_count, 1);
  EXPECT_EQ(*stages.tensors[0]->Snapshot().values, (std::vector<float>(4, 0)));
}

TEST(PushPipelineTest, RefusesUnknownRepeatedAndMisplacedGradientsBeforeReadingValues) {
  FakeStages stages;
  EXPECT_NE(
      RunPush(&stages, {{"nope", Floats({1})}}).status().message().find("unknown tensor 'nope'"),
      std::string::npos);
  EXPECT_NE(RunPush(&stages, {{"a", Floats({1, 1, 1, 1})}, {"a", Floats({1, 1, 1, 1})}})
                .status()
                .message()
                .find("appears twice"),
            std::string::npos);
  EXPECT_EQ(RunPush(&stages, {{"a", Floats({1, 1, 1})}}).status().code(),
            absl::StatusCode::kInvalidArgument);  // Wrong size.
  EXPECT_EQ(stages.applied, 0);
  EXPECT_EQ(stages.rejected_count, 3);
}

TEST(PushPipelineTest, TheShardsRefusalAtCheckOrAdmissionAppliesNothing) {
  FakeStages stages;
  stages.state = absl::FailedPreconditionError("training has not started");
  EXPECT_EQ(RunPush(&stages, {{"a", Floats({1, 1, 1, 1})}}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  stages.state = absl::OkStatus();
  stages.admit = absl::AbortedError("worker 0 was dropped");
  EXPECT_EQ(RunPush(&stages, {{"a", Floats({1, 1, 1, 1})}}).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(stages.applied, 0);
  // An empty push is admitted (a lease renewal) and answered at once.
  stages.admit = absl::OkStatus();
  absl::StatusOr<PushResponse> empty = RunPush(&stages, {});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->accepted(), 0);
  EXPECT_EQ(stages.accepted_count, 1);
}

}  // namespace
}  // namespace rubato
