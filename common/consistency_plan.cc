#include "common/consistency_plan.h"

#include "absl/strings/str_cat.h"

namespace rubato {

std::string DescribeDecision(const ConsistencyChange* change) {
  if (change == nullptr) return "bsp";
  if (change->backup_workers() > 0) return absl::StrCat("backup:", change->backup_workers());
  if (change->staleness() > 0) return absl::StrCat("ssp:", change->staleness());
  return "bsp";
}

const ConsistencyChange* ConsistencyPlan::At(int64_t step) const {
  const int64_t start = PeriodStart(step);
  if (start == 0) return nullptr;
  auto it = changes_.find(start);
  return it == changes_.end() ? nullptr : &it->second;
}

int ConsistencyPlan::BackupAt(int64_t step) const {
  const ConsistencyChange* c = At(step);
  return c == nullptr ? 0 : c->backup_workers();
}

int ConsistencyPlan::StalenessAt(int64_t step) const {
  const ConsistencyChange* c = At(step);
  return c == nullptr ? 0 : c->staleness();
}

const ConsistencyChange* ConsistencyPlan::Newest() const {
  return changes_.empty() ? nullptr : &changes_.rbegin()->second;
}

absl::Status ConsistencyPlan::Check(const ConsistencyChange& change, int num_workers) const {
  const int64_t from = change.from_step();
  if (from <= every_ || PeriodStart(from) != from) {
    return absl::InvalidArgumentError(absl::StrCat("adaptive consistency: a decision from step ",
                                                   from, ", which does not begin a period of ",
                                                   every_, " steps after the first"));
  }
  if (change.backup_workers() < 0 || change.backup_workers() >= num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("adaptive consistency: a decision of ", change.backup_workers(),
                     " backup workers from step ", from, ", not in [0, ", num_workers, ")"));
  }
  if (change.staleness() < 0 || change.staleness() > kMaxAdaptiveStaleness) {
    return absl::InvalidArgumentError(absl::StrCat("adaptive consistency: a decision of staleness ",
                                                   change.staleness(), " from step ", from,
                                                   ", not in [0, ", kMaxAdaptiveStaleness, "]"));
  }
  if (change.staleness() > 0 && change.backup_workers() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adaptive consistency: a decision from step ", from, " of both ", change.backup_workers(),
        " backup workers and staleness ", change.staleness(), " (one of bsp, backup:b and ssp:s)"));
  }
  auto it = changes_.find(from);
  if (it != changes_.end() && (it->second.backup_workers() != change.backup_workers() ||
                               it->second.staleness() != change.staleness())) {
    return absl::FailedPreconditionError(
        absl::StrCat("adaptive consistency: two decisions for the steps from ", from, ": ",
                     DescribeDecision(&it->second), " and ", DescribeDecision(&change)));
  }
  return absl::OkStatus();
}

absl::Status ConsistencyPlan::Add(const ConsistencyChange& change, int num_workers, bool* added) {
  if (added != nullptr) *added = false;
  if (absl::Status s = Check(change, num_workers); !s.ok()) return s;
  auto [it, inserted] = changes_.emplace(change.from_step(), change);
  if (added != nullptr) *added = inserted;
  return absl::OkStatus();
}

void ConsistencyPlan::DropAfter(int64_t step) {
  changes_.erase(changes_.upper_bound(step), changes_.end());
}

}  // namespace rubato
