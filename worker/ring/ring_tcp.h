// The ring all-reduce's data plane over plain TCP: TcpRingLink, a RingLink
// (common/ring_allreduce.h) whose blocks travel on one socket per neighbour pair, set up through
// the authenticated RingPeer gRPC service.
//
// Why not gRPC for the blocks (worker/ring/ring_link.h): on loopback each block on a gRPC stream cost
// 300-400 us, against about 90 us to copy 256 KiB through the kernel, so a 1 MB all-reduce on 2
// ranks took 3.6x OpenMPI's time. The cost is per message: HTTP/2 framing, a receive into freshly
// allocated slices, and hand-offs between gRPC's threads and the caller's. Here a block is a
// 16-byte header and the caller's floats, written with one sendmsg from the calling thread when
// the socket has room (a sender thread takes over only when it has not), and read by the thread
// that asked for it, in pieces of up to 256 KiB (one default segment) into one reused buffer, from
// which it is added or copied into the destination in the same pass as the finiteness check.
//
// Setting up, and who may connect (the data socket carries no token of its own):
//  1. The receiving rank listens on its own host (TcpRingListener, --ring_data_port, 0 = any free
//     port) before its gRPC server starts.
//  2. The sending rank calls RingPeer.OpenData on the next rank's gRPC address. The service
//     checks the caller's token exactly as it does for Stream (only the previous rank may ask) and
//     answers with the listener's port and a fresh 32-byte random ticket.
//  3. The sender connects to that port on the host it dialled and first writes a 48-byte hello:
//     "RBRING1\0", its rank and the ring's size (int32 each), the ticket. The listener accepts the
//     one connection whose hello carries an outstanding ticket (compared in constant time; the
//     first connection in uses them all up) and then stops listening. Anything else is closed and
//     logged, and the wait goes on until the deadline.
// So a connection is accepted only from whoever passed the gRPC service's authentication. The
// blocks themselves are not encrypted: with TLS the ring stays on gRPC (ResolveRingTransport,
// worker/ring/allreduce_client.h).
//
// Wire format after the hello, one way only (little-endian, as the floats): frames of a tag
// (int64) and a byte count (int64), then that many bytes of float32. Tags increase; a frame with
// tag -1 and no bytes closes the link on purpose; a frame with tag -3 says that the sender gave up,
// and why (a status code as int32, then at most 1024 bytes of text). The receiver takes blocks in
// the order they were sent, which is the order RingAllReduceMean asks for them: a block other than
// the one asked for is an error (it can never come later).
//
// Failure handling. A rank whose all-reduce fails tells its next rank why before it closes (the
// give-up frame), so errors travel around the ring and every rank's names the cause:
//  - the next rank not up yet: the sender thread retries OpenData (wait_for_ready) until the link
//    is destroyed; Flush fails at its deadline naming the next rank;
//  - the previous rank dies: the socket from it ends without a closing or give-up frame, and
//    Receive fails at once naming it. That rank's next gives up and tells its own next, and so on
//    around the ring: "rank 3 gave up: all-reduce: rank 2 gave up: ... the data connection from
//    rank 1 broke";
//  - the next rank dies: writes to it fail at once naming it. A Receive waiting meanwhile waits on
//    for the previous rank, which learns of the death through the chain above within
//    milliseconds (in a ring of two, the previous rank is the dead one);
//  - a rank stops but keeps its connections (SIGSTOP): the rank after it times out naming it,
//    and the others learn that from the chain, with the same DEADLINE_EXCEEDED code.
// Flush means the kernel has every byte queued so far, so the caller's memory is its own again
// (the socket holds a copy); it does not wait for the next rank to have read them.
#ifndef RUBATO_WORKER_RING_RING_TCP_H_
#define RUBATO_WORKER_RING_RING_TCP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ring_allreduce.h"
#include "common/security.h"
#include "grpcpp/channel.h"

