// rubato_health_probe: asks a Rubato endpoint's gRPC health service whether it serves, for
// scripts, container health checks and clusters whose probes cannot speak gRPC.
//
//   rubato_health_probe 127.0.0.1:8081               # prints SERVING, exits 0
//   rubato_health_probe --timeout_ms=500 ps-0:5000
//
// Plaintext only (a --health_listen port, or a main port without TLS). Exit status: 0 SERVING;
// 1 NOT_SERVING or another answer; 2 bad arguments; 3 no answer, with the reason (the name does
// not resolve, refused, timed out) from common/net_diagnose.h.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/net_diagnose.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(int64_t, timeout_ms, 2000, "How long to wait for the answer.");
ABSL_FLAG(std::string, service, "", "Service to ask about; empty: the process as a whole.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("rubato_health_probe [--timeout_ms=N] [--service=S] HOST:PORT");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "rubato_health_probe: error: expected one HOST:PORT argument\n");
    return 2;
  }
  const std::string address = args[1];
  if (absl::Status s = rubato::ValidateHostPort(address, "address"); !s.ok()) {
    std::fprintf(stderr, "rubato_health_probe: error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  const int64_t timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (timeout_ms < 1) {
    std::fprintf(stderr, "rubato_health_probe: error: --timeout_ms must be >= 1\n");
    return 2;
  }
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    const bool transport = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    std::fprintf(
        stderr, "rubato_health_probe: error: %s: %s\n", address.c_str(),
        transport ? rubato::DiagnoseEndpoint(address, absl::Milliseconds(timeout_ms)).detail.c_str()
                  : status.error_message().c_str());
    return transport ? 3 : 1;
  }
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}
