#include "common/auth.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "openssl/crypto.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "openssl/rand.h"

namespace rubato {

std::string AuthIdentity::ToString() const {
  return worker_id.has_value() ? absl::StrCat("worker ", *worker_id) : "the operator";
}

namespace {

std::string Hex(const unsigned char* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    hex[2 * i] = kHex[bytes[i] >> 4];
    hex[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return hex;
}

// HMAC-SHA256(key, message), raw.
std::string RawMac(absl::string_view key, absl::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &length);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

bool SameMac(absl::string_view mac, absl::string_view expected) {
  // The length of a MAC is public; its content is compared in constant time.
  return mac.size() == expected.size() &&
         CRYPTO_memcmp(mac.data(), expected.data(), expected.size()) == 0;
}

}  // namespace

absl::StatusOr<std::string> NewChallenge() {
  std::string challenge(kChallengeBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(challenge.data()),
                 static_cast<int>(challenge.size())) != 1) {
    return absl::InternalError("the system's random generator gave no challenge");
  }
  return challenge;
}

absl::Status CheckJobId(absl::string_view job_id) {
  const bool ok = !job_id.empty() && job_id.size() <= kMaxJobIdBytes &&
                  std::all_of(job_id.begin(), job_id.end(), [](char c) {
                    return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
                  });
  if (ok) return absl::OkStatus();
  if (job_id.empty()) {
    return absl::InvalidArgumentError(
        "--auth_secret_file needs --job_id: the job's identity (a name and a fresh nonce, e.g. "
        "mnist-$(openssl rand -hex 8)), the same for every process of the job and new for each "
        "job, so that no token of another job is accepted (./rubato launch makes one)");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--job_id must be 1 to ", kMaxJobIdBytes,
      " letters, digits, '.', '_' or '-'; got ", job_id.size(), " bytes"));
}

absl::StatusOr<JobAuth> JobAuth::FromSecret(const std::string& secret,
                                            const std::string& job_id) {
  if (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the job secret must be ", kMinSecretBytes,
                                                   " to ", kMaxSecretBytes, " bytes, got ",
                                                   secret.size()));
  }
  RETURN_IF_ERROR(CheckJobId(job_id));
  return JobAuth(RawMac(secret, absl::StrCat("rubato job ", job_id)), job_id);
}

absl::StatusOr<JobAuth> JobAuth::FromFile(const std::string& path, const std::string& job_id) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("--auth_secret_file ", path, ": no such file"));
  }
  // Others get nothing and the group at most reads: 0600, or 0640/0440 as a Kubernetes Secret
  // volume gives a non-root pod through its fsGroup (the file is root's, the group the pod's).
  if ((st.st_mode & (S_IRWXO | S_IWGRP | S_IXGRP)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth_secret_file ", path, " is accessible by others or writable by its group (mode ",
        absl::StrFormat("%03o", st.st_mode & 0777), "); chmod 600 it (640 or 440 for a group "
        "that only reads it)"));
  }
  if (st.st_size > static_cast<off_t>(2 * kMaxSecretBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_secret_file ", path, " is ", st.st_size, " bytes; a secret is at most ",
                     kMaxSecretBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_secret_file ", path, ": cannot read"));
  std::stringstream content;
  content << in.rdbuf();
  std::string secret = content.str();
  secret.erase(secret.find_last_not_of(" \t\r\n") + 1);
  RETURN_IF_ERROR(CheckJobId(job_id));
  absl::StatusOr<JobAuth> auth = FromSecret(secret, job_id);
  if (!auth.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_secret_file ", path, ": ", auth.status().message()));
  }
  return auth;
}

std::string JobAuth::Mac(absl::string_view message) const {
  const std::string mac = RawMac(key_, message);
  return Hex(reinterpret_cast<const unsigned char*>(mac.data()), mac.size());
}

std::string JobAuth::HelloAnswer(int worker_id, absl::string_view challenge) const {
  return Mac(absl::StrCat("rubato data hello worker ", worker_id, " ",
                          Hex(reinterpret_cast<const unsigned char*>(challenge.data()),
                              challenge.size())));
}

absl::Status JobAuth::VerifyHelloAnswer(int worker_id, absl::string_view challenge,
                                        absl::string_view answer) const {
  if (SameMac(answer, HelloAnswer(worker_id, challenge))) return absl::OkStatus();
  return absl::UnauthenticatedError(absl::StrCat(
      "wrong hello answer for worker ", worker_id,
      " (not made from this job's secret and --job_id, or not for this connection)"));
}

std::string JobAuth::WorkerToken(int worker_id) const {
  return absl::StrCat("worker/", worker_id, "/", Mac(absl::StrCat("rubato worker ", worker_id)));
}

std::string JobAuth::OperatorToken() const {
  return absl::StrCat("operator/", Mac("rubato operator"));
}

absl::StatusOr<AuthIdentity> JobAuth::Verify(absl::string_view token) const {
  AuthIdentity identity;
  std::string expected;
  absl::string_view mac;
  if (absl::ConsumePrefix(&token, "worker/")) {
    const size_t slash = token.find('/');
    int id = -1;
    // One spelling per id: digits only, no leading zero ("worker/+1/", "worker/01/" are not 1).
    if (slash == absl::string_view::npos || slash == 0 || slash > 5 ||
        (slash > 1 && token[0] == '0') ||
        !std::all_of(token.begin(), token.begin() + slash, absl::ascii_isdigit) ||
        !absl::SimpleAtoi(token.substr(0, slash), &id) || id >= kMaxWorkers) {
      return absl::UnauthenticatedError("malformed rubato-auth token (bad worker id)");
    }
    identity.worker_id = id;
    expected = Mac(absl::StrCat("rubato worker ", id));
    mac = token.substr(slash + 1);
  } else if (absl::ConsumePrefix(&token, "operator/")) {
    expected = Mac("rubato operator");
    mac = token;
  } else {
    return absl::UnauthenticatedError(
        "malformed rubato-auth token (expected worker/<id>/<mac> or operator/<mac>)");
  }
  if (!SameMac(mac, expected)) {
    return absl::UnauthenticatedError(
        absl::StrCat("wrong rubato-auth token for ", identity.ToString(),
                     " (not made from this job's secret and --job_id)"));
  }
  return identity;
}

}  // namespace rubato
