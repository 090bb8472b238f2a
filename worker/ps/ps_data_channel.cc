#include "worker/ps/ps_data_channel.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/data_plane_wire.h"
#include "common/socket_io.h"
#include "grpc/slice.h"
#include "grpcpp/support/slice.h"

namespace rubato {
namespace {

// The answer to a call may come this long after its deadline (the shard's own DEADLINE_EXCEEDED
// answer, on its way).
constexpr absl::Duration kAnswerSlack = absl::Seconds(2);
// The largest status code (UNAUTHENTICATED); anything else on the wire is not a shard's answer.
constexpr int32_t kMaxStatusCode = 16;

}  // namespace

PsDataChannel::~PsDataChannel() {
  std::vector<std::unique_ptr<Connection>> all;
  std::deque<Job> waiting;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& c : connections_) {
      if (const int fd = c->fd.load(); fd >= 0) ::shutdown(fd, SHUT_RDWR);
    }
    all = std::move(connections_);
    waiting = std::move(waiting_);
  }
  for (auto& c : all) {
    c->thread.join();
    if (const int fd = c->fd.load(); fd >= 0) ::close(fd);
  }
  for (Job& job : waiting) {
    job.done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the data channel closed"));
  }
}

void PsDataChannel::Call(int method, const grpc::ByteBuffer* request, absl::Time deadline,
                         grpc::ByteBuffer* response, Done done, PullSink* sink) {
  Job job{method, request, deadline, response, std::move(done), sink};
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      Assign(std::move(job));
      return;
    }
  }
  job.done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the data channel closed"));
}

void PsDataChannel::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;  // Wakes the idle connections' threads, which end (Run).
}

int PsDataChannel::open_connections() const {
  absl::MutexLock lock(&mu_);
  int open = 0;
  for (const auto& c : connections_) open += c->ended ? 0 : 1;
  return open;
}

void PsDataChannel::EndConnection(Connection* c) {
  if (const int fd = c->fd.exchange(-1); fd >= 0) ::close(fd);  // The shard's end sees it close.
  c->socket.reset();
  c->ended = true;
  ++ended_;
}

void PsDataChannel::Assign(Job job) {
  if (!idle_.empty()) {
    Connection* c = idle_.back();
    idle_.pop_back();
    c->job = std::move(job);
    c->has_job = true;
  } else if (static_cast<int>(connections_.size()) - ended_ < kMaxDataConnections) {
    auto c = std::make_unique<Connection>();
    c->job = std::move(job);
    c->has_job = true;
    Connection* raw = c.get();
    connections_.push_back(std::move(c));
    raw->thread = std::thread([this, raw] { Run(raw); });
  } else {
    waiting_.push_back(std::move(job));
  }
}

void PsDataChannel::Run(Connection* c) {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return c->has_job || stopping_ || draining_;
      };
      mu_.Await(absl::Condition(&ready));
      if (!c->has_job) {
        if (!stopping_) {  // Draining: an idle connection ends now.
          idle_.erase(std::find(idle_.begin(), idle_.end(), c));
          EndConnection(c);
        }
        return;
      }
      job = std::move(c->job);
    }
    grpc::Status status;
    if (c->fd.load() < 0) {
      std::unique_ptr<DataSocket> socket;
      status = Open(&socket);
      if (status.ok()) {
        absl::MutexLock lock(&mu_);
        if (stopping_) {
          ::close(socket->fd());
          status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the data channel closed");
        } else {
          c->fd.store(socket->fd());
          c->socket = std::move(socket);
        }
      } else if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
        broken_.store(true);
      }
    }
    if (status.ok()) status = Exchange(c, job);
    bool ended = false;
    {
      absl::MutexLock lock(&mu_);
      c->has_job = false;
      if (!waiting_.empty()) {
        c->job = std::move(waiting_.front());
        waiting_.pop_front();
        c->has_job = true;
      } else if (draining_ && !stopping_) {
        EndConnection(c);
        ended = true;
      } else {
        idle_.push_back(c);
      }
    }
    job.done(std::move(status));
    if (ended) return;
  }
}

