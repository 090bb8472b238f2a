#include "tests/test_cluster.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <random>
#include <cstdlib>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

absl::StatusOr<std::string> Runfile(absl::string_view relative_path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) {
    return absl::FailedPreconditionError(
        "TEST_SRCDIR / TEST_WORKSPACE are not set: run this test with `bazel test`");
  }
  std::string path = absl::StrCat(srcdir, "/", workspace, "/", relative_path);
  if (access(path.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(
        path, " is not an executable in the runfiles; is it a `data` dependency of the test?"));
  }
  return path;
}

// The last `max_chars` of `text`, for error messages.
std::string Tail(absl::string_view text, size_t max_chars = 2000) {
  if (text.size() <= max_chars) return std::string(text);
  return absl::StrCat("...", text.substr(text.size() - max_chars));
}

std::string Describe(const Subprocess& p) {
  return absl::StrCat(p.name(), " stderr:\n", Tail(p.ReadStderr()));
}

// What is left of `deadline`, never negative.
absl::Duration Remaining(absl::Time deadline) {
  return std::max(absl::ZeroDuration(), deadline - absl::Now());
}

}  // namespace

absl::StatusOr<std::string> TestCluster::ServerBinary() { return Runfile("server/rubato_server"); }

absl::StatusOr<std::string> TestCluster::WorkerBinary() { return Runfile("worker/rubato_worker"); }

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Create() {
  absl::StatusOr<std::string> server = ServerBinary();
  if (!server.ok()) return server.status();
  absl::StatusOr<std::string> worker = WorkerBinary();
  if (!worker.ok()) return worker.status();
  std::string dir = ::testing::TempDir() + "rubato_cluster_XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("mkdtemp ", dir));
  }
  return std::unique_ptr<TestCluster>(
      new TestCluster(std::move(dir), *std::move(server), *std::move(worker)));
}

TestCluster::TestCluster(std::string dir, std::string server_binary, std::string worker_binary)
    : dir_(std::move(dir)),
      server_binary_(std::move(server_binary)),
      worker_binary_(std::move(worker_binary)) {}

absl::StatusOr<std::unique_ptr<Subprocess>> TestCluster::Spawn(
    const std::string& name, const std::string& binary, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string prefix = absl::StrCat(dir_, "/", name);
  return Subprocess::Start(name, std::move(argv), prefix + ".stdout", prefix + ".stderr");
}

absl::Status TestCluster::StartServers(const TestServerOptions& options) {
  if (!servers_.empty()) return absl::FailedPreconditionError("servers already started");
  num_workers_ = options.num_workers;
  server_options_ = options;
  std::vector<std::string> port_files;
  for (int s = 0; s < options.num_shards; ++s) {
    port_files.push_back(absl::StrCat(dir_, "/server-", s, ".port"));
    std::vector<std::string> args = {
        absl::StrCat("--shard_id=", s),
        absl::StrCat("--num_shards=", options.num_shards),
        absl::StrCat("--num_workers=", options.num_workers),
        "--listen=127.0.0.1:0",
        absl::StrCat("--port_file=", port_files.back()),
    };
    args.insert(args.end(), options.extra_flags.begin(), options.extra_flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> server =
        Spawn(absl::StrCat("server-", s), server_binary_, args);
    if (!server.ok()) return server.status();
    servers_.push_back(*std::move(server));
  }

  // The server renames the port file into place once it accepts connections.
  const absl::Time deadline = absl::Now() + options.start_timeout;
  for (int s = 0; s < options.num_shards; ++s) {
    while (access(port_files[s].c_str(), R_OK) != 0) {
      absl::StatusOr<int> exited = servers_[s]->Wait(absl::ZeroDuration());
      if (exited.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("server-", s, " exited with status ",
                                                          *exited, " before reporting its port; ",
                                                          Describe(*servers_[s])));
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("server-", s, " wrote no port file within ",
                                                        absl::FormatDuration(options.start_timeout),
                                                        "; ", Describe(*servers_[s])));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    const std::string address(absl::StripAsciiWhitespace(ReadFileOrEmpty(port_files[s])));
    if (!absl::StartsWith(address, "127.0.0.1:")) {
      return absl::InternalError(
          absl::StrCat("server-", s, " port file ", port_files[s], " holds '", address, "'"));
    }
    addresses_.push_back(address);
  }
  return absl::OkStatus();
}

absl::Status TestCluster::RestartServer(int shard_id, absl::Duration start_timeout) {
  if (shard_id < 0 || shard_id >= static_cast<int>(addresses_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no shard ", shard_id));
  }
  const std::string port_file =
      absl::StrCat(dir_, "/server-", shard_id, ".restart-", ++restarts_, ".port");
  std::vector<std::string> args = {
      absl::StrCat("--shard_id=", shard_id),
      absl::StrCat("--num_shards=", server_options_.num_shards),
      absl::StrCat("--num_workers=", server_options_.num_workers),
      "--listen=" + addresses_[shard_id],
      "--port_file=" + port_file,
  };
  args.insert(args.end(), server_options_.extra_flags.begin(), server_options_.extra_flags.end());
  ASSIGN_OR_RETURN(
      std::unique_ptr<Subprocess> server,
      Spawn(absl::StrCat("server-", shard_id, "-restart-", restarts_), server_binary_, args));
  servers_[shard_id] = std::move(server);
  const absl::Time deadline = absl::Now() + start_timeout;
  while (access(port_file.c_str(), R_OK) != 0) {
    if (absl::StatusOr<int> exited = servers_[shard_id]->Wait(absl::ZeroDuration()); exited.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("restarted server-", shard_id,
                                                        " exited with status ", *exited, "; ",
                                                        Describe(*servers_[shard_id])));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "restarted server-", shard_id, " wrote no port file; ", Describe(*servers_[shard_id])));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::OkStatus();
}

std::string TestCluster::servers_flag() const { return absl::StrJoin(addresses_, ","); }

absl::StatusOr<Subprocess*> TestCluster::StartWorker(int worker_id,
                                                     const std::vector<std::string>& extra_flags) {
  if (addresses_.empty()) return absl::FailedPreconditionError("StartServers first");
  if (workers_.count(worker_id) > 0) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " already started"));
  }
  std::vector<std::string> args = {
      absl::StrCat("--worker_id=", worker_id),
      absl::StrCat("--num_workers=", num_workers_),
      absl::StrCat("--servers=", servers_flag()),
      // The tests check every worker's final accuracy (under bsp, that they all hold the same
      // weights); by default only worker 0 of a bsp job evaluates.
      "--eval_all_workers",
  };
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> worker =
      Spawn(absl::StrCat("worker-", worker_id), worker_binary_, args);
  if (!worker.ok()) return worker.status();
  Subprocess* raw = worker->get();
  workers_[worker_id] = *std::move(worker);
  return raw;
}

