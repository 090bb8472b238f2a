// wire_fuzzer: a libFuzzer harness that checks common/tensor_wire.h's parsers against protobuf's
// own, on arbitrary bytes cut into pieces at arbitrary places (as gRPC slices cut a message).
//
// Input: byte 0 picks the message (even: PushRequest, odd: PullResponse); byte 1 the number of
// cuts (0..7); the next bytes the cut positions; the rest is the message. Checked:
//   - protobuf accepts  =>  ours accepts, with the same worker_id, step and, per tensor, the same
//     name, data and version;
//   - ours accepts and protobuf refuses  =>  some tensor name is not valid UTF-8 (the one thing
//     protobuf checks and ours does not, see tensor_wire.h);
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

// Well-formed UTF-8 (no overlong forms, no surrogates, at most U+10FFFF), as protobuf requires of
// proto3 strings.
bool ValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t more = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      more = 1;
      cp = c & 0x1f;
    } else if ((c >> 4) == 0xe) {
      more = 2;
      cp = c & 0x0f;
    } else if ((c >> 3) == 0x1e) {
      more = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + more >= s.size()) return false;
    for (size_t k = 1; k <= more; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    if ((more == 1 && cp < 0x80) || (more == 2 && cp < 0x800) || (more == 3 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += more + 1;
  }
  return true;
}

void CheckTensor(const TensorValue& theirs, const WireTensor& ours) {
  FUZZ_CHECK(theirs.name() == ours.name, "name differs");
  FUZZ_CHECK(theirs.data() == ours.data.Flatten(), "data of '", ours.name, "' differs");
  FUZZ_CHECK(theirs.version() == ours.version, "version differs");
  // The float helpers over the pieces agree with the flattened bytes.
  if (ours.data.size() % 4 == 0) {
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
      FUZZ_CHECK(theirs.gradients_size() == static_cast<int>(ours.gradients.size()),
                 "gradient count differs");
      for (int i = 0; i < theirs.gradients_size(); ++i)
        CheckTensor(theirs.gradients(i), ours.gradients[i]);
    } else if (we_accept) {
      bool bad_name = false;
      for (const WireTensor& t : ours.gradients) bad_name = bad_name || !ValidUtf8(t.name);
      FUZZ_CHECK(bad_name || static_cast<int>(ours.gradients.size()) > kMaxTensors,
                 "ours accepts a PushRequest that protobuf refuses, with valid UTF-8 names");
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
    } else if (we_accept) {
      bool bad_name = false;
      for (const WireTensor& t : ours) bad_name = bad_name || !ValidUtf8(t.name);
      FUZZ_CHECK(bad_name,
                 "ours accepts a PullResponse that protobuf refuses, with valid UTF-8 names");
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
