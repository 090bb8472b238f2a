// The physical bound of TLS in the benchmarks: what AES-128-GCM (TLS 1.3's first suite, as
// common/tls_stream.h prefers) encrypts per second on one core of this machine.
#ifndef RUBATO_EXPERIMENTS_CRYPTO_RATE_H_
#define RUBATO_EXPERIMENTS_CRYPTO_RATE_H_

namespace rubato {

// AES-128-GCM encryption of 16 KiB records (TLS's largest) on the calling thread for `seconds`
// with OpenSSL's EVP: bytes per second.
double AesGcmBytesPerSecond(double seconds);

}  // namespace rubato

#endif  // RUBATO_EXPERIMENTS_CRYPTO_RATE_H_
