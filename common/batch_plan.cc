#include "common/batch_plan.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/limits.h"

namespace rubato {

namespace {
constexpr int64_t kDefaultEvery = 50;
}  // namespace

BatchPlan::BatchPlan(int workers, int initial_batch)
    : workers_(std::max(1, workers)), initial_batch_(std::max(1, initial_batch)) {}

int BatchPlan::BatchAt(int64_t step) const {
  int batch = initial_batch_;
  for (const BatchChange& c : changes_) {
    if (c.from_step() > step) break;
    batch = c.batch_size();
  }
  return batch;
}

int64_t BatchPlan::ExamplesBefore(int64_t step) const {
  int64_t examples = 0, from = 0;
  int batch = initial_batch_;
  for (const BatchChange& c : changes_) {
    if (c.from_step() >= step) break;
    examples += (c.from_step() - from) * batch * workers_;
    from = c.from_step();
    batch = c.batch_size();
  }
  return examples + std::max<int64_t>(0, step - from) * batch * workers_;
}

int64_t BatchPlan::TotalSteps(int64_t examples) const {
  int64_t done = 0, from = 0;
  int batch = initial_batch_;
  for (const BatchChange& c : changes_) {
    const int64_t segment = (c.from_step() - from) * batch * workers_;
    if (done + segment >= examples) break;
    done += segment;
    from = c.from_step();
    batch = c.batch_size();
  }
  const int64_t global = int64_t{batch} * workers_;
  return from + std::max<int64_t>(0, (examples - done + global - 1) / global);
}

absl::Status BatchPlan::Add(const BatchChange& change) {
  const int64_t after = changes_.empty() ? 0 : changes_.back().from_step();
  if (static_cast<int>(changes_.size()) >= kMaxChanges) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch plan already holds ", kMaxChanges, " changes"));
  }
  if (change.from_step() <= after || change.from_step() >= kMaxStep) {
    return absl::InvalidArgumentError(absl::StrCat("batch change from step ", change.from_step(),
                                                   ": must come after step ", after,
                                                   " and before 2^48"));
  }
  if (change.batch_size() < 1 || change.batch_size() > kMaxBatchSize) {
    return absl::InvalidArgumentError(absl::StrCat("batch change from step ", change.from_step(),
                                                   ": batch_size must be in [1, ", kMaxBatchSize,
                                                   "], got ", change.batch_size()));
  }
  if (change.batch_size() == BatchAt(change.from_step())) {
    return absl::InvalidArgumentError(absl::StrCat("batch change from step ", change.from_step(),
                                                   ": the batch is ", change.batch_size(),
                                                   " already"));
  }
  if (change.global_batch() != int64_t{change.batch_size()} * workers_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch change from step ", change.from_step(), ": global_batch ", change.global_batch(),
        " is not ", change.batch_size(), " x ", workers_, " workers"));
  }
  changes_.push_back(change);
  return absl::OkStatus();
}

int ProposeBatch(const AdaptiveBatchConfig& config, int workers, int current, double b_simple) {
  if (config.max_global_batch() <= 0 || !std::isfinite(b_simple) || b_simple <= 0) return current;
  workers = std::max(1, workers);
  const int64_t lo = (config.min_global_batch() + workers - 1) / workers;
  const int64_t hi = std::max<int64_t>(lo, config.max_global_batch() / workers);
  const double target = std::clamp(b_simple, static_cast<double>(config.min_global_batch()),
                                   static_cast<double>(config.max_global_batch()));
  const int64_t proposed =
      std::clamp<int64_t>(std::llround(target / workers), std::max<int64_t>(1, lo), hi);
  const double ratio = static_cast<double>(proposed) / std::max(1, current);
  if (ratio < BatchPlan::kHysteresis && ratio > 1 / BatchPlan::kHysteresis) return current;
  return static_cast<int>(proposed);
}

absl::Status ValidateAdaptiveBatch(const AdaptiveBatchConfig& c, int workers) {
  if (c.max_global_batch() == 0 && c.min_global_batch() == 0 && c.every_steps() == 0) {
    return absl::OkStatus();
  }
  const int64_t most = int64_t{kMaxBatchSize} * std::max(1, workers);
  if (c.min_global_batch() < std::max(1, workers) || c.min_global_batch() > c.max_global_batch() ||
      c.max_global_batch() > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adaptive_batch: need ", workers, " workers <= min_global_batch <= max_global_batch <= ",
        most, ", got [", c.min_global_batch(), ", ", c.max_global_batch(), "]"));
  }
  if (c.every_steps() != 0 && (c.every_steps() < 2 || c.every_steps() > kMaxStep)) {
    return absl::InvalidArgumentError(
        absl::StrCat("adaptive_batch.every_steps: must be >= 2 (a change takes effect two steps "
                     "after it is decided), got ",
                     c.every_steps()));
  }
  return absl::OkStatus();
}

int64_t AdaptiveBatchEvery(const AdaptiveBatchConfig& config) {
  return config.every_steps() > 0 ? config.every_steps() : kDefaultEvery;
}

}  // namespace rubato
