// Network: how long a simulated message takes (sim/README.md).
//
// Hosts each have one NIC. A message of B bytes from host a to host b leaves a's NIC when the
// messages queued there before it have (first in, first out), taking B / rate; its first byte
// reaches b's NIC `latency` after it left, and b takes it in when the messages queued there before
// it have, again at B / rate, but never before its last byte could have arrived. So N workers
// pushing to one shard at once take N x B / rate at the shard's NIC (incast), and a shard
// answering N pulls sends them one after another. The fabric between NICs is non-blocking (full
// bisection, as a data-centre fabric aims for); nothing is lost, reordered between two hosts, or
// retransmitted; a queue does not share its bandwidth between messages as TCP flows would (the
// last message of a burst ends at the same time, the others earlier). Messages between processes
// of one host go through its loopback, one queue at the loopback's rate and latency; or, where
// the host's processors are modelled (UseCpu), as work on them: the loopback moves bytes with the
// sender's and the receiver's CPU, so a transfer of B bytes is 2 B / rate of work on up to two
// cores (it takes B / rate on an idle host), shared with whatever else the host computes.
//
// A Queue alone models any first-in-first-out server (a shard's processor applying gradients).
#ifndef RUBATO_SIM_NETWORK_H_
#define RUBATO_SIM_NETWORK_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "sim/cpu.h"
#include "sim/event_loop.h"

namespace rubato {

// A first-in-first-out server of some rate: a job of `bytes` starting no earlier than `ready`
// ends `bytes / rate` after the later of `ready` and the end of the job before it.
class Queue {
 public:
  // bytes_per_second > 0; infinite: jobs take no time.
  explicit Queue(double bytes_per_second) : bytes_per_second_(bytes_per_second) {}

  // Queues a job; returns when it starts (*start, if given) and when it ends.
  absl::Time Take(absl::Time ready, int64_t bytes, absl::Time* start = nullptr);
  absl::Duration Time(int64_t bytes) const;

  double bytes_per_second() const { return bytes_per_second_; }
  absl::Duration busy() const { return busy_; }  // The jobs' time so far.
  int64_t bytes() const { return bytes_; }

 private:
  const double bytes_per_second_;
  absl::Time free_ = absl::InfinitePast();
  absl::Duration busy_;
  int64_t bytes_ = 0;
};

struct HostSpec {
  std::string name;
  double nic_bytes_per_second = 100e9 / 8;  // 100 Gb/s
  absl::Duration latency = absl::Microseconds(10);
  double loopback_bytes_per_second = 8e9;
  absl::Duration loopback_latency = absl::Microseconds(20);
  // Processors its processes share (sim/cpu.h); 0: as many as their work needs.
  int cores = 0;
};

// INVALID_ARGUMENT naming the field: rates must be > 0, latencies and cores >= 0.
absl::Status ValidateHostSpec(const HostSpec& spec);

class Network {
 public:
  // `loop` must outlive the network.
  explicit Network(EventLoop* loop) : loop_(loop) {}

  // The new host's index. The spec must be valid (ValidateHostSpec).
  int AddHost(const HostSpec& spec);
  int hosts() const { return static_cast<int>(hosts_.size()); }
  EventLoop* loop() const { return loop_; }
  const HostSpec& host(int h) const { return hosts_[h].spec; }

  // Host `h`'s loopback moves bytes on `cpu` (not owned; must outlive the network) from now on.
  void UseCpu(int h, Cpu* cpu) { hosts_[h].cpu = cpu; }

  // Sends `bytes` (>= 0) from host `from` to host `to` now; `delivered` runs (as an event) when
  // the last byte has been taken in. Returns that time (InfiniteFuture through a loopback on a
  // Cpu, where it depends on what comes later).
  absl::Time Send(int from, int to, int64_t bytes, std::function<void()> delivered);

  // What each host's NIC has carried: bytes out and in, and the time each direction was busy.
  struct HostStats {
    int64_t bytes_out = 0;
    int64_t bytes_in = 0;
    absl::Duration busy_out;
    absl::Duration busy_in;
  };
  HostStats stats(int h) const;

 private:
  struct Host {
    HostSpec spec;
    Queue out;
    Queue in;
    Queue loopback;
    Cpu* cpu = nullptr;
  };

  EventLoop* const loop_;
  std::vector<Host> hosts_;
};

}  // namespace rubato

#endif  // RUBATO_SIM_NETWORK_H_
