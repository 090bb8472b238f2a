// Every consistency model end to end: 2 server shards and 3 worker processes on 127.0.0.1 train the
// MLP on a subset of Fashion-MNIST; every process must exit cleanly and every worker must learn
// well above chance (10%).
#include <sys/stat.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr char kDataDir[] = "/usr/share/datasets/fashion-mnist";

struct ModeCase {
  const char* name;
  const char* mode;
  std::vector<std::string> extra;  // Flags for servers and workers.
  double min_accuracy;
};

class ConsistencyIntegrationTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(ConsistencyIntegrationTest, TwoShardsThreeWorkersLearn) {
  struct stat st;
  if (stat(kDataDir, &st) != 0) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  const ModeCase& c = GetParam();
  auto cluster = TestCluster::Create();
  ASSERT_TRUE(IsOk(cluster));
  TestServerOptions options;
  options.num_shards = 2;
  options.num_workers = 3;
  options.extra_flags = {absl::StrCat("--mode=", c.mode), "--learning_rate=0.1"};
  options.extra_flags.insert(options.extra_flags.end(), c.extra.begin(), c.extra.end());
  ASSERT_TRUE(IsOk((*cluster)->StartServers(options)));
  std::vector<std::string> flags = {absl::StrCat("--data_dir=", kDataDir),
                                    absl::StrCat("--mode=", c.mode),
                                    "--batch_size=64",
                                    "--train_limit=6000",
                                    "--test_limit=1000",
                                    "--steps=80",
                                    "--log_every=10"};
  flags.insert(flags.end(), c.extra.begin(), c.extra.end());
  for (int w = 0; w < 3; ++w) ASSERT_TRUE(IsOk((*cluster)->StartWorker(w, flags)));
  absl::StatusOr<std::map<int, int>> statuses = (*cluster)->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(statuses));
  for (int w = 0; w < 3; ++w) {
    Subprocess* worker = (*cluster)->worker(w);
    EXPECT_EQ(statuses->at(w), 0) << worker->ReadStderr();
    absl::StatusOr<double> accuracy = FinalTestAccuracy(worker->ReadStdout());
    ASSERT_TRUE(IsOk(accuracy)) << "worker " << w;
    std::printf("%s worker %d: final test accuracy %.4f\n", c.mode, w, *accuracy);
    EXPECT_GE(*accuracy, c.min_accuracy) << c.mode << " worker " << w;
  }
  EXPECT_TRUE(IsOk((*cluster)->StopServers(absl::Seconds(15))));
}

// Thresholds sit well below what each mode measured here (80 steps, 6000 examples; bsp 0.731,
// backup:1 0.744, async 0.619-0.790, ssp:2 0.727-0.779) and far above chance (0.1). Under async and
// ssp each worker evaluates whatever the weights are when it finishes, so the workers differ and
// vary from run to run; their bound is looser.
INSTANTIATE_TEST_SUITE_P(
    Modes, ConsistencyIntegrationTest,
    ::testing::Values(ModeCase{"Bsp", "bsp", {}, 0.65}, ModeCase{"Backup", "backup:1", {}, 0.65},
                      ModeCase{"Async", "async", {}, 0.45},
                      ModeCase{"AsyncStalenessAware", "async", {"--staleness_aware_lr=true"}, 0.45},
                      ModeCase{"Ssp", "ssp:2", {}, 0.45}),
    [](const ::testing::TestParamInfo<ModeCase>& info) { return info.param.name; });

}  // namespace
}  // namespace rubato
