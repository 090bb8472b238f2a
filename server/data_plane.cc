#include "server/data_plane.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/socket_io.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/parameter_service.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the data plane's wire format is the host's little-endian layout");

namespace rubato {
namespace {

constexpr absl::Duration kHelloTimeout = absl::Seconds(5);
constexpr absl::Duration kBodyTimeout = absl::Seconds(60);
constexpr absl::Duration kWriteTimeout = absl::Seconds(60);
// The longest timeout a request may ask for (the shard caps its waits further).
constexpr int64_t kMaxTimeoutMs = int64_t{24} * 3600 * 1000;

// What the shard answered: filled by its callback, on whichever thread, and waited for by the
// connection's thread. Shared, so that a callback after the connection gave up still finds it.
struct Answer {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  grpc::ByteBuffer body ABSL_GUARDED_BY(mu);

  void Set(absl::Status s, grpc::ByteBuffer b) {
    absl::MutexLock lock(&mu);
    status = std::move(s);
    body = std::move(b);
    done = true;
  }
};

// A received request body, owned for as long as the shard holds views into it.
// Its bytes count against the server's budget until it is freed, which may be after the server
// is gone (the shard may hold it), hence the shared counter.
struct Body {
  Body(size_t n, int worker, std::shared_ptr<DataBodyBytes> budget_used)
      : bytes(new char[n > 0 ? n : 1]), size(n), worker(worker), used(std::move(budget_used)) {}
  ~Body() {
    used->total.fetch_sub(static_cast<int64_t>(size));
    used->per_worker[worker].fetch_sub(static_cast<int64_t>(size));
  }
  Body(const Body&) = delete;
  Body& operator=(const Body&) = delete;

  std::unique_ptr<char[]> bytes;
  const size_t size;
  const int worker;
  const std::shared_ptr<DataBodyBytes> used;
  WirePush push;
};

// Each worker's share of the body budget (DataPlaneOptions::num_workers).
int64_t PerWorkerBudget(const DataPlaneOptions& o) {
  const int64_t workers = std::max(o.num_workers, 1);
  return std::max(o.memory_budget_bytes / workers,
                  std::min(o.memory_budget_bytes / 2, o.max_message_bytes));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(
    const DataPlaneOptions& options, ParameterShard* shard, ServerSecurity security) {
  const std::string host = options.host == "0.0.0.0" ? "" : options.host;
  absl::StatusOr<Listening> listening = ListenTcp(host, options.port, 128);
  if (!listening.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot listen for Push and Pull data on ",
                                               options.host, ":", options.port, ": ",
                                               listening.status().message()));
  }
  return std::unique_ptr<DataPlaneServer>(
      new DataPlaneServer(options, shard, std::move(security), listening->fd, listening->port));
}

DataPlaneServer::DataPlaneServer(const DataPlaneOptions& options, ParameterShard* shard,
                                 ServerSecurity security, int listen_fd, int port)
    : options_(options),
      shard_(shard),
      security_(std::move(security)),
      listen_fd_(listen_fd),
      port_(port),
      body_bytes_(std::make_shared<DataBodyBytes>(std::max(options.num_workers, 1))),
      per_worker_budget_(PerWorkerBudget(options)) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

DataPlaneServer::~DataPlaneServer() {
  stopping_.store(true);
  acceptor_.join();
  ::close(listen_fd_);
  std::list<std::unique_ptr<Connection>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& c : connections_) ::shutdown(c->socket->fd(), SHUT_RDWR);  // Wakes its reads and writes.
    all = std::move(connections_);
  }
  for (auto& c : all) {
    c->thread.join();
    ::close(c->socket->fd());
  }
}

int64_t DataPlaneServer::body_bytes() const { return body_bytes_->total.load(); }

int DataPlaneServer::connections() const {
  absl::MutexLock lock(&mu_);
  int open = 0;
  for (const auto& c : connections_) open += c->ended.load() ? 0 : 1;
  return open;
}

void DataPlaneServer::Reap() {
  std::list<std::unique_ptr<Connection>> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->ended.load()) {
        ended.push_back(std::move(*it));
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : ended) {
    c->thread.join();
    ::close(c->socket->fd());
  }
}

void DataPlaneServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) {
      Reap();
      continue;
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // EAGAIN, EINTR, ECONNABORTED: wait on.
    Reap();
    absl::MutexLock lock(&mu_);
    if (!Admit(PeerName(addr))) {
      ::close(fd);
      continue;
    }
    SetDataSocketOptions(fd);
    WatchPeerLiveness(fd, options_.peer_dead_after);
    auto connection = std::make_unique<Connection>();
    connection->socket = std::make_unique<DataSocket>(fd);
    connection->peer = PeerName(addr);
    Connection* raw = connection.get();
    connections_.push_back(std::move(connection));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
}

