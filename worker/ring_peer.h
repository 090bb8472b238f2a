// The gRPC side of the ring all-reduce: a mailbox of tagged blocks that this rank's RingPeer
// service fills, and a RingLink that delivers to the next rank and takes from the mailbox.
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
#include "common/ring_allreduce.h"
#include "proto/ring.grpc.pb.h"

namespace rubato {

// Blocks delivered to this rank, by tag. Thread-safe.
class RingMailbox {
 public:
  // INVALID_ARGUMENT for a repeated tag, a size that is not whole floats, or non-finite values.
  absl::Status Put(int64_t tag, const std::string& bytes);
  // Waits until `deadline` for the block `tag` and copies it into `out` (sizes must match).
  // DEADLINE_EXCEEDED names `from`, the rank expected to send it.
  absl::Status Take(int64_t tag, absl::Span<float> out, absl::Time deadline, int from);

 private:
  absl::Mutex mu_;
  std::map<int64_t, std::string> blocks_ ABSL_GUARDED_BY(mu_);
};

class RingPeerService final : public RingPeer::CallbackService {
 public:
  explicit RingPeerService(RingMailbox* mailbox) : mailbox_(mailbox) {}
  grpc::ServerUnaryReactor* Deliver(grpc::CallbackServerContext* context, const RingBlock* block,
                                    RingAck* ack) override;

 private:
  RingMailbox* const mailbox_;
};

// Sends to `next_address` (rank + 1 mod size); receives from `mailbox`. Sends wait for the next
// rank to come up (start-up order does not matter) until the all-reduce's deadline.
class GrpcRingLink final : public RingLink {
 public:
  GrpcRingLink(int rank, int size, const std::string& next_address, RingMailbox* mailbox,
               absl::Duration send_timeout);
  absl::Status Send(int64_t tag, absl::Span<const float> data) override;
  absl::Status Receive(int64_t tag, absl::Span<float> out, absl::Time deadline) override;

 private:
  const int rank_;
  const int size_;
  const std::string next_address_;
  RingMailbox* const mailbox_;
  const absl::Duration send_timeout_;
  std::unique_ptr<RingPeer::Stub> stub_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_PEER_H_
