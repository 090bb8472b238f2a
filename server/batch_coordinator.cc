#include "server/batch_coordinator.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "server/request_checks.h"

namespace rubato {

BatchCoordinator::BatchCoordinator(int shard_id, const AdaptiveBatchConfig& config,
                                   NoiseScaleMonitor* noise)
    : shard_id_(shard_id), config_(config), noise_(noise) {}

absl::Status BatchCoordinator::CheckRegistration(int worker, int batch,
                                                 const Membership& members) const {
  if (!enabled()) return absl::OkStatus();
  // The plan starts from one batch for every worker; a worker that joins later registers with
  // that first batch and takes the changes from the response.
  int first = plan_.has_value() ? plan_->initial_batch() : 0;  // 0: no other registrant.
  for (int other = 0; other < members.num_workers() && first == 0; ++other) {
    const Membership::Worker& o = members.worker(other);
    if (o.registered && other != worker) first = o.batch_size;
  }
  if (first != 0 && batch != first) {
    return absl::FailedPreconditionError(
        absl::StrCat("job mismatch: under an adaptive batch every worker starts from the same "
                     "batch; worker ",
                     worker, " registered with ", batch, " but the job's is ", first));
  }
  return absl::OkStatus();
}

void BatchCoordinator::Start(int workers, int initial_batch) {
  if (!enabled() || plan_.has_value()) return;
  plan_.emplace(workers, initial_batch);
  Publish();
}

void BatchCoordinator::Publish() {
  std::atomic_store(&view_,
                    std::shared_ptr<const BatchPlan>(std::make_shared<const BatchPlan>(*plan_)));
}

absl::Status BatchCoordinator::CheckPush(const WirePush& request, int registered_batch) const {
  if (request.noise_relay.has_value()) {
    const NoiseScaleRelay& r = *request.noise_relay;
    if (!std::isfinite(r.g2_ema()) || !std::isfinite(r.trace_ema())) {
      return absl::InvalidArgumentError("noise_relay: its figures must be finite");
    }
    if (absl::Status s = CheckStep("noise_relay.step", r.step()); !s.ok()) return s;
  }
  if (!plan_.has_value()) {
    if (request.batch_size != 0 && request.batch_size != registered_batch) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", request.worker_id, " pushed gradients of a batch of ", request.batch_size,
          " but registered a batch of ", registered_batch, " (this job's batch is fixed)"));
    }
    return absl::OkStatus();
  }
  const int expected = plan_->BatchAt(request.step);
  if (request.batch_size != expected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", request.worker_id, " pushed step ", request.step, " computed on a batch of ",
        request.batch_size, " but the job's adaptive batch at that step is ", expected,
        " per worker (announced in the push responses)"));
  }
  return absl::OkStatus();
}

void BatchCoordinator::TakeRelay(const WirePush& request, const LearningRateScheduler& schedule) {
  if (!plan_.has_value()) return;
  const int64_t every = AdaptiveBatchEvery(config_);
  if (relay_step_ >= 0 && request.step > relay_step_) Decide(schedule);
  if (request.step <= decided_through_ || request.step % every != 0 ||
      !request.noise_relay.has_value()) {
    return;
  }
  if (relay_step_ != request.step) {
    relays_.clear();
    relay_step_ = request.step;
  }
  relays_.emplace(request.worker_id, *request.noise_relay);  // A worker's first relay counts.
}

void BatchCoordinator::Decide(const LearningRateScheduler& schedule) {
  const int64_t step = relay_step_;
  const NoiseScaleRelay relay = relays_.begin()->second;
  relays_.clear();
  relay_step_ = -1;
  decided_through_ = step;
  const double b_simple = relay.g2_ema() > 0 ? relay.trace_ema() / relay.g2_ema() : std::nan("");
  const int workers = plan_->workers();
  const int current = plan_->BatchAt(step + 2);
  const int batch = ProposeBatch(config_, workers, current, b_simple);
  if (batch == current) return;
  BatchChange change;
  change.set_from_step(step + 2);
  change.set_batch_size(batch);
  change.set_global_batch(int64_t{batch} * workers);
  change.set_b_simple(b_simple);
  change.set_learning_rate(schedule.At(step + 2) * schedule.BatchFactor(change.global_batch()));
  if (absl::Status s = plan_->Add(change); !s.ok()) {
    RUBATO_LOG(WARNING) << "shard " << shard_id_ << ": adaptive batch kept at " << current << ": "
                        << s.message();
    return;
  }
  if (noise_ != nullptr) noise_->SetBatchFrom(change.from_step(), batch);
  Publish();
  RUBATO_LOG(INFO) << "shard " << shard_id_ << ": adaptive batch: B_simple " << b_simple
                   << " (relayed at step " << step << ", moving averages of step " << relay.step()
                   << "); global batch " << int64_t{current} * workers << " -> "
                   << change.global_batch() << " from step " << change.from_step()
                   << ", learning rate " << change.learning_rate();
}

}  // namespace rubato
