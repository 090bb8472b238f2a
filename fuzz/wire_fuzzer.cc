// wire_fuzzer: a libFuzzer harness that checks common/tensor_wire.h's parsers against protobuf's
// own, on arbitrary bytes cut into pieces at arbitrary places (as gRPC slices cut a message).
//
// Input: byte 0 picks the message (even: PushRequest, odd: PullResponse); byte 1 the number of
// cuts (0..7); the next bytes the cut positions; the rest is the message. Checked:
//   - ours accepts exactly when protobuf accepts, and then with the same worker_id, step and, per
//     tensor, the same name, data, version and offset;
//   - the float helpers agree with a plain copy of the flattened bytes.
// A broken invariant aborts (a crash for libFuzzer).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/tensor_wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/parameter_server.pb.h"

namespace rubato {
namespace fuzz {
namespace {

constexpr int kMaxTensors = 1024;

void CheckTensor(const TensorValue& theirs, const WireTensor& ours) {
  FUZZ_CHECK(theirs.name() == ours.name, "name differs");
  FUZZ_CHECK(theirs.data() == ours.data.Flatten(),
             absl::StrCat("data of '", ours.name, "' differs"));
  FUZZ_CHECK(theirs.version() == ours.version, "version differs");
  FUZZ_CHECK(theirs.offset() == ours.offset, "offset differs");
  // Sub-ranges of the pieces hold the same bytes as the flattened data's.
  const std::string whole = ours.data.Flatten();
  for (size_t from : {size_t{0}, whole.size() / 3, whole.size() / 2}) {
    const size_t length = (whole.size() - from) / 2 + 1;
    FUZZ_CHECK(ours.data.Sub(from, length).Flatten() == whole.substr(from, length),
               "a sub-range's bytes differ");
  }
  // The float helpers over the pieces agree with the flattened bytes.
  if (!ours.data.empty() && ours.data.size() % 4 == 0) {
    const std::string flat = ours.data.Flatten();
    const size_t n = flat.size() / 4;
    std::vector<float> copied(n, 0.0f);
    CopyFloats(ours.data, copied.data());
    FUZZ_CHECK(std::memcmp(copied.data(), flat.data(), flat.size()) == 0, "CopyFloats differs");
    int64_t first_bad = -1;
    for (size_t i = 0; i < n && first_bad < 0; ++i) {
      if (!std::isfinite(copied[i])) first_bad = static_cast<int64_t>(i);
    }
    FUZZ_CHECK(FirstNonFinite(ours.data) == first_bad, "FirstNonFinite differs");
  }
}

void Run(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const bool push = (data[0] & 1) == 0;
  const int cuts = data[1] % 8;
  if (size < 2 + static_cast<size_t>(cuts)) return;
  const std::string message(reinterpret_cast<const char*>(data) + 2 + cuts, size - 2 - cuts);
  std::vector<size_t> at;
  for (int k = 0; k < cuts; ++k)
    at.push_back(message.empty() ? 0 : data[2 + k] % (message.size() + 1));
  std::sort(at.begin(), at.end());
  ByteChunks chunks;
  size_t from = 0;
  for (size_t c : at) {
    chunks.Append(absl::string_view(message).substr(from, c - from));
    from = c;
  }
  chunks.Append(absl::string_view(message).substr(from));
  FUZZ_CHECK(chunks.size() == message.size(), "pieces lost bytes");

  if (push) {
    PushRequest theirs;
    const bool they_accept =
        theirs.ParseFromString(message) && theirs.gradients_size() <= kMaxTensors;
    WirePush ours;
    const bool we_accept = ParsePushRequest(chunks, kMaxTensors, &ours).ok();
    if (they_accept) {
      FUZZ_CHECK(we_accept, "protobuf accepts a PushRequest that ours refuses");
      FUZZ_CHECK(theirs.worker_id() == ours.worker_id, "worker_id differs");
      FUZZ_CHECK(theirs.step() == ours.step, "step differs");
      FUZZ_CHECK(theirs.batch_size() == ours.batch_size, "batch_size differs");
      FUZZ_CHECK(theirs.has_noise_relay() == ours.noise_relay.has_value(),
                 "noise_relay's presence differs");
      FUZZ_CHECK(!ours.noise_relay.has_value() || ours.noise_relay->SerializeAsString() ==
                                                      theirs.noise_relay().SerializeAsString(),
                 "noise_relay differs");
      FUZZ_CHECK(theirs.gradients_size() == static_cast<int>(ours.gradients.size()),
                 "gradient count differs");
      for (int i = 0; i < theirs.gradients_size(); ++i)
        CheckTensor(theirs.gradients(i), ours.gradients[i]);
    } else {
      FUZZ_CHECK(!we_accept, "ours accepts a PushRequest that protobuf refuses");
    }
  } else {
    PullResponse theirs;
    const bool they_accept =
        theirs.ParseFromString(message) && theirs.tensors_size() <= kMaxTensors;
    std::vector<WireTensor> ours;
    const bool we_accept = ParsePullResponse(chunks, kMaxTensors, &ours).ok();
    if (they_accept) {
      FUZZ_CHECK(we_accept, "protobuf accepts a PullResponse that ours refuses");
      FUZZ_CHECK(theirs.tensors_size() == static_cast<int>(ours.size()), "tensor count differs");
      for (int i = 0; i < theirs.tensors_size(); ++i) CheckTensor(theirs.tensors(i), ours[i]);
    } else {
      FUZZ_CHECK(!we_accept, "ours accepts a PullResponse that protobuf refuses");
    }
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace rubato

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rubato::fuzz::Run(data, size);
  return 0;
}
