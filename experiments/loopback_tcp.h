// The physical reference of the transport benchmarks: one TCP stream over loopback.
#ifndef RUBATO_EXPERIMENTS_LOOPBACK_TCP_H_
#define RUBATO_EXPERIMENTS_LOOPBACK_TCP_H_

namespace rubato {

// One connection on 127.0.0.1, one thread writing 1 MiB blocks and one reading, for `seconds`:
// bytes per second received (0 if the sockets cannot be set up).
double LoopbackTcpBytesPerSecond(double seconds);

}  // namespace rubato

#endif  // RUBATO_EXPERIMENTS_LOOPBACK_TCP_H_
