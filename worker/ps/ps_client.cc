#include "worker/ps/ps_client.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "worker/ps/call_gate.h"
#include "worker/ps/data_plane_shard_channel.h"
#include "worker/ps/fan_out.h"
#include "worker/ps/grpc_shard_channel.h"
#include "worker/ps/ps_codec.h"
#include "worker/ps/recovery.h"
#include "worker/ps/retry_timer.h"

namespace rubato {

absl::StatusOr<int64_t> PsClient::StartPush(int64_t, absl::Span<const int>,
                                            absl::Span<const std::vector<float>>,
                                            std::vector<std::vector<float>>*) {
  return absl::UnimplementedError("this client pushes all tensors at once (no partial pushes)");
}

absl::Status PsClient::WaitPush(int64_t, PushResult*, PushTiming*) {
  return absl::UnimplementedError("this client pushes all tensors at once (no partial pushes)");
}

void PsClient::StartPull(int64_t, absl::Span<std::vector<float>>, PullDone done) {
  done(absl::UnimplementedError("this client has no asynchronous pull"), -1);
}

void PsClient::StartPushAll(int64_t, absl::Span<const std::vector<float>>, PushDone done) {
  done(absl::UnimplementedError("this client has no asynchronous push"), PushResult());
}

void PsClient::AddPushResponse(const PushResponse& response, PushResult* result) {
  result->dropped += response.dropped();
  result->max_staleness = std::max(result->max_staleness, response.max_staleness());
  if (response.has_noise_scale()) result->noise.push_back(response.noise_scale());
  if (response.has_batch_change()) result->batch_changes.push_back(response.batch_change());
  if (response.has_consistency_change()) {
    result->consistency_changes.push_back(response.consistency_change());
  }
}

absl::Status PsClient::AdoptConsistency(const std::vector<ConsistencyChange>& changes,
                                        std::vector<ConsistencyChange>* learned) {
  absl::MutexLock lock(&consistency_mu_);
  if (!consistency_plan_.has_value()) return absl::OkStatus();
  for (const ConsistencyChange& c : changes) {
    bool added = false;
    if (absl::Status s = consistency_plan_->Add(c, consistency_workers_, &added); !s.ok()) {
      return absl::InternalError(absl::StrCat("the servers announced ", s.message()));
    }
    if (added && learned != nullptr) learned->push_back(c);
  }
  return absl::OkStatus();
}

std::optional<ConsistencyRelay> PsClient::ConsistencyRelayFor(int64_t step) const {
  absl::MutexLock lock(&consistency_mu_);
  if (!consistency_plan_.has_value()) return std::nullopt;
  ConsistencyRelay relay;
  relay.set_compute_ms(compute_ms_);
  if (timed_step_ == step - 1) relay.set_previous_step_ms(step_ms_);
  if (const ConsistencyChange* c = consistency_plan_->At(step); c != nullptr) {
    // The decision alone: the figures behind it stay with shard 0.
    relay.mutable_change()->set_from_step(c->from_step());
    relay.mutable_change()->set_backup_workers(c->backup_workers());
    relay.mutable_change()->set_staleness(c->staleness());
  }
  return relay;
}

void PsClient::AddPushResult(const PushResult& part, PushResult* total) {
  total->dropped += part.dropped;
  total->max_staleness = std::max(total->max_staleness, part.max_staleness);
  total->noise.insert(total->noise.end(), part.noise.begin(), part.noise.end());
  total->batch_changes.insert(total->batch_changes.end(), part.batch_changes.begin(),
                              part.batch_changes.end());
  total->consistency_changes.insert(total->consistency_changes.end(),
                                    part.consistency_changes.begin(),
                                    part.consistency_changes.end());
  if (part.min_version >= 0) {
    total->min_version =
        total->min_version < 0 ? part.min_version : std::min(total->min_version, part.min_version);
  }
}

namespace {

// A shard's tensors are sent in calls of about kTargetCallBytes (worker/ps/call_plan.h). Calls to
// one shard overlap on its connection, and messages below glibc's largest mmap threshold (32 MiB)
// are built in reused heap memory instead of freshly faulted pages (common/malloc_tuning.h): with
// one call per shard, a 64 MB model ran at 0.12-0.2 GB/s per worker.
// What may be in flight to one shard at once. Pushes: bytes, across every push of the client (the
// tickets of StartPush run at once, one per layer), at most two calls' worth
// (kPushCallsInFlight x the call size: the target call size, or the shard's bsp part size when
// smaller), so many small pushes go together but what the shard receives for this worker stays
// bounded (a bsp shard acknowledges a gradient that arrived before a lower-numbered worker's only
// once it is added); a call larger than that (a large tensor outside bsp) goes alone. Other calls:
// kCallsInFlightPerShard per operation (worker/ps/fan_out.h).
constexpr int64_t kPushCallsInFlight = 2;

// The push gate's limit for a shard of that part size: two calls, each with its framing (names,
// tags; far below kMessageOverheadBytes).
int64_t PushBytesInFlight(int64_t part_elements, int64_t target_call_bytes) {
  return kPushCallsInFlight *
         (PushCallBytes(part_elements, target_call_bytes) + (kMessageOverheadBytes >> 4));
}

// One push (StartPush, or a whole Push) and the pull that may follow it, or a pull alone: its
// calls' buffers, which live until it is over, and what they returned.
struct Ticket {
  BorrowedSlices borrowed;  // First: destroyed last.
  int64_t step = 0;
  // The push: the shard of each call, its bytes (for the shard's push gate), its request and
  // answer.
  std::vector<int> push_shards;
  std::vector<int64_t> weights;
  std::vector<grpc::ByteBuffer> requests;
  std::vector<grpc::ByteBuffer> raw;
  std::vector<PushResponse> responses;
  // The pull: one call per entry of pull_shards, of pull_tensors' tensors for `pull_step`, into
  // `pull_into` (null: no pull).
  int64_t pull_step = 0;
  absl::Span<std::vector<float>> pull_into;
  bool pulls = false;
  std::vector<int> pull_shards;
  std::vector<std::vector<int>> pull_tensors;
  std::vector<grpc::ByteBuffer> pull_requests;
  std::vector<grpc::ByteBuffer> pulled;
  std::vector<PullSink> sinks;

