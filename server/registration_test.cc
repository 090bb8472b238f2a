#include "server/registration.h"

#include <memory>
#include <string>
#include <vector>

#include "common/cluster_spec.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

ClusterSpec Job() {
  ClusterSpec cluster;
  cluster.set_num_workers(2);
  *cluster.mutable_consistency() = *ParseConsistency("bsp");
  return cluster;
}

RegisterRequest Request(int worker) {
  RegisterRequest r;
  r.set_worker_id(worker);
  r.set_num_workers(2);
  *r.mutable_consistency() = *ParseConsistency("bsp");
  r.set_batch_size(8);
  r.set_steps_per_epoch(10);
  r.set_total_steps(100);
  TensorSpec* w = r.add_model();
  w->set_name("w");
  w->add_shape(2);
  w->add_shape(2);
  return r;
}

absl::Status Validate(const RegisterRequest& r) {
  absl::flat_hash_map<std::string, int> index;
  return ValidateRegisterRequest(r, Job(), /*shard_id=*/1, &index);
}

TEST(ValidateRegisterRequestTest, AcceptsAGoodRequestAndIndexesItsModel) {
  absl::flat_hash_map<std::string, int> index;
  ASSERT_TRUE(ValidateRegisterRequest(Request(1), Job(), 1, &index).ok());
  EXPECT_EQ(index.at("w"), 0);
}

TEST(ValidateRegisterRequestTest, RefusesEachBadFieldNamingIt) {
  RegisterRequest r = Request(2);
  EXPECT_EQ(Validate(r).code(), absl::StatusCode::kInvalidArgument);
  r = Request(0);
  r.set_num_workers(3);
  absl::Status s = Validate(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("job mismatch: shard 1 runs 2 workers"), std::string::npos) << s;
  r = Request(0);
  r.set_total_steps(-1);
  EXPECT_NE(Validate(r).message().find("total_steps"), std::string::npos);
  r = Request(0);
  r.clear_model();
  EXPECT_NE(Validate(r).message().find("empty model"), std::string::npos);
  r = Request(0);
  r.set_batch_size(0);
  EXPECT_NE(Validate(r).message().find("batch_size"), std::string::npos);
  r = Request(0);
  *r.add_model() = r.model(0);
  EXPECT_NE(Validate(r).message().find("appears twice"), std::string::npos);
  r = Request(0);
  r.mutable_model(0)->add_shape(-1);
  EXPECT_EQ(Validate(r).code(), absl::StatusCode::kInvalidArgument);
  r = Request(0);
  TensorValue* v = r.add_initial_values();
  v->set_name("w");
  v->set_data(std::string(12, '\0'));  // 3 floats for 4.
  EXPECT_EQ(Validate(r).code(), absl::StatusCode::kInvalidArgument);
  r.mutable_initial_values(0)->set_name("x");
  r.mutable_initial_values(0)->set_data(std::string(16, '\0'));
  EXPECT_NE(Validate(r).message().find("initial value 0 is 'x'"), std::string::npos);
}

TEST(CheckModelMatchesTest, NamesTheFirstDifference) {
  std::vector<std::unique_ptr<TensorAggregator>> tensors;
  tensors.push_back(std::make_unique<TensorAggregator>("w", std::vector<int64_t>{2, 2},
                                                       std::vector<float>(4), TensorRole(), 2));
  absl::flat_hash_map<std::string, int> index = {{"w", 0}};
  RegisterRequest r = Request(1);
  absl::flat_hash_map<std::string, int> model_index = {{"w", 0}};
  EXPECT_TRUE(CheckModelMatches(tensors, index, r, model_index, 0).ok());
  r.mutable_model(0)->set_shape(1, 3);
  absl::Status s = CheckModelMatches(tensors, index, r, model_index, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("tensor 'w' is [2,2] on the server but [2,3] on worker 1"),
            std::string::npos)
      << s;
  r = Request(1);
  TensorSpec* extra = r.add_model();
  extra->set_name("b");
  extra->add_shape(2);
  model_index["b"] = 1;
  s = CheckModelMatches(tensors, index, r, model_index, 0);
  EXPECT_NE(s.message().find("has tensor 'b' which the server does not"), std::string::npos) << s;
  model_index.erase("w");
  s = CheckModelMatches(tensors, index, r, model_index, 0);
  EXPECT_NE(s.message().find("has no tensor 'w'"), std::string::npos) << s;
}

TEST(InitialValuesElectionTest, AsksOneRegistrantUntilItsGrantRunsOut) {
  InitialValuesElection election(absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(100);
  EXPECT_TRUE(election.Ask(2, t0));
  EXPECT_FALSE(election.Ask(0, t0 + absl::Seconds(5)));
  EXPECT_TRUE(election.Ask(2, t0 + absl::Seconds(6)));  // The one asked, again.
  EXPECT_FALSE(election.Ask(1, t0 + absl::Seconds(16)));
  EXPECT_TRUE(election.Ask(1, t0 + absl::Seconds(17)));  // 2 was silent for longer than 10 s.
  EXPECT_FALSE(election.Ask(2, t0 + absl::Seconds(18)));
}

}  // namespace
}  // namespace rubato
