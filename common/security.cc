#include "common/security.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"

namespace rubato {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, " ", path, ": cannot read"));
  std::stringstream content;
  content << in.rdbuf();
  std::string pem = content.str();
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return pem;
}

absl::Status CheckTlsFiles(const TlsFiles& tls) {
  if (tls.cert.empty() != tls.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const JobAuth>> LoadAuth(const SecurityConfig& config) {
  if (config.auth_secret_file.empty()) return std::shared_ptr<const JobAuth>();
  ASSIGN_OR_RETURN(JobAuth auth, JobAuth::FromFile(config.auth_secret_file, config.job_id));
  return std::make_shared<const JobAuth>(std::move(auth));
}

}  // namespace

bool IsLoopbackHost(absl::string_view host_port) {
  absl::string_view host = host_port.substr(0, host_port.rfind(':'));
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

ServerSecurity::ServerSecurity() : credentials_(grpc::InsecureServerCredentials()) {}

absl::StatusOr<ServerSecurity> ServerSecurity::Create(const SecurityConfig& config) {
  ServerSecurity s;
  s.insecure_ = config.insecure;
  ASSIGN_OR_RETURN(s.auth_, LoadAuth(config));
  RETURN_IF_ERROR(CheckTlsFiles(config.tls));
  if (config.tls.enabled()) {
    if (config.tls.cert.empty()) {
      return absl::InvalidArgumentError("a server needs --tls_cert and --tls_key for TLS");
    }
    grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    ASSIGN_OR_RETURN(pair.private_key, ReadPem(config.tls.key, "tls_key"));
    ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(config.tls.cert, "tls_cert"));
    s.tls_ = "TLS";
    if (!config.tls.ca.empty()) {
      ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(config.tls.ca, "tls_ca"));
      options.client_certificate_request =
          GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
      s.tls_ = "mutual TLS";
    }
    absl::StatusOr<std::shared_ptr<const TlsContext>> data_tls =
        TlsContext::ForServer(pair.cert_chain, pair.private_key, options.pem_root_certs);
    if (!data_tls.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_cert/--tls_key/--tls_ca: ",
                                                     data_tls.status().message()));
    }
    s.data_tls_ = *std::move(data_tls);
    options.pem_key_cert_pairs.push_back(std::move(pair));
    s.credentials_ = grpc::SslServerCredentials(options);
  }
  return s;
}

namespace {

// The call's one rubato-auth token.
absl::StatusOr<absl::string_view> TokenOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto range = metadata.equal_range(kAuthMetadataKey);
  if (range.first == range.second) {
    return absl::UnauthenticatedError(
        "this job's servers authenticate every call: no rubato-auth token (start the client with "
        "the job's --auth_secret_file)");
  }
  if (std::next(range.first) != range.second) {
    return absl::UnauthenticatedError("more than one rubato-auth token");
  }
  const grpc::string_ref token = range.first->second;
  return absl::string_view(token.data(), token.size());
}

}  // namespace

// A valid token of another identity than the worker the call is for.
absl::Status NotItself(const AuthIdentity& identity, int worker_id) {
  return absl::PermissionDeniedError(absl::StrCat("a call for worker ", worker_id,
                                                  " carries the token of ", identity.ToString(),
                                                  "; a worker can act only as itself"));
}

absl::Status ServerSecurity::CheckCall(const grpc::CallbackServerContext& context,
                                       std::optional<int> worker_id) const {
  if (auth_ == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const absl::string_view token, TokenOf(context));
  return CheckToken(token, worker_id);
}

absl::StatusOr<int> ServerSecurity::Caller(const grpc::CallbackServerContext& context) const {
  if (auth_ == nullptr) return -1;
  ASSIGN_OR_RETURN(const absl::string_view token, TokenOf(context));
  ASSIGN_OR_RETURN(const AuthIdentity identity, auth_->Verify(token));
  return identity.worker_id.value_or(-1);
}

