#include "sim/network.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rubato {

absl::Duration Queue::Time(int64_t bytes) const {
  if (std::isinf(bytes_per_second_) || bytes <= 0) return absl::ZeroDuration();
  return absl::Seconds(static_cast<double>(bytes) / bytes_per_second_);
}

absl::Time Queue::Take(absl::Time ready, int64_t bytes, absl::Time* start) {
  const absl::Time begin = std::max(ready, free_);
  const absl::Duration d = Time(bytes);
  free_ = begin + d;
  busy_ += d;
  bytes_ += bytes;
  if (start != nullptr) *start = begin;
  return free_;
}

absl::Status ValidateHostSpec(const HostSpec& spec) {
  auto rate = [&](const char* field, double v) -> absl::Status {
    if (!(v > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("host '", spec.name, "': ", field, " must be > 0, got ", v));
    }
    return absl::OkStatus();
  };
  auto delay = [&](const char* field, absl::Duration d) -> absl::Status {
    if (d < absl::ZeroDuration() || d == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat("host '", spec.name, "': ", field,
                                                     " must be finite and >= 0, got ",
                                                     absl::FormatDuration(d)));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = rate("NIC rate", spec.nic_bytes_per_second); !s.ok()) return s;
  if (absl::Status s = rate("loopback rate", spec.loopback_bytes_per_second); !s.ok()) return s;
  if (absl::Status s = delay("latency", spec.latency); !s.ok()) return s;
  if (spec.cores < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host '", spec.name, "': cores must be >= 0, got ", spec.cores));
  }
  return delay("loopback latency", spec.loopback_latency);
}

int Network::AddHost(const HostSpec& spec) {
  hosts_.push_back(Host{spec, Queue(spec.nic_bytes_per_second), Queue(spec.nic_bytes_per_second),
                        Queue(spec.loopback_bytes_per_second), nullptr});
  return static_cast<int>(hosts_.size()) - 1;
}

absl::Time Network::Send(int from, int to, int64_t bytes, std::function<void()> delivered) {
  const absl::Time now = loop_->Now();
  absl::Time arrived;
  if (from == to && hosts_[from].cpu != nullptr) {
    Host& h = hosts_[from];
    const absl::Duration latency = h.spec.loopback_latency;
    EventLoop* loop = loop_;
    h.cpu->Run(
        2 * h.loopback.Time(bytes),
        [loop, latency, delivered = std::move(delivered)]() mutable {
          loop->After(latency, std::move(delivered));
        },
        /*width=*/2);
    return absl::InfiniteFuture();
  }
  if (from == to) {
    Host& h = hosts_[from];
    arrived = h.loopback.Take(now, bytes) + h.spec.loopback_latency;
  } else {
    Host& a = hosts_[from];
    Host& b = hosts_[to];
    absl::Time left;
    const absl::Time sent = a.out.Take(now, bytes, &left);
    const absl::Duration latency = std::max(a.spec.latency, b.spec.latency);
    // Taken in from when its first byte arrives, but not ending before its last one has.
    arrived = std::max(b.in.Take(left + latency, bytes), sent + latency);
  }
  loop_->At(arrived, std::move(delivered));
  return arrived;
}

Network::HostStats Network::stats(int h) const {
  const Host& host = hosts_[h];
  HostStats s;
  s.bytes_out = host.out.bytes();
  s.bytes_in = host.in.bytes();
  s.busy_out = host.out.busy();
  s.busy_in = host.in.busy();
  return s;
}

}  // namespace rubato
