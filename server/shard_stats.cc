#include "server/shard_stats.h"

#include <algorithm>

#include "common/limits.h"

namespace rubato {

void ShardCounters::RecordStaleness(int64_t tau) {
  int bucket = 7;
  if (tau < 4) {
    bucket = static_cast<int>(tau);
  } else if (tau < 8) {
    bucket = 4;
  } else if (tau < 16) {
    bucket = 5;
  } else if (tau < 32) {
    bucket = 6;
  }
  ++staleness_histogram_[bucket];
}

void ShardCounters::Fill(GetStatsResponse* s) const {
  s->set_pushes(pushes_);
  s->set_rejected_pushes(rejected_pushes_);
  s->set_duplicate_gradients(duplicate_gradients_);
  s->set_dropped_workers(dropped_workers_);
  s->set_dropped_gradients(dropped_gradients_);
  s->set_refused_updates(refused_updates_);
  for (const auto& n : staleness_histogram_) s->add_staleness_histogram(n);
  s->set_learning_rate(last_learning_rate_);
}

void FillTensorStats(const std::vector<std::unique_ptr<TensorAggregator>>& tensors,
                     int64_t restored_versions, GetStatsResponse* s) {
  int64_t bytes = 0;
  int64_t applied = 0;
  int64_t min_version = tensors.empty() ? 0 : kMaxStep;
  for (const auto& t : tensors) {
    bytes += t->elements() * static_cast<int64_t>(sizeof(float));
    const int64_t version = t->version();
    TensorStats* ts = s->add_tensors();
    ts->set_name(t->name());
    ts->set_elements(t->elements());
    ts->set_version(version);
    applied += version;  // Less the restored versions, below.
    min_version = std::min(min_version, version);
  }
  s->set_min_version(min_version);
  s->set_bytes(bytes);
  s->set_applied_updates(applied - restored_versions);
}

void FillWorkerStats(const Membership& members, absl::Time now, GetStatsResponse* s) {
  s->set_restored_step(members.restored_step());
  for (int id = 0; id < members.num_workers(); ++id) {
    s->set_finished_workers(s->finished_workers() + (members.worker(id).finished ? 1 : 0));
  }
  for (int id = 0; id < members.num_workers(); ++id) {
    const Membership::Worker& w = members.worker(id);
    if (!w.registered) continue;
    WorkerStats* ws = s->add_workers();
    ws->set_worker_id(id);
    ws->set_last_step(w.last_step);
    ws->set_ms_since_seen(absl::ToInt64Milliseconds(now - w.last_seen));
    ws->set_batch_size(w.batch_size);
  }
}

}  // namespace rubato
