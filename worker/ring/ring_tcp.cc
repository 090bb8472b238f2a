#include "worker/ring/ring_tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/net_diagnose.h"
#include "common/socket_io.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "proto/ring.grpc.pb.h"
#include "worker/ring/ring_codec.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the ring's wire format is the host's little-endian layout");

namespace rubato {
namespace {

constexpr char kHelloMagic[8] = {'R', 'B', 'R', 'I', 'N', 'G', '1', '\0'};
// How long a connection may take to present its hello before the listener drops it.
constexpr absl::Duration kHelloTimeout = absl::Seconds(2);
// A receive still waiting says so this often.
constexpr absl::Duration kStallReport = absl::Seconds(5);
// Each OpenData attempt while the next rank is not up yet.
constexpr absl::Duration kOpenDataAttempt = absl::Milliseconds(500);
constexpr absl::Duration kConnectTimeout = absl::Seconds(5);
// Received blocks are read in pieces of this size and combined from there (it stays in cache).
constexpr size_t kPieceBytes = 256 * 1024;

void Store64(char* at, int64_t v) { std::memcpy(at, &v, 8); }
int64_t Load64(const char* at) {
  int64_t v;
  std::memcpy(&v, at, 8);
  return v;
}

}  // namespace

// --- TcpRingListener --------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TcpRingListener>> TcpRingListener::Create(const std::string& host,
                                                                         int port, int from_rank) {
  const std::string where = absl::StrCat(host, ":", port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("ring data port ", port, " is not 0..65535"));
  }
  absl::StatusOr<Listening> listening = ListenTcp(host, port, 16);
  if (!listening.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for ring data on ", where,
                     " (the host of this rank's own entry in --peers, which must be an address "
                     "of this host): ", listening.status().message()));
  }
  const int fd = listening->fd, actual = listening->port;
  return std::unique_ptr<TcpRingListener>(new TcpRingListener(fd, actual, from_rank));
}

TcpRingListener::~TcpRingListener() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

absl::StatusOr<std::string> TcpRingListener::IssueTicket() {
  std::string ticket(kRingTicketBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(ticket.data()), kRingTicketBytes) != 1) {
    return absl::InternalError("no random bytes for a ring data ticket (OpenSSL RAND_bytes)");
  }
  absl::MutexLock lock(&mu_);
  tickets_.push_back(ticket);
  if (tickets_.size() > kRingOutstandingTickets) tickets_.pop_front();
  return ticket;
}

absl::Status TcpRingListener::CheckHello(const char* hello) {
  if (std::memcmp(hello, kHelloMagic, sizeof(kHelloMagic)) != 0) {
    return absl::InvalidArgumentError("it is not a Rubato ring data connection");
  }
  int32_t from;
  std::memcpy(&from, hello + 8, 4);
  if (from != from_rank_) {
    return absl::PermissionDeniedError(absl::StrCat(
        "it says it is rank ", from, ", but this rank receives from rank ", from_rank_, " only"));
  }
  absl::MutexLock lock(&mu_);
  bool match = false;
  for (const std::string& ticket : tickets_) {  // Every one compared, each in constant time.
    match |= CRYPTO_memcmp(hello + 16, ticket.data(), kRingTicketBytes) == 0;
  }
  if (!match) return absl::PermissionDeniedError("its ticket is not one OpenData issued");
  tickets_.clear();
  return absl::OkStatus();
}