namespace rubato {

constexpr size_t kRingTicketBytes = 32;
constexpr size_t kRingHelloBytes = 48;
constexpr size_t kRingFrameHeaderBytes = 16;
constexpr int64_t kRingGiveUpTag = -3;
constexpr size_t kRingGiveUpTextBytes = 1024;
// TcpRingLink::SetReceiveSpin's default (allreduce_benchmark --spin_us compares).
constexpr absl::Duration kDefaultRingReceiveSpin = absl::Microseconds(200);
// Tickets the listener honours at once (see IssueTicket).
constexpr size_t kRingOutstandingTickets = 8;

// The receiving end's rendezvous: a listening socket, and the ticket the connection must present.
class TcpRingListener {
 public:
  // Listens on `host` (the host part of this rank's listen address: an address of this host, a
  // name for one, or 0.0.0.0 / ::) at `port` (0: any free port) for rank `from_rank`'s connection.
  // UNAVAILABLE naming the address if it cannot.
  static absl::StatusOr<std::unique_ptr<TcpRingListener>> Create(const std::string& host, int port,
                                                                 int from_rank);
  ~TcpRingListener();
  TcpRingListener(const TcpRingListener&) = delete;
  TcpRingListener& operator=(const TcpRingListener&) = delete;

  int port() const { return port_; }

  // A fresh random ticket. The last kRingOutstandingTickets issued are all good until one of them
  // opens the connection, which voids the others. Several are honoured because the sender retries
  // OpenData with short deadlines while the next rank starts: an attempt it gave up on may still
  // be answered by this rank after the retry was, and a single current ticket then refused the
  // sender's connection (seen under load). Every ticket goes to the authenticated previous rank
  // only, so honouring a few is no weaker than honouring one. Thread-safe.
  absl::StatusOr<std::string> IssueTicket();

  // Waits until `deadline` for from_rank's connection with an outstanding ticket and returns its
  // socket (the caller owns it). Closes and logs any other connection, and keeps waiting. Once one
  // is accepted the listening socket is closed, so later calls fail with FAILED_PRECONDITION.
  // DEADLINE_EXCEEDED if none came. One caller at a time.
  absl::StatusOr<int> Accept(absl::Time deadline);

 private:
  TcpRingListener(int fd, int port, int from_rank)
      : listen_fd_(fd), port_(port), from_rank_(from_rank) {}
  // OK if `hello` is from_rank's with an outstanding ticket (then all are used up).
  absl::Status CheckHello(const char* hello);

  int listen_fd_;
  const int port_;
  const int from_rank_;
  absl::Mutex mu_;
  std::deque<std::string> tickets_ ABSL_GUARDED_BY(mu_);  // Oldest first; empty once used.
};

// The sending end towards the next rank and the receiving end from the previous one, for one rank.
// Not thread-safe: one thread calls Send, Flush and Receive (as RingAllReduceMean does); the link
// runs one thread of its own that connects and writes what the caller's thread could not.
//
// Lifetime: memory passed to Send must stay unchanged until Flush returns OK (or the link is
// destroyed), since blocks are written from it without a copy.
class TcpRingLink final : public RingLink {
 public:
  // Sends to `next_address` (rank + 1 mod size, the gRPC address: the data connection goes to the
  // same host), receives through `listener` (which must outlive the link). `security`: the gRPC
  // channel's credentials and this rank's token, for OpenData. The destructor waits at most
  // `close_timeout` for the closing frame to reach the kernel (after a failure, not at all: it
  // sends the give-up frame if the socket has room, and resets the connection otherwise).
  TcpRingLink(int rank, int size, const std::string& next_address, TcpRingListener* listener,
              absl::Duration close_timeout = absl::Seconds(10),
              const ClientSecurity& security = ClientSecurity());
  ~TcpRingLink() override;
  TcpRingLink(const TcpRingLink&) = delete;
  TcpRingLink& operator=(const TcpRingLink&) = delete;

