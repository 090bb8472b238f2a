#include "experiments/crypto_rate.h"

#include <openssl/evp.h>

#include <cstdint>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rubato {

double AesGcmBytesPerSecond(double seconds) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  const unsigned char key[16] = {1};
  unsigned char iv[12] = {2};
  std::vector<unsigned char> in(16384, 7), out(16384 + 16);
  unsigned char tag[16];
  EVP_EncryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key, nullptr);
  int64_t bytes = 0;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  while (absl::Now() < end) {
    for (int i = 0; i < 64; ++i) {
      ++iv[0];  // A fresh nonce a record, as TLS has.
      int n = 0;
      EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv);
      EVP_EncryptUpdate(ctx, out.data(), &n, in.data(), static_cast<int>(in.size()));
      EVP_EncryptFinal_ex(ctx, out.data() + n, &n);
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, tag);
      bytes += static_cast<int64_t>(in.size());
    }
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  EVP_CIPHER_CTX_free(ctx);
  return static_cast<double>(bytes) / elapsed;
}

}  // namespace rubato