  absl::Status status;
  PsClient::PushTiming timing;
  int64_t min_version = -1;  // Of the tensors pulled, if any.
  // What ends the ticket: `then` where set (an asynchronous operation), else `over` is notified.
  std::function<void()> then;
  absl::Notification over;
};

// The ticket's calls are over.
void Over(const std::shared_ptr<Ticket>& t) {
  if (!t->then) {
    t->over.Notify();
    return;
  }
  std::function<void()> then = std::move(t->then);
  t->then = nullptr;  // It holds the ticket.
  then();
}

class ShardedPsClient final : public PsClient {
 public:
  ShardedPsClient(const PsClientOptions& options, CallPlan plan,
                  std::vector<std::unique_ptr<ShardChannel>> channels)
      : options_(options),
        plan_(std::move(plan)),
        codec_(options_.worker_id, &options_.model, &plan_),
        channels_(std::move(channels)),
        part_elements_(channels_.size(), 0) {
    if (options_.timer == nullptr) own_timer_ = std::make_unique<RetryTimer>(options_.clock);
    context_.timer = options_.timer != nullptr ? options_.timer : own_timer_.get();
    context_.retry_timeout = options_.retry_timeout;
    for (const auto& c : channels_) {
      context_.channels.push_back(c.get());
      addresses_.push_back(c->address());
      push_gates_.push_back(
          std::make_unique<CallGate>(PushBytesInFlight(0, options_.target_call_bytes)));
      gates_.push_back(push_gates_.back().get());
    }
  }

  // Tickets never waited for are waited for here: their calls hold the client.
  ~ShardedPsClient() override {
    for (auto& [ticket, t] : pending_) t->over.WaitForNotification();
  }

