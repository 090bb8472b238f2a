#include "worker/ps_client.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/data_plane_wire.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/net_diagnose.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "common/tensor_wire.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "proto/parameter_server.grpc.pb.h"
#include "worker/call_plan.h"
#include "worker/ps_data_channel.h"

namespace rubato {

absl::StatusOr<int64_t> PsClient::StartPush(int64_t, absl::Span<const int>,
                                            absl::Span<const std::vector<float>>,
                                            std::vector<std::vector<float>>*) {
  return absl::UnimplementedError("this client pushes all tensors at once (no partial pushes)");
}

void PsClient::AddPushResponse(const PushResponse& response, PushResult* result) {
  result->dropped += response.dropped();
  result->max_staleness = std::max(result->max_staleness, response.max_staleness());
  if (response.has_noise_scale()) result->noise.push_back(response.noise_scale());
  if (response.has_batch_change()) result->batch_changes.push_back(response.batch_change());
}

void PsClient::AddPushResult(const PushResult& part, PushResult* total) {
  total->dropped += part.dropped;
  total->max_staleness = std::max(total->max_staleness, part.max_staleness);
  total->noise.insert(total->noise.end(), part.noise.begin(), part.noise.end());
  total->batch_changes.insert(total->batch_changes.end(), part.batch_changes.begin(),
                              part.batch_changes.end());
  if (part.min_version >= 0) {
    total->min_version =
        total->min_version < 0 ? part.min_version : std::min(total->min_version, part.min_version);
  }
}

absl::Status PsClient::WaitPush(int64_t, PushResult*, PushTiming*) {
  return absl::UnimplementedError("this client pushes all tensors at once (no partial pushes)");
}

namespace {

// A shard's tensors are sent in calls of about kTargetCallBytes (worker/call_plan.h). Calls to one
// shard overlap on its connection, and messages below glibc's largest mmap threshold (32 MiB) are
// built in reused heap memory instead of freshly faulted pages (common/malloc_tuning.h): with one
// call per shard, a 64 MB model ran at 0.12-0.2 GB/s per worker.
// What may be in flight to one shard at once. Pushes: bytes, across every push of the client (the
// tickets of StartPush run at once, one per layer), at most two calls' worth
// (kPushCallsInFlight x the call size: kTargetCallBytes, or the shard's bsp part size when
// smaller), so many small pushes go together but what the shard receives for this worker stays
// bounded (a bsp shard acknowledges a gradient that arrived before a lower-numbered worker's only
// once it is added); a call larger than that (a large tensor outside bsp) goes alone. Other calls:
// kCallsInFlightPerShard per operation.
constexpr int kCallsInFlightPerShard = 2;
constexpr int64_t kPushCallsInFlight = 2;
// The smallest bsp part a server may ask for (4 KiB; rubato_server's are 1 to 8 MiB).
constexpr int64_t kMinPartElements = 1024;

// The push gate's limit for a shard of that part size: two calls, each with its framing (names,
// tags; far below kMessageOverheadBytes).
int64_t PushBytesInFlight(int64_t part_elements) {
  return kPushCallsInFlight * (PushCallBytes(part_elements) + (kMessageOverheadBytes >> 4));
}

// Lets calls run at once while their weights (1 a call, or its bytes) add up to at most `limit`,
// in the order they were begun; one runs alone whatever its weight. A call begun while the rest
// would not fit starts (on the thread that ends an earlier one) once they do.
class CallGate {
 public:
  explicit CallGate(int64_t limit) : limit_(limit) {}
  CallGate(const CallGate&) = delete;
  CallGate& operator=(const CallGate&) = delete;

  // Runs `start` now, or queues it until enough ends.
  void Begin(int64_t weight, std::function<void()> start) {
    {
      absl::MutexLock lock(&mu_);
      if (!waiting_.empty() || !FitsLocked(weight)) {
        waiting_.push_back({weight, std::move(start)});
        return;
      }
      in_flight_ += weight;
      ++running_;
    }
    start();
  }

  // A call of `weight` that Begin started has ended: the queued ones that now fit start, in order.
  void End(int64_t weight) {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      in_flight_ -= weight;
      --running_;
      TakeReadyLocked(&ready);
    }
    for (auto& start : ready) start();
  }

  // A new limit (a shard announced its part size), for the calls begun from now on.
  void SetLimit(int64_t limit) {
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      limit_ = limit;
      TakeReadyLocked(&ready);
    }
    for (auto& start : ready) start();
  }

 private:
  bool FitsLocked(int64_t weight) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ == 0 || in_flight_ + weight <= limit_;
  }
  void TakeReadyLocked(std::vector<std::function<void()>>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!waiting_.empty() && FitsLocked(waiting_.front().first)) {
      in_flight_ += waiting_.front().first;
      ++running_;
      ready->push_back(std::move(waiting_.front().second));
      waiting_.pop_front();
    }
  }

  absl::Mutex mu_;
  int64_t limit_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::pair<int64_t, std::function<void()>>> waiting_ ABSL_GUARDED_BY(mu_);
};

constexpr char kPushMethod[] = "/rubato.ParameterServer/Push";
constexpr char kPullMethod[] = "/rubato.ParameterServer/Pull";

// Slices that alias the caller's memory (gradients sent in place). gRPC releases each once it no
// longer reads it; the caller's memory may change only after WaitReleased.
class BorrowedSlices {
 public:
  BorrowedSlices() = default;
  BorrowedSlices(const BorrowedSlices&) = delete;
  BorrowedSlices& operator=(const BorrowedSlices&) = delete;
  ~BorrowedSlices() { WaitReleased(); }

