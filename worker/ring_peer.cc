#include "worker/ring_peer.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/net_diagnose.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace rubato {
namespace {

constexpr char kStreamMethod[] = "/rubato.RingPeer/Stream";
// Empty blocks with special tags. Both ask the receiver to acknowledge everything read so far;
// other blocks are not acknowledged one by one.
constexpr int64_t kClosingTag = -1;  // The last block of a stream closed on purpose.
constexpr int64_t kSyncTag = -2;     // Sent by Flush.

// Serializes RingBlock{from_rank, tag, data} as two slices: a copied header (the small fields
// through protobuf, then field 3's key and length by hand) and `data` itself, not copied. gRPC
// sees a static slice, so it never frees it; the caller keeps the memory unchanged until the
// receiver acknowledges the block (by then every byte has left this process).
grpc::ByteBuffer EncodeBlock(int from_rank, int64_t tag, absl::Span<const float> data) {
  RingBlock header;
  header.set_from_rank(from_rank);
  header.set_tag(tag);
  const uint64_t payload = data.size() * sizeof(float);
  constexpr uint8_t kDataKey = (3 << 3) | 2;  // Field 3, length-delimited.
  uint8_t bytes[32];
  header.ByteSizeLong();  // Caches the sizes (at most 16 bytes: two varints and their keys).
  uint8_t* p = header.SerializeWithCachedSizesToArray(bytes);
  *p++ = kDataKey;
  p = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(payload, p);
  grpc::Slice slices[2] = {grpc::Slice(bytes, p - bytes), grpc::Slice()};
  if (payload == 0) return grpc::ByteBuffer(slices, 1);
  slices[1] = grpc::Slice(data.data(), payload, grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(slices, 2);
}

// out (+)= the floats at `bytes` (out.size() of them, possibly unaligned), in one pass that also
// flags non-finite values (an all-ones exponent). Returns whether all were finite. Written in
// fixed blocks of 16 so that GCC vectorizes it at -O2 (and with AVX2 where the CPU has it).
__attribute__((target_clones("avx2", "default"))) bool CombineFiniteFloats(
    const char* __restrict bytes, absl::Span<float> out, RingLink::Combine combine) {
  constexpr uint32_t kExponent = 0x7f800000u;
  constexpr size_t kBlock = 16;
  uint32_t exponents[kBlock] = {};  // Element-wise maxima, reduced once at the end.
  const size_t n = out.size();
  float* __restrict o = out.data();
  const bool add = combine == RingLink::Combine::kAdd;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const char* in = bytes + 4 * i;
    for (size_t j = 0; j < kBlock; ++j) {
      uint32_t u;
      std::memcpy(&u, in + 4 * j, 4);
      exponents[j] = std::max(exponents[j], u & kExponent);
    }
    if (add) {
      for (size_t j = 0; j < kBlock; ++j) {
        float v;
        std::memcpy(&v, in + 4 * j, 4);
        o[i + j] += v;
      }
    } else {
      std::memcpy(o + i, in, 4 * kBlock);
    }
  }
  uint32_t max_exponent = 0;
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, bytes + 4 * i, 4);
    float v;
    std::memcpy(&v, &u, 4);
    max_exponent = std::max(max_exponent, u & kExponent);
    o[i] = add ? o[i] + v : v;
  }
  for (uint32_t e : exponents) max_exponent = std::max(max_exponent, e);
  return max_exponent != kExponent;
}