absl::StatusOr<int> TcpRingListener::Accept(absl::Time deadline) {
  if (listen_fd_ < 0) {
    return absl::FailedPreconditionError("the ring data listener already accepted its connection");
  }
  for (;;) {
    pollfd p{listen_fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, PollMillis(deadline));
    if (ready == 0 && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rank ", from_rank_, " did not open its data connection"));
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // EAGAIN after a spurious wake-up, EINTR, ECONNABORTED: wait on.
    char hello[kRingHelloBytes];
    std::string why;
    // Its own timeout, not the caller's deadline.
    const ReadEnd end = ReadWithin(fd, hello, sizeof(hello), absl::Now() + kHelloTimeout, &why);
    absl::Status ok =
        end == ReadEnd::kDone
            ? CheckHello(hello)
            : absl::InvalidArgumentError(absl::StrCat("no hello: ", DescribeReadEnd(end, why)));
    if (!ok.ok()) {
      RUBATO_LOG(WARNING) << "refused a ring data connection from " << PeerName(addr) << ": "
                          << ok.message();
      ::close(fd);
      continue;
    }
    SetDataSocketOptions(fd);
    ::close(listen_fd_);
    listen_fd_ = -1;
    return fd;
  }
}

// --- TcpRingLink ------------------------------------------------------------------------------

TcpRingLink::TcpRingLink(int rank, int size, const std::string& next_address,
                         TcpRingListener* listener, absl::Duration close_timeout,
                         const ClientSecurity& security)
    : rank_(rank),
      size_(size),
      next_rank_((rank + 1) % size),
      prev_rank_((rank + size - 1) % size),
      next_address_(next_address),
      listener_(listener),
      close_timeout_(close_timeout),
      security_(security),
      piece_(kPieceBytes) {
  sender_ = std::thread([this] { SenderLoop(); });
}

TcpRingLink::~TcpRingLink() {
  const absl::Time deadline = absl::Now() + close_timeout_;
  bool orderly = false, told = false;
  {
    absl::MutexLock lock(&mu_);
    const int out = out_fd_.load();
    orderly = failure_.ok() && send_error_.ok() && out >= 0;
    if (orderly) {
      queue_.push_back(MakeFrame(kRingClosingTag, nullptr, 0));
      auto sent = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return queue_.empty() || !send_error_.ok();
      };
      orderly = mu_.AwaitWithDeadline(absl::Condition(&sent), deadline) && send_error_.ok();
    } else if (!failure_.ok() && send_error_.ok() && out >= 0 && queue_.empty()) {
      // This rank gives up: tell the next one why, so that its error names the cause, not this
      // rank. Only between frames (the sender thread is idle while the queue is empty).
      const int32_t code = static_cast<int32_t>(failure_.code());
      std::string note(reinterpret_cast<const char*>(&code), sizeof(code));
      note += std::string(failure_.message().substr(0, kRingGiveUpTextBytes));
      Frame frame = MakeFrame(kRingGiveUpTag, note.data(), note.size());
      told = Write(out, &frame, /*block=*/false).ok() && frame.sent == frame.total();
    }
    stopping_ = true;
  }
  int out = out_fd_.load();
  if (out >= 0) {
    if (!orderly && !told) {
      // Reset rather than deliver what is left: the ring is broken.
      linger reset{1, 0};
      ::setsockopt(out, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    }
    // Wakes a sender blocked in a write; a note or the closing frame is delivered before the FIN.
    ::shutdown(out, orderly || told ? SHUT_WR : SHUT_RDWR);
  }
  sender_.join();
  out = out_fd_.load();  // It may have connected after the load above (then it wrote nothing).
  // Read what the previous rank sent after its last block (its closing frame, if it came), so that
  // closing does not reset its connection. Nothing more is needed from it, so do not wait.
  if (orderly && in_fd_ >= 0 && receive_error_.ok()) DrainIncoming(absl::Now());
  if (in_fd_ >= 0) ::close(in_fd_);
  if (out >= 0) ::close(out);
}

TcpRingLink::Frame TcpRingLink::MakeFrame(int64_t tag, const char* data, size_t bytes) {
  Frame frame;
  Store64(frame.header, tag);
  Store64(frame.header + 8, static_cast<int64_t>(bytes));
  frame.data = data;
  frame.bytes = bytes;
  return frame;
}

absl::Status TcpRingLink::Write(int fd, Frame* frame, bool block) {
  while (frame->sent < frame->total()) {
    iovec iov[2];
    int count = 0;
    if (frame->sent < kRingFrameHeaderBytes) {
      iov[count++] = {frame->header + frame->sent, kRingFrameHeaderBytes - frame->sent};
      if (frame->bytes > 0) iov[count++] = {const_cast<char*>(frame->data), frame->bytes};
    } else {
      const size_t done = frame->sent - kRingFrameHeaderBytes;
      iov[count++] = {const_cast<char*>(frame->data) + done, frame->bytes - done};
    }
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = count;
    const ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (n > 0) {
      frame->sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && !block && (errno == EAGAIN || errno == EWOULDBLOCK)) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("all-reduce data connection to rank ", next_rank_, " at ", next_address_,
                     " broke: ", n < 0 ? std::strerror(errno) : "nothing written",
                     " (the rank exited, was killed or lost the connection)"));
  }
  return absl::OkStatus();
}

