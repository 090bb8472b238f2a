// CPU accounting for the transport benchmarks: how many of the machine's cores a measurement kept
// busy, so that a throughput can be read against the CPU it cost (on a 2-core machine the loopback
// stream itself may already use both cores, and then nothing that also copies through the kernel
// can beat it).
#ifndef RUBATO_EXPERIMENTS_CPU_METER_H_
#define RUBATO_EXPERIMENTS_CPU_METER_H_

#include <cstdint>

namespace rubato {

// What a measurement window cost.
struct CpuUse {
  double wall_seconds = 0;
  double process_cores = 0;  // This process's user + system CPU seconds / wall seconds.
  double machine_cores = 0;  // Every core's non-idle time (/proc/stat) / wall seconds.
  int machine_core_count = 0;
};

// Started at construction; Stop() reads the window. Process time comes from getrusage, machine
// time from /proc/stat (0 where it cannot be read), so softirq work that the kernel accounts to no
// process (loopback TCP's receive path, say) is counted in machine_cores.
class CpuMeter {
 public:
  CpuMeter();
  CpuUse Stop() const;

 private:
  int64_t start_wall_ns_;
  double start_process_seconds_;
  int64_t start_busy_ticks_;
};

}  // namespace rubato

#endif  // RUBATO_EXPERIMENTS_CPU_METER_H_
