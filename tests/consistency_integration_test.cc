// Every consistency model end to end: 2 server shards and 3 worker processes on 127.0.0.1 train the
// MLP on a subset of Fashion-MNIST; every process must exit cleanly, every worker must learn well
// above chance (10%), and each shard's final statistics (printed as it exits) must show the mode's
// own signature, so that a server that ignored --mode fails:
//   bsp       every gradient applied with staleness 0, one update per tensor per step
//   backup:1  one update per tensor per step from exactly 2 of the 3 workers' gradients
//   async     every gradient applied alone on arrival (3 updates per tensor per step), some stale
//   ssp:2     every gradient applied alone on arrival, as async
//   adaptive  (worker 2 four times slower) shard 0 decides every 10 steps, the first decision
//             leaves worker 2 out, and shard 1 applies the same decisions, learned from the
//             workers' relays over the data plane
//   adaptive  (each step one worker delayed, in turn) shard 0 chooses ssp: every gradient of
//             every step applied, some computed on weights a step or more old, and the same
//             decisions on both shards
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/parameter_server.pb.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr const char* kDataDir = kFashionMnistDir;
constexpr int kWorkers = 3;
constexpr int64_t kSteps = 80;

// What a shard's statistics must show at the end.
enum class Signature { kBsp, kBackup1, kOnArrival, kAdaptive, kAdaptiveSsp };

struct ModeCase {
  const char* name;
  const char* mode;
  std::vector<std::string> extra;  // Flags for servers and workers.
  double min_accuracy;
  Signature signature;
  std::vector<std::string> worker_extra = {};  // Flags for the workers only.
  std::string delay_trace = "";                // Written to a file given as --delay_trace.
};

// Each step one of the 3 workers is delayed 12 ms (on a 20 ms floor), a different one each step.
std::string RotatingDelayTrace() {
  std::string trace = "# step worker delay_ms\n";
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StrAppend(&trace, step, " ", step % kWorkers, " 12\n");
  }
  return trace;
}

// The {"event":"stats",...} line a server prints on stdout as it exits, as GetStatsResponse.
absl::StatusOr<GetStatsResponse> FinalStats(const std::string& server_stdout) {
  for (absl::string_view line : absl::StrSplit(server_stdout, '\n')) {
    if (!absl::StrContains(line, "\"event\":\"stats\"")) continue;
    GetStatsResponse stats;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;  // "event"
    const auto status =
        google::protobuf::util::JsonStringToMessage(std::string(line), &stats, options);
    if (!status.ok()) return absl::InvalidArgumentError(status.ToString());
    return stats;
  }
  return absl::NotFoundError(absl::StrCat("no stats line in: ", server_stdout));
}