absl::Status ServerSecurity::CheckToken(absl::string_view token,
                                        std::optional<int> worker_id) const {
  if (auth_ == nullptr) return absl::OkStatus();
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "this job's servers authenticate every call: no rubato-auth token (start the client with "
        "the job's --auth_secret_file)");
  }
  ASSIGN_OR_RETURN(AuthIdentity identity, auth_->Verify(token));
  if (worker_id.has_value() && identity.worker_id != worker_id) {
    return NotItself(identity, *worker_id);
  }
  return absl::OkStatus();
}

absl::Status ServerSecurity::CheckActsAs(int caller, int worker_id) const {
  if (auth_ == nullptr || caller == worker_id) return absl::OkStatus();
  AuthIdentity identity;
  if (caller >= 0) identity.worker_id = caller;
  return NotItself(identity, worker_id);
}

absl::Status ServerSecurity::CheckHello(int worker_id, absl::string_view challenge,
                                        absl::string_view answer) const {
  if (auth_ == nullptr) return absl::OkStatus();
  if (answer.empty()) {
    return absl::UnauthenticatedError(
        "this job's servers authenticate every call: a data-connection hello without an answer "
        "(start the client with the job's --auth_secret_file and --job_id)");
  }
  return auth_->VerifyHelloAnswer(worker_id, challenge, answer);
}

absl::Status ServerSecurity::CheckListenAddress(absl::string_view listen) const {
  if (auth_ != nullptr || insecure_ || IsLoopbackHost(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to listen on ", listen,
      " without authentication: anyone who reaches it could read and overwrite the model. Give "
      "the job's --auth_secret_file (./rubato launch makes one), listen on a loopback address, or "
      "pass --insecure on a network you trust"));
}

std::string ServerSecurity::Describe() const {
  std::string transport = tls_.empty() ? "plaintext" : tls_;
  if (auth_ != nullptr) {
    return absl::StrCat(transport, ", every call authenticated by the job secret (job ",
                        auth_->job_id(), ")");
  }
  return absl::StrCat(transport, ", calls NOT authenticated (",
                      insecure_ ? "--insecure" : "no --auth_secret_file: loopback only", ")");
}

ClientSecurity::ClientSecurity() : credentials_(grpc::InsecureChannelCredentials()) {}

std::string ClientSecurity::HelloAnswer(absl::string_view challenge) const {
  if (auth_ == nullptr || !worker_id_.has_value()) return "";
  return auth_->HelloAnswer(*worker_id_, challenge);
}

absl::StatusOr<ClientSecurity> ClientSecurity::Create(const SecurityConfig& config,
                                                      std::optional<int> worker_id) {
  ClientSecurity c;
  ASSIGN_OR_RETURN(c.auth_, LoadAuth(config));
  c.worker_id_ = worker_id;
  if (c.auth_ != nullptr) {
    c.token_ = worker_id.has_value() ? c.auth_->WorkerToken(*worker_id) : c.auth_->OperatorToken();
  }
  RETURN_IF_ERROR(CheckTlsFiles(config.tls));
  if (config.tls.enabled()) {
    grpc::SslCredentialsOptions options;
    if (!config.tls.ca.empty()) {
      ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(config.tls.ca, "tls_ca"));
    }
    if (!config.tls.cert.empty()) {
      ASSIGN_OR_RETURN(options.pem_private_key, ReadPem(config.tls.key, "tls_key"));
      ASSIGN_OR_RETURN(options.pem_cert_chain, ReadPem(config.tls.cert, "tls_cert"));
    }
    absl::StatusOr<std::shared_ptr<const TlsContext>> data_tls = TlsContext::ForClient(
        options.pem_root_certs, options.pem_cert_chain, options.pem_private_key);
    if (!data_tls.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_ca/--tls_cert/--tls_key: ",
                                                     data_tls.status().message()));
    }
    c.data_tls_ = *std::move(data_tls);
    c.credentials_ = grpc::SslCredentials(options);
    c.encrypts_ = true;
  }
  return c;
}

void ClientSecurity::Attach(grpc::ClientContext* context) const {
  if (!token_.empty()) context->AddMetadata(kAuthMetadataKey, token_);
}

}  // namespace rubato
