// PsClient: a worker's view of the sharded parameter servers.
//
// The model is a list of tensors (proto TensorSpec) in a fixed order; values are passed as one
// float vector per tensor in that order. Each tensor lives on the shard chosen by PlaceTensors
// (common/placement.h), which every worker computes identically. Calls go to all shards at once
// and return when every shard has answered; the first error, prefixed with the shard and its
// address, is returned.
//
// One implementation (CreatePsClient) runs over one ShardChannel per shard
// (worker/ps/shard_channel.h): gRPC, the plain-TCP data plane (CreateGrpcPsClient picks them), or
// shards in the same process (inprocess/in_process_shard_channel.h). Every operation is a FanOut of
// asynchronous calls that end by callback (worker/ps/fan_out.h): a partial push's ticket holds no
// thread, and the synchronous calls start an operation and wait for it. The ring all-reduce
// baseline (worker/ring/allreduce_client.h) is the other PsClient.
//
// Tensor bytes are not copied on the way: a push sends each gradient's memory as a slice, and a
// pull copies the received slices straight into the parameters (common/tensor_wire.h), or the data
// plane reads them there in place; the framing is protobuf's, so the servers see ordinary
// PushRequest and PullResponse messages.
//
// Network faults: a pull or push whose call fails with UNAVAILABLE (connection refused, reset or
// cut) is retried with backoff (100 ms doubling to 2 s) for up to `retry_timeout` from its first
// failure; then it fails naming the shard.
// Retrying is safe: a push is idempotent per (worker, step, tensor), and a pull supersedes the
// same worker's parked one on the shard. Heartbeats go to every shard at once and are not retried
// (the next one follows within a quarter lease). Deadlines and backoffs read options.clock.
#ifndef RUBATO_WORKER_PS_PS_CLIENT_H_
#define RUBATO_WORKER_PS_PS_CLIENT_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/consistency_plan.h"
#include "common/limits.h"
#include "common/security.h"
#include "proto/parameter_server.pb.h"
#include "worker/ps/call_plan.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

class PsClient {
 public:
  virtual ~PsClient() = default;