grpc::Status PsDataChannel::Open(std::unique_ptr<DataSocket>* socket_out) {
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::StatusOr<int> fd = ConnectTcp(options_.host, options_.port, options_.connect_timeout);
  if (!fd.ok()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("cannot open the data connection to ", options_.description,
                                     " (port ", options_.port, "): ", fd.status().message()));
  }
  SetDataSocketOptions(*fd);
  WatchPeerLiveness(*fd, options_.peer_dead_after);
  auto socket = std::make_unique<DataSocket>(*fd);
  if (options_.tls != nullptr) {
    if (std::string failed = socket->HandshakeAsClient(*options_.tls, options_.host, deadline);
        !failed.empty()) {
      ::close(*fd);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("the data connection to ", options_.description, " (port ",
                                       options_.port, "): ", failed));
    }
  }
  // The server speaks first: its challenge, which the hello answers.
  char challenge[sizeof(kDataChallengeMagic) + kDataChallengeBytes];
  std::string why;
  ReadEnd end = socket->Read(challenge, sizeof(challenge), deadline, &why);
  std::string failed = end == ReadEnd::kDone ? "" : DescribeReadEnd(end, why);
  if (failed.empty() &&
      std::memcmp(challenge, kDataChallengeMagic, sizeof(kDataChallengeMagic)) != 0) {
    ::close(*fd);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("port ", options_.port, " of ", options_.description,
                                     " does not answer as a Rubato data plane"));
  }
  const std::string proof =
      !failed.empty() || !options_.answer_challenge
          ? ""
          : options_.answer_challenge(absl::string_view(
                challenge + sizeof(kDataChallengeMagic), kDataChallengeBytes));
  char hello[16];
  std::memcpy(hello, kDataHelloMagic, sizeof(kDataHelloMagic));
  WireStore<int32_t>(hello + 8, options_.worker_id);
  WireStore<int32_t>(hello + 12, static_cast<int32_t>(proof.size()));
  iovec iov[2] = {{hello, sizeof(hello)}, {const_cast<char*>(proof.data()), proof.size()}};
  if (failed.empty()) failed = socket->Write(iov, 2, deadline);
  char answer[16];
  end = ReadEnd::kError;
  if (failed.empty()) {
    end = socket->Read(answer, sizeof(answer), deadline, &why);
    if (end != ReadEnd::kDone) failed = DescribeReadEnd(end, why);
  }
  if (!failed.empty()) {
    ::close(*fd);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("the data connection to ", options_.description,
                                     " broke during its hello: ", failed));
  }
  const int32_t code = WireLoad<int32_t>(answer);
  const int32_t text_bytes = std::clamp(WireLoad<int32_t>(answer + 4), 0, kDataMaxTextBytes);
  if (code < 0 || code > kMaxStatusCode) {  // Whatever answered is not a Rubato shard.
    ::close(*fd);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("port ", options_.port, " of ", options_.description,
                                     " does not answer as a Rubato data plane"));
  }
  if (code != 0) {
    std::string text(static_cast<size_t>(text_bytes), '\0');
    socket->Read(text.data(), text.size(), deadline, &why);
    ::close(*fd);
    return grpc::Status(static_cast<grpc::StatusCode>(code),
                        absl::StrCat(options_.description, " refused a data connection: ", text));
  }
  *socket_out = std::move(socket);
  return grpc::Status::OK;
}