  grpc::Slice Borrow(const void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    ++out_;
    return grpc::Slice(const_cast<void*>(data), bytes, &Release, this);
  }

  // gRPC lets go of a call's slices when the call is over, so this returns at once after the
  // calls; the deadline is a guard against a bug, which would otherwise let gRPC read memory that
  // the caller reuses: it ends the process, naming the cause.
  void WaitReleased() {
    absl::MutexLock lock(&mu_);
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_ == 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&released), absl::Seconds(60))) {
      RUBATO_LOG(ERROR) << "gRPC still holds " << out_
                        << " gradient slice(s) 60 s after their calls ended; stopping rather "
                           "than let it read reused memory";
      std::abort();
    }
  }

 private:
  static void Release(void* self) {
    auto* b = static_cast<BorrowedSlices*>(self);
    absl::MutexLock lock(&b->mu_);
    --b->out_;
  }

  absl::Mutex mu_;
  int out_ ABSL_GUARDED_BY(mu_) = 0;
};

grpc::ByteBuffer SerializedMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

class GrpcPsClient final : public PsClient {
 public:
  GrpcPsClient(const PsClientOptions& options, CallPlan plan)
      : options_(options), plan_(std::move(plan)) {
    for (const std::string& address : options_.servers) {
      std::shared_ptr<grpc::Channel> channel =
          grpc::CreateCustomChannel(address, options_.security.credentials(),
                                    RubatoChannelArguments(options_.max_message_bytes));
      stubs_.push_back(ParameterServer::NewStub(channel));
      generic_.push_back(std::make_unique<grpc::GenericStub>(channel));
    }
    for (const CallGroup& g : plan_.groups) group_shards_.push_back(g.shard);
    part_elements_.assign(options_.servers.size(), 0);
    data_.resize(options_.servers.size());
    for (size_t s = 0; s < options_.servers.size(); ++s) {
      push_gates_.push_back(std::make_unique<CallGate>(PushBytesInFlight(0)));
    }
  }