// Combines a payload that may be split across slices at any byte into `out`: whole floats straight
// from each slice, a float that straddles two slices through a 4-byte buffer.
bool CombinePayload(const RingPayload& payload, absl::Span<float> out, RingLink::Combine combine) {
  bool finite = true;
  size_t skip = payload.offset, left = payload.bytes, next = 0;
  char carry[4];
  size_t carried = 0;
  for (const grpc::Slice& slice : payload.slices) {
    const char* p = reinterpret_cast<const char*>(slice.begin());
    size_t len = slice.size();
    if (skip >= len) {
      skip -= len;
      continue;
    }
    p += skip;
    len = std::min(len - skip, left);
    skip = 0;
    left -= len;
    if (carried > 0) {
      const size_t k = std::min(4 - carried, len);
      std::memcpy(carry + carried, p, k);
      carried += k;
      p += k;
      len -= k;
      if (carried < 4) continue;
      finite &= CombineFiniteFloats(carry, out.subspan(next++, 1), combine);
      carried = 0;
    }
    const size_t whole = len / 4;
    finite &= CombineFiniteFloats(p, out.subspan(next, whole), combine);
    next += whole;
    carried = len - 4 * whole;
    std::memcpy(carry, p + 4 * whole, carried);
    if (left == 0) break;
  }
  return finite;
}

grpc::ByteBuffer EncodeAck(int64_t blocks) {
  RingAck ack;
  ack.set_blocks(blocks);
  grpc::Slice slice(ack.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

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
      if (put.ok() && (tag == kClosingTag || tag == kSyncTag) && payload.bytes == 0) {
        closed_ |= tag == kClosingTag;
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

}  // namespace

absl::Status ParseRingBlock(const grpc::ByteBuffer& message, int* from_rank, int64_t* tag,
                            RingPayload* payload) {
  *from_rank = 0;  // proto3 leaves out fields that are zero.
  *tag = 0;
  payload->slices.clear();
  grpc::Status dumped = message.Dump(&payload->slices);
  if (!dumped.ok()) return absl::InvalidArgumentError("ring block: unreadable message");
  const size_t total = message.Length();
  // The fields before data take at most 2 + 10 + 1 + 10 + 1 + 10 bytes; parse a copy of those.
  uint8_t head[40];
  size_t head_bytes = 0;
  for (const grpc::Slice& slice : payload->slices) {
    const size_t k = std::min(slice.size(), sizeof(head) - head_bytes);
    std::memcpy(head + head_bytes, slice.begin(), k);
    head_bytes += k;
    if (head_bytes == sizeof(head)) break;
  }
  google::protobuf::io::CodedInputStream in(head, static_cast<int>(head_bytes));
  payload->offset = total;
  payload->bytes = 0;
  while (static_cast<size_t>(in.CurrentPosition()) < head_bytes) {
    const uint32_t key = in.ReadTag();
    uint64_t value = 0;
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (field == 3 && wire == 2) {
      // 64 bits: ReadVarint32 would truncate a longer varint (2^48 read as 0, an "empty" block
      // that protobuf itself refuses; found by fuzz/ring_mailbox_fuzzer).
      // And at most 5 bytes, as protobuf reads a length (an overlong encoding such as
      // 80 80 80 80 80 80 00 for 0 is refused there; also found by the fuzzer).
      uint64_t length = 0;
      const int length_at = in.CurrentPosition();
      if (!in.ReadVarint64(&length) || in.CurrentPosition() - length_at > 5 || length > total ||
          static_cast<size_t>(in.CurrentPosition()) + length != total) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ring block: data must be the last field and fill the message (", total, " bytes)"));
      }
      payload->offset = in.CurrentPosition();
      payload->bytes = length;
      return absl::OkStatus();
    }
    if ((field != 1 && field != 2) || wire != 0 || !in.ReadVarint64(&value)) {
      return absl::InvalidArgumentError(absl::StrCat("ring block: unexpected or truncated field ",
                                                     field, " (wire type ", wire, ")"));
    }
    if (field == 1) *from_rank = static_cast<int32_t>(value);
    if (field == 2) *tag = static_cast<int64_t>(value);
  }
  if (head_bytes != total) {
    return absl::InvalidArgumentError("ring block: malformed header");
  }
  return absl::OkStatus();  // No data field: an empty block.
}

absl::Status RingMailbox::Put(int from, int64_t tag, RingPayload payload) {
  if (tag < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring block has a negative tag ", tag));
  }
  if (from != from_rank_) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " came from rank ", from,
                                                   ", but this rank receives from rank ",
                                                   from_rank_, " only"));
  }
  if (payload.bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring block ", tag, " has ", payload.bytes, " bytes, not whole floats"));
  }
  absl::MutexLock lock(&mu_);
  if (!blocks_.emplace(tag, std::move(payload)).second) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " delivered twice"));
  }
  return absl::OkStatus();
}

