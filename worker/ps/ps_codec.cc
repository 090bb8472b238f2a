#include "worker/ps/ps_codec.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/grpc_bytes.h"
#include "common/log.h"
#include "common/tensor_wire.h"

namespace rubato {
namespace {

// Lowers *min_version (if given) to `version`, or sets it for the first tensor while *first.
void NoteVersion(int64_t version, int64_t* min_version, bool* first) {
  if (min_version == nullptr) return;
  *min_version = *first ? version : std::min(*min_version, version);
  *first = false;
}

}  // namespace

grpc::Slice BorrowedSlices::Borrow(const void* data, size_t bytes) {
  absl::MutexLock lock(&mu_);
  ++out_;
  return grpc::Slice(const_cast<void*>(data), bytes, &Release, this);
}

void BorrowedSlices::WaitReleased() {
  absl::MutexLock lock(&mu_);
  auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_ == 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&released), absl::Seconds(60))) {
    RUBATO_LOG(ERROR) << "a channel still holds " << out_
                      << " gradient slice(s) 60 s after their calls ended; stopping rather "
                         "than let it read reused memory";
    std::abort();
  }
}

void BorrowedSlices::WhenReleased(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (out_ > 0) {
      when_released_ = std::move(fn);
      return;
    }
  }
  fn();
}

void BorrowedSlices::Release(void* self) {
  auto* b = static_cast<BorrowedSlices*>(self);
  std::function<void()> fn;
  {
    absl::MutexLock lock(&b->mu_);
    if (--b->out_ > 0 || !b->when_released_) return;
    fn = std::move(b->when_released_);
    b->when_released_ = nullptr;
  }
  fn();  // Last: it may destroy *b.
}

absl::Status ParseMessageBytes(const std::string& address, const grpc::ByteBuffer& raw,
                               google::protobuf::MessageLite* message) {
  if (!ParseSerializedMessage(raw, message)) {
    return absl::InternalError(
        absl::StrCat("server ", address, " sent a malformed ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

grpc::ByteBuffer PsCodec::PullRequestFor(int64_t step, const std::vector<int>& tensors) const {
  PullRequest request;
  request.set_worker_id(worker_id_);
  request.set_step(step);
  for (int i : tensors) request.add_names(model_[i].name());
  return SerializedMessage(request);
}

grpc::ByteBuffer PsCodec::PushRequestFor(int64_t step, const std::vector<PushPiece>& pieces,
                                         absl::Span<const std::vector<float>> grads,
                                         int32_t batch_size, const NoiseScaleRelay* relay,
                                         BorrowedSlices* borrowed,
                                         const ConsistencyRelay* consistency) const {
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * pieces.size());
  std::string header;
  EncodePushHeader(worker_id_, step, &header);
  EncodePushExtras(batch_size, relay, &header, consistency);
  for (const PushPiece& piece : pieces) {
    const size_t bytes = static_cast<size_t>(piece.elements) * sizeof(float);
    EncodeTensorHeader(3, model_[piece.tensor].name(), 0, bytes, &header, piece.offset);
    slices.emplace_back(header);
    header.clear();
    slices.push_back(borrowed->Borrow(grads[piece.tensor].data() + piece.offset, bytes));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

PullSink PsCodec::SinkFor(const std::vector<int>& tensors,
                          absl::Span<std::vector<float>> params) const {
  PullSink sink;
  for (int i : tensors) {
    params[i].resize(plan_.elements[i]);
    sink.tensors.push_back({&model_[i].name(), params[i].data(), plan_.elements[i]});
  }
  return sink;
}

absl::Status PsCodec::StorePulled(int shard, const std::string& address,
                                  const std::vector<int>& want, const PullSink& sink,
                                  const grpc::ByteBuffer& raw,
                                  absl::Span<std::vector<float>> params, int64_t* min_version,
                                  bool* first) const {
  if (!sink.stored) return StoreTensors(shard, address, want, raw, params, min_version, first);
  for (const PullSink::Tensor& t : sink.tensors) NoteVersion(t.version, min_version, first);
  return absl::OkStatus();
}

absl::Status PsCodec::StoreTensors(int shard, const std::string& address,
                                   const std::vector<int>& want, const grpc::ByteBuffer& raw,
                                   absl::Span<std::vector<float>> params, int64_t* min_version,
                                   bool* first) const {
  std::vector<grpc::Slice> slices;
  std::vector<WireTensor> tensors;
  ByteChunks message;
  absl::Status parsed = absl::InternalError("unreadable");
  if (raw.Dump(&slices).ok()) {
    for (const grpc::Slice& slice : slices) {
      message.Append(absl::string_view(reinterpret_cast<const char*>(slice.begin()), slice.size()));
    }
    parsed = ParsePullResponse(message, static_cast<int>(want.size()), &tensors);
  }
  if (!parsed.ok()) {
    return absl::InternalError(absl::StrCat("shard ", shard, " at ", address,
                                            " sent a malformed pull answer: ", parsed.message()));
  }
  if (tensors.size() != want.size()) {
    return absl::InternalError(absl::StrCat("shard ", shard, " returned ", tensors.size(),
                                            " tensors for ", want.size(), " requested"));
  }
  for (size_t k = 0; k < want.size(); ++k) {
    const WireTensor& v = tensors[k];
    const int i = want[k];
    if (v.name != model_[i].name() ||
        static_cast<int64_t>(v.data.size()) != 4 * plan_.elements[i]) {
      return absl::InternalError(absl::StrCat("shard ", shard, " returned a malformed value for '",
                                              model_[i].name(), "'"));
    }
    params[i].resize(plan_.elements[i]);
    CopyFloats(v.data, params[i].data());
    NoteVersion(v.version, min_version, first);
  }
  return absl::OkStatus();
}

absl::Status PsCodec::CheckSizes(absl::Span<const std::vector<float>> values,
                                 const char* what) const {
  if (values.size() != model_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(values.size(), " ", what, "s for a model of ", model_.size(), " tensors"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (static_cast<int64_t>(values[i].size()) != plan_.elements[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " of '", model_[i].name(), "' has ",
                                                     values[i].size(), " elements, expected ",
                                                     plan_.elements[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace rubato
