// FUZZ_CHECK: how the fuzz harnesses report a broken invariant. The message goes to the
// sanitizers' report stream, which survives libFuzzer's -close_fd_mask=2 (used to silence the
// shard's log lines), or to stderr without a sanitizer; then abort(), which libFuzzer reports as a
// crash and saves the input. Also Verbose().
#ifndef RUBATO_FUZZ_FUZZ_CHECK_H_
#define RUBATO_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

// Defined by every sanitizer runtime (sanitizer_common); absent in a plain build.
extern "C" void __sanitizer_report_error_summary(const char* summary) __attribute__((weak));

namespace rubato {
namespace fuzz {

[[noreturn]] inline void Fail(const std::string& message) {
  if (&__sanitizer_report_error_summary != nullptr) {
    __sanitizer_report_error_summary(message.c_str());
  } else {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
  std::abort();
}

// Whether RUBATO_FUZZ_VERBOSE is set: the harnesses then print each action and its outcome to
// stderr, to see what an input does (replay it: `<fuzzer> FILE`).
inline bool Verbose() {
  static const bool verbose = std::getenv("RUBATO_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

}  // namespace fuzz
}  // namespace rubato

// Aborts with "fuzz invariant broken: <condition>: <message>" when `condition` is false; `message`
// is anything absl::StrCat takes.
#define FUZZ_CHECK(condition, message)                                                          \
  do {                                                                                          \
    if (!(condition)) {                                                                         \
      ::rubato::fuzz::Fail(absl::StrCat("fuzz invariant broken: ", #condition, ": ", message)); \
    }                                                                                           \
  } while (0)

#endif  // RUBATO_FUZZ_FUZZ_CHECK_H_
