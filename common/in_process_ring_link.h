// InProcessLink: a RingLink (common/ring_allreduce.h) between threads of one process, for tests.
#ifndef RUBATO_COMMON_IN_PROCESS_RING_LINK_H_
#define RUBATO_COMMON_IN_PROCESS_RING_LINK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ring_allreduce.h"

namespace rubato {

// A link that copies nothing: Send leaves a pointer to the sender's memory in the next rank's
// mailbox, the receiver reads it there, and only then is the block released. So the algorithm's
// use of sent memory is tested: writing a region before the next rank has read it (an all-gather
// step too early, a call returning before Flush) changes what that rank receives.
struct Ledger {
  absl::Mutex mu;
  std::set<int64_t> outstanding ABSL_GUARDED_BY(mu);
};

struct Block {
  absl::Span<const float> data;
  Ledger* sender;
};

class InProcessMailbox {
 public:
  void Put(int64_t tag, Block block) {
    absl::MutexLock lock(&mu_);
    blocks_[tag] = block;
  }
  bool AwaitAny(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto any = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !blocks_.empty(); };
    return mu_.AwaitWithDeadline(absl::Condition(&any), deadline);
  }
  absl::Status Take(int64_t tag, absl::Span<float> out, RingLink::Combine combine,
                    absl::Time deadline, int from) {
    Block block;
    {
      absl::MutexLock lock(&mu_);
      auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return blocks_.count(tag) > 0; };
      if (!mu_.AwaitWithDeadline(absl::Condition(&has), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("no block ", tag, " from rank ", from));
      }
      block = blocks_[tag];
      blocks_.erase(tag);
    }
    if (block.data.size() != out.size()) {
      return absl::InternalError(absl::StrCat("block ", tag, " has ", block.data.size()));
    }
    // Give the sender a chance to (wrongly) overwrite the block before it is read.
    std::this_thread::yield();
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = combine == RingLink::Combine::kAdd ? out[i] + block.data[i] : block.data[i];
    }
    absl::MutexLock lock(&block.sender->mu);
    block.sender->outstanding.erase(tag);
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  std::map<int64_t, Block> blocks_ ABSL_GUARDED_BY(mu_);
};

class InProcessLink : public RingLink {
 public:
  InProcessLink(int rank, std::vector<std::unique_ptr<InProcessMailbox>>* boxes)
      : rank_(rank), boxes_(boxes) {}
  absl::Status Send(int64_t tag, absl::Span<const float> data) override {
    {
      absl::MutexLock lock(&ledger_.mu);
      ledger_.outstanding.insert(tag);
    }
    (*boxes_)[(rank_ + 1) % boxes_->size()]->Put(tag, Block{data, &ledger_});
    return absl::OkStatus();
  }
  absl::Status Flush(absl::Time deadline) override {
    absl::MutexLock lock(&ledger_.mu);
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ledger_.mu) {
      return ledger_.outstanding.empty();
    };
    if (!ledger_.mu.AwaitWithDeadline(absl::Condition(&released), deadline)) {
      return absl::DeadlineExceededError("blocks not released");
    }
    return absl::OkStatus();
  }
  absl::Status Receive(int64_t tag, absl::Span<float> out, Combine combine,
                       absl::Time deadline) override {
    const int size = static_cast<int>(boxes_->size());
    return (*boxes_)[rank_]->Take(tag, out, combine, deadline, (rank_ + size - 1) % size);
  }
  absl::StatusOr<bool> Incoming(absl::Time deadline) override {
    return (*boxes_)[rank_]->AwaitAny(deadline);
  }

 private:
  int rank_;
  std::vector<std::unique_ptr<InProcessMailbox>>* boxes_;
  Ledger ledger_;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_IN_PROCESS_RING_LINK_H_
