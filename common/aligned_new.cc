// In the AVX2 build (bazel/isa.bzl) every operator new returns 32-byte aligned memory, so that a
// run's results do not depend on where the allocator put its buffers. Eigen's vector loops and
// reductions split a buffer at its first 32-byte boundary; with glibc's 16-byte alignment that
// boundary moves from run to run, and with it the rounding of every sum over a buffer: two runs
// of the same bsp job then end on different weights, and a resumed one differs from an
// uninterrupted one. The baseline build needs nothing (16-byte SSE vectors: every malloc is
// aligned for them), and gets nothing from this file.
#if defined(__AVX2__)

#include <stdlib.h>

#include <cstddef>
#include <new>

namespace {

constexpr std::size_t kAlignment = 32;

void* Allocate(std::size_t size) noexcept {
  void* p = nullptr;
  return posix_memalign(&p, kAlignment, size == 0 ? 1 : size) == 0 ? p : nullptr;
}

void* AllocateOrThrow(std::size_t size) {
  for (;;) {
    if (void* p = Allocate(size)) return p;
    std::new_handler handler = std::get_new_handler();
    if (handler == nullptr) throw std::bad_alloc();
    handler();
  }
}

}  // namespace

void* operator new(std::size_t size) { return AllocateOrThrow(size); }
void* operator new[](std::size_t size) { return AllocateOrThrow(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return Allocate(size); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return Allocate(size); }
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, std::size_t) noexcept { free(p); }
void operator delete[](void* p, std::size_t) noexcept { free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { free(p); }

#endif  // __AVX2__
