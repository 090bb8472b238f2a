// A job's life from start to exit, with real processes on 127.0.0.1: servers end by themselves once
// the workers are done (or dropped), every endpoint answers gRPC health checks, all-reduce ranks
// listen apart from the address they are known by, and a worker asked for CUDA where there is none
// says so.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr const char* kDataDir = kFashionMnistDir;
const std::vector<std::string> kShortJob = {"--steps=40", "--train_limit=3000", "--test_limit=500",
                                            "--log_every=10"};

// A loopback port that was free a moment ago.
int FreePort() { return FreeLoopbackPorts(1)[0]; }

std::string ProbeBinary() {
  return absl::StrCat(std::getenv("TEST_SRCDIR"), "/", std::getenv("TEST_WORKSPACE"),
                      "/deploy/rubato_health_probe");
}

// Runs the health probe against `address`.
ProcessResult Probe(TestCluster* cluster, const std::string& address) {
  static int n = 0;
  absl::StatusOr<ProcessResult> r = cluster->Run(absl::StrCat("probe-", n++), ProbeBinary(),
                                                 {"--timeout_ms=2000", address}, absl::Seconds(10));
  EXPECT_TRUE(IsOk(r));
  return r.ok() ? *r : ProcessResult();
}

class LifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
    auto cluster = TestCluster::Create();
    ASSERT_TRUE(IsOk(cluster));
    cluster_ = std::move(*cluster);
  }
  std::unique_ptr<TestCluster> cluster_;
};

