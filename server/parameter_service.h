// ParameterService: the gRPC face of one ParameterShard, on the callback API.
//
// Each RPC is translated to a ParameterShard call. A Pull that must wait is not parked on a thread:
// the reactor is finished from whichever thread later satisfies it (a Push that applies the update,
// or the shard's deadline thread).
//
// Every call is authenticated first (common/security.h) when the job has a secret: Register, Pull,
// Push, Heartbeat, Finish, Rollback and TakeWork only with the token of the request's own worker_id,
// GetStats with any valid token. A refused call changes nothing, not even the caller's lease.
#ifndef RUBATO_SERVER_PARAMETER_SERVICE_H_
#define RUBATO_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/grpc_bytes.h"
#include "common/security.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server_builder.h"
#include "proto/parameter_server.grpc.pb.h"
#include "server/parameter_shard.h"
#include "server/read_gate.h"

namespace rubato {

// Push and Pull are served by a generic callback service as raw bytes (ByteBuffer in, ByteBuffer
// out), so that tensor bytes are never copied by the service: a push is parsed over the received
// slices (common/tensor_wire.h) and its gradients are added into the shard's accumulators from
// them; a pull is answered with slices that reference the shard's copy-on-write weights, shared by
// every pull of that version. Generic, not raw unary, so that the call's token is checked before
// its body is read: gRPC hands a unary method its whole message, so a caller without a token could
// make the server receive and hold large bodies before being refused (issue 31); a generic call's
// reactor reads only once the metadata has passed, and one that does not is finished unread.
// (Built from Service, not CallbackService, whose callback Push and Pull the generic ones would
// hide: clang's -Woverloaded-virtual.)
using ParameterServiceBase =
    ParameterServer::WithGenericMethod_Pull<ParameterServer::WithGenericMethod_Push<
        ParameterServer::WithCallbackMethod_Register<ParameterServer::WithCallbackMethod_Heartbeat<
            ParameterServer::WithCallbackMethod_Finish<ParameterServer::WithCallbackMethod_GetStats<
                ParameterServer::WithCallbackMethod_Rollback<
                    ParameterServer::WithCallbackMethod_TakeWork<ParameterServer::Service>>>>>>>>;

// A PullResponse as slices: each tensor's framing, then its weights in place (the slices hold
// references to the shared weights).
grpc::ByteBuffer EncodePullResponse(const std::vector<PulledTensor>& tensors);

// A push's bytes, parsed over the received slices (referenced, not copied): the parse points into
// the slices, so the two live together, as long as the shard holds any of the gradients (the
// keepalive of ParameterShard::Push). INVALID_ARGUMENT for a malformed message.
struct ReceivedPush {
  std::vector<grpc::Slice> slices;
  WirePush push;
};
absl::StatusOr<std::shared_ptr<ReceivedPush>> ReceivePush(const grpc::ByteBuffer& request);
// INVALID_ARGUMENT "malformed PullRequest" for bytes that are not one.
absl::StatusOr<PullRequest> ReceivePull(const grpc::ByteBuffer& request);

class ParameterService final : public ParameterServiceBase {
 public:
  // `shard` must outlive the service.
  explicit ParameterService(ParameterShard* shard, ServerSecurity security = ServerSecurity())
      : shard_(shard), security_(std::move(security)) {}

  // Registers the service and its generic part (Push and Pull) with `builder`; the server may
  // have no other generic service.
  void AddTo(grpc::ServerBuilder* builder);

  // Push and Pull of one call whose token has been checked for this job, by `caller` (what
  // ServerSecurity::Caller said; checked here against the request's worker), answered by `done`
  // (an OK status with the response, or an error). A pull waits at most until `deadline`.
  using Answered = std::function<void(grpc::Status, grpc::ByteBuffer)>;
  void ServePush(int caller, const grpc::ByteBuffer& request, Answered done);
  void ServePull(int caller, absl::Time deadline, const grpc::ByteBuffer& request, Answered done);
  const ServerSecurity& security() const { return security_; }

  // Push and Pull bodies are received through a ReadGate (server/read_gate.h). By default each
  // caller (a worker, by its token; the operator, other ids and an unauthenticated job's calls
  // count as one more) has at most kReadsPerCaller reads at once, with no total. LimitReads, before
  // serving, caps the total at max(2, memory_budget / max_message) and each caller at
  // min(kReadsPerCaller, total / (workers + 1)), at least 1: what gRPC holds of bodies being
  // received then stays within the budget (for a budget of two messages or more).
  static constexpr int kReadsPerCaller = 2;
  void LimitReads(int64_t memory_budget_bytes, int64_t max_message_bytes);
  ReadGate& read_gate() { return *read_gate_; }
  // The gate's caller for a token's worker id (-1: not a worker).
  int GateCaller(int worker) const;

  // The port of the shard's data plane (server/data_plane.h) that Register answers name; 0 (the
  // default): none.
  void set_data_port(int port) { data_port_.store(port); }

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const RegisterRequest* request,
                                     RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const HeartbeatRequest* request,
                                      HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                   const FinishRequest* request, FinishResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const GetStatsRequest* request,
                                     GetStatsResponse* response) override;
  grpc::ServerUnaryReactor* Rollback(grpc::CallbackServerContext* context,
                                     const RollbackRequest* request,
                                     RollbackResponse* response) override;
  grpc::ServerUnaryReactor* TakeWork(grpc::CallbackServerContext* context,
                                     const TakeWorkRequest* request,
                                     TakeWorkResponse* response) override;

 private:
  // Push and Pull: a reactor per call that checks the token, then reads the one request.
  class DataMethods final : public grpc::CallbackGenericService {
   public:
    explicit DataMethods(ParameterService* service) : service_(service) {}
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override;

   private:
    ParameterService* const service_;
  };

  ParameterShard* const shard_;
  const ServerSecurity security_;
  DataMethods data_methods_{this};
  std::unique_ptr<ReadGate> read_gate_ =
      std::make_unique<ReadGate>(/*total=*/1 << 20, kReadsPerCaller);
  std::atomic<int> data_port_{0};
};

}  // namespace rubato

#endif  // RUBATO_SERVER_PARAMETER_SERVICE_H_
