// The gRPC side of the ring all-reduce (common/ring_allreduce.h): one header for all of it.
//
// Each rank serves RingPeer; its previous neighbour keeps one client stream open to it and writes
// blocks in order. Incoming blocks wait in a RingMailbox until the algorithm asks for them by tag.
// The parts, each usable and testable alone:
//   worker/ring/ring_codec.h    the wire format: blocks encoded and parsed without copying the floats;
//   worker/ring/ring_mailbox.h  RingMailbox: received blocks by tag, and the failures that end waits;
//   worker/ring/ring_service.h  RingPeerService: the server end of the stream from the previous rank;
//   worker/ring/ring_link.h     GrpcRingLink: the client end of the stream to the next rank;
//   worker/ring/ring_tcp.h      TcpRingLink: the faster data plane over plain TCP, set up through this
//                          service's OpenData (the default unless the job uses TLS).
//
// Failure handling, since a dead or stuck peer must not hang a job:
//  - the next rank not up yet: the stream waits for it (wait_for_ready, reconnect backoff capped at
//    1 s by RubatoChannelArguments) until the all-reduce's deadline;
//  - the next rank dies: the stream fails, and every later Send/Flush fails at once naming it, as
//    does a Receive waiting meanwhile (the failure aborts this rank's mailbox);
//  - the previous rank dies: its stream breaks, and Receive fails at once naming it (blocks it
//    delivered before still count);
//  - a rank stops but keeps its connections (SIGSTOP, a livelock): Flush and Receive time out at
//    the deadline, naming the rank waited for, and the link's destructor cancels its stream after
//    its close timeout.
#ifndef RUBATO_WORKER_RING_RING_PEER_H_
#define RUBATO_WORKER_RING_RING_PEER_H_

#include "worker/ring/ring_codec.h"    // IWYU pragma: export
#include "worker/ring/ring_link.h"     // IWYU pragma: export
#include "worker/ring/ring_mailbox.h"  // IWYU pragma: export
#include "worker/ring/ring_service.h"  // IWYU pragma: export
#include "worker/ring/ring_tcp.h"      // IWYU pragma: export

#endif  // RUBATO_WORKER_RING_RING_PEER_H_