void TcpRingLink::SetSendErrorLocked(absl::Status error) {
  if (!send_error_.ok()) return;
  // The queue stays: the sender thread may still be writing its front frame.
  send_error_ = std::move(error);
}

absl::StatusOr<int> TcpRingLink::OpenConnection() {
  // While the next rank does not answer, the channel is made anew every kStallReport, with a
  // subchannel of its own: a fresh name resolution and connection rather than one stuck in
  // gRPC's state (a CI run once saw 30 s of failed attempts to a rank that was listening).
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<RingPeer::Stub> stub;
  const absl::Time start = absl::Now();
  absl::Time renew = start;
  int64_t failed = 0;
  OpenDataReply reply;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::CancelledError("the link closed before it connected");
    }
    if (absl::Now() >= renew) {
      grpc::ChannelArguments args = RubatoChannelArguments(kDefaultMaxMessageBytes);
      if (channel != nullptr) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      channel = grpc::CreateCustomChannel(next_address_, security_.credentials(), args);
      stub = RingPeer::NewStub(channel);
      renew = absl::Now() + kStallReport;
    }
    // A channel in TRANSIENT_FAILURE fails the call at once with gRPC's reason for it (the
    // connect error); otherwise the call waits for the channel, up to kOpenDataAttempt.
    const grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
    const absl::Time attempt_end = absl::Now() + kOpenDataAttempt;
    grpc::ClientContext context;
    context.set_wait_for_ready(state != GRPC_CHANNEL_TRANSIENT_FAILURE);
    context.set_deadline(absl::ToChronoTime(attempt_end));
    security_.Attach(&context);
    OpenDataRequest request;
    request.set_from_rank(rank_);
    const grpc::Status status = stub->OpenData(&context, request, &reply);
    if (status.ok()) break;
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // Not up yet: wait on, as a gRPC stream would, saying so every kStallReport.
      const std::string why = absl::StrCat(FromGrpcStatus(status).ToString(), " (channel ",
                                           ChannelStateName(state), ")");
      absl::MutexLock lock(&mu_);
      open_error_ = why;
      // The rest of the attempt's time, unless the link closes.
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), attempt_end);
      if (++failed % (kStallReport / kOpenDataAttempt) == 0) {
        RUBATO_LOG(WARNING) << "ring rank " << rank_ << ": rank " << next_rank_ << " at "
                            << next_address_ << " has not answered OpenData for "
                            << absl::FormatDuration(
                                   absl::Trunc(absl::Now() - start, absl::Seconds(1)))
                            << "; the newest attempt: " << why;
      }
      continue;
    }
    const absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(),
                        absl::StrCat("all-reduce: rank ", next_rank_, " at ", next_address_,
                                     " refused a data connection: ", s.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    open_error_.clear();
  }
  if (reply.port() <= 0 || reply.port() > 65535 || reply.ticket().size() != kRingTicketBytes) {
    return absl::InternalError(absl::StrCat("all-reduce: rank ", next_rank_, " at ", next_address_,
                                            " answered OpenData with port ", reply.port(),
                                            " and a ", reply.ticket().size(), "-byte ticket"));
  }
  std::string host, ignored_port;
  if (!SplitHostPort(next_address_, &host, &ignored_port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce: '", next_address_, "' is not host:port"));
  }
  const std::string data_address = absl::StrCat(
      host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host, ":", reply.port());
  absl::StatusOr<int> connected = ConnectTcp(host, reply.port(), kConnectTimeout);
  if (!connected.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "all-reduce: cannot open the data connection to rank ", next_rank_, " at ", data_address,
        ": ", connected.status().message(),
        " (its gRPC port answers, so a firewall may let that port through but not "
        "this one: set --ring_data_port on that rank and open it, or use --ring_transport=grpc)"));
  }
  const int fd = *connected;
  SetDataSocketOptions(fd);
  char hello[kRingHelloBytes] = {};
  std::memcpy(hello, kHelloMagic, sizeof(kHelloMagic));
  const int32_t from = rank_, size = size_;
  std::memcpy(hello + 8, &from, 4);
  std::memcpy(hello + 12, &size, 4);
  std::memcpy(hello + 16, reply.ticket().data(), kRingTicketBytes);
  iovec iov{hello, sizeof(hello)};
  if (const std::string why = WriteWithin(fd, &iov, 1, absl::Now() + kHelloTimeout); !why.empty()) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("all-reduce: the data connection to rank ",
                                               next_rank_, " at ", data_address,
                                               " broke during its hello: ", why));
  }
  // Blocking from here on: only this thread writes, and the destructor's shutdown() wakes it.
  ::fcntl(fd, F_SETFL, 0);
  return fd;
}

