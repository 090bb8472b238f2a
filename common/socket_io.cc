#include "common/socket_io.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rubato {

int PollMillis(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 60 * 60 * 1000));
}

bool SpinUntilReadable(int fd, absl::Time until) {
  do {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) != 0) return true;  // Readable, closed, or an error for recv to report.
    ::sched_yield();
  } while (absl::Now() < until);
  return false;
}

ReadEnd ReadWithin(int fd, char* data, size_t size, absl::Time deadline, std::string* why,
                   absl::Duration spin) {
  while (size > 0) {
    const ssize_t n = ::recv(fd, data, size, MSG_DONTWAIT);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return ReadEnd::kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *why = std::strerror(errno);
      return ReadEnd::kError;
    }
    if (spin > absl::ZeroDuration() &&
        SpinUntilReadable(fd, std::min(absl::Now() + spin, deadline))) {
      continue;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, PollMillis(deadline)) == 0 && absl::Now() >= deadline) {
      return ReadEnd::kTimedOut;
    }
  }
  return ReadEnd::kDone;
}

std::string DescribeReadEnd(ReadEnd end, const std::string& why) {
  switch (end) {
    case ReadEnd::kDone:
      return "done";
    case ReadEnd::kClosed:
      return "it closed the connection";
    case ReadEnd::kTimedOut:
      return "it sent too little in time";
    case ReadEnd::kError:
      break;
  }
  return why;
}

std::string WriteWithin(int fd, iovec* iov, int count, absl::Time deadline) {
  while (count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --count;
      continue;
    }
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(std::min(count, IOV_MAX));
    const ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      size_t left = static_cast<size_t>(n);
      while (left > 0) {
        const size_t take = std::min(left, iov->iov_len);
        iov->iov_base = static_cast<char*>(iov->iov_base) + take;
        iov->iov_len -= take;
        left -= take;
        if (iov->iov_len == 0) {
          ++iov;
          --count;
        }
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, PollMillis(deadline)) == 0 && absl::Now() >= deadline) {
        return "timed out (the other end does not read)";
      }
      continue;
    }
    return n < 0 ? std::strerror(errno) : "nothing written";
  }
  return "";
}

void SetDataSocketOptions(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int bytes = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

void WatchPeerLiveness(int fd, absl::Duration dead_after) {
  const int seconds =
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Seconds(dead_after), 2, 24 * 3600));
  int on = 1;
  // Probes start after two thirds of the time idle, then every sixth; TCP_USER_TIMEOUT overrides
  // the probe count, ending the connection once `dead_after` passed with a probe unanswered.
  int idle = std::max(1, seconds * 2 / 3);
  int interval = std::max(1, seconds / 6);
  int count = 3;
  unsigned int user_timeout_ms = static_cast<unsigned int>(seconds) * 1000u;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

std::string PeerName(const sockaddr_storage& addr) {
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), sizeof(addr), host, sizeof(host), port,
                  sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unknown address";
  }
  return addr.ss_family == AF_INET6 ? absl::StrCat("[", host, "]:", port)
                                    : absl::StrCat(host, ":", port);
}

absl::StatusOr<Listening> ListenTcp(const std::string& host, int port, int backlog) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port ", port, " is not 0..65535"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* list = nullptr;
  const std::string port_text = absl::StrCat(port);
  if (const int rc =
          ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &list);
      rc != 0) {
    return absl::UnavailableError(gai_strerror(rc));
  }
  std::string error = "no address";
  int fd = -1;
  for (const addrinfo* ai = list; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(list);
  if (fd < 0) return absl::UnavailableError(error);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  Listening out;
  out.fd = fd;
  out.port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  return out;
}

absl::StatusOr<int> ConnectTcp(const std::string& host, int port, absl::Duration timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string port_text = absl::StrCat(port);
  if (const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &list); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + timeout;
  int fd = -1;
  std::string error = "no address";
  for (const addrinfo* ai = list; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        if (::poll(&p, 1, PollMillis(deadline)) == 0) {
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof(err);
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        }
      }
    }
    if (err != 0) {
      error = std::strerror(err);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(list);
  if (fd < 0) return absl::UnavailableError(error);
  return fd;
}

}  // namespace rubato