bool DataPlaneServer::Admit(const std::string& peer) {
  int authenticated = 0;
  Connection* oldest_pending = nullptr;
  int pending = 0;
  for (const auto& c : connections_) {
    if (c->ended.load()) continue;
    if (c->authenticated) {
      ++authenticated;
    } else {
      ++pending;
      if (oldest_pending == nullptr) oldest_pending = c.get();  // The list is in accept order.
    }
  }
  if (authenticated >= options_.max_connections) {
    RUBATO_LOG(WARNING) << "refused a data connection from " << peer << ": "
                        << options_.max_connections << " authenticated ones are open already";
    return false;
  }
  if (pending >= options_.max_pending_hellos && oldest_pending != nullptr) {
    // Its thread sees the end in its hello and ends; Reap joins it.
    ::shutdown(oldest_pending->socket->fd(), SHUT_RDWR);
    oldest_pending->ended.store(true);
    const int64_t now_s = absl::ToUnixSeconds(absl::Now());
    if (eviction_said_ != now_s) {  // At most once a second.
      eviction_said_ = now_s;
      RUBATO_LOG(WARNING) << options_.max_pending_hellos
                          << " data connections have not said hello yet: closed the oldest ("
                          << oldest_pending->peer << ") for one from " << peer;
    }
  }
  return true;
}

absl::Status DataPlaneServer::ReserveBody(int worker, int64_t bytes) {
  std::atomic<int64_t>& mine = body_bytes_->per_worker[worker];
  if (mine.fetch_add(bytes) + bytes > per_worker_budget_) {
    mine.fetch_sub(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ", bytes, "-byte request would take worker ", worker, "'s requests in flight past its ",
        per_worker_budget_ >> 10, " KiB share of the data plane's ",
        options_.memory_budget_bytes >> 20,
        " MiB memory budget (--memory_budget_mb, shared by the job's workers); retry later"));
  }
  if (body_bytes_->total.fetch_add(bytes) + bytes > options_.memory_budget_bytes) {
    body_bytes_->total.fetch_sub(bytes);
    mine.fetch_sub(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("a ", bytes, "-byte request would take the server's data plane past its ",
                     options_.memory_budget_bytes >> 20,
                     " MiB memory budget (--memory_budget_mb); retry later"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> DataPlaneServer::Hello(Connection* c) {
  const absl::Time deadline = absl::Now() + kHelloTimeout;
  if (const TlsContext* tls = security_.data_tls().get(); tls != nullptr) {
    // Within the hello's time: a connection is not authenticated until its hello is.
    if (std::string failed = c->socket->HandshakeAsServer(*tls, deadline); !failed.empty()) {
      c->handshake_failed = true;
      return absl::UnauthenticatedError(failed);
    }
  }
  ASSIGN_OR_RETURN(const std::string challenge, NewChallenge());
  char opening[sizeof(kDataChallengeMagic)];
  std::memcpy(opening, kDataChallengeMagic, sizeof(opening));
  iovec out[2] = {{opening, sizeof(opening)},
                  {const_cast<char*>(challenge.data()), challenge.size()}};
  if (std::string failed = c->socket->Write(out, 2, deadline); !failed.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no challenge sent: ", failed));
  }
  char hello[16];
  std::string why;
  ReadEnd end = c->socket->Read(hello, sizeof(hello), deadline, &why);
  if (end != ReadEnd::kDone) {
    return absl::InvalidArgumentError(absl::StrCat("no hello: ", DescribeReadEnd(end, why)));
  }
  if (std::memcmp(hello, kDataHelloMagic, sizeof(kDataHelloMagic)) != 0) {
    return absl::InvalidArgumentError(
        "it is not a Rubato data connection (or a worker of another Rubato version)");
  }
  const int32_t worker = WireLoad<int32_t>(hello + 8);
  const int32_t answer_bytes = WireLoad<int32_t>(hello + 12);
  if (answer_bytes < 0 || answer_bytes > kDataMaxAnswerBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a hello with an answer of ", answer_bytes,
                                                   " bytes (at most ", kDataMaxAnswerBytes, ")"));
  }
  if (worker < 0 || worker >= kMaxWorkers || worker >= options_.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("a hello from worker ", worker, " (the job has ",
                                                   options_.num_workers, ")"));
  }
  std::string answer(static_cast<size_t>(answer_bytes), '\0');
  end = c->socket->Read(answer.data(), answer.size(), deadline, &why);
  if (end != ReadEnd::kDone) {
    return absl::InvalidArgumentError(absl::StrCat("no answer: ", DescribeReadEnd(end, why)));
  }
  RETURN_IF_ERROR(security_.CheckHello(worker, challenge, answer));
  absl::MutexLock lock(&mu_);
  int& open = per_worker_[worker];
  if (open >= kMaxConnectionsPerWorker) {
    return absl::ResourceExhaustedError(absl::StrCat("worker ", worker, " has ", open,
                                                     " data connections open already (at most ",
                                                     kMaxConnectionsPerWorker, ")"));
  }
  ++open;
  c->authenticated = true;
  return worker;
}

