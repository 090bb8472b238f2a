// How a PsClient's calls are written and their answers read: PushRequests whose gradients are
// slices of the caller's memory (no copy), PullRequests, and pull answers stored into the model
// (straight from the received slices, or already in place where the channel used a PullSink).
// Errors name the shard by its address.
#ifndef RUBATO_WORKER_PS_PS_CODEC_H_
#define RUBATO_WORKER_PS_PS_CODEC_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/parameter_server.pb.h"
#include "worker/ps/call_plan.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

// Slices that alias the caller's memory (gradients sent in place). A channel lets go of a call's
// slices when the call is over; the caller's memory may change only after WaitReleased.
class BorrowedSlices {
 public:
  BorrowedSlices() = default;
  BorrowedSlices(const BorrowedSlices&) = delete;
  BorrowedSlices& operator=(const BorrowedSlices&) = delete;
  ~BorrowedSlices() { WaitReleased(); }

  grpc::Slice Borrow(const void* data, size_t bytes);

  // Returns at once after the calls, which release their slices as they end; the deadline (60 s)
  // is a guard against a bug, which would otherwise let a channel read memory that the caller
  // reuses: it ends the process, naming the cause.
  void WaitReleased();
  // Runs `fn` once every slice is released: at once if none is out, else on the thread that
  // releases the last (at most one such `fn` at a time). For callers that must not block.
  void WhenReleased(std::function<void()> fn);

 private:
  static void Release(void* self);

  absl::Mutex mu_;
  int out_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> when_released_ ABSL_GUARDED_BY(mu_);
};

// A small answer (a PushResponse) from its bytes; INTERNAL naming the server if malformed.
absl::Status ParseMessageBytes(const std::string& address, const grpc::ByteBuffer& raw,
                               google::protobuf::MessageLite* message);

class PsCodec {
 public:
  // `model` and `plan` must outlive the codec.
  PsCodec(int worker_id, const std::vector<TensorSpec>* model, const CallPlan* plan)
      : worker_id_(worker_id), model_(*model), plan_(*plan) {}

  // A PullRequest for `tensors` (model indices) at `step`.
  grpc::ByteBuffer PullRequestFor(int64_t step, const std::vector<int>& tensors) const;

  // A PushRequest of `pieces` (whole gradients, or parts at their offsets), declaring `batch_size`
  // (0: the registered one) and the job's noise scale `relay` (none if null): the framing in small
  // slices, each gradient's bytes as a slice of `grads` itself, borrowed from `borrowed`.
  grpc::ByteBuffer PushRequestFor(int64_t step, const std::vector<PushPiece>& pieces,
                                  absl::Span<const std::vector<float>> grads, int32_t batch_size,
                                  const NoiseScaleRelay* relay, BorrowedSlices* borrowed,
                                  const ConsistencyRelay* consistency = nullptr) const;

  // Where a pull of `tensors` may be read into `params` in place (each resized to its size first).
  PullSink SinkFor(const std::vector<int>& tensors, absl::Span<std::vector<float>> params) const;

  // A pull's answer from shard `shard` at `address`: already in `params` if the channel stored it
  // through `sink` (its versions there), else parsed from `raw` and copied into params. Lowers
  // *min_version (if given) to each tensor's version, or sets it for the first while *first.
  // INTERNAL for a malformed answer.
  absl::Status StorePulled(int shard, const std::string& address, const std::vector<int>& want,
                           const PullSink& sink, const grpc::ByteBuffer& raw,
                           absl::Span<std::vector<float>> params, int64_t* min_version,
                           bool* first) const;

  // InvalidArgument unless `values` holds one vector per tensor of the model, each of its size;
  // `what` names them ("gradient").
  absl::Status CheckSizes(absl::Span<const std::vector<float>> values, const char* what) const;

 private:
  absl::Status StoreTensors(int shard, const std::string& address, const std::vector<int>& want,
                            const grpc::ByteBuffer& raw, absl::Span<std::vector<float>> params,
                            int64_t* min_version, bool* first) const;

  const int worker_id_;
  const std::vector<TensorSpec>& model_;
  const CallPlan& plan_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_PS_CODEC_H_
