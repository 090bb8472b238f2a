#include "common/test_certificates.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <fstream>

namespace rubato {
namespace {

std::string MemoryText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string text(data, static_cast<size_t>(n));
  BIO_free(bio);
  return text;
}

std::string ToPem(X509* cert) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  return MemoryText(bio);
}

std::string ToPem(EVP_PKEY* key) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  return MemoryText(bio);
}

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "test certificates: %s failed\n", what);
    std::abort();
  }
}

// A certificate for `name` with `key`, issued by `issuer` (self-signed when null) and signed with
// `signer`.
X509* NewCertificate(const std::string& name, EVP_PKEY* key, X509* issuer, EVP_PKEY* signer,
                     bool ca, const std::string& san) {
  static std::atomic<long> serial{1};
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), serial.fetch_add(1));
  X509_gmtime_adj(X509_getm_notBefore(cert), -60);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* subject = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1, 0);
  X509_set_issuer_name(cert, issuer == nullptr ? subject : X509_get_subject_name(issuer));
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer == nullptr ? cert : issuer, cert, nullptr, nullptr, 0);
  auto add = [&](int nid, const char* value) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    Require(ext != nullptr, value);
    X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
  };
  add(NID_basic_constraints, ca ? "critical,CA:TRUE" : "CA:FALSE");
  if (!san.empty()) add(NID_subject_alt_name, san.c_str());
  Require(X509_sign(cert, signer, EVP_sha256()) > 0, "X509_sign");
  return cert;
}

}  // namespace

TestCa::TestCa(const std::string& name) : key_(EVP_EC_gen("P-256")) {
  Require(key_ != nullptr, "EVP_EC_gen");
  x509_ = NewCertificate(name, key_, nullptr, key_, /*ca=*/true, "");
  pem_ = ToPem(x509_);
}

TestCa::~TestCa() {
  X509_free(x509_);
  EVP_PKEY_free(key_);
}

TestIdentity TestCa::Issue(const std::string& name, const std::string& san) const {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  Require(key != nullptr, "EVP_EC_gen");
  X509* cert = NewCertificate(name, key, x509_, key_, /*ca=*/false, san);
  TestIdentity id{ToPem(cert), ToPem(key)};
  X509_free(cert);
  EVP_PKEY_free(key);
  return id;
}

std::string WriteTestFile(const std::string& dir, const std::string& name,
                          const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  ::chmod(path.c_str(), 0600);
  return path;
}

}  // namespace rubato
