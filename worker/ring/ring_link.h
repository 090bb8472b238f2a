// The sending end of the ring all-reduce's transport: GrpcRingLink, the RingLink
// (common/ring_allreduce.h) of one rank over gRPC.
//
// A link keeps one client stream open to the next rank's RingPeer service (worker/ring/ring_service.h)
// and writes blocks on it in order, encoded without copying the floats (worker/ring/ring_codec.h). Why
// one stream and not a call per block: a stream costs one HTTP/2 stream set-up for the whole job,
// keeps blocks in order (so the receiver gets segment s before s+1, which the pipelined ring
// needs), and lets the sender queue the next block while the previous one is still on the wire.
// The link receives through the rank's own RingMailbox (worker/ring/ring_mailbox.h), which the service
// fills.
//
// Known limit: gRPC 1.51 keeps an HTTP/2 connection's flow-control window at 64 KiB (with
// bandwidth-delay probing off; on, it was slower), so a link moves 64 KiB per window-update round
// trip (GRPC_TRACE=flowctl: "stalled ... by transport ... t_win=0"). Splitting blocks over several
// connections was slower still on 2 cores. This is what holds 1 MB all-reduces back.
#ifndef RUBATO_WORKER_RING_RING_LINK_H_
#define RUBATO_WORKER_RING_RING_LINK_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/limits.h"
#include "common/ring_allreduce.h"
#include "common/security.h"
#include "grpcpp/channel.h"
#include "worker/ring/ring_mailbox.h"

namespace rubato {

// Sends to `next_address` (rank + 1 mod size) on one stream, opened at construction; receives from
// `mailbox`, which must outlive the link, and aborts it if the stream fails (so a rank waiting to
// receive learns at once that its next rank died). Send does not copy the floats: the message
// points at the caller's memory. Flush sends an empty sync block (tag -2) and waits for the next
// rank to acknowledge it, which it does once it has read every block before it; blocks are not
// acknowledged one by one. The destructor sends a closing block (tag -1, which tells the receiver
// the stream ended on purpose), closes the stream and waits (at most `close_timeout`) until the
// next rank has read every block, so a rank that finishes first does not take its last blocks
// with it (unless a Receive failed: then the ring is broken and the stream is cancelled at once).
// It returns only once gRPC is done with the stream (cancelling it if the next rank does not read;
// see ~GrpcRingLink).
//
// Lifetime: after a failed all-reduce, blocks sent but never acknowledged may still be on their
// way until the destructor returns, so memory passed to Send must outlive the link, not just the
// all-reduce: declare the buffers before the link (members and locals are destroyed in reverse
// order).
class GrpcRingLink final : public RingLink {
 public:
  // `security`: the channel's credentials and this rank's token (worker `rank`'s).
  GrpcRingLink(int rank, int size, const std::string& next_address, RingMailbox* mailbox,
               absl::Duration close_timeout = absl::Seconds(10),
               const ClientSecurity& security = ClientSecurity(),
               int64_t max_message_bytes = kDefaultMaxMessageBytes);
  ~GrpcRingLink() override;
  GrpcRingLink(const GrpcRingLink&) = delete;
  GrpcRingLink& operator=(const GrpcRingLink&) = delete;

  absl::Status Send(int64_t tag, absl::Span<const float> data) override;
  absl::Status Flush(absl::Time deadline) override;
  absl::Status Receive(int64_t tag, absl::Span<float> out, Combine combine,
                       absl::Time deadline) override;
  absl::StatusOr<bool> Incoming(absl::Time deadline) override;

  class Stream;  // The client stream's reactor and its queue (worker/ring/ring_link.cc).

 private:
  const int rank_;
  const int size_;
  const std::string next_address_;
  RingMailbox* const mailbox_;
  const absl::Duration close_timeout_;
  bool receive_failed_ = false;  // Then the destructor cancels instead of closing in order.
  // Declared before stream_, so destroyed after it: the last reference to the channel must go on
  // this thread, never on one of gRPC's (see ~GrpcRingLink).
  std::shared_ptr<grpc::Channel> channel_;
  // Owned here alone; the destructor frees it only after the call's OnDone.
  std::unique_ptr<Stream> stream_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_RING_LINK_H_
