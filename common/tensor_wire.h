// The tensor-carrying messages of proto/parameter_server.proto (PushRequest, PullResponse), read
// and written without copying their tensor bytes.
//
// A received message is a list of byte pieces (gRPC slices). ParsePushRequest and
// ParsePullResponse walk the protobuf wire format over those pieces and return each tensor's data
// as views into them, so that a shard can add a gradient into its accumulator straight from the
// receive buffers and a worker can copy pulled weights straight into its parameters. Encode*
// writes only the small framing (tags, lengths, names); the tensor bytes are sent from the caller's
// own memory as further pieces, the way the ring (worker/ring/ring_codec.h) already sends blocks.
//
// The parsers accept exactly what protobuf's own parser accepts for these messages (fields in any
// order, repeated scalars where the last wins, unknown fields and groups skipped, a known field
// with the wrong wire type treated as unknown) and reject what it rejects (truncation, an overlong
// varint, tag or length, a stray end-group tag, a length past the end, a name that is not UTF-8),
// with an InvalidArgument that says where. fuzz/wire_fuzzer.cc checks the two parsers against
// each other on arbitrary input cut at arbitrary places.
#ifndef RUBATO_COMMON_TENSOR_WIRE_H_
#define RUBATO_COMMON_TENSOR_WIRE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// A byte string held as pieces that someone else owns (gRPC slices, or parts of a std::string).
class ByteChunks {
 public:
  ByteChunks() = default;
  explicit ByteChunks(absl::string_view whole) { Append(whole); }

  void Append(absl::string_view piece) {
    if (piece.empty()) return;
    pieces_.push_back(piece);
    size_ += piece.size();
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::vector<absl::string_view>& pieces() const { return pieces_; }
  // The bytes [offset, offset + length), as views of the same pieces (clipped to size()).
  ByteChunks Sub(size_t offset, size_t length) const;
  // The bytes in one string (a copy: for small fields and tests).
  std::string Flatten() const;

 private:
  std::vector<absl::string_view> pieces_;
  size_t size_ = 0;
};

// Well-formed UTF-8 (no overlong forms, no surrogates, at most U+10FFFF), as protobuf requires of
// proto3 strings.
bool IsValidUtf8(absl::string_view s);

// Float32 values held in ByteChunks (little-endian; size() must be a multiple of 4). A float may
// straddle two pieces.

// One read of every value: the index of the first NaN or Inf (-1 if every value is finite) and,
// when all are finite, the largest magnitude (what common/update_guard.h bounds an update with).
struct FloatScan {
  int64_t first_non_finite = -1;
  double max_abs_bound = 0;
};
FloatScan ScanFloats(const ByteChunks& bytes);
int64_t FirstNonFinite(const ByteChunks& bytes);
// OK if `bytes` holds exactly `elements` finite floats, with *max_abs_bound (if not null) set as
// ScanFloats' max_abs_bound. Otherwise InvalidArgument naming `what` (e.g. "gradient
// 'fc0.weight'") and the byte count or the first non-finite element.
// CheckFloatBytes (common/tensor_bytes.h) is this for one contiguous string.
absl::Status CheckFloatChunks(absl::string_view what, const ByteChunks& bytes, int64_t elements,
                              double* max_abs_bound = nullptr);
// out[i] = value i, for size() / 4 values.
void CopyFloats(const ByteChunks& bytes, float* out);
// acc[i] += value i.
void AddFloats(const ByteChunks& bytes, float* acc);
// As CopyFloats and AddFloats, in the same pass adding the values' squares to *squares (summed in
// float lanes over blocks of kSquaresBlock values, each block's sum added in double: the precision
// of a double sum to within a few float roundings per block, at the speed of a float one).
void CopyFloats(const ByteChunks& bytes, float* out, double* squares);
void AddFloats(const ByteChunks& bytes, float* acc, double* squares);
inline constexpr int64_t kSquaresBlock = 1024;

// One TensorValue as it arrived.
struct WireTensor {
  std::string name;
  ByteChunks data;
  int64_t version = 0;
  int64_t offset = 0;  // TensorValue.offset: a push of part of a tensor, from this element
};

struct WirePush {
  int32_t worker_id = 0;
  int64_t step = 0;
  std::vector<WireTensor> gradients;
  int32_t batch_size = 0;                             // PushRequest.batch_size
  std::optional<NoiseScaleRelay> noise_relay;         // PushRequest.noise_relay, when present
  std::optional<ConsistencyRelay> consistency_relay;  // PushRequest.consistency_relay, likewise
};

// The same push from a parsed PushRequest: the gradients are views of `request`'s bytes, which
// must outlive the WirePush.
WirePush WirePushOf(const PushRequest& request);

// At most `max_tensors` tensors are read; one more is an InvalidArgument (a hostile message of
// millions of empty entries must not cost millions of parsed entries).
absl::Status ParsePushRequest(const ByteChunks& message, int max_tensors, WirePush* out);
absl::Status ParsePullResponse(const ByteChunks& message, int max_tensors,
                               std::vector<WireTensor>* out);

// Framing. A PushRequest is EncodePushHeader, then for each gradient EncodeTensorHeader(3, ...)
// followed by its data bytes. A PullResponse is, for each tensor, EncodeTensorHeader(1, ...)
// followed by its data bytes. Each appends to *out.
void EncodePushHeader(int32_t worker_id, int64_t step, std::string* out);
// PushRequest's batch_size (when non-zero), noise_relay and consistency_relay (when given), after
// the header.
void EncodePushExtras(int32_t batch_size, const NoiseScaleRelay* relay, std::string* out,
                      const ConsistencyRelay* consistency = nullptr);
// The header of field `field` (a TensorValue) whose data of `data_bytes` bytes follows it
// immediately; version and offset are written when non-zero (proto3 omits zero).
void EncodeTensorHeader(int field, absl::string_view name, int64_t version, size_t data_bytes,
                        std::string* out, int64_t offset = 0);

}  // namespace rubato

#endif  // RUBATO_COMMON_TENSOR_WIRE_H_
