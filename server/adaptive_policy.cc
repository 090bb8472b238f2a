#include "server/adaptive_policy.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace rubato {
namespace {

constexpr double kHysteresis = 0.1;
constexpr double kMaxComputeMs = 1e9;

// (n - b) / c_(n-b) of sorted times.
double Rate(const std::vector<double>& sorted, int b) {
  const int n = static_cast<int>(sorted.size());
  return (n - b) / sorted[n - b - 1];
}

}  // namespace

void ChooseBackupWorkers(std::vector<double> times_ms, int current, double hysteresis,
                         ConsistencyChange* change) {
  std::sort(times_ms.begin(), times_ms.end());
  const int n = static_cast<int>(times_ms.size());
  current = std::clamp(current, 0, std::max(0, n - 1));
  if (n == 0) {
    change->set_backup_workers(0);
    change->set_expected_step_ms(0);
    change->set_gain(1);
    return;
  }
  int best = 0;
  for (int b = 1; b < n; ++b) {
    if (Rate(times_ms, b) > Rate(times_ms, best)) best = b;
  }
  const double gain = Rate(times_ms, best) / Rate(times_ms, current);
  const int chosen = gain > 1 + hysteresis ? best : current;
  change->set_backup_workers(chosen);
  change->set_expected_step_ms(times_ms[n - chosen - 1]);
  change->set_gain(chosen == current ? 1.0 : gain);
}

AdaptivePolicy::AdaptivePolicy(const ConsistencyConfig& config)
    : StepPolicy(config), plan_(config.adaptive_every_steps()) {}

bool AdaptivePolicy::StepComplete(int64_t step, int received, bool all_members_in,
                                  int members) const {
  if (received == 0) return false;
  if (all_members_in) return true;
  absl::MutexLock lock(&mu_);
  return received >= std::max(1, members - plan_.BackupAt(step));
}

double AdaptivePolicy::LearningRate(const LearningRateScheduler& schedule, int64_t version,
                                    int members, int64_t staleness) const {
  const double rate = StepPolicy::LearningRate(schedule, version, members, staleness);
  int b = 0;
  {
    absl::MutexLock lock(&mu_);
    b = plan_.BackupAt(version);
  }
  if (b == 0 || members < 1) return rate;
  const int contributors = std::max(1, members - b);
  return rate * schedule.BatchFactor(schedule.global_batch() * contributors / members);
}

absl::Status AdaptivePolicy::CheckRelay(const WirePush& push, int num_workers) const {
  if (!push.consistency_relay.has_value()) return absl::OkStatus();
  const ConsistencyRelay& relay = *push.consistency_relay;
  if (!(relay.compute_ms() >= 0 && relay.compute_ms() < kMaxComputeMs)) {
    return absl::InvalidArgumentError(absl::StrCat("consistency_relay.compute_ms ",
                                                   relay.compute_ms(), " from worker ",
                                                   push.worker_id, " is not in [0, 1e9)"));
  }
  if (!relay.has_change()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (relay.change().from_step() != plan_.PeriodStart(push.step)) {
    return absl::InvalidArgumentError(
        absl::StrCat("consistency_relay: worker ", push.worker_id, "'s push of step ", push.step,
                     " relays the decision from step ", relay.change().from_step(),
                     ", which does not govern that step"));
  }
  return plan_.Check(relay.change(), num_workers);
}

void AdaptivePolicy::TakeRelay(const WirePush& push, int shard_id,
                               const std::vector<char>& member) {
  absl::MutexLock lock(&mu_);
  if (compute_ms_.size() < member.size()) compute_ms_.resize(member.size(), 0.0);
  if (push.consistency_relay.has_value()) {
    const ConsistencyRelay& relay = *push.consistency_relay;
    const size_t w = static_cast<size_t>(push.worker_id);
    if (w < compute_ms_.size() && relay.compute_ms() > 0) compute_ms_[w] = relay.compute_ms();
    if (relay.has_change()) {
      // The decision alone, not figures a worker may have attached. Checked before the push was
      // admitted; a conflict since (another worker's relay in between) keeps the first.
      ConsistencyChange decision;
      decision.set_from_step(relay.change().from_step());
      decision.set_backup_workers(relay.change().backup_workers());
      if (absl::Status s = plan_.Add(decision, static_cast<int>(member.size())); !s.ok()) {
        RUBATO_LOG(WARNING) << "shard " << shard_id << ": " << s.message();
      }
    }
  }
  if (shard_id == 0 && plan_.DecidesAt(push.step) && push.step > decided_through_) {
    DecideLocked(push.step, member);
  }
}

void AdaptivePolicy::DecideLocked(int64_t step, const std::vector<char>& member) {
  const ConsistencyChange* newest = plan_.Newest();
  const int before = newest == nullptr ? 0 : newest->backup_workers();
  decided_through_ = step;
  std::vector<double> times;
  ConsistencyChange change;
  change.set_from_step(step + 1);
  bool all_known = true;
  for (size_t w = 0; w < member.size(); ++w) {
    change.add_compute_ms(compute_ms_[w]);
    if (!member[w]) continue;
    if (compute_ms_[w] > 0) {
      times.push_back(compute_ms_[w]);
    } else {
      all_known = false;
    }
  }
  if (all_known) {
    ChooseBackupWorkers(times, before, kHysteresis, &change);
  } else {
    // A member not heard from yet: wait for everyone (bsp) until every time is known.
    change.set_backup_workers(0);
    change.set_gain(1);
  }
  if (absl::Status s = plan_.Add(change, static_cast<int>(member.size())); !s.ok()) {
    // Only a relay of this very period could be here first, which shard 0 never gets before
    // deciding it; keep what is known.
    RUBATO_LOG(WARNING) << "shard 0: " << s.message();
    return;
  }
  const int now = change.backup_workers();
  RUBATO_LOG(INFO) << "adaptive consistency: steps " << step + 1 << ".."
                   << step + plan_.every_steps() << " run "
                   << (now == 0 ? std::string("bsp") : absl::StrCat("backup:", now))
                   << (now == before ? " (unchanged)" : " (changed)") << "; compute ms per worker ["
                   << absl::StrJoin(change.compute_ms(), ", ",
                                    [](std::string* out, double ms) {
                                      absl::StrAppend(out, std::round(ms * 10) / 10);
                                    })
                   << "], expected step " << std::round(change.expected_step_ms() * 10) / 10
                   << " ms";
}

bool AdaptivePolicy::Newest(ConsistencyChange* out) const {
  absl::MutexLock lock(&mu_);
  const ConsistencyChange* newest = plan_.Newest();
  if (newest == nullptr) return false;
  *out = *newest;
  return true;
}

std::vector<ConsistencyChange> AdaptivePolicy::Plan() const {
  absl::MutexLock lock(&mu_);
  std::vector<ConsistencyChange> out;
  for (const auto& [from, change] : plan_.changes()) out.push_back(change);
  return out;
}

void AdaptivePolicy::RestartAt(int64_t step) {
  absl::MutexLock lock(&mu_);
  plan_.DropAfter(step);
  decided_through_ = std::min(decided_through_, step - 1);
}

}  // namespace rubato
