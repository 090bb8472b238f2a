// The standard gRPC health-checking service (grpc.health.v1.Health, Check) on every Rubato
// endpoint, for load balancers and Kubernetes probes.
//
//   rubato::HealthService health;                  // SERVING
//   builder.RegisterService(&health);              // beside the endpoint's own service
//   auto probe = rubato::StartHealthServer("0.0.0.0:8081", &health);  // optional probe port
//   health.SetServing(false);                      // while shutting down
//
// Implemented here over the callback API rather than with gRPC's built-in one, which in gRPC 1.51
// cannot run on a server without another service and polls a completion queue of its own. Check
// answers without authentication: it tells only whether the process serves. Kubernetes' gRPC
// probes speak plaintext, so a process whose main port uses TLS gives probes a port of their own
// (--health_listen) that serves nothing but Health and accepts only tiny messages. Watch is not
// implemented (UNIMPLEMENTED), as the protocol allows.
#ifndef RUBATO_COMMON_HEALTH_H_
#define RUBATO_COMMON_HEALTH_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "proto/health.grpc.pb.h"

namespace rubato {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  // `services`: names that Check knows besides "" (the process as a whole), e.g.
  // "rubato.ParameterServer"; others are NOT_FOUND. All share one status.
  explicit HealthService(std::vector<std::string> services = {});

  void SetServing(bool serving) { serving_.store(serving); }
  bool serving() const { return serving_.load(); }

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;

 private:
  const std::vector<std::string> services_;
  std::atomic<bool> serving_{true};
};

// A plaintext server on `address` (host:port; port 0 picks one) serving only `health`, which must
// outlive it. `*bound_port` (if given) receives the port. UNAVAILABLE naming the address if it
// cannot bind.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& address,
                                                                HealthService* health,
                                                                int* bound_port = nullptr);

}  // namespace rubato

#endif  // RUBATO_COMMON_HEALTH_H_
