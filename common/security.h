// Transport security and call authentication for every Rubato endpoint, in one place.
//
// ServerSecurity is what a listening endpoint (a parameter-server shard, an all-reduce rank)
// needs: its gRPC credentials (plaintext, TLS, or mutual TLS) and the job's JobAuth, with which
// every handler checks the caller (CheckCall). ClientSecurity is the other side: channel
// credentials and the token this process attaches to each call (Attach).
//
// The secure default: an endpoint without a job secret accepts calls from anyone who reaches its
// port, so it may listen only on a loopback address unless the operator says --insecure
// (CheckListenAddress).
#ifndef RUBATO_COMMON_SECURITY_H_
#define RUBATO_COMMON_SECURITY_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/auth.h"
#include "common/tls_stream.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace rubato {

// PEM files for TLS. cert and key together turn TLS on; ca verifies the other end: a client checks
// the server's certificate against it (the system's roots without it), a server given a ca
// requires and verifies a client certificate (mutual TLS).
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// What every binary is given: --auth_secret_file, --job_id, --tls_cert/--tls_key/--tls_ca,
// --insecure.
struct SecurityConfig {
  std::string auth_secret_file;
  // The job's identity (common/auth.h): required with auth_secret_file, mixed into every token.
  std::string job_id;
  TlsFiles tls;
  bool insecure = false;
};

class ServerSecurity {
 public:
  // Plaintext, no authentication: for tests and in-process tools on loopback.
  ServerSecurity();
  // InvalidArgument / NotFound naming the flag and file for a bad secret or unreadable PEM files.
  static absl::StatusOr<ServerSecurity> Create(const SecurityConfig& config);

  const std::shared_ptr<grpc::ServerCredentials>& credentials() const { return credentials_; }
  bool authenticates() const { return auth_ != nullptr; }
  // True with TLS: what this server receives is encrypted.
  bool encrypts() const { return !tls_.empty(); }
  // With TLS, the same certificates for the data plane's connections (server/data_plane.h);
  // null without.
  const std::shared_ptr<const TlsContext>& data_tls() const { return data_tls_; }

  // OK if the call carries a valid token (or authentication is off). With `worker_id`, the token
  // must be that worker's; without, any valid token will do (read-only calls). UNAUTHENTICATED for
  // a missing or wrong token, PERMISSION_DENIED for a valid token of another identity.
  absl::Status CheckCall(const grpc::CallbackServerContext& context,
                         std::optional<int> worker_id) const;
  // Who a call's valid token is: a worker's id, or -1 for the operator's token or when calls are
  // not authenticated; CheckCall's error for a missing or invalid token.
  absl::StatusOr<int> Caller(const grpc::CallbackServerContext& context) const;
  // CheckCall's worker check for a call whose token Caller() has already verified: OK if `caller`
  // (what Caller returned) is `worker_id` or calls are not authenticated, PERMISSION_DENIED as
  // CheckCall's otherwise. (One HMAC a call, not two.)
  absl::Status CheckActsAs(int caller, int worker_id) const;
  // The same check for a token that came another way; an empty token is a missing one.
  absl::Status CheckToken(absl::string_view token, std::optional<int> worker_id) const;
  // A plain-TCP data connection's hello (server/data_plane.h): OK if `answer` is worker
  // `worker_id`'s answer to this connection's `challenge` (or authentication is off);
  // UNAUTHENTICATED otherwise, an empty answer being a missing one.
  absl::Status CheckHello(int worker_id, absl::string_view challenge,
                          absl::string_view answer) const;

  // OK for a loopback address, or when calls are authenticated, or with --insecure; otherwise
  // FAILED_PRECONDITION naming the address and the two ways out.
  absl::Status CheckListenAddress(absl::string_view listen) const;

  // One line for the start-up log: "TLS (mutual), calls authenticated by the job secret" etc.
  std::string Describe() const;

 private:
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::shared_ptr<const JobAuth> auth_;
  bool insecure_ = false;
  std::string tls_;  // "", "TLS" or "mutual TLS".
  std::shared_ptr<const TlsContext> data_tls_;
};

class ClientSecurity {
 public:
  // Plaintext, no token.
  ClientSecurity();
  // As ServerSecurity::Create; the token is worker `worker_id`'s, or the operator's when nullopt.
  static absl::StatusOr<ClientSecurity> Create(const SecurityConfig& config,
                                               std::optional<int> worker_id);

  const std::shared_ptr<grpc::ChannelCredentials>& credentials() const { return credentials_; }
  // Adds this process's token to a call, if it has one.
  void Attach(grpc::ClientContext* context) const;
  // This worker's answer to a data connection's `challenge` ("" without authentication).
  std::string HelloAnswer(absl::string_view challenge) const;
  // True with TLS: what this client sends is encrypted.
  bool encrypts() const { return encrypts_; }
  // With TLS, the same certificates for data connections (worker/ps/ps_data_channel.h); null
  // without.
  const std::shared_ptr<const TlsContext>& data_tls() const { return data_tls_; }

 private:
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::shared_ptr<const JobAuth> auth_;
  std::optional<int> worker_id_;
  std::string token_;
  bool encrypts_ = false;
  std::shared_ptr<const TlsContext> data_tls_;
};

// True for 127.0.0.0/8, ::1 and "localhost" (host part of host:port).
bool IsLoopbackHost(absl::string_view host_port);

}  // namespace rubato

#endif  // RUBATO_COMMON_SECURITY_H_
