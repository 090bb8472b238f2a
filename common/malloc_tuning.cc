#include "common/malloc_tuning.h"

#include <cstdlib>  // Defines __GLIBC__ on glibc systems, for the test below.

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace rubato {

void KeepFreedMemory() {
#if defined(__GLIBC__)
  // Blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap; freed
  // memory stays mapped; the heap grows 256 MiB at a time.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
#endif
}

void ReturnFreedMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace rubato