// How long a Take that found the previous rank's stream broken waits for this rank's own link to
// the next rank to fail too (see Take).
constexpr absl::Duration kBrokenStreamGrace = absl::Seconds(1);

absl::Status RingMailbox::Take(int64_t tag, absl::Span<float> out, RingLink::Combine combine,
                               absl::Time deadline) {
  RingPayload payload;
  {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return blocks_.count(tag) > 0 || !broken_.empty() || !aborted_.ok();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("all-reduce timed out waiting for block ", tag, " from rank ", from_rank_));
    }
    auto it = blocks_.find(tag);
    if (it == blocks_.end() && aborted_.ok()) {
      // The previous rank's stream broke. When the next rank died, the previous one often fails
      // on that first and exits, and its broken stream reaches here before this rank's own link
      // to the next rank reports the death: give that link a moment, so that the error names the
      // rank that failed first rather than one that gave up because of it.
      auto aborted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !aborted_.ok(); };
      mu_.AwaitWithDeadline(absl::Condition(&aborted),
                            std::min(deadline, absl::Now() + kBrokenStreamGrace));
    }
    if (it == blocks_.end() && !aborted_.ok()) {
      if (broken_.empty()) return aborted_;
      return absl::Status(aborted_.code(),
                          absl::StrCat(aborted_.message(), " (then the stream from rank ",
                                       from_rank_, " broke too: ", broken_, ")"));
    }
    if (it == blocks_.end()) {
      return absl::UnavailableError(absl::StrCat("all-reduce: the stream from rank ", from_rank_,
                                                 " broke before block ", tag, " came: ", broken_));
    }
    payload = std::move(it->second);
    blocks_.erase(it);
  }
  if (payload.bytes != out.size() * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " from rank ", from_rank_,
                                                   " has ", payload.bytes / sizeof(float),
                                                   " floats, expected ", out.size()));
  }
  if (!CombinePayload(payload, out, combine)) {
    // Name the culprit (from a contiguous copy: this is the error path).
    std::vector<float> values(out.size());
    CombinePayload(payload, absl::MakeSpan(values), RingLink::Combine::kCopy);
    return CheckFloatBytes(
        absl::StrCat("ring block ", tag, " from rank ", from_rank_),
        absl::string_view(reinterpret_cast<const char*>(values.data()), payload.bytes),
        static_cast<int64_t>(values.size()));
  }
  return absl::OkStatus();
}

void RingMailbox::StreamOpened() {
  absl::MutexLock lock(&mu_);
  broken_.clear();
}

void RingMailbox::Abort(absl::Status error) {
  absl::MutexLock lock(&mu_);
  if (aborted_.ok()) aborted_ = std::move(error);
}

void RingMailbox::StreamBroke(absl::string_view why) {
  absl::MutexLock lock(&mu_);
  if (broken_.empty()) broken_ = std::string(why);
}

// A stream refused before it could reach the mailbox (authentication failed).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RingPeerService::Stream(
    grpc::CallbackServerContext* context) {
  if (absl::Status s = security_.CheckCall(*context, mailbox_->from_rank()); !s.ok()) {
    return new RefusedStream(s);
  }
  return new StreamReader(mailbox_);
}