  // How long a Receive waiting for bytes polls the socket without sleeping (yielding the core
  // between polls) before it sleeps until they come; zero sleeps at once. The wake-up from a
  // sleep costs tens of microseconds (two context switches, more on a busy host), paid once or
  // twice per block; a short spin skips it whenever the block is that close. Set before the
  // first Receive. kDefaultRingReceiveSpin unless set.
  void SetReceiveSpin(absl::Duration spin) { receive_spin_ = spin; }

  // Waits for the sender thread's connection to the next rank and accepts the previous rank's.
  absl::Status Connect(absl::Time deadline) override;
  absl::Status Send(int64_t tag, absl::Span<const float> data) override;
  absl::Status Flush(absl::Time deadline) override;
  absl::Status Receive(int64_t tag, absl::Span<float> out, Combine combine,
                       absl::Time deadline) override;
  // Polls the connection from the previous rank (accepting it first, within `deadline`).
  absl::StatusOr<bool> Incoming(absl::Time deadline) override;

 private:
  // One frame on its way: the header, then `bytes` of the caller's memory; `sent` counts both.
  struct Frame {
    char header[kRingFrameHeaderBytes];
    const char* data = nullptr;
    size_t bytes = 0;
    size_t sent = 0;
    size_t total() const { return kRingFrameHeaderBytes + bytes; }
  };
  static Frame MakeFrame(int64_t tag, const char* data, size_t bytes);

  void SenderLoop();
  // OpenData, then the TCP connection and the hello. Retries while the next rank is not up.
  absl::StatusOr<int> OpenConnection();
  // Writes what fits of `frame` without blocking (`block` false) or all of it.
  absl::Status Write(int fd, Frame* frame, bool block);
  void SetSendErrorLocked(absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Reads exactly `size` bytes of block `tag` from the previous rank by `deadline`.
  absl::Status ReadFull(char* data, size_t size, int64_t tag, absl::Time deadline);
  // The socket from the previous rank broke (`why`).
  absl::Status IncomingBroke(absl::string_view why);
  // Waits (spinning first, as a read does) until block `tag`'s first bytes are there, the
  // connection ends or `deadline`; while nothing comes it logs a warning every 5 s naming the
  // block, the previous rank and when the receive gives up.
  void AwaitBlock(int64_t tag, absl::Time deadline);
  // The previous rank's give-up frame of `bytes` bytes (instead of block `tag`): its error.
  absl::Status ReadGiveUp(int64_t bytes, int64_t tag, absl::Time deadline);
  absl::Status SendError();
  // Accepts the previous rank's connection by `deadline`, unless it already has been. With
  // DEADLINE_EXCEEDED, `waiting_for` says what for.
  absl::Status AcceptIncoming(absl::Time deadline, absl::string_view waiting_for);
  // Why the sender thread has not connected to the next rank: its error, or else a probe of the
  // next rank's address (taking up to `probe`).
  std::string WhyNotConnected(absl::Duration probe);
  // Reads and drops frames from the previous rank until its closing or give-up frame or
  // `deadline`.
  void DrainIncoming(absl::Time deadline);

  const int rank_;
  const int size_;
  const int next_rank_;
  const int prev_rank_;
  const std::string next_address_;
  TcpRingListener* const listener_;
  const absl::Duration close_timeout_;
  const ClientSecurity security_;

  absl::Mutex mu_;
  std::deque<Frame> queue_ ABSL_GUARDED_BY(mu_);  // The front one may be half written.
  absl::Status send_error_ ABSL_GUARDED_BY(mu_);
  // The next rank's answer to the newest OpenData attempt that failed, while none has succeeded
  // (empty: none failed yet): what a connect timeout reports beside its own probe.
  std::string open_error_ ABSL_GUARDED_BY(mu_);
  // The first error a call returned: the destructor tells the next rank (give-up frame).
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int> out_fd_{-1};  // Set once by the sender thread when connected.
  std::thread sender_;

  // The receiving side, touched only by the caller's thread.
  int in_fd_ = -1;
  absl::Status receive_error_;  // Sticky: after one, the stream is out of step.
  absl::Duration receive_spin_ = kDefaultRingReceiveSpin;
  std::vector<char> piece_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_RING_TCP_H_
