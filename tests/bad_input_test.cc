// Bad flags, missing data, unreachable servers, mismatched models and dead workers: every case must
// end in a non-zero exit and a one-line error that names the problem, and nothing may hang.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr const char* kDataDir = kFashionMnistDir;
// Usage errors and runtime failures, as rubato_worker and rubato_server document them.
constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;
// No case here should take more than a few seconds; this only turns a hang into a failure.
constexpr absl::Duration kRunTimeout = absl::Seconds(20);

// Success if `stderr_text` has exactly one "<program>: error: " line and it contains every needle.
::testing::AssertionResult OneErrorLineContaining(const std::string& stderr_text,
                                                  absl::string_view program,
                                                  const std::vector<std::string>& needles) {
  const std::vector<std::string> errors = ErrorLines(stderr_text, program);
  if (errors.size() != 1) {
    return ::testing::AssertionFailure()
           << errors.size() << " lines start with '" << program << ": error: ', not 1; stderr:\n"
           << stderr_text;
  }
  for (const std::string& needle : needles) {
    if (errors[0].find(needle) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "the error does not mention '" << needle << "': " << errors[0];
    }
  }
  return ::testing::AssertionSuccess() << errors[0];
}

// A loopback port that nothing listens on: bound by the kernel's choice, then released.
int UnusedLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = TestCluster::Create();
    ASSERT_TRUE(IsOk(cluster));
    cluster_ = *std::move(cluster);
  }

  // Runs rubato_worker alone (no servers are started) with flags that are valid on their own,
  // then `flags`; a later flag overrides an earlier one. --servers points at port 1, where nothing
  // listens, and the short connect timeout keeps a flag that is wrongly accepted from hanging.
  ProcessResult RunWorker(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {
        "--worker_id=0",
        "--num_workers=1",
        "--servers=127.0.0.1:1",
        "--connect_timeout_ms=1000",
        absl::StrCat("--data_dir=", kDataDir),
        "--train_limit=100",
        "--test_limit=100",
        "--steps=1",
    };
    args.insert(args.end(), flags.begin(), flags.end());
    return Run("worker", *TestCluster::WorkerBinary(), args);
  }

  // Runs rubato_server alone with valid flags for 2 workers, then `flags`.
  // One server with a 1 s lease and two workers of `steps` steps that heartbeat to match; returns
  // once worker 1 has reported its first steps.
  // `min_step_ms`: a compute floor, for a case that must not depend on how fast a step computes.
  void StartTwoWorkersWithShortLeases(int steps, Subprocess** w0, Subprocess** w1,
                                      int min_step_ms = 0) {
    TestServerOptions options;
    options.num_workers = 2;
    options.extra_flags = {"--lease_ms=1000", "--wait_timeout_ms=30000"};
    ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
    const std::vector<std::string> flags = {absl::StrCat("--data_dir=", kDataDir),
                                            "--train_limit=2000",
                                            "--test_limit=100",
                                            absl::StrCat("--steps=", steps),
                                            "--log_every=5",
                                            "--lease_ms=1000",
                                            absl::StrCat("--min_step_ms=", min_step_ms)};
    absl::StatusOr<Subprocess*> first = cluster_->StartWorker(0, flags);
    ASSERT_TRUE(IsOk(first));
    absl::StatusOr<Subprocess*> second = cluster_->StartWorker(1, flags);
    ASSERT_TRUE(IsOk(second));
    ASSERT_TRUE(IsOk(WaitForStdoutLine(*second, "\"event\":\"step\"", kRunTimeout)));
    *w0 = *first;
    *w1 = *second;
  }

  ProcessResult RunServer(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {
        "--num_workers=2",
        "--listen=127.0.0.1:0",
        absl::StrCat("--port_file=", cluster_->dir(), "/server.port"),
    };
    args.insert(args.end(), flags.begin(), flags.end());
    return Run("server", *TestCluster::ServerBinary(), args);
  }

  ProcessResult Run(const std::string& name, const std::string& binary,
                    const std::vector<std::string>& args) {
    absl::StatusOr<ProcessResult> result =
        cluster_->Run(absl::StrCat(name, "-", ++runs_), binary, args, kRunTimeout);
    EXPECT_TRUE(IsOk(result)) << absl::StrJoin(args, " ");
    return result.ok() ? *std::move(result) : ProcessResult();
  }

  std::unique_ptr<TestCluster> cluster_;
  int runs_ = 0;
};

