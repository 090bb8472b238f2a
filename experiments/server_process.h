// A rubato_server child process on 127.0.0.1, for the experiments that measure the real binary
// (server_memory's resident size, transport_benchmark's separate-process figures).
#ifndef RUBATO_EXPERIMENTS_SERVER_PROCESS_H_
#define RUBATO_EXPERIMENTS_SERVER_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rubato {

struct ServerProcess {
  pid_t pid = -1;
  std::string address;  // 127.0.0.1:PORT
};

// Starts `binary` with --listen=127.0.0.1:0, a --port_file in a fresh temporary directory, and
// `flags` (its stdout to /dev/null, its stderr this process's), and waits up to `timeout` for the
// port it bound. UNAVAILABLE (the child killed) if it
// did not say in time, naming the binary.
absl::StatusOr<ServerProcess> StartServerProcess(const std::string& binary,
                                                 const std::vector<std::string>& flags,
                                                 absl::Duration timeout = absl::Seconds(10));

// SIGTERM, then SIGKILL if it has not exited after `grace`; reaps it. Its exit status, or -1.
int StopServerProcess(ServerProcess* server, absl::Duration grace = absl::Seconds(10));

// The process's resident set size (VmRSS), or -1.
int64_t ResidentBytes(pid_t pid);

}  // namespace rubato

#endif  // RUBATO_EXPERIMENTS_SERVER_PROCESS_H_
