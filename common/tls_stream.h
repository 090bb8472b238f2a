// TLS for Rubato's plain-TCP data plane (server/data_plane.h, worker/ps/ps_data_channel.h), with
// the OpenSSL that gRPC links here, so that a job with --tls_cert keeps Push and Pull off gRPC.
//
// TlsContext is what one process's connections share: its certificate and key, and what it
// verifies the other end against, from the same PEM files as its gRPC credentials
// (common/security.h). A server given a CA requires a client certificate that it verifies
// (mutual TLS); a client verifies the server's certificate against the CA (the system's roots
// without one) and that it names the host dialled (a DNS name or an IP address in its
// subjectAltName), as gRPC does.
//
// DataSocket is one end of a data connection: a non-blocking socket and, when the job uses TLS,
// its TLS session. Its Read and Write have the shapes of common/socket_io.h's ReadWithin and
// WriteWithin (every wait a poll() with a deadline) and are those with plaintext. One thread at a
// time may use a DataSocket; another may shutdown() its fd to wake it. Versions: TLS 1.2 and 1.3
// only, AES-128-GCM preferred (it has the CPU's instructions), no renegotiation, no compression.
#ifndef RUBATO_COMMON_TLS_STREAM_H_
#define RUBATO_COMMON_TLS_STREAM_H_

#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/socket_io.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace rubato {

class TlsContext {
 public:
  // A server's: its certificate chain and private key (PEM text); with `ca_pem`, every client
  // must present a certificate that verifies against it. INVALID_ARGUMENT naming what OpenSSL
  // could not use.
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForServer(const std::string& cert_pem,
                                                                     const std::string& key_pem,
                                                                     const std::string& ca_pem);
  // A client's: verifies servers against `ca_pem` (the system's roots when empty), and presents
  // `cert_pem` with `key_pem` when given (for mutual TLS).
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForClient(const std::string& ca_pem,
                                                                     const std::string& cert_pem,
                                                                     const std::string& key_pem);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  SSL_CTX* get() const { return ctx_; }

 private:
  explicit TlsContext(SSL_CTX* ctx) : ctx_(ctx) {}
  SSL_CTX* const ctx_;
};

class DataSocket {
 public:
  // Plaintext over `fd` (-1: none yet), which the caller owns and closes.
  explicit DataSocket(int fd = -1) { wire_.fd = fd; }
  ~DataSocket();  // Frees the TLS session; the fd stays open.
  DataSocket(const DataSocket&) = delete;
  DataSocket& operator=(const DataSocket&) = delete;

  // Runs the TLS handshake on the socket by `deadline`, as the server or as the client of `host`
  // (the name or address the server's certificate must carry); from then on Read and Write are
  // encrypted. Empty on success, else why it failed ("certificate verify failed: ...").
  std::string HandshakeAsServer(const TlsContext& tls, absl::Time deadline);
  std::string HandshakeAsClient(const TlsContext& tls, const std::string& host,
                                absl::Time deadline);

  // ReadWithin and WriteWithin (common/socket_io.h), through TLS when the handshake was made.
  ReadEnd Read(char* data, size_t size, absl::Time deadline, std::string* why,
               absl::Duration spin = absl::ZeroDuration());
  std::string Write(iovec* iov, int count, absl::Time deadline);

  int fd() const { return wire_.fd; }
  bool encrypted() const { return ssl_ != nullptr; }

  // What the session's BIO works on (internal): the socket, and the TLS bytes written and not
  // sent yet.
  struct Wire {
    int fd = -1;
    std::string out;
  };

 private:
  std::string Handshake(absl::Time deadline);
  // Sends what the session has written (wire_.out) by `deadline`; empty or why not.
  std::string Flush(absl::Time deadline);
  // Writes all of [data, data + size) through TLS by `deadline`; empty or why not.
  std::string WriteTls(const char* data, size_t size, absl::Time deadline);

  Wire wire_;
  SSL* ssl_ = nullptr;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_TLS_STREAM_H_
