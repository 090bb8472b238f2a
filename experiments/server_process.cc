#include "experiments/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace rubato {

absl::StatusOr<ServerProcess> StartServerProcess(const std::string& binary,
                                                 const std::vector<std::string>& flags,
                                                 absl::Duration timeout) {
  char dir_template[] = "/tmp/rubato-server-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string port_file = absl::StrCat(dir_template, "/port");
  std::vector<std::string> args = {binary, "--listen=127.0.0.1:0", "--port_file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ServerProcess server;
  server.pid = fork();
  if (server.pid < 0) return absl::InternalError("fork failed");
  if (server.pid == 0) {
    // Its final statistics line (stdout) would land among the experiment's figures.
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDOUT_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (server.address.empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    std::ifstream(port_file) >> server.address;
    if (waitpid(server.pid, nullptr, WNOHANG) == server.pid) {
      return absl::UnavailableError(absl::StrCat(binary, " exited before serving"));
    }
  }
  unlink(port_file.c_str());
  rmdir(dir_template);
  if (server.address.empty()) {
    kill(server.pid, SIGKILL);
    waitpid(server.pid, nullptr, 0);
    return absl::UnavailableError(
        absl::StrCat(binary, " did not write its port within ", absl::FormatDuration(timeout)));
  }
  return server;
}

int StopServerProcess(ServerProcess* server, absl::Duration grace) {
  if (server->pid <= 0) return -1;
  kill(server->pid, SIGTERM);
  int status = 0;
  const absl::Time deadline = absl::Now() + grace;
  pid_t done = 0;
  while ((done = waitpid(server->pid, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (done == 0) {
    kill(server->pid, SIGKILL);
    waitpid(server->pid, &status, 0);
  }
  server->pid = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    int64_t kb = 0;
    if (absl::ConsumePrefix(&rest, "VmRSS:") && absl::ConsumeSuffix(&rest, " kB") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kb)) {
      return kb << 10;
    }
  }
  return -1;
}

}  // namespace rubato