  // Registers with every shard; under bsp and backup, first rolls the job back to a common step
  // when a restarted shard stands behind the others (worker/ps/recovery.h), which restarts the
  // shards that were ahead: their calls fail while they do, and registering starts over.
  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial, int32_t batch_size,
                                   int64_t resume_step) override {
    // Counted as it starts and as it ends, so that Heartbeat sees any registration that overlaps
    // its own calls.
    registrations_.fetch_add(1);
    absl::StatusOr<int64_t> resume = RegisterWithRollbacks(initial, batch_size, resume_step);
    registrations_.fetch_add(1);
    return resume;
  }

  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    RETURN_IF_ERROR(CheckPullInto(params.size()));
    std::shared_ptr<Ticket> t = NewPull(step, params);
    StartPulls(t);
    t->over.WaitForNotification();
    if (min_version != nullptr && t->status.ok()) *min_version = t->min_version;
    return t->status;
  }

  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    RETURN_IF_ERROR(codec_.CheckSizes(grads, "gradient"));
    std::shared_ptr<Ticket> t = NewPush(step, AllTensors(), grads);
    StartPushCalls(t);
    t->over.WaitForNotification();
    return Collect(t.get(), result);
  }

  bool supports_async() const override { return true; }

  void StartPull(int64_t step, absl::Span<std::vector<float>> params, PullDone done) override {
    if (absl::Status s = CheckPullInto(params.size()); !s.ok()) {
      done(std::move(s), -1);
      return;
    }
    std::shared_ptr<Ticket> t = NewPull(step, params);
    t->then = [t, done = std::move(done)] {
      done(t->status, t->status.ok() ? t->min_version : -1);
    };
    StartPulls(t);
  }

  void StartPushAll(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushDone done) override {
    if (absl::Status s = codec_.CheckSizes(grads, "gradient"); !s.ok()) {
      done(std::move(s), PushResult());
      return;
    }
    std::shared_ptr<Ticket> t = NewPush(step, AllTensors(), grads);
    t->then = [this, t, done = std::move(done)]() mutable {
      t->requests.clear();
      // A shard may hold the gradients a little longer (a bsp gradient held for its turn is
      // acknowledged once added): `done` once every channel has let go of them.
      t->borrowed.WhenReleased([this, t, done = std::move(done)] {
        PushResult result;
        const absl::Status status = Collect(t.get(), &result);
        done(status, std::move(result));
      });
    };
    StartPushCalls(t);
  }

  bool supports_partial_push() const override { return true; }

  absl::StatusOr<int64_t> StartPush(int64_t step, absl::Span<const int> tensors,
                                    absl::Span<const std::vector<float>> grads,
                                    std::vector<std::vector<float>>* pull_into) override {
    RETURN_IF_ERROR(CheckPartialPush(tensors, grads, pull_into));
    std::shared_ptr<Ticket> t =
        NewPush(step, std::vector<int>(tensors.begin(), tensors.end()), grads);
    if (pull_into != nullptr) {
      // The same tensors for the next step, one call per shard.
      PlanPull(t.get(), step + 1, absl::MakeSpan(*pull_into));
      std::map<int, size_t> call_of_shard;
      for (int i : tensors) {
        const int shard = plan_.placement.shard_of[i];
        auto [it, added] = call_of_shard.emplace(shard, t->pull_shards.size());
        if (added) {
          t->pull_shards.push_back(shard);
          t->pull_tensors.emplace_back();
        }
        t->pull_tensors[it->second].push_back(i);
      }
    }
    const int64_t ticket = next_ticket_++;
    pending_.emplace(ticket, t);
    StartPushCalls(t);
    return ticket;
  }

  absl::Status WaitPush(int64_t ticket, PushResult* result, PushTiming* timing) override {
    auto it = pending_.find(ticket);
    if (it == pending_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no push with ticket ", ticket));
    }
    std::shared_ptr<Ticket> t = std::move(it->second);
    pending_.erase(it);
    t->over.WaitForNotification();
    if (timing != nullptr) *timing = t->timing;
    if (result == nullptr) return Collect(t.get(), nullptr);
    PushResult part;
    const absl::Status status = Collect(t.get(), &part);
    AddPushResult(part, result);
    return status;
  }

  // Every shard at once, so that a slow or unreachable shard delays no other's heartbeat.
  //
  // A shard that answers ABORTED has dropped this worker or restarted: the training loop must
  // register again, and will once one of its calls is refused so. But the loop may be waiting at
  // another shard (an ssp pull, for a worker that itself waits for this one to come back to the
  // restarted shard) and would wait there until the servers' wait timeout. So the shards that
  // answered are asked to end this worker's waiting pulls (HeartbeatRequest.end_pulls), which
  // answers them ABORTED and sends the loop to register; the next heartbeat asks again while it
  // has not, for a pull that arrived after. Not if a registration ran meanwhile: its own pulls
  // are not to be ended.
  absl::Status Heartbeat(int64_t step) override {
    const int64_t registrations = registrations_.load();
    HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(step);
    std::vector<HeartbeatResponse> responses(channels_.size());
    std::vector<absl::Status> answers(channels_.size());
    const absl::Status status = RunFanOut(
        &context_, EveryShard(shards(), options_.heartbeat_timeout, Retry::kNever),
        [&](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
            ShardChannel::Done done) {
          channel->Heartbeat(request, &responses[call], o,
                             [&answers, call, done = std::move(done)](absl::Status s) {
                               answers[call] = s;
                               done(std::move(s));
                             });
        });
    if (!absl::IsAborted(status) || registrations_.load() != registrations) return status;
    FanOutSpec others = EveryShard(0, options_.heartbeat_timeout, Retry::kNever);
    for (int s = 0; s < shards(); ++s) {
      if (answers[s].ok()) others.shards.push_back(s);
    }
    if (others.shards.empty()) return status;
    RUBATO_LOG(INFO) << "worker " << options_.worker_id
                     << " is to register again; ending its waiting pulls at shard(s) "
                     << absl::StrJoin(others.shards, ", ") << " (" << status.message() << ")";
    request.set_end_pulls(true);
    const absl::Status ended = RunFanOut(
        &context_, std::move(others),
        [&](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
            ShardChannel::Done done) {
          channel->Heartbeat(request, &responses[call], o, std::move(done));
        });
    if (!ended.ok()) RUBATO_LOG(WARNING) << "ending waiting pulls: " << ended;
    return status;
  }

  absl::Status Finish(int64_t steps) override {
    FinishRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(steps);
    std::vector<FinishResponse> responses(channels_.size());
    return RunFanOut(&context_,
                     EveryShard(shards(), options_.rpc_timeout, Retry::kWhileUnavailable),
                     [&](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
                         ShardChannel::Done done) {
                       channel->Finish(request, &responses[call], o, std::move(done));
                     });
  }

  absl::StatusOr<TakeWorkResponse> TakeWork(const TakeWorkRequest& request) override {
    TakeWorkResponse response;
    FanOutSpec shard0 = EveryShard(0, options_.rpc_timeout, Retry::kWhileUnavailable);
    shard0.shards.push_back(0);
    RETURN_IF_ERROR(RunFanOut(&context_, std::move(shard0),
                              [&](ShardChannel* channel, int, const ShardChannel::CallOptions& o,
                                  ShardChannel::Done done) {
                                channel->TakeWork(request, &response, o, std::move(done));
                              }));
    return response;
  }

  const std::vector<int>& shard_of() const override { return plan_.placement.shard_of; }
  const std::vector<int64_t>& shard_bytes() const override { return plan_.placement.shard_bytes; }

 private:
  int shards() const { return static_cast<int>(channels_.size()); }
  absl::Time Now() const { return options_.clock->Now(); }

  absl::StatusOr<int64_t> RegisterWithRollbacks(absl::Span<const std::vector<float>> initial,
                                                int32_t batch_size, int64_t resume_step) {
    constexpr int kMaxRollbacks = 4;
    const absl::Time deadline = Now() + options_.connect_timeout;
    int rollbacks = 0;
    for (;;) {
      std::vector<RegisterResponse> responses;
      absl::StatusOr<int64_t> resume = RegisterRound(initial, batch_size, resume_step, &responses);
      if (!resume.ok()) {
        // A shard restarting to roll back, asked by this worker or by another (it answers
        // "shutting down" until it exits, then cannot be reached until it is up again): its
        // restarted self is waited for up to the connect timeout, as a shard not up yet is.
        if (absl::IsUnavailable(resume.status()) && Now() < deadline) {
          options_.clock->SleepFor(absl::Milliseconds(200));
          continue;
        }
        return resume.status();
      }
      const std::optional<RollbackPlan> rollback = PlanRollback(responses);
      if (!rollback.has_value()) {
        if (const std::string split = DescribeSplitStep(responses); !split.empty()) {
          RUBATO_LOG(WARNING) << split;
        }
        return *resume;
      }
      RETURN_IF_ERROR(RollBack(*rollback, responses));
      if (++rollbacks > kMaxRollbacks) {
        return absl::FailedPreconditionError(
            absl::StrCat("the shards still belong to different recoveries after ", kMaxRollbacks,
                         " roll-backs (", DescribeRecoveries(responses), ")"));
      }
      options_.clock->SleepFor(absl::Milliseconds(200));
    }
  }

  // One round of registration with every shard: without initial values first (a shard that has
  // no weights yet asks one worker for them, needs_initial_values, and tells the others to come
  // back, initialising), then with them where asked, until every shard has registered this worker.
  // The step to resume from: a step some shard has not seen from this worker is pushed again
  // everywhere (shards that had it acknowledge the repeat as a duplicate).
  absl::StatusOr<int64_t> RegisterRound(absl::Span<const std::vector<float>> initial,
                                        int32_t batch_size, int64_t resume_step,
                                        std::vector<RegisterResponse>* out) {
    RETURN_IF_ERROR(codec_.CheckSizes(initial, "initial value"));
    std::vector<RegisterRequest> requests = RegisterRequests(batch_size, resume_step);
    std::vector<RegisterResponse> responses(shards());
    const absl::Time deadline = Now() + options_.connect_timeout;
    FanOutSpec spec = EveryShard(shards(), absl::ZeroDuration(), Retry::kWaitForReady);
    absl::Duration backoff = absl::Milliseconds(20);
    while (!spec.shards.empty()) {
      spec.timeout = std::max(absl::Seconds(1), deadline - Now());
      const std::vector<int> pending = spec.shards;
      RETURN_IF_ERROR(RunFanOut(&context_, spec,
                                [&](ShardChannel* channel, int call,
                                    const ShardChannel::CallOptions& o, ShardChannel::Done done) {
                                  const int s = pending[call];
                                  channel->Register(requests[s], &responses[s], o, std::move(done));
                                }));
      std::vector<int> again;
      bool waiting = false;
      for (int s : pending) {
        const RegisterResponse& r = responses[s];
        if (r.needs_initial_values() && requests[s].initial_values().empty()) {
          AddInitialValues(s, initial, &requests[s]);
          again.push_back(s);
        } else if (r.needs_initial_values() || r.initialising()) {
          again.push_back(s);
          waiting = waiting || r.initialising();
        }
      }
      if (again.empty()) break;
      if (Now() > deadline) {
        return absl::UnavailableError(absl::StrCat(
            "parameter server shard ", again[0], " at ", addresses_[again[0]],
            " has had no initial weights for ", absl::FormatDuration(options_.connect_timeout),
            " (the worker asked for them never sent them)"));
      }
      if (waiting) {
        options_.clock->SleepFor(backoff);
        backoff = std::min(2 * backoff, absl::Milliseconds(500));
      }
      spec.shards = std::move(again);
    }
    RETURN_IF_ERROR(CheckRegisterAnswers(responses, addresses_));
    int64_t resume = responses[0].resume_step();
    registered_batch_plan_.clear();
    for (int s = 0; s < shards(); ++s) {
      channels_[s]->Registered(responses[s]);
      part_elements_[s] = responses[s].part_elements();
      push_gates_[s]->SetLimit(PushBytesInFlight(part_elements_[s], options_.target_call_bytes));
      resume = std::min(resume, responses[s].resume_step());
      KeepBatchPlan(responses[s]);
    }
    *out = std::move(responses);
    return resume;
  }

  std::vector<RegisterRequest> RegisterRequests(int32_t batch_size, int64_t resume_step) const {
    std::vector<RegisterRequest> requests(shards());
    for (RegisterRequest& r : requests) {
      r.set_worker_id(options_.worker_id);
      r.set_batch_size(batch_size);
      r.set_resume_step(resume_step);
      r.set_num_workers(options_.num_workers);
      *r.mutable_consistency() = options_.consistency;
      r.set_steps_per_epoch(options_.steps_per_epoch);
      r.set_total_steps(options_.total_steps);
    }
    for (size_t i = 0; i < options_.model.size(); ++i) {
      *requests[plan_.placement.shard_of[i]].add_model() = options_.model[i];
    }
    return requests;
  }

  void AddInitialValues(int shard, absl::Span<const std::vector<float>> initial,
                        RegisterRequest* request) const {
    for (size_t i = 0; i < options_.model.size(); ++i) {
      if (plan_.placement.shard_of[i] != shard) continue;
      TensorValue* v = request->add_initial_values();
      v->set_name(options_.model[i].name());
      FloatsToBytes(initial[i], v->mutable_data());
    }
  }

  // Asks the shards `plan` names to roll back; FAILED_PRECONDITION naming the shards and the step
  // to restore by hand if one cannot.
  // Rolls plan.shards back to plan.request's step. A shard without that step's checkpoint (its
  // writer skipped it to keep up) agrees to nothing and names the newest it has before it; then
  // every shard, the restored one included, is rolled back to the oldest step so named, as a
  // recovery every worker names alike (RecoveryIdFor), until all agree.
  absl::Status RollBack(RollbackPlan plan, const std::vector<RegisterResponse>& responses) {
    RUBATO_LOG(WARNING) << "the shards stand at different recoveries ("
                        << DescribeRecoveries(responses) << "): rolling shard(s) "
                        << absl::StrJoin(plan.shards, ", ") << " back to step "
                        << plan.request.step() << ", shard " << plan.behind << "'s checkpoint";
    constexpr int kMaxRounds = 8;
    for (int round = 1;; ++round) {
      std::vector<RollbackResponse> answers;
      RETURN_IF_ERROR(RollBackOnce(plan, responses, &answers));
      int64_t back_to = plan.request.step();
      std::vector<int> lacking;
      for (const RollbackResponse& a : answers) {
        // Another worker's roll-back went further back meanwhile: register again, plan anew.
        if (a.behind()) return absl::OkStatus();
      }
      for (size_t i = 0; i < answers.size(); ++i) {
        if (!answers[i].lacks_checkpoint()) continue;
        lacking.push_back(plan.shards[i]);
        back_to = std::min(back_to, answers[i].newest_checkpoint_before());
      }
      if (lacking.empty()) return absl::OkStatus();
      if (back_to < 0 || round == kMaxRounds) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rolling back to step ", plan.request.step(), ": shard(s) ",
            absl::StrJoin(lacking, ", "),
            " have no checkpoint of that step nor of one before it that every shard has; "
            "restart every shard with --restore_step of a step each has, or afresh"));
      }
      RUBATO_LOG(WARNING) << "shard(s) " << absl::StrJoin(lacking, ", ")
                          << " have no checkpoint of step " << plan.request.step()
                          << " (their writers skipped it): rolling every shard back to step "
                          << back_to;
      plan.request.set_recovery_id(RecoveryIdFor(plan.request.recovery_id(), back_to));
      plan.request.set_step(back_to);
      plan.shards.clear();
      for (int s = 0; s < shards(); ++s) plan.shards.push_back(s);
    }
  }

  absl::Status RollBackOnce(const RollbackPlan& plan, const std::vector<RegisterResponse>& responses,
                            std::vector<RollbackResponse>* answers_out) {
    RollbackRequest request = plan.request;
    request.set_worker_id(options_.worker_id);
    FanOutSpec spec;
    spec.shards = plan.shards;
    spec.timeout = options_.rpc_timeout;
    // Another worker may have asked first: the shard is then restarting to roll back, and answers
    // UNAVAILABLE, or cannot be reached, until its restarted self does; that one answers this
    // recovery's roll-back as done. So it is retried as a push is.
    spec.retry = Retry::kWhileUnavailable;
    std::vector<RollbackResponse> answers(plan.shards.size());
    const absl::Status status = RunFanOut(
        &context_, spec,
        [&](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
            ShardChannel::Done done) {
          channel->Rollback(request, &answers[call], o, std::move(done));
        });
    if (!status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shards stand at different steps after a restart (", DescribeRecoveries(responses),
          ") and rolling back to step ", request.step(), " failed: ", status.message(),
          "; restart every shard with --restore_step=", request.step(),
          " (each keeps its newest --checkpoint_keep checkpoints)"));
    }
    *answers_out = std::move(answers);
    return absl::OkStatus();
  }

  absl::Status CheckPartialPush(absl::Span<const int> tensors,
                                absl::Span<const std::vector<float>> grads,
                                const std::vector<std::vector<float>>* pull_into) const {
    const size_t n = options_.model.size();
    if (pull_into != nullptr) RETURN_IF_ERROR(CheckPullInto(pull_into->size()));
    if (grads.size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(grads.size(), " gradients for a model of ", n, " tensors"));
    }
    if (tensors.empty()) return absl::InvalidArgumentError("a push of no tensors");
    std::vector<bool> seen(n, false);
    for (int i : tensors) {
      if (i < 0 || i >= static_cast<int>(n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("push of tensor index ", i, ", the model has ", n, " tensors"));
      }
      if (seen[i]) {
        return absl::InvalidArgumentError(absl::StrCat("tensor index ", i, " pushed twice"));
      }
      seen[i] = true;
      if (static_cast<int64_t>(grads[i].size()) != plan_.elements[i]) {
        return absl::InvalidArgumentError(absl::StrCat("gradient of '", options_.model[i].name(),
                                                       "' has ", grads[i].size(),
                                                       " elements, expected ", plan_.elements[i]));
      }
    }
    return absl::OkStatus();
  }

  // A ticket pushing `tensors` of `grads` (sent in place), its calls planned but not started.
  std::shared_ptr<Ticket> NewPush(int64_t step, const std::vector<int>& tensors,
                                  absl::Span<const std::vector<float>> grads) {
    auto t = std::make_shared<Ticket>();
    t->step = step;
    t->timing.started = Now();
    const std::optional<ConsistencyRelay> consistency = ConsistencyRelayFor(step);
    for (const PushCall& call :
         PlanPushCalls(plan_, tensors, part_elements_, options_.target_call_bytes)) {
      t->push_shards.push_back(call.shard);
      t->requests.push_back(codec_.PushRequestFor(
          step, call.pieces, grads, push_batch_size_, has_push_relay_ ? &push_relay_ : nullptr,
          &t->borrowed, consistency.has_value() ? &*consistency : nullptr));
      t->weights.push_back(static_cast<int64_t>(t->requests.back().Length()));
    }
    t->raw.resize(t->requests.size());
    return t;
  }

  absl::Status CheckPullInto(size_t tensors) const {
    if (tensors == options_.model.size()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("pull into ", tensors, " tensors, model has ", options_.model.size()));
  }

  std::vector<int> AllTensors() const {
    std::vector<int> all(options_.model.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    return all;
  }

  // A ticket pulling every tensor for `step` into `params`, its calls planned but not started.
  std::shared_ptr<Ticket> NewPull(int64_t step, absl::Span<std::vector<float>> params) {
    auto t = std::make_shared<Ticket>();
    t->timing.started = Now();
    PlanPull(t.get(), step, params);
    for (const CallGroup& g : plan_.groups) {
      t->pull_shards.push_back(g.shard);
      t->pull_tensors.push_back(g.tensors);
    }
    return t;
  }

  // The ticket pulls for `step` into `into` once its push is acknowledged (its calls: the caller
  // fills pull_shards and pull_tensors).
  void PlanPull(Ticket* t, int64_t step, absl::Span<std::vector<float>> into) const {
    t->pulls = true;
    t->pull_step = step;
    t->pull_into = into;
  }

  // Calls to `shards` that carry tensors: each with the call deadline, retried while a shard is
  // unreachable.
  FanOutSpec PushPullCalls(std::vector<int> shards) const {
    FanOutSpec spec;
    spec.shards = std::move(shards);
    spec.timeout = options_.rpc_timeout;
    spec.retry = Retry::kWhileUnavailable;
    return spec;
  }

  // The push's calls, through the shards' push gates, retried while a shard is unreachable; then
  // the pull, if any.
  void StartPushCalls(const std::shared_ptr<Ticket>& t) {
    FanOutSpec spec = PushPullCalls(t->push_shards);
    spec.weights = t->weights;
    spec.gates = gates_;
    StartFanOut(
        &context_, std::move(spec),
        [t](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
            ShardChannel::Done done) {
          channel->Push(&t->requests[call], &t->raw[call], o, std::move(done));
        },
        [this, t](absl::Status status) {
          t->responses.resize(t->raw.size());
          for (size_t c = 0; c < t->raw.size() && status.ok(); ++c) {
            status = ParseMessageBytes(addresses_[t->push_shards[c]], t->raw[c], &t->responses[c]);
          }
          t->timing.acknowledged = t->timing.pulled = Now();
          t->status = std::move(status);
          if (!t->status.ok() || !t->pulls) {
            Over(t);
            return;
          }
          StartPulls(t);
        });
  }

  // The ticket's pull calls; the ticket is over when they are.
  void StartPulls(const std::shared_ptr<Ticket>& t) {
    const size_t calls = t->pull_shards.size();
    for (size_t c = 0; c < calls; ++c) {
      t->pull_requests.push_back(codec_.PullRequestFor(t->pull_step, t->pull_tensors[c]));
      t->sinks.push_back(codec_.SinkFor(t->pull_tensors[c], t->pull_into));
    }
    t->pulled.resize(calls);
    FanOutSpec spec = PushPullCalls(t->pull_shards);
    StartFanOut(
        &context_, std::move(spec),
        [t](ShardChannel* channel, int call, const ShardChannel::CallOptions& o,
            ShardChannel::Done done) {
          channel->Pull(&t->pull_requests[call], &t->pulled[call], &t->sinks[call], o,
                        std::move(done));
        },
        [this, t](absl::Status status) {
          bool first = true;
          for (size_t c = 0; c < t->pull_shards.size() && status.ok(); ++c) {
            const int shard = t->pull_shards[c];
            status = codec_.StorePulled(shard, addresses_[shard], t->pull_tensors[c], t->sinks[c],
                                        t->pulled[c], t->pull_into, &t->min_version, &first);
          }
          t->timing.pulled = Now();
          t->status = std::move(status);
          Over(t);
        });
  }

  // An over ticket's status, and what its shards reported into *result (if given). The gradients
  // may change once this returns: every channel has let go of them.
  absl::Status Collect(Ticket* t, PushResult* result) {
    t->requests.clear();
    t->borrowed.WaitReleased();
    if (result != nullptr) {
      *result = PushResult();
      for (const PushResponse& r : t->responses) AddPushResponse(r, result);
      result->min_version = t->min_version;
    }
    return t->status;
  }

  const PsClientOptions options_;
  // Placement, the pulls' call groups and each tensor's elements (worker/ps/call_plan.h).
  const CallPlan plan_;
  const PsCodec codec_;
  const std::vector<std::unique_ptr<ShardChannel>> channels_;
  std::vector<std::string> addresses_;  // Of each shard, for messages.
  std::unique_ptr<RetryTimer> own_timer_;  // Unless options_.timer is given.
  FanOutContext context_;
  // Each shard's bsp part size from its last Register answer (0: whole tensors).
  std::vector<int64_t> part_elements_;
  // One gate per shard for the calls that carry gradients, shared by Push and every StartPush.
  std::vector<std::unique_ptr<CallGate>> push_gates_;
  std::vector<CallGate*> gates_;  // The same.
  // Pushes started and not yet waited for, by ticket. Used by the training thread only.
  std::map<int64_t, std::shared_ptr<Ticket>> pending_;
  int64_t next_ticket_ = 1;
  std::atomic<int64_t> registrations_{0};  // Register's starts and ends (see Heartbeat).
};

}  // namespace

