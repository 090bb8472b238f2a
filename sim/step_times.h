// StepTimes: a measured distribution of step times that simulated workers draw their compute
// from, in place of one fixed step time (issue 34's compute model: "or from a measured
// step-time distribution").
//
// The file holds one step time in milliseconds per line (blank lines and lines starting with `#`
// skipped), e.g. the per-step times of a real worker or a profiler's trace of a real model. Worker
// w's step s takes sample (mix(seed, w, s) mod n): independent draws, the same in every run with
// the same seed, whatever the order the simulation asks in. The straggler flags and patterns
// apply on top, to the drawn time, as they apply to a measured compute time in rubato_worker.
#ifndef RUBATO_SIM_STEP_TIMES_H_
#define RUBATO_SIM_STEP_TIMES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rubato {

class StepTimes {
 public:
  // INVALID_ARGUMENT naming `path` and the line for a time that does not parse, is negative or is
  // not finite, and for a file without any; NOT_FOUND for a missing file.
  static absl::StatusOr<StepTimes> FromFile(const std::string& path, uint64_t seed = 1);
  static absl::StatusOr<StepTimes> FromText(absl::string_view text, absl::string_view path,
                                            uint64_t seed = 1);

  absl::Duration At(int worker, int64_t step) const;
  absl::Duration Mean() const;
  size_t size() const { return samples_.size(); }

 private:
  StepTimes(std::vector<absl::Duration> samples, uint64_t seed)
      : samples_(std::move(samples)), seed_(seed) {}

  std::vector<absl::Duration> samples_;
  uint64_t seed_;
};

}  // namespace rubato

#endif  // RUBATO_SIM_STEP_TIMES_H_
