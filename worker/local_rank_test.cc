#include "worker/local_rank.h"

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace rubato {
namespace {

// An environment of its own, so that the test's does not leak in.
struct Env {
  std::map<std::string, std::string> vars;
  std::function<const char*(const char*)> Get() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

TEST(LocalRankTest, FlagThenEachVariableInOrderThenWorkerId) {
  Env env;
  env.vars = {{"LOCAL_RANK", "3"},
              {"SLURM_LOCALID", "2"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
              {"MPI_LOCALRANKID", "0"}};
  absl::StatusOr<LocalRank> r = FindLocalRank(5, 9, env.Get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 5);
  EXPECT_EQ(r->source, "--local_rank");
  const int expected[] = {3, 2, 1, 0};
  for (int i = 0; i < 4; ++i) {
    r = FindLocalRank(-1, 9, env.Get());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->rank, expected[i]);
    EXPECT_EQ(r->source, kLocalRankVariables[i]);
    env.vars.erase(kLocalRankVariables[i]);
  }
  r = FindLocalRank(-1, 9, env.Get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 9);
  EXPECT_EQ(r->source, "the worker id");
}

TEST(LocalRankTest, EmptyVariableIsSkipped) {
  Env env;
  env.vars = {{"LOCAL_RANK", ""}, {"SLURM_LOCALID", "4"}};
  absl::StatusOr<LocalRank> r = FindLocalRank(-1, 0, env.Get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 4);
  EXPECT_EQ(r->source, "SLURM_LOCALID");
}

TEST(LocalRankTest, BadValuesNamed) {
  Env env;
  EXPECT_EQ(FindLocalRank(-2, 0, env.Get()).status().message(), "--local_rank=-2 < -1");
  env.vars = {{"SLURM_LOCALID", "x1"}};
  EXPECT_EQ(FindLocalRank(-1, 0, env.Get()).status().message(),
            "SLURM_LOCALID=x1 in the environment is not a rank >= 0");
  env.vars = {{"LOCAL_RANK", "-1"}};
  EXPECT_EQ(FindLocalRank(-1, 0, env.Get()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
