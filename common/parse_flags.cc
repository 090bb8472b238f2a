#include "common/parse_flags.h"

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "absl/flags/parse.h"

namespace rubato {
namespace {

// Set while Abseil parses: its exit(1) on a refused command line runs the atexit handlers, and
// this one ends the process with the usage status instead.
std::atomic<int> g_exit_instead{0};

void ExitWithUsageStatus() {
  if (const int status = g_exit_instead.load(); status != 0) std::_Exit(status);
}

// --help and its kin print and exit by Abseil's rules; they are not errors.
bool AsksForUsage(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (arg == "--") break;
    while (!arg.empty() && arg.front() == '-') arg.remove_prefix(1);
    if (arg.substr(0, 4) == "help" || arg.substr(0, 7) == "version" ||
        arg.substr(0, 15) == "only_check_args") {
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<char*> ParseFlagsOrExit(int argc, char** argv, int usage_status) {
  if (AsksForUsage(argc, argv)) return absl::ParseCommandLine(argc, argv);
  static const bool registered = std::atexit(ExitWithUsageStatus) == 0;
  if (registered) g_exit_instead.store(usage_status);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  g_exit_instead.store(0);
  return rest;
}

}  // namespace rubato
