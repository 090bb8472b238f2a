#include "common/security_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, auth_secret_file, "",
          "File holding the job's secret (16 to 4096 bytes, mode 600). Every call is then "
          "authenticated with a per-worker HMAC token. Same file for servers and workers; "
          "./rubato launch makes one per job.");
ABSL_FLAG(std::string, job_id, "",
          "The job's identity, required with --auth_secret_file: a name and a fresh nonce (e.g. "
          "mnist-$(openssl rand -hex 8)), the same for every process of the job and new for each "
          "job. Every token is made from the secret and it, so no other job accepts them. "
          "./rubato launch makes one per job.");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: this endpoint's TLS identity.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle: clients verify servers against it; a server given it requires and "
          "verifies client certificates (mutual TLS).");
ABSL_FLAG(bool, insecure, false,
          "Allow listening on a non-loopback address without --auth_secret_file (anyone who "
          "reaches the port can then read and change the model).");

namespace rubato {

SecurityConfig SecurityConfigFromFlags() {
  SecurityConfig config;
  config.auth_secret_file = absl::GetFlag(FLAGS_auth_secret_file);
  config.job_id = absl::GetFlag(FLAGS_job_id);
  config.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  config.tls.key = absl::GetFlag(FLAGS_tls_key);
  config.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  config.insecure = absl::GetFlag(FLAGS_insecure);
  return config;
}

}  // namespace rubato
