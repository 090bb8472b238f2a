// ring_mailbox_fuzzer: a libFuzzer harness over the receiving end of the ring all-reduce's
// transport (worker/ring/ring_peer.h): ParseRingBlock, which reads a RingBlock from the transport's
// buffers without copying them, and RingMailbox::Put / Take, which file blocks by tag and add or
// copy them into the destination while checking that every value is finite.
//
// Each input is a serialized rubato.fuzz.RingFuzzCase (fuzz/fuzz_case.proto); one that does not
// parse is skipped. Its messages are cut into grpc::Slices at fuzz-chosen byte offsets (floats
// then straddle slices, as they do off the wire), and its actions deliver them (ParseRingBlock,
// then Put), take blocks with a deadline of now, and report the stream opened, broken or aborted.
// The harness keeps its own model of the mailbox and checks, with FUZZ_CHECK:
//   - ParseRingBlock accepts only what protobuf itself parses as a RingBlock, with the same
//     from_rank, tag and data, and its payload ends the message;
//   - Put succeeds exactly when the tag is >= 0 and not already waiting, the sender is the
//     mailbox's previous rank and the data is whole floats;
//   - Take of a waiting block succeeds exactly when the sizes agree and every value is finite, and
//     then leaves precisely `out` + data (add) or data (copy), computed here float by float; Take
//     of a missing block fails with the abort's status, UNAVAILABLE after a broken stream, or
//     DEADLINE_EXCEEDED.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "fuzz/fuzz_case.pb.h"
#include "fuzz/fuzz_check.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/ring.pb.h"
#include "worker/ring/ring_peer.h"

