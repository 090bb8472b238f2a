#include "tests/tcp_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rubato {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

// Closes with a reset rather than an orderly FIN, as a broken link would look to the peer.
void Reset(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpProxy>> TcpProxy::Start(int target_port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int e = errno;
    close(fd);
    return absl::ErrnoToStatus(e, "proxy bind/listen");
  }
  return std::unique_ptr<TcpProxy>(new TcpProxy(fd, ntohs(a.sin_port), target_port));
}

TcpProxy::TcpProxy(int listen_fd, int port, int target_port)
    : listen_fd_(listen_fd), port_(port), target_port_(target_port) {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

TcpProxy::~TcpProxy() {
  stop_ = true;
  Cut();
  accept_thread_.join();
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    pumps.swap(pumps_);
  }
  for (std::thread& t : pumps) t.join();
  close(listen_fd_);
}

void TcpProxy::Cut() {
  cut_ = true;
  absl::MutexLock lock(&mu_);
  // shutdown wakes the pumps' poll; they close the descriptors themselves.
  for (int fd : open_fds_) shutdown(fd, SHUT_RDWR);
}

void TcpProxy::Restore() { cut_ = false; }

void TcpProxy::AcceptLoop() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    if (cut_) {
      Reset(client);
      continue;
    }
    absl::MutexLock lock(&mu_);
    pumps_.emplace_back([this, client] { Pump(client); });
  }
}

void TcpProxy::Pump(int client) {
  const int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a = Loopback(target_port_);
  if (server < 0 || connect(server, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (server >= 0) close(server);
    Reset(client);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    open_fds_.push_back(client);
    open_fds_.push_back(server);
  }
  char buffer[1 << 16];
  pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
  bool open = true;
  while (open && !cut_ && !stop_) {
    if (poll(fds, 2, 50) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2 && open; ++i) {
      if (fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n <= 0) {
        open = false;
        break;
      }
      for (ssize_t done = 0; done < n;) {
        // MSG_NOSIGNAL: a peer gone, or a Cut() that shuts the socket down mid-write, is EPIPE
        // here, not a SIGPIPE that silently ends the whole test process.
        const ssize_t w = send(fds[1 - i].fd, buffer + done, n - done, MSG_NOSIGNAL);
        if (w <= 0) {
          open = false;
          break;
        }
        done += w;
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    open_fds_.erase(std::remove_if(open_fds_.begin(), open_fds_.end(),
                                   [&](int fd) { return fd == client || fd == server; }),
                    open_fds_.end());
  }
  Reset(client);
  Reset(server);
}

}  // namespace rubato
