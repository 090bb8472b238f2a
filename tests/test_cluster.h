// TestCluster: real rubato_server and rubato_worker processes on 127.0.0.1, for end-to-end tests.
//
// The binaries come from the test's Bazel runfiles ($TEST_SRCDIR/$TEST_WORKSPACE/server/
// rubato_server and .../worker/rubato_worker), so a test target lists them as `data`. Every process
// writes its stdout and stderr to files in a fresh directory under ::testing::TempDir(). Servers
// listen on port 0 and report the port the kernel chose through --port_file.
//
//   auto cluster = TestCluster::Create();
//   TestServerOptions options;
//   options.num_workers = 2;
//   (*cluster)->StartServers(options);
//   (*cluster)->StartWorker(0, {"--steps=10"});
//   (*cluster)->StartWorker(1, {"--steps=10"});
//   auto exit_statuses = (*cluster)->WaitForWorkers(absl::Seconds(60));  // {0: 0, 1: 0}
//   (*cluster)->WaitForServers(absl::Seconds(10));  // OK: the server exited 0 by itself
//
// Destroying the cluster kills whatever is still running.
#ifndef RUBATO_TESTS_TEST_CLUSTER_H_
#define RUBATO_TESTS_TEST_CLUSTER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"

namespace rubato {

struct TestServerOptions {
  int num_shards = 1;
  // --num_workers of every server, and of the workers started by StartWorker.
  int num_workers = 1;
  // Appended to every server's flags (e.g. "--wait_timeout_ms=3000").
  std::vector<std::string> extra_flags;
  // How long the servers get to write their port files.
  absl::Duration start_timeout = absl::Seconds(30);
};

// What a process that ran to completion left behind.
struct ProcessResult {
  int exit_status = -1;  // As Subprocess::Wait reports it.
  std::string stdout_text;
  std::string stderr_text;
};

class TestCluster {
 public:
  // Makes a fresh directory for the processes' files; starts nothing. NotFound if a binary is
  // missing from the runfiles (a test target that lacks the `data` dependency).
  static absl::StatusOr<std::unique_ptr<TestCluster>> Create();

  ~TestCluster() = default;
  TestCluster(const TestCluster&) = delete;
  TestCluster& operator=(const TestCluster&) = delete;

  static absl::StatusOr<std::string> ServerBinary();
  static absl::StatusOr<std::string> WorkerBinary();

  // Starts options.num_shards servers on 127.0.0.1:0 and waits for their port files. An error
  // names the server and carries its stderr if one exits early or does not report a port in time.
  // FailedPrecondition if servers were already started.
  absl::Status StartServers(const TestServerOptions& options);

  // Starts shard `shard_id` again, after it died, on the address it had and with the flags it had
  // (a restarted process, as a supervisor would start it); waits for its port file. The old
  // process must have exited (Signal it and Wait first).
  absl::Status RestartServer(int shard_id, absl::Duration start_timeout = absl::Seconds(30));

  // "127.0.0.1:port" of each shard, in shard order; empty before StartServers.
  const std::vector<std::string>& server_addresses() const { return addresses_; }
  // The addresses joined with ',' as --servers expects them.
  std::string servers_flag() const;

  // Starts rubato_worker with --worker_id, --num_workers and --servers of the running servers,
  // followed by `extra_flags` (a later flag overrides an earlier one). FailedPrecondition before
  // StartServers or for a worker id already started.
  absl::StatusOr<Subprocess*> StartWorker(int worker_id,
                                          const std::vector<std::string>& extra_flags);

  // The worker started with `worker_id`, or null.
  Subprocess* worker(int worker_id) const;
  Subprocess* server(int shard_id) const;

  // Waits, with one deadline for all, for every started worker to exit; returns the exit statuses
  // indexed by worker id. DeadlineExceeded naming the first worker still running.
  absl::StatusOr<std::map<int, int>> WaitForWorkers(absl::Duration timeout);

  // Waits, with one deadline for all, for every server to exit by itself (as it does once every
  // worker has finished). OK only if each exits 0; otherwise the error names the server, its exit
  // status and stderr, or the first one still running (which is left running).
  absl::Status WaitForServers(absl::Duration timeout);

  // Sends SIGTERM to every server and waits for each to exit. OK only if every one exits with 0;
  // otherwise the error names the server, its exit status and stderr.
  absl::Status StopServers(absl::Duration timeout);

  // Runs `binary` with `args` to completion, its output in this cluster's directory as `name`.*.
  // DeadlineExceeded (and the process is killed) if it does not exit within `timeout`.
  absl::StatusOr<ProcessResult> Run(const std::string& name, const std::string& binary,
                                    const std::vector<std::string>& args, absl::Duration timeout);

  // The directory holding the processes' files.
  const std::string& dir() const { return dir_; }

 private:
  explicit TestCluster(std::string dir, std::string server_binary, std::string worker_binary);

  absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::string& name,
                                                    const std::string& binary,
                                                    const std::vector<std::string>& args);

  // Constant after construction.
  const std::string dir_;
  const std::string server_binary_;
  const std::string worker_binary_;

  int num_workers_ = 0;
  TestServerOptions server_options_;
  int restarts_ = 0;
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
  std::map<int, std::unique_ptr<Subprocess>> workers_;
};

// Debian's dataset-fashion-mnist, which the end-to-end tests train on, and whether it is there
// (they skip, saying so, without it).
inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";
bool HaveFashionMnist();

// The params_fnv1a field of the last {"event":"done",...} line of a worker's stdout (16 hex digits:
// a fingerprint of its final parameters), or "" without one.
std::string ParamsFingerprint(absl::string_view worker_stdout);

// test_accuracy of the last {"event":"done",...} line of a worker's stdout. NotFound without such a
// line; InvalidArgument if the line has no parsable test_accuracy.
absl::StatusOr<double> FinalTestAccuracy(absl::string_view worker_stdout);

// The value of "key": in a JSON line, a number's digits or a string's text without its quotes;
// "" if the line has no such key.
std::string JsonField(absl::string_view line, absl::string_view key);
// The integer value of "key": in `line`; -1 if absent or not an integer.
int64_t JsonIntField(absl::string_view line, absl::string_view key);

// The last {"event":"done",...} line of a worker's stdout, or "" without one.
std::string DoneLine(absl::string_view worker_stdout);

// The lines of `text` that start with "<program>: error: ", without the prefix.
std::vector<std::string> ErrorLines(absl::string_view text, absl::string_view program);

// Whether `text` has a line containing `needle`.
bool HasLineContaining(absl::string_view text, absl::string_view needle);

// Polls `process`'s stdout until a line contains `needle`. FailedPrecondition if the process exits
// without printing one, DeadlineExceeded after `timeout`; either carries its stderr.
absl::Status WaitForStdoutLine(Subprocess* process, absl::string_view needle,
                               absl::Duration timeout);

// For ASSERT_TRUE(IsOk(...)): the failure message is the status.
::testing::AssertionResult IsOk(const absl::Status& status);
template <typename T>
::testing::AssertionResult IsOk(const absl::StatusOr<T>& status_or) {
  return IsOk(status_or.status());
}

// `n` distinct loopback ports that were free a moment ago, for processes that must be told their
// port before they start (ring peers, health ports). Chosen at random below the kernel's ephemeral
// range (32768 and up on Linux), where a port the kernel picked (bind to port 0) could be taken
// meanwhile by any process's outgoing connection: tests running in parallel lost their ring
// port that way.
std::vector<int> FreeLoopbackPorts(int n);

}  // namespace rubato

#endif  // RUBATO_TESTS_TEST_CLUSTER_H_
