// Throwaway TLS material for tests, made in memory with OpenSSL: a CA, and keys and certificates
// it signs (P-256, valid for an hour, SHA-256), as PEM text.
#ifndef RUBATO_COMMON_TEST_CERTIFICATES_H_
#define RUBATO_COMMON_TEST_CERTIFICATES_H_

#include <string>

typedef struct evp_pkey_st EVP_PKEY;
typedef struct x509_st X509;

namespace rubato {

struct TestIdentity {
  std::string cert;  // PEM
  std::string key;   // PEM
};

class TestCa {
 public:
  explicit TestCa(const std::string& name);
  ~TestCa();
  TestCa(const TestCa&) = delete;
  TestCa& operator=(const TestCa&) = delete;

  const std::string& cert() const { return pem_; }
  // A key and a certificate for `name` signed by this CA, with `san` as its subjectAltName
  // ("IP:127.0.0.1,DNS:localhost"; none when empty).
  TestIdentity Issue(const std::string& name, const std::string& san) const;

 private:
  EVP_PKEY* key_;
  X509* x509_;
  std::string pem_;
};

// Writes `text` to dir/name (mode 0600); the path.
std::string WriteTestFile(const std::string& dir, const std::string& name,
                          const std::string& text);

}  // namespace rubato

#endif  // RUBATO_COMMON_TEST_CERTIFICATES_H_