// --- rubato_worker: flags and data -----------------------------------------------------------

struct BadFlagCase {
  std::string name;
  std::vector<std::string> flags;
  std::vector<std::string> error_mentions;
};

// For gtest's failure messages, which otherwise dump the struct's bytes.
void PrintTo(const BadFlagCase& c, std::ostream* os) { *os << absl::StrJoin(c.flags, " "); }

class BadWorkerFlagTest : public BadInputTest, public ::testing::WithParamInterface<BadFlagCase> {};

TEST_P(BadWorkerFlagTest, ExitsWithUsageErrorNamingTheFlag) {
  const BadFlagCase& c = GetParam();
  const ProcessResult r = RunWorker(c.flags);
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(OneErrorLineContaining(r.stderr_text, "rubato_worker", c.error_mentions));
  EXPECT_EQ(r.stdout_text, "") << "no progress record before the flags are checked";
}

INSTANTIATE_TEST_SUITE_P(
    Flags, BadWorkerFlagTest,
    ::testing::Values(
        BadFlagCase{"ZeroBatchSize", {"--batch_size=0"}, {"--batch_size", "got 0"}},
        BadFlagCase{"NonNumericLayer", {"--layers=784-x-10"}, {"--layers", "784-x-10", "\"x\""}},
        BadFlagCase{"UnknownMode", {"--mode=bogus"}, {"mode", "'bogus'"}},
        BadFlagCase{"NegativeRingSpin",
                    {"--mode=allreduce", "--peers=127.0.0.1:1,127.0.0.1:2", "--num_workers=2",
                     "--ring_spin_us=-5"},
                    {"--ring_spin_us", "0..100000", "-5"}},
        BadFlagCase{"UnknownPsTransport", {"--ps_transport=udp"}, {"--ps_transport=udp", "grpc"}},
        BadFlagCase{"WorkerIdOutOfRange",
                    {"--worker_id=5", "--num_workers=2"},
                    {"--worker_id", "num_workers=2", "got 5"}}),
    [](const ::testing::TestParamInfo<BadFlagCase>& info) { return info.param.name; });

TEST_F(BadInputTest, WorkerLayersThatDoNotMatchTheData) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  const ProcessResult r = RunWorker({"--layers=100-10"});
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  // "--layers 100-10 needs 100 inputs and 10 classes; the data has 784 and 10"
  EXPECT_TRUE(OneErrorLineContaining(r.stderr_text, "rubato_worker", {"--layers 100-10", "784"}));
}

TEST_F(BadInputTest, WorkerUnknownFlag) {
  const ProcessResult r = RunWorker({"--no_such_flag=3"});
  // Abseil's flag parser rejects it before main() can, with its own "ERROR: Unknown command line
  // flag" line; the status is still the usage status 2 (common/parse_flags.h), so that a
  // Kubernetes pod failure policy fails the job rather than restarting the pod.
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(HasLineContaining(r.stderr_text, "'no_such_flag'")) << r.stderr_text;
  EXPECT_EQ(r.stdout_text, "");
}

TEST_F(BadInputTest, FlagValuesAbseilRefusesAreUsageErrors) {
  ProcessResult r = RunWorker({"--batch_size=abc"});
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(HasLineContaining(r.stderr_text, "'batch_size'")) << r.stderr_text;
  r = RunServer({"--no_such_flag=1"});
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(HasLineContaining(r.stderr_text, "'no_such_flag'")) << r.stderr_text;
  r = RunServer({"--update_threads=many"});
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  // --helpfull is no error: Abseil's own status (1), with the flags on stdout.
  r = RunServer({"--helpfull"});
  EXPECT_EQ(r.exit_status, 1);
  EXPECT_NE(r.stdout_text.find("--checkpoint_dir"), std::string::npos);
}

TEST_F(BadInputTest, WorkerMissingDataDir) {
  const ProcessResult r = RunWorker({"--data_dir=/nonexistent"});
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(OneErrorLineContaining(r.stderr_text, "rubato_worker", {"/nonexistent"}));
}

