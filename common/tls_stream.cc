#include "common/tls_stream.h"

#include <arpa/inet.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rubato {
namespace {

// Consecutive pieces smaller than this are copied together into one TLS record (a request's
// header and a push's small tensors), instead of a record each.
constexpr size_t kGatherBytes = 16 * 1024;
// How much is encrypted (16 records) before it is sent, in one system call.
constexpr size_t kSliceBytes = 256 * 1024;

// What OpenSSL's error queue says (emptying it), or `otherwise`.
std::string OpenSslErrors(absl::string_view otherwise) {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char text[256];
    ERR_error_string_n(e, text, sizeof(text));
    absl::StrAppend(&out, out.empty() ? "" : "; ", text);
  }
  return out.empty() ? std::string(otherwise) : out;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Loads the certificates of `ca_pem` as the ones that verify the other end.
absl::Status TrustCertificates(SSL_CTX* ctx, const std::string& ca_pem) {
  BioPtr bio = MemoryBio(ca_pem);
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  int loaded = 0;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    const int added = X509_STORE_add_cert(store, cert);
    X509_free(cert);
    if (added != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("the TLS CA file: ", OpenSslErrors("a certificate was not taken")));
    }
    ++loaded;
  }
  ERR_clear_error();  // The end of the PEM text.
  if (loaded == 0) {
    return absl::InvalidArgumentError("the TLS CA file holds no PEM certificate");
  }
  return absl::OkStatus();
}

// Uses `cert_pem` (the certificate, then its chain) and `key_pem` as this end's identity.
absl::Status UseIdentity(SSL_CTX* ctx, const std::string& cert_pem, const std::string& key_pem) {
  BioPtr certs = MemoryBio(cert_pem);
  X509* leaf = PEM_read_bio_X509_AUX(certs.get(), nullptr, nullptr, nullptr);
  if (leaf == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the TLS certificate file holds no PEM certificate: ", OpenSslErrors("nothing read")));
  }
  const int used = SSL_CTX_use_certificate(ctx, leaf);
  X509_free(leaf);
  if (used != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the TLS certificate: ", OpenSslErrors("not usable")));
  }
  while (X509* chain = PEM_read_bio_X509(certs.get(), nullptr, nullptr, nullptr)) {
    if (SSL_CTX_add0_chain_cert(ctx, chain) != 1) {
      X509_free(chain);
      return absl::InvalidArgumentError(
          absl::StrCat("the TLS certificate's chain: ", OpenSslErrors("not usable")));
    }
  }
  ERR_clear_error();
  BioPtr key_bio = MemoryBio(key_pem);
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the TLS key file holds no PEM private key: ", OpenSslErrors("nothing read")));
  }
  const int key_used = SSL_CTX_use_PrivateKey(ctx, key);
  EVP_PKEY_free(key);
  if (key_used != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the TLS key does not go with the certificate: ", OpenSslErrors("mismatch")));
  }
  return absl::OkStatus();
}

// What every context of Rubato's has: TLS 1.2 or 1.3, AES-128-GCM first, no renegotiation or
// compression, and reads of many records a system call.
absl::StatusOr<SSL_CTX*> NewContext(const SSL_METHOD* method) {
  SSL_CTX* ctx = SSL_CTX_new(method);
  if (ctx == nullptr) {
    return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslErrors("failed")));
  }
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION |
                               SSL_OP_CIPHER_SERVER_PREFERENCE | SSL_OP_IGNORE_UNEXPECTED_EOF);
  SSL_CTX_set_ciphersuites(ctx,
                           "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                           "TLS_CHACHA20_POLY1305_SHA256");
  SSL_CTX_set_cipher_list(ctx,
                          "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"
                          "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                          "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305");
  SSL_CTX_set_mode(ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, 256 * 1024);
  return ctx;
}

// The BIO of every TLS session, over DataSocket::Wire: reads recv() from the socket; writes are
// gathered in the Wire's buffer, which the DataSocket sends (Flush) in large system calls, with
// MSG_NOSIGNAL (OpenSSL's own socket BIO writes each 16 KiB record with write(), which also raises
// SIGPIPE, ending the process, once the other end has gone).
int WireWrite(BIO* bio, const char* data, int size) {
  auto* wire = static_cast<DataSocket::Wire*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  wire->out.append(data, static_cast<size_t>(size));
  return size;
}

int WireRead(BIO* bio, char* data, int size) {
  auto* wire = static_cast<DataSocket::Wire*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  const ssize_t n = ::recv(wire->fd, data, static_cast<size_t>(size), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    BIO_set_retry_read(bio);
  }
  if (n == 0) errno = 0;  // The end: SSL_ERROR_SYSCALL with errno 0, or ZERO_RETURN.
  return static_cast<int>(n);
}

long WireCtrl(BIO* /*bio*/, int command, long /*larg*/, void* /*parg*/) {
  return command == BIO_CTRL_FLUSH ? 1 : 0;  // DataSocket::Flush sends what is gathered.
}

int WireCreate(BIO* bio) {
  BIO_set_init(bio, 1);
  return 1;
}

const BIO_METHOD* WireMethod() {
  static const BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "rubato socket");
    BIO_meth_set_write(m, WireWrite);
    BIO_meth_set_read(m, WireRead);
    BIO_meth_set_ctrl(m, WireCtrl);
    BIO_meth_set_create(m, WireCreate);
    return m;
  }();
  return method;
}

