// The binaries' command line: absl::ParseCommandLine, except for the exit status of a command
// line that Abseil refuses (an unknown flag, a value that does not parse): Abseil exits 1, which
// a supervisor cannot tell from a runtime failure; ParseFlagsOrExit exits `usage_status` (2, as
// every other usage error of rubato_server and rubato_worker does), so that a Kubernetes pod
// failure policy fails the job at once instead of restarting a pod that cannot start
// (deploy/k8s/README.md). --help, --helpfull, --version and the like keep Abseil's status.
//
//   std::vector<char*> rest = rubato::ParseFlagsOrExit(argc, argv);
#ifndef RUBATO_COMMON_PARSE_FLAGS_H_
#define RUBATO_COMMON_PARSE_FLAGS_H_

#include <vector>

namespace rubato {

inline constexpr int kExitUsageStatus = 2;

std::vector<char*> ParseFlagsOrExit(int argc, char** argv, int usage_status = kExitUsageStatus);

}  // namespace rubato

#endif  // RUBATO_COMMON_PARSE_FLAGS_H_
