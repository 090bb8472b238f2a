#include "server/parked_pulls.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "server/request_checks.h"

namespace rubato {

PullState::PullState(int worker, int64_t step, std::vector<int> tensors, absl::Time deadline,
                     Done done)
    : worker_(worker),
      step_(step),
      tensors_(std::move(tensors)),
      deadline_(deadline),
      done_(std::move(done)),
      got_(tensors_.size()),
      missing_(static_cast<int>(tensors_.size())) {}

bool PullState::Fill(int slot, TensorSnapshot snapshot) {
  absl::MutexLock lock(&mu_);
  if (over_) return false;
  got_[slot] = std::move(snapshot);
  if (--missing_ > 0) return false;
  over_ = true;
  return true;
}

bool PullState::Over() const {
  absl::MutexLock lock(&mu_);
  return over_;
}

bool PullState::End() {
  absl::MutexLock lock(&mu_);
  if (over_) return false;
  over_ = true;
  return true;
}

bool PullState::Overlaps(const PullState& other) const {
  for (int a : tensors_) {
    if (std::find(other.tensors_.begin(), other.tensors_.end(), a) != other.tensors_.end()) {
      return true;
    }
  }
  return false;
}

std::vector<TensorSnapshot> PullState::TakeSnapshots() {
  absl::MutexLock lock(&mu_);
  return std::move(got_);
}

bool ParkedPulls::Park(PullStatePtr pull) {
  const bool sooner = pull->deadline() < due_;
  due_ = std::min(due_, pull->deadline());
  const int worker = pull->worker();
  parked_.push_back(std::move(pull));
  of_worker_[worker].push_back(std::prev(parked_.end()));
  return sooner;
}

ParkedPulls::List::iterator ParkedPulls::Erase(List::iterator it) {
  auto found = of_worker_.find((*it)->worker());
  std::vector<List::iterator>& mine = found->second;
  mine.erase(std::find(mine.begin(), mine.end(), it));
  if (mine.empty()) of_worker_.erase(found);
  return parked_.erase(it);
}

void ParkedPulls::Supersede(const PullState& pull, std::vector<std::function<void()>>* out) {
  auto found = of_worker_.find(pull.worker());
  if (found == of_worker_.end()) return;
  const std::vector<List::iterator> mine = found->second;  // Erase changes the index.
  for (List::iterator it : mine) {
    PullStatePtr p = *it;
    if (p->Over()) {
      Erase(it);
    } else if (p->Overlaps(pull) && p->End()) {
      out->push_back([p = std::move(p), step = pull.step()] {
        p->Answer(
            absl::AbortedError(absl::StrCat("pull for step ", p->step(), " by worker ", p->worker(),
                                            " superseded by its pull for step ", step)),
            {});
      });
      Erase(it);
    }
  }
}

void ParkedPulls::ArmWhere(const std::function<bool(const PullState&)>& may_start,
                           const std::function<bool(const PullStatePtr&)>& arm,
                           std::vector<PullStatePtr>* ready) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    PullState& p = **it;
    if (p.Over()) {
      it = Erase(it);
      continue;
    }
    if (!p.armed && may_start(p) && arm(*it)) {
      ready->push_back(*it);
      it = Erase(it);
      continue;
    }
    ++it;
  }
}

absl::Time ParkedPulls::Expire(absl::Time now,
                               const std::function<absl::Status(const PullState&)>& why,
                               std::vector<std::pair<PullStatePtr, absl::Status>>* expired) {
  absl::Time next = absl::InfiniteFuture();
  for (auto it = parked_.begin(); it != parked_.end();) {
    PullState& p = **it;
    if (p.Over()) {
      it = Erase(it);
    } else if (p.deadline() <= now) {
      absl::Status status = why(p);
      if (p.End()) expired->emplace_back(*it, std::move(status));
      it = Erase(it);
    } else {
      next = std::min(next, p.deadline());
      ++it;
    }
  }
  due_ = next;
  return next;
}

void ParkedPulls::EndAll(std::vector<PullStatePtr>* ended) {
  for (PullStatePtr& p : parked_) {
    if (p->End()) ended->push_back(std::move(p));
  }
  parked_.clear();
  of_worker_.clear();
}

void ParkedPulls::EndWorker(int worker, std::vector<PullStatePtr>* ended) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if ((*it)->worker() != worker) {
      ++it;
      continue;
    }
    if ((*it)->End()) ended->push_back(*it);
    it = Erase(it);
  }
}

int64_t ParkedPulls::Pending() const {
  int64_t pending = 0;
  for (const PullStatePtr& p : parked_) pending += p->Over() ? 0 : 1;
  return pending;
}

absl::StatusOr<std::vector<int>> ResolvePull(const PullRequest& request,
                                             const absl::flat_hash_map<std::string, int>& index,
                                             int tensor_count, int shard_id) {
  if (request.names_size() > tensor_count) {
    return absl::InvalidArgumentError(absl::StrCat("a pull of ", request.names_size(),
                                                   " tensors from a shard of ", tensor_count));
  }
  std::vector<int> which;
  if (request.names().empty()) {
    for (int i = 0; i < tensor_count; ++i) which.push_back(i);
    return which;
  }
  absl::flat_hash_set<int> seen;
  for (const std::string& name : request.names()) {
    RETURN_IF_ERROR(CheckTensorName(name));  // Before it is echoed in an error.
    auto it = index.find(name);
    if (it == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor '", Printable(name), "' (not on shard ", shard_id, ")"));
    }
    if (!seen.insert(it->second).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' appears twice in one pull"));
    }
    which.push_back(it->second);
  }
  return which;
}

PullResponse CopyPulled(const std::vector<PulledTensor>& tensors) {
  PullResponse response;
  for (const PulledTensor& t : tensors) {
    TensorValue* v = response.add_tensors();
    v->set_name(*t.name);
    v->set_version(t.snapshot.version);
    FloatsToBytes(*t.snapshot.values, v->mutable_data());
  }
  return response;
}

std::string DescribePullWait(const PullState& pull, bool started, const Membership& members,
                             const ConsistencyPolicy& policy,
                             const std::vector<std::unique_ptr<TensorAggregator>>& tensors) {
  if (!started) {
    std::vector<int> missing;
    for (int w = 0; w < members.num_workers(); ++w) {
      if (!members.worker(w).registered) missing.push_back(w);
    }
    return absl::StrCat("waiting for worker(s) ", absl::StrJoin(missing, ", "), " to register (",
                        members.members(), " of ", members.num_workers(), " registered)");
  }
  if (!pull.armed && !policy.MayStartPull(pull.step(), members)) {
    return policy.DescribeBlockedPull(pull.step(), members);
  }
  for (int i : pull.tensors()) {
    const TensorAggregator& t = *tensors[i];
    const int64_t version = t.version();
    if (version >= pull.step()) continue;
    return absl::StrCat("tensor '", t.name(), "' is at version ", version, "; waiting for step ",
                        version, " gradients from worker(s) ",
                        absl::StrJoin(t.Missing(members.member()), ", "));
  }
  return "nothing (ready)";
}

}  // namespace rubato
