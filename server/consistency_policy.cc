// The consistency policies' registration table and the behaviour they share out of line.
#include "server/consistency_policy.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cluster_spec.h"
#include "server/adaptive_policy.h"
#include "server/async_policy.h"
#include "server/backup_policy.h"
#include "server/bsp_policy.h"
#include "server/ssp_policy.h"

namespace rubato {
namespace {

template <typename Policy>
std::unique_ptr<ConsistencyPolicy> Make(const ConsistencyConfig& config) {
  return std::make_unique<Policy>(config);
}

// Every mode that runs on parameter servers, and its policy.
constexpr std::pair<ConsistencyMode,
                    std::unique_ptr<ConsistencyPolicy> (*)(const ConsistencyConfig&)>
    kPolicies[] = {
        {BSP, &Make<BspPolicy>}, {BACKUP, &Make<BackupPolicy>},     {ASYNC, &Make<AsyncPolicy>},
        {SSP, &Make<SspPolicy>}, {ADAPTIVE, &Make<AdaptivePolicy>},
};

}  // namespace

absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> ConsistencyPolicy::Create(
    const ConsistencyConfig& config) {
  for (const auto& [mode, make] : kPolicies) {
    if (mode == config.mode()) return make(config);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "mode ", FormatConsistency(config), " has no parameter-server consistency policy",
      config.mode() == ALLREDUCE ? " (allreduce runs without parameter servers)" : ""));
}

int64_t PushPartElements(const ConsistencyConfig& consistency, int num_workers,
                         int64_t push_budget_bytes) {
  absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> policy =
      ConsistencyPolicy::Create(consistency);
  return policy.ok() ? (*policy)->PartElements(num_workers, push_budget_bytes) : 0;
}

int64_t BspPolicy::PartElements(int num_workers, int64_t push_budget_bytes) const {
  if (num_workers < 1) return 0;
  constexpr int64_t kMin = (int64_t{1} << 20) / sizeof(float);
  constexpr int64_t kMax = (int64_t{8} << 20) / sizeof(float);
  const int64_t share = std::max<int64_t>(push_budget_bytes, 0) / (2 * int64_t{num_workers});
  return std::clamp<int64_t>(share / sizeof(float), kMin, kMax) / 1024 * 1024;
}

int64_t StepPolicy::UpdateBatch(const Membership& members) const {
  int64_t sum = 0;
  for (int w = 0; w < members.num_workers(); ++w) sum += members.worker(w).batch_size;
  return sum;
}

int64_t ArrivalPolicy::UpdateBatch(const Membership& members) const {
  int64_t sum = 0;
  for (int w = 0; w < members.num_workers(); ++w) sum += members.worker(w).batch_size;
  const int64_t n = std::max(1, members.num_workers());
  return (sum + n / 2) / n;
}

double ArrivalPolicy::LearningRate(const LearningRateScheduler& schedule, int64_t version,
                                   int members, int64_t staleness) const {
  double lr = schedule.At(version / std::max(1, members));
  if (config().staleness_aware_lr() && staleness > 1) lr /= static_cast<double>(staleness);
  return lr;
}

absl::Status ArrivalPolicy::CheckPushStep(int worker, int64_t step, int64_t pulled,
                                          int shard) const {
  if (step <= pulled) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, " from worker ", worker, " is from the future: it has pulled ",
                   pulled < 0 ? std::string("nothing") : absl::StrCat("up to step ", pulled),
                   " from shard ", shard));
}

std::string SspPolicy::DescribeBlockedPull(int64_t step, const Membership& members) const {
  const int64_t need = NeededClock(step);
  std::vector<std::string> behind;
  for (int w = 0; w < members.num_workers(); ++w) {
    if (members.worker(w).registered && members.Clock(w) < need) {
      behind.push_back(absl::StrCat(w, " (clock ", members.Clock(w), ")"));
    }
  }
  return absl::StrCat("ssp: step ", step, " needs every worker at clock >= ", need,
                      "; waiting for worker(s) ", absl::StrJoin(behind, ", "));
}

}  // namespace rubato
