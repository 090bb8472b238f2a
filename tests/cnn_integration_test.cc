// End to end with --model=cnn: real rubato_server and rubato_worker processes on 127.0.0.1.
//   - Two workers train the CNN past 0.85 test accuracy in a few hundred steps.
//   - Overlap, from the workers' own timestamps: with --overlap (the default) the last layer's
//     push starts before the backward pass has finished (before the first layer's backward ends),
//     and each layer's pull for the next step follows its push; with --overlap=false the one
//     push starts after the backward pass.
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr const char* kDataDir = kFashionMnistDir;

// The number after "key": in `line` (the first occurrence at or after `from`), or NaN.
double NumberAfter(absl::string_view line, absl::string_view key, size_t from = 0) {
  const std::string k = absl::StrCat("\"", key, "\":");
  const size_t at = line.find(k, from);
  if (at == absl::string_view::npos) return std::nan("");
  return std::strtod(std::string(line.substr(at + k.size())).c_str(), nullptr);
}

// One {"event":"overlap",...} record: the step's compute end and each push's layer and start, in ms
// from the start of the step's compute.
struct OverlapRecord {
  double compute_end_ms = 0;
  std::vector<std::string> layers;
  std::vector<double> start_ms, ack_ms, pulled_ms;
};

std::vector<OverlapRecord> OverlapRecords(absl::string_view worker_stdout) {
  std::vector<OverlapRecord> records;
  for (absl::string_view line : absl::StrSplit(worker_stdout, '\n')) {
    if (!absl::StrContains(line, "\"event\":\"overlap\"")) continue;
    OverlapRecord r;
    r.compute_end_ms = NumberAfter(line, "compute_end_ms");
    for (size_t at = line.find("\"layer\":\""); at != absl::string_view::npos;
         at = line.find("\"layer\":\"", at + 1)) {
      const size_t begin = at + 9, end = line.find('"', begin);
      r.layers.emplace_back(line.substr(begin, end - begin));
      r.start_ms.push_back(NumberAfter(line, "start_ms", at));
      r.ack_ms.push_back(NumberAfter(line, "ack_ms", at));
      r.pulled_ms.push_back(NumberAfter(line, "pulled_ms", at));
    }
    records.push_back(std::move(r));
  }
  return records;
}

std::vector<double> StepField(absl::string_view worker_stdout, absl::string_view field) {
  std::vector<double> values;
  for (absl::string_view line : absl::StrSplit(worker_stdout, '\n')) {
    if (absl::StrContains(line, "\"event\":\"step\"")) values.push_back(NumberAfter(line, field));
  }
  return values;
}

// A field of the worker's done record (NaN if there is none).
double DoneField(absl::string_view worker_stdout, absl::string_view field) {
  for (absl::string_view line : absl::StrSplit(worker_stdout, '\n')) {
    if (absl::StrContains(line, "\"event\":\"done\"")) return NumberAfter(line, field);
  }
  return std::nan("");
}

// Runs `num_workers` CNN workers against one shard with Adam; returns each worker's stdout after
// checking that every process exits 0.
std::vector<std::string> RunCnnJob(int num_workers, const std::vector<std::string>& flags,
                                   absl::Duration timeout) {
  std::vector<std::string> outputs;
  auto cluster = TestCluster::Create();
  EXPECT_TRUE(IsOk(cluster));
  if (!cluster.ok()) return outputs;
  TestServerOptions options;
  options.num_workers = num_workers;
  options.extra_flags = {"--optimizer=adam", "--learning_rate=0.001"};
  EXPECT_TRUE(IsOk((*cluster)->StartServers(options)));
  std::vector<std::string> worker_flags = {absl::StrCat("--data_dir=", kDataDir), "--model=cnn",
                                           "--backend=cpu"};
  worker_flags.insert(worker_flags.end(), flags.begin(), flags.end());
  for (int w = 0; w < num_workers; ++w) {
    EXPECT_TRUE(IsOk((*cluster)->StartWorker(w, worker_flags)));
  }
  absl::StatusOr<std::map<int, int>> exit_statuses = (*cluster)->WaitForWorkers(timeout);
  EXPECT_TRUE(IsOk(exit_statuses));
  if (!exit_statuses.ok()) return outputs;
  for (int w = 0; w < num_workers; ++w) {
    EXPECT_EQ(exit_statuses->at(w), 0) << (*cluster)->worker(w)->ReadStderr();
    outputs.push_back((*cluster)->worker(w)->ReadStdout());
  }
  EXPECT_TRUE(IsOk((*cluster)->WaitForServers(absl::Seconds(15))));
  return outputs;
}

TEST(CnnIntegrationTest, TwoWorkersTrainTheCnnPast85Percent) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  // Global batch 64 (2 x 32), 400 steps: 25,600 examples, under half an epoch.
  const std::vector<std::string> outputs = RunCnnJob(
      2,
      {"--batch_size=32", "--steps=400", "--eval_every=400", "--test_limit=2000", "--log_every=50"},
      absl::Seconds(600));
  ASSERT_EQ(outputs.size(), 2u);
  absl::StatusOr<double> a0 = FinalTestAccuracy(outputs[0]);
  absl::StatusOr<double> a1 = FinalTestAccuracy(outputs[1]);
  ASSERT_TRUE(IsOk(a0));
  ASSERT_TRUE(IsOk(a1));
  EXPECT_EQ(*a0, *a1);  // BSP: the same final weights
  ::testing::Test::RecordProperty("test_accuracy", absl::StrCat(*a0));
  std::printf("cnn final test accuracy: %.4f\n", *a0);
  EXPECT_GT(*a0, 0.85);
}