void TcpRingLink::SenderLoop() {
  absl::StatusOr<int> fd = OpenConnection();
  {
    absl::MutexLock lock(&mu_);
    if (!fd.ok()) {
      SetSendErrorLocked(fd.status());
      return;
    }
    out_fd_.store(*fd);  // The destructor closes it.
  }
  for (;;) {
    Frame frame;
    {
      absl::MutexLock lock(&mu_);
      auto work = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || stopping_ || !send_error_.ok();
      };
      mu_.Await(absl::Condition(&work));
      // Stopping: the destructor has waited for the queue to empty, or gave up on it.
      if (queue_.empty() || stopping_ || !send_error_.ok()) return;
      // A copy: the front stays queued (the caller's thread writes only while the queue is
      // empty) and unchanged (Flush reads it) until it is written.
      frame = queue_.front();
    }
    absl::Status written = Write(*fd, &frame, /*block=*/true);
    absl::MutexLock lock(&mu_);
    if (!written.ok()) {
      SetSendErrorLocked(stopping_ ? absl::CancelledError("the link closed") : written);
      return;
    }
    queue_.pop_front();
  }
}

absl::Status TcpRingLink::SendError() {
  absl::MutexLock lock(&mu_);
  return send_error_;
}

std::string TcpRingLink::WhyNotConnected(absl::Duration probe) {
  std::string open_error;
  {
    absl::MutexLock lock(&mu_);
    if (!send_error_.ok()) return std::string(send_error_.message());
    open_error = open_error_;
  }
  return absl::StrCat(DiagnoseEndpoint(next_address_, probe).detail,
                      open_error.empty() ? "" : "; its newest OpenData attempt: ", open_error);
}

absl::Status TcpRingLink::AcceptIncoming(absl::Time deadline, absl::string_view waiting_for) {
  if (in_fd_ >= 0) return absl::OkStatus();
  absl::StatusOr<int> fd = listener_->Accept(deadline);
  if (absl::IsDeadlineExceeded(fd.status())) {
    return absl::DeadlineExceededError(absl::StrCat(
        "all-reduce timed out waiting for ", waiting_for, " from rank ", prev_rank_, ": ",
        fd.status().message(),
        out_fd_.load() >= 0
            ? ""
            : absl::StrCat("; this rank could not connect to the next, rank ", next_rank_, " at ",
                           next_address_, " either: ", WhyNotConnected(absl::Seconds(2)))));
  }
  if (!fd.ok()) return fd.status();
  in_fd_ = *fd;
  return absl::OkStatus();
}

absl::Status TcpRingLink::Connect(absl::Time deadline) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto connected = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return out_fd_.load() >= 0 || !send_error_.ok();
    };
    if (mu_.AwaitWithDeadline(absl::Condition(&connected), deadline)) status = send_error_;
  }
  if (status.ok() && out_fd_.load() < 0) {
    status = absl::DeadlineExceededError(absl::StrCat("all-reduce timed out connecting to rank ",
                                                      next_rank_, " at ", next_address_, ": ",
                                                      WhyNotConnected(absl::Seconds(1))));
  }
  if (status.ok()) status = AcceptIncoming(deadline, "the ring's data connection");
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = status;
  }
  return status;
}

