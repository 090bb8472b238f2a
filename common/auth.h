// JobAuth: authentication of every Rubato RPC by a secret shared by the job's processes.
//
// Each worker proves its identity with a token derived from the job secret and its worker id,
// HMAC-SHA256(secret, "rubato worker <id>") (RFC 2104 / FIPS 198-1), sent as call metadata
// `rubato-auth: worker/<id>/<64 hex digits>`. A server recomputes the MAC for the id the token
// claims and compares in constant time, then requires the request's own worker_id to be that id, so
// a worker can act only as itself. Tools that only read (GetStats) may use the operator token,
// HMAC(secret, "rubato operator"), which no worker-id request accepts.
//
// The token is a bearer credential: it does not change per call, so anyone who can read the
// traffic can replay it. Use TLS (common/security.h) wherever the network is not trusted.
#ifndef RUBATO_COMMON_AUTH_H_
#define RUBATO_COMMON_AUTH_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rubato {

// The metadata key every authenticated call carries.
inline constexpr char kAuthMetadataKey[] = "rubato-auth";
// A secret shorter than this (after trailing white space is removed) is refused.
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;

// Who a valid token speaks for.
struct AuthIdentity {
  // A worker's id, or nullopt for the operator.
  std::optional<int> worker_id;
  std::string ToString() const;
};

class JobAuth {
 public:
  // Reads the secret from `path`, dropping trailing white space. NotFound if the file cannot be
  // read, InvalidArgument if the secret is shorter than kMinSecretBytes or longer than
  // kMaxSecretBytes, or if the file can be read by group or others (as ssh refuses a private key
  // with such permissions: a secret others can read is no secret).
  static absl::StatusOr<JobAuth> FromFile(const std::string& path);
  // InvalidArgument for a secret of the wrong length.
  static absl::StatusOr<JobAuth> FromSecret(std::string secret);

  // "worker/<id>/<hex mac>".
  std::string WorkerToken(int worker_id) const;
  // "operator/<hex mac>".
  std::string OperatorToken() const;

  // The identity `token` proves: UNAUTHENTICATED, naming what is wrong but nothing about the
  // secret, for a malformed token or a wrong MAC. Constant time in the MAC comparison.
  absl::StatusOr<AuthIdentity> Verify(absl::string_view token) const;

 private:
  explicit JobAuth(std::string secret) : secret_(std::move(secret)) {}
  std::string Mac(absl::string_view message) const;  // 64 lowercase hex digits.

  std::string secret_;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_AUTH_H_
