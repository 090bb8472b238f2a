#include "server/parameter_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"

namespace rubato {

namespace {

// Releases the reference to a version's weights that a pull answer's slice held.
void ReleaseWeights(void* held) {
  delete static_cast<std::shared_ptr<const std::vector<float>>*>(held);
}

}  // namespace

grpc::ByteBuffer EncodePullResponse(const std::vector<PulledTensor>& tensors) {
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * tensors.size());
  for (const PulledTensor& t : tensors) {
    const std::vector<float>& values = *t.snapshot.values;
    const size_t bytes = values.size() * sizeof(float);
    std::string header;
    EncodeTensorHeader(1, *t.name, t.snapshot.version, bytes, &header);
    slices.emplace_back(std::move(header));
    slices.emplace_back(const_cast<float*>(values.data()), bytes, &ReleaseWeights,
                        new std::shared_ptr<const std::vector<float>>(t.snapshot.values));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

namespace {

// Finishes `context`'s default reactor with `result`, copying the value into `response` when OK.
template <typename Response>
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                 absl::StatusOr<Response> result, Response* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (result.ok()) *response = std::move(*result);
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

absl::StatusOr<std::shared_ptr<ReceivedPush>> ReceivePush(const grpc::ByteBuffer& request) {
  auto received = std::make_shared<ReceivedPush>();
  if (!request.Dump(&received->slices).ok()) {
    return absl::InvalidArgumentError("unreadable push message");
  }
  ByteChunks message;
  for (const grpc::Slice& slice : received->slices) {
    message.Append(absl::string_view(reinterpret_cast<const char*>(slice.begin()), slice.size()));
  }
  RETURN_IF_ERROR(ParsePushRequest(message, kMaxTensors, &received->push));
  return received;
}

absl::StatusOr<PullRequest> ReceivePull(const grpc::ByteBuffer& request) {
  PullRequest pull;
  if (!ParseSerializedMessage(request, &pull)) {
    return absl::InvalidArgumentError("malformed PullRequest");
  }
  return pull;
}

grpc::ServerUnaryReactor* ParameterService::Register(grpc::CallbackServerContext* context,
                                                     const RegisterRequest* request,
                                                     RegisterResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  absl::StatusOr<RegisterResponse> result = shard_->Register(*request);
  if (result.ok()) result->set_data_port(data_port_.load());
  return Answer(context, std::move(result), response);
}

void ParameterService::ServePush(int caller, const grpc::ByteBuffer& request, Answered done) {
  absl::StatusOr<std::shared_ptr<ReceivedPush>> parsed = ReceivePush(request);
  if (!parsed.ok()) return done(ToGrpcStatus(parsed.status()), grpc::ByteBuffer());
  std::shared_ptr<ReceivedPush> received = *std::move(parsed);
  if (absl::Status s = security_.CheckActsAs(caller, received->push.worker_id); !s.ok()) {
    return done(ToGrpcStatus(s), grpc::ByteBuffer());
  }
  // The gradients' bytes stay in `received`'s slices, which the shard holds while it needs them.
  WirePush push = std::move(received->push);
  shard_->Push(std::move(push), std::move(received),
               [done = std::move(done)](absl::StatusOr<PushResponse> result) {
                 if (!result.ok()) return done(ToGrpcStatus(result.status()), grpc::ByteBuffer());
                 done(grpc::Status::OK, SerializedMessage(*result));
               });
}

grpc::ServerUnaryReactor* ParameterService::Heartbeat(grpc::CallbackServerContext* context,
                                                      const HeartbeatRequest* request,
                                                      HeartbeatResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::Finish(grpc::CallbackServerContext* context,
                                                   const FinishRequest* request,
                                                   FinishResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Finish(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::Rollback(grpc::CallbackServerContext* context,
                                                     const RollbackRequest* request,
                                                     RollbackResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->Rollback(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::TakeWork(grpc::CallbackServerContext* context,
                                                     const TakeWorkRequest* request,
                                                     TakeWorkResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, request->worker_id()); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, shard_->TakeWork(*request), response);
}

grpc::ServerUnaryReactor* ParameterService::GetStats(grpc::CallbackServerContext* context,
                                                     const GetStatsRequest* /*request*/,
                                                     GetStatsResponse* response) {
  if (absl::Status s = security_.CheckCall(*context, std::nullopt); !s.ok()) {
    return Refuse(context, s);
  }
  return Answer(context, absl::StatusOr<GetStatsResponse>(shard_->Stats()), response);
}

void ParameterService::ServePull(int caller, absl::Time deadline, const grpc::ByteBuffer& request,
                                 Answered done) {
  absl::StatusOr<PullRequest> parsed = ReceivePull(request);
  if (!parsed.ok()) return done(ToGrpcStatus(parsed.status()), grpc::ByteBuffer());
  const PullRequest& pull = *parsed;
  if (absl::Status s = security_.CheckActsAs(caller, pull.worker_id()); !s.ok()) {
    return done(ToGrpcStatus(s), grpc::ByteBuffer());
  }
  shard_->Pull(pull, deadline,
               ParameterShard::SharedPullDone(
                   [done = std::move(done)](absl::Status status, std::vector<PulledTensor> tensors) {
                     if (!status.ok()) return done(ToGrpcStatus(status), grpc::ByteBuffer());
                     done(grpc::Status::OK, EncodePullResponse(tensors));
                   }));
}

namespace {

constexpr char kPushMethod[] = "/rubato.ParameterServer/Push";
constexpr char kPullMethod[] = "/rubato.ParameterServer/Pull";

// One Push or Pull: the token is checked from the call's metadata before anything of the body is
// read; a call without a valid one is finished unread. Then the one request is read and served.
class DataCall final : public grpc::ServerGenericBidiReactor {
 public:
  DataCall(ParameterService* service, grpc::GenericCallbackServerContext* context)
      : service_(service), context_(context), push_(context->method() == kPushMethod) {
    if (!push_ && context->method() != kPullMethod) {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                          absl::StrCat("no method ", context->method())));
      return;
    }
    absl::StatusOr<int> caller = service_->security().Caller(*context);
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    // Its body is received once its caller has a read free (ParameterService::ReadGate).
    token_of_ = *caller;
    caller_ = service_->GateCaller(*caller);
    start_ = std::make_shared<std::function<void()>>([this] { StartRead(&request_); });
    service_->read_gate().Enter(caller_, start_);
  }

  void OnCancel() override {
    // Cancelled (by its client, its deadline or a shutdown) while waiting for a read: it ends
    // unread. Otherwise a read under way ends (not ok) and OnReadDone finishes it.
    if (start_ != nullptr && service_->read_gate().Withdraw(caller_, start_.get())) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before its body was read"));
    }
  }

  void OnReadDone(bool ok) override {
    service_->read_gate().Leave(caller_);
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(context_->method(), ": the call ended without a request")));
      return;
    }
    ParameterService::Answered done = [this](grpc::Status status, grpc::ByteBuffer response) {
      if (!status.ok()) {
        Finish(status);
        return;
      }
      response_ = std::move(response);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    };
    if (push_) {
      service_->ServePush(token_of_, request_, std::move(done));
    } else {
      // The client's deadline, if any; the shard caps it with the cluster's wait timeout. A
      // cancelled call stays queued until that deadline, which is bounded; finishing it then is
      // harmless.
      service_->ServePull(token_of_, absl::FromChrono(context_->deadline()), request_,
                          std::move(done));
    }
  }

  void OnDone() override { delete this; }

 private:
  ParameterService* const service_;
  grpc::GenericCallbackServerContext* const context_;
  const bool push_;
  int token_of_ = -1;  // ServerSecurity::Caller's answer
  int caller_ = -1;    // the read gate's
  std::shared_ptr<std::function<void()>> start_;  // set once the token has passed
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

}  // namespace

grpc::ServerGenericBidiReactor* ParameterService::DataMethods::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new DataCall(service_, context);
}

void ParameterService::LimitReads(int64_t memory_budget_bytes, int64_t max_message_bytes) {
  const int64_t total =
      std::clamp<int64_t>(memory_budget_bytes / std::max<int64_t>(max_message_bytes, 1), 2, 1 << 20);
  const int64_t per_caller =
      std::clamp<int64_t>(total / (int64_t{shard_->num_workers()} + 1), 1, kReadsPerCaller);
  read_gate_ = std::make_unique<ReadGate>(static_cast<int>(total), static_cast<int>(per_caller));
}

int ParameterService::GateCaller(int worker) const {
  const int workers = shard_->num_workers();
  return worker >= 0 && worker < workers ? worker : workers;
}

void ParameterService::AddTo(grpc::ServerBuilder* builder) {
  builder->RegisterService(this);
  builder->RegisterCallbackGenericService(&data_methods_);
}

}  // namespace rubato
