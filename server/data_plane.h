// DataPlaneServer: a shard's Push and Pull over plain TCP, beside its gRPC service.
//
// Why: on loopback a 1 MB push+pull through gRPC 1.51's callback API costs about 11 context
// switches, spread over gRPC's two poller threads and the caller's (the 1 MB, 3-worker case ran
// at 0.56x ps-lite, both pollers ~62% busy and a quarter of the machine idle). The ring all-reduce
// left gRPC for the same reason (worker/ring/ring_tcp.h). Here one thread per connection reads a
// request, hands it to the shard (the same ParameterShard calls, the same zero-copy parse and
// shared-snapshot answer as server/parameter_service.h), and writes the answer with one sendmsg.
//
// Who may connect: the server opens each connection with a fresh random challenge, and the
// client's hello gives its worker id and its answer, an HMAC of the challenge under the job's key
// (common/auth.h, ServerSecurity::CheckHello): no credential crosses the wire that would be
// accepted on another connection, or by another job. Every request on it must then be that
// worker's. With TLS (--tls_cert), each connection starts with a TLS handshake
// (common/tls_stream.h: the server's certificate and, with --tls_ca, the worker's, as over gRPC),
// within the hello's time, and everything below then travels encrypted. A worker learns the port from
// RegisterResponse.data_port and dials it on the host of the shard's gRPC address; where that
// fails (a firewall, a proxy in front of the gRPC port) it uses gRPC (worker/ps/ps_data_channel.h).
//
// Wire format (little-endian, as the floats):
//   challenge "RBPSCHL1", 32 random bytes (the server's first bytes on every connection);
//   hello     "RBPSDAT2", worker id (int32), answer bytes n (int32, at most 1024), the answer
//             (64 hex digits; none without authentication);
//   answer    status code (int32, 0 = OK, else absl's code), text bytes (int32, at most 1024),
//             0 (int64), the text (why it was refused); after a refusal the server closes;
//   request   method (int32: 1 Push, 2 Pull), 0 (int32), timeout in ms (int64, >= 0),
//             body bytes (int64, at most the job's message limit), then the body: a PushRequest
//             or PullRequest in protobuf's wire format (proto/parameter_server.proto);
//   response  status code (int32), 0 (int32), body bytes (int64), then the body: the
//             PushResponse or PullResponse when the code is 0, else the error's text.
// One request at a time per connection, answered in order; a client opens more connections for
// calls in flight together (at most kMaxConnectionsPerWorker each).
//
// Limits, so that no client can hang the server or grow its memory without bound: a hello must
// arrive within 5 s; a request header may wait up to 10 minutes (then the idle connection is
// closed), its body must arrive within 60 s of its header, and an answer must be taken within
// 60 s; a connection whose peer's host stops acknowledging (TCP keepalive and TCP_USER_TIMEOUT)
// ends after peer_dead_after, 15 s, on both sides, as gRPC's keepalive ends a dead channel. At most
// max_connections authenticated connections at once, at most kMaxConnectionsPerWorker per worker;
// at most max_pending_hellos not authenticated yet, a new one closing the oldest, so a flood of
// silent connections cannot keep a worker out. Request bodies stay within memory_budget_bytes
// together (rubato_server gives it the size of its gRPC quota, --memory_budget_mb), and each
// worker's within its share of it, so one identity trickling large bodies cannot starve the
// others; a body larger than the message limit, an unknown method, or a negative
// timeout closes the connection after an answer naming the problem. A malformed message is answered
// with INVALID_ARGUMENT and the connection goes on, as over gRPC.
#ifndef RUBATO_SERVER_DATA_PLANE_H_
#define RUBATO_SERVER_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/data_plane_wire.h"
#include "common/limits.h"
#include "common/security.h"
#include "common/socket_io.h"
#include "common/tls_stream.h"
#include "server/parameter_shard.h"

