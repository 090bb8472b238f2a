// AllReduceClient: the `allreduce` mode behind the PsClient interface, so the training loop is the
// same as with parameter servers. There are no servers: every worker keeps the weights, averages
// its gradient with the others' through a ring all-reduce over gRPC (common/ring_allreduce.h,
// worker/ring/ring_peer.h), and applies the same optimizer library and learning-rate schedule the
// servers use (common/optimizer.h, common/lr_schedule.h). Every rank computes bit-identical means,
// starts from the same seeded weights and applies the same float operations, so the weights stay
// bit-identical on every worker.
#ifndef RUBATO_WORKER_RING_ALLREDUCE_CLIENT_H_
#define RUBATO_WORKER_RING_ALLREDUCE_CLIENT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/security.h"
#include "proto/cluster.pb.h"
#include "worker/ps/ps_client.h"
#include "worker/ring/ring_tcp.h"

namespace rubato {

// How blocks travel between ranks. kTcp: a plain TCP data plane set up through the authenticated
// gRPC service (worker/ring/ring_tcp.h), the fast one; kGrpc: a gRPC stream (worker/ring/ring_link.h), which
// TLS encrypts. kAuto: kTcp, or kGrpc when the job uses TLS.
enum class RingTransport { kAuto, kTcp, kGrpc };

// "auto", "tcp" or "grpc"; INVALID_ARGUMENT naming --ring_transport otherwise.
absl::StatusOr<RingTransport> ParseRingTransport(absl::string_view text);
// kAuto resolved as above; kTcp with TLS is INVALID_ARGUMENT (its blocks would not be encrypted).
absl::StatusOr<RingTransport> ResolveRingTransport(RingTransport requested, bool tls);

struct AllReduceOptions {
  int rank = 0;
  ClusterSpec cluster;  // workers (addresses), num_workers, optimizer, lr_schedule.
  // Where this rank's server binds; empty: its advertised address, cluster.workers(rank). Apart
  // from it when the others reach this rank through a name or address that is not its own (a
  // Kubernetes Service, NAT): e.g. "0.0.0.0:6000".
  std::string listen;
  std::vector<TensorSpec> model;
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
  // One all-reduce must finish within this (a dead or stuck peer becomes DEADLINE_EXCEEDED
  // naming it).
  absl::Duration timeout = absl::Seconds(60);
  // Register waits this long for the ring's connections to both neighbours (ranks start at
  // different times; the first all-reduce's timeout should not pay for that).
  absl::Duration connect_timeout = absl::Seconds(30);
  // This rank's ring server (credentials, and the job secret that checks the previous rank's
  // token) and its link to the next rank (credentials, this rank's token).
  ServerSecurity server_security;
  ClientSecurity client_security;
  RingTransport transport = RingTransport::kAuto;
  // kTcp: the data listener's port on the listen address's host (0: any free port).
  int data_port = 0;
  // kTcp: how long a receive polls before it sleeps (TcpRingLink::SetReceiveSpin).
  absl::Duration receive_spin = kDefaultRingReceiveSpin;
};

// Starts this rank's RingPeer server on `listen`, else cluster.workers(rank).
absl::StatusOr<std::unique_ptr<PsClient>> CreateAllReduceClient(const AllReduceOptions& options);

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_ALLREDUCE_CLIENT_H_
