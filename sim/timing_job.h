// TimingJob: one parameter-server job run in simulated time (sim/README.md).
//
// The real ParameterShard (its consistency policy, aggregation, membership, parked pulls and
// optimizer) and the real sharded PsClient (placement, call plan, codec, fan-out, gates, retries)
// of every worker run on one thread, driven by an EventLoop; their calls cross a simulated Network
// (SimShardChannel). Each worker's step is the training loop's: pull the weights its step needs,
// compute for the step time its StragglerModel gives (the same flags and patterns as
// rubato_worker), push the gradients, and go on; under backup:b (and adaptive) a worker whose pull
// comes back newer skips to that step, as the loop does. Under adaptive consistency each worker
// relays its compute times and adopts the shards' decisions after each push, as the training
// loop does (TrainingLoop::AdoptConsistency), so the real shards decide. At the timing level no
// model is trained: each tensor is held and sent at 1 / scale of its size, its bytes counted in
// full by the network and the shards' processors, so that thousands of workers of a large model fit
// in one process. At the training level a Workload (sim/workload.h) computes each worker's real
// gradients and reports what the worker would; each worker then pulls the final weights before it
// finishes.
//
// What is not simulated (yet): work reassignment (refused), failures and heartbeats (leases are
// set beyond the run), and the overlap of pushes with the backward pass. The rings are
// sim/ring_job.h's.
#ifndef RUBATO_SIM_TIMING_JOB_H_
#define RUBATO_SIM_TIMING_JOB_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"
#include "sim/network.h"
#include "sim/step_times.h"
#include "sim/workload.h"
#include "worker/straggler_model.h"

namespace rubato {

struct TimingJobOptions {
  // The job: num_workers, consistency (bsp, backup:b, ssp:s, async, adaptive), optimizer,
  // wait_timeout_ms.
  // Leases are set to a day (no failures are simulated, no heartbeats sent).
  ClusterSpec cluster;
  int shards = 1;
  // Each tensor's elements, as the real model has them (the timing level).
  std::vector<int64_t> tensor_elements;
  // >= 1: each tensor is held at ceil(elements / scale) elements (the timing level).
  int64_t scale = 1;
  // The training level (not owned; must outlive the run): the workload's model, weights,
  // gradients and compute times, in place of tensor_elements, zeros and step_time. scale must be
  // 1.
  Workload* workload = nullptr;
  int64_t steps = 100;          // Every worker's.
  int64_t steps_per_epoch = 0;  // For the shards' schedules (0: steps).
  int batch_size = 64;          // Per worker (for the shards' schedule).
  // One step's compute before each worker's StragglerModel adds to it; or, if step_times is
  // given (not owned; must outlive the run), each worker's draw from that measured distribution.
  absl::Duration step_time = absl::Milliseconds(20);
  const StepTimes* step_times = nullptr;
  // Worker w's injected delays (empty: none).
  std::vector<StragglerOptions> stragglers;
  // Hosts: workers_per_host workers on each worker host, shards_per_host shards on each server
  // host (servers on hosts of their own).
  HostSpec worker_host;
  HostSpec server_host;
  int workers_per_host = 1;
  int shards_per_host = 1;
  // Every worker and shard on one host (worker_host's spec), all talking through its loopback: a
  // local launch. The two fields above are then ignored.
  bool colocated = false;
  // How fast a shard applies pushed gradients (bytes of gradient a second; infinite: no time).
  double apply_bytes_per_second = std::numeric_limits<double>::infinity();
};

// The largest scale the job allows: bsp pushes a tensor larger than its part size in parts, and a
// held part may not be smaller than a client accepts (worker/ps/recovery.h). Unbounded (INT64_MAX)
// otherwise.
int64_t MaxScale(const TimingJobOptions& options);

// INVALID_ARGUMENT naming the first bad option; UNIMPLEMENTED for a mode the simulator does not
// run.
absl::Status ValidateTimingJobOptions(const TimingJobOptions& options);

struct TimingJobResult {
  // Simulated time from the start to the last worker's last push acknowledged.
  absl::Duration wall;
  struct Worker {
    int64_t computed_steps = 0;
    int64_t skipped_steps = 0;
    int64_t dropped_pushes = 0;  // Pushes of which a shard dropped a gradient (backup:b).
    absl::Duration compute;      // Step times and injected delays.
    absl::Duration waiting;      // In pulls and pushes.
    absl::Duration finished;     // From the start.
  };
  std::vector<Worker> workers;
  int64_t dropped_gradients = 0;
  // Each shard's statistics at the end (as a real server reports them).
  std::vector<GetStatsResponse> shard_stats;
  // Busy fraction of the busiest shard host's NIC, in and out, over the run.
  double max_shard_nic_in = 0;
  double max_shard_nic_out = 0;
  int64_t events = 0;
  double real_seconds = 0;  // Wall-clock time the simulation took.
};

// Runs the job to its end. An error of a worker's call (a timeout naming whom it waited for) ends
// the simulation with that error.
absl::StatusOr<TimingJobResult> RunTimingJob(const TimingJobOptions& options);

}  // namespace rubato

#endif  // RUBATO_SIM_TIMING_JOB_H_
