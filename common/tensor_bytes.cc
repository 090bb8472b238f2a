#include "common/tensor_bytes.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rubato {

#if !defined(ABSL_IS_LITTLE_ENDIAN)
#error "Rubato's wire format is little-endian float32; add byte swapping for this platform."
#endif

int64_t ElementCount(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 1 || n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::Status CheckFloatBytes(absl::string_view what, absl::string_view bytes, int64_t elements) {
  if (static_cast<int64_t>(bytes.size()) != elements * 4) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", bytes.size(), " bytes, expected ",
                                                   elements * 4, " (", elements,
                                                   " float32 values)"));
  }
  const char* p = bytes.data();
  for (int64_t i = 0; i < elements; ++i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a non-finite value (", v, ") at element ", i));
    }
  }
  return absl::OkStatus();
}

void BytesToFloats(absl::string_view bytes, absl::Span<float> out) {
  if (out.empty()) return;  // memcpy from a null pointer is undefined even for 0 bytes.
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
}

void FloatsToBytes(absl::Span<const float> values, std::string* out) {
  // assign() copies once; resize() + memcpy would zero-fill the buffer first.
  out->assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

}  // namespace rubato