  // Registers with every shard, offering `initial` values (one per tensor) for shards not yet
  // initialised. Waits up to the connect timeout for servers that are not up yet, or that answer
  // UNAVAILABLE (a shard shutting down to roll back, which another worker may have asked for).
  // Returns the step to compute next: the smallest tensor version over the shards (0 for a new job;
  // later for a worker that rejoins after being dropped).
  virtual absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial,
                                           int32_t batch_size, int64_t resume_step) = 0;

  // Fills `params` (one vector per tensor, resized as needed) with weights of version >= step.
  // If `min_version` is given, it receives the smallest version among the pulled tensors.
  virtual absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                            int64_t* min_version = nullptr) = 0;

  // Sends the gradients computed at `step` (one per tensor).
  // If `result` is given, it receives what the shards reported: dropped gradients summed, and the
  // largest staleness.
  struct PushResult {
    int64_t dropped = 0;
    int64_t max_staleness = 0;
    int64_t min_version = -1;  // WaitPush with a pull: the smallest version pulled (-1: none)
    // bsp, backup: each answering shard's newest noise-scale terms (server/noise_scale.h).
    std::vector<NoiseScaleStats> noise;
    // Adaptive batch: each answering shard's newest batch change (common/batch_plan.h).
    std::vector<BatchChange> batch_changes;
    // Adaptive consistency: each answering shard's newest decision (common/consistency_plan.h).
    std::vector<ConsistencyChange> consistency_changes;
    // The examples in every gradient the job has applied so far, where the client knows it and
    // it is not the steps' (the partial all-reduce, whose rounds carry a varying number of
    // gradients); -1 otherwise.
    int64_t applied_examples = -1;
  };
  virtual absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                            PushResult* result = nullptr) = 0;

  // An asynchronous push of some of the tensors computed at `step` (indices into the model, each
  // at most once per step), for pushing each layer's gradient as soon as the backward pass has
  // produced it. The gradients are sent from `grads` in place (no copy), so the pushed tensors'
  // vectors must not change until WaitPush returns; StartPush returns a ticket, or
  // InvalidArgument for a bad index or size.
  //
  // If `pull_into` is given (one vector per tensor, as for Pull), then as soon as the shards have
  // acknowledged the push, the same ticket pulls those tensors for step + 1 (the weights the next
  // step needs: in BSP the shard answers once every worker's gradient of that tensor is applied)
  // into (*pull_into)[i] for each pushed i, so that the next step's pull of a layer starts as soon
  // as that layer's update can be applied, while the backward pass of the layers below still
  // runs. The caller must not read or write those vectors until WaitPush returns.
  //
  // WaitPush waits for that ticket's calls (with the retries Push and Pull make) and returns their
  // status, adding what the shards reported into *result (min_version: the smallest version
  // pulled, if any) and, if given, setting *timing. Each ticket is waited for once; all of one
  // step's tickets are waited for before the next step. Only clients whose
  // supports_partial_push() is true implement them.
  struct PushTiming {
    absl::Time started;       // StartPush called
    absl::Time acknowledged;  // every shard answered the push
    absl::Time pulled;        // every shard answered the pull (== acknowledged without one)
  };
  virtual bool supports_partial_push() const { return false; }
  virtual absl::StatusOr<int64_t> StartPush(int64_t step, absl::Span<const int> tensors,
                                            absl::Span<const std::vector<float>> grads,
                                            std::vector<std::vector<float>>* pull_into = nullptr);
  virtual absl::Status WaitPush(int64_t ticket, PushResult* result, PushTiming* timing = nullptr);

  // Asynchronous Pull and Push of every tensor, for a caller that must not block (a simulator's
  // event loop drives every worker from one thread: sim/README.md): each starts the operation and
  // returns; `done` runs exactly once, on the thread that ends the last call (possibly the
  // caller's, inside the call), with what Pull or Push would have returned (min_version -1 on
  // error). The vectors must stay valid, and the gradients unchanged, until then; the client must
  // outlive its operations. Only clients whose supports_async() is true implement them; others
  // answer UNIMPLEMENTED at once.
  using PullDone = std::function<void(absl::Status, int64_t min_version)>;
  using PushDone = std::function<void(absl::Status, PushResult)>;
  virtual bool supports_async() const { return false; }
  virtual void StartPull(int64_t step, absl::Span<std::vector<float>> params, PullDone done);
  virtual void StartPushAll(int64_t step, absl::Span<const std::vector<float>> grads,
                            PushDone done);

  // Adds what one ticket's shards reported (`part`) into `total`, as WaitPush does: dropped
  // gradients summed, the largest staleness, the smallest version pulled (-1: none).
  static void AddPushResult(const PushResult& part, PushResult* total);
  // Adds one shard's answer to a push into `result`.
  static void AddPushResponse(const PushResponse& response, PushResult* result);

  // Adaptive batch (common/batch_plan.h): what the following pushes declare: the batch their
  // gradients were computed on (PushRequest.batch_size; 0: the registered one) and the job's noise
  // scale as this worker summed it (PushRequest.noise_relay; none if null).
  void SetPushExtras(int32_t batch_size, const NoiseScaleRelay* relay) {
    push_batch_size_ = batch_size;
    has_push_relay_ = relay != nullptr;
    if (relay != nullptr) push_relay_ = *relay;
  }
  // Adaptive consistency (server/adaptive_policy.h): every following push relays this worker's
  // compute time per step (SetComputeMs) and the decision governing its step, as learned from the
  // shards' answers (AdoptConsistency, which appends to `learned` the decisions new to it and is
  // INTERNAL when two shards disagree).
  void EnableAdaptiveConsistency(int every_steps, int num_workers) {
    absl::MutexLock lock(&consistency_mu_);
    consistency_plan_.emplace(every_steps);
    consistency_workers_ = num_workers;
  }
  // The worker's mean compute time per step lately, and step `step`'s own (relayed in the pushes
  // of step + 1).
  void SetComputeMs(double mean_ms, int64_t step, double step_ms) {
    absl::MutexLock lock(&consistency_mu_);
    compute_ms_ = mean_ms;
    timed_step_ = step;
    step_ms_ = step_ms;
  }
  absl::Status AdoptConsistency(const std::vector<ConsistencyChange>& changes,
                                std::vector<ConsistencyChange>* learned);
  // Adaptive batch: the changes so far, as the last Register's answers gave them (the longest
  // list any shard sent).
  const std::vector<BatchChange>& registered_batch_plan() const { return registered_batch_plan_; }

  virtual absl::Status Heartbeat(int64_t step) = 0;

  // Tells every shard that this worker has finished after `steps` steps (after its last pull), so
  // that the servers stop expecting its heartbeats and end once every worker has finished.
  // Retried while a shard is unreachable, like a push.
  virtual absl::Status Finish(int64_t steps) = 0;

  // Work reassignment (server/work_queue.h): shard 0's answer, retried while it is unreachable
  // (request.request makes a retry safe). UNIMPLEMENTED for a client without parameter servers.
  virtual absl::StatusOr<TakeWorkResponse> TakeWork(const TakeWorkRequest& request) {
    return absl::UnimplementedError("TakeWork needs parameter servers");
  }

  // Placement: the shard of each tensor, and bytes per shard.
  virtual const std::vector<int>& shard_of() const = 0;
  virtual const std::vector<int64_t>& shard_bytes() const = 0;

  // Where the client, not the step count, ends the job: its last step once known (the partial
  // all-reduce, whose rounds go on until they have carried the job's gradients); the loop ends
  // there. Unknown (nullopt) by default.
  virtual std::optional<int64_t> FinalStep() const { return std::nullopt; }

 protected:
  // For the implementations: the PushRequest fields SetPushExtras set, and the plan Register
  // found.
  int32_t push_batch_size_ = 0;
  bool has_push_relay_ = false;
  NoiseScaleRelay push_relay_;
  std::vector<BatchChange> registered_batch_plan_;
  // The relay of a push of `step` (nullopt without adaptive consistency).
  std::optional<ConsistencyRelay> ConsistencyRelayFor(int64_t step) const;
  void KeepBatchPlan(const RegisterResponse& response) {
    if (response.batch_plan_size() > static_cast<int>(registered_batch_plan_.size())) {
      registered_batch_plan_.assign(response.batch_plan().begin(), response.batch_plan().end());
    }
  }

 private:
  mutable absl::Mutex consistency_mu_;
  std::optional<ConsistencyPlan> consistency_plan_ ABSL_GUARDED_BY(consistency_mu_);
  int consistency_workers_ ABSL_GUARDED_BY(consistency_mu_) = 0;
  double compute_ms_ ABSL_GUARDED_BY(consistency_mu_) = 0;
  int64_t timed_step_ ABSL_GUARDED_BY(consistency_mu_) = -1;
  double step_ms_ ABSL_GUARDED_BY(consistency_mu_) = 0;
};

