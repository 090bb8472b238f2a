// RingAllReduceMean: the bandwidth-optimal all-reduce of Patarasuk & Yuan (2009), over an abstract
// link to the ring's neighbours, so the algorithm is tested in-process and a gRPC link
// (worker/ring/ring_peer.h) carries it between processes.
//
// N ranks each hold a vector of the same length, split into N chunks (lengths differ by at most
// one). Reduce-scatter: in step k = 0..N-2 rank r sends chunk (r - k) mod N to rank r+1 and adds
// the chunk (r - k - 1) mod N it receives from rank r-1; afterwards rank r holds the full sum of
// chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished chunks around. Each rank sends
// and receives 2(N-1)/N of the vector, the lower bound for a ring. Every rank ends with
// bit-identical values: each chunk's sum is computed once, by one rank, and copied to the others.
//
// Pipelining. Every chunk is cut into segments, and the block a rank sends at step k+1 is exactly
// the block it received (and combined) at step k. So the ring runs segment by segment rather than
// step by step: as soon as segment s of step k has arrived and been added, it is queued for the
// next rank, while segment s+1 of step k is still on the wire. Sends never wait for the receiver;
// the link queues them in order. With S bytes and segments of G bytes the last byte arrives about
// 2(N-1)/N * S/B + 2(N-1) * G/B after the first is sent (B the link bandwidth), instead of
// 2(N-1) * (S/N)/B with no overlap between a step's receive, its addition and the next send.
// Blocks are sent from `data` itself, without a copy, so sent memory must not change before the
// next rank has the block. Within a call, one region that was sent is written again: all-gather
// step j overwrites the chunk this rank sent in reduce-scatter step j. That is safe without any
// wait: the block that overwrites it carries the chunk's final sum, which exists only after rank
// r+1 added this rank's block to it. At the end, Flush waits for the next rank to have every block
// this call sent (the all-gather ones carry no such guarantee), so the caller may reuse `data`.
#ifndef RUBATO_COMMON_RING_ALLREDUCE_H_
#define RUBATO_COMMON_RING_ALLREDUCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace rubato {

// A rank's connection to its ring neighbours. Blocks carry tags, so a block that arrives before it
// is asked for waits for its turn and a block out of place is detected.
class RingLink {
 public:
  enum class Combine { kAdd, kCopy };

  virtual ~RingLink() = default;
  // Waits until `deadline` for the transport's connections to both neighbours, where it has any
  // to set up, so that the ranks' start-up times do not count against the first all-reduce's
  // timeout. DEADLINE_EXCEEDED names the neighbour that did not connect. By default there is
  // nothing to wait for (the first Send or Receive connects).
  virtual absl::Status Connect(absl::Time /*deadline*/) { return absl::OkStatus(); }
  // Queues `data` for the next rank under `tag` and returns without waiting for it to be delivered.
  // Blocks leave in the order they were queued, and their tags must increase (those of
  // RingAllReduceMean do, over calls with increasing `round` and the same length and segment
  // size); a receiver may reject a block that breaks the order. The link may read `data` (without
  // copying it) until the next rank has received the block, so the caller must not change it
  // before (Flush tells). Fails at once if the link has already failed.
  virtual absl::Status Send(int64_t tag, absl::Span<const float> data) = 0;
  // Waits until `deadline` for the next rank to have received every block queued so far:
  // DEADLINE_EXCEEDED naming the next rank otherwise. Afterwards their memory is the caller's.
  virtual absl::Status Flush(absl::Time deadline) = 0;
  // Waits until `deadline` for the block sent under `tag` by the previous rank, and adds it to
  // `out` (kAdd) or copies it there (kCopy). Its size must equal out.size(). DEADLINE_EXCEEDED
  // names the previous rank.
  virtual absl::Status Receive(int64_t tag, absl::Span<float> out, Combine combine,
                               absl::Time deadline) = 0;
  // Waits until `deadline` for the previous rank's next block (or the end of its connection) to
  // start arriving, without taking it: true if it has, false at the deadline, which leaves the link
  // as it was (unlike Receive's). An error if the link has already failed. Lets a rank that has
  // nothing to send yet learn that another rank started an operation (the partial all-reduce,
  // worker/ring/partial_allreduce.h). UNIMPLEMENTED by default.
  virtual absl::StatusOr<bool> Incoming(absl::Time /*deadline*/) {
    return absl::UnimplementedError("this ring link cannot wait for incoming blocks");
  }
};

// Replaces `data` on every rank by the element-wise mean over the `size` ranks. All ranks must call
// it with the same length, segment size and `round` (a per-call counter that keeps tags of
// successive calls apart). Fails with the link's error, or DEADLINE_EXCEEDED once `timeout` has
// passed. `segment_elements` is the largest block sent (see Pipelining above); 0 picks one from
// the length: half a chunk, between 64 Ki and 256 Ki floats (256 KiB to 1 MiB; per-block costs
// made smaller segments slower on loopback, see experiments/allreduce_benchmark --segment_kb).
absl::Status RingAllReduceMean(int rank, int size, int64_t round, RingLink* link,
                               absl::Span<float> data, absl::Duration timeout,
                               int64_t segment_elements = 0);

// Replaces `data` on every rank by the element-wise sum over the ranks, like RingAllReduceMean but
// with tags from `*next_tag` on (all ranks must pass the same value), which it advances past the
// tags it used, so that calls of different lengths can follow one another on one link.
absl::Status RingAllReduceSum(int rank, int size, int64_t* next_tag, RingLink* link,
                              absl::Span<float> data, absl::Duration timeout,
                              int64_t segment_elements = 0);

// The segment length RingAllReduceMean uses for `n` elements over `size` ranks when given 0.
int64_t DefaultRingSegmentElements(int64_t n, int size);

// What RingAllReduceMean (scale: 1 / ranks) or RingAllReduceSum (scale: 1) leaves on every rank
// when rank r holds inputs[r], computed in one place with the ring's float operations in its
// order: chunk c is summed from rank c's values on around the ring, then multiplied by `scale`
// unless it is 1. So a simulation of the ring (sim/ring_job.h) trains on bit-identical means.
// Every input and `out` must have the same length. With `ranks` (increasing, not empty), only
// those ranks' inputs are read and the others count as zeros (skipping the zeros the ring would
// add leaves every sum as it is, but for the sign of a zero sum), so a sum of a few ranks' values
// out of many costs what those few do (the partial all-reduce's rounds).
void RingReduceInOrder(absl::Span<const absl::Span<const float>> inputs, float scale,
                       absl::Span<float> out, absl::Span<const int> ranks = {});
// The scale RingAllReduceMean applies for `size` ranks.
float RingMeanScale(int size);

}  // namespace rubato

#endif  // RUBATO_COMMON_RING_ALLREDUCE_H_
