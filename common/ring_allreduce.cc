#include "common/ring_allreduce.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

// Chunk c of a vector of n elements split into `size` chunks: [begin, end).
int64_t ChunkBegin(int64_t n, int size, int c) {
  const int64_t base = n / size, extra = n % size;
  return c * base + std::min<int64_t>(c, extra);
}

int Mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

absl::Status RingAllReduceMean(int rank, int size, int64_t round, RingLink* link,
                               absl::Span<float> data, absl::Duration timeout,
                               int64_t segment_elements) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is not in [0, ", size, ")"));
  }
  if (segment_elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_elements must be >= 1, got ", segment_elements));
  }
  if (size == 1) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + timeout;
  const int64_t n = static_cast<int64_t>(data.size());
  auto chunk = [&](int c) {
    const int64_t begin = ChunkBegin(n, size, c);
    return data.subspan(begin, ChunkBegin(n, size, c + 1) - begin);
  };
  // Tags: round, phase (0 reduce-scatter, 1 all-gather), step, segment.
  const int64_t segments_max = (n / size + 1 + segment_elements - 1) / segment_elements;
  auto tag = [&](int phase, int step, int64_t segment) {
    return ((round * 2 + phase) * size + step) * segments_max + segment;
  };
  auto segment = [&](absl::Span<float> c, int64_t s) {
    const int64_t begin = std::min<int64_t>(s * segment_elements, c.size());
    return c.subspan(begin, std::min<int64_t>(segment_elements, c.size() - begin));
  };
  auto count = [&](absl::Span<float> c) {
    return std::max<int64_t>(
        1, (static_cast<int64_t>(c.size()) + segment_elements - 1) / segment_elements);
  };
  std::vector<float> incoming(std::min<int64_t>(segment_elements, n / size + 1));
  for (int step = 0; step < size - 1; ++step) {
    const absl::Span<float> out = chunk(Mod(rank - step, size));
    for (int64_t s = 0; s < count(out); ++s) {
      RETURN_IF_ERROR(link->Send(tag(0, step, s), segment(out, s)));
    }
    const absl::Span<float> into = chunk(Mod(rank - step - 1, size));
    for (int64_t s = 0; s < count(into); ++s) {
      const absl::Span<float> part = segment(into, s);
      const absl::Span<float> buffer = absl::MakeSpan(incoming).subspan(0, part.size());
      RETURN_IF_ERROR(link->Receive(tag(0, step, s), buffer, deadline));
      for (size_t i = 0; i < part.size(); ++i) part[i] += buffer[i];
    }
  }
  // Rank r now owns the sum of chunk (r + 1) mod size: scale it once, then pass it around.
  const float inv = 1.0f / static_cast<float>(size);
  for (float& x : chunk(Mod(rank + 1, size))) x *= inv;
  for (int step = 0; step < size - 1; ++step) {
    const absl::Span<float> out = chunk(Mod(rank + 1 - step, size));
    for (int64_t s = 0; s < count(out); ++s) {
      RETURN_IF_ERROR(link->Send(tag(1, step, s), segment(out, s)));
    }
    const absl::Span<float> into = chunk(Mod(rank - step, size));
    for (int64_t s = 0; s < count(into); ++s) {
      RETURN_IF_ERROR(link->Receive(tag(1, step, s), segment(into, s), deadline));
    }
  }
  return absl::OkStatus();
}

}  // namespace rubato