Subprocess* TestCluster::worker(int worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : it->second.get();
}

Subprocess* TestCluster::server(int shard_id) const {
  if (shard_id < 0 || shard_id >= static_cast<int>(servers_.size())) return nullptr;
  return servers_[shard_id].get();
}

absl::StatusOr<std::map<int, int>> TestCluster::WaitForWorkers(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::map<int, int> exit_statuses;
  for (auto& [id, process] : workers_) {
    absl::StatusOr<int> status = process->Wait(Remaining(deadline));
    if (!status.ok()) {
      return absl::Status(status.status().code(),
                          absl::StrCat(status.status().message(), "; ", Describe(*process)));
    }
    exit_statuses[id] = *status;
  }
  return exit_statuses;
}

absl::Status TestCluster::WaitForServers(absl::Duration timeout) {
  std::vector<std::string> problems;
  const absl::Time deadline = absl::Now() + timeout;
  for (auto& server : servers_) {
    absl::StatusOr<int> status = server->Wait(Remaining(deadline));
    if (!status.ok()) {
      return absl::DeadlineExceededError(
          absl::StrCat(server->name(), " still running ", absl::FormatDuration(timeout),
                       " after the wait began; ", Describe(*server)));
    }
    if (*status != 0) {
      problems.push_back(
          absl::StrCat(server->name(), " exited with status ", *status, "; ", Describe(*server)));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrJoin(problems, "\n"));
}

absl::Status TestCluster::StopServers(absl::Duration timeout) {
  std::vector<std::string> problems;
  for (auto& server : servers_) {
    if (absl::Status s = server->Signal(SIGTERM); !s.ok())
      problems.push_back(std::string(s.message()));
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (auto& server : servers_) {
    absl::StatusOr<int> status = server->Wait(Remaining(deadline));
    if (!status.ok()) {
      problems.push_back(absl::StrCat(status.status().message(), "; ", Describe(*server)));
      server->Kill();
    } else if (*status != 0 && *status != 128 + SIGTERM) {
      // 0: the job was over; 143: stopped before it was (server_main.cc). Both are a clean stop.
      problems.push_back(absl::StrCat(server->name(), " exited with status ", *status,
                                      " after SIGTERM; ", Describe(*server)));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrJoin(problems, "\n"));
}

absl::StatusOr<ProcessResult> TestCluster::Run(const std::string& name, const std::string& binary,
                                               const std::vector<std::string>& args,
                                               absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<Subprocess>> process = Spawn(name, binary, args);
  if (!process.ok()) return process.status();
  absl::StatusOr<int> status = (*process)->Wait(timeout);
  if (!status.ok()) {
    (*process)->Kill();
    return absl::Status(status.status().code(),
                        absl::StrCat(status.status().message(), "; ", Describe(**process)));
  }
  ProcessResult result;
  result.exit_status = *status;
  result.stdout_text = (*process)->ReadStdout();
  result.stderr_text = (*process)->ReadStderr();
  return result;
}

bool HaveFashionMnist() {
  struct stat st;
  return stat(kFashionMnistDir, &st) == 0 && S_ISDIR(st.st_mode);
}

std::string JsonField(absl::string_view line, absl::string_view key) {
  const std::string quoted = absl::StrCat("\"", key, "\":");
  const size_t at = line.find(quoted);
  if (at == absl::string_view::npos) return "";
  size_t begin = at + quoted.size();
  const bool string = begin < line.size() && line[begin] == '"';
  if (string) ++begin;
  size_t end = begin;
  while (end < line.size() && line[end] != (string ? '"' : ',') && line[end] != '}') ++end;
  return std::string(line.substr(begin, end - begin));
}

int64_t JsonIntField(absl::string_view line, absl::string_view key) {
  int64_t v = -1;
  return absl::SimpleAtoi(JsonField(line, key), &v) ? v : -1;
}

std::string DoneLine(absl::string_view worker_stdout) {
  std::string done;
  for (absl::string_view line : absl::StrSplit(worker_stdout, '\n')) {
    if (absl::StrContains(line, "\"event\":\"done\"")) done = std::string(line);
  }
  return done;
}

std::string ParamsFingerprint(absl::string_view worker_stdout) {
  const size_t at = worker_stdout.rfind("\"params_fnv1a\":\"");
  if (at == absl::string_view::npos || at + 16 + 16 > worker_stdout.size()) return "";
  return std::string(worker_stdout.substr(at + 16, 16));
}

absl::StatusOr<double> FinalTestAccuracy(absl::string_view worker_stdout) {
  std::vector<absl::string_view> lines = absl::StrSplit(worker_stdout, '\n');
  for (auto line = lines.rbegin(); line != lines.rend(); ++line) {
    if (!absl::StrContains(*line, "\"event\":\"done\"")) continue;
    constexpr absl::string_view kKey = "\"test_accuracy\":";
    const size_t at = line->find(kKey);
    if (at == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("no test_accuracy in: ", *line));
    }
    absl::string_view value = line->substr(at + kKey.size());
    value = value.substr(0, value.find_first_of(",}"));
    double accuracy;
    if (!absl::SimpleAtod(value, &accuracy)) {
      return absl::InvalidArgumentError(absl::StrCat("test_accuracy '", value, "' in: ", *line));
    }
    return accuracy;
  }
  return absl::NotFoundError(
      absl::StrCat("no \"done\" event in worker stdout:\n", Tail(worker_stdout)));
}

std::vector<std::string> ErrorLines(absl::string_view text, absl::string_view program) {
  const std::string prefix = absl::StrCat(program, ": error: ");
  std::vector<std::string> errors;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, prefix)) errors.push_back(std::string(line));
  }
  return errors;
}

