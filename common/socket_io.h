// Blocking-with-deadline socket helpers shared by Rubato's plain-TCP data planes: the ring
// all-reduce's (worker/ring/ring_tcp.h) and the parameter servers' (server/data_plane.h).
//
// Sockets here are non-blocking; every wait is a poll() with a deadline, so nothing waits forever
// on a peer that stopped. Errors are returned as text (the system's reason) for the caller to put
// into a message that names the peer.
#ifndef RUBATO_COMMON_SOCKET_IO_H_
#define RUBATO_COMMON_SOCKET_IO_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rubato {

// Milliseconds from now to `deadline` for poll(): 0 once it has passed, at most an hour.
int PollMillis(absl::Time deadline);

// Polls `fd` without sleeping until it is readable (true) or `until` (false), giving the core to
// any other runnable thread between tries.
bool SpinUntilReadable(int fd, absl::Time until);

// How ReadWithin ended.
enum class ReadEnd { kDone, kClosed, kError, kTimedOut };

// Reads exactly `size` bytes from non-blocking `fd` by `deadline`, waiting in poll(); with kError,
// `why` is the system's reason. With `spin` > 0, each wait for bytes first polls without sleeping
// for up to `spin`, yielding the core between tries, and only then sleeps in poll: that skips a
// wake-up when the bytes come soon.
ReadEnd ReadWithin(int fd, char* data, size_t size, absl::Time deadline, std::string* why,
                   absl::Duration spin = absl::ZeroDuration());

// A few words for a ReadWithin that did not end in kDone ("it closed the connection", ...).
std::string DescribeReadEnd(ReadEnd end, const std::string& why);

// Writes all of `iov` (modified as it goes) to non-blocking `fd` by `deadline`. Empty on success,
// else the reason ("timed out", or the system's).
std::string WriteWithin(int fd, iovec* iov, int count, absl::Time deadline);

// No Nagle delay, and socket buffers of 4 MiB each way (the kernel caps them at its
// net.core.{w,r}mem_max), so that a large message is taken by one sendmsg from the calling thread.
void SetDataSocketOptions(int fd);

// How long a connection of the parameter servers' data plane may go without any sign of life from
// its peer's host before it is dropped: the same as gRPC's keepalive on Rubato's channels (a ping
// after 10 s, answered within 5 s; common/grpc_options.cc), so that a shard whose host vanished
// (powered off, partitioned, a pod moved) is given up as soon over either transport.
inline constexpr absl::Duration kDataPeerDeadAfter = absl::Seconds(15);

// Has the kernel end the connection (reads and writes then fail with ETIMEDOUT) once its peer's
// host has shown no sign of life for about `dead_after`: TCP keepalive probes an idle connection
// (a call parked at a barrier sends nothing for minutes), and TCP_USER_TIMEOUT bounds how long
// sent data may stay unacknowledged. A live peer that is merely slow to answer keeps the
// connection: its kernel acknowledges the probes. Not for the ring, whose ranks may leave a full
// receive window unread while they compute. Rounded to whole seconds, at least 2.
void WatchPeerLiveness(int fd, absl::Duration dead_after);

// "host:port" of a peer, bracketed for IPv6.
std::string PeerName(const sockaddr_storage& addr);

// A non-blocking listening socket on `host` (empty: every address) and `port` (0: any free one).
struct Listening {
  int fd = -1;
  int port = 0;
};
// UNAVAILABLE with the system's reason; the caller says what the listener is for.
absl::StatusOr<Listening> ListenTcp(const std::string& host, int port, int backlog);

// A connected non-blocking socket to host:port within `timeout`; UNAVAILABLE with the reason
// (unresolvable, refused, timed out, ...), without naming the address (the caller does).
absl::StatusOr<int> ConnectTcp(const std::string& host, int port, absl::Duration timeout);

}  // namespace rubato

#endif  // RUBATO_COMMON_SOCKET_IO_H_