TEST_F(BadInputTest, WorkerCannotReachServer) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  const int port = UnusedLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  const absl::Time start = absl::Now();
  const ProcessResult r = RunWorker({"--servers=" + address, "--connect_timeout_ms=1000"});
  EXPECT_EQ(r.exit_status, kExitRuntime) << r.stderr_text;
  // The error says why: nothing listens there (a wrong port, or a server not started).
  EXPECT_TRUE(OneErrorLineContaining(r.stderr_text, "rubato_worker",
                                     {"cannot reach", address, "connection refused by " + address}));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "--connect_timeout_ms=1000 not honoured";
}

// --- rubato_server: flags --------------------------------------------------------------------

class BadServerFlagTest : public BadInputTest, public ::testing::WithParamInterface<BadFlagCase> {};

TEST_P(BadServerFlagTest, ExitsWithUsageErrorNamingTheFlag) {
  const BadFlagCase& c = GetParam();
  const ProcessResult r = RunServer(c.flags);
  EXPECT_EQ(r.exit_status, kExitUsage) << r.stderr_text;
  EXPECT_TRUE(OneErrorLineContaining(r.stderr_text, "rubato_server", c.error_mentions));
  struct stat st;
  EXPECT_NE(stat((cluster_->dir() + "/server.port").c_str(), &st), 0)
      << "a server that rejects its flags must not report a port";
}

INSTANTIATE_TEST_SUITE_P(
    Flags, BadServerFlagTest,
    ::testing::Values(
        BadFlagCase{"UnknownMode", {"--mode=bogus"}, {"mode", "'bogus'"}},
        BadFlagCase{"NegativeLearningRate", {"--learning_rate=-1"}, {"learning_rate", "-1"}},
        BadFlagCase{"ZeroWorkers", {"--num_workers=0"}, {"num_workers", "required"}},
        BadFlagCase{"NegativeWorkers", {"--num_workers=-3"}, {"num_workers", "got -3"}},
        BadFlagCase{"UnknownOptimizer", {"--optimizer=adagrad"}, {"optimizer.type", "adagrad"}},
        BadFlagCase{"BetaOutOfRange", {"--optimizer=lamb", "--beta1=1.5"}, {"optimizer.beta1"}},
        BadFlagCase{"UnknownScaling", {"--lr_scaling=cubic"}, {"lr_schedule.scaling", "cubic"}},
        BadFlagCase{"DataPortOutOfRange", {"--data_port=70000"}, {"--data_port=70000", "-1"}}),
    [](const ::testing::TestParamInfo<BadFlagCase>& info) { return info.param.name; });

// --- Running jobs that go wrong -----------------------------------------------------------------

// Flags for a short job on little data; the steps are plenty for the cases below, which end early.
std::vector<std::string> SmallJobFlags(const std::vector<std::string>& more) {
  std::vector<std::string> flags = {absl::StrCat("--data_dir=", kDataDir), "--train_limit=2000",
                                    "--test_limit=100", "--steps=100000", "--log_every=5"};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

TEST_F(BadInputTest, ModelMismatchFailsTheLateWorkerAndTimesOutTheOther) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  TestServerOptions options;
  options.num_workers = 2;
  options.extra_flags = {"--wait_timeout_ms=3000"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));

  // Worker 0 registers first, so that its model is the one the server holds.
  absl::StatusOr<Subprocess*> w0 = cluster_->StartWorker(0, SmallJobFlags({"--layers=784-256-10"}));
  ASSERT_TRUE(IsOk(w0));
  ASSERT_TRUE(IsOk(WaitForStdoutLine(*w0, "\"event\":\"start\"", kRunTimeout)));
  absl::StatusOr<Subprocess*> w1 = cluster_->StartWorker(1, SmallJobFlags({"--layers=784-128-10"}));
  ASSERT_TRUE(IsOk(w1));

  absl::StatusOr<int> status1 = (*w1)->Wait(kRunTimeout);
  ASSERT_TRUE(IsOk(status1));
  EXPECT_EQ(*status1, kExitRuntime);
  // "model mismatch on shard 0: tensor 'fc0.weight' is [784,256] on the server but [784,128] on
  // worker 1"
  EXPECT_TRUE(OneErrorLineContaining((*w1)->ReadStderr(), "rubato_worker",
                                     {"model mismatch", "[784,256]", "[784,128]", "worker 1"}));

  // Worker 0 waits at its first BSP barrier for worker 1, which never registered, until the
  // server's wait timeout (3 s) fails its pull.
  absl::StatusOr<int> status0 = (*w0)->Wait(absl::Seconds(15));
  ASSERT_TRUE(IsOk(status0));
  EXPECT_EQ(*status0, kExitRuntime);
  EXPECT_TRUE(OneErrorLineContaining((*w0)->ReadStderr(), "rubato_worker",
                                     {"timed out", "waiting for worker(s) 1 to register"}));

  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(15))));
}

