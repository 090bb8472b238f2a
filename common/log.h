// Rubato's one logging facility: timestamped lines on stderr.
//
//   RUBATO_LOG(INFO) << "listening on " << address;
//
// Debian's Abseil (20220623) has no absl/log. Stdout is left to machine-readable output (the
// worker's JSON progress records), so every human-readable line goes to stderr.
#ifndef RUBATO_COMMON_LOG_H_
#define RUBATO_COMMON_LOG_H_

#include <sstream>
#include <string>

namespace rubato {

enum class LogLevel { kInfo, kWarning, kError };

// Collects one line and writes it, with time, level and source location, when destroyed.
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;

  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Sets the tag printed on every line (e.g. "server-0", "worker-1"). Call once from main.
void SetLogTag(const std::string& tag);

// Lines below `level` are not written (a simulator of thousands of workers keeps warnings only).
void SetMinLogLevel(LogLevel level);

}  // namespace rubato

#define RUBATO_LOG_LEVEL_INFO ::rubato::LogLevel::kInfo
#define RUBATO_LOG_LEVEL_WARNING ::rubato::LogLevel::kWarning
#define RUBATO_LOG_LEVEL_ERROR ::rubato::LogLevel::kError
#define RUBATO_LOG(level) \
  ::rubato::LogMessage(RUBATO_LOG_LEVEL_##level, __FILE__, __LINE__).stream()

#endif  // RUBATO_COMMON_LOG_H_