namespace rubato {
namespace fuzz {
namespace {

constexpr uint32_t kMaxTakeFloats = 1 << 16;
constexpr size_t kMaxSlices = 64;

std::string MessageBytes(const RingMessage& m, int mailbox_rank) {
  switch (m.content_case()) {
    case RingMessage::kRaw:
      return m.raw();
    case RingMessage::kBlock:
      return m.block().SerializeAsString();
    case RingMessage::kFloats: {
      const FloatBlock& f = m.floats();
      RingBlock block;
      block.set_from_rank(f.use_mailbox_rank() ? mailbox_rank : f.from_rank());
      block.set_tag(f.tag());
      std::string* data = block.mutable_data();
      data->resize(f.values_size() * sizeof(float));
      if (!f.values().empty()) std::memcpy(data->data(), f.values().data(), data->size());
      return block.SerializeAsString();
    }
    case RingMessage::CONTENT_NOT_SET:
      break;
  }
  return std::string();
}

// `bytes` as the transport might hand them over: cut at `cuts` (modulo the length). gRPC merges
// adjacent small (inlined, <= 23 bytes) slices, as its transport's buffers would be; longer pieces
// stay separate slices, so floats straddle slice boundaries.
grpc::ByteBuffer Cut(const std::string& bytes,
                     const google::protobuf::RepeatedField<uint32_t>& cuts) {
  std::vector<size_t> at;
  for (uint32_t c : cuts) {
    if (at.size() + 1 >= kMaxSlices) break;
    at.push_back(bytes.empty() ? 0 : c % bytes.size());
  }
  std::sort(at.begin(), at.end());
  at.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t end : at) {
    slices.emplace_back(bytes.data() + begin, end - begin);
    begin = end;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The payload's bytes, contiguous.
std::string Flatten(const RingPayload& payload) {
  std::string out;
  size_t skip = payload.offset;
  for (const grpc::Slice& slice : payload.slices) {
    const char* p = reinterpret_cast<const char*>(slice.begin());
    size_t len = slice.size();
    const size_t k = std::min(skip, len);
    skip -= k;
    out.append(p + k, len - k);
  }
  FUZZ_CHECK(out.size() >= payload.bytes, absl::StrCat(out.size(), " < ", payload.bytes));
  out.resize(payload.bytes);
  return out;
}

bool SameFloat(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

// The harness's model of the mailbox.
struct Model {
  std::map<int64_t, std::string> waiting;  // Tag -> data of blocks put and not taken.
  std::map<int64_t, size_t> last_size;     // Tag -> floats of the last block delivered under it.
  bool broken = false;
  absl::Status aborted;
};

void Deliver(const std::string& bytes, const grpc::ByteBuffer& message, int mailbox_rank,
             RingMailbox* mailbox, Model* model) {
  int from = -1;
  int64_t tag = -1;
  RingPayload payload;
  const absl::Status parsed = ParseRingBlock(message, &from, &tag, &payload);
  if (Verbose()) {
    std::fprintf(stderr,
                 "ring_mailbox_fuzzer: parse %zu bytes in %zu slices: %s (from %d, tag %ld)\n",
                 bytes.size(), payload.slices.size(), parsed.ToString().c_str(), from,
                 static_cast<long>(tag));
  }
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.code() == absl::StatusCode::kInvalidArgument, parsed.ToString());
    return;
  }
  RingBlock reference;
  FUZZ_CHECK(reference.ParseFromString(bytes),
             absl::StrCat("ParseRingBlock accepted what protobuf does not: ",
                          absl::BytesToHexString(bytes.substr(0, 64))));
  FUZZ_CHECK(from == reference.from_rank(), absl::StrCat(from, " vs ", reference.from_rank()));
  FUZZ_CHECK(tag == reference.tag(), absl::StrCat(tag, " vs ", reference.tag()));
  FUZZ_CHECK(payload.offset + payload.bytes == bytes.size(),
             absl::StrCat(payload.offset, " + ", payload.bytes, " vs ", bytes.size()));
  const std::string data = Flatten(payload);
  FUZZ_CHECK(data == reference.data(), absl::StrCat("data of block ", tag, " differs"));

  const bool expect_ok = tag >= 0 && from == mailbox_rank && payload.bytes % sizeof(float) == 0 &&
                         model->waiting.count(tag) == 0;
  const absl::Status put = mailbox->Put(from, tag, std::move(payload));
  if (Verbose()) std::fprintf(stderr, "ring_mailbox_fuzzer: put: %s\n", put.ToString().c_str());
  FUZZ_CHECK(put.ok() == expect_ok,
             absl::StrCat("Put(", from, ", ", tag, ", ", data.size(), " bytes): ", put.ToString()));
  if (put.ok()) {
    model->last_size[tag] = data.size() / sizeof(float);
    model->waiting.emplace(tag, data);
  } else {
    FUZZ_CHECK(put.code() == absl::StatusCode::kInvalidArgument, put.ToString());
  }
}

void Take(const TakeAction& a, RingMailbox* mailbox, Model* model) {
  size_t n = a.floats();
  if (a.use_block_size()) {
    auto it = model->last_size.find(a.tag());
    if (it != model->last_size.end()) n = it->second;
  }
  n = std::min<size_t>(n, kMaxTakeFloats);
  std::vector<float> out(n, 0.0f);
  for (size_t i = 0; i < n && !a.initial().empty(); ++i) {
    out[i] = a.initial(static_cast<int>(i % a.initial_size()));
  }
  const std::vector<float> before = out;
  const RingLink::Combine combine = a.add() ? RingLink::Combine::kAdd : RingLink::Combine::kCopy;
  const absl::Status taken = mailbox->Take(a.tag(), absl::MakeSpan(out), combine, absl::Now());
  if (Verbose()) {
    std::fprintf(stderr, "ring_mailbox_fuzzer: take %ld into %zu floats: %s\n",
                 static_cast<long>(a.tag()), n, taken.ToString().c_str());
  }

  auto it = model->waiting.find(a.tag());
  if (it == model->waiting.end()) {
    FUZZ_CHECK(!taken.ok(), absl::StrCat("took block ", a.tag(), ", which was never put"));
    if (!model->aborted.ok() && !model->broken) {
      FUZZ_CHECK(taken == model->aborted, taken.ToString());
    } else if (!model->aborted.ok()) {
      // Both: the abort (the next rank's failure) first, then the broken stream.
      FUZZ_CHECK(taken.code() == model->aborted.code() &&
                     absl::StartsWith(taken.message(), model->aborted.message()) &&
                     absl::StrContains(taken.message(), "then the stream from rank"),
                 taken.ToString());
    } else if (model->broken) {
      FUZZ_CHECK(taken.code() == absl::StatusCode::kUnavailable, taken.ToString());
    } else {
      FUZZ_CHECK(taken.code() == absl::StatusCode::kDeadlineExceeded, taken.ToString());
    }
    return;
  }
  const std::string data = std::move(it->second);
  model->waiting.erase(it);
  if (data.size() != n * sizeof(float)) {
    FUZZ_CHECK(taken.code() == absl::StatusCode::kInvalidArgument,
               absl::StrCat(data.size(), " bytes into ", n, " floats: ", taken.ToString()));
    return;
  }
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, data.data() + 4 * i, 4);
    finite &= std::isfinite(v);
  }
  if (!finite) {
    FUZZ_CHECK(taken.code() == absl::StatusCode::kInvalidArgument, taken.ToString());
    return;
  }
  FUZZ_CHECK(taken.ok(), taken.ToString());
  for (size_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, data.data() + 4 * i, 4);
    const float expected = a.add() ? before[i] + v : v;
    FUZZ_CHECK(SameFloat(out[i], expected),
               absl::StrCat("block ", a.tag(), " element ", i, ": ", out[i], " vs ", expected));
  }
}

void RunCase(const RingFuzzCase& c) {
  RingMailbox mailbox(c.from_rank());
  Model model;
  std::vector<std::string> messages;
  for (const RingMessage& m : c.messages()) messages.push_back(MessageBytes(m, c.from_rank()));

  for (const RingAction& action : c.actions()) {
    switch (action.action_case()) {
      case RingAction::kDeliver: {
        if (messages.empty()) break;
        const size_t i = action.deliver() % messages.size();
        Deliver(messages[i], Cut(messages[i], c.messages(static_cast<int>(i)).cuts()),
                c.from_rank(), &mailbox, &model);
        break;
      }
      case RingAction::kTake:
        Take(action.take(), &mailbox, &model);
        break;
      case RingAction::kStreamOpened:
        mailbox.StreamOpened();
        model.broken = false;
        break;
      case RingAction::kStreamBroke:
        mailbox.StreamBroke(action.stream_broke());
        model.broken = model.broken || !action.stream_broke().empty();
        break;
      case RingAction::kAbort: {
        absl::Status error = absl::UnavailableError(action.abort());
        if (model.aborted.ok()) model.aborted = error;
        mailbox.Abort(std::move(error));
        break;
      }
      case RingAction::ACTION_NOT_SET:
        break;
    }
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace rubato

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rubato::fuzz::RingFuzzCase c;
  if (size > static_cast<size_t>(INT32_MAX) || !c.ParseFromArray(data, static_cast<int>(size))) {
    return 0;
  }
  rubato::fuzz::RunCase(c);
  return 0;
}
