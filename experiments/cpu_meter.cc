#include "experiments/cpu_meter.h"

#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace rubato {
namespace {

int64_t WallNanos() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

double ProcessCpuSeconds() {
  rusage u;
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// The machine's non-idle clock ticks over all cores: the first line of /proc/stat, less idle and
// iowait (guest time is already inside user). -1 where it cannot be read.
int64_t MachineBusyTicks() {
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return -1;
  long long v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int n = std::fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2],
                            &v[3], &v[4], &v[5], &v[6], &v[7]);
  std::fclose(f);
  if (n != 8) return -1;
  // user nice system idle iowait irq softirq steal
  return v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
}

}  // namespace

CpuMeter::CpuMeter()
    : start_wall_ns_(WallNanos()),
      start_process_seconds_(ProcessCpuSeconds()),
      start_busy_ticks_(MachineBusyTicks()) {}

CpuUse CpuMeter::Stop() const {
  CpuUse use;
  use.wall_seconds = (WallNanos() - start_wall_ns_) / 1e9;
  use.machine_core_count = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (use.wall_seconds <= 0) return use;
  use.process_cores = (ProcessCpuSeconds() - start_process_seconds_) / use.wall_seconds;
  const int64_t busy = MachineBusyTicks();
  if (busy >= 0 && start_busy_ticks_ >= 0) {
    use.machine_cores =
        static_cast<double>(busy - start_busy_ticks_) / sysconf(_SC_CLK_TCK) / use.wall_seconds;
  }
  return use;
}

}  // namespace rubato
