// Subprocess: one child process for multi-process tests, its stdout and stderr in files.
//
// The child is started with fork + exec and asks the kernel (PR_SET_PDEATHSIG) for SIGKILL when
// the thread that started it ends, so that a crashed or killed test leaves nothing running. The
// destructor kills and reaps a child that is still running.
#ifndef RUBATO_TESTS_SUBPROCESS_H_
#define RUBATO_TESTS_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rubato {

class Subprocess {
 public:
  // Starts argv[0] (a path: there is no PATH search) with `argv`, stdin from /dev/null, and stdout
  // and stderr truncated into the given files. `name` ("worker-1") labels errors. Returns
  // InvalidArgument for an empty argv, and the errno's status (NotFound for a missing binary,
  // PermissionDenied, ...) naming the process if a file cannot be opened or exec fails.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(std::string name,
                                                           std::vector<std::string> argv,
                                                           std::string stdout_path,
                                                           std::string stderr_path);

  // Kills (SIGKILL) and reaps the child if it is still running.
  ~Subprocess();

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Waits up to `timeout` for the child to exit and returns its exit status: the exit code, or
  // 128 + N for death by signal N (as a shell reports it). DeadlineExceeded naming the process if
  // it is still running at the deadline; the child is left running. Once the child has been
  // reaped, every later call returns the same status at once.
  absl::StatusOr<int> Wait(absl::Duration timeout);

  // Sends `sig`. FailedPrecondition if the child has already been reaped.
  absl::Status Signal(int sig);

  // Sends SIGKILL if the child has not been reaped yet; it does not wait.
  void Kill();

  // The files' contents so far ("" if unreadable).
  std::string ReadStdout() const;
  std::string ReadStderr() const;

  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }

 private:
  Subprocess(std::string name, pid_t pid, std::string stdout_path, std::string stderr_path);

  // Constant after construction.
  const std::string name_;
  const pid_t pid_;
  const std::string stdout_path_;
  const std::string stderr_path_;

  // Set once the child has been reaped.
  std::optional<int> exit_status_;
};

// The contents of the file at `path`, or "" if it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

}  // namespace rubato

#endif  // RUBATO_TESTS_SUBPROCESS_H_
