#include "common/health.h"

#include <memory>
#include <string>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"

namespace rubato {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// Asks the health service at 127.0.0.1:port about `service`; the call's status and the answer.
grpc::Status Check(int port, const std::string& service, HealthCheckResponse* response) {
  auto stub = Health::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest request;
  request.set_service(service);
  return stub->Check(&context, request, response);
}

TEST(HealthTest, ProbePortFollowsSetServing) {
  HealthService health({"rubato.ParameterServer"});
  int port = 0;
  auto server = StartHealthServer("127.0.0.1:0", &health, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT(port, 0);
  HealthCheckResponse response;
  ASSERT_TRUE(Check(port, "", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check(port, "rubato.ParameterServer", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  health.SetServing(false);
  ASSERT_TRUE(Check(port, "", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);

  // A service it does not know is NOT_FOUND, as the protocol says.
  EXPECT_EQ(Check(port, "no.such.Service", &response).error_code(), grpc::StatusCode::NOT_FOUND);
  (*server)->Shutdown();
}

TEST(HealthTest, ServesBesideAnotherServiceOnOneServer) {
  HealthService health;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  HealthCheckResponse response;
  ASSERT_TRUE(Check(port, "", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  server->Shutdown();
}

TEST(HealthTest, AnAddressInUseIsAnErrorNamingIt) {
  HealthService health;
  int port = 0;
  auto first = StartHealthServer("127.0.0.1:0", &health, &port);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto second = StartHealthServer(address, &health);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(address), std::string::npos) << second.status();
}

}  // namespace
}  // namespace rubato
