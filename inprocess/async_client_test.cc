// PsClient's asynchronous whole pull and push (StartPull, StartPushAll: what the simulator drives
// every worker with, sim/README.md) against a real shard in process: they end by callback, a bsp
// pull only once every worker's gradient is in, with what the synchronous calls give.
#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "inprocess/in_process_shard_channel.h"
#include "server/parameter_shard.h"
#include "worker/ps/ps_client.h"

namespace rubato {
namespace {

const std::vector<float> kInitial = {1.0f, 2.0f, 3.0f, 4.0f};

ClusterSpec Bsp() {
  ClusterSpec c;
  c.set_num_workers(2);
  c.mutable_consistency()->set_mode(BSP);
  c.mutable_optimizer()->set_type("sgd");
  c.mutable_optimizer()->set_learning_rate(0.5);
  c.set_lease_ms(30000);
  c.set_wait_timeout_ms(30000);
  return c;
}

std::unique_ptr<PsClient> Client(ParameterShard* shard, int worker) {
  PsClientOptions o;
  o.worker_id = worker;
  o.num_workers = 2;
  o.consistency = Bsp().consistency();
  o.steps_per_epoch = 10;
  o.total_steps = 10;
  TensorSpec t;
  t.set_name("w");
  t.add_shape(4);
  o.model.push_back(t);
  auto client = CreatePsClient(o, InProcessChannels({shard}));
  EXPECT_TRUE(client.ok()) << client.status();
  return std::move(*client);
}

struct Pulled {
  absl::Notification done;
  absl::Status status;
  int64_t min_version = -2;
};

struct Pushed {
  absl::Notification done;
  absl::Status status;
  PsClient::PushResult result;
};

TEST(AsyncClientTest, ABspPullEndsByCallbackOnceEveryWorkerHasPushed) {
  ShardOptions so;
  so.cluster = Bsp();
  auto shard = ParameterShard::Create(so);
  ASSERT_TRUE(shard.ok()) << shard.status();
  std::unique_ptr<PsClient> c0 = Client(shard->get(), 0);
  std::unique_ptr<PsClient> c1 = Client(shard->get(), 1);
  ASSERT_TRUE(c0->supports_async());
  std::vector<std::vector<float>> p0 = {kInitial}, p1 = {kInitial};
  ASSERT_TRUE(c0->Register(p0, 16, 0).ok());
  ASSERT_TRUE(c1->Register(p1, 16, 0).ok());

  const std::vector<std::vector<float>> g0 = {{1, 1, 1, 1}}, g1 = {{3, 3, 3, 3}};
  Pushed push0;
  c0->StartPushAll(0, g0, [&](absl::Status s, PsClient::PushResult r) {
    push0.status = std::move(s);
    push0.result = std::move(r);
    push0.done.Notify();
  });
  ASSERT_TRUE(push0.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(push0.status.ok()) << push0.status;
  EXPECT_EQ(push0.result.dropped, 0);

  Pulled pull0;
  c0->StartPull(1, absl::MakeSpan(p0), [&](absl::Status s, int64_t v) {
    pull0.status = std::move(s);
    pull0.min_version = v;
    pull0.done.Notify();
  });
  // Step 0 lacks worker 1's gradient: the pull of step 1 waits at the shard, not in the caller.
  EXPECT_FALSE(pull0.done.HasBeenNotified());

  Pushed push1;
  c1->StartPushAll(0, g1, [&](absl::Status s, PsClient::PushResult r) {
    push1.status = std::move(s);
    push1.done.Notify();
  });
  ASSERT_TRUE(push1.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(push1.status.ok()) << push1.status;
  ASSERT_TRUE(pull0.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(pull0.status.ok()) << pull0.status;
  EXPECT_EQ(pull0.min_version, 1);

  // The same weights as a synchronous pull: each moved down by the same amount (the mean
  // gradient, 2, is the same in every element).
  ASSERT_TRUE(c1->Pull(1, absl::MakeSpan(p1)).ok());
  EXPECT_EQ(p0, p1);
  const float moved = kInitial[0] - p0[0][0];
  EXPECT_GT(moved, 0);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(kInitial[i] - p0[0][i], moved) << i;
}

TEST(AsyncClientTest, BadShapesEndAtOnceWithTheReason) {
  ShardOptions so;
  so.cluster = Bsp();
  auto shard = ParameterShard::Create(so);
  ASSERT_TRUE(shard.ok()) << shard.status();
  std::unique_ptr<PsClient> c0 = Client(shard->get(), 0);
  std::vector<std::vector<float>> two(2);
  std::optional<absl::Status> pulled;
  c0->StartPull(0, absl::MakeSpan(two), [&](absl::Status s, int64_t v) {
    pulled = s;
    EXPECT_EQ(v, -1);
  });
  ASSERT_TRUE(pulled.has_value());
  EXPECT_EQ(pulled->code(), absl::StatusCode::kInvalidArgument) << *pulled;
  std::optional<absl::Status> pushed;
  const std::vector<std::vector<float>> short_grad = {{1, 2}};
  c0->StartPushAll(0, short_grad, [&](absl::Status s, PsClient::PushResult) { pushed = s; });
  ASSERT_TRUE(pushed.has_value());
  EXPECT_EQ(pushed->code(), absl::StatusCode::kInvalidArgument) << *pushed;
}

}  // namespace
}  // namespace rubato
