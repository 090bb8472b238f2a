#include "server/shard_options.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace rubato {
namespace {

ShardOptions Valid(ConsistencyMode mode = BSP) {
  ShardOptions o;
  o.shard_id = 1;
  o.num_shards = 2;
  o.cluster.set_num_workers(4);
  o.cluster.mutable_consistency()->set_mode(mode);
  o.cluster.mutable_optimizer()->set_type("sgd");
  o.cluster.mutable_optimizer()->set_learning_rate(0.1);
  o.cluster.set_lease_ms(10000);
  o.cluster.set_wait_timeout_ms(10000);
  return o;
}

void ExpectRefused(const ShardOptions& o, const std::string& says) {
  const absl::Status s = ValidateShardOptions(o);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find(says), std::string::npos) << s;
}

TEST(ShardOptionsTest, EachBadOptionIsRefusedByName) {
  EXPECT_TRUE(ValidateShardOptions(Valid()).ok()) << ValidateShardOptions(Valid());
  ShardOptions o = Valid();
  o.shard_id = 2;
  ExpectRefused(o, "shard_id 2 is not in [0, num_shards=2)");
  o = Valid();
  o.shard_id = -1;
  ExpectRefused(o, "shard_id -1");
  o = Valid();
  o.num_shards = 0;
  ExpectRefused(o, "num_shards=0");
  o = Valid();
  o.cluster.set_num_workers(0);
  ExpectRefused(o, "num_workers");
  o = Valid();
  o.update_threads = 0;
  ExpectRefused(o, "update_threads must be >= 1, got 0");
  o = Valid();
  o.apply_threads = 257;
  ExpectRefused(o, "apply_threads must be in [1, 256], got 257");
  o = Valid();
  o.clock = nullptr;
  ExpectRefused(o, "clock");
}

TEST(ShardOptionsTest, APartSizeIsTheOptionsOnlyWhereThePolicyPushesInParts) {
  ShardOptions bsp = Valid(BSP);
  const std::unique_ptr<ConsistencyPolicy> sync =
      std::move(*ConsistencyPolicy::Create(bsp.cluster.consistency()));
  const int64_t policy_parts = PartElementsFor(bsp, *sync);
  EXPECT_GT(policy_parts, 0);
  EXPECT_EQ(policy_parts, sync->PartElements(4, bsp.push_budget_bytes));
  bsp.part_elements = 8;
  EXPECT_EQ(PartElementsFor(bsp, *sync), 8);
  bsp.part_elements = 0;
  EXPECT_EQ(PartElementsFor(bsp, *sync), 0) << "0: whole tensors";

  ShardOptions async = Valid(ASYNC);
  const std::unique_ptr<ConsistencyPolicy> free =
      std::move(*ConsistencyPolicy::Create(async.cluster.consistency()));
  async.part_elements = 8;
  EXPECT_EQ(PartElementsFor(async, *free), 0) << "async pushes whole tensors";
}

}  // namespace
}  // namespace rubato
