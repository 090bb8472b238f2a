// For tests of TensorAggregator and what it feeds: a Context with SGD at a constant rate, the
// given consistency mode and every one of `workers` a member. Not copyable (the context points
// into it).
#ifndef RUBATO_SERVER_AGGREGATOR_TEST_CONTEXT_H_
#define RUBATO_SERVER_AGGREGATOR_TEST_CONTEXT_H_

#include <memory>
#include <optional>
#include <utility>

#include "common/lr_schedule.h"
#include "common/optimizer.h"
#include "proto/cluster.pb.h"
#include "server/consistency_policy.h"
#include "server/tensor_aggregator.h"

namespace rubato {

struct AggregatorTestContext {
  AggregatorTestContext(const ConsistencyConfig& consistency, int workers, double learning_rate,
                        int64_t total_steps)
      : policy(std::move(*ConsistencyPolicy::Create(consistency))) {
    OptimizerConfig config;
    config.set_type("sgd");
    config.set_learning_rate(learning_rate);
    optimizer = std::move(*Optimizer::Create(config));
    schedule.emplace(
        *LearningRateScheduler::Create(learning_rate, LearningRateSchedule(), {1, 1, total_steps}));
    auto m = std::make_shared<TensorAggregator::Members>();
    m->member.assign(workers, 1);
    m->count = workers;
    members = m;
    ctx.policy = policy.get();
    ctx.optimizer = optimizer.get();
    ctx.members = &members;
    ctx.schedule = &*schedule;
  }
  AggregatorTestContext(const AggregatorTestContext&) = delete;
  AggregatorTestContext& operator=(const AggregatorTestContext&) = delete;

  void SetMember(int w, bool on) {
    auto m = std::make_shared<TensorAggregator::Members>(*members);
    m->member[w] = on ? 1 : 0;
    m->count += on ? 1 : -1;
    members = m;
  }

  std::unique_ptr<ConsistencyPolicy> policy;
  std::unique_ptr<Optimizer> optimizer;
  std::optional<LearningRateScheduler> schedule;
  std::shared_ptr<const TensorAggregator::Members> members;
  TensorAggregator::Context ctx;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_AGGREGATOR_TEST_CONTEXT_H_
