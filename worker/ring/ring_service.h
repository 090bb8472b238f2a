// The receiving end of the ring all-reduce's transport: the RingPeer gRPC service.
//
// Each rank serves RingPeer; its previous neighbour keeps one stream open to it
// (worker/ring/ring_link.h) and writes blocks in order. The service parses each block in place
// (worker/ring/ring_codec.h) and files it in the rank's RingMailbox (worker/ring/ring_mailbox.h), where the
// all-reduce takes it; it acknowledges the blocks read so far when the sender asks (a sync or
// closing block), and reports a stream that breaks to the mailbox, so that a rank waiting for a
// block learns at once that its previous rank is gone.
#ifndef RUBATO_WORKER_RING_RING_SERVICE_H_
#define RUBATO_WORKER_RING_RING_SERVICE_H_

#include <utility>

#include "common/security.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "proto/ring.grpc.pb.h"
#include "worker/ring/ring_mailbox.h"
#include "worker/ring/ring_tcp.h"

namespace rubato {

// Serves RingPeer.Stream on raw messages (ParseRingBlock), so a block's floats are read once, by
// the addition in RingMailbox::Take, straight from the buffers the transport filled. With a job
// secret, a stream is accepted only with the previous rank's own token (common/security.h);
// anything else ends at once with UNAUTHENTICATED or PERMISSION_DENIED and never reaches the
// mailbox. `mailbox` must outlive the service's server.
//
// OpenData hands the previous rank (checked the same way) the port of `data`, this rank's TCP data
// listener (worker/ring/ring_tcp.h), and a fresh ticket for it; FAILED_PRECONDITION without one.
class RingPeerService final
    : public RingPeer::WithCallbackMethod_OpenData<
          RingPeer::WithRawCallbackMethod_Stream<RingPeer::Service>> {
 public:
  explicit RingPeerService(RingMailbox* mailbox, ServerSecurity security = ServerSecurity(),
                           TcpRingListener* data = nullptr)
      : mailbox_(mailbox), security_(std::move(security)), data_(data) {}
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* OpenData(grpc::CallbackServerContext* context,
                                     const OpenDataRequest* request,
                                     OpenDataReply* reply) override;

 private:
  RingMailbox* const mailbox_;
  const ServerSecurity security_;
  TcpRingListener* const data_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_RING_SERVICE_H_
