// The wire form of a tensor's values: raw little-endian float32, row-major (proto
// TensorValue.data).
#ifndef RUBATO_COMMON_TENSOR_BYTES_H_
#define RUBATO_COMMON_TENSOR_BYTES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rubato {

// Product of the dimensions (1 for a scalar); -1 if a dimension is < 1 or the product overflows.
int64_t ElementCount(absl::Span<const int64_t> shape);

// The element count of a shape that arrived over the network: InvalidArgument unless every
// dimension is >= 1, the rank is at most kMaxTensorRank and the product at most kMaxTensorElements
// (common/limits.h).
absl::StatusOr<int64_t> CheckedElementCount(absl::Span<const int64_t> shape);

// "[784,256]".
std::string ShapeString(absl::Span<const int64_t> shape);

// OK if `bytes` holds exactly `elements` finite floats. Otherwise InvalidArgument naming `what`
// (e.g. "gradient 'fc0.weight'") and the byte count or the first non-finite element.
absl::Status CheckFloatBytes(absl::string_view what, absl::string_view bytes, int64_t elements);

// Copies `bytes` (already checked) into `out`, which must have bytes.size() / 4 elements.
void BytesToFloats(absl::string_view bytes, absl::Span<float> out);

// Replaces *out with the bytes of `values`.
void FloatsToBytes(absl::Span<const float> values, std::string* out);

}  // namespace rubato

#endif  // RUBATO_COMMON_TENSOR_BYTES_H_
