#include "server/checkpoint_capture.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec.h"
#include "common/limits.h"
#include "common/tensor_bytes.h"
#include "server/request_checks.h"

namespace rubato {

void CheckpointAssembler::Attach(const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                                 int64_t every_steps, int64_t versions_per_step) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i]->SetCheckpointing(
        every_steps * versions_per_step,
        [this, i, versions_per_step](int64_t version, TensorSnapshot weights,
                                     TensorOptimizerState state) {
          Add(static_cast<int>(i), version / versions_per_step, std::move(weights),
              std::move(state));
        });
  }
}

void CheckpointAssembler::Add(int tensor, int64_t step, TensorSnapshot weights,
                              TensorOptimizerState state) {
  std::shared_ptr<CapturedCheckpoint> complete;
  {
    absl::MutexLock lock(&mu_);
    Pending& p = pending_[step];
    if (p.weights.empty()) {
      p.weights.resize(tensors_);
      p.optimizer_states.resize(tensors_);
    }
    if (p.weights[tensor].values != nullptr) return;  // Taken already (cannot happen twice).
    p.weights[tensor] = std::move(weights);
    p.optimizer_states[tensor] = std::move(state);
    if (++p.filled < tensors_) return;
    complete = std::make_shared<CapturedCheckpoint>();
    complete->step = step;
    complete->weights = std::move(p.weights);
    complete->optimizer_states = std::move(p.optimizer_states);
    // Older steps can no longer complete (every tensor is past them); drop them.
    pending_.erase(pending_.begin(), pending_.upper_bound(step));
  }
  last_step_.store(step);
  sink_(std::move(complete));
}

ShardCheckpoint MakeCheckpointProto(const CapturedCheckpoint& capture, const ShardJob& job,
                                    const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                                    const Membership& members, absl::Time now) {
  ShardCheckpoint c;
  c.set_shard_id(job.shard_id);
  c.set_num_shards(job.num_shards);
  c.set_step(capture.step);
  *c.mutable_cluster() = *job.cluster;
  *c.mutable_cluster()->mutable_optimizer() = *job.optimizer;
  for (size_t i = 0; i < tensors.size() && i < capture.weights.size(); ++i) {
    TensorCheckpoint* t = c.add_tensors();
    t->set_name(tensors[i]->name());
    for (int64_t d : tensors[i]->shape()) t->add_shape(d);
    const std::vector<float>& values = *capture.weights[i].values;
    t->set_values(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    t->set_version(capture.weights[i].version);
    *t->mutable_optimizer_state() =
        SaveOptimizerState(job.optimizer->type(), capture.optimizer_states[i]);
  }
  for (int w = 0; w < members.num_workers(); ++w) {
    const Membership::Worker& worker = members.worker(w);
    WorkerCheckpoint* wc = c.add_workers();
    wc->set_worker_id(w);
    wc->set_batch_size(worker.batch_size);
    wc->set_clock(capture.step);
    c.set_global_batch(c.global_batch() + worker.batch_size);
  }
  c.set_steps_per_epoch(members.worker(0).steps_per_epoch);
  c.set_total_steps(members.worker(0).total_steps);
  c.set_written_unix_ms(absl::ToUnixMillis(now));
  return c;
}

namespace {

absl::Status CheckSameJob(const ShardCheckpoint& c, const ShardJob& job) {
  auto mismatch = [&](absl::string_view what, const auto& theirs, const auto& ours) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint is of another job: its ", what, " is ", theirs, ", this shard's ", ours));
  };
  if (c.shard_id() != job.shard_id) return mismatch("shard", c.shard_id(), job.shard_id);
  if (c.num_shards() != job.num_shards) {
    return mismatch("shard count", c.num_shards(), job.num_shards);
  }
  if (c.cluster().num_workers() != job.cluster->num_workers()) {
    return mismatch("worker count", c.cluster().num_workers(), job.cluster->num_workers());
  }
  if (FormatConsistency(c.cluster().consistency()) !=
      FormatConsistency(job.cluster->consistency())) {
    return mismatch("mode", FormatConsistency(c.cluster().consistency()),
                    FormatConsistency(job.cluster->consistency()));
  }
  if (c.cluster().optimizer().type() != job.optimizer->type()) {
    return mismatch("optimizer", c.cluster().optimizer().type(), job.optimizer->type());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RestoredTensors> RestoreTensors(const ShardCheckpoint& c, const ShardJob& job,
                                               const ConsistencyPolicy& policy,
                                               const Optimizer& optimizer, int64_t part_elements) {
  if (absl::Status s = CheckSameJob(c, job); !s.ok()) return s;
  if (c.tensors().empty() || c.tensors_size() > kMaxTensors) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of step ", c.step(), " holds ", c.tensors_size(), " tensors"));
  }
  RestoredTensors restored;
  for (const TensorCheckpoint& t : c.tensors()) {
    const std::string what = absl::StrCat("checkpoint tensor '", t.name(), "'");
    if (absl::Status s = CheckTensorName(t.name()); !s.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint: ", s.message()));
    }
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    absl::StatusOr<int64_t> n = CheckedElementCount(t.shape());
    if (!n.ok()) return absl::DataLossError(absl::StrCat(what, ": ", n.status().message()));
    if (absl::Status s = CheckFloatBytes(what, t.values(), *n); !s.ok()) {
      return absl::DataLossError(s.message());
    }
    if (!policy.RestoredVersionConsistent(t.version(), c.step())) {
      return absl::DataLossError(absl::StrCat(what, " is at version ", t.version(),
                                              ", not the checkpoint's step ", c.step()));
    }
    absl::StatusOr<TensorOptimizerState> state =
        LoadOptimizerState(t.optimizer_state(), job.optimizer->type(), *n);
    if (!state.ok()) return absl::DataLossError(absl::StrCat(what, ": ", state.status().message()));
    if (!restored.index.emplace(t.name(), static_cast<int>(restored.tensors.size())).second) {
      return absl::DataLossError(absl::StrCat(what, " appears twice"));
    }
    std::vector<float> values(*n);
    BytesToFloats(t.values(), absl::MakeSpan(values));
    const TensorRole role = optimizer.RoleOf(t.name(), shape);
    restored.tensors.push_back(
        std::make_unique<TensorAggregator>(t.name(), std::move(shape), std::move(values), role,
                                           job.cluster->num_workers(), part_elements));
    restored.tensors.back()->Restore(t.version(), std::move(*state));
    restored.versions += t.version();
  }
  return restored;
}

}  // namespace rubato