  // Registers with every shard; under bsp and backup, first rolls the job back to a common step
  // when a restarted shard stands behind the others (RollBackIfNeeded), which restarts the shards
  // that were ahead: their calls fail while they do, and registering starts over.
  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial, int32_t batch_size,
                                   int64_t resume_step) override {
    constexpr int kMaxRollbacks = 4;
    const absl::Time deadline = absl::Now() + options_.connect_timeout;
    int rollbacks = 0;
    for (;;) {
      std::vector<RegisterResponse> responses;
      absl::StatusOr<int64_t> resume = RegisterRound(initial, batch_size, resume_step, &responses);
      if (!resume.ok()) {
        if (rollbacks > 0 && absl::IsUnavailable(resume.status()) && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(200));  // A shard restarting for the roll-back.
          continue;
        }
        return resume.status();
      }
      ASSIGN_OR_RETURN(const bool rolled_back, RollBackIfNeeded(responses));
      if (!rolled_back) return *resume;
      if (++rollbacks > kMaxRollbacks) {
        return absl::FailedPreconditionError(
            absl::StrCat("the shards still belong to different recoveries after ", kMaxRollbacks,
                         " roll-backs (", DescribeRecoveries(responses), ")"));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  }

  // Under bsp and backup, every shard must hold the state of one recovery (RegisterResponse's
  // recovery_id). If they differ, a restored shard stands behind: asks every shard of another
  // recovery to roll back to the step of the one furthest behind (ParameterShard::Rollback).
  // True if it asked; FAILED_PRECONDITION naming the shards and the step to restore by hand if a
  // shard cannot.
  absl::StatusOr<bool> RollBackIfNeeded(const std::vector<RegisterResponse>& responses) {
    const ConsistencyMode mode = responses[0].consistency().mode();
    if (mode != BSP && mode != BACKUP) return false;
    int behind = -1;
    bool differ = false;
    for (size_t s = 0; s < responses.size(); ++s) {
      const RegisterResponse& r = responses[s];
      differ |= r.recovery_id() != responses[0].recovery_id();
      if (r.recovery_id() != 0 &&
          (behind < 0 || r.resume_step() < responses[behind].resume_step())) {
        behind = static_cast<int>(s);
      }
    }
    if (!differ || behind < 0) return false;
    RollbackRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(responses[behind].resume_step());
    request.set_recovery_id(responses[behind].recovery_id());
    std::vector<int> call_shards;
    for (size_t s = 0; s < responses.size(); ++s) {
      if (responses[s].recovery_id() != request.recovery_id()) {
        call_shards.push_back(static_cast<int>(s));
      }
    }
    RUBATO_LOG(WARNING) << "the shards stand at different recoveries ("
                        << DescribeRecoveries(responses) << "): rolling shard(s) "
                        << absl::StrJoin(call_shards, ", ") << " back to step " << request.step()
                        << ", shard " << behind << "'s checkpoint";
    std::vector<RollbackResponse> answers(responses.size());
    const absl::Status status = FanOut(call_shards, options_.rpc_timeout, Retry::kNever,
                                       [&](ParameterServer::Stub::async_interface* async, int call,
                                           grpc::ClientContext* context, Done done) {
                                         const int s = call_shards[call];
                                         async->Rollback(context, &request, &answers[s], done);
                                       });
    if (!status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shards stand at different steps after a restart (", DescribeRecoveries(responses),
          ") and rolling back to step ", request.step(), " failed: ", status.message(),
          "; restart every shard with --restore_step=", request.step(),
          " (each keeps its newest --checkpoint_keep checkpoints)"));
    }
    return true;
  }

  static std::string DescribeRecoveries(const std::vector<RegisterResponse>& responses) {
    std::vector<std::string> parts;
    for (size_t s = 0; s < responses.size(); ++s) {
      const RegisterResponse& r = responses[s];
      parts.push_back(absl::StrCat("shard ", s, " at step ", r.resume_step(),
                                   r.recovery_id() == 0
                                       ? std::string(", never restored")
                                       : absl::StrCat(", recovery ", absl::Hex(r.recovery_id()))));
    }
    return absl::StrJoin(parts, "; ");
  }

  absl::StatusOr<int64_t> RegisterRound(absl::Span<const std::vector<float>> initial,
                                        int32_t batch_size, int64_t resume_step,
                                        std::vector<RegisterResponse>* out) {
    RETURN_IF_ERROR(CheckSizes(initial, "initial value"));
    const int shards = static_cast<int>(stubs_.size());
    std::vector<RegisterRequest> requests(shards);
    std::vector<RegisterResponse> responses(shards);
    std::vector<int> call_shards(shards);
    for (int s = 0; s < shards; ++s) {
      call_shards[s] = s;
      requests[s].set_worker_id(options_.worker_id);
      requests[s].set_batch_size(batch_size);
      requests[s].set_resume_step(resume_step);
      requests[s].set_num_workers(options_.num_workers);
      *requests[s].mutable_consistency() = options_.consistency;
      requests[s].set_steps_per_epoch(options_.steps_per_epoch);
      requests[s].set_total_steps(options_.total_steps);
    }
    for (size_t i = 0; i < options_.model.size(); ++i) {
      *requests[plan_.placement.shard_of[i]].add_model() = options_.model[i];
    }
    // Without initial values first: a shard that has no weights yet asks one worker for them
    // (needs_initial_values), and tells the others to come back (initialising).
    const absl::Time deadline = absl::Now() + options_.connect_timeout;
    std::vector<int> pending = call_shards;
    absl::Duration backoff = absl::Milliseconds(20);
    while (!pending.empty()) {
      RETURN_IF_ERROR(FanOut(pending, std::max(absl::Seconds(1), deadline - absl::Now()),
                             Retry::kWaitForReady,
                             [&](ParameterServer::Stub::async_interface* async, int call,
                                 grpc::ClientContext* context, Done done) {
                               const int s = pending[call];
                               async->Register(context, &requests[s], &responses[s], done);
                             }));
      std::vector<int> again;
      for (int s : pending) {
        RegisterResponse& r = responses[s];
        if (r.needs_initial_values() && requests[s].initial_values().empty()) {
          for (size_t i = 0; i < options_.model.size(); ++i) {
            if (plan_.placement.shard_of[i] != s) continue;
            TensorValue* v = requests[s].add_initial_values();
            v->set_name(options_.model[i].name());
            FloatsToBytes(initial[i], v->mutable_data());
          }
          again.push_back(s);
        } else if (r.needs_initial_values() || r.initialising()) {
          again.push_back(s);
        }
      }
      if (again.empty()) break;
      if (absl::Now() > deadline) {
        return absl::UnavailableError(absl::StrCat(
            "parameter server shard ", again[0], " at ", options_.servers[again[0]],
            " has had no initial weights for ", absl::FormatDuration(options_.connect_timeout),
            " (the worker asked for them never sent them)"));
      }
      bool waiting = false;
      for (int s : again) waiting = waiting || responses[s].initialising();
      if (waiting) {
        absl::SleepFor(backoff);
        backoff = std::min(2 * backoff, absl::Milliseconds(500));
      }
      pending = std::move(again);
    }
    for (int s = 0; s < shards; ++s) {
      if (responses[s].num_shards() != shards || responses[s].shard_id() != s) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server at ", options_.servers[s], " is shard ", responses[s].shard_id(), " of ",
            responses[s].num_shards(), ", but this worker has it as shard ", s, " of ", shards));
      }
      // The worker seeks its data to this step (and may send it back in a Rollback).
      if (responses[s].resume_step() < 0 || responses[s].resume_step() >= kMaxStep) {
        return absl::InternalError(absl::StrCat("server at ", options_.servers[s],
                                                " answered resume_step ",
                                                responses[s].resume_step(), ", not in [0, 2^48)"));
      }
      // Parts smaller than kMinPartElements would make a tensor thousands of calls: a server
      // that asks for that is refused, as is one past any tensor's size.
      if (const int64_t part = responses[s].part_elements();
          part != 0 && (part < kMinPartElements || part > kMaxTensorElements)) {
        return absl::InternalError(absl::StrCat("server at ", options_.servers[s],
                                                " answered part_elements ", part, ", not 0 or in [",
                                                kMinPartElements, ", ", kMaxTensorElements, "]"));
      }
    }
    for (int s = 0; s < shards; ++s) {
      UpdateDataChannel(s, responses[s].data_port());
      part_elements_[s] = responses[s].part_elements();
      push_gates_[s]->SetLimit(PushBytesInFlight(part_elements_[s]));
    }
    // A step some shard has not seen from this worker is pushed again everywhere; shards that had
    // it acknowledge the repeat as a duplicate.
    int64_t resume = responses[0].resume_step();
    registered_batch_plan_.clear();
    for (const RegisterResponse& r : responses) {
      resume = std::min(resume, r.resume_step());
      KeepBatchPlan(r);
    }
    *out = std::move(responses);
    return resume;
  }

  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    if (params.size() != options_.model.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pull into ", params.size(), " tensors, model has ", options_.model.size()));
    }
    const size_t n = plan_.groups.size();
    std::vector<grpc::ByteBuffer> requests(n);
    std::vector<grpc::ByteBuffer> responses(n);
    // Over the data plane each answer is read straight into `params` (no copy) where it is laid
    // out as expected; else (and over gRPC) it is parsed and copied by StoreTensors.
    std::vector<PsDataChannel::PullSink> sinks(n);
    for (size_t g = 0; g < n; ++g) {
      requests[g] = PullRequestFor(step, plan_.groups[g].tensors);
      sinks[g] = SinkFor(plan_.groups[g].tensors, params);
    }
    RETURN_IF_ERROR(FanOut(group_shards_, options_.rpc_timeout, Retry::kWhileUnavailable,
                           [&](ParameterServer::Stub::async_interface*, int call,
                               grpc::ClientContext* context, Done done) {
                             CallRaw(group_shards_[call], DataMethod::kPull, context,
                                     &requests[call], &responses[call], std::move(done),
                                     &sinks[call]);
                           }));
    bool first = true;
    for (size_t g = 0; g < n; ++g) {
      RETURN_IF_ERROR(StorePulled(plan_.groups[g].shard, plan_.groups[g].tensors, sinks[g],
                                  responses[g], params, min_version, &first));
    }
    return absl::OkStatus();
  }

  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    RETURN_IF_ERROR(CheckSizes(grads, "gradient"));
    std::vector<int> all(options_.model.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    const std::vector<PushCall> calls = PlanPushCalls(plan_, all, part_elements_);
    const size_t n = calls.size();
    std::vector<int> call_shards(n);
    for (size_t c = 0; c < n; ++c) call_shards[c] = calls[c].shard;
    BorrowedSlices borrowed;  // Declared first: destroyed last, after waiting for gRPC.
    std::vector<grpc::ByteBuffer> requests(n);
    std::vector<grpc::ByteBuffer> raw(n);
    std::vector<int64_t> weights(n);
    for (size_t c = 0; c < n; ++c) {
      requests[c] = PushRequestFor(step, calls[c].pieces, grads, &borrowed);
      weights[c] = static_cast<int64_t>(requests[c].Length());
    }
    absl::Status status = FanOut(
        call_shards, options_.rpc_timeout, Retry::kWhileUnavailable,
        [&](ParameterServer::Stub::async_interface*, int call, grpc::ClientContext* context,
            Done done) {
          CallRaw(call_shards[call], DataMethod::kPush, context, &requests[call], &raw[call],
                  std::move(done));
        },
        &push_gates_, &weights);
    requests.clear();
    borrowed.WaitReleased();
    RETURN_IF_ERROR(status);
    std::vector<PushResponse> responses(n);
    for (size_t c = 0; c < n; ++c) {
      RETURN_IF_ERROR(ParseAnswer(call_shards[c], raw[c], &responses[c]));
    }
    if (result != nullptr) {
      *result = PushResult();
      for (const PushResponse& r : responses) AddPushResponse(r, result);
    }
    return absl::OkStatus();
  }

  bool supports_partial_push() const override { return true; }

  absl::StatusOr<int64_t> StartPush(int64_t step, absl::Span<const int> tensors,
                                    absl::Span<const std::vector<float>> grads,
                                    std::vector<std::vector<float>>* pull_into) override {
    if (pull_into != nullptr && pull_into->size() != options_.model.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pull into ", pull_into->size(), " tensors, model has ", options_.model.size()));
    }
    if (grads.size() != options_.model.size()) {
      return absl::InvalidArgumentError(absl::StrCat(grads.size(), " gradients for a model of ",
                                                     options_.model.size(), " tensors"));
    }
    if (tensors.empty()) return absl::InvalidArgumentError("a push of no tensors");
    auto pending = std::make_unique<PendingPush>();
    pending->timing.started = absl::Now();
    // The tensors of each shard (for the pull that follows); the push's calls are planned below.
    std::map<int, size_t> call_of_shard;
    for (int i : tensors) {
      if (i < 0 || i >= static_cast<int>(options_.model.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "push of tensor index ", i, ", the model has ", options_.model.size(), " tensors"));
      }
      if (static_cast<int64_t>(grads[i].size()) != plan_.elements[i]) {
        return absl::InvalidArgumentError(absl::StrCat("gradient of '", options_.model[i].name(),
                                                       "' has ", grads[i].size(),
                                                       " elements, expected ", plan_.elements[i]));
      }
      const int shard = plan_.placement.shard_of[i];
      auto [it, added] = call_of_shard.emplace(shard, pending->call_shards.size());
      if (added) {
        pending->call_shards.push_back(shard);
        pending->call_tensors.emplace_back();
      }
      pending->call_tensors[it->second].push_back(i);
    }
    // The gradients are sent from `grads` in place, so they must not change until WaitPush.
    const std::vector<int> list(tensors.begin(), tensors.end());
    for (const PushCall& call : PlanPushCalls(plan_, list, part_elements_)) {
      pending->push_shards.push_back(call.shard);
      pending->requests.push_back(PushRequestFor(step, call.pieces, grads, &pending->borrowed));
      pending->weights.push_back(static_cast<int64_t>(pending->requests.back().Length()));
    }
    pending->raw.resize(pending->requests.size());
    PendingPush* p = pending.get();
    p->thread = std::thread([this, p, step, pull_into] {
      p->status = FanOut(
          p->push_shards, options_.rpc_timeout, Retry::kWhileUnavailable,
          [this, p](ParameterServer::Stub::async_interface*, int call, grpc::ClientContext* context,
                    Done done) {
            CallRaw(p->push_shards[call], DataMethod::kPush, context, &p->requests[call],
                    &p->raw[call], std::move(done));
          },
          &push_gates_, &p->weights);
      p->requests.clear();
      p->borrowed.WaitReleased();
      p->responses.resize(p->raw.size());
      for (size_t c = 0; c < p->raw.size() && p->status.ok(); ++c) {
        p->status = ParseAnswer(p->push_shards[c], p->raw[c], &p->responses[c]);
      }
      p->timing.acknowledged = p->timing.pulled = absl::Now();
      if (!p->status.ok() || pull_into == nullptr) return;
      // The same tensors for the next step, from the same shards.
      const size_t calls = p->call_shards.size();
      std::vector<grpc::ByteBuffer> pulls(calls);
      std::vector<grpc::ByteBuffer> pulled(calls);
      std::vector<PsDataChannel::PullSink> sinks(calls);
      for (size_t c = 0; c < calls; ++c) {
        pulls[c] = PullRequestFor(step + 1, p->call_tensors[c]);
        sinks[c] = SinkFor(p->call_tensors[c], absl::MakeSpan(*pull_into));
      }
      p->status = FanOut(p->call_shards, options_.rpc_timeout, Retry::kWhileUnavailable,
                         [&](ParameterServer::Stub::async_interface*, int call,
                             grpc::ClientContext* context, Done done) {
                           CallRaw(p->call_shards[call], DataMethod::kPull, context, &pulls[call],
                                   &pulled[call], std::move(done), &sinks[call]);
                         });
      bool first = true;
      for (size_t c = 0; c < calls && p->status.ok(); ++c) {
        p->status = StorePulled(p->call_shards[c], p->call_tensors[c], sinks[c], pulled[c],
                                absl::MakeSpan(*pull_into), &p->min_version, &first);
      }
      p->timing.pulled = absl::Now();
    });
    const int64_t ticket = next_ticket_++;
    pending_.emplace(ticket, std::move(pending));
    return ticket;
  }

  absl::Status WaitPush(int64_t ticket, PushResult* result, PushTiming* timing) override {
    auto it = pending_.find(ticket);
    if (it == pending_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no push with ticket ", ticket));
    }
    std::unique_ptr<PendingPush> p = std::move(it->second);
    pending_.erase(it);
    p->thread.join();
    if (timing != nullptr) *timing = p->timing;
    if (result != nullptr) {
      PushResult part;
      for (const PushResponse& r : p->responses) AddPushResponse(r, &part);
      part.min_version = p->min_version;
      AddPushResult(part, result);
    }
    return p->status;
  }

  ~GrpcPsClient() override {
    for (auto& [ticket, p] : pending_) p->thread.join();
  }

  // Every shard at once, so that a slow or unreachable shard delays no other's heartbeat.
  absl::Status Heartbeat(int64_t step) override {
    HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(step);
    return ToEveryShard<HeartbeatResponse>(
        options_.heartbeat_timeout, Retry::kNever,
        [&](ParameterServer::Stub::async_interface* async, grpc::ClientContext* context,
            HeartbeatResponse* response,
            Done done) { async->Heartbeat(context, &request, response, std::move(done)); });
  }

  absl::Status Finish(int64_t steps) override {
    FinishRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(steps);
    return ToEveryShard<FinishResponse>(
        options_.rpc_timeout, Retry::kWhileUnavailable,
        [&](ParameterServer::Stub::async_interface* async, grpc::ClientContext* context,
            FinishResponse* response,
            Done done) { async->Finish(context, &request, response, std::move(done)); });
  }

  const std::vector<int>& shard_of() const override { return plan_.placement.shard_of; }
  const std::vector<int64_t>& shard_bytes() const override { return plan_.placement.shard_bytes; }

 private:
  using Done = std::function<void(grpc::Status)>;

  // One StartPush: its calls, run by `thread`, and what they returned.
  struct PendingPush {
    BorrowedSlices borrowed;       // First: destroyed last.
    std::vector<int> push_shards;  // the shard of each push call (requests, raw, responses)
    std::vector<int64_t> weights;  // and its bytes, for the shard's push gate
    // The pull that follows: one call per shard (call_shards) of its pushed tensors.
    std::vector<int> call_shards;
    std::vector<std::vector<int>> call_tensors;
    std::vector<grpc::ByteBuffer> requests;
    std::vector<grpc::ByteBuffer> raw;
    std::vector<PushResponse> responses;
    std::thread thread;
    absl::Status status;
    PushTiming timing;
    int64_t min_version = -1;  // of the tensors pulled after the push, if any
  };

  // Push or Pull to `shard`: over its data plane while it offers one that works, else over gRPC.
  void CallRaw(int shard, DataMethod method, grpc::ClientContext* context,
               const grpc::ByteBuffer* request, grpc::ByteBuffer* response, Done done,
               PsDataChannel::PullSink* sink = nullptr) {
    std::shared_ptr<PsDataChannel> data;
    {
      absl::MutexLock lock(&data_mu_);
      data = data_[shard];
    }
    if (data != nullptr && !data->broken()) {
      data->Call(
          static_cast<int>(method), request, absl::FromChrono(context->deadline()), response,
          [this, shard, d = data.get(), done = std::move(done)](grpc::Status status) {
            if (d->broken()) DropDataChannel(shard, d, status);
            done(std::move(status));
          },
          sink);
      return;
    }
    generic_[shard]->UnaryCall(context, method == DataMethod::kPush ? kPushMethod : kPullMethod,
                               grpc::StubOptions(), request, response, std::move(done));
  }

  // A shard's Register answer offered `port` for its data plane (0: none).
  void UpdateDataChannel(int shard, int port) {
    absl::MutexLock lock(&data_mu_);
    if (!options_.use_data_plane || options_.security.encrypts() || port <= 0 || port > 65535) {
      Retire(shard);
      return;
    }
    if (data_[shard] != nullptr && data_[shard]->port() == port && !data_[shard]->broken()) return;
    std::string host, ignored;
    if (!SplitHostPort(options_.servers[shard], &host, &ignored)) {
      Retire(shard);
      return;
    }
    PsDataChannel::Options o;
    o.host = host;
    o.port = port;
    o.worker_id = options_.worker_id;
    o.token = options_.security.token();
    o.description = absl::StrCat("shard ", shard, " at ", options_.servers[shard]);
    o.max_message_bytes = options_.max_message_bytes;
    Retire(shard);
    data_[shard] = std::make_shared<PsDataChannel>(std::move(o));
  }

  // Stops using shard's data channel: its connections close as their calls end (Drain). It is
  // destroyed with the client, not here: a call's callback, which runs on the channel's own
  // thread, may be what drops it.
  void Retire(int shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(data_mu_) {
    if (data_[shard] == nullptr) return;
    data_[shard]->Drain();
    retired_.push_back(std::move(data_[shard]));
    data_[shard] = nullptr;
  }

  // The data channel to `shard` could not connect: its calls go over gRPC from now on.
  void DropDataChannel(int shard, const PsDataChannel* data, const grpc::Status& why) {
    absl::MutexLock lock(&data_mu_);
    if (data_[shard].get() != data) return;
    RUBATO_LOG(WARNING) << why.error_message() << "; Push and Pull to shard " << shard
                        << " go over gRPC from now on";
    Retire(shard);
  }

  // A PullRequest for `tensors` (model indices) at `step`.
  grpc::ByteBuffer PullRequestFor(int64_t step, const std::vector<int>& tensors) const {
    PullRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(step);
    for (int i : tensors) request.add_names(options_.model[i].name());
    return SerializedMessage(request);
  }

  // A PushRequest of `pieces` (whole gradients, or parts at their offsets): the framing in small
  // slices, each gradient's bytes as a slice of `grads` itself.
  grpc::ByteBuffer PushRequestFor(int64_t step, const std::vector<PushPiece>& pieces,
                                  absl::Span<const std::vector<float>> grads,
                                  BorrowedSlices* borrowed) const {
    std::vector<grpc::Slice> slices;
    slices.reserve(2 * pieces.size());
    std::string header;
    EncodePushHeader(options_.worker_id, step, &header);
    EncodePushExtras(push_batch_size_, has_push_relay_ ? &push_relay_ : nullptr, &header);
    for (const PushPiece& piece : pieces) {
      const size_t bytes = static_cast<size_t>(piece.elements) * sizeof(float);
      EncodeTensorHeader(3, options_.model[piece.tensor].name(), 0, bytes, &header, piece.offset);
      slices.emplace_back(header);
      header.clear();
      slices.push_back(borrowed->Borrow(grads[piece.tensor].data() + piece.offset, bytes));
    }
    return grpc::ByteBuffer(slices.data(), slices.size());
  }

  // A small answer (PushResponse) from its bytes; INTERNAL naming the shard if malformed.
  absl::Status ParseAnswer(int shard, const grpc::ByteBuffer& raw,
                           google::protobuf::MessageLite* message) const {
    grpc::Slice whole;
    if (!raw.DumpToSingleSlice(&whole).ok() ||
        !message->ParseFromArray(whole.begin(), static_cast<int>(whole.size()))) {
      return absl::InternalError(absl::StrCat("server ", options_.servers[shard],
                                              " sent a malformed ", message->GetTypeName()));
    }
    return absl::OkStatus();
  }

  // Where a pull of `tensors` may be read into `params` in place (each resized to its size first).
  PsDataChannel::PullSink SinkFor(const std::vector<int>& tensors,
                                  absl::Span<std::vector<float>> params) const {
    PsDataChannel::PullSink sink;
    for (int i : tensors) {
      params[i].resize(plan_.elements[i]);
      sink.tensors.push_back({&options_.model[i].name(), params[i].data(), plan_.elements[i]});
    }
    return sink;
  }

  // A pull's answer: already in `params` if the data channel stored it in place (its versions in
  // the sink), else parsed from `raw` and copied there.
  absl::Status StorePulled(int shard, const std::vector<int>& want,
                           const PsDataChannel::PullSink& sink, const grpc::ByteBuffer& raw,
                           absl::Span<std::vector<float>> params, int64_t* min_version,
                           bool* first) const {
    if (!sink.stored) return StoreTensors(shard, want, raw, params, min_version, first);
    for (const PsDataChannel::PullSink::Tensor& t : sink.tensors) {
      NoteVersion(t.version, min_version, first);
    }
    return absl::OkStatus();
  }

  // Lowers *min_version (if given) to `version`, or sets it for the first tensor while *first.
  static void NoteVersion(int64_t version, int64_t* min_version, bool* first) {
    if (min_version == nullptr) return;
    *min_version = *first ? version : std::min(*min_version, version);
    *first = false;
  }

  // Copies the values of shard `shard`'s answer to a pull of `want` (model indices, in request
  // order) into params, straight from the received slices, lowering *min_version (if given) to
  // each tensor's version, or setting it for the first tensor while *first. INTERNAL for a
  // malformed answer.
  absl::Status StoreTensors(int shard, const std::vector<int>& want, const grpc::ByteBuffer& raw,
                            absl::Span<std::vector<float>> params, int64_t* min_version,
                            bool* first) const {
    std::vector<grpc::Slice> slices;
    std::vector<WireTensor> tensors;
    ByteChunks message;
    absl::Status parsed = absl::InternalError("unreadable");
    if (raw.Dump(&slices).ok()) {
      for (const grpc::Slice& slice : slices) {
        message.Append(
            absl::string_view(reinterpret_cast<const char*>(slice.begin()), slice.size()));
      }
      parsed = ParsePullResponse(message, static_cast<int>(want.size()), &tensors);
    }
    if (!parsed.ok()) {
      return absl::InternalError(absl::StrCat("shard ", shard, " at ", options_.servers[shard],
                                              " sent a malformed pull answer: ", parsed.message()));
    }
    if (tensors.size() != want.size()) {
      return absl::InternalError(absl::StrCat("shard ", shard, " returned ", tensors.size(),
                                              " tensors for ", want.size(), " requested"));
    }
    for (size_t k = 0; k < want.size(); ++k) {
      const WireTensor& v = tensors[k];
      const int i = want[k];
      if (v.name != options_.model[i].name() ||
          static_cast<int64_t>(v.data.size()) != 4 * plan_.elements[i]) {
        return absl::InternalError(absl::StrCat(
            "shard ", shard, " returned a malformed value for '", options_.model[i].name(), "'"));
      }
      params[i].resize(plan_.elements[i]);
      CopyFloats(v.data, params[i].data());
      NoteVersion(v.version, min_version, first);
    }
    return absl::OkStatus();
  }

  enum class Retry {
    kNever,
    // The calls wait for a server that is not up yet (gRPC's wait_for_ready); running out of time
    // means the server could not be reached.
    kWaitForReady,
    // A call that fails with UNAVAILABLE is started again after a backoff (0.1 s doubling to 2 s)
    // until it gets through, for up to options_.retry_timeout from its first failure.
    kWhileUnavailable,
  };

  // Starts one asynchronous call per entry of `call_shards` (the shard each call goes to) with
  // start(async stub, call index, context, done), all at once, and waits for every one, retrying
  // as `retry` says. Returns the first error, naming its shard.
  // `gates`, if given, holds one CallGate per shard that these calls share with other operations
  // (pushes), each call weighing its entry of `weights` (bytes); otherwise each shard gets a gate
  // of this operation's own, of kCallsInFlightPerShard calls.
  template <typename StartCall>
  absl::Status FanOut(const std::vector<int>& call_shards, absl::Duration timeout, Retry retry,
                      StartCall start, std::vector<std::unique_ptr<CallGate>>* gates = nullptr,
                      const std::vector<int64_t>* weights = nullptr) {
    const size_t n = call_shards.size();
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<size_t> calls(n);
    for (size_t c = 0; c < n; ++c) calls[c] = c;
    std::vector<absl::Time> first_failure(n, absl::InfiniteFuture());
    absl::Duration backoff = absl::Milliseconds(100);
    while (true) {
      std::vector<grpc::Status> results =
          RunCalls(call_shards, calls, deadline, retry, start, gates, weights);
      absl::Status error;
      std::vector<size_t> again;
      const absl::Time now = absl::Now();
      for (size_t k = 0; k < calls.size(); ++k) {
        const size_t c = calls[k];
        const int shard = call_shards[c];
        const grpc::Status& status = results[k];
        if (status.ok()) continue;
        if (retry == Retry::kWaitForReady &&
            status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          if (error.ok()) {
            error = absl::UnavailableError(
                absl::StrCat("cannot reach parameter server shard ", shard, " at ",
                             options_.servers[shard], " within ", absl::FormatDuration(timeout),
                             ": ", Diagnose(shard), " (gRPC: ", status.error_message(), ")"));
          }
          continue;
        }
        if (retry == Retry::kWhileUnavailable && IsTransportFailure(status)) {
          if (first_failure[c] == absl::InfiniteFuture()) first_failure[c] = now;
          if (now < first_failure[c] + options_.retry_timeout && now < deadline) {
            again.push_back(c);
            continue;
          }
          if (error.ok()) {
            error = absl::UnavailableError(absl::StrCat(
                "parameter server shard ", shard, " at ", options_.servers[shard],
                " unreachable for ", absl::FormatDuration(now - first_failure[c]),
                " (retried with backoff for up to ", absl::FormatDuration(options_.retry_timeout),
                "): ", Diagnose(shard), " (gRPC: ", status.error_message(), ")"));
          }
          continue;
        }
        if (error.ok()) error = Annotate(shard, status);
      }
      if (!error.ok()) return error;
      if (again.empty()) return absl::OkStatus();
      absl::SleepFor(std::min(backoff, std::max(absl::ZeroDuration(), deadline - absl::Now())));
      backoff = std::min(2 * backoff, absl::Seconds(2));
      calls = std::move(again);
    }
  }

  // One call to every shard at once: start(async stub, context, response, done) sends the same
  // small request to each.
  template <typename Response, typename StartCall>
  absl::Status ToEveryShard(absl::Duration timeout, Retry retry, StartCall start) {
    const int shards = static_cast<int>(stubs_.size());
    std::vector<int> call_shards(shards);
    for (int s = 0; s < shards; ++s) call_shards[s] = s;
    std::vector<Response> responses(shards);
    return FanOut(
        call_shards, timeout, retry,
        [&](ParameterServer::Stub::async_interface* async, int call, grpc::ClientContext* context,
            Done done) { start(async, context, &responses[call], std::move(done)); });
  }

  // UNAVAILABLE from the transport (refused, reset, cut), not from a server that answered: a
  // shard that is shutting down says so in its message and is not retried.
  static bool IsTransportFailure(const grpc::Status& status) {
    return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
           status.error_message().find("shutting down") == std::string::npos;
  }

  // One round of FanOut: the calls `calls` (indices into call_shards), concurrently, each with the
  // whole operation's deadline. A retry fails fast while the connection is down (it is not
  // wait_for_ready), so FanOut's backoff loop, not the call, decides how long to keep trying, and a
  // call that gets through still has its full deadline (a BSP pull may wait at the barrier).
  template <typename StartCall>
  std::vector<grpc::Status> RunCalls(const std::vector<int>& call_shards,
                                     const std::vector<size_t>& calls, absl::Time deadline,
                                     Retry retry, StartCall& start,
                                     std::vector<std::unique_ptr<CallGate>>* gates,
                                     const std::vector<int64_t>* weights) {
    const size_t n = calls.size();
    std::vector<grpc::ClientContext> contexts(n);
    std::vector<grpc::Status> results(n);
    absl::BlockingCounter pending(static_cast<int>(n));
    // Each call passes its shard's gate: FanOut's `gates` (pushes, weighed in bytes), or this
    // round's own (kCallsInFlightPerShard calls); each finished call starts the ones queued at its
    // shard's gate that now fit, which may be another operation's.
    std::map<int, std::unique_ptr<CallGate>> own;
    std::vector<CallGate*> gate_of(n);
    std::vector<int64_t> weight_of(n, 1);
    for (size_t k = 0; k < n; ++k) {
      const int shard = call_shards[calls[k]];
      if (gates != nullptr) {
        gate_of[k] = (*gates)[shard].get();
        if (weights != nullptr) weight_of[k] = (*weights)[calls[k]];
      } else {
        std::unique_ptr<CallGate>& g = own[shard];
        if (g == nullptr) g = std::make_unique<CallGate>(kCallsInFlightPerShard);
        gate_of[k] = g.get();
      }
    }
    for (size_t k = 0; k < n; ++k) {
      gate_of[k]->Begin(weight_of[k], [&, k] {
        const size_t c = calls[k];
        contexts[k].set_deadline(absl::ToChronoTime(deadline));
        contexts[k].set_wait_for_ready(retry == Retry::kWaitForReady);
        options_.security.Attach(&contexts[k]);
        start(stubs_[call_shards[c]]->async(), static_cast<int>(c), &contexts[k],
              [&, k](grpc::Status status) {
                results[k] = std::move(status);
                gate_of[k]->End(weight_of[k]);  // Before the count: this round outlives its gates.
                pending.DecrementCount();
              });
      });
    }
    pending.Wait();
    return results;
  }

  // What a plain TCP connect says about the shard's address: the name does not resolve, refused,
  // timed out, no route, or connects (the failure is above TCP).
  std::string Diagnose(int shard) const {
    return DiagnoseEndpoint(options_.servers[shard], absl::Seconds(2)).detail;
  }

  absl::Status Annotate(int shard, const grpc::Status& status) const {
    if (status.ok()) return absl::OkStatus();
    absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(),
                        absl::StrCat("server ", options_.servers[shard], ": ", s.message()));
  }

  absl::Status CheckSizes(absl::Span<const std::vector<float>> values, const char* what) const {
    if (values.size() != options_.model.size()) {
      return absl::InvalidArgumentError(absl::StrCat(values.size(), " ", what, "s for a model of ",
                                                     options_.model.size(), " tensors"));
    }
    for (size_t i = 0; i < values.size(); ++i) {
      if (static_cast<int64_t>(values[i].size()) != plan_.elements[i]) {
        return absl::InvalidArgumentError(absl::StrCat(what, " of '", options_.model[i].name(),
                                                       "' has ", values[i].size(),
                                                       " elements, expected ", plan_.elements[i]));
      }
    }
    return absl::OkStatus();
  }

  const PsClientOptions options_;
  // Placement, the pulls' call groups and each tensor's elements (worker/call_plan.h).
  const CallPlan plan_;
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs_;
  // The same channels, for Push and Pull as raw bytes (common/tensor_wire.h).
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_;
  std::vector<int> group_shards_;  // Shard of each entry of plan_.groups.
  // Each shard's bsp part size from its last Register answer (0: whole tensors).
  std::vector<int64_t> part_elements_;
  // Each shard's data channel, while it offers one that works (null: gRPC).
  absl::Mutex data_mu_;
  std::vector<std::shared_ptr<PsDataChannel>> data_ ABSL_GUARDED_BY(data_mu_);
  std::vector<std::shared_ptr<PsDataChannel>> retired_ ABSL_GUARDED_BY(data_mu_);
  // One gate per shard for the calls that carry gradients, shared by Push and every StartPush.
  std::vector<std::unique_ptr<CallGate>> push_gates_;
  // Pushes started and not yet waited for, by ticket. Used by the training thread only.
  std::map<int64_t, std::unique_ptr<PendingPush>> pending_;
  int64_t next_ticket_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(const PsClientOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no parameter servers given");
  if (options.model.empty()) return absl::InvalidArgumentError("the model has no tensors");
  ASSIGN_OR_RETURN(CallPlan plan, PlanCalls(options.model, static_cast<int>(options.servers.size()),
                                            options.max_message_bytes));
  return std::unique_ptr<PsClient>(new GrpcPsClient(options, std::move(plan)));
}

}  // namespace rubato
