#include "server/adaptive_policy.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace rubato {
namespace {

constexpr double kHysteresis = 0.1;
constexpr double kMaxComputeMs = 1e9;

using Rows = std::vector<std::vector<double>>;

// The window's time under ssp:s (s = 0: bsp): worker w starts step t once it has finished step
// t - 1 and steps up to t - 1 - s are applied, a step being applied once every worker finished it.
double SspWindowMs(const Rows& rows, int s) {
  const size_t n = rows[0].size();
  std::vector<double> finish(n, 0.0);
  std::vector<double> applied;
  applied.reserve(rows.size());
  for (size_t t = 0; t < rows.size(); ++t) {
    const double gate = t >= static_cast<size_t>(s) + 1 ? applied[t - 1 - s] : 0.0;
    double done = 0;
    for (size_t w = 0; w < n; ++w) {
      finish[w] = std::max(finish[w], gate) + rows[t][w];
      done = std::max(done, finish[w]);
    }
    applied.push_back(done);
  }
  return applied.back();
}

// The window's time under backup:b: each step ends when its (n - b)-th fastest worker is done.
double BackupWindowMs(const Rows& rows, int b) {
  double total = 0;
  for (std::vector<double> row : rows) {
    const auto kth = row.begin() + (row.size() - b - 1);
    std::nth_element(row.begin(), kth, row.end());
    total += *kth;
  }
  return total;
}

struct Outcome {
  double window_ms = 0;
  double rate = 0;  // Gradients averaged per ms.
};

Outcome Replay(const Rows& rows, int b, int s) {
  const int n = static_cast<int>(rows[0].size());
  Outcome o;
  o.window_ms = b > 0 ? BackupWindowMs(rows, b) : SspWindowMs(rows, s);
  o.rate = o.window_ms > 0 ? (n - b) * static_cast<double>(rows.size()) / o.window_ms : 0;
  return o;
}

}  // namespace