absl::Status TcpRingLink::Send(int64_t tag, absl::Span<const float> data) {
  absl::MutexLock lock(&mu_);
  if (!send_error_.ok()) {
    if (failure_.ok()) failure_ = send_error_;
    return send_error_;
  }
  Frame frame = MakeFrame(tag, reinterpret_cast<const char*>(data.data()), data.size() * 4);
  const int fd = out_fd_.load();
  if (fd >= 0 && queue_.empty()) {
    // Most blocks fit in the socket's buffer at once: no hand-off to the sender thread.
    if (absl::Status s = Write(fd, &frame, /*block=*/false); !s.ok()) {
      SetSendErrorLocked(s);
      if (failure_.ok()) failure_ = s;
      return s;
    }
    if (frame.sent == frame.total()) return absl::OkStatus();
  }
  queue_.push_back(frame);
  return absl::OkStatus();
}

absl::Status TcpRingLink::Flush(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto sent = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.empty() || !send_error_.ok();
  };
  absl::Status status = send_error_;
  if (!mu_.AwaitWithDeadline(absl::Condition(&sent), deadline)) {
    if (out_fd_.load() < 0) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "all-reduce timed out connecting to rank ", next_rank_, " at ", next_address_, ": ",
          DiagnoseEndpoint(next_address_, absl::Seconds(1)).detail,
          open_error_.empty() ? "" : "; its newest OpenData attempt: ", open_error_));
    } else {
      size_t left = 0;
      for (const Frame& f : queue_) left += f.total() - f.sent;
      status = absl::DeadlineExceededError(
          absl::StrCat("all-reduce timed out sending to rank ", next_rank_, " at ", next_address_,
                       ": up to ", left, " bytes not taken (the rank stopped reading)"));
    }
  } else {
    status = send_error_;
  }
  if (!status.ok() && failure_.ok()) failure_ = status;
  return status;
}

absl::Status TcpRingLink::ReadFull(char* data, size_t size, int64_t tag, absl::Time deadline) {
  // Only the previous rank can end this wait (or the deadline): if the next rank died, the ranks
  // in between give up one after the other, each telling its next why, until the previous rank
  // does, which takes milliseconds (see TcpRingLink in the header).
  std::string why;
  switch (ReadWithin(in_fd_, data, size, deadline, &why, receive_spin_)) {
    case ReadEnd::kDone:
      return absl::OkStatus();
    case ReadEnd::kClosed:
      return IncomingBroke(
          "the connection ended without its closing frame (the rank exited, was killed, gave up "
          "or lost the connection)");
    case ReadEnd::kError:
      return IncomingBroke(why);
    case ReadEnd::kTimedOut:
      break;
  }
  return absl::DeadlineExceededError(
      absl::StrCat("all-reduce timed out waiting for block ", tag, " from rank ", prev_rank_));
}

void TcpRingLink::AwaitBlock(int64_t tag, absl::Time deadline) {
  // The usual case: it comes while the receive spins, as ReadWithin would.
  if (SpinUntilReadable(in_fd_, std::min(deadline, absl::Now() + receive_spin_))) return;
  const absl::Time began = absl::Now();
  for (;;) {
    pollfd p{in_fd_, POLLIN, 0};
    const absl::Time report = std::min(deadline, absl::Now() + kStallReport);
    if (::poll(&p, 1, PollMillis(report)) != 0) return;  // Bytes, an end, or an error.
    const absl::Time now = absl::Now();
    if (now >= deadline) return;
    RUBATO_LOG(WARNING) << "all-reduce stalled: waiting "
                        << absl::FormatDuration(absl::Trunc(now - began, absl::Seconds(1)))
                        << " for block " << tag << " from rank " << prev_rank_
                        << " (its data connection is open; nothing has come); giving up in "
                        << absl::FormatDuration(absl::Trunc(deadline - now, absl::Seconds(1)));
  }
}

absl::Status TcpRingLink::IncomingBroke(absl::string_view why) {
  return absl::UnavailableError(
      absl::StrCat("all-reduce: the data connection from rank ", prev_rank_, " broke: ", why));
}

