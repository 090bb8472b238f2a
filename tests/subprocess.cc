#include "tests/subprocess.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rubato {
namespace {

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Close(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

absl::Status ErrnoError(int error, absl::string_view what) {
  return absl::ErrnoToStatus(error, what);
}

// Shell convention: the exit code, or 128 + the signal that killed the process.
int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;  // Stopped or continued: not requested from waitpid, so never seen.
}

}  // namespace

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(std::string name,
                                                              std::vector<std::string> argv,
                                                              std::string stdout_path,
                                                              std::string stderr_path) {
  if (argv.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": empty argv"));

  // Everything the child needs is prepared here: between fork and exec only async-signal-safe
  // calls are allowed.
  Fd out(open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (out.get() < 0) return ErrnoError(errno, absl::StrCat(name, ": cannot open ", stdout_path));
  Fd err(open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (err.get() < 0) return ErrnoError(errno, absl::StrCat(name, ": cannot open ", stderr_path));
  Fd in(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (in.get() < 0) return ErrnoError(errno, absl::StrCat(name, ": cannot open /dev/null"));
  // The child writes exec's errno here; a successful exec closes it, and the parent reads EOF.
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) return ErrnoError(errno, absl::StrCat(name, ": pipe2"));
  Fd exec_read(exec_pipe[0]);
  Fd exec_write(exec_pipe[1]);
  std::vector<char*> cargv;
  for (std::string& arg : argv) cargv.push_back(arg.data());
  cargv.push_back(nullptr);
  const pid_t parent = getpid();

  const pid_t pid = fork();
  if (pid < 0) return ErrnoError(errno, absl::StrCat(name, ": fork"));
  if (pid == 0) {
    // Child. PR_SET_PDEATHSIG fires when the forking thread ends; the check after it closes the
    // race with a parent that died before the prctl.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    // dup2 clears O_CLOEXEC on the copies, so only 0, 1, 2 survive exec.
    if (dup2(in.get(), STDIN_FILENO) < 0 || dup2(out.get(), STDOUT_FILENO) < 0 ||
        dup2(err.get(), STDERR_FILENO) < 0) {
      const int e = errno;
      ssize_t ignored = write(exec_write.get(), &e, sizeof e);
      (void)ignored;
      _exit(127);
    }
    execv(cargv[0], cargv.data());
    const int e = errno;
    ssize_t ignored = write(exec_write.get(), &e, sizeof e);
    (void)ignored;
    _exit(127);
  }

  exec_write.Close();
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(exec_read.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  if (n == sizeof child_errno) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return ErrnoError(child_errno, absl::StrCat(name, ": cannot execute ", argv[0]));
  }
  return std::unique_ptr<Subprocess>(
      new Subprocess(std::move(name), pid, std::move(stdout_path), std::move(stderr_path)));
}

Subprocess::Subprocess(std::string name, pid_t pid, std::string stdout_path,
                       std::string stderr_path)
    : name_(std::move(name)),
      pid_(pid),
      stdout_path_(std::move(stdout_path)),
      stderr_path_(std::move(stderr_path)) {}

Subprocess::~Subprocess() {
  if (exit_status_.has_value()) return;
  kill(pid_, SIGKILL);
  int status;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration poll = absl::Milliseconds(1);
  while (!exit_status_.has_value()) {
    int status;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_status_ = DecodeWaitStatus(status);
      break;
    }
    if (r < 0 && errno != EINTR) {
      return ErrnoError(errno, absl::StrCat(name_, " (pid ", pid_, "): waitpid"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          name_, " (pid ", pid_, ") did not exit within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(poll, deadline - now));
    poll = std::min(poll * 2, absl::Milliseconds(20));
  }
  return *exit_status_;
}

absl::Status Subprocess::Signal(int sig) {
  if (exit_status_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, " (pid ", pid_, ") has already exited with status ", *exit_status_));
  }
  // Not yet reaped, so the pid cannot have been reused: at worst this signals a zombie.
  if (kill(pid_, sig) != 0) {
    return ErrnoError(errno, absl::StrCat(name_, " (pid ", pid_, "): kill(", sig, ")"));
  }
  return absl::OkStatus();
}

void Subprocess::Kill() {
  if (!exit_status_.has_value()) kill(pid_, SIGKILL);
}

std::string Subprocess::ReadStdout() const { return ReadFileOrEmpty(stdout_path_); }

std::string Subprocess::ReadStderr() const { return ReadFileOrEmpty(stderr_path_); }

}  // namespace rubato
