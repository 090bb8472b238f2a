// Whole-tensor placement keeps LARS and LAMB exact across shards: each shard holds every element of
// its tensors, so the per-tensor norms are complete, and a model spread over shards trains exactly
// as it does on one shard and as the optimizer library does on the averaged gradients directly.
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/optimizer.h"
#include "common/placement.h"
#include "common/tensor_bytes.h"
#include "gtest/gtest.h"
#include "server/parameter_shard.h"

namespace rubato {
namespace {

constexpr int kWorkers = 2;

struct Model {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> values;
};

Model MakeModel() {
  Model m;
  m.names = {"fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"};
  m.shapes = {{12, 8}, {8}, {8, 3}, {3}};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (const auto& shape : m.shapes) {
    std::vector<float> v(ElementCount(shape));
    for (float& x : v) x = normal(rng);
    m.values.push_back(v);
  }
  m.values[1].assign(8, 0.0f);  // A zero bias: trust ratio 1 (and excluded anyway, rank 1).
  return m;
}

ShardOptions Lamb() {
  ShardOptions o;
  o.cluster.set_num_workers(kWorkers);
  o.cluster.mutable_consistency()->set_mode(BSP);
  o.cluster.mutable_optimizer()->set_type("lamb");
  o.cluster.mutable_optimizer()->set_learning_rate(0.01);
  o.cluster.mutable_optimizer()->set_weight_decay(0.01);
  o.cluster.set_lease_ms(10000);
  o.cluster.set_wait_timeout_ms(10000);
  return o;
}

// A shard holding the tensors `which` of the model.
std::unique_ptr<ParameterShard> ShardWith(const Model& m, const std::vector<int>& which,
                                          int shard_id, int num_shards) {
  ShardOptions o = Lamb();
  o.shard_id = shard_id;
  o.num_shards = num_shards;
  auto shard = ParameterShard::Create(o);
  EXPECT_TRUE(shard.ok()) << shard.status();
  for (int w = 0; w < kWorkers; ++w) {
    RegisterRequest r;
    r.set_worker_id(w);
    r.set_batch_size(4);
    r.set_num_workers(kWorkers);
    r.mutable_consistency()->set_mode(BSP);
    for (int i : which) {
      TensorSpec* spec = r.add_model();
      spec->set_name(m.names[i]);
      for (int64_t d : m.shapes[i]) spec->add_shape(d);
      TensorValue* v = r.add_initial_values();
      v->set_name(m.names[i]);
      FloatsToBytes(m.values[i], v->mutable_data());
    }
    EXPECT_TRUE((*shard)->Register(r).ok());
  }
  return std::move(*shard);
}

std::map<std::string, std::vector<float>> PullAll(ParameterShard* shard, int64_t step) {
  absl::Notification done;
  std::map<std::string, std::vector<float>> out;
  PullRequest req;
  req.set_worker_id(0);
  req.set_step(step);
  shard->Pull(req, absl::Now() + absl::Seconds(5), [&](absl::Status s, PullResponse r) {
    EXPECT_TRUE(s.ok()) << s;
    for (const TensorValue& v : r.tensors()) {
      std::vector<float> f(v.data().size() / 4);
      BytesToFloats(v.data(), absl::MakeSpan(f));
      out[v.name()] = f;
    }
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  return out;
}

TEST(ShardedOptimizerTest, LambOnTwoShardsMatchesOneShardAndTheLibrary) {
  const Model m = MakeModel();
  std::vector<TensorSize> sizes;
  for (size_t i = 0; i < m.names.size(); ++i) {
    sizes.push_back({m.names[i], 4 * ElementCount(m.shapes[i])});
  }
  auto placement = PlaceTensors(sizes, 2);
  ASSERT_TRUE(placement.ok());
  std::vector<int> on[2];
  for (size_t i = 0; i < m.names.size(); ++i) on[placement->shard_of[i]].push_back(i);
  ASSERT_FALSE(on[0].empty());
  ASSERT_FALSE(on[1].empty());
  std::unique_ptr<ParameterShard> split[2] = {ShardWith(m, on[0], 0, 2), ShardWith(m, on[1], 1, 2)};
  std::unique_ptr<ParameterShard> whole = ShardWith(m, {0, 1, 2, 3}, 0, 1);

  // The library applied directly to the mean gradients, as the reference.
  auto optimizer = Optimizer::Create(Lamb().cluster.optimizer());
  ASSERT_TRUE(optimizer.ok()) << optimizer.status();
  std::vector<std::vector<float>> reference = m.values;
  std::vector<TensorOptimizerState> states(m.names.size());

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int step = 0; step < 5; ++step) {
    std::vector<std::vector<std::vector<float>>> grads(kWorkers);  // (worker, tensor, elements)
    for (int w = 0; w < kWorkers; ++w) {
      for (const auto& v : m.values) {
        std::vector<float> g(v.size());
        for (float& x : g) x = normal(rng);
        grads[w].push_back(g);
      }
    }
    for (int w = 0; w < kWorkers; ++w) {
      for (int s = 0; s < 2; ++s) {
        PushRequest p;
        p.set_worker_id(w);
        p.set_step(step);
        for (int i : on[s]) {
          TensorValue* v = p.add_gradients();
          v->set_name(m.names[i]);
          FloatsToBytes(grads[w][i], v->mutable_data());
        }
        ASSERT_TRUE(split[s]->Push(p).ok());
      }
      PushRequest all;
      all.set_worker_id(w);
      all.set_step(step);
      for (size_t i = 0; i < m.names.size(); ++i) {
        TensorValue* v = all.add_gradients();
        v->set_name(m.names[i]);
        FloatsToBytes(grads[w][i], v->mutable_data());
      }
      ASSERT_TRUE(whole->Push(all).ok());
    }
    for (size_t i = 0; i < m.names.size(); ++i) {
      std::vector<float> mean(m.values[i].size());
      for (size_t k = 0; k < mean.size(); ++k) {
        mean[k] = static_cast<float>((double{grads[0][i][k]} + grads[1][i][k]) * 0.5);
      }
      const TensorRole role = (*optimizer)->RoleOf(m.names[i], m.shapes[i]);
      (*optimizer)->Update(0.01f, mean, absl::MakeSpan(reference[i]), role, &states[i]);
    }
  }
  auto a = PullAll(split[0].get(), 5);
  auto b = PullAll(split[1].get(), 5);
  auto c = PullAll(whole.get(), 5);
  for (size_t i = 0; i < m.names.size(); ++i) {
    const std::string& name = m.names[i];
    const auto& sharded = placement->shard_of[i] == 0 ? a.at(name) : b.at(name);
    EXPECT_EQ(sharded, c.at(name)) << name;       // Bit-identical.
    EXPECT_EQ(c.at(name), reference[i]) << name;  // And the library's own result.
    EXPECT_NE(c.at(name), m.values[i]) << name;   // Something was trained.
  }
}

}  // namespace
}  // namespace rubato
