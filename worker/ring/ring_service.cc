#include "worker/ring/ring_service.h"

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "worker/ring/ring_codec.h"

namespace rubato {
namespace {

// The server's end of one stream from the previous rank: reads blocks into the mailbox and
// acknowledges them (the latest count, whenever no acknowledgement is being written) until the
// sender closes the stream, or ends it with the error of a malformed block.
class StreamReader final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit StreamReader(RingMailbox* mailbox) : mailbox_(mailbox) {
    mailbox_->StreamOpened();
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    absl::Status put;
    bool acknowledge = false;
    if (ok) {
      int from = -1;
      int64_t tag = -1;
      RingPayload payload;
      put = ParseRingBlock(message_, &from, &tag, &payload);
      if (put.ok() && (tag == kRingClosingTag || tag == kRingSyncTag) && payload.bytes == 0) {
        closed_ |= tag == kRingClosingTag;
        acknowledge = true;
      } else if (put.ok() && tag >= 0 && tag <= last_tag_) {
        // A sender writes its blocks in the order of their tags.
        put = absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " came after block ",
                                                      last_tag_, " (repeated or out of order)"));
      } else if (put.ok()) {
        put = mailbox_->Put(from, tag, std::move(payload));
        last_tag_ = tag;
      }
      message_.Clear();
    } else if (!closed_) {  // The sender went away without closing the stream.
      mailbox_->StreamBroke(
          "the stream ended without its closing block (the rank exited, was "
          "killed, gave up or lost the connection)");
    }
    if (!put.ok()) mailbox_->StreamBroke(put.message());
    bool write = false, finish = false, read = false;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (ok && put.ok()) {
        ++read_;
        if (acknowledge) wanted_ = read_;
      } else {
        ending_ = true;
        status_ = ToGrpcStatus(put);
      }
      read = reading_ = !ending_;  // Not after a failed write either: the stream is over.
      write = !writing_ && !ending_ && wanted_ > acked_;
      if (write) {
        writing_ = true;
        ack_ = EncodeAck(acked_ = wanted_);
      }
      finish = FinishNowLocked();
    }
    if (write) StartWrite(&ack_);
    if (read) StartRead(&message_);
    if (finish) Finish(status_);
  }

  void OnWriteDone(bool ok) override {
    bool write = false, finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) ending_ = true;  // The stream is gone; the read out fails too.
      write = !ending_ && wanted_ > acked_;
      if (write) {
        writing_ = true;
        ack_ = EncodeAck(acked_ = wanted_);
      }
      finish = FinishNowLocked();
    }
    if (write) StartWrite(&ack_);
    if (finish) Finish(status_);
  }

  void OnCancel() override {
    mailbox_->StreamBroke(
        "the stream was cancelled (the rank exited, gave up or lost the "
        "connection)");
  }

  void OnDone() override { delete this; }

 private:
  // Finish once, when the stream is over and no read or write is outstanding.
  bool FinishNowLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ending_ || writing_ || reading_ || finished_) return false;
    finished_ = true;
    return true;
  }

  RingMailbox* const mailbox_;
  grpc::ByteBuffer message_;
  bool closed_ = false;  // The closing block came. Only the read callbacks touch it and last_tag_.
  int64_t last_tag_ = -1;
  // Reads and writes complete on different threads.
  absl::Mutex mu_;
  int64_t read_ ABSL_GUARDED_BY(mu_) = 0;    // Blocks read.
  int64_t wanted_ ABSL_GUARDED_BY(mu_) = 0;  // Blocks up to the latest sync or closing block.
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;   // The count in the latest acknowledgement.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // Reads are over: finish once no write is out.
  bool reading_ ABSL_GUARDED_BY(mu_) = true;  // The constructor starts the first read.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_;   // Set before ending_, read after.
  grpc::ByteBuffer ack_;  // Touched only by whoever set writing_.
};

// A stream refused before it could reach the mailbox (authentication failed).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RingPeerService::Stream(
    grpc::CallbackServerContext* context) {
  if (absl::Status s = security_.CheckCall(*context, mailbox_->from_rank()); !s.ok()) {
    return new RefusedStream(s);
  }
  return new StreamReader(mailbox_);
}

grpc::ServerUnaryReactor* RingPeerService::OpenData(grpc::CallbackServerContext* context,
                                                    const OpenDataRequest* request,
                                                    OpenDataReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = security_.CheckCall(*context, mailbox_->from_rank());
  if (status.ok() && request->from_rank() != mailbox_->from_rank()) {
    status = absl::PermissionDeniedError(absl::StrCat("OpenData from rank ", request->from_rank(),
                                                      ", but this rank receives from rank ",
                                                      mailbox_->from_rank(), " only"));
  }
  if (status.ok() && data_ == nullptr) {
    status = absl::FailedPreconditionError(
        "this rank carries the ring over gRPC only (--ring_transport=grpc, or TLS); start every "
        "rank with the same --ring_transport");
  }
  if (status.ok()) {
    absl::StatusOr<std::string> ticket = data_->IssueTicket();
    if (ticket.ok()) {
      reply->set_port(data_->port());
      reply->set_ticket(*ticket);
    } else {
      status = ticket.status();
    }
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace rubato
