// Issue 9 end to end, with the real binaries: authentication, TLS, a port in use, the loopback-only
// default, a worker that rejoins under ssp and async, and a network cut a worker must ride out.
// Each case reproduces a finding against main before the fix (see the issue) and fails there.
#include <sys/stat.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "tests/tcp_proxy.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr char kDataDir[] = "/usr/share/datasets/fashion-mnist";
constexpr absl::Duration kRunTimeout = absl::Seconds(60);

class HardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    struct stat st;
    if (stat(kDataDir, &st) != 0) GTEST_SKIP() << "Fashion-MNIST not found at " << kDataDir;
    auto cluster = TestCluster::Create();
    ASSERT_TRUE(IsOk(cluster));
    cluster_ = *std::move(cluster);
  }

  // A secret file with mode 600 in the cluster's directory.
  std::string WriteSecret(const std::string& name, const std::string& secret) {
    const std::string path = absl::StrCat(cluster_->dir(), "/", name);
    std::ofstream(path) << secret;
    EXPECT_EQ(chmod(path.c_str(), 0600), 0);
    return path;
  }

  std::vector<std::string> WorkerFlags(int steps) {
    return {absl::StrCat("--data_dir=", kDataDir), "--train_limit=3000", "--test_limit=500",
            absl::StrCat("--steps=", steps), "--log_every=5", "--connect_timeout_ms=5000"};
  }

  ProcessResult RunWorker(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--worker_id=0", "--num_workers=1",
                                     absl::StrCat("--servers=", cluster_->servers_flag())};
    for (const std::string& f : WorkerFlags(5)) args.push_back(f);
    args.insert(args.end(), extra.begin(), extra.end());
    absl::StatusOr<ProcessResult> r =
        cluster_->Run(absl::StrCat("worker-run-", ++runs_), *TestCluster::WorkerBinary(), args,
                      kRunTimeout);
    EXPECT_TRUE(IsOk(r));
    return r.ok() ? *std::move(r) : ProcessResult();
  }

  ProcessResult RunServer(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--num_workers=1",
                                     absl::StrCat("--port_file=", cluster_->dir(), "/run.port")};
    args.insert(args.end(), extra.begin(), extra.end());
    const std::string name = absl::StrCat("server-run-", ++runs_);
    absl::StatusOr<ProcessResult> r =
        cluster_->Run(name, *TestCluster::ServerBinary(), args, absl::Seconds(3));
    if (r.ok()) return *std::move(r);
    // A server that starts serves until a signal: Run kills it at the deadline. What it said is in
    // its files.
    ProcessResult killed;
    killed.stderr_text = ReadFileOrEmpty(absl::StrCat(cluster_->dir(), "/", name, ".stderr"));
    return killed;
  }

  std::unique_ptr<TestCluster> cluster_;
  int runs_ = 0;
};

// Finding 6: gRPC set SO_REUSEPORT, so a second server bound a port a live one held.
TEST_F(HardeningTest, PortInUseIsAnErrorNamingTheAddress) {
  TestServerOptions options;
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  const std::string taken = cluster_->server_addresses()[0];
  ProcessResult second = RunServer({absl::StrCat("--listen=", taken)});
  EXPECT_EQ(second.exit_status, 2) << second.stderr_text;
  EXPECT_NE(second.stderr_text.find(absl::StrCat("cannot listen on ", taken)), std::string::npos)
      << second.stderr_text;
  EXPECT_NE(second.stderr_text.find("in use"), std::string::npos) << second.stderr_text;
  // Told apart before gRPC tries, so no dump of gRPC's own precedes the one error line.
  EXPECT_EQ(second.stderr_text.find("Failed to add"), std::string::npos) << second.stderr_text;
  // An address of another host (TEST-NET-1; a bind sends nothing) is another cause, named.
  ProcessResult elsewhere = RunServer({"--listen=192.0.2.1:5000", "--insecure"});
  EXPECT_EQ(elsewhere.exit_status, 2) << elsewhere.stderr_text;
  EXPECT_NE(elsewhere.stderr_text.find(
                "cannot listen on 192.0.2.1:5000 (--listen): 192.0.2.1 is not an address of "
                "this host"),
            std::string::npos)
      << elsewhere.stderr_text;
}

