#include "common/health.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/net_diagnose.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace rubato {
namespace {

// A health check request is a service name: a few bytes.
constexpr int kMaxHealthMessageBytes = 4096;

}  // namespace

HealthService::HealthService(std::vector<std::string> services) : services_(std::move(services)) {}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const grpc::health::v1::HealthCheckRequest* request,
                                               grpc::health::v1::HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!request->service().empty() &&
      std::find(services_.begin(), services_.end(), request->service()) == services_.end()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
    return reactor;
  }
  response->set_status(serving() ? grpc::health::v1::HealthCheckResponse::SERVING
                                 : grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& address,
                                                                HealthService* health,
                                                                int* bound_port) {
  if (const std::string why = DiagnoseListen(address); !why.empty()) {
    return absl::UnavailableError(
        absl::StrCat("--health_listen: cannot listen on ", address, ": ", why));
  }
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxHealthMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen: cannot listen on ", address,
                                               ": gRPC could not bind it (see its log)"));
  }
  if (bound_port != nullptr) *bound_port = port;
  return server;
}

}  // namespace rubato