TEST_F(LifecycleTest, ServersExitByThemselvesOnceEveryWorkerHasFinished) {
  TestServerOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  // Every server port answers health checks, without a token.
  for (const std::string& address : cluster_->server_addresses()) {
    const ProcessResult probe = Probe(cluster_.get(), address);
    EXPECT_EQ(probe.exit_status, 0) << probe.stderr_text;
    EXPECT_EQ(probe.stdout_text, "SERVING\n");
  }
  for (int w = 0; w < 2; ++w) ASSERT_TRUE(IsOk(cluster_->StartWorker(w, kShortJob)));
  auto exits = cluster_->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(exits));
  for (const auto& [w, status] : *exits) EXPECT_EQ(status, 0) << cluster_->worker(w)->ReadStderr();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(IsOk(cluster_->WaitForServers(absl::Seconds(10))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "every worker finished: no lease to wait";
  for (int s = 0; s < 2; ++s) {
    const std::string out = cluster_->server(s)->ReadStdout();
    EXPECT_TRUE(absl::StartsWith(out, "{\"event\":\"stats\",\"shard_id\":")) << out;
    EXPECT_TRUE(absl::StrContains(out, "\"finished_workers\":2")) << out;
    EXPECT_TRUE(absl::StrContains(out, "\"min_version\":40,")) << out;
    EXPECT_TRUE(absl::StrContains(cluster_->server(s)->ReadStderr(), "job over")) << s;
  }
}

TEST_F(LifecycleTest, ADeadWorkerDoesNotKeepTheServersRunning) {
  TestServerOptions options;
  options.num_workers = 3;
  options.extra_flags = {"--lease_ms=1000"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  for (int w = 0; w < 3; ++w) {
    std::vector<std::string> flags = kShortJob;
    flags.push_back("--lease_ms=1000");
    if (w == 2) flags.push_back("--crash_at_step=5");
    ASSERT_TRUE(IsOk(cluster_->StartWorker(w, flags)));
  }
  auto exits = cluster_->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(exits));
  EXPECT_EQ(exits->at(0), 0);
  EXPECT_EQ(exits->at(1), 0);
  EXPECT_EQ(exits->at(2), 3);  // The injected crash.
  // Worker 2 was dropped after its lease; it gets one more lease to come back, then the job ends.
  ASSERT_TRUE(IsOk(cluster_->WaitForServers(absl::Seconds(15))));
  const std::string out = cluster_->server(0)->ReadStdout();
  EXPECT_TRUE(absl::StrContains(out, "\"finished_workers\":2")) << out;
  EXPECT_TRUE(absl::StrContains(out, "\"dropped_workers\":1,")) << out;
}

TEST_F(LifecycleTest, ServerWithoutWorkersGivesUpAfterTheIdleTimeoutNamingThem) {
  TestServerOptions options;
  options.num_workers = 2;
  options.extra_flags = {"--idle_timeout_ms=1500"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  absl::StatusOr<int> status = cluster_->server(0)->Wait(absl::Seconds(15));
  ASSERT_TRUE(IsOk(status));
  EXPECT_EQ(*status, 1);
  const std::string err = cluster_->server(0)->ReadStderr();
  EXPECT_TRUE(absl::StrContains(err, "rubato_server: error: shard 0: no worker has been live"))
      << err;
  EXPECT_TRUE(absl::StrContains(err, "never registered: 0,1")) << err;
}

TEST_F(LifecycleTest, HealthListenPortsOfServerAndWorker) {
  const int server_health = FreePort();
  const int worker_health = FreePort();
  ASSERT_GT(server_health, 0);
  ASSERT_GT(worker_health, 0);
  TestServerOptions options;
  options.num_workers = 1;
  options.extra_flags = {absl::StrCat("--health_listen=127.0.0.1:", server_health)};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  ProcessResult probe = Probe(cluster_.get(), absl::StrCat("127.0.0.1:", server_health));
  EXPECT_EQ(probe.exit_status, 0) << probe.stderr_text;
  EXPECT_EQ(probe.stdout_text, "SERVING\n");
  // The probe port serves nothing but health: a worker cannot train through it.
  std::vector<std::string> flags = kShortJob;
  flags.push_back(absl::StrCat("--health_listen=127.0.0.1:", worker_health));
  flags.push_back("--pause_at_step=1");
  flags.push_back("--pause_ms=3000");
  ASSERT_TRUE(IsOk(cluster_->StartWorker(0, flags)));
  bool answered = false;
  for (int i = 0; i < 40 && !answered; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    probe = Probe(cluster_.get(), absl::StrCat("127.0.0.1:", worker_health));
    answered = probe.exit_status == 0;
  }
  EXPECT_TRUE(answered) << probe.stderr_text;
  EXPECT_EQ(probe.stdout_text, "SERVING\n");
  auto exits = cluster_->WaitForWorkers(absl::Seconds(60));
  ASSERT_TRUE(IsOk(exits));
  EXPECT_EQ(exits->at(0), 0);
  ASSERT_TRUE(IsOk(cluster_->WaitForServers(absl::Seconds(10))));
  // Gone with its process: refused, and the probe says so.
  probe = Probe(cluster_.get(), absl::StrCat("127.0.0.1:", server_health));
  EXPECT_EQ(probe.exit_status, 3);
  EXPECT_TRUE(absl::StrContains(probe.stderr_text, "connection refused")) << probe.stderr_text;
}

TEST_F(LifecycleTest, RanksListenApartFromTheAddressesTheyAreKnownBy) {
  // Known to each other as localhost:P, each binds 127.0.0.1:P: as behind a Service name.
  const int p0 = FreePort(), p1 = FreePort();
  const std::string peers = absl::StrCat("--peers=localhost:", p0, ",localhost:", p1);
  std::vector<std::unique_ptr<Subprocess>> ranks;
  absl::StatusOr<std::string> worker = TestCluster::WorkerBinary();
  ASSERT_TRUE(IsOk(worker));
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> argv = {*worker,
                                     absl::StrCat("--worker_id=", r),
                                     "--num_workers=2",
                                     "--mode=allreduce",
                                     peers,
                                     absl::StrCat("--listen=127.0.0.1:", r == 0 ? p0 : p1)};
    argv.insert(argv.end(), kShortJob.begin(), kShortJob.end());
    auto p = Subprocess::Start(absl::StrCat("rank-", r), argv,
                               absl::StrCat(cluster_->dir(), "/rank-", r, ".out"),
                               absl::StrCat(cluster_->dir(), "/rank-", r, ".err"));
    ASSERT_TRUE(IsOk(p));
    ranks.push_back(std::move(*p));
  }
  for (auto& rank : ranks) {
    absl::StatusOr<int> status = rank->Wait(absl::Seconds(120));
    ASSERT_TRUE(IsOk(status));
    EXPECT_EQ(*status, 0) << rank->ReadStderr();
    EXPECT_TRUE(IsOk(FinalTestAccuracy(rank->ReadStdout())));
  }
}

TEST_F(LifecycleTest, CudaBackendWhereNoneIsUsableIsAClearError) {
  absl::StatusOr<ProcessResult> r =
      cluster_->Run("cuda-worker", *TestCluster::WorkerBinary(),
                    {"--worker_id=0", "--num_workers=1", "--servers=127.0.0.1:1", "--backend=cuda"},
                    absl::Seconds(30));
  ASSERT_TRUE(IsOk(r));
  // The binary starts on a host without CUDA (no libcudart needed) and refuses with the reason.
  EXPECT_EQ(r->exit_status, 2) << r->stderr_text;
  EXPECT_TRUE(absl::StrContains(r->stderr_text, "rubato_worker: error: --backend=cuda: "))
      << r->stderr_text;
}

}  // namespace
}  // namespace rubato