// A new session of `tls` over `wire`, or null.
SSL* NewSession(const TlsContext& tls, DataSocket::Wire* wire) {
  SSL* ssl = SSL_new(tls.get());
  if (ssl == nullptr) return nullptr;
  BIO* bio = BIO_new(WireMethod());
  if (bio == nullptr) {
    SSL_free(ssl);
    return nullptr;
  }
  BIO_set_data(bio, wire);
  SSL_set_bio(ssl, bio, bio);  // The session owns it.
  return ssl;
}

// Waits for `fd` to be readable (want_read) or writable by `deadline`; false once it has passed.
bool WaitFor(int fd, bool want_read, absl::Time deadline) {
  pollfd p{fd, static_cast<short>(want_read ? POLLIN : POLLOUT), 0};
  return !(::poll(&p, 1, PollMillis(deadline)) == 0 && absl::Now() >= deadline);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForServer(
    const std::string& cert_pem, const std::string& key_pem, const std::string& ca_pem) {
  absl::StatusOr<SSL_CTX*> made = NewContext(TLS_server_method());
  if (!made.ok()) return made.status();
  std::shared_ptr<const TlsContext> context(new TlsContext(*made));
  SSL_CTX* ctx = *made;
  SSL_CTX_set_num_tickets(ctx, 0);  // Connections live long; nothing to resume.
  if (absl::Status s = UseIdentity(ctx, cert_pem, key_pem); !s.ok()) return s;
  if (!ca_pem.empty()) {
    if (absl::Status s = TrustCertificates(ctx, ca_pem); !s.ok()) return s;
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return context;
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForClient(
    const std::string& ca_pem, const std::string& cert_pem, const std::string& key_pem) {
  absl::StatusOr<SSL_CTX*> made = NewContext(TLS_client_method());
  if (!made.ok()) return made.status();
  std::shared_ptr<const TlsContext> context(new TlsContext(*made));
  SSL_CTX* ctx = *made;
  if (ca_pem.empty()) {
    if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
      return absl::InternalError(
          absl::StrCat("the system's TLS roots: ", OpenSslErrors("not loaded")));
    }
  } else if (absl::Status s = TrustCertificates(ctx, ca_pem); !s.ok()) {
    return s;
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!cert_pem.empty()) {
    if (absl::Status s = UseIdentity(ctx, cert_pem, key_pem); !s.ok()) return s;
  }
  return context;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

DataSocket::~DataSocket() {
  if (ssl_ != nullptr) SSL_free(ssl_);
}

std::string DataSocket::HandshakeAsServer(const TlsContext& tls, absl::Time deadline) {
  if (ssl_ != nullptr) return "the TLS handshake was made already";
  ssl_ = NewSession(tls, &wire_);
  if (ssl_ == nullptr) return OpenSslErrors("SSL_new failed");
  SSL_set_accept_state(ssl_);
  return Handshake(deadline);
}

std::string DataSocket::HandshakeAsClient(const TlsContext& tls, const std::string& host,
                                          absl::Time deadline) {
  if (ssl_ != nullptr) return "the TLS handshake was made already";
  ssl_ = NewSession(tls, &wire_);
  if (ssl_ == nullptr) return OpenSslErrors("SSL_new failed");
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  unsigned char address[16];
  const bool literal = ::inet_pton(AF_INET, name.c_str(), address) == 1 ||
                       ::inet_pton(AF_INET6, name.c_str(), address) == 1;
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl_);
  if (literal) {
    if (X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) != 1) {
      return absl::StrCat("'", name, "' is not an address to verify");
    }
  } else {
    SSL_set_tlsext_host_name(ssl_, name.c_str());
    if (SSL_set1_host(ssl_, name.c_str()) != 1) {
      return absl::StrCat("'", name, "' is not a host name to verify");
    }
  }
  SSL_set_connect_state(ssl_);
  return Handshake(deadline);
}

std::string DataSocket::Handshake(absl::Time deadline) {
  for (;;) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl_);
    const int e = SSL_get_error(ssl_, r);
    // What it wrote (its flight, or an alert) goes out first.
    if (std::string failed = Flush(deadline); !failed.empty()) {
      return absl::StrCat("TLS handshake: ", failed);
    }
    if (r == 1) return "";
    if (e == SSL_ERROR_WANT_READ) {
      if (!WaitFor(wire_.fd, true, deadline)) return "the TLS handshake timed out";
      continue;
    }
    const long verified = SSL_get_verify_result(ssl_);
    if (verified != X509_V_OK) {
      ERR_clear_error();
      return absl::StrCat("TLS certificate verify failed: ",
                          X509_verify_cert_error_string(verified));
    }
    if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
      return errno != 0 ? absl::StrCat("TLS handshake: ", std::strerror(errno))
                        : "the other end closed the connection during the TLS handshake";
    }
    return absl::StrCat("TLS handshake: ", OpenSslErrors("failed"));
  }
}