TEST_F(BadInputTest, WorkerConfiguredForAnotherJobIsRefused) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  TestServerOptions options;
  options.num_workers = 2;
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  // Flags given later override the cluster's --num_workers=2: this worker thinks the job has 3
  // workers, so it would split the data three ways and run fewer steps than its peer.
  absl::StatusOr<Subprocess*> w1 = cluster_->StartWorker(1, SmallJobFlags({"--num_workers=3"}));
  ASSERT_TRUE(IsOk(w1));
  absl::StatusOr<int> status1 = (*w1)->Wait(kRunTimeout);
  ASSERT_TRUE(IsOk(status1));
  EXPECT_EQ(*status1, kExitRuntime);
  EXPECT_TRUE(OneErrorLineContaining(
      (*w1)->ReadStderr(), "rubato_worker",
      {"FAILED_PRECONDITION", "job mismatch", "runs 2 workers", "started with 3 workers"}));
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(15))));
}

TEST_F(BadInputTest, ServerStoppedUnderAWaitingWorker) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  TestServerOptions options;
  options.num_workers = 2;
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  // Worker 1 never comes, so worker 0's step-0 pull is parked on the server (for up to the default
  // 120 s wait timeout).
  // A server stopped before the job is over may be started again by its supervisor: the worker
  // retries it up to --retry_timeout_ms, then fails naming it.
  absl::StatusOr<Subprocess*> w0 =
      cluster_->StartWorker(0, SmallJobFlags({"--retry_timeout_ms=3000"}));
  ASSERT_TRUE(IsOk(w0));
  ASSERT_TRUE(IsOk(WaitForStdoutLine(*w0, "\"event\":\"start\"", kRunTimeout)));
  // The pull follows the start record at once; this leaves it ample time to arrive.
  absl::SleepFor(absl::Seconds(1));

  Subprocess* server = cluster_->server(0);
  ASSERT_TRUE(IsOk(server->Signal(SIGTERM)));
  absl::StatusOr<int> server_status = server->Wait(absl::Seconds(10));
  ASSERT_TRUE(IsOk(server_status)) << "a parked pull must not hold up shutdown";
  // Signalled before the job is over: not a success, so that a supervisor starts it again.
  EXPECT_EQ(*server_status, 128 + SIGTERM) << server->ReadStderr();
  EXPECT_NE(server->ReadStderr().find("before the job is over"), std::string::npos)
      << server->ReadStderr();

  absl::StatusOr<int> status0 = (*w0)->Wait(absl::Seconds(15));
  ASSERT_TRUE(IsOk(status0));
  EXPECT_EQ(*status0, kExitRuntime);
  EXPECT_TRUE(OneErrorLineContaining((*w0)->ReadStderr(), "rubato_worker", {"step 0", "shard 0", "unreachable", "retried with backoff"}))
      << (*w0)->ReadStderr();
}

TEST_F(BadInputTest, WorkerKilledMidRunIsDroppedAndItsPeerFinishes) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  Subprocess* w0 = nullptr;
  Subprocess* w1 = nullptr;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkersWithShortLeases(60, &w0, &w1));
  ASSERT_TRUE(IsOk(w1->Signal(SIGKILL)));
  absl::StatusOr<int> status1 = w1->Wait(absl::Seconds(5));
  ASSERT_TRUE(IsOk(status1));
  EXPECT_EQ(*status1, 128 + SIGKILL);

  // Once worker 1's 1 s lease runs out, the shard drops it from the barrier and worker 0 trains on
  // alone, well before the 30 s wait timeout.
  absl::StatusOr<int> status0 = w0->Wait(absl::Seconds(25));
  ASSERT_TRUE(IsOk(status0)) << "worker 0 hung on its dead peer";
  EXPECT_EQ(*status0, 0) << w0->ReadStderr();
  EXPECT_TRUE(HasLineContaining(w0->ReadStdout(), "\"event\":\"done\""));
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(15))));
  EXPECT_TRUE(HasLineContaining(cluster_->server(0)->ReadStderr(), "dropped worker 1"))
      << cluster_->server(0)->ReadStderr();
}

