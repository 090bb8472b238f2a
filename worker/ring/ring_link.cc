#include "worker/ring/ring_link.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/net_diagnose.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "worker/ring/ring_codec.h"

namespace rubato {
namespace {

constexpr char kStreamMethod[] = "/rubato.RingPeer/Stream";
// How often a wait for the next rank's acknowledgements says that it goes on (as a receive's does,
// worker/ring/ring_mailbox.cc).
constexpr absl::Duration kStallReport = absl::Seconds(5);

}  // namespace

// The client end of the stream to the next rank. Blocks queue here and are written one at a time
// (the callback API allows one outstanding write), each as soon as the previous one is handed to
// the transport; HTTP/2 flow control paces them. Acknowledgements come back on the same stream. A
// hold keeps the call alive while the link may still write, so a write never races the call's
// end.
//
// Owned by the link alone, which destroys it only once OnDone has run (Close), so the reactor, its
// context and the buffers being written outlive the call. OnDone is the last callback gRPC makes,
// and touches nothing of this object after it releases mu_.
class GrpcRingLink::Stream final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `on_failure` runs (under the stream's lock) when the stream fails, until Close.
  Stream(int next_rank, std::string next_address, std::shared_ptr<grpc::Channel> channel,
         std::function<void(const absl::Status&)> on_failure, const ClientSecurity& security)
      : next_rank_(next_rank),
        next_address_(std::move(next_address)),
        channel_(std::move(channel)),
        on_failure_(std::move(on_failure)) {
    security.Attach(&context_);
  }

  void Start() {
    context_.set_wait_for_ready(true);  // The next rank may still be starting.
    grpc::GenericStub stub(channel_);
    stub.PrepareBidiStreamingCall(&context_, kStreamMethod, grpc::StubOptions(), this);
    AddHold();
    StartRead(&ack_);
    StartCall();
  }

  absl::Status Enqueue(grpc::ByteBuffer block) {
    {
      absl::MutexLock lock(&mu_);
      // A failed stream: the receiver's reason (OnDone's status) rather than the generic one a
      // failed read or write left, when it comes within FinalErrorLocked's wait.
      if (!error_.ok()) return FinalErrorLocked();
      ++queued_;
      if (writing_) {
        queue_.push_back(std::move(block));
        return absl::OkStatus();
      }
      writing_ = true;
      current_ = std::move(block);
    }
    // Outside the lock; safe because writing_ keeps anyone else from writing and the hold keeps
    // the call alive.
    StartWrite(&current_);
    return absl::OkStatus();
  }

  // Waits for every block queued so far to be acknowledged.
  absl::Status WaitAcknowledged(absl::Time deadline) {
    {
      absl::MutexLock lock(&mu_);
      auto acknowledged = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !error_.ok() || acked_ == queued_;
      };
      const absl::Time began = absl::Now();
      absl::Time report = began + kStallReport;
      bool done = false;
      for (;;) {
        if (mu_.AwaitWithDeadline(absl::Condition(&acknowledged), std::min(deadline, report))) {
          done = true;
          break;
        }
        const absl::Time now = absl::Now();
        if (now >= deadline) break;
        if (now < report) continue;  // Woken early: wait on.
        report = now + kStallReport;
        // A stopped or overloaded next rank: say on whom this rank waits, as a receive does.
        RUBATO_LOG(WARNING) << "all-reduce stalled: waiting "
                            << absl::FormatDuration(absl::Trunc(now - began, absl::Seconds(1)))
                            << " for rank " << next_rank_ << " at " << next_address_ << " to take "
                            << (queued_ - acked_)
                            << " block(s) (its stream is open; nothing acknowledged); giving up in "
                            << absl::FormatDuration(absl::Trunc(deadline - now, absl::Seconds(1)));
      }
      if (done) {
        if (error_.ok()) return absl::OkStatus();
        return FinalErrorLocked();
      }
      const bool connected = channel_->GetState(false) == GRPC_CHANNEL_READY;
      std::string why;
      if (!connected) {
        // Why not, told apart: the name does not resolve, refused, no answer, no route.
        why = absl::StrCat("could not connect: ",
                           DiagnoseEndpoint(next_address_, absl::Seconds(2)).detail);
      } else if (connected && written_ < queued_) {
        why = absl::StrCat(queued_ - written_, " blocks not taken (is the rank stuck?)");
      } else if (connected) {
        why = absl::StrCat(queued_ - acked_, " blocks not acknowledged (is the rank stuck?)");
      }
      SetErrorLocked(absl::DeadlineExceededError(absl::StrCat(
          "all-reduce timed out sending to rank ", next_rank_, " at ", next_address_, ": ", why)));
    }
    context_.TryCancel();  // The write in progress fails, the hold goes, OnDone follows.
    absl::MutexLock lock(&mu_);
    return FinalErrorLocked();
  }