std::string DataSocket::Flush(absl::Time deadline) {
  std::string& out = wire_.out;
  size_t sent = 0;
  std::string failed;
  while (sent < out.size()) {
    const ssize_t n =
        ::send(wire_.fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!WaitFor(wire_.fd, false, deadline)) {
        failed = "timed out (the other end does not read)";
        break;
      }
    } else {
      failed = n < 0 ? std::strerror(errno) : "nothing written";
      break;
    }
  }
  out.clear();  // Sent, or the connection is to be given up.
  return failed;
}

ReadEnd DataSocket::Read(char* data, size_t size, absl::Time deadline, std::string* why,
                         absl::Duration spin) {
  if (ssl_ == nullptr) return ReadWithin(wire_.fd, data, size, deadline, why, spin);
  while (size > 0) {
    ERR_clear_error();
    size_t n = 0;
    const int r = SSL_read_ex(ssl_, data, size, &n);
    const int e = r == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl_, r);
    if (!wire_.out.empty()) {  // A key update's answer, or an alert.
      if (std::string failed = Flush(deadline); !failed.empty()) {
        *why = failed;
        return ReadEnd::kError;
      }
    }
    if (r == 1) {
      data += n;
      size -= n;
      continue;
    }
    if (e == SSL_ERROR_ZERO_RETURN) return ReadEnd::kClosed;
    if (e == SSL_ERROR_WANT_READ) {
      if (spin > absl::ZeroDuration() &&
          SpinUntilReadable(wire_.fd, std::min(absl::Now() + spin, deadline))) {
        continue;
      }
      if (!WaitFor(wire_.fd, true, deadline)) return ReadEnd::kTimedOut;
      continue;
    }
    if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
      if (errno == 0) return ReadEnd::kClosed;
      *why = std::strerror(errno);
      return ReadEnd::kError;
    }
    *why = absl::StrCat("TLS: ", OpenSslErrors("the record could not be read"));
    return ReadEnd::kError;
  }
  return ReadEnd::kDone;
}

std::string DataSocket::Write(iovec* iov, int count, absl::Time deadline) {
  if (ssl_ == nullptr) return WriteWithin(wire_.fd, iov, count, deadline);
  std::string gathered;
  auto flush = [&]() -> std::string {
    if (gathered.empty()) return "";
    std::string failed = WriteTls(gathered.data(), gathered.size(), deadline);
    gathered.clear();
    return failed;
  };
  for (int i = 0; i < count; ++i) {
    const char* data = static_cast<const char*>(iov[i].iov_base);
    const size_t size = iov[i].iov_len;
    if (size < kGatherBytes) {
      if (gathered.size() + size > kGatherBytes) {
        if (std::string failed = flush(); !failed.empty()) return failed;
      }
      gathered.append(data, size);
      continue;
    }
    if (std::string failed = flush(); !failed.empty()) return failed;
    if (std::string failed = WriteTls(data, size, deadline); !failed.empty()) return failed;
  }
  return flush();
}

std::string DataSocket::WriteTls(const char* data, size_t size, absl::Time deadline) {
  while (size > 0) {
    // Encrypted a slice at a time into the wire's buffer (which never refuses), then sent.
    const size_t slice = std::min(size, kSliceBytes);
    ERR_clear_error();
    size_t n = 0;
    if (SSL_write_ex(ssl_, data, slice, &n) != 1 || n != slice) {
      const int e = SSL_get_error(ssl_, 0);
      wire_.out.clear();
      if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
        return errno != 0 ? std::strerror(errno) : "the connection closed";
      }
      return absl::StrCat("TLS: ", OpenSslErrors("the record could not be written"));
    }
    if (std::string failed = Flush(deadline); !failed.empty()) return failed;
    data += slice;
    size -= slice;
  }
  return "";
}

}  // namespace rubato