absl::StatusOr<bool> TcpRingLink::Incoming(absl::Time deadline) {
  if (!receive_error_.ok()) return receive_error_;
  if (in_fd_ < 0) {  // Not connected yet (Connect accepts it): no block can have come.
    absl::StatusOr<int> fd = listener_->Accept(deadline);
    if (absl::IsDeadlineExceeded(fd.status())) return false;
    if (!fd.ok()) return fd.status();
    in_fd_ = *fd;
  }
  pollfd p{in_fd_, POLLIN, 0};
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
  const timespec wait = absl::ToTimespec(left);
  const int ready = ::ppoll(&p, 1, &wait, nullptr);
  if (ready < 0 && errno != EINTR) {
    return IncomingBroke(absl::StrCat("poll: ", std::strerror(errno)));
  }
  return ready > 0;  // Bytes, an end, or an error: the next Receive tells which.
}

absl::Status TcpRingLink::Receive(int64_t tag, absl::Span<float> out, Combine combine,
                                  absl::Time deadline) {
  if (!receive_error_.ok()) return receive_error_;
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(AcceptIncoming(deadline, absl::StrCat("block ", tag)));
    char header[kRingFrameHeaderBytes];
    AwaitBlock(tag, deadline);
    if (absl::Status s = ReadFull(header, sizeof(header), tag, deadline); !s.ok()) return s;
    const int64_t got = Load64(header);
    const int64_t bytes = Load64(header + 8);
    if (got == kRingClosingTag) {
      return absl::UnavailableError(absl::StrCat("all-reduce: rank ", prev_rank_,
                                                 " closed its link before sending block ", tag));
    }
    if (got == kRingGiveUpTag) return ReadGiveUp(bytes, tag, deadline);
    if (got != tag) {
      return absl::InvalidArgumentError(absl::StrCat("ring block ", got, " from rank ", prev_rank_,
                                                     " came when block ", tag,
                                                     " was expected (repeated or out of order)"));
    }
    if (bytes != static_cast<int64_t>(out.size() * sizeof(float))) {
      return absl::InvalidArgumentError(absl::StrCat("ring block ", tag, " from rank ", prev_rank_,
                                                     " has ", bytes, " bytes, expected ",
                                                     out.size() * sizeof(float)));
    }
    bool finite = true;
    for (size_t at = 0; at < out.size();) {
      const size_t n = std::min(out.size() - at, kPieceBytes / sizeof(float));
      if (absl::Status s = ReadFull(piece_.data(), n * sizeof(float), tag, deadline); !s.ok()) {
        return s;
      }
      finite &= CombineFiniteFloats(piece_.data(), out.subspan(at, n), combine);
      at += n;
    }
    if (!finite) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring block ", tag, " from rank ", prev_rank_, " holds a non-finite value"));
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    receive_error_ = status;
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = status;
  }
  return status;
}

absl::Status TcpRingLink::ReadGiveUp(int64_t bytes, int64_t tag, absl::Time deadline) {
  if (bytes < 4 || bytes > static_cast<int64_t>(4 + kRingGiveUpTextBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", prev_rank_, " gave up with a ", bytes,
                                                   "-byte note (4 to ", 4 + kRingGiveUpTextBytes,
                                                   " allowed)"));
  }
  std::string note(static_cast<size_t>(bytes), '\0');
  RETURN_IF_ERROR(ReadFull(note.data(), note.size(), tag, deadline));
  int32_t code;
  std::memcpy(&code, note.data(), 4);
  if (code <= 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int32_t>(absl::StatusCode::kUnknown);
  }
  std::string text = note.substr(4);
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';  // Printable in a log line.
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat("all-reduce: rank ", prev_rank_, " gave up: ", text));
}

void TcpRingLink::DrainIncoming(absl::Time deadline) {
  char header[kRingFrameHeaderBytes];
  std::string why;
  while (ReadWithin(in_fd_, header, sizeof(header), deadline, &why) == ReadEnd::kDone) {
    if (Load64(header) < 0) return;  // Closing or give-up: the last frame.
    int64_t left = Load64(header + 8);
    while (left > 0) {
      const size_t n = std::min<size_t>(left, piece_.size());
      if (ReadWithin(in_fd_, piece_.data(), n, deadline, &why) != ReadEnd::kDone) return;
      left -= static_cast<int64_t>(n);
    }
  }
}

}  // namespace rubato