  // Closes the stream once everything queued is written, and waits until `timeout` for the
  // receiver to have read it all (the call then ends in good order); cancels the call otherwise,
  // and waits up to `cancelled_grace` more for its end, which gRPC reports soon after a
  // cancellation. Returns whether the call ended (OnDone ran): only then may this be destroyed.
  bool Close(absl::Duration timeout, absl::Duration cancelled_grace) {
    const absl::Time deadline = absl::Now() + timeout;
    HoldRelease release;
    {
      absl::MutexLock lock(&mu_);
      auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; };
      mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
      closing_ = true;
      on_failure_ = nullptr;
      release = ReleaseHoldLocked();  // Or OnWriteDone does, once the write in progress ends.
    }
    Apply(release);
    if (AwaitDone(deadline)) return true;
    if (timeout > absl::ZeroDuration()) {
      RUBATO_LOG(WARNING) << "all-reduce stream to rank " << next_rank_ << " at " << next_address_
                          << " did not close within " << absl::FormatDuration(timeout)
                          << " (the rank did not read its last blocks); cancelling it";
    }
    context_.TryCancel();  // The write in progress fails, the hold goes, OnDone follows.
    return AwaitDone(absl::Now() + cancelled_grace);
  }

  void OnWriteDone(bool ok) override {
    bool next = false;
    HoldRelease release;
    {
      absl::MutexLock lock(&mu_);
      if (ok) ++written_;
      if (!ok && error_.ok()) {
        Fail("the stream broke (the rank exited, was killed or lost the connection)");
      }
      if (ok && error_.ok() && !queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        next = true;
      } else {
        writing_ = false;
        current_.Clear();
        release = ReleaseHoldLocked();
      }
    }
    if (next) StartWrite(&current_);
    Apply(release);
  }

  void OnReadDone(bool ok) override {
    bool more = false;
    HoldRelease release;
    {
      absl::MutexLock lock(&mu_);
      int64_t blocks = 0;
      if (ok && (!ParseRingAck(ack_, &blocks).ok() || blocks < acked_ || blocks > queued_)) {
        Fail(absl::StrCat("malformed acknowledgement (", blocks, " blocks, ", acked_,
                          " acknowledged and ", queued_, " sent before)"));
      } else if (ok) {
        acked_ = blocks;
        more = true;
      } else if (!closing_ && error_.ok()) {
        Fail("the rank ended the stream (it exited, was killed or lost the connection)");
      }
      release = ReleaseHoldLocked();
    }
    if (more) StartRead(&ack_);
    Apply(release);
  }

  // The link may destroy this object as soon as done_ is set and mu_ released (Close), so nothing
  // may follow the lock's release here.
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    done_ = true;
    if (!status.ok() && (error_.ok() || generic_error_)) {
      const absl::Status s = FromGrpcStatus(status);
      SetErrorLocked(
          absl::Status(s.code(), absl::StrCat("all-reduce stream to rank ", next_rank_, " at ",
                                              next_address_, ": ", s.message())));
      generic_error_ = false;
    } else if (error_.ok() && !closing_) {
      Fail("the rank closed the stream");
    }
  }

 private:
  // Waits until `deadline` for OnDone.
  bool AwaitDone(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
    return mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  }

  // After a failure, waits (briefly) for the call to end, so that gRPC is done with the caller's
  // memory and the receiver's reason, if it sent one, is in error_.
  absl::Status FinalErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!done_) {
      auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
      mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(2));
    }
    return error_;
  }

  void Fail(absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    SetErrorLocked(absl::UnavailableError(
        absl::StrCat("all-reduce stream to rank ", next_rank_, " at ", next_address_, ": ", what)));
    generic_error_ = true;
  }

  // Records the link's failure: queued blocks are dropped, and waiters wake.
  void SetErrorLocked(absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    error_ = std::move(error);
    if (on_failure_) on_failure_(error_);
    queue_.clear();
  }

  // The hold goes once no write is in progress and the stream failed or is being closed; a stream
  // closed in good order is half-closed first.
  struct HoldRelease {
    bool release = false;
    bool writes_done = false;
  };
  HoldRelease ReleaseHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!hold_ || writing_ || (error_.ok() && !closing_)) return {};
    hold_ = false;
    return {true, error_.ok()};
  }
  void Apply(HoldRelease release) {
    if (release.writes_done) StartWritesDone();
    if (release.release) RemoveHold();
  }

  const int next_rank_;
  const std::string next_address_;
  const std::shared_ptr<grpc::Channel> channel_;
  grpc::ClientContext context_;
  grpc::ByteBuffer ack_;      // The acknowledgement being read; only OnReadDone touches it.
  grpc::ByteBuffer current_;  // The block being written; touched only by whoever set writing_.

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_ ABSL_GUARDED_BY(mu_) = true;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool generic_error_ ABSL_GUARDED_BY(mu_) = false;  // error_ may be refined by OnDone's status.
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::Status&)> on_failure_ ABSL_GUARDED_BY(mu_);
};

