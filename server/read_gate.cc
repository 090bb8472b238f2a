#include "server/read_gate.h"

#include <utility>

namespace rubato {

void ReadGate::Enter(int caller, Start start) {
  {
    absl::MutexLock lock(&mu_);
    int& mine = reading_[caller];
    if (reading_total_ >= total_ || mine >= per_caller_) {
      waiting_[caller].push_back(std::move(start));
      return;
    }
    ++mine;
    ++reading_total_;
  }
  (*start)();
}

void ReadGate::Grant(std::vector<Start>* grants) {
  while (reading_total_ < total_ && !waiting_.empty()) {
    // The waiting caller with the fewest reads going; among equals, the first after the one
    // served last (wrapping around).
    auto pick = waiting_.end();
    int fewest = per_caller_;
    bool pick_after = false;
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      const int reads = reading_[it->first];
      const bool after = it->first > last_served_;
      if (reads < fewest || (reads == fewest && pick != waiting_.end() && after && !pick_after)) {
        pick = it;
        fewest = reads;
        pick_after = after;
      }
    }
    if (pick == waiting_.end()) return;  // every waiting caller reads its share
    ++reading_[pick->first];
    ++reading_total_;
    last_served_ = pick->first;
    grants->push_back(std::move(pick->second.front()));
    pick->second.pop_front();
    if (pick->second.empty()) waiting_.erase(pick);
  }
}

void ReadGate::Leave(int caller) {
  std::vector<Start> grants;
  {
    absl::MutexLock lock(&mu_);
    --reading_[caller];
    --reading_total_;
    Grant(&grants);
  }
  for (const Start& start : grants) (*start)();
}

bool ReadGate::Withdraw(int caller, const std::function<void()>* start) {
  absl::MutexLock lock(&mu_);
  auto it = waiting_.find(caller);
  if (it == waiting_.end()) return false;
  std::deque<Start>& queue = it->second;
  for (auto w = queue.begin(); w != queue.end(); ++w) {
    if (w->get() == start) {
      queue.erase(w);
      if (queue.empty()) waiting_.erase(it);
      return true;
    }
  }
  return false;
}

int ReadGate::reading(int caller) const {
  absl::MutexLock lock(&mu_);
  auto it = reading_.find(caller);
  return it == reading_.end() ? 0 : it->second;
}

int ReadGate::waiting(int caller) const {
  absl::MutexLock lock(&mu_);
  auto it = waiting_.find(caller);
  return it == waiting_.end() ? 0 : static_cast<int>(it->second.size());
}

int ReadGate::reading() const {
  absl::MutexLock lock(&mu_);
  return reading_total_;
}

}  // namespace rubato