grpc::Status PsDataChannel::Exchange(Connection* c, const Job& job) {
  const int fd = c->fd.load();
  DataSocket* socket = c->socket.get();
  auto broke = [&](grpc::StatusCode code, const std::string& what) {
    ::shutdown(fd, SHUT_RDWR);
    {
      absl::MutexLock lock(&mu_);
      c->fd.store(-1);
    }
    ::close(fd);
    c->socket.reset();
    return grpc::Status(code,
                        absl::StrCat("the data connection to ", options_.description, " ", what));
  };
  std::vector<grpc::Slice> slices;
  if (!job.request->Dump(&slices).ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "unreadable request");
  }
  int64_t bytes = 0;
  for (const grpc::Slice& s : slices) bytes += static_cast<int64_t>(s.size());
  char header[kDataRequestHeaderBytes] = {};
  WireStore<int32_t>(header, job.method);
  WireStore<int64_t>(header + 8,
                     std::max<int64_t>(0, absl::ToInt64Milliseconds(job.deadline - absl::Now())));
  WireStore<int64_t>(header + 16, bytes);
  std::vector<iovec> iov;
  iov.reserve(1 + slices.size());
  iov.push_back({header, sizeof(header)});
  for (const grpc::Slice& s : slices) iov.push_back({const_cast<uint8_t*>(s.begin()), s.size()});
  if (std::string failed = socket->Write(iov.data(), static_cast<int>(iov.size()), job.deadline);
      !failed.empty()) {
    return broke(absl::Now() >= job.deadline ? grpc::StatusCode::DEADLINE_EXCEEDED
                                             : grpc::StatusCode::UNAVAILABLE,
                 absl::StrCat("broke while sending: ", failed));
  }
  const absl::Time answer_by = job.deadline + kAnswerSlack;
  char answer[kDataResponseHeaderBytes];
  std::string why;
  ReadEnd end = socket->Read(answer, sizeof(answer), answer_by, &why, options_.receive_spin);
  if (end == ReadEnd::kTimedOut) {
    return broke(grpc::StatusCode::DEADLINE_EXCEEDED, "had no answer by the call's deadline");
  }
  if (end != ReadEnd::kDone) {
    return broke(grpc::StatusCode::UNAVAILABLE,
                 absl::StrCat("broke: ", DescribeReadEnd(end, why),
                              " (the shard exited, was killed or lost the connection)"));
  }
  const int32_t code = WireLoad<int32_t>(answer);
  const int64_t size = WireLoad<int64_t>(answer + 8);
  if (size < 0 || size > options_.max_message_bytes + (int64_t{1} << 20) || code < 0 ||
      code > kMaxStatusCode || (code != 0 && size > kDataMaxTextBytes)) {
    return broke(grpc::StatusCode::INTERNAL,
                 absl::StrCat("sent an answer of ", size, " bytes (status ", code, ")"));
  }
  if (code == 0 && job.sink != nullptr) {
    if (const std::string failed = ReadPullInPlace(socket, size, job, answer_by, &end);
        !failed.empty()) {
      return broke(end == ReadEnd::kTimedOut ? grpc::StatusCode::DEADLINE_EXCEEDED
                                             : grpc::StatusCode::UNAVAILABLE,
                   absl::StrCat("broke in an answer: ", failed));
    }
    return grpc::Status::OK;
  }
  grpc::Slice body(grpc_slice_malloc_large(static_cast<size_t>(size)), grpc::Slice::STEAL_REF);
  end = socket->Read(reinterpret_cast<char*>(const_cast<uint8_t*>(body.begin())), body.size(),
                   answer_by, &why, options_.receive_spin);
  if (end != ReadEnd::kDone) {
    return broke(end == ReadEnd::kTimedOut ? grpc::StatusCode::DEADLINE_EXCEEDED
                                           : grpc::StatusCode::UNAVAILABLE,
                 absl::StrCat("broke in an answer: ", DescribeReadEnd(end, why)));
  }
  if (code != 0) {
    return grpc::Status(static_cast<grpc::StatusCode>(code),
                        std::string(reinterpret_cast<const char*>(body.begin()), body.size()));
  }
  *job.response = grpc::ByteBuffer(&body, 1);
  return grpc::Status::OK;
}

namespace {

// The body of one answer, read from a socket through a small buffer (for the few bytes of each
// tensor's header) or straight into a destination (its bytes), remembering everything consumed so
// that an answer of another layout can still be handed back whole (Whole).
class AnswerReader {
 public:
  AnswerReader(DataSocket* socket, int64_t size, absl::Time deadline, absl::Duration spin)
      : socket_(socket), left_(size), deadline_(deadline), spin_(spin) {}

  int64_t left() const { return left_ + static_cast<int64_t>(end_ - at_); }