void ExpectSignature(const GetStatsResponse& stats, Signature signature) {
  const int64_t tensors = stats.tensors_size();
  ASSERT_GT(tensors, 0);
  int64_t gradients = 0, stale = 0;
  for (int b = 0; b < stats.staleness_histogram_size(); ++b) {
    gradients += stats.staleness_histogram(b);
    if (b > 0) stale += stats.staleness_histogram(b);
  }
  const std::string shard = absl::StrCat("shard ", stats.shard_id());
  switch (signature) {
    case Signature::kBsp:
      EXPECT_EQ(gradients, kWorkers * kSteps * tensors) << shard;
      EXPECT_EQ(stale, 0) << shard;
      EXPECT_EQ(stats.dropped_gradients(), 0) << shard;
      EXPECT_EQ(stats.applied_updates(), kSteps * tensors) << shard;
      for (const TensorStats& t : stats.tensors()) EXPECT_EQ(t.version(), kSteps) << t.name();
      break;
    case Signature::kBackup1:
      // Each step is applied on its second gradient; the third comes late (dropped) or never (its
      // worker skipped ahead).
      EXPECT_EQ(gradients, (kWorkers - 1) * kSteps * tensors) << shard;
      EXPECT_EQ(stale, 0) << shard;
      EXPECT_LE(stats.dropped_gradients(), kSteps * tensors) << shard;
      EXPECT_EQ(stats.applied_updates(), kSteps * tensors) << shard;
      for (const TensorStats& t : stats.tensors()) EXPECT_EQ(t.version(), kSteps) << t.name();
      break;
    case Signature::kAdaptive:
      // Steps 1..10 bsp, then what shard 0 decided: some steps without worker 2's gradient.
      EXPECT_LT(gradients, kWorkers * kSteps * tensors) << shard;
      EXPECT_GE(gradients, (kWorkers - 1) * kSteps * tensors) << shard;
      EXPECT_EQ(stale, 0) << shard;
      EXPECT_EQ(stats.applied_updates(), kSteps * tensors) << shard;
      for (const TensorStats& t : stats.tensors()) EXPECT_EQ(t.version(), kSteps) << t.name();
      EXPECT_GE(stats.consistency_plan_size(), 1) << shard;
      break;
    case Signature::kAdaptiveSsp:
      // ssp periods: every member's gradient in every step, some of them computed on weights
      // that lacked the last step or more.
      EXPECT_EQ(gradients, kWorkers * kSteps * tensors) << shard;
      EXPECT_GT(stale, 0) << shard << ": no gradient was computed on older weights";
      EXPECT_EQ(stats.dropped_gradients(), 0) << shard;
      EXPECT_EQ(stats.applied_updates(), kSteps * tensors) << shard;
      for (const TensorStats& t : stats.tensors()) EXPECT_EQ(t.version(), kSteps) << t.name();
      EXPECT_GE(stats.consistency_plan_size(), 1) << shard;
      break;
    case Signature::kOnArrival:
      EXPECT_EQ(gradients, kWorkers * kSteps * tensors) << shard;
      EXPECT_GT(stale, 0) << shard << ": three workers never overtook each other";
      EXPECT_EQ(stats.dropped_gradients(), 0) << shard;
      EXPECT_EQ(stats.applied_updates(), kWorkers * kSteps * tensors) << shard;
      for (const TensorStats& t : stats.tensors()) {
        EXPECT_EQ(t.version(), kWorkers * kSteps) << t.name();
      }
      break;
  }
}

class ConsistencyIntegrationTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(ConsistencyIntegrationTest, TwoShardsThreeWorkersLearn) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  const ModeCase& c = GetParam();
  auto cluster = TestCluster::Create();
  ASSERT_TRUE(IsOk(cluster));
  TestServerOptions options;
  options.num_shards = 2;
  options.num_workers = kWorkers;
  options.extra_flags = {absl::StrCat("--mode=", c.mode), "--learning_rate=0.1"};
  options.extra_flags.insert(options.extra_flags.end(), c.extra.begin(), c.extra.end());
  ASSERT_TRUE(IsOk((*cluster)->StartServers(options)));
  std::vector<std::string> flags = {absl::StrCat("--data_dir=", kDataDir),
                                    absl::StrCat("--mode=", c.mode),
                                    "--batch_size=64",
                                    "--train_limit=6000",
                                    "--test_limit=1000",
                                    absl::StrCat("--steps=", kSteps),
                                    "--log_every=10"};
  flags.insert(flags.end(), c.extra.begin(), c.extra.end());
  flags.insert(flags.end(), c.worker_extra.begin(), c.worker_extra.end());
  if (!c.delay_trace.empty()) {
    const std::string path = absl::StrCat(::testing::TempDir(), "/", c.name, ".trace");
    std::ofstream(path) << c.delay_trace;
    flags.push_back(absl::StrCat("--delay_trace=", path));
  }
  for (int w = 0; w < kWorkers; ++w) ASSERT_TRUE(IsOk((*cluster)->StartWorker(w, flags)));
  absl::StatusOr<std::map<int, int>> statuses = (*cluster)->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(statuses));
  std::vector<double> accuracies;
  for (int w = 0; w < kWorkers; ++w) {
    Subprocess* worker = (*cluster)->worker(w);
    EXPECT_EQ(statuses->at(w), 0) << worker->ReadStderr();
    absl::StatusOr<double> accuracy = FinalTestAccuracy(worker->ReadStdout());
    ASSERT_TRUE(IsOk(accuracy)) << "worker " << w;
    std::printf("%s worker %d: final test accuracy %.4f\n", c.mode, w, *accuracy);
    EXPECT_GE(*accuracy, c.min_accuracy) << c.mode << " worker " << w;
    accuracies.push_back(*accuracy);
  }
  if (c.signature != Signature::kOnArrival) {
    // Where steps are gathered every worker ends on the same final weights (in ssp periods too,
    // though its last pulls may be stale).
    for (int w = 1; w < kWorkers; ++w) EXPECT_EQ(accuracies[w], accuracies[0]) << "worker " << w;
  }
  // The servers end by themselves once every worker has finished, printing their statistics.
  ASSERT_TRUE(IsOk((*cluster)->WaitForServers(absl::Seconds(20))));
  // Adaptive: shard 0's decisions (backup workers, staleness), by first step.
  std::map<int64_t, std::pair<int, int>> decided;
  for (int shard = 0; shard < 2; ++shard) {
    absl::StatusOr<GetStatsResponse> stats = FinalStats((*cluster)->server(shard)->ReadStdout());
    ASSERT_TRUE(IsOk(stats)) << "shard " << shard;
    ExpectSignature(*stats, c.signature);
    if (c.signature != Signature::kAdaptive && c.signature != Signature::kAdaptiveSsp) continue;
    for (const ConsistencyChange& d : stats->consistency_plan()) {
      const std::pair<int, int> choice = {d.backup_workers(), d.staleness()};
      if (shard == 0) {
        decided[d.from_step()] = choice;
      } else {
        ASSERT_TRUE(decided.count(d.from_step()))
            << "shard 1 knows a decision from step " << d.from_step() << " that shard 0 never took";
        EXPECT_EQ(decided[d.from_step()], choice) << d.from_step();
      }
    }
    if (shard == 0) {
      ASSERT_FALSE(decided.empty());
      EXPECT_EQ(decided.begin()->first, 11);
      if (c.signature == Signature::kAdaptive) {
        EXPECT_EQ(decided.begin()->second, std::make_pair(1, 0)) << "worker 2 is four times slower";
      } else {
        // bsp waits 32 ms a step, backup:1 20 ms for 2 gradients, ssp about 24 ms for 3.
        EXPECT_EQ(decided.begin()->second.first, 0);
        EXPECT_GE(decided.begin()->second.second, 1) << "one worker delayed per step, in turn";
      }
    }
  }
}

// Thresholds sit well below what each mode measured here (80 steps, 6000 examples; bsp 0.731,
// backup:1 0.744, async 0.619-0.790, ssp:2 0.727-0.779) and far above chance (0.1). Under async and
// ssp each worker evaluates whatever the weights are when it finishes, so the workers differ and
// vary from run to run; their bound is looser.
INSTANTIATE_TEST_SUITE_P(
    Modes, ConsistencyIntegrationTest,
    ::testing::Values(ModeCase{"Bsp", "bsp", {}, 0.65, Signature::kBsp},
                      ModeCase{"Backup", "backup:1", {}, 0.65, Signature::kBackup1},
                      ModeCase{"Async", "async", {}, 0.45, Signature::kOnArrival},
                      ModeCase{"AsyncStalenessAware",
                               "async",
                               {"--staleness_aware_lr=true"},
                               0.45,
                               Signature::kOnArrival},
                      ModeCase{"Ssp", "ssp:2", {}, 0.45, Signature::kOnArrival},
                      ModeCase{"Adaptive",
                               "adaptive:10",
                               {},
                               0.65,
                               Signature::kAdaptive,
                               {"--slow_workers=2:4", "--min_step_ms=10"}},
                      ModeCase{"AdaptiveSsp",
                               "adaptive:10",
                               {},
                               0.65,
                               Signature::kAdaptiveSsp,
                               {"--min_step_ms=20"},
                               RotatingDelayTrace()}),
    [](const ::testing::TestParamInfo<ModeCase>& info) { return info.param.name; });

}  // namespace
}  // namespace rubato
