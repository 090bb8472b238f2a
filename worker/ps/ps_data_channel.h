// PsDataChannel: a worker's Push and Pull calls to one shard over the shard's plain-TCP data
// plane (server/data_plane.h, which documents the wire format and why it exists).
//
// Each call runs on one connection from start to answer: the connection's own thread writes the
// request (the gradient slices in place, no copy) with one sendmsg, then reads the answer into a
// fresh slice that PsClient parses as it parses gRPC's. Calls in flight together get connections
// of their own (opened on demand, kept for reuse, at most kMaxDataConnections; more calls wait
// for one), so that the shard's answers never queue behind one another.
//
// Failures come back as gRPC statuses, so that PsClient's retries treat both transports alike:
// UNAVAILABLE when the connection cannot be opened or breaks (the shard died or restarted, or its
// host stopped acknowledging for kDataPeerDeadAfter: a vanished host is given up as soon as over
// gRPC, whose keepalive does the same, not at the call's deadline minutes later), the
// shard's own code and text when it refuses a call, DEADLINE_EXCEEDED when no answer comes by the
// call's deadline. A channel that could not open a connection is broken() from then on: PsClient
// sends that shard's calls over gRPC instead, until the next registration offers a data port.
#ifndef RUBATO_WORKER_PS_PS_DATA_CHANNEL_H_
#define RUBATO_WORKER_PS_PS_DATA_CHANNEL_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/socket_io.h"
#include "common/tls_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

inline constexpr int kMaxDataConnections = 8;

class PsDataChannel {
 public:
  struct Options {
    std::string host;  // The host of the shard's gRPC address.
    int port = 0;      // RegisterResponse.data_port.
    int worker_id = 0;
    // The worker's answer to a connection's challenge (ClientSecurity::HelloAnswer); null or ""
    // without authentication.
    std::function<std::string(absl::string_view challenge)> answer_challenge;
    std::string description;  // "shard 1 at host:port", for messages.
    // With TLS: the client's context (ClientSecurity::data_tls); the shard's certificate must name
    // `host`. Null: plaintext.
    std::shared_ptr<const TlsContext> tls;
    int64_t max_message_bytes = kDefaultMaxMessageBytes;  // A larger answer is refused.
    absl::Duration connect_timeout = absl::Seconds(3);
    // How long a call waiting for its answer polls before it sleeps (common/socket_io.h).
    absl::Duration receive_spin = absl::Microseconds(100);
    // A connection whose shard's host shows no sign of life for this long fails with UNAVAILABLE
    // (common/socket_io.h, WatchPeerLiveness), which PsClient retries as it retries gRPC's.
    absl::Duration peer_dead_after = kDataPeerDeadAfter;
  };
  explicit PsDataChannel(Options options) : options_(std::move(options)) {}
  // Closes every connection and waits for their threads (calls in flight end with UNAVAILABLE).
  ~PsDataChannel();

  PsDataChannel(const PsDataChannel&) = delete;
  PsDataChannel& operator=(const PsDataChannel&) = delete;

  // Where a pull's answer may be read in place (worker/ps/shard_channel.h).
  using PullSink = ::rubato::PullSink;

  using Done = std::function<void(grpc::Status)>;
  // Sends `request` (a PushRequest, method 1, or PullRequest, method 2, in protobuf's wire format)
  // and calls done(status) on a connection's thread once *response holds the answer (or `sink`
  // does, for a pull) or the call failed. `request`, `response` and `sink` must stay valid until
  // then.
  void Call(int method, const grpc::ByteBuffer* request, absl::Time deadline,
            grpc::ByteBuffer* response, Done done, PullSink* sink = nullptr);

  // The client stopped using this channel (it uses gRPC, or a newer channel, for the shard): each
  // connection closes as soon as it has no call, so that neither end keeps threads and sockets
  // for it (the shard counts a worker's connections against kMaxConnectionsPerWorker). Calls made
  // after this are still carried, on connections that close once they end.
  void Drain();

  // A connection could not be opened: use gRPC.
  bool broken() const { return broken_.load(); }
  // Connections open now, or being opened (tests).
  int open_connections() const;
  int port() const { return options_.port; }

 private:
  struct Job {
    int method = 0;
    const grpc::ByteBuffer* request = nullptr;
    absl::Time deadline;
    grpc::ByteBuffer* response = nullptr;
    Done done;
    PullSink* sink = nullptr;
  };
  struct Connection {
    std::atomic<int> fd{-1};  // Set by its thread; shut down by the destructor.
    std::unique_ptr<DataSocket> socket;  // Over fd (TLS when the job uses it); its thread's.
    std::thread thread;
    bool has_job = false;  // Guarded by the channel's mu_, as are job and ended.
    Job job;
    bool ended = false;  // Its thread returned (draining); it takes no more jobs.
  };
  // Gives `job` to an idle connection, a new one, or the queue.
  void Assign(Job job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends connection `c`'s thread while draining: closes its socket, and it takes no more jobs.
  void EndConnection(Connection* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Connection* c);
  // Opens (with TLS, makes the handshake) and greets; the socket, or UNAVAILABLE / the shard's
  // refusal.
  grpc::Status Open(std::unique_ptr<DataSocket>* socket);
  grpc::Status Exchange(Connection* c, const Job& job);
  // Reads a pull answer of `size` bytes from `fd` into job.sink, or whole into *job.response when
  // it is not laid out as expected. Empty on success, else why reading failed (and how).
  std::string ReadPullInPlace(DataSocket* socket, int64_t size, const Job& job,
                              absl::Time deadline, ReadEnd* end);

  const Options options_;
  std::atomic<bool> broken_{false};
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  int ended_ ABSL_GUARDED_BY(mu_) = 0;  // Of connections_.
  std::vector<Connection*> idle_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_PS_DATA_CHANNEL_H_