absl::Status WaitForStdoutLine(Subprocess* process, absl::string_view needle,
                               absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!HasLineContaining(process->ReadStdout(), needle)) {
    if (absl::StatusOr<int> exited = process->Wait(absl::ZeroDuration()); exited.ok()) {
      // It may have printed the line just before exiting.
      if (HasLineContaining(process->ReadStdout(), needle)) break;
      return absl::FailedPreconditionError(absl::StrCat(process->name(), " exited with status ",
                                                        *exited, " before printing a line with ",
                                                        needle, "; ", Describe(*process)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(process->name(), " printed no line with ", needle, " within ",
                       absl::FormatDuration(timeout), "; ", Describe(*process)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::OkStatus();
}

::testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << status;
}

bool HasLineContaining(absl::string_view text, absl::string_view needle) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, needle)) return true;
  }
  return false;
}

std::vector<int> FreeLoopbackPorts(int n) {
  std::random_device seed;
  std::mt19937 rng(seed());
  std::uniform_int_distribution<int> pick(20000, 32000);
  std::vector<int> ports;
  for (int tries = 0; static_cast<int>(ports.size()) < n && tries < 10000; ++tries) {
    const int port = pick(rng);
    if (std::find(ports.begin(), ports.end(), port) != ports.end()) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(fd);
    if (free) ports.push_back(port);
  }
  EXPECT_EQ(static_cast<int>(ports.size()), n) << "no free loopback ports below 32000";
  return ports;
}

}  // namespace rubato