// Secure by default: without a secret a server listens only on loopback, unless --insecure.
TEST_F(HardeningTest, NonLoopbackListenNeedsASecretOrInsecure) {
  ProcessResult refused = RunServer({"--listen=0.0.0.0:0"});
  EXPECT_EQ(refused.exit_status, 2) << refused.stderr_text;
  EXPECT_NE(refused.stderr_text.find("refusing to listen on 0.0.0.0:0 without authentication"),
            std::string::npos)
      << refused.stderr_text;
  // With a secret (or --insecure) it starts and serves; Run kills it at its deadline.
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{
            absl::StrCat("--auth_secret_file=", WriteSecret("s", "0123456789abcdef0123")),
            "--job_id=hardening-listen"},
        {"--insecure"}}) {
    std::vector<std::string> args = {"--listen=0.0.0.0:0"};
    args.insert(args.end(), flags.begin(), flags.end());
    ProcessResult served = RunServer(args);
    const std::string flag = flags[0];
    EXPECT_NE(served.stderr_text.find("serving on 0.0.0.0:"), std::string::npos)
        << flag << ": " << served.stderr_text;
  }
}

// Finding 7: anyone who reached the port could register, push, pull and read stats.
TEST_F(HardeningTest, OnlyWorkersWithTheJobSecretTakePart) {
  const std::string secret = WriteSecret("job.secret", "correct horse battery staple 42");
  const std::string other = WriteSecret("other.secret", "some other job's secret, 31 bytes");
  TestServerOptions options;
  const std::string job = "--job_id=hardening-7f3a9c0e11d2b456";
  options.extra_flags = {absl::StrCat("--auth_secret_file=", secret), job};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  // No secret; another secret; this job's secret with another job's id (a job started later
  // from the same secret file).
  for (const std::vector<std::string>& wrong :
       {std::vector<std::string>{},
        {absl::StrCat("--auth_secret_file=", other), job},
        {absl::StrCat("--auth_secret_file=", secret), "--job_id=hardening-0000000000000000"}}) {
    ProcessResult r = RunWorker(wrong);
    EXPECT_EQ(r.exit_status, 1) << r.stderr_text;
    EXPECT_NE(r.stderr_text.find("UNAUTHENTICATED"), std::string::npos) << r.stderr_text;
  }
  // A secret without a job id is a usage error, named.
  ProcessResult no_id = RunWorker({absl::StrCat("--auth_secret_file=", secret)});
  EXPECT_EQ(no_id.exit_status, 2) << no_id.stderr_text;
  EXPECT_NE(no_id.stderr_text.find("--auth_secret_file needs --job_id"), std::string::npos)
      << no_id.stderr_text;
  ProcessResult good = RunWorker({absl::StrCat("--auth_secret_file=", secret), job});
  EXPECT_EQ(good.exit_status, 0) << good.stderr_text;
  EXPECT_TRUE(FinalTestAccuracy(good.stdout_text).ok()) << good.stdout_text;
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(10))));
}

// TLS with client certificates, from a throwaway CA made here.
TEST_F(HardeningTest, MutualTlsJobTrainsAndPlaintextOrCertlessClientsAreRefused) {
  const std::string d = cluster_->dir();
  const std::string script = absl::StrCat(
      "set -e; cd ", d,
      "; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 "
      "-subj /CN=rubato-test-ca -keyout ca.key -out ca.pem 2>/dev/null; "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext; "
      "for n in server client; do "
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=$n "
      "-keyout $n.key -out $n.csr 2>/dev/null; "
      "openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
      "-extfile san.ext -out $n.pem 2>/dev/null; done");
  ASSERT_EQ(std::system(script.c_str()), 0) << "openssl could not make the test certificates";
  const std::string secret = WriteSecret("job.secret", "a secret for the TLS job, 30+ bytes");
  TestServerOptions options;
  options.extra_flags = {absl::StrCat("--auth_secret_file=", secret), "--job_id=hardening-tls",
                         absl::StrCat("--tls_cert=", d, "/server.pem"),
                         absl::StrCat("--tls_key=", d, "/server.key"),
                         absl::StrCat("--tls_ca=", d, "/ca.pem")};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  const std::string auth = absl::StrCat("--auth_secret_file=", secret);
  const std::string job = "--job_id=hardening-tls";
  const std::string ca = absl::StrCat("--tls_ca=", d, "/ca.pem");
  // Plaintext, and TLS without a client certificate: the handshake fails, the worker cannot reach
  // the server and says so within its connect timeout.
  for (const std::vector<std::string>& refused :
       {std::vector<std::string>{auth, job}, {auth, job, ca}}) {
    ProcessResult r = RunWorker(refused);
    EXPECT_EQ(r.exit_status, 1) << r.stderr_text;
    EXPECT_NE(r.stderr_text.find("cannot reach parameter server shard 0"), std::string::npos)
        << r.stderr_text;
  }
  ProcessResult good = RunWorker({auth, job, ca, absl::StrCat("--tls_cert=", d, "/client.pem"),
                                  absl::StrCat("--tls_key=", d, "/client.key")});
  EXPECT_EQ(good.exit_status, 0) << good.stderr_text;
  EXPECT_TRUE(FinalTestAccuracy(good.stdout_text).ok()) << good.stdout_text;
  // Issue 31, item 9: Push and Pull stayed on the shard's data plane, itself mutual TLS (before,
  // a TLS job had no data plane, and its calls went over gRPC).
  EXPECT_EQ(good.stderr_text.find("go over gRPC"), std::string::npos) << good.stderr_text;
  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(10))));
  const std::string server_log = ReadFileOrEmpty(absl::StrCat(d, "/server-0.stderr"));
  EXPECT_NE(server_log.find("Push and Pull data plane (mutual TLS"), std::string::npos)
      << server_log;
}

