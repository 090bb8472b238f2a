// RingAllReduce: the bandwidth-optimal all-reduce of Patarasuk & Yuan (2009), over an abstract link
// to the ring's neighbours, so the algorithm is tested in-process and a gRPC link can carry it.
//
// N ranks each hold a vector of the same length, split into N chunks (lengths differ by at most
// one). Reduce-scatter: in step k = 0..N-2 rank r sends chunk (r - k) mod N to rank r+1 and adds
// the chunk (r - k - 1) mod N it receives from rank r-1; afterwards rank r holds the full sum of
// chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished chunks around. Each rank sends
// and receives 2(N-1)/N of the vector, the lower bound for a ring. Every rank ends with
// bit-identical values: each chunk's sum is computed once, by one rank, and copied to the others.
//
// Status: the algorithm and its in-process tests. The gRPC link, pipelining of large chunks, the
// `allreduce` training mode and the benchmarks against OpenMPI and Gloo are issue 5's remaining
// work.
#ifndef RUBATO_COMMON_RING_ALLREDUCE_H_
#define RUBATO_COMMON_RING_ALLREDUCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace rubato {

// A rank's connection to its ring neighbours. Blocks are tagged so that a message that arrives
// early (the sender is a step ahead) waits for its turn.
class RingLink {
 public:
  virtual ~RingLink() = default;
  // Sends `data` to the next rank under `tag`.
  virtual absl::Status Send(int64_t tag, absl::Span<const float> data) = 0;
  // Receives the block sent under `tag` by the previous rank into `out` (its size must match),
  // waiting until `deadline`: DEADLINE_EXCEEDED naming the previous rank otherwise.
  virtual absl::Status Receive(int64_t tag, absl::Span<float> out, absl::Time deadline) = 0;
};

// Replaces `data` on every rank by the element-wise mean over the `size` ranks. All ranks must call
// it with the same length and `round` (a per-call counter that keeps tags of successive calls
// apart). Fails with the link's error, or DEADLINE_EXCEEDED once `timeout` has passed.
//
// Each chunk travels in segments of at most `segment_elements` floats (4 MiB by default), so that
// no message is large: all ranks send their segments at once, and a segment is added as soon as it
// is received.
absl::Status RingAllReduceMean(int rank, int size, int64_t round, RingLink* link,
                               absl::Span<float> data, absl::Duration timeout,
                               int64_t segment_elements = int64_t{1} << 20);

}  // namespace rubato

#endif  // RUBATO_COMMON_RING_ALLREDUCE_H_
