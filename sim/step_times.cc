#include "sim/step_times.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rubato {
namespace {

// SplitMix64's finaliser: a well-mixed 64-bit value from any input.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<StepTimes> StepTimes::FromText(absl::string_view text, absl::string_view path,
                                              uint64_t seed) {
  std::vector<absl::Duration> samples;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    double ms = 0;
    if (!absl::SimpleAtod(line, &ms) || !std::isfinite(ms) || ms < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": '", line, "' is not a step time in ms (>= 0)"));
    }
    samples.push_back(absl::Microseconds(ms * 1e3));
  }
  if (samples.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no step times"));
  }
  return StepTimes(std::move(samples), seed);
}

absl::StatusOr<StepTimes> StepTimes::FromFile(const std::string& path, uint64_t seed) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read step times from ", path));
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path, seed);
}

absl::Duration StepTimes::At(int worker, int64_t step) const {
  const uint64_t h =
      Mix(Mix(Mix(seed_) ^ static_cast<uint64_t>(worker)) ^ static_cast<uint64_t>(step));
  return samples_[h % samples_.size()];
}

absl::Duration StepTimes::Mean() const {
  absl::Duration sum;
  for (absl::Duration d : samples_) sum += d;
  return sum / static_cast<int64_t>(samples_.size());
}

}  // namespace rubato
