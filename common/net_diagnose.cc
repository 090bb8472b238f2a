#include "common/net_diagnose.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rubato {

bool SplitHostPort(absl::string_view address, std::string* host, std::string* port) {
  for (absl::string_view scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(address, scheme)) {
      address.remove_prefix(scheme.size());
      break;
    }
  }
  size_t colon;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return false;
    }
    *host = std::string(address.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = address.rfind(':');
    if (colon == absl::string_view::npos) return false;
    *host = std::string(address.substr(0, colon));
  }
  *port = std::string(address.substr(colon + 1));
  int n = 0;
  return !host->empty() && absl::SimpleAtoi(*port, &n) && n > 0 && n < 65536;
}

namespace {

// How long a connected probe waits to see whether the far end hangs up without a word.
constexpr absl::Duration kHangUpWait = absl::Milliseconds(300);

// errno of a non-blocking connect to `ai` finished within `timeout`; 0 on success, ETIMEDOUT when
// the handshake did not complete in time. On success, *hung_up tells whether the far end closed
// (or reset) the connection within kHangUpWait (bounded by `timeout`) without being sent anything:
// what a proxy or port-forward does when what is behind it has gone, while a gRPC server (or
// anything that waits for its client to speak first) keeps the connection open.
int TryConnect(const addrinfo* ai, absl::Duration timeout, bool* hung_up) {
  *hung_up = false;
  const absl::Time deadline = absl::Now() + timeout;
  const int fd =
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return errno;
  int err = 0;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(timeout)));
      int ready;
      do {
        ready = ::poll(&p, 1, ms);
      } while (ready < 0 && errno == EINTR);
      if (ready == 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
  }
  if (err == 0) {
    const int ms = static_cast<int>(std::clamp<int64_t>(
        absl::ToInt64Milliseconds(std::min(kHangUpWait, deadline - absl::Now())), 0,
        absl::ToInt64Milliseconds(kHangUpWait)));
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    int ready;
    do {
      ready = ::poll(&p, 1, ms);
    } while (ready < 0 && errno == EINTR);
    if (ready > 0) {
      char byte;
      const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      *hung_up = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
    }
  }
  ::close(fd);
  return err;
}

}  // namespace

EndpointDiagnosis DiagnoseEndpoint(absl::string_view address, absl::Duration timeout) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) {
    return {Reachability::kBadAddress, absl::StrCat("'", address, "' is not host:port")};
  }
  const absl::Time deadline = absl::Now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &list); rc != 0) {
    if (rc == EAI_NONAME || rc == EAI_NODATA || rc == EAI_FAIL || rc == EAI_AGAIN) {
      return {Reachability::kNoSuchHost,
              absl::StrCat("the host name '", host, "' does not resolve (", gai_strerror(rc), ")")};
    }
    return {Reachability::kOtherError,
            absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc))};
  }
  // Every address of the name; the outcome is the best one seen (connects > refused > ...).
  int refused = 0, timed_out = 0, unreachable = 0, other = 0, tried = 0;
  std::string other_error, refused_by;  // refused_by: the first refusing address, numeric.
  for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    ++tried;
    bool hung_up = false;
    const int err = TryConnect(ai, deadline - absl::Now(), &hung_up);
    if (err == 0 && hung_up) {
      ::freeaddrinfo(list);
      return {Reachability::kHangsUp,
              absl::StrCat(address,
                           " accepts a TCP connection and closes it at once, before anything is "
                           "sent: something in between (a proxy, port-forward or load balancer) "
                           "answers for a process that is no longer there; is the server behind "
                           "it running?")};
    }
    if (err == 0) {
      ::freeaddrinfo(list);
      return {Reachability::kConnects,
              absl::StrCat("a TCP connection to ", address,
                           " succeeds and stays open, so the failure is above TCP: TLS or "
                           "credentials that do not match, or not a Rubato endpoint")};
    }
    if (err == ECONNREFUSED) {
      if (++refused == 1) {
        char ip[NI_MAXHOST];
        if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, ip, sizeof(ip), nullptr, 0,
                          NI_NUMERICHOST) == 0 &&
            host != ip) {
          refused_by = ip;
        }
      }
    } else if (err == ETIMEDOUT) {
      ++timed_out;
    } else if (err == EHOSTUNREACH || err == ENETUNREACH) {
      ++unreachable;
    } else {
      ++other;
      other_error = std::strerror(err);
    }
  }
  ::freeaddrinfo(list);
  if (refused > 0) {
    return {Reachability::kRefused,
            absl::StrCat("connection refused by ", address,
                         refused_by.empty() ? "" : absl::StrCat(" at ", refused_by),
                         " (the host is up, but nothing listens on port ", port, ")")};
  }
  if (timed_out > 0) {
    return {Reachability::kTimedOut,
            absl::StrCat("no answer from ", address, " within ", absl::FormatDuration(timeout),
                         " (the host is down, or the network between drops the packets)")};
  }
  if (unreachable > 0) {
    return {Reachability::kUnreachable,
            absl::StrCat(address, " is unreachable: no route to the host")};
  }
  return {Reachability::kOtherError, absl::StrCat("cannot connect to ", address, ": ",
                                                  tried == 0 ? "no address" : other_error)};
}

std::string DiagnoseListen(absl::string_view address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::StrCat("'", address, "' is not host:port");
  }
  std::string host(address.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                                   &found);
      rc != 0) {
    return absl::StrCat("the host name '", host, "' does not resolve (", ::gai_strerror(rc), ")");
  }
  int error = 0;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = errno;
      continue;
    }
    const int on = 1;  // As gRPC binds: a port in TIME_WAIT is no reason to fail.
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    const bool bound = ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    if (!bound) error = errno;
    ::close(fd);
    if (bound) {
      ::freeaddrinfo(found);
      return "";
    }
  }
  ::freeaddrinfo(found);
  switch (error) {
    case EADDRINUSE:
      return absl::StrCat("port ", port, " is in use on this host (another process listens on it; "
                          "stop it or choose another port)");
    case EADDRNOTAVAIL:
      return absl::StrCat(host, " is not an address of this host (listen on one of its own "
                          "addresses, or on 0.0.0.0 for all of them)");
    case EACCES:
      return absl::StrCat("port ", port, " needs privileges this process lacks (ports below 1024; "
                          "choose a higher one)");
    default:
      return absl::StrCat("binding it fails: ", std::strerror(error));
  }
}

}  // namespace rubato