  bool Byte(uint8_t* b) {
    if (at_ == end_ && !Fill()) return false;
    *b = static_cast<uint8_t>(buffer_[at_++]);
    log_.back().text.push_back(static_cast<char>(*b));
    return true;
  }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // `n` bytes into `to` (buffered ones first), logged as a view of `to`.
  bool Into(char* to, int64_t n) {
    if (n > left()) return false;  // Nothing consumed: the answer can still be handed back whole.
    const int64_t buffered = std::min<int64_t>(n, end_ - at_);
    std::memcpy(to, buffer_ + at_, static_cast<size_t>(buffered));
    at_ += static_cast<size_t>(buffered);
    if (n > buffered && !Read(to + buffered, n - buffered)) return false;
    log_.back().view = absl::string_view(to, static_cast<size_t>(n));
    log_.emplace_back();
    return true;
  }
  // What was consumed, then the rest of the answer, as one slice.
  bool Whole(int64_t size, grpc::ByteBuffer* out) {
    grpc::Slice body(grpc_slice_malloc_large(static_cast<size_t>(size)), grpc::Slice::STEAL_REF);
    char* to = reinterpret_cast<char*>(const_cast<uint8_t*>(body.begin()));
    for (const Piece& p : log_) {
      std::memcpy(to, p.text.data(), p.text.size());
      to += p.text.size();
      if (!p.view.empty()) std::memcpy(to, p.view.data(), p.view.size());
      to += p.view.size();
    }
    const size_t buffered = end_ - at_;
    std::memcpy(to, buffer_ + at_, buffered);
    at_ = end_;
    if (!Read(to + buffered, left_)) return false;
    *out = grpc::ByteBuffer(&body, 1);
    return true;
  }
  ReadEnd end() const { return end_state_; }
  const std::string& why() const { return why_; }

 private:
  struct Piece {
    std::string text;        // Header bytes, in order,
    absl::string_view view;  // then the tensor bytes that followed them.
  };
  bool Fill() {
    const int64_t n = std::min<int64_t>(left_, sizeof(buffer_));
    if (n == 0 || !Read(buffer_, n)) return false;
    at_ = 0;
    end_ = static_cast<size_t>(n);
    return true;
  }
  bool Read(char* to, int64_t n) {
    if (n > left_) return false;
    end_state_ = socket_->Read(to, static_cast<size_t>(n), deadline_, &why_, spin_);
    if (end_state_ != ReadEnd::kDone) return false;
    left_ -= n;
    return true;
  }

  DataSocket* const socket_;
  int64_t left_;  // Not yet read from the socket.
  const absl::Time deadline_;
  const absl::Duration spin_;
  char buffer_[64];
  size_t at_ = 0, end_ = 0;
  std::vector<Piece> log_ = std::vector<Piece>(1);
  ReadEnd end_state_ = ReadEnd::kDone;
  std::string why_;
};

// Reads one tensor of the expected layout into `t`; false (with nothing lost) when it is not so.
bool ReadTensorInPlace(AnswerReader& r, PsDataChannel::PullSink::Tensor& t) {
  uint64_t tag, inner, name_bytes;
  if (!r.Varint(&tag) || tag != 0x0a || !r.Varint(&inner) || inner > uint64_t{1} << 40) {
    return false;
  }
  const int64_t inner_ends = r.left() - static_cast<int64_t>(inner);
  uint8_t b;
  if (!r.Byte(&b) || b != 0x0a || !r.Varint(&name_bytes) || name_bytes != t.name->size()) {
    return false;
  }
  for (char expected : *t.name) {
    if (!r.Byte(&b) || static_cast<char>(b) != expected) return false;
  }
  uint64_t version = 0, data_bytes;
  if (!r.Byte(&b)) return false;
  if (b == 0x18) {
    if (!r.Varint(&version) || version > uint64_t{1} << 62 || !r.Byte(&b)) return false;
  }
  if (b != 0x12 || !r.Varint(&data_bytes) ||
      data_bytes != static_cast<uint64_t>(t.elements) * sizeof(float) ||
      r.left() - static_cast<int64_t>(data_bytes) != inner_ends) {
    return false;
  }
  if (!r.Into(reinterpret_cast<char*>(t.data), static_cast<int64_t>(data_bytes))) return false;
  t.version = static_cast<int64_t>(version);
  return true;
}

}  // namespace

std::string PsDataChannel::ReadPullInPlace(DataSocket* socket, int64_t size, const Job& job,
                                           absl::Time deadline, ReadEnd* end) {
  AnswerReader reader(socket, size, deadline, options_.receive_spin);
  job.sink->stored = false;
  bool in_place = true;
  for (PullSink::Tensor& t : job.sink->tensors) {
    if (!ReadTensorInPlace(reader, t)) {
      in_place = false;
      break;
    }
  }
  if (in_place && reader.left() == 0) {
    job.sink->stored = true;
    return "";
  }
  *end = reader.end();
  if (*end != ReadEnd::kDone) return DescribeReadEnd(*end, reader.why());
  // Another layout: the whole answer, for PsClient's parser.
  if (!reader.Whole(size, job.response)) {
    *end = reader.end();
    return DescribeReadEnd(*end, reader.why());
  }
  return "";
}

}  // namespace rubato
