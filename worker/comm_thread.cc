#include "worker/comm_thread.h"

#include <sys/prctl.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace rubato {

CommThread::CommThread() : thread_([this] { Loop(); }) {}

CommThread::~CommThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void CommThread::Post(std::string what, std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({std::move(what), std::move(task)});
}

absl::Status CommThread::Drain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  if (mu_.AwaitWithTimeout(absl::Condition(&idle), timeout)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "the communication thread is still busy after ", absl::FormatDuration(timeout), ": ",
      busy_ ? running_ : "a task", " is running, and ", queue_.size(), " more wait behind it"));
}

int64_t CommThread::tasks_run() const {
  absl::MutexLock lock(&mu_);
  return run_;
}

void CommThread::Loop() {
  ::prctl(PR_SET_NAME, "rubato-comm");  // as top -H and perf show it
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return;  // stop_, with nothing left to run
    Task task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    running_ = std::move(task.what);
    mu_.Unlock();
    task.run();
    mu_.Lock();
    busy_ = false;
    running_.clear();
    ++run_;
  }
}

}  // namespace rubato