absl::StatusOr<std::unique_ptr<PsClient>> CreatePsClient(
    const PsClientOptions& options, std::vector<std::unique_ptr<ShardChannel>> channels) {
  if (channels.empty()) return absl::InvalidArgumentError("no parameter servers given");
  if (options.model.empty()) return absl::InvalidArgumentError("the model has no tensors");
  for (const auto& c : channels) {
    if (c == nullptr) return absl::InvalidArgumentError("a shard without a channel");
  }
  if (options.clock == nullptr) return absl::InvalidArgumentError("no clock");
  if (options.timer != nullptr && options.timer->clock() != options.clock) {
    return absl::InvalidArgumentError("the client's timer runs on another clock than its own");
  }
  ASSIGN_OR_RETURN(CallPlan plan, PlanCalls(options.model, static_cast<int>(channels.size()),
                                            options.max_message_bytes, options.target_call_bytes));
  std::unique_ptr<PsClient> client(
      new ShardedPsClient(options, std::move(plan), std::move(channels)));
  if (options.consistency.mode() == ADAPTIVE) {
    client->EnableAdaptiveConsistency(options.consistency.adaptive_every_steps(),
                                      options.num_workers);
  }
  return client;
}

absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(const PsClientOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no parameter servers given");
  const bool data_plane = options.use_data_plane;
  std::vector<std::unique_ptr<ShardChannel>> channels;
  for (size_t s = 0; s < options.servers.size(); ++s) {
    auto grpc_channel = std::make_unique<GrpcShardChannel>(options.servers[s], options.security,
                                                           options.max_message_bytes);
    if (!data_plane) {
      channels.push_back(std::move(grpc_channel));
      continue;
    }
    DataPlaneShardChannel::Options o;
    o.worker_id = options.worker_id;
    o.answer_challenge = [security = options.security](absl::string_view challenge) {
      return security.HelloAnswer(challenge);
    };
    o.description = absl::StrCat("shard ", s, " at ", options.servers[s]);
    o.max_message_bytes = options.max_message_bytes;
    o.tls = options.security.data_tls();  // Null without TLS.
    channels.push_back(std::make_unique<DataPlaneShardChannel>(std::move(grpc_channel), o));
  }
  return CreatePsClient(options, std::move(channels));
}

}  // namespace rubato
