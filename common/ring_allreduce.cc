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

int64_t DefaultRingSegmentElements(int64_t n, int size) {
  const int64_t chunk = n / std::max(size, 1) + 1;
  return std::clamp<int64_t>(chunk / 2, int64_t{64} << 10, int64_t{256} << 10);
}

namespace {

// The ring itself. Tags start at `first_tag` (or at `round` times the tags of one call, when
// first_tag < 0); `*tags_used` gets how many this call used. Each rank's finished chunk is
// multiplied by `scale` unless it is 1.
absl::Status RingAllReduce(int rank, int size, int64_t round, int64_t first_tag, RingLink* link,
                           absl::Span<float> data, absl::Duration timeout, int64_t segment_elements,
                           float scale, int64_t* tags_used) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is not in [0, ", size, ")"));
  }
  if (segment_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_elements must be >= 0, got ", segment_elements));
  }
  *tags_used = 0;
  if (size == 1) {
    if (scale != 1.0f) {
      for (float& x : data) x *= scale;
    }
    return absl::OkStatus();
  }
  const int64_t n = static_cast<int64_t>(data.size());
  if (segment_elements == 0) segment_elements = DefaultRingSegmentElements(n, size);
  const absl::Time deadline = absl::Now() + timeout;
  auto chunk = [&](int c) {
    const int64_t begin = ChunkBegin(n, size, Mod(c, size));
    return data.subspan(begin, ChunkBegin(n, size, Mod(c, size) + 1) - begin);
  };
  // Steps 0..size-2 reduce-scatter, steps size-1..2size-3 all-gather. The chunk received at step k
  // is the chunk sent at step k+1.
  const int steps = 2 * (size - 1);
  auto sent_chunk = [&](int k) { return k < size - 1 ? chunk(rank - k) : chunk(rank + size - k); };
  auto received_chunk = [&](int k) {
    return k < size - 1 ? chunk(rank - k - 1) : chunk(rank + size - 1 - k);
  };
  // Every chunk has at least one segment (possibly empty), so each step sends at least one block.
  auto segments = [&](absl::Span<float> c) {
    return std::max<int64_t>(
        1, (static_cast<int64_t>(c.size()) + segment_elements - 1) / segment_elements);
  };
  auto segment = [&](absl::Span<float> c, int64_t s) {
    const int64_t begin = std::min<int64_t>(s * segment_elements, c.size());
    return c.subspan(begin, std::min<int64_t>(segment_elements, c.size() - begin));
  };
  // Tags: (round, step, segment), unique within and across calls with the same segment length.
  const int64_t segments_max = segments(chunk(0));
  *tags_used = steps * segments_max;
  const int64_t base = first_tag >= 0 ? first_tag : round * *tags_used;
  auto tag = [&](int k, int64_t s) { return base + k * segments_max + s; };

  const absl::Span<float> first = sent_chunk(0);
  for (int64_t s = 0; s < segments(first); ++s) {
    RETURN_IF_ERROR(link->Send(tag(0, s), segment(first, s)));
  }
  for (int k = 0; k < steps; ++k) {
    const absl::Span<float> into = received_chunk(k);
    const RingLink::Combine combine =
        k < size - 1 ? RingLink::Combine::kAdd : RingLink::Combine::kCopy;
    for (int64_t s = 0; s < segments(into); ++s) {
      const absl::Span<float> part = segment(into, s);
      // All-gather steps overwrite chunks sent earlier; see the header on why that is safe.
      RETURN_IF_ERROR(link->Receive(tag(k, s), part, combine, deadline));
      // The last reduce-scatter step completes this rank's chunk: scale it once, here.
      if (k == size - 2 && scale != 1.0f) {
        for (float& x : part) x *= scale;
      }
      if (k + 1 < steps) RETURN_IF_ERROR(link->Send(tag(k + 1, s), part));
    }
  }
  return link->Flush(deadline);
}

}  // namespace

float RingMeanScale(int size) { return 1.0f / static_cast<float>(std::max(size, 1)); }

absl::Status RingAllReduceMean(int rank, int size, int64_t round, RingLink* link,
                               absl::Span<float> data, absl::Duration timeout,
                               int64_t segment_elements) {
  int64_t tags = 0;
  return RingAllReduce(rank, size, round, /*first_tag=*/-1, link, data, timeout, segment_elements,
                       RingMeanScale(size), &tags);
}

void RingReduceInOrder(absl::Span<const absl::Span<const float>> inputs, float scale,
                       absl::Span<float> out, absl::Span<const int> ranks) {
  const int size = static_cast<int>(inputs.size());
  if (size == 0) return;
  const int64_t n = static_cast<int64_t>(out.size());
  std::vector<int> all;
  if (ranks.empty()) {
    all.resize(size);
    for (int r = 0; r < size; ++r) all[r] = r;
    ranks = all;
  }
  const int m = static_cast<int>(ranks.size());
  for (int c = 0; c < size; ++c) {
    // Rank c sends its chunk c; each next rank adds its own to what it received (kAdd): the
    // ranks in order from c around the ring.
    const int first =
        static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), c) - ranks.begin());
    for (int64_t i = ChunkBegin(n, size, c); i < ChunkBegin(n, size, c + 1); ++i) {
      float sum = inputs[ranks[first % m]][i];
      for (int k = 1; k < m; ++k) sum = sum + inputs[ranks[(first + k) % m]][i];
      out[i] = scale != 1.0f ? sum * scale : sum;
    }
  }
}

absl::Status RingAllReduceSum(int rank, int size, int64_t* next_tag, RingLink* link,
                              absl::Span<float> data, absl::Duration timeout,
                              int64_t segment_elements) {
  if (*next_tag < 0) {
    return absl::InvalidArgumentError(absl::StrCat("next tag must be >= 0, got ", *next_tag));
  }
  int64_t tags = 0;
  RETURN_IF_ERROR(RingAllReduce(rank, size, /*round=*/0, *next_tag, link, data, timeout,
                                segment_elements, 1.0f, &tags));
  *next_tag += tags;
  return absl::OkStatus();
}

}  // namespace rubato