TEST(CnnIntegrationTest, WithOverlapTheLastLayersPushStartsBeforeTheBackwardPassEnds) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  // Every layer pushed alone (the default 4 MiB buckets would take this small CNN in one push).
  const std::vector<std::string> outputs =
      RunCnnJob(1,
                {"--batch_size=32", "--steps=6", "--log_every=2", "--train_limit=1000",
                 "--test_limit=100", "--push_bucket_kb=0"},
                absl::Seconds(120));
  ASSERT_EQ(outputs.size(), 1u);
  const std::vector<OverlapRecord> records = OverlapRecords(outputs[0]);
  ASSERT_EQ(records.size(), 3u) << outputs[0];
  for (const OverlapRecord& r : records) {
    // One push per layer with parameters, last layer first.
    ASSERT_EQ(r.layers, (std::vector<std::string>{"dense2", "dense1", "conv2", "conv1"}))
        << outputs[0];
    // dense2's gradient is pushed while conv2 and conv1 still run their backward passes.
    EXPECT_LT(r.start_ms[0], r.compute_end_ms) << outputs[0];
    EXPECT_LT(r.start_ms[1], r.compute_end_ms) << outputs[0];
    for (size_t k = 0; k < r.layers.size(); ++k) {
      EXPECT_GE(r.ack_ms[k], r.start_ms[k]) << r.layers[k];
      // Each layer's pull for the next step follows its push.
      EXPECT_GE(r.pulled_ms[k], r.ack_ms[k]) << r.layers[k];
      if (k > 0) {
        EXPECT_GE(r.start_ms[k], r.start_ms[k - 1]) << r.layers[k];
      }
    }
  }
  for (double f : StepField(outputs[0], "hidden_fraction")) {
    EXPECT_GT(f, 0) << outputs[0];
    EXPECT_LE(f, 1) << outputs[0];
  }
  // Every layer's mean ready-to-acknowledged time (a map: its keys in sorted order).
  const size_t latency = outputs[0].rfind("\"push_latency_ms\":{");
  ASSERT_NE(latency, std::string::npos) << outputs[0];
  const std::string latencies =
      outputs[0].substr(latency, outputs[0].find('}', latency) + 1 - latency);
  EXPECT_TRUE(absl::StartsWith(latencies, "\"push_latency_ms\":{\"conv1\":")) << latencies;
  for (const char* layer : {"conv2", "dense1", "dense2"}) {
    EXPECT_TRUE(absl::StrContains(latencies, absl::StrCat(",\"", layer, "\":"))) << latencies;
  }
  // After the first step, the weights came with the pushes: no step pulls on its own. Each step
  // after the first started its forward pass before they had all arrived (the last step's pulls
  // are waited for after its backward pass: the job's final weights).
  EXPECT_EQ(DoneField(outputs[0], "layerwise_steps"), 5) << outputs[0];
  // Waiting for them all after the backward pass instead, no step pulls or waits in its forward
  // pass: its pull_ms is 0.
  const std::vector<std::string> whole =
      RunCnnJob(1,
                {"--batch_size=32", "--steps=6", "--log_every=2", "--train_limit=1000",
                 "--test_limit=100", "--push_bucket_kb=0", "--layerwise_forward=false"},
                absl::Seconds(120));
  ASSERT_EQ(whole.size(), 1u);
  const std::vector<double> pull_ms = StepField(whole[0], "pull_ms");
  ASSERT_EQ(pull_ms.size(), 3u);
  EXPECT_EQ(pull_ms[1], 0) << whole[0];
  EXPECT_EQ(pull_ms[2], 0) << whole[0];
  EXPECT_EQ(DoneField(whole[0], "layerwise_steps"), 0) << whole[0];
}

TEST(CnnIntegrationTest, WithoutOverlapTheOnePushStartsAfterTheBackwardPass) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  const std::vector<std::string> outputs =
      RunCnnJob(1,
                {"--batch_size=32", "--steps=4", "--log_every=2", "--train_limit=1000",
                 "--test_limit=100", "--overlap=false"},
                absl::Seconds(120));
  ASSERT_EQ(outputs.size(), 1u);
  const std::vector<OverlapRecord> records = OverlapRecords(outputs[0]);
  ASSERT_EQ(records.size(), 2u) << outputs[0];
  for (const OverlapRecord& r : records) {
    ASSERT_EQ(r.layers, std::vector<std::string>{"all"}) << outputs[0];
    EXPECT_GE(r.start_ms[0], r.compute_end_ms) << outputs[0];
  }
  for (double f : StepField(outputs[0], "hidden_fraction")) EXPECT_EQ(f, 0) << outputs[0];
  EXPECT_TRUE(absl::StrContains(outputs[0], "\"overlap\":false")) << outputs[0];
}

}  // namespace
}  // namespace rubato
