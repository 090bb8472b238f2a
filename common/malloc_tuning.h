// KeepFreedMemory: make glibc's allocator reuse large freed blocks instead of returning them to the
// kernel, for processes that allocate and free tensor-sized buffers every step.
//
// Every push and pull builds protobuf messages whose byte fields are tensor-sized. By default glibc
// serves each block above its mmap threshold (128 KiB, adapting) with a fresh mmap and unmaps it on
// free, and trims the heap top, so every step faults in new pages: one fault per 4 KiB, and each
// fault is expensive under this machine's hypervisor. Measured with
// experiments/transport_benchmark (push+pull of a 16 MB model against an in-process shard):
// 0.45 GB/s by default, 2.6 GB/s with these settings. It also keeps all threads in glibc's one main
// arena: see malloc_tuning.cc for why and what that measured.
#ifndef RUBATO_COMMON_MALLOC_TUNING_H_
#define RUBATO_COMMON_MALLOC_TUNING_H_

namespace rubato {

// Call once, early in main, before other threads start. A no-op outside glibc.
void KeepFreedMemory();

// Gives freed memory back to the kernel now (malloc_trim). KeepFreedMemory keeps it for reuse,
// which is right in steady state; after a transient peak (a burst of large messages, refused or
// not) a server calls this periodically so that its resident size comes back down.
void ReturnFreedMemory();

// Turns off abseil's Mutex deadlock detection, which Debian's abseil leaves on (it is built without
// NDEBUG; upstream's release builds have it off). It records every lock in a process-wide graph
// under one global lock: GraphCycles was 0.3-0.4% of the samples of the demo and of a 16 MB,
// 3-worker transport benchmark, and is gone with it off. The throughput gain is within this
// machine's noise (1.17 -> 1.19 GB/s at 1 MB with 1 worker, 0.521 -> 0.535 at 16 MB with 3,
// medians of 3 interleaved runs). Unit tests keep it on. Call once, early in main.
void SkipMutexDeadlockDetection();

}  // namespace rubato

#endif  // RUBATO_COMMON_MALLOC_TUNING_H_