// The value of `key` in the last "done" record of a worker's stdout, or -1.
int64_t DoneField(const std::string& stdout_text, const std::string& key) {
  int64_t value = -1;
  for (absl::string_view line : absl::StrSplit(stdout_text, '\n')) {
    if (line.find("\"event\":\"done\"") == absl::string_view::npos) continue;
    const size_t at = line.find(absl::StrCat("\"", key, "\":"));
    if (at == absl::string_view::npos) continue;
    value = std::strtoll(std::string(line.substr(at + key.size() + 3)).c_str(), nullptr, 10);
  }
  return value;
}

// Finding 5: a worker stopped for longer than its lease rejoined at the tensor version, which in
// ssp and async counts every worker's pushes: under ssp:2 every worker then timed out, under
// async the rejoined worker skipped most of its steps and still reported them done.
TEST_F(HardeningTest, StoppedWorkerRejoinsAtItsOwnClockInSspAndAsync) {
  for (const std::string mode : {"ssp:2", "async"}) {
    SCOPED_TRACE(mode);
    auto cluster = TestCluster::Create();
    ASSERT_TRUE(IsOk(cluster));
    TestServerOptions options;
    options.num_workers = 3;
    options.extra_flags = {absl::StrCat("--mode=", mode), "--lease_ms=1500",
                           "--wait_timeout_ms=30000"};
    ASSERT_TRUE(IsOk((*cluster)->StartServers(options)));
    std::vector<std::string> flags = WorkerFlags(120);
    flags.insert(flags.end(), {absl::StrCat("--mode=", mode), "--lease_ms=1500",
                               "--min_step_ms=25", "--wait_timeout_ms=30000"});
    for (int w = 0; w < 3; ++w) ASSERT_TRUE(IsOk((*cluster)->StartWorker(w, flags)));
    Subprocess* stopped = (*cluster)->worker(1);
    ASSERT_TRUE(IsOk(WaitForStdoutLine(stopped, "\"step\":10,", kRunTimeout)));
    ASSERT_TRUE(IsOk(stopped->Signal(SIGSTOP)));
    absl::SleepFor(absl::Seconds(4));  // Well past the lease: the shard drops it.
    ASSERT_TRUE(IsOk(stopped->Signal(SIGCONT)));
    absl::StatusOr<std::map<int, int>> statuses = (*cluster)->WaitForWorkers(absl::Seconds(90));
    ASSERT_TRUE(IsOk(statuses));
    for (int w = 0; w < 3; ++w) {
      Subprocess* worker = (*cluster)->worker(w);
      EXPECT_EQ(statuses->at(w), 0) << "worker " << w << ":\n" << worker->ReadStderr();
    }
    const std::string out = stopped->ReadStdout();
    EXPECT_TRUE(HasLineContaining(out, "\"event\":\"rejoin\"")) << "it was not dropped:\n" << out;
    // It computed (nearly) all of its own steps: none skipped on a rejoin at its own clock.
    EXPECT_EQ(DoneField(out, "skipped_steps"), 0) << out;
    EXPECT_EQ(DoneField(out, "computed_steps"), 120) << out;
  }
}

