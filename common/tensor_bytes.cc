#include "common/tensor_bytes.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"
#include "common/tensor_wire.h"

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

absl::StatusOr<int64_t> CheckedElementCount(absl::Span<const int64_t> shape) {
  if (shape.size() > static_cast<size_t>(kMaxTensorRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape of rank ", shape.size(), " (at most ", kMaxTensorRank, ")"));
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    // n <= kMaxTensorElements and d <= kMaxTensorElements: the product fits in int64.
    if (d < 1 || d > kMaxTensorElements || (n *= d) > kMaxTensorElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeString(shape), " is not a product of dimensions >= 1 of at most ",
          kMaxTensorElements, " elements"));
    }
  }
  return n;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::Status CheckFloatBytes(absl::string_view what, absl::string_view bytes, int64_t elements) {
  return CheckFloatChunks(what, ByteChunks(bytes), elements);
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