struct PsClientOptions {
  std::vector<std::string> servers;  // host:port per shard.
  int worker_id = 0;
  // The job as this worker sees it; the servers refuse a worker configured for another job.
  int num_workers = 0;
  ConsistencyConfig consistency;
  int64_t steps_per_epoch = 0;  // For the servers' learning-rate schedule.
  int64_t total_steps = 0;
  std::vector<TensorSpec> model;
  // Register waits this long for unreachable servers before failing with UNAVAILABLE.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of one pull or push; should exceed the servers' wait_timeout_ms.
  absl::Duration rpc_timeout = absl::Seconds(150);
  // How long a pull or push rides out an unreachable shard (see above).
  absl::Duration retry_timeout = absl::Seconds(30);
  // Deadline of one heartbeat to each shard.
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  // Channel credentials and this worker's token.
  ClientSecurity security;
  // The job's message limit (ClusterSpec.max_message_bytes): a tensor, or a shard's initial
  // values, that cannot fit is refused at creation.
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  // Push and Pull over a shard's TCP data plane (server/data_plane.h; TLS with the client's TLS
  // credentials) where its Register answer offers one; false: over gRPC only
  // (--ps_transport=grpc).
  bool use_data_plane = true;
  // What deadlines, backoffs and timings read; must outlive the client. Channels read their calls'
  // deadlines on the same clock.
  Clock* clock = Clock::Real();
  // What runs the retries' backoffs: null for a RetryTimer of the client's own (a thread waiting on
  // `clock`); a simulator's event loop (sim/event_loop.h). Its clock must be `clock`; it must
  // outlive the client.
  Timer* timer = nullptr;
  // The size calls are cut to (worker/ps/call_plan.h); tests make it small.
  int64_t target_call_bytes = kTargetCallBytes;
};

// The client over `channels` (channels[s] is shard s; options.servers is not used). InvalidArgument
// as CreateGrpcPsClient.
absl::StatusOr<std::unique_ptr<PsClient>> CreatePsClient(
    const PsClientOptions& options, std::vector<std::unique_ptr<ShardChannel>> channels);

// Over gRPC to options.servers, Push and Pull over each shard's data plane where its Register
// answer offers one (options.use_data_plane), with TLS when the client has TLS.
// InvalidArgument for an empty server list, a bad tensor shape, or a tensor (or a shard's initial
// values, which Register sends in one message) that cannot fit in max_message_bytes, naming the
// --max_message_mb that would.
absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(const PsClientOptions& options);

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_PS_CLIENT_H_