// Finding 9: a cut of the link between a worker and its server longer than about 5 s killed the
// worker. It now rides out a cut shorter than --retry_timeout_ms, and fails naming the shard after.
// The proxy stands in front of the gRPC port only, so the workers here keep Push and Pull on gRPC
// (--ps_transport=grpc): the data plane's port would bypass the cut.
TEST_F(HardeningTest, WorkerRidesOutANetworkCutThenFailsNamingTheShard) {
  TestServerOptions options;
  options.extra_flags = {"--lease_ms=20000"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  const std::string& address = cluster_->server_addresses()[0];
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  absl::StatusOr<std::unique_ptr<TcpProxy>> proxy = TcpProxy::Start(port);
  ASSERT_TRUE(IsOk(proxy));
  std::vector<std::string> flags = WorkerFlags(150);
  flags.insert(flags.end(), {absl::StrCat("--servers=127.0.0.1:", (*proxy)->port()),
                             "--min_step_ms=20", "--lease_ms=20000", "--ps_transport=grpc"});
  absl::StatusOr<Subprocess*> worker = cluster_->StartWorker(0, flags);
  ASSERT_TRUE(IsOk(worker));
  ASSERT_TRUE(IsOk(WaitForStdoutLine(*worker, "\"step\":10,", kRunTimeout)));
  (*proxy)->Cut();
  absl::SleepFor(absl::Seconds(6));
  (*proxy)->Restore();
  absl::StatusOr<int> status = (*worker)->Wait(kRunTimeout);
  ASSERT_TRUE(IsOk(status));
  EXPECT_EQ(*status, 0) << (*worker)->ReadStderr();
  EXPECT_TRUE(FinalTestAccuracy((*worker)->ReadStdout()).ok());

  EXPECT_TRUE(IsOk(cluster_->StopServers(absl::Seconds(10))));

  // A cut that outlasts --retry_timeout_ms: the worker fails, naming the shard and its address.
  auto second = TestCluster::Create();
  ASSERT_TRUE(IsOk(second));
  ASSERT_TRUE(IsOk((*second)->StartServers(options)));
  const std::string& address2 = (*second)->server_addresses()[0];
  auto proxy2 = TcpProxy::Start(std::stoi(address2.substr(address2.rfind(':') + 1)));
  ASSERT_TRUE(IsOk(proxy2));
  flags = WorkerFlags(150);
  flags.insert(flags.end(),
               {absl::StrCat("--servers=127.0.0.1:", (*proxy2)->port()), "--min_step_ms=20",
                "--lease_ms=20000", "--retry_timeout_ms=1500", "--ps_transport=grpc"});
  absl::StatusOr<Subprocess*> doomed = (*second)->StartWorker(0, flags);
  ASSERT_TRUE(IsOk(doomed));
  ASSERT_TRUE(IsOk(WaitForStdoutLine(*doomed, "\"step\":10,", kRunTimeout)));
  (*proxy2)->Cut();
  const absl::Time cut_at = absl::Now();
  status = (*doomed)->Wait(kRunTimeout);
  ASSERT_TRUE(IsOk(status));
  EXPECT_EQ(*status, 1) << (*doomed)->ReadStderr();
  EXPECT_GE(absl::Now() - cut_at, absl::Milliseconds(1400)) << "gave up before the retry window";
  const std::vector<std::string> errors = ErrorLines((*doomed)->ReadStderr(), "rubato_worker");
  ASSERT_EQ(errors.size(), 1u) << (*doomed)->ReadStderr();
  EXPECT_NE(errors[0].find(absl::StrCat("parameter server shard 0 at 127.0.0.1:",
                                        (*proxy2)->port(), " unreachable for")),
            std::string::npos)
      << errors[0];
}

// Issue 31, item 5: a shard stopped (SIGSTOP) for longer than a call's deadline ended every
// worker with DEADLINE_EXCEEDED, although --retry_timeout_ms was longer. A call that had no answer
// by its deadline is now retried like one that was refused, within the retry timeout. Here
// --wait_timeout_ms=2000 makes each call's deadline 12 s; the shard is stopped for 15 s, and the
// lease (60 s) is longer, so nobody is dropped.
TEST_F(HardeningTest, AShardStoppedPastACallsDeadlineIsWaitedForWithinTheRetryTimeout) {
  TestServerOptions options;
  options.num_workers = 2;
  options.extra_flags = {"--lease_ms=60000", "--wait_timeout_ms=2000"};
  ASSERT_TRUE(IsOk(cluster_->StartServers(options)));
  std::vector<std::string> flags = WorkerFlags(80);
  flags.insert(flags.end(), {"--lease_ms=60000", "--wait_timeout_ms=2000",
                             "--min_step_ms=20", "--retry_timeout_ms=40000"});
  for (int w = 0; w < 2; ++w) ASSERT_TRUE(IsOk(cluster_->StartWorker(w, flags)));
  ASSERT_TRUE(IsOk(WaitForStdoutLine(cluster_->worker(0), "\"step\":10,", kRunTimeout)));
  Subprocess* shard = cluster_->server(0);
  ASSERT_TRUE(IsOk(shard->Signal(SIGSTOP)));
  absl::SleepFor(absl::Seconds(15));
  ASSERT_TRUE(IsOk(shard->Signal(SIGCONT)));
  absl::StatusOr<std::map<int, int>> statuses = cluster_->WaitForWorkers(kRunTimeout);
  ASSERT_TRUE(IsOk(statuses));
  for (int w = 0; w < 2; ++w) {
    Subprocess* worker = cluster_->worker(w);
    EXPECT_EQ(statuses->at(w), 0) << "worker " << w << ":\n" << worker->ReadStderr();
    EXPECT_TRUE(FinalTestAccuracy(worker->ReadStdout()).ok()) << worker->ReadStdout();
  }
  EXPECT_TRUE(IsOk(cluster_->WaitForServers(absl::Seconds(30))));
}

}  // namespace
}  // namespace rubato
