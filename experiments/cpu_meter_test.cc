#include "experiments/cpu_meter.h"

#include <time.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace rubato {
namespace {

double ProcessCpuSecondsNow() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

// Spins until this process has used `seconds` of CPU, however long that takes on a loaded machine.
void Burn(double seconds) {
  const double until = ProcessCpuSecondsNow() + seconds;
  volatile double sink = 0;
  while (ProcessCpuSecondsNow() < until) {
    for (int i = 0; i < 10000; ++i) sink = sink + i;
  }
}

TEST(CpuMeterTest, CountsTheCpuThisProcessUsed) {
  const CpuMeter meter;
  Burn(0.3);
  const CpuUse use = meter.Stop();
  ASSERT_GT(use.wall_seconds, 0);
  EXPECT_GE(use.machine_core_count, 1);
  const double process_seconds = use.process_cores * use.wall_seconds;
  EXPECT_GE(process_seconds, 0.29);
  EXPECT_LE(process_seconds, use.wall_seconds * use.machine_core_count + 0.05);
  // /proc/stat counts in clock ticks (10 ms here): the machine was busy at least while we were.
  EXPECT_GE(use.machine_cores * use.wall_seconds, 0.25);
}

TEST(CpuMeterTest, ASleepCostsAlmostNothing) {
  const CpuMeter meter;
  usleep(300 * 1000);
  const CpuUse use = meter.Stop();
  EXPECT_GE(use.wall_seconds, 0.29);
  EXPECT_LT(use.process_cores, 0.2);
}

}  // namespace
}  // namespace rubato