namespace rubato {

struct DataPlaneOptions {
  std::string host;  // The address to listen on ("" or "0.0.0.0": every address).
  int port = 0;      // 0: any free port.
  // The job's message limit: a larger body is refused.
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  // What the request bodies of every connection may take together, the ones the shard still
  // holds included; a request past it is refused (RESOURCE_EXHAUSTED) and its connection closed.
  int64_t memory_budget_bytes = int64_t{4} << 30;
  // The job's workers (> 0): a hello from another id is refused, and no worker's bodies may take
  // more than its share of the budget, max(budget / num_workers, min(budget / 2, message
  // limit)), so that one identity trickling large bodies cannot starve the others.
  int num_workers = 1;
  // Authenticated connections (each worker at most kMaxConnectionsPerWorker).
  int max_connections = 512;
  // Connections not authenticated yet (each at most 5 s): a new one past this many closes the
  // oldest, so a flood of connections that never say hello cannot lock workers out.
  int max_pending_hellos = 64;
  absl::Duration idle_timeout = absl::Minutes(10);
  // How long a connection waiting for its next request polls before it sleeps (see
  // common/socket_io.h, ReadWithin).
  absl::Duration receive_spin = absl::Microseconds(100);
  // A connection whose worker's host shows no sign of life for this long is closed
  // (common/socket_io.h, WatchPeerLiveness).
  absl::Duration peer_dead_after = kDataPeerDeadAfter;
};

// Bytes of request bodies alive now, in all and by worker (a body may outlive its server: the
// shard may hold it). Internal to DataPlaneServer.
struct DataBodyBytes {
  explicit DataBodyBytes(int workers) : per_worker(workers) {}
  std::atomic<int64_t> total{0};
  std::vector<std::atomic<int64_t>> per_worker;
};

class DataPlaneServer {
 public:
  // Listens and starts accepting. `shard` must outlive the server. UNAVAILABLE naming the address
  // if it cannot listen.
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(const DataPlaneOptions& options,
                                                                ParameterShard* shard,
                                                                ServerSecurity security);
  // Stops accepting, closes every connection and waits for their threads. Call after the shard's
  // Shutdown, which answers the parked pulls those threads may wait for.
  ~DataPlaneServer();

  DataPlaneServer(const DataPlaneServer&) = delete;
  DataPlaneServer& operator=(const DataPlaneServer&) = delete;

  int port() const { return port_; }
  // Connections open now (tests).
  int connections() const;
  // Bytes of request bodies reserved now, being received or waiting for their answers (tests).
  int64_t body_bytes() const;

 private:
  struct Connection {
    // Its socket (closed by whoever reaps it; shut down from any thread), and the TLS session
    // its thread reads and writes through.
    std::unique_ptr<DataSocket> socket;
    bool handshake_failed = false;       // Its TLS handshake failed (its thread's).
    std::string peer;
    int worker = -1;  // Set once its hello is accepted.
    bool authenticated = false;  // Under the server's mu_: its hello was accepted.
    std::thread thread;
    std::atomic<bool> ended{false};
  };


  DataPlaneServer(const DataPlaneOptions& options, ParameterShard* shard, ServerSecurity security,
                  int listen_fd, int port);
  void AcceptLoop();
  // Serves a connection until it ends: its hello, then one request after another.
  void Serve(Connection* connection);
  // Reads and checks the hello; the worker id, or the refusal sent back.
  absl::StatusOr<int> Hello(Connection* connection);
  // Reads the hello (Hello) and writes its answer; the worker id, or nullopt once a refused
  // connection, or one the answer could not reach, is ended.
  std::optional<int> AnswerHello(Connection* connection) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads one request, hands it to the shard, waits for and writes the answer; false when the
  // connection is to close (the worker closed it, it idled or broke, a refusal, or stopping).
  bool ServeRequest(Connection* connection, const std::string& who);
  // Removes the connections whose threads have ended (joins them).
  void Reap() ABSL_LOCKS_EXCLUDED(mu_);
  // Makes room for a new connection: false if max_connections authenticated ones are open;
  // closes the oldest unauthenticated one if max_pending_hellos are.
  bool Admit(const std::string& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a body of `bytes` of `worker`'s, or refuses it (RESOURCE_EXHAUSTED) past the budget or
  // the worker's share of it.
  absl::Status ReserveBody(int worker, int64_t bytes);

  const DataPlaneOptions options_;
  ParameterShard* const shard_;
  const ServerSecurity security_;
  const int listen_fd_;
  const int port_;
  std::atomic<bool> stopping_{false};
  // Against options_.memory_budget_bytes and per_worker_budget_.
  const std::shared_ptr<DataBodyBytes> body_bytes_;
  const int64_t per_worker_budget_;
  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, int> per_worker_ ABSL_GUARDED_BY(mu_);
  int64_t eviction_said_ ABSL_GUARDED_BY(mu_) = 0;  // When Admit last logged (Unix seconds).
  std::thread acceptor_;
};

}  // namespace rubato

#endif  // RUBATO_SERVER_DATA_PLANE_H_
