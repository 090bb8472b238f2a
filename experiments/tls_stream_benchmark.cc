// The data plane's TLS (common/tls_stream.h) against its physical bounds, on this machine:
//
//   bazel run //experiments:tls_stream_benchmark [-- --seconds=2]
//
// One connection over 127.0.0.1, one thread writing 16 MiB messages through a DataSocket and
// one reading them, plaintext and then TLS 1.3 (AES-128-GCM, a throwaway CA made in memory): the
// bytes per second received. Next to them, AES-128-GCM's own rate on one core (OpenSSL's EVP,
// 16 KiB records), and the bound they make together: the writing thread encrypts every byte and
// then sends it, so a TLS stream cannot beat 1 / (1 / plaintext + 1 / AES).

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/socket_io.h"
#include "common/test_certificates.h"
#include "common/tls_stream.h"
#include "experiments/crypto_rate.h"

ABSL_FLAG(double, seconds, 2.0, "Measuring time per figure.");
ABSL_FLAG(int64_t, message_mb, 16, "The size of each message written, in MiB.");

namespace rubato {
namespace {

// A connected pair over 127.0.0.1 as the data plane sets it up: {accepted, connected}.
std::pair<int, int> Pair() {
  absl::StatusOr<Listening> l = ListenTcp("127.0.0.1", 0, 4);
  if (!l.ok()) return {-1, -1};
  absl::StatusOr<int> client = ConnectTcp("127.0.0.1", l->port, absl::Seconds(5));
  int server = -1;
  for (int i = 0; i < 1000 && server < 0 && client.ok(); ++i) {
    server = ::accept4(l->fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (server < 0) ::usleep(1000);
  }
  ::close(l->fd);
  if (!client.ok() || server < 0) return {-1, -1};
  SetDataSocketOptions(server);
  SetDataSocketOptions(*client);
  return {server, *client};
}

// Messages of `message_bytes` from one DataSocket to the other for `seconds`; bytes per second
// received, or -1 with a message.
double StreamBytesPerSecond(const TlsContext* server_tls, const TlsContext* client_tls,
                            int64_t message_bytes, double seconds) {
  auto [sfd, cfd] = Pair();
  if (sfd < 0) {
    std::fprintf(stderr, "cannot connect over 127.0.0.1\n");
    return -1;
  }
  DataSocket reader(sfd), writer(cfd);
  if (server_tls != nullptr) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    std::string server_error;
    std::thread t([&] { server_error = reader.HandshakeAsServer(*server_tls, deadline); });
    const std::string client_error = writer.HandshakeAsClient(*client_tls, "127.0.0.1", deadline);
    t.join();
    if (!server_error.empty() || !client_error.empty()) {
      std::fprintf(stderr, "handshake: %s %s\n", server_error.c_str(), client_error.c_str());
      ::close(sfd);
      ::close(cfd);
      return -1;
    }
  }
  std::string out(static_cast<size_t>(message_bytes), 'x'), in(out.size(), '\0');
  std::atomic<bool> stop{false};
  std::thread write([&] {
    while (!stop.load()) {
      iovec iov{out.data(), out.size()};
      if (!writer.Write(&iov, 1, absl::Now() + absl::Seconds(30)).empty()) return;
    }
  });
  int64_t received = 0;
  std::string why;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  while (absl::Now() < end) {
    if (reader.Read(in.data(), in.size(), absl::Now() + absl::Seconds(30), &why) !=
        ReadEnd::kDone) {
      break;
    }
    received += message_bytes;
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  stop.store(true);
  ::shutdown(sfd, SHUT_RDWR);  // Wakes the writer.
  write.join();
  ::close(sfd);
  ::close(cfd);
  return static_cast<double>(received) / elapsed;
}

int Run() {
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int64_t message_bytes = absl::GetFlag(FLAGS_message_mb) << 20;
  TestCa ca("tls_stream_benchmark CA");
  const TestIdentity server = ca.Issue("server", "IP:127.0.0.1");
  const TestIdentity client = ca.Issue("client", "DNS:worker");
  auto server_tls = TlsContext::ForServer(server.cert, server.key, ca.cert());
  auto client_tls = TlsContext::ForClient(ca.cert(), client.cert, client.key);
  if (!server_tls.ok() || !client_tls.ok()) {
    std::fprintf(stderr, "TLS contexts: %s %s\n", server_tls.status().ToString().c_str(),
                 client_tls.status().ToString().c_str());
    return 1;
  }
  const double aes = AesGcmBytesPerSecond(seconds);
  const double plain = StreamBytesPerSecond(nullptr, nullptr, message_bytes, seconds);
  const double tls =
      StreamBytesPerSecond(server_tls->get(), client_tls->get(), message_bytes, seconds);
  std::printf("AES-128-GCM on one core (16 KiB records): %.2f GB/s\n", aes / 1e9);
  std::printf("one loopback stream of %lld MiB messages: plaintext %.2f GB/s, TLS %.2f GB/s "
              "(%.2fx plaintext; bound 1 / (1 / plaintext + 1 / AES) = %.2f GB/s, the writer "
              "encrypting each byte and then sending it)\n",
              static_cast<long long>(message_bytes >> 20), plain / 1e9, tls / 1e9, tls / plain,
              1 / (1 / plain + 1 / aes) / 1e9);
  return plain > 0 && tls > 0 ? 0 : 1;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return rubato::Run();
}