TEST_F(BadInputTest, PausedWorkerIsDroppedThenRejoinsAndCarriesOn) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  Subprocess* w0 = nullptr;
  Subprocess* w1 = nullptr;
  // Steps of 10 ms at least: worker 0, alone once worker 1's lease runs out, must still be
  // training when worker 1 wakes (the AVX2 build finished all 400 steps in the pause, and the
  // shard, its job over, was gone).
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkersWithShortLeases(400, &w0, &w1, 10));
  // Frozen for 2.5 s, heartbeats included: longer than the 1 s lease.
  ASSERT_TRUE(IsOk(w1->Signal(SIGSTOP)));
  absl::SleepFor(absl::Milliseconds(2500));
  ASSERT_TRUE(IsOk(w1->Signal(SIGCONT)));

  absl::StatusOr<std::map<int, int>> statuses = cluster_->WaitForWorkers(absl::Seconds(60));
  ASSERT_TRUE(IsOk(statuses));
  EXPECT_EQ(statuses->at(0), 0) << w0->ReadStderr();
  EXPECT_EQ(statuses->at(1), 0) << w1->ReadStderr();
  // Its next RPC was refused with ABORTED; it registered again and finished the job.
  EXPECT_TRUE(HasLineContaining(w1->ReadStdout(), "\"event\":\"rejoin\"")) << w1->ReadStdout();
  EXPECT_TRUE(HasLineContaining(w1->ReadStdout(), "\"event\":\"done\""));
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(15))));
  EXPECT_TRUE(HasLineContaining(cluster_->server(0)->ReadStderr(), "dropped worker 1"));
}

TEST_F(BadInputTest, WorkerKilledMidRunTimesOutItsPeerWhenTheLeaseIsLonger) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
  TestServerOptions options;
  options.num_workers = 2;
  options.extra_flags = {"--wait_timeout_ms=3000", "--lease_ms=60000"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  absl::StatusOr<Subprocess*> w0 = cluster_->StartWorker(0, SmallJobFlags({}));
  ASSERT_TRUE(IsOk(w0));
  absl::StatusOr<Subprocess*> w1 = cluster_->StartWorker(1, SmallJobFlags({}));
  ASSERT_TRUE(IsOk(w1));

  // Both are training once worker 1 reports a step.
  ASSERT_TRUE(IsOk(WaitForStdoutLine(*w1, "\"event\":\"step\"", kRunTimeout)));
  ASSERT_TRUE(IsOk((*w1)->Signal(SIGKILL)));
  const absl::Time killed = absl::Now();
  absl::StatusOr<int> status1 = (*w1)->Wait(absl::Seconds(5));
  ASSERT_TRUE(IsOk(status1));
  EXPECT_EQ(*status1, 128 + SIGKILL);

  absl::StatusOr<int> status0 = (*w0)->Wait(absl::Seconds(15));
  ASSERT_TRUE(IsOk(status0)) << "worker 0 must give up on its dead peer";
  EXPECT_EQ(*status0, kExitRuntime);
  // "... pull for step N by worker 0 timed out on shard 0: tensor '...' is at version N-1; waiting
  // for step N-1 gradients from worker(s) 1"
  EXPECT_TRUE(OneErrorLineContaining((*w0)->ReadStderr(), "rubato_worker",
                                     {"timed out", "gradients from worker(s) 1"}));
  // Not before the server's wait timeout, and not much after it.
  const absl::Duration waited = absl::Now() - killed;
  EXPECT_GE(waited, absl::Seconds(1)) << "gave up well before --wait_timeout_ms=3000";
  EXPECT_LT(waited, absl::Seconds(10));

  // The server outlives the dead worker and still shuts down cleanly.
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(15))));
}

}  // namespace
}  // namespace rubato
