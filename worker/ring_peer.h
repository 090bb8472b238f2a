// The gRPC side of the ring all-reduce (common/ring_allreduce.h).
//
// Each rank serves RingPeer; its previous neighbour keeps one client stream open to it and writes
// blocks in order. Why one stream and not a call per block: a stream costs one HTTP/2 stream set-up
// for the whole job, keeps blocks in order (so the receiver gets segment s before s+1, which the
// pipelined ring needs), and lets the sender queue the next block while the previous one is still
// on the wire. Incoming blocks wait in a RingMailbox until the algorithm asks for them by tag.
//
// Known limit: gRPC 1.51 keeps an HTTP/2 connection's flow-control window at 64 KiB (with
// bandwidth-delay probing off; on, it was slower), so a link moves 64 KiB per window-update round
// trip (GRPC_TRACE=flowctl: "stalled ... by transport ... t_win=0"). Splitting blocks over several
// connections was slower still on 2 cores. This is what holds 1 MB all-reduces back.
//
// Failure handling, since a dead or stuck peer must not hang a job:
//  - the next rank not up yet: the stream waits for it (wait_for_ready, reconnect backoff capped at
//    1 s by RubatoChannelArguments) until the all-reduce's deadline;
//  - the next rank dies: the stream fails, and every later Send/Flush fails at once naming it, as
//    does a Receive waiting meanwhile (the failure aborts this rank's mailbox);
//  - the previous rank dies: its stream breaks, and Receive fails at once naming it (blocks it
//    delivered before still count);
//  - a rank stops but keeps its connections (SIGSTOP, a livelock): Flush and Receive time out at
//    the deadline, naming the rank waited for.
#ifndef RUBATO_WORKER_RING_PEER_H_
#define RUBATO_WORKER_RING_PEER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/ring_allreduce.h"
#include "common/security.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/ring.grpc.pb.h"

namespace rubato {

// A block's floats as they came off the wire: the message's slices, not copied, holding `bytes`
// bytes from byte `offset` on. Floats may straddle slices.
struct RingPayload {
  std::vector<grpc::Slice> slices;
  size_t offset = 0;
  size_t bytes = 0;
};

// Parses a serialized RingBlock without copying its data: INVALID_ARGUMENT naming the problem if
// it is not one (data must be the last field, as protobuf writes it).
absl::Status ParseRingBlock(const grpc::ByteBuffer& message, int* from_rank, int64_t* tag,
                            RingPayload* payload);

// Blocks delivered to this rank by `from_rank` (its previous neighbour), by tag. Thread-safe.
class RingMailbox {
 public:
  explicit RingMailbox(int from_rank) : from_rank_(from_rank) {}

  int from_rank() const { return from_rank_; }

  // INVALID_ARGUMENT for a sender other than from_rank, a size that is not whole floats, or a
  // repeated tag.
  absl::Status Put(int from, int64_t tag, RingPayload payload);
  // Waits until `deadline` for block `tag`, then adds it to `out` or copies it there, checking in
  // the same pass that every value is finite. DEADLINE_EXCEEDED names the previous rank;
  // UNAVAILABLE if its stream broke before the block came; INVALID_ARGUMENT for a size other than
  // out.size() or a non-finite value (`out` may then hold part of the block).
  absl::Status Take(int64_t tag, absl::Span<float> out, RingLink::Combine combine,
                    absl::Time deadline);

  // The service reports the previous rank's stream: opened, or ended other than by the sender
  // closing it (the sender died or cancelled; `why` says how). Take then fails at once for blocks
  // that did not come.
  void StreamOpened();
  void StreamBroke(absl::string_view why);
  // This rank's link to the next rank failed: Take fails at once too (the ring cannot complete),
  // with `error`. Stays until the mailbox is destroyed.
  void Abort(absl::Status error);

 private:
  const int from_rank_;
  absl::Mutex mu_;
  std::map<int64_t, RingPayload> blocks_ ABSL_GUARDED_BY(mu_);
  std::string broken_ ABSL_GUARDED_BY(mu_);  // Non-empty once the stream broke.
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

// Serves RingPeer.Stream on raw messages (ParseRingBlock), so a block's floats are read once, by
// the addition in RingMailbox::Take, straight from the buffers the transport filled. With a job
// secret, a stream is accepted only with the previous rank's own token (common/security.h);
// anything else ends at once with UNAUTHENTICATED or PERMISSION_DENIED and never reaches the
// mailbox.
class RingPeerService final : public RingPeer::WithRawCallbackMethod_Stream<RingPeer::Service> {
 public:
  explicit RingPeerService(RingMailbox* mailbox, ServerSecurity security = ServerSecurity())
      : mailbox_(mailbox), security_(std::move(security)) {}
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

 private:
  RingMailbox* const mailbox_;
  const ServerSecurity security_;
};

// Sends to `next_address` (rank + 1 mod size) on one stream, opened at construction; receives from
// `mailbox`, which must outlive the link, and aborts it if the stream fails (so a rank waiting to
// receive learns at once that its next rank died). Send does not copy the floats: the message
// points at the caller's memory. Flush sends an empty sync block (tag -2) and waits for the next
// rank to acknowledge it, which it does once it has read every block before it; blocks are not
// acknowledged one by one. The destructor sends a closing block (tag -1, which tells the receiver
// the stream ended on purpose), closes the stream and waits (at most `close_timeout`) until the
// next rank has read every block, so a rank that finishes first does not take its last blocks
// with it (unless a Receive failed: then the ring is broken and the stream is cancelled at once).
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

  class Stream;  // The client stream's reactor and its queue (worker/ring_peer.cc).

 private:
  const int rank_;
  const int size_;
  const std::string next_address_;
  RingMailbox* const mailbox_;
  const absl::Duration close_timeout_;
  bool receive_failed_ = false;  // Then the destructor cancels instead of closing in order.
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<Stream> stream_;  // Lives until the stream is done, even past this link.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_PEER_H_