// How long the destructor waits for a cancelled stream's OnDone, which gRPC runs soon after a
// cancellation; only a wedged gRPC thread takes longer.
constexpr absl::Duration kCancelledStreamGrace = absl::Seconds(30);

GrpcRingLink::GrpcRingLink(int rank, int size, const std::string& next_address,
                           RingMailbox* mailbox, absl::Duration close_timeout,
                           const ClientSecurity& security, int64_t max_message_bytes)
    : rank_(rank),
      size_(size),
      next_address_(next_address),
      mailbox_(mailbox),
      close_timeout_(close_timeout),
      channel_(grpc::CreateCustomChannel(next_address, security.credentials(),
                                         RubatoChannelArguments(max_message_bytes))),
      stream_(std::make_unique<Stream>(
          (rank + 1) % size, next_address, channel_,
          [mailbox](const absl::Status& error) { mailbox->Abort(error); }, security)) {
  stream_->Start();
}

GrpcRingLink::~GrpcRingLink() {
  // The closing block; if the link already failed there is nothing to close cleanly.
  stream_->Enqueue(EncodeBlock(rank_, kRingClosingTag, {})).IgnoreError();
  // After a failed receive the ring is broken: do not wait for the next rank to read the rest.
  // Close returns once the call has ended (OnDone ran), cancelling it if the next rank has not
  // read everything within close_timeout_. The stream, and then the channel (members are destroyed
  // in reverse order), are then freed here: gRPC shuts down the completion queue that runs
  // callbacks when its last channel goes, which it cannot do from that queue's own thread (it
  // aborts), so the last references must not go in a callback.
  if (!stream_->Close(receive_failed_ ? absl::ZeroDuration() : close_timeout_,
                      kCancelledStreamGrace)) {
    // gRPC broke its promise of an OnDone after cancellation. Freeing the stream now would let a
    // late callback write to freed memory, and waiting on would hang the rank: keep it (and,
    // through it, the channel) for good, the lesser harm.
    RUBATO_LOG(ERROR) << "all-reduce stream to rank " << (rank_ + 1) % size_ << " at "
                      << next_address_ << " did not end within "
                      << absl::FormatDuration(kCancelledStreamGrace)
                      << " of being cancelled; leaking it";
    Stream* leaked = stream_.release();
    static_cast<void>(leaked);
  }
}

absl::Status GrpcRingLink::Send(int64_t tag, absl::Span<const float> data) {
  return stream_->Enqueue(EncodeBlock(rank_, tag, data));
}

absl::Status GrpcRingLink::Flush(absl::Time deadline) {
  RETURN_IF_ERROR(stream_->Enqueue(EncodeBlock(rank_, kRingSyncTag, {})));
  return stream_->WaitAcknowledged(deadline);
}

absl::StatusOr<bool> GrpcRingLink::Incoming(absl::Time deadline) {
  return mailbox_->AwaitAny(deadline);
}

absl::Status GrpcRingLink::Receive(int64_t tag, absl::Span<float> out, Combine combine,
                                   absl::Time deadline) {
  absl::Status status = mailbox_->Take(tag, out, combine, deadline);
  if (!status.ok()) receive_failed_ = true;
  // Nothing came from the previous rank, and this rank never reached the next one either: a ring
  // that never formed. Say why the next one is unreachable, which is often why the other is
  // silent (a mistyped or unresolvable --peers entry, a rank not started).
  if (absl::IsDeadlineExceeded(status) && channel_->GetState(false) != GRPC_CHANNEL_READY) {
    return absl::DeadlineExceededError(
        absl::StrCat(status.message(), "; this rank could not connect to the next, rank ",
                     (rank_ + 1) % size_, " at ", next_address_,
                     " either: ", DiagnoseEndpoint(next_address_, absl::Seconds(2)).detail));
  }
  return status;
}

}  // namespace rubato
