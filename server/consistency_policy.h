// ConsistencyPolicy: what one consistency mode (ClusterSpec.consistency) decides, as an interface
// with one class per mode. The shard (server/parameter_shard.h) and each tensor
// (server/tensor_aggregator.h) hold the state and ask the policy; neither branches on the mode.
// The modes themselves are defined in docs/consistency.md:
//   bsp       server/bsp_policy.h      every member's gradient, summed in worker-id order
//   backup:b  server/backup_policy.h   members - b gradients; later ones dropped
//   async     server/async_policy.h    each gradient applied alone on arrival
//   ssp:s     server/ssp_policy.h      as async, with pulls bounded by the slowest member's clock
//   adaptive  server/adaptive_policy.h bsp, backup:b or ssp:s (in steps), chosen every K steps
// bsp, backup and adaptive share StepPolicy (gradients gathered into steps, server/step_policy.h);
// async and ssp share ArrivalPolicy (applied on arrival, server/arrival_policy.h).
//
// To add a mode: a value in proto/cluster.proto's ConsistencyMode and its spelling in
// common/cluster_spec.cc, a class here (usually derived from StepPolicy or ArrivalPolicy), and
// its line in consistency_policy.cc's table. Nothing in the shard changes.
#ifndef RUBATO_SERVER_CONSISTENCY_POLICY_H_
#define RUBATO_SERVER_CONSISTENCY_POLICY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/lr_schedule.h"
#include "proto/cluster.pb.h"
#include "server/membership.h"

namespace rubato {

class AdaptivePolicy;

class ConsistencyPolicy {
 public:
  // The policy of config.mode(); INVALID_ARGUMENT for a mode without one (allreduce runs without
  // parameter servers).
  static absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> Create(const ConsistencyConfig& config);

  virtual ~ConsistencyPolicy() = default;

  const ConsistencyConfig& config() const { return config_; }

  // ---- How gradients become updates (TensorAggregator) ----
  // Gradients are gathered into steps, one update per step (else: applied alone on arrival).
  virtual bool Synchronous() const = 0;
  // A step's sum is taken in worker-id order, holding early arrivals, so that it is bit-exact in
  // every arrival order; gradients held that long are answered DEADLINE_EXCEEDED after the wait
  // timeout.
  virtual bool SumsInWorkerOrder() const { return false; }
  // Whether the gathered step `step` with `received` gradients may be applied, `all_members_in`
  // telling whether every member's is among them.
  virtual bool StepComplete(int64_t step, int received, bool all_members_in, int members) const = 0;
  // The rate of the update that takes a tensor from `version` to version + 1.
  virtual double LearningRate(const LearningRateScheduler& schedule, int64_t version, int members,
                              int64_t staleness) const = 0;
  // The part size (elements) in which workers push large tensors, so that what each has in flight
  // stays within its share of `push_budget_bytes`; 0: whole tensors.
  virtual int64_t PartElements(int num_workers, int64_t push_budget_bytes) const { return 0; }
  // The examples behind one update, the batch the learning rate is scaled for (--lr_scaling):
  // a step's sum of the members' batches where gradients are gathered, one worker's batch where
  // each is applied alone.
  virtual int64_t UpdateBatch(const Membership& members) const = 0;

  // ---- Pulls and pushes (the shard) ----
  // The version a pull for `step` needs before it is answered.
  virtual int64_t NeededVersion(int64_t step) const = 0;
  // Where gradients are gathered: how many steps past a tensor's version a push's step may be
  // (a worker that pulled older weights, as NeededVersion allows); such a gradient is kept until
  // its step is the tensor's. 0: a push is for the tensor's step or an earlier one.
  virtual int MaxLead() const { return 0; }
  // Whether a pull for `step` may start asking its tensors, given the members' clocks.
  virtual bool MayStartPull(int64_t step, const Membership& members) const { return true; }
  // Why a pull for `step` that may not start is waiting; called only when MayStartPull is false.
  virtual std::string DescribeBlockedPull(int64_t step, const Membership& members) const {
    return "";
  }
  // Pushes advance the members' clocks (Membership::Pushed); KeepsClocks() false skips the
  // shard's lock on the push path.
  virtual bool KeepsClocks() const { return false; }
  // A member's clock that advanced may let parked pulls start.
  virtual bool ClockReleasesPulls() const { return false; }
  // OK, or FAILED_PRECONDITION if worker `worker`'s push of `step` cannot be (a gradient from the
  // future: it was computed on weights the worker never pulled, `pulled`, -1 for none).
  virtual absl::Status CheckPushStep(int worker, int64_t step, int64_t pulled, int shard) const {
    return absl::OkStatus();
  }

  // ---- Registration, checkpoints and recovery ----
  // Where a registering worker goes on: given the shard's lowest tensor version and the worker's
  // own clock.
  virtual int64_t ResumeStep(int64_t min_version, int64_t own_clock) const = 0;
  // Versions a tensor advances by per job step.
  virtual int64_t VersionsPerStep(int num_workers) const = 0;
  // Whether a tensor restored at `version` is consistent with a checkpoint of `step`.
  virtual bool RestoredVersionConsistent(int64_t version, int64_t step) const = 0;
  // Whether a failure is recovered by rolling every shard back to one checkpoint (else a restored
  // shard goes on and workers rejoin at their own steps).
  virtual bool RollsBack() const = 0;
  // Whether the shard measures the gradient noise scale (server/noise_scale.h).
  virtual bool MeasuresNoiseScale() const { return Synchronous(); }

  // ---- Adaptive consistency ----
  // The adaptive policy's decisions and relays (server/adaptive_policy.h); null for the others.
  virtual AdaptivePolicy* adaptive() { return nullptr; }

 protected:
  explicit ConsistencyPolicy(const ConsistencyConfig& config) : config_(config) {}

 private:
  const ConsistencyConfig config_;
};

// The part size for a job of `num_workers` under `push_budget_bytes` in mode `consistency`:
// ConsistencyPolicy::PartElements of its policy, 0 for a mode without one.
int64_t PushPartElements(const ConsistencyConfig& consistency, int num_workers,
                         int64_t push_budget_bytes);

}  // namespace rubato

#endif  // RUBATO_SERVER_CONSISTENCY_POLICY_H_
