#include "server/checkpoint_capture.h"

#include <memory>
#include <vector>

#include "common/cluster_spec.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TensorSnapshot Weights(std::vector<float> values, int64_t version) {
  return {std::make_shared<const std::vector<float>>(std::move(values)), version};
}

TEST(CheckpointAssemblerTest, HandsOnAStepOnceEveryTensorIsInAndDropsOlderSteps) {
  std::vector<std::shared_ptr<const CapturedCheckpoint>> out;
  CheckpointAssembler assembler(
      2, [&](std::shared_ptr<const CapturedCheckpoint> c) { out.push_back(std::move(c)); });
  EXPECT_EQ(assembler.last_step(), -1);
  assembler.Add(0, 10, Weights({1, 2}, 10), TensorOptimizerState());
  assembler.Add(0, 20, Weights({3, 4}, 20), TensorOptimizerState());
  EXPECT_TRUE(out.empty());
  assembler.Add(1, 20, Weights({5}, 20), TensorOptimizerState());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0]->step, 20);
  EXPECT_EQ((*out[0]->weights[0].values)[1], 4);
  EXPECT_EQ(assembler.last_step(), 20);
  assembler.Add(1, 10, Weights({6}, 10), TensorOptimizerState());  // Step 10 was dropped.
  EXPECT_EQ(out.size(), 1u);
}

struct Fixture {
  Fixture() {
    cluster.set_num_workers(2);
    *cluster.mutable_consistency() = *ParseConsistency("bsp");
    cluster.mutable_optimizer()->set_type("sgd");
    cluster.mutable_optimizer()->set_learning_rate(0.1);
    optimizer = std::move(*Optimizer::Create(cluster.optimizer()));
    policy = std::move(*ConsistencyPolicy::Create(cluster.consistency()));
    job = {1, 2, &cluster, &optimizer->config()};
    tensors.push_back(std::make_unique<TensorAggregator>(
        "w", std::vector<int64_t>{3}, std::vector<float>{1, 2, 3}, TensorRole(), 2));
  }
  ClusterSpec cluster;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<ConsistencyPolicy> policy;
  ShardJob job;
  std::vector<std::unique_ptr<TensorAggregator>> tensors;
};

TEST(CheckpointCaptureTest, AProtoRestoresToTheSameTensors) {
  Fixture f;
  Membership members(1, 2, 1000);
  members.worker(0).batch_size = 16;
  members.worker(1).batch_size = 16;
  members.worker(0).steps_per_epoch = 5;
  members.worker(0).total_steps = 50;
  CapturedCheckpoint capture;
  capture.step = 7;
  capture.weights.push_back(Weights({4, 5, 6}, 7));
  capture.optimizer_states.emplace_back();
  const ShardCheckpoint proto =
      MakeCheckpointProto(capture, f.job, f.tensors, members, absl::FromUnixMillis(1234));
  EXPECT_EQ(proto.step(), 7);
  EXPECT_EQ(proto.global_batch(), 32);
  EXPECT_EQ(proto.total_steps(), 50);
  EXPECT_EQ(proto.written_unix_ms(), 1234);
  ASSERT_EQ(proto.workers_size(), 2);
  EXPECT_EQ(proto.workers(1).clock(), 7);

  absl::StatusOr<RestoredTensors> restored =
      RestoreTensors(proto, f.job, *f.policy, *f.optimizer, 0);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->tensors.size(), 1u);
  EXPECT_EQ(restored->index.at("w"), 0);
  EXPECT_EQ(restored->versions, 7);
  EXPECT_EQ(restored->tensors[0]->version(), 7);
  EXPECT_EQ(*restored->tensors[0]->Snapshot().values, (std::vector<float>{4, 5, 6}));
}

TEST(CheckpointCaptureTest, AnotherJobsOrAnInconsistentCheckpointIsRefused) {
  Fixture f;
  Membership members(1, 2, 1000);
  CapturedCheckpoint capture;
  capture.step = 7;
  capture.weights.push_back(Weights({4, 5, 6}, 7));
  capture.optimizer_states.emplace_back();
  const ShardCheckpoint good =
      MakeCheckpointProto(capture, f.job, f.tensors, members, absl::UnixEpoch());
  ShardCheckpoint c = good;
  c.set_shard_id(0);
  absl::Status s = RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("its shard is 0, this shard's 1"), std::string::npos) << s;
  c = good;
  c.mutable_cluster()->mutable_optimizer()->set_type("adam");
  EXPECT_EQ(RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  c = good;
  c.mutable_tensors(0)->set_version(6);  // bsp: every tensor at the checkpoint's step.
  s = RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("not the checkpoint's step 7"), std::string::npos) << s;
  c = good;
  c.mutable_tensors(0)->set_values("abc");
  EXPECT_EQ(RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status().code(),
            absl::StatusCode::kDataLoss);
  c = good;
  *c.add_tensors() = c.tensors(0);
  s = RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status();
  EXPECT_NE(s.message().find("appears twice"), std::string::npos) << s;
  c = good;
  c.clear_tensors();
  EXPECT_EQ(RestoreTensors(c, f.job, *f.policy, *f.optimizer, 0).status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace rubato