namespace {

// Writes a status code and a body (the answer's slices, or an error's text) as one response.
std::string WriteResponse(DataSocket* socket, const absl::Status& status,
                          const grpc::ByteBuffer* body) {
  std::vector<grpc::Slice> slices;
  std::string text;
  if (status.ok()) {
    if (body != nullptr && body->Valid() && !body->Dump(&slices).ok()) slices.clear();
  } else {
    text = std::string(status.message().substr(0, kDataMaxTextBytes));
  }
  int64_t bytes = static_cast<int64_t>(text.size());
  for (const grpc::Slice& s : slices) bytes += static_cast<int64_t>(s.size());
  char header[kDataResponseHeaderBytes] = {};
  WireStore<int32_t>(header, static_cast<int32_t>(status.code()));
  WireStore<int64_t>(header + 8, bytes);
  std::vector<iovec> iov;
  iov.reserve(2 + slices.size());
  iov.push_back({header, sizeof(header)});
  if (!text.empty()) iov.push_back({text.data(), text.size()});
  for (const grpc::Slice& s : slices) {
    iov.push_back({const_cast<uint8_t*>(s.begin()), s.size()});
  }
  return socket->Write(iov.data(), static_cast<int>(iov.size()), absl::Now() + kWriteTimeout);
}

// The refusal of a request whose header is out of bounds (OK if it is within them): an unknown
// method, a negative timeout, or a body over the job's message limit.
absl::Status CheckRequestHeader(int32_t method, int64_t timeout_ms, int64_t bytes,
                                int64_t max_message_bytes) {
  if (method != static_cast<int32_t>(DataMethod::kPush) &&
      method != static_cast<int32_t>(DataMethod::kPull)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown data method ", method));
  }
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("a negative timeout, ", timeout_ms, " ms"));
  }
  if (bytes < 0 || bytes > max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ", bytes, "-byte request; this job's limit is ", max_message_bytes, " bytes"));
  }
  return absl::OkStatus();
}


// Parses a push and hands it to the shard, which then holds *body and answers into `answer`; a
// malformed push, or one for another worker, is answered at once and *body left in place.
void DispatchPush(ParameterShard* shard, std::shared_ptr<Body>* body, int worker,
                  const std::string& who, const std::shared_ptr<Answer>& answer) {
  const absl::string_view whole((*body)->bytes.get(), (*body)->size);
  absl::Status s = ParsePushRequest(ByteChunks(whole), kMaxTensors, &(*body)->push);
  if (s.ok() && (*body)->push.worker_id != worker) {
    s = absl::PermissionDeniedError(absl::StrCat("a push for worker ", (*body)->push.worker_id,
                                                 " on ", who, "; a worker can act only as itself"));
  }
  if (!s.ok()) {
    answer->Set(s, grpc::ByteBuffer());
    return;
  }
  WirePush push = std::move((*body)->push);  // Its bytes stay in `body`, which the shard holds.
  shard->Push(std::move(push), std::move(*body), [answer](absl::StatusOr<PushResponse> result) {
    if (result.ok()) {
      answer->Set(absl::OkStatus(), SerializedMessage(*result));
    } else {
      answer->Set(result.status(), grpc::ByteBuffer());
    }
  });
}

// Parses a pull and hands it to the shard, which answers into `answer` by `deadline`; a malformed
// pull, or one for another worker, is answered at once.
void DispatchPull(ParameterShard* shard, absl::string_view whole, int worker,
                  const std::string& who, absl::Time deadline,
                  const std::shared_ptr<Answer>& answer) {
  PullRequest pull;
  if (!pull.ParseFromArray(whole.data(), static_cast<int>(whole.size()))) {
    answer->Set(absl::InvalidArgumentError("malformed PullRequest"), grpc::ByteBuffer());
  } else if (pull.worker_id() != worker) {
    answer->Set(
        absl::PermissionDeniedError(absl::StrCat("a pull for worker ", pull.worker_id(), " on ",
                                                 who, "; a worker can act only as itself")),
        grpc::ByteBuffer());
  } else {
    shard->Pull(pull, deadline,
                ParameterShard::SharedPullDone(
                    [answer](absl::Status status, std::vector<PulledTensor> tensors) {
                      grpc::ByteBuffer b;
                      if (status.ok()) b = EncodePullResponse(tensors);
                      answer->Set(std::move(status), std::move(b));
                    }));
  }
}

