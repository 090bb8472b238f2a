#include "worker/ring_peer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "grpcpp/create_channel.h"

namespace rubato {

absl::Status RingMailbox::Put(int64_t tag, const std::string& bytes) {
  if (bytes.size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring block ", tag, " has ", bytes.size(), " bytes, not whole floats"));
  }
  RETURN_IF_ERROR(CheckFloatBytes(absl::StrCat("ring block ", tag), bytes,
                                  static_cast<int64_t>(bytes.size() / sizeof(float))));
  absl::MutexLock lock(&mu_);
  if (!blocks_.emplace(tag, bytes).second) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " delivered twice"));
  }
  return absl::OkStatus();
}

absl::Status RingMailbox::Take(int64_t tag, absl::Span<float> out, absl::Time deadline, int from) {
  absl::MutexLock lock(&mu_);
  auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return blocks_.count(tag) > 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&has), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("all-reduce timed out waiting for block ", tag, " from rank ", from));
  }
  auto it = blocks_.find(tag);
  if (it->second.size() != out.size() * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " from rank ", from, " has ",
                                                   it->second.size() / sizeof(float),
                                                   " floats, expected ", out.size()));
  }
  BytesToFloats(it->second, out);
  blocks_.erase(it);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* RingPeerService::Deliver(grpc::CallbackServerContext* context,
                                                   const RingBlock* block, RingAck* /*ack*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(mailbox_->Put(block->tag(), block->data())));
  return reactor;
}

GrpcRingLink::GrpcRingLink(int rank, int size, const std::string& next_address,
                           RingMailbox* mailbox, absl::Duration send_timeout)
    : rank_(rank),
      size_(size),
      next_address_(next_address),
      mailbox_(mailbox),
      send_timeout_(send_timeout),
      stub_(RingPeer::NewStub(grpc::CreateCustomChannel(
          next_address, grpc::InsecureChannelCredentials(), RubatoChannelArguments()))) {}

absl::Status GrpcRingLink::Send(int64_t tag, absl::Span<const float> data) {
  RingBlock block;
  block.set_from_rank(rank_);
  block.set_tag(tag);
  FloatsToBytes(data, block.mutable_data());
  RingAck ack;
  grpc::ClientContext context;
  context.set_wait_for_ready(true);  // The next rank may still be starting.
  context.set_deadline(absl::ToChronoTime(absl::Now() + send_timeout_));
  const grpc::Status status = stub_->Deliver(&context, block, &ack);
  if (!status.ok()) {
    const absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(), absl::StrCat("all-reduce send to rank ", (rank_ + 1) % size_,
                                               " at ", next_address_, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status GrpcRingLink::Receive(int64_t tag, absl::Span<float> out, absl::Time deadline) {
  return mailbox_->Take(tag, out, deadline, (rank_ + size_ - 1) % size_);
}

}  // namespace rubato
