#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <cstring>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rubato {
namespace {

absl::Mutex tag_mu;
std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
std::string& Tag() {
  static std::string* tag = new std::string("rubato");
  return *tag;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}

}  // namespace

void SetLogTag(const std::string& tag) {
  absl::MutexLock lock(&tag_mu);
  Tag() = tag;
}

void SetMinLogLevel(LogLevel level) { min_level.store(static_cast<int>(level)); }

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line) {}

LogMessage::~LogMessage() {
  if (static_cast<int>(level_) < min_level.load(std::memory_order_relaxed)) return;
  const char* base = std::strrchr(file_, '/');
  std::string tag;
  {
    absl::MutexLock lock(&tag_mu);
    tag = Tag();
  }
  std::string line = absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::LocalTimeZone());
  line += " ";
  line += LevelName(level_);
  line += " [" + tag + "] " + (base ? base + 1 : file_) + ":" + std::to_string(line_) + "] ";
  line += stream_.str();
  line += "\n";
  // One fwrite per line keeps concurrent lines whole.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace rubato
