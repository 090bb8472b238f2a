#include "worker/ps/fan_out.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace rubato {
namespace {

constexpr absl::Duration kFirstBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

// UNAVAILABLE from the transport (refused, reset, cut), not from a shard that answered: a shard
// that is shutting down says so in its message and is not retried. Or no answer by the call's
// deadline (`past_deadline`): the shard's own DEADLINE_EXCEEDED comes before it.
bool IsTransportFailure(const absl::Status& status, bool past_deadline) {
  if (absl::IsDeadlineExceeded(status)) return past_deadline;
  return absl::IsUnavailable(status) &&
         status.message().find("shutting down") == absl::string_view::npos;
}

class Operation : public std::enable_shared_from_this<Operation> {
 public:
  Operation(const FanOutContext* context, FanOutSpec spec, StartCall start,
            std::function<void(absl::Status)> done)
      : context_(context),
        spec_(std::move(spec)),
        start_(std::move(start)),
        done_(std::move(done)),
        deadline_(context->timer->clock()->Now() + spec_.timeout),
        calls_(spec_.shards.size()) {
    if (spec_.gates.empty()) {
      for (int shard : spec_.shards) {
        std::unique_ptr<CallGate>& g = own_gates_[shard];
        if (g == nullptr) g = std::make_unique<CallGate>(kCallsInFlightPerShard);
      }
    }
  }

  void Start() {
    const int n = static_cast<int>(spec_.shards.size());  // calls_.size(), constant
    {
      absl::MutexLock lock(&mu_);
      outstanding_ = n;
    }
    if (n == 0) {
      done_(absl::OkStatus());
      return;
    }
    for (int c = 0; c < n; ++c) Launch(c);
  }

 private:
  struct Call {
    absl::Time first_failure = absl::InfiniteFuture();
    absl::Duration backoff = kFirstBackoff;
    absl::Time deadline;  // The current attempt's.
  };

  int shard(int c) const { return spec_.shards[c]; }
  absl::Time AttemptDeadline(int c) {
    absl::MutexLock lock(&mu_);
    return calls_[c].deadline;
  }
  int64_t weight(int c) const { return spec_.weights.empty() ? 1 : spec_.weights[c]; }
  CallGate* gate(int c) const {
    return spec_.gates.empty() ? own_gates_.at(shard(c)).get() : spec_.gates[shard(c)];
  }

  void Launch(int c) {
    std::shared_ptr<Operation> self = shared_from_this();
    gate(c)->Begin(weight(c), [self, c] {
      ShardChannel::CallOptions options;
      {
        // The first attempt has the operation's deadline; a retry, its timeout from now.
        absl::MutexLock lock(&self->mu_);
        Call& call = self->calls_[c];
        call.deadline = call.first_failure == absl::InfiniteFuture()
                            ? self->deadline_
                            : std::max(self->deadline_,
                                       self->context_->timer->clock()->Now() + self->spec_.timeout);
        options.deadline = call.deadline;
      }
      options.wait_for_ready = self->spec_.retry == Retry::kWaitForReady;
      self->start_(self->context_->channels[self->shard(c)], c, options,
                   [self, c](absl::Status status) {
                     self->gate(c)->End(self->weight(c));
                     self->Ended(c, std::move(status));
                   });
    });
  }

  void Ended(int c, absl::Status status) {
    const absl::Time now = context_->timer->clock()->Now();
    absl::Status error;
    bool retry = false;
    absl::Time when;
    if (!status.ok()) {
      ShardChannel* channel = context_->channels[shard(c)];
      if (spec_.retry == Retry::kWaitForReady && absl::IsDeadlineExceeded(status)) {
        error = absl::UnavailableError(absl::StrCat(
            "cannot reach parameter server shard ", shard(c), " at ", channel->address(),
            " within ", absl::FormatDuration(spec_.timeout), ": ", channel->Diagnose(),
            " (gRPC: ", status.message(), ")"));
      } else if (spec_.retry == Retry::kWhileUnavailable &&
                 IsTransportFailure(status, now >= AttemptDeadline(c))) {
        absl::MutexLock lock(&mu_);
        Call& call = calls_[c];
        if (call.first_failure == absl::InfiniteFuture()) call.first_failure = now;
        const absl::Time give_up = call.first_failure + context_->retry_timeout;
        if (error_.ok() && now < give_up) {
          retry = true;
          when = now + std::min(call.backoff, give_up - now);
          call.backoff = std::min(2 * call.backoff, kMaxBackoff);
        }
      } else {
        error = absl::Status(status.code(), absl::StrCat("server ", channel->address(), ": ",
                                                         status.message()));
      }
      if (!retry && error.ok()) {
        absl::Time first;
        {
          absl::MutexLock lock(&mu_);
          first = calls_[c].first_failure;
        }
        const bool silent = absl::IsDeadlineExceeded(status);
        error = absl::UnavailableError(absl::StrCat(
            "parameter server shard ", shard(c), " at ", channel->address(),
            silent ? " gave no answer" : " unreachable", " for ",
            absl::FormatDuration(now - first), " (retried with backoff for up to ",
            absl::FormatDuration(context_->retry_timeout), "): ",
            silent ? "its calls found no answer by their deadlines (a shard stopped, overloaded "
                     "or cut off; see its log); "
                   : "",
            channel->Diagnose(), " (gRPC: ", status.message(), ")"));
      }
    }
    if (retry) {
      std::shared_ptr<Operation> self = shared_from_this();
      context_->timer->At(when, [self, c] { self->Retried(c); });
      return;
    }
    End(std::move(error));
  }

  // A call's backoff is over: start it again, unless another call failed meanwhile.
  void Retried(int c) {
    bool failed;
    {
      absl::MutexLock lock(&mu_);
      failed = !error_.ok();
    }
    if (failed) {
      End(absl::OkStatus());
      return;
    }
    Launch(c);
  }

  // A call is over for good, with `error` (OK: it succeeded, or gave up for another's error).
  void End(absl::Status error) {
    bool last;
    absl::Status result;
    {
      absl::MutexLock lock(&mu_);
      if (error_.ok()) error_ = std::move(error);
      last = --outstanding_ == 0;
      if (last) result = error_;
    }
    if (last) done_(std::move(result));
  }

  const FanOutContext* const context_;
  const FanOutSpec spec_;
  const StartCall start_;
  const std::function<void(absl::Status)> done_;
  const absl::Time deadline_;
  std::map<int, std::unique_ptr<CallGate>> own_gates_;  // Without spec_.gates.
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // Calls not over for good.
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void StartFanOut(const FanOutContext* context, FanOutSpec spec, StartCall start,
                 std::function<void(absl::Status)> done) {
  std::make_shared<Operation>(context, std::move(spec), std::move(start), std::move(done))
      ->Start();
}

absl::Status RunFanOut(const FanOutContext* context, FanOutSpec spec, StartCall start) {
  absl::Notification over;
  absl::Status result;
  StartFanOut(context, std::move(spec), std::move(start), [&](absl::Status status) {
    result = std::move(status);
    over.Notify();
  });
  over.WaitForNotification();
  return result;
}

FanOutSpec EveryShard(int shards, absl::Duration timeout, Retry retry) {
  FanOutSpec spec;
  for (int s = 0; s < shards; ++s) spec.shards.push_back(s);
  spec.timeout = timeout;
  spec.retry = retry;
  return spec;
}

}  // namespace rubato
