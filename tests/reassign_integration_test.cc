// Work reassignment end to end (issue 33 item 1): real rubato_server and rubato_worker processes,
// async with --reassign, one worker slowed 8x. Every unit of every epoch is drawn exactly once
// across the workers (so, by worker/data/unit_batcher_test, every example once per epoch), the
// fast workers take units of the slow one's share, and a run replayed from the unit records draws
// the same units on the same workers in the same order.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr int kWorkers = 3;
// 3000 examples: shares of 1000, batches of 16 (62 whole and one of 8 per share and epoch), units
// of 2 batches (32 units per share).
constexpr int kEpochs = 2;
constexpr int kBatchesPerShare = 63;
constexpr int kUnitsPerShare = 32;
const std::vector<std::string> kClusterFlags = {
    "--mode=async", "--reassign=true", "--reassign_unit_batches=2", "--learning_rate=0.05"};

using Unit = std::tuple<int64_t, int64_t, int64_t>;  // (epoch, owner, index)

std::vector<Unit> UnitsOf(const std::string& out) {
  std::vector<Unit> units;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(out, '\n'))) {
    if (absl::StrContains(line, "\"event\":\"unit\"")) {
      units.emplace_back(JsonIntField(line, "epoch"), JsonIntField(line, "owner"), JsonIntField(line, "unit"));
    }
  }
  return units;
}

// Runs the job; returns each worker's stdout and shard 0's stderr.
void RunJob(const std::vector<std::string>& extra, std::vector<std::string>* outs,
            std::string* server_log) {
  auto cluster = TestCluster::Create();
  ASSERT_TRUE(IsOk(cluster));
  TestServerOptions options;
  options.num_workers = kWorkers;
  options.extra_flags = kClusterFlags;
  ASSERT_TRUE(IsOk((*cluster)->StartServers(options)));
  for (int w = 0; w < kWorkers; ++w) {
    std::vector<std::string> flags = kClusterFlags;
    for (const char* f : {"--train_limit=3000", "--test_limit=500", "--batch_size=16",
                          "--eval_every=1000", "--log_every=20", "--min_step_ms=2"}) {
      flags.push_back(f);
    }
    flags.push_back(absl::StrCat("--data_dir=", kFashionMnistDir));
    flags.push_back(absl::StrCat("--epochs=", kEpochs));
    if (w == kWorkers - 1) flags.push_back("--slowdown=8");
    flags.insert(flags.end(), extra.begin(), extra.end());
    ASSERT_TRUE(IsOk((*cluster)->StartWorker(w, flags)));
  }
  absl::StatusOr<std::map<int, int>> exits = (*cluster)->WaitForWorkers(absl::Seconds(150));
  ASSERT_TRUE(IsOk(exits));
  outs->clear();
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(exits->at(w), 0) << (*cluster)->worker(w)->ReadStderr();
    outs->push_back((*cluster)->worker(w)->ReadStdout());
  }
  EXPECT_TRUE(IsOk((*cluster)->StopServers(absl::Seconds(15))));
  *server_log = (*cluster)->server(0)->ReadStderr();
}

TEST(ReassignIntegrationTest, EveryUnitOnceAndTheSlowWorkersShareMovesToTheFastOnes) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kFashionMnistDir;
  std::vector<std::string> outs;
  std::string server_log;
  RunJob({}, &outs, &server_log);
  ASSERT_EQ(outs.size(), static_cast<size_t>(kWorkers));
  std::map<Unit, int> drawn;
  int64_t steps = 0, reassigned = 0;
  std::vector<int64_t> units_of(kWorkers, 0);
  for (int w = 0; w < kWorkers; ++w) {
    for (const Unit& u : UnitsOf(outs[w])) ++drawn[u];
    const std::string done = DoneLine(outs[w]);
    ASSERT_FALSE(done.empty()) << outs[w];
    steps += JsonIntField(done, "computed_steps");
    units_of[w] = JsonIntField(done, "units");
    reassigned += JsonIntField(done, "reassigned_units");
    EXPECT_EQ(units_of[w], static_cast<int64_t>(UnitsOf(outs[w]).size()));
  }
  for (int64_t e = 0; e < kEpochs; ++e) {
    for (int64_t o = 0; o < kWorkers; ++o) {
      for (int64_t k = 0; k < kUnitsPerShare; ++k) {
        EXPECT_EQ(drawn[Unit(e, o, k)], 1)
            << "unit " << k << " of worker " << o << "'s share of epoch " << e;
      }
    }
  }
  EXPECT_EQ(drawn.size(), static_cast<size_t>(kEpochs * kWorkers * kUnitsPerShare));
  // Every batch of every share once: the job's steps are the data's, however they were spread.
  EXPECT_EQ(steps, kEpochs * kWorkers * kBatchesPerShare);
  // The slow worker drew fewer units than its share; the fast ones took the rest.
  EXPECT_LT(units_of[kWorkers - 1], kEpochs * kUnitsPerShare);
  EXPECT_GT(reassigned, 0);
  EXPECT_TRUE(absl::StrContains(server_log, "reassign: worker")) << server_log;
  std::printf("units drawn per worker: %lld %lld %lld (%lld reassigned)\n",
              static_cast<long long>(units_of[0]), static_cast<long long>(units_of[1]),
              static_cast<long long>(units_of[2]), static_cast<long long>(reassigned));

  // Replayed from the unit records: the same units, on the same workers, in the same order.
  const std::string log = absl::StrCat(std::getenv("TEST_TMPDIR"), "/units.jsonl");
  {
    std::ofstream f(log);
    for (const std::string& out : outs) f << out;
  }
  std::vector<std::string> replayed;
  RunJob({absl::StrCat("--reassign_replay=", log)}, &replayed, &server_log);
  ASSERT_EQ(replayed.size(), static_cast<size_t>(kWorkers));
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(UnitsOf(replayed[w]), UnitsOf(outs[w])) << "worker " << w;
  }
  EXPECT_FALSE(absl::StrContains(server_log, "reassign: worker"))
      << "a replayed run asked shard 0 for work:\n"
      << server_log;
}

}  // namespace
}  // namespace rubato