void ChooseConsistency(const Rows& steps_ms, const ConsistencyChange& current, int max_staleness,
                       double hysteresis, ConsistencyChange* change) {
  const int n = steps_ms.empty() ? 0 : static_cast<int>(steps_ms[0].size());
  change->set_backup_workers(0);
  change->set_staleness(0);
  change->set_expected_step_ms(0);
  change->set_gain(1);
  if (n == 0) return;
  const int current_b = std::clamp(current.backup_workers(), 0, n - 1);
  const int current_s = current_b > 0 ? 0 : std::clamp(current.staleness(), 0, max_staleness);
  // bsp, then ssp:1.., then backup:1..; a later one replaces the best only if strictly faster.
  std::vector<std::pair<int, int>> choices = {{0, 0}};
  for (int s = 1; s <= max_staleness; ++s) choices.push_back({0, s});
  for (int b = 1; b < n; ++b) choices.push_back({b, 0});
  std::pair<int, int> best = choices[0];
  Outcome best_outcome = Replay(steps_ms, 0, 0);
  for (const auto& [b, s] : choices) {
    const Outcome o = Replay(steps_ms, b, s);
    if (o.rate > best_outcome.rate) {
      best = {b, s};
      best_outcome = o;
    }
  }
  const Outcome now = Replay(steps_ms, current_b, current_s);
  const double gain = now.rate > 0 ? best_outcome.rate / now.rate : 1;
  const bool change_it = gain > 1 + hysteresis;
  const auto [b, s] = change_it ? best : std::make_pair(current_b, current_s);
  const Outcome& chosen = change_it ? best_outcome : now;
  change->set_backup_workers(b);
  change->set_staleness(s);
  change->set_expected_step_ms(chosen.window_ms / static_cast<double>(steps_ms.size()));
  change->set_gain(change_it ? gain : 1.0);
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

int64_t AdaptivePolicy::NeededVersion(int64_t step) const {
  absl::MutexLock lock(&mu_);
  if (total_steps_ > 0 && step >= total_steps_) return step;  // The final weights.
  return std::max<int64_t>(0, step - plan_.StalenessAt(step));
}

void AdaptivePolicy::SetTotalSteps(int64_t steps) {
  absl::MutexLock lock(&mu_);
  total_steps_ = steps;
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
  for (const auto& [name, ms] : {std::make_pair("compute_ms", relay.compute_ms()),
                                 std::make_pair("previous_step_ms", relay.previous_step_ms())}) {
    if (!(ms >= 0 && ms < kMaxComputeMs)) {
      return absl::InvalidArgumentError(absl::StrCat("consistency_relay.", name, " ", ms,
                                                     " from worker ", push.worker_id,
                                                     " is not in [0, 1e9)"));
    }
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
    // Shard 0 keeps the times of the steps the next decision will replay: from the last decision
    // step on, and no further than a push may lead (MaxLead) past the next one: at most K +
    // MaxLead rows.
    const int64_t timed = push.step - 1;
    if (shard_id == 0 && w < member.size() && relay.previous_step_ms() > 0 &&
        timed >= decided_through_ &&
        timed < decided_through_ + plan_.every_steps() + kMaxAdaptiveStaleness) {
      std::vector<double>& row = step_ms_[timed];
      row.resize(member.size(), 0.0);
      row[w] = relay.previous_step_ms();
    }
    if (relay.has_change()) {
      // The decision alone, not figures a worker may have attached. Checked before the push was
      // admitted; a conflict since (another worker's relay in between) keeps the first.
      ConsistencyChange decision;
      decision.set_from_step(relay.change().from_step());
      decision.set_backup_workers(relay.change().backup_workers());
      decision.set_staleness(relay.change().staleness());
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
  const ConsistencyChange before = newest == nullptr ? ConsistencyChange() : *newest;
  const int64_t window_start = decided_through_;
  decided_through_ = step;
  ConsistencyChange change;
  change.set_from_step(step + 1);
  bool all_known = true;
  for (size_t w = 0; w < member.size(); ++w) {
    change.add_compute_ms(compute_ms_[w]);
    if (member[w] && compute_ms_[w] <= 0) all_known = false;
  }
  // The window: the steps timed since the last decision (before `step`), each a row of the
  // members' times, a time not heard being the worker's mean; none timed: one row of the means.
  std::vector<std::vector<double>> rows;
  const std::vector<double> means = compute_ms_;  // (A copy: the lambda holds no lock.)
  auto row_of = [&member, &means](const std::vector<double>* times) {
    std::vector<double> row;
    for (size_t w = 0; w < member.size(); ++w) {
      if (!member[w]) continue;
      const double t = times != nullptr && w < times->size() ? (*times)[w] : 0.0;
      row.push_back(t > 0 ? t : means[w]);
    }
    return row;
  };
  for (auto it = step_ms_.lower_bound(window_start); it != step_ms_.end() && it->first < step;
       ++it) {
    rows.push_back(row_of(&it->second));
  }
  if (rows.empty()) rows.push_back(row_of(nullptr));
  step_ms_.erase(step_ms_.begin(), step_ms_.lower_bound(step));
  if (all_known) {
    ChooseConsistency(rows, before, kMaxAdaptiveStaleness, kHysteresis, &change);
  } else {
    // A member not heard from yet: wait for everyone (bsp) until every time is known.
    change.set_backup_workers(0);
    change.set_staleness(0);
    change.set_gain(1);
  }
  if (absl::Status s = plan_.Add(change, static_cast<int>(member.size())); !s.ok()) {
    // Only a relay of this very period could be here first, which shard 0 never gets before
    // deciding it; keep what is known.
    RUBATO_LOG(WARNING) << "shard 0: " << s.message();
    return;
  }
  const std::string was = DescribeDecision(&before), now = DescribeDecision(&change);
  RUBATO_LOG(INFO) << "adaptive consistency: steps " << step + 1 << ".."
                   << step + plan_.every_steps() << " run " << now
                   << (now == was ? " (unchanged)" : " (changed)") << "; compute ms per worker ["
                   << absl::StrJoin(change.compute_ms(), ", ",
                                    [](std::string* out, double ms) {
                                      absl::StrAppend(out, std::round(ms * 10) / 10);
                                    })
                   << "] over " << rows.size() << " step(s), expected step "
                   << std::round(change.expected_step_ms() * 10) / 10 << " ms";
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
  step_ms_.clear();
}

}  // namespace rubato
