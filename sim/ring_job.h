// RingJob: the ring all-reduce baseline (`--mode allreduce`) and its partial variants
// (`allreduce:majority`, `allreduce:solo`) in simulated time, for the parameter-server versus
// all-reduce comparisons at scale (sim/README.md).
//
// Unlike TimingJob, this does not run Rubato's ring code: RingAllReduceMean and PartialAllReduce
// are written for one thread per rank that blocks on its link, which an event loop of thousands of
// ranks cannot host. It runs their schedules instead, block by block, on the network model's
// terms (sim/network.h: a block of B bytes leaves a NIC at its rate after the blocks queued before
// it, and arrives `latency` later):
//
//   The synchronous ring (common/ring_allreduce.h, Patarasuk & Yuan 2009): a step's all-reduce
//   starts on each rank when its gradient is ready. N chunks of ceil(elements / N) floats, each
//   cut into segments of DefaultRingSegmentElements (the real choice); in step k = 0..2N-3 a rank
//   sends segment s of its step-k chunk as soon as it has received (and added) segment s of step
//   k-1 from the previous rank, and only once it has started itself. Its all-reduce ends when its
//   last block has arrived and the next rank has every block it sent (the real Flush).
//
//   The partial all-reduce (worker/ring/partial_allreduce.h, Li et al., PPoPP 2020): rounds of an
//   all-reduce of elements + 1 floats that go on once `quorum` ranks have a gradient pending. solo
//   (quorum 1): a rank with a gradient pending and its communication free starts the round; the
//   others join when the previous rank's first block reaches them (so activation travels around
//   the ring). Larger quorums first poll: an all-reduce of one float started by a rank whose
//   readiness changed since the last poll, joined likewise, counting the ranks ready when they
//   joined; the round follows the first poll that counts a quorum. A rank's gradient is carried by
//   the first round it is pending at the start of; its worker then computes the next one (a
//   worker waits in Contribute until its gradient is applied). The job ends once its rounds have
//   carried steps x workers gradients (the synchronous job's examples); gradients still pending
//   are dropped.
//
// With a Workload (the training level, sim/workload.h) every rank computes its real gradient on
// the weights of the moment it starts computing, and the ranks apply what the real ring computes:
// the synchronous ring's mean in its own float operations and order (RingReduceInOrder, so the
// weights are those of a real `--mode allreduce` job bit for bit), a partial round's sum of the
// gradients it carried times one over their count; each with cluster.optimizer and its
// lr_schedule, as AllReduceClient does (the partial rounds at the schedule's step of the
// gradients applied so far). The workload writes each rank's records; a rank whose gradient a
// partial round carried goes on from the rounds done, skipping steps, as the training loop does.
//
// Assumptions beyond the network model's: one rank per host (each NIC direction carries one flow,
// the ring's); every chunk has ceil(elements / N) floats; a block costs its floats plus
// kRingBlockOverheadBytes of framing; adding a block, applying the update and the polls' counting
// take no time (as a shard's apply does in TimingJob by default); no failures.
#ifndef RUBATO_SIM_RING_JOB_H_
#define RUBATO_SIM_RING_JOB_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/cluster.pb.h"
#include "sim/network.h"
#include "sim/step_times.h"
#include "sim/timing_job.h"
#include "sim/workload.h"
#include "worker/straggler_model.h"

namespace rubato {

// A block's header and the transport's framing (worker/ring/ring_codec.h: rank, tag, length).
inline constexpr int64_t kRingBlockOverheadBytes = 32;

struct RingJobOptions {
  int workers = 1;
  int64_t elements = 0;  // One gradient's floats (the model's).
  // Ranks that must have a gradient pending before a round goes on: workers for the synchronous
  // ring (its steps), 1 for solo, (workers + 1) / 2 for majority.
  int quorum = 1;
  bool partial = false;  // false: the synchronous ring (quorum must be workers).
  int64_t steps = 100;   // Every worker's (partial: steps x workers gradients in all).
  absl::Duration step_time = absl::Milliseconds(20);
  const StepTimes* step_times = nullptr;     // Not owned; if given, drawn from, not step_time.
  std::vector<StragglerOptions> stragglers;  // Worker w's (empty: none).
  HostSpec host;                             // Every rank's host (its NIC).
  int64_t segment_elements = 0;              // 0: DefaultRingSegmentElements.
  // The training level (not owned; must outlive the run): the model, gradients, compute times and
  // records, in place of `elements` and `step_time`; the ranks apply cluster.optimizer() with
  // cluster.lr_schedule() for a global batch of workers x batch_size.
  Workload* workload = nullptr;
  ClusterSpec cluster;
  int batch_size = 64;
  int64_t steps_per_epoch = 0;  // For the schedule (0: steps).
};

// INVALID_ARGUMENT naming the first bad option.
absl::Status ValidateRingJobOptions(const RingJobOptions& options);

// Sets options->partial and quorum for an ALLREDUCE consistency of options->workers ranks (the
// real PartialQuorum); INVALID_ARGUMENT for another mode.
absl::Status SetRingConsistency(const ConsistencyConfig& consistency, RingJobOptions* options);

// The time each rank ends one all-reduce of `elements` floats that rank r starts at start[r]
// (seconds), over links of `host`'s NIC. *blocks, if given, is increased by the blocks sent.
std::vector<double> RingAllReduceEnds(const std::vector<double>& start, int64_t elements,
                                      int64_t segment_elements, const HostSpec& host,
                                      int64_t* blocks = nullptr);

// Runs the job. In the result, `events` counts the blocks sent, dropped_gradients the gradients
// pending when a partial job ended, and a worker's skipped_steps is 0; shard fields are empty.
absl::StatusOr<TimingJobResult> RunRingJob(const RingJobOptions& options);

}  // namespace rubato

#endif  // RUBATO_SIM_RING_JOB_H_