// The client end of the stream to the next rank. Blocks queue here and are written one at a time
// (the callback API allows one outstanding write), each as soon as the previous one is handed to
// the transport; HTTP/2 flow control paces them. Acknowledgements come back on the same stream. A
// hold keeps the call alive while the link may still write, so a write never races the call's
// end. Owned by a shared_ptr that the reactor keeps until OnDone, so the link may go away first.
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

  void Start(std::shared_ptr<Stream> self) {
    self_ = std::move(self);
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
      if (!error_.ok()) return error_;
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
      if (mu_.AwaitWithDeadline(absl::Condition(&acknowledged), deadline)) {
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
  // receiver to have read it all; cancels otherwise.
  void Close(absl::Duration timeout) {
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
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      auto is_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
      done = mu_.AwaitWithDeadline(absl::Condition(&is_done), deadline);
    }
    if (!done) context_.TryCancel();  // OnDone follows; this object lives until then.
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
      RingAck ack;
      grpc::Slice slice;
      if (ok && (!ack_.DumpToSingleSlice(&slice).ok() ||
                 !ack.ParseFromArray(slice.begin(), static_cast<int>(slice.size())) ||
                 ack.blocks() < acked_ || ack.blocks() > queued_)) {
        Fail(absl::StrCat("malformed acknowledgement (", ack.blocks(), " blocks, ", acked_,
                          " acknowledged and ", queued_, " sent before)"));
      } else if (ok) {
        acked_ = ack.blocks();
        more = true;
      } else if (!closing_ && error_.ok()) {
        Fail("the rank ended the stream (it exited, was killed or lost the connection)");
      }
      release = ReleaseHoldLocked();
    }
    if (more) StartRead(&ack_);
    Apply(release);
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Stream> keep;  // Destroyed last, after the lock is released.
    absl::MutexLock lock(&mu_);
    keep = std::move(self_);
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
  std::shared_ptr<Stream> self_;

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

GrpcRingLink::GrpcRingLink(int rank, int size, const std::string& next_address,
                           RingMailbox* mailbox, absl::Duration close_timeout,
                           const ClientSecurity& security, int64_t max_message_bytes)
    : rank_(rank),
      size_(size),
      next_address_(next_address),
      mailbox_(mailbox),
      close_timeout_(close_timeout),
      channel_(grpc::CreateCustomChannel(next_address, security.credentials(),
                                         RubatoChannelArguments(max_message_bytes))) {
  stream_ = std::make_shared<Stream>(
      (rank + 1) % size, next_address, channel_,
      [mailbox](const absl::Status& error) { mailbox->Abort(error); }, security);
  stream_->Start(stream_);
}

GrpcRingLink::~GrpcRingLink() {
  // The closing block; if the link already failed there is nothing to close cleanly.
  stream_->Enqueue(EncodeBlock(rank_, kClosingTag, {})).IgnoreError();
  // After a failed receive the ring is broken: do not wait for the next rank to read the rest.
  stream_->Close(receive_failed_ ? absl::ZeroDuration() : close_timeout_);
  // The reactor drops its reference to itself as OnDone returns, on a gRPC thread. The last
  // references to the stream and its channel must go here instead: gRPC shuts down the completion
  // queue that runs callbacks when its last channel goes, which it cannot do from that queue's own
  // thread (it aborts). After Close, OnDone is on its way (cancelled at worst).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (stream_.use_count() > 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (stream_.use_count() > 1) {
    RUBATO_LOG(ERROR) << "all-reduce stream to " << next_address_
                      << " did not end within 30 s of being cancelled; leaking it";
    new std::shared_ptr<Stream>(std::move(stream_));
    new std::shared_ptr<grpc::Channel>(std::move(channel_));
  }
}

absl::Status GrpcRingLink::Send(int64_t tag, absl::Span<const float> data) {
  return stream_->Enqueue(EncodeBlock(rank_, tag, data));
}

absl::Status GrpcRingLink::Flush(absl::Time deadline) {
  RETURN_IF_ERROR(stream_->Enqueue(EncodeBlock(rank_, kSyncTag, {})));
  return stream_->WaitAcknowledged(deadline);
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
