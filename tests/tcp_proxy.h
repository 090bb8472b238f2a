// TcpProxy: a loopback TCP forwarder whose link can be cut and restored, to stand in for a network
// partition between a worker and a server in tests (the kernel here has no netem).
//
//   auto proxy = TcpProxy::Start(server_port);   // listens on 127.0.0.1:proxy->port()
//   ... clients connect to the proxy's port ...
//   proxy->Cut();       // every connection is reset; new ones are reset on arrival
//   proxy->Restore();   // connections go through again
//
// Forwarding runs on the proxy's own threads; the destructor cuts and joins them.
#ifndef RUBATO_TESTS_TCP_PROXY_H_
#define RUBATO_TESTS_TCP_PROXY_H_

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace rubato {

class TcpProxy {
 public:
  // Listens on 127.0.0.1 (a port the kernel picks) and forwards to 127.0.0.1:target_port.
  static absl::StatusOr<std::unique_ptr<TcpProxy>> Start(int target_port);
  ~TcpProxy();
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  int port() const { return port_; }
  // Resets every open connection and, until Restore, every new one.
  void Cut();
  void Restore();

 private:
  TcpProxy(int listen_fd, int port, int target_port);
  void AcceptLoop();
  void Pump(int client_fd);

  const int listen_fd_;
  const int port_;
  const int target_port_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  absl::Mutex mu_;
  std::vector<int> open_fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::thread accept_thread_;
};

}  // namespace rubato

#endif  // RUBATO_TESTS_TCP_PROXY_H_
