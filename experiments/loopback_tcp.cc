#include "experiments/loopback_tcp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rubato {

double LoopbackTcpBytesPerSecond(double seconds) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("loopback listener");
    close(listener);
    return 0;
  }
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      std::vector<char> block(1 << 20, 1);
      while (!stop.load()) {
        if (write(fd, block.data(), block.size()) <= 0) break;
      }
    }
    close(fd);
  });
  const int conn = accept(listener, nullptr, nullptr);
  std::vector<char> buffer(1 << 20);
  int64_t received = 0;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  while (absl::Now() < end) {
    const ssize_t n = read(conn, buffer.data(), buffer.size());
    if (n <= 0) break;
    received += n;
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  stop.store(true);
  close(conn);  // Unblocks the writer.
  writer.join();
  close(listener);
  return received / elapsed;
}

}  // namespace rubato
