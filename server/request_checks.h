// Checks of the fields of a shard's requests (and checkpoints) that several parts of the shard
// share: steps in range, tensor names of a sane size, names as they may be echoed in an error.
#ifndef RUBATO_SERVER_REQUEST_CHECKS_H_
#define RUBATO_SERVER_REQUEST_CHECKS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/limits.h"

namespace rubato {

// Steps, versions and resume points are in [0, kMaxStep): clock arithmetic on them cannot
// overflow. INVALID_ARGUMENT naming `field` otherwise.
inline absl::Status CheckStep(absl::string_view field, int64_t step) {
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [0, ", kMaxStep, "), got ", step));
  }
  return absl::OkStatus();
}

inline absl::Status CheckTensorName(absl::string_view name) {
  if (name.empty() || name.size() > static_cast<size_t>(kMaxTensorNameBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a tensor name must be 1 to ", kMaxTensorNameBytes, " bytes, got ", name.size()));
  }
  return absl::OkStatus();
}

// A name as it may be echoed in an error: printable ASCII as is, anything else escaped.
inline std::string Printable(absl::string_view name) { return absl::CHexEscape(name); }

}  // namespace rubato

#endif  // RUBATO_SERVER_REQUEST_CHECKS_H_
