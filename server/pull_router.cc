#include "server/pull_router.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"

namespace rubato {

PullStatePtr PullRouter::Take(int worker, int64_t step, std::vector<int> which,
                              absl::Time deadline, absl::Time now, PullState::Done done,
                              std::vector<std::function<void()>>* superseded, bool* sooner) {
  auto pull = std::make_shared<PullState>(worker, step, std::move(which),
                                          std::min(deadline, now + max_wait_), std::move(done));
  parked_.Supersede(*pull, superseded);
  if (MayStart(*pull) && Arm(pull)) return pull;
  const bool earlier = parked_.Park(std::move(pull));
  if (sooner != nullptr) *sooner = earlier;
  return nullptr;
}

bool PullRouter::MayStart(const PullState& pull) const {
  return started_ && policy_->MayStartPull(pull.step(), *members_);
}

bool PullRouter::Arm(const PullStatePtr& pull) {
  return tensors_->Arm(pull, policy_->NeededVersion(pull->step()));
}

void PullRouter::ArmParked(std::vector<PullStatePtr>* ready) {
  if (!started_) return;
  parked_.ArmWhere([this](const PullState& p) { return MayStart(p); },
                   [this](const PullStatePtr& p) { return Arm(p); }, ready);
}

absl::Time PullRouter::Expire(absl::Time now,
                              std::vector<std::pair<PullStatePtr, absl::Status>>* expired) {
  auto why = [this](const PullState& p) {
    return absl::DeadlineExceededError(absl::StrCat(
        "pull for step ", p.step(), " by worker ", p.worker(), " timed out on shard ", shard_id_,
        ": ", DescribePullWait(p, started_, *members_, *policy_, tensors_->all())));
  };
  return parked_.Expire(now, why, expired);
}

}  // namespace rubato