// Waits for the shard's answer and moves it into *status and *body; false if the server stops
// first. The shard answers every call (a parked pull by its deadline, capped by the job's wait
// timeout), so this wait only gives up when the server stops.
bool AwaitAnswer(Answer* answer, const std::atomic<bool>& stopping, absl::Status* status,
                 grpc::ByteBuffer* body) {
  absl::MutexLock lock(&answer->mu);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answer->mu) {
    return answer->done || stopping.load();
  };
  while (!answer->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(200))) {
  }
  if (!answer->done) return false;
  *status = answer->status;
  *body = std::move(answer->body);
  return true;
}

}  // namespace

void DataPlaneServer::Serve(Connection* c) {
  const std::optional<int> worker = AnswerHello(c);
  if (!worker.has_value()) return;
  c->worker = *worker;
  const std::string who = absl::StrCat("worker ", *worker, "'s data connection from ", c->peer);
  while (ServeRequest(c, who)) {
  }
  {
    absl::MutexLock lock(&mu_);
    --per_worker_[*worker];
  }
  ::shutdown(c->socket->fd(), SHUT_RDWR);
  c->ended.store(true);
}

std::optional<int> DataPlaneServer::AnswerHello(Connection* c) {
  absl::StatusOr<int> worker = Hello(c);
  char answer[16] = {};
  const std::string text =
      worker.ok() ? "" : std::string(worker.status().message().substr(0, kDataMaxTextBytes));
  WireStore<int32_t>(answer, static_cast<int32_t>(worker.status().code()));
  WireStore<int32_t>(answer + 4, static_cast<int32_t>(text.size()));
  iovec iov[2] = {{answer, sizeof(answer)}, {const_cast<char*>(text.data()), text.size()}};
  // After a failed TLS handshake there is no channel to answer on (OpenSSL sent its alert).
  const std::string failed = c->handshake_failed
                                 ? std::string("no TLS")
                                 : c->socket->Write(iov, 2, absl::Now() + kHelloTimeout);
  if (!worker.ok() || !failed.empty()) {
    if (!worker.ok()) {
      RUBATO_LOG(WARNING) << "refused a data connection from " << c->peer << ": "
                          << worker.status().message();
    }
    if (worker.ok()) {
      absl::MutexLock lock(&mu_);
      --per_worker_[*worker];
    }
    ::shutdown(c->socket->fd(), SHUT_RDWR);  // The peer sees the end now; Reap closes the fd.
    c->ended.store(true);
    return std::nullopt;
  }
  return *worker;
}

bool DataPlaneServer::ServeRequest(Connection* c, const std::string& who) {
  char header[kDataRequestHeaderBytes];
  std::string why;
  const ReadEnd end = c->socket->Read(header, sizeof(header), absl::Now() + options_.idle_timeout,
                                 &why, options_.receive_spin);
  if (end != ReadEnd::kDone) return false;  // Closed by the worker, idle too long, or stopping.
  const int32_t method = WireLoad<int32_t>(header);
  const int64_t timeout_ms = WireLoad<int64_t>(header + 8);
  const int64_t bytes = WireLoad<int64_t>(header + 16);
  absl::Status refused = CheckRequestHeader(method, timeout_ms, bytes, options_.max_message_bytes);
  if (refused.ok()) {
    refused = ReserveBody(c->worker, bytes);
  }
  if (!refused.ok()) {
    RUBATO_LOG(WARNING) << who << ": " << refused.message() << "; closing it";
    WriteResponse(c->socket.get(), refused, nullptr);
    return false;
  }
  auto body = std::make_shared<Body>(static_cast<size_t>(bytes), c->worker, body_bytes_);
  if (c->socket->Read(body->bytes.get(), body->size, absl::Now() + kBodyTimeout, &why,
                 options_.receive_spin) != ReadEnd::kDone) {
    return false;
  }
  const absl::Time deadline = absl::Now() + absl::Milliseconds(std::min(timeout_ms, kMaxTimeoutMs));
  auto answer = std::make_shared<Answer>();
  if (method == static_cast<int32_t>(DataMethod::kPush)) {
    DispatchPush(shard_, &body, c->worker, who, answer);
  } else {
    DispatchPull(shard_, absl::string_view(body->bytes.get(), body->size), c->worker, who, deadline,
                 answer);
  }
  absl::Status status;
  grpc::ByteBuffer response;
  if (!AwaitAnswer(answer.get(), stopping_, &status, &response)) return false;
  if (const std::string failed = WriteResponse(c->socket.get(), status, &response); !failed.empty()) {
    RUBATO_LOG(WARNING) << who << ": cannot send its answer: " << failed << "; closing it";
    return false;
  }
  return true;
}

}  // namespace rubato
