#include "common/malloc_tuning.h"

#include <cstdlib>  // Defines __GLIBC__ on glibc systems, for the test below.

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "absl/synchronization/mutex.h"

namespace rubato {

void KeepFreedMemory() {
#if defined(__GLIBC__)
  // Blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap; freed
  // memory stays mapped; the heap grows 256 MiB at a time.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
  // One arena. The per-thread arenas that glibc adds are heaps of at most 64 MiB each, and a heap
  // that becomes wholly free is unmapped whatever the trim threshold: gRPC's threads receive
  // tensor-sized messages in them, so a busy server re-faulted those pages every few steps (28% of
  // the samples of a 64 MB, 3-worker transport_benchmark run were page faults). With one arena,
  // 64 MB with 3 workers went from 0.32-0.36 to 0.53 GB/s per worker, and its CPU per byte from
  // 1.4 to 0.86 core-s/GB. The lock this shares costs nothing visible at 1 MB with 3 workers.
  mallopt(M_ARENA_MAX, 1);
#endif
}

void ReturnFreedMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

void SkipMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace rubato
