// JobAuth: authentication of every Rubato RPC by a secret shared by the job's processes.
//
// Each job has an identity, its job id (--job_id): a name and a fresh nonce, made by whoever starts
// the job (./rubato launch, deploy/k8s/make_job.py) and given to every process of it. The job's
// key is HMAC-SHA256(secret, "rubato job <job id>") (RFC 2104 / FIPS 198-1), and every credential
// is made with that key, so nothing of one job is accepted by another, even one started later
// with the same secret file (a Kubernetes Secret is kept across runs).
//
// A worker proves its identity with a token, HMAC(key, "rubato worker <id>"), sent as call
// metadata `rubato-auth: worker/<id>/<64 hex digits>`. A server recomputes the MAC for the id the
// token claims and compares in constant time, then requires the request's own worker_id to be
// that id, so a worker can act only as itself. Tools that only read (GetStats) may use the
// operator token, HMAC(key, "rubato operator"), which no worker-id request accepts.
//
// The token is a bearer credential within its job: anyone who can read the job's gRPC traffic
// can replay it to that job. Use TLS (common/security.h) wherever the network is not trusted. The
// plain-TCP data plane sends no token: its hello answers a fresh challenge of the server's with
// HMAC(key, "rubato data hello worker <id> <challenge in hex>"), useless on any other connection.
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
// A job id: 1 to kMaxJobIdBytes of letters, digits, '.', '_' and '-'.
inline constexpr size_t kMaxJobIdBytes = 128;
// The bytes of a data connection's challenge.
inline constexpr size_t kChallengeBytes = 32;

// Who a valid token speaks for.
struct AuthIdentity {
  // A worker's id, or nullopt for the operator.
  std::optional<int> worker_id;
  std::string ToString() const;
};

class JobAuth {
 public:
  // Reads the secret from `path`, dropping trailing white space, for the job `job_id`. NotFound
  // if the file cannot be read, InvalidArgument if the secret is shorter than kMinSecretBytes or
  // longer than kMaxSecretBytes, if the file can be read by group or others (as ssh refuses a
  // private key with such permissions: a secret others can read is no secret), or for a bad job
  // id (CheckJobId).
  static absl::StatusOr<JobAuth> FromFile(const std::string& path, const std::string& job_id);
  // InvalidArgument for a secret of the wrong length or a bad job id.
  static absl::StatusOr<JobAuth> FromSecret(const std::string& secret, const std::string& job_id);

  const std::string& job_id() const { return job_id_; }

  // "worker/<id>/<hex mac>".
  std::string WorkerToken(int worker_id) const;
  // "operator/<hex mac>".
  std::string OperatorToken() const;

  // The identity `token` proves: UNAUTHENTICATED, naming what is wrong but nothing about the
  // secret, for a malformed token or a wrong MAC. Constant time in the MAC comparison.
  absl::StatusOr<AuthIdentity> Verify(absl::string_view token) const;

  // A data connection's hello: worker `worker_id`'s answer to the server's `challenge` (64 hex
  // digits).
  std::string HelloAnswer(int worker_id, absl::string_view challenge) const;
  // UNAUTHENTICATED unless `answer` is worker `worker_id`'s to `challenge` (constant time).
  absl::Status VerifyHelloAnswer(int worker_id, absl::string_view challenge,
                                 absl::string_view answer) const;

 private:
  JobAuth(std::string key, std::string job_id) : key_(std::move(key)), job_id_(std::move(job_id)) {}
  std::string Mac(absl::string_view message) const;  // 64 lowercase hex digits.

  std::string key_;  // HMAC(secret, "rubato job <job id>"), 32 bytes.
  std::string job_id_;
};

// A data connection's challenge: kChallengeBytes from the system's CSPRNG; INTERNAL if it has
// none to give.
absl::StatusOr<std::string> NewChallenge();

// InvalidArgument naming --job_id unless `job_id` is 1 to kMaxJobIdBytes of letters, digits, '.',
// '_' and '-'.
absl::Status CheckJobId(absl::string_view job_id);

}  // namespace rubato

#endif  // RUBATO_COMMON_AUTH_H_
