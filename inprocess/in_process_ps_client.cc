#include "inprocess/in_process_ps_client.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "common/tensor_wire.h"

namespace rubato {
namespace {

class InProcessPsClient final : public PsClient {
 public:
  InProcessPsClient(const PsClientOptions& options, std::vector<ParameterShard*> shards,
                    CallPlan plan, int64_t target_call_bytes)
      : options_(options),
        shards_(std::move(shards)),
        plan_(std::move(plan)),
        target_call_bytes_(target_call_bytes),
        part_elements_(shards_.size(), 0) {}

  ~InProcessPsClient() override {
    for (auto& [ticket, p] : pending_) p->thread.join();
  }

  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial, int32_t batch_size,
                                   int64_t resume_step) override {
    RETURN_IF_ERROR(CheckSizes(initial, "initial value"));
    int64_t resume = -1;
    registered_batch_plan_.clear();
    for (int s = 0; s < static_cast<int>(shards_.size()); ++s) {
      RegisterRequest request;
      request.set_worker_id(options_.worker_id);
      request.set_batch_size(batch_size);
      request.set_resume_step(resume_step);
      request.set_num_workers(options_.num_workers);
      *request.mutable_consistency() = options_.consistency;
      request.set_steps_per_epoch(options_.steps_per_epoch);
      request.set_total_steps(options_.total_steps);
      for (size_t i = 0; i < options_.model.size(); ++i) {
        if (plan_.placement.shard_of[i] == s) *request.add_model() = options_.model[i];
      }
      // As the gRPC client: without values first, with them if asked, again while another
      // worker is sending them.
      const absl::Time deadline = absl::Now() + options_.connect_timeout;
      while (true) {
        ASSIGN_OR_RETURN(RegisterResponse response, Annotate(s, shards_[s]->Register(request)));
        if (response.needs_initial_values() && request.initial_values().empty()) {
          for (size_t i = 0; i < options_.model.size(); ++i) {
            if (plan_.placement.shard_of[i] != s) continue;
            TensorValue* v = request.add_initial_values();
            v->set_name(options_.model[i].name());
            FloatsToBytes(initial[i], v->mutable_data());
          }
          continue;
        }
        if (response.needs_initial_values() || response.initialising()) {
          if (absl::Now() > deadline) {
            return absl::UnavailableError(absl::StrCat("shard ", s, " has no initial weights"));
          }
          absl::SleepFor(absl::Milliseconds(5));
          continue;
        }
        resume = resume < 0 ? response.resume_step() : std::min(resume, response.resume_step());
        KeepBatchPlan(response);
        part_elements_[s] = response.part_elements();
        break;
      }
    }
    return resume;
  }

  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    if (params.size() != options_.model.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pull into ", params.size(), " tensors, model has ", options_.model.size()));
    }
    bool first = true;
    for (const CallGroup& g : plan_.groups) {
      RETURN_IF_ERROR(PullGroup(g.shard, step, g.tensors, params, min_version, &first));
    }
    return absl::OkStatus();
  }

  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    RETURN_IF_ERROR(CheckSizes(grads, "gradient"));
    if (result != nullptr) *result = PushResult();
    std::vector<int> all(options_.model.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    for (const PushCall& call : PlanPushCalls(plan_, all, part_elements_, target_call_bytes_)) {
      RETURN_IF_ERROR(PushCallNow(call, step, grads, result));
    }
    return absl::OkStatus();
  }

  bool supports_partial_push() const override { return true; }

  absl::StatusOr<int64_t> StartPush(int64_t step, absl::Span<const int> tensors,
                                    absl::Span<const std::vector<float>> grads,
                                    std::vector<std::vector<float>>* pull_into) override {
    if (grads.size() != options_.model.size()) {
      return absl::InvalidArgumentError(absl::StrCat(grads.size(), " gradients for a model of ",
                                                     options_.model.size(), " tensors"));
    }
    if (pull_into != nullptr && pull_into->size() != options_.model.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pull into ", pull_into->size(), " tensors, model has ", options_.model.size()));
    }
    if (tensors.empty()) return absl::InvalidArgumentError("a push of no tensors");
    auto p = std::make_unique<Pending>();
    std::map<int, std::vector<int>> by_shard;
    for (int i : tensors) {
      if (i < 0 || i >= static_cast<int>(options_.model.size()) ||
          static_cast<int64_t>(grads[i].size()) != plan_.elements[i]) {
        return absl::InvalidArgumentError(absl::StrCat("bad tensor index or size: ", i));
      }
      by_shard[plan_.placement.shard_of[i]].push_back(i);
    }
    p->timing.started = absl::Now();
    Pending* raw = p.get();
    const std::vector<int> list(tensors.begin(), tensors.end());
    std::vector<PushCall> calls = PlanPushCalls(plan_, list, part_elements_, target_call_bytes_);
    p->thread = std::thread([this, raw, by_shard, calls, step, grads, pull_into] {
      for (const PushCall& call : calls) {
        if (raw->status.ok()) raw->status = PushCallNow(call, step, grads, &raw->result);
      }
      raw->timing.acknowledged = raw->timing.pulled = absl::Now();
      if (!raw->status.ok() || pull_into == nullptr) return;
      bool first = true;
      for (const auto& [shard, list] : by_shard) {
        if (raw->status.ok()) {
          raw->status = PullGroup(shard, step + 1, list, absl::MakeSpan(*pull_into),
                                  &raw->result.min_version, &first);
        }
      }
      raw->timing.pulled = absl::Now();
    });
    const int64_t ticket = next_ticket_++;
    pending_.emplace(ticket, std::move(p));
    return ticket;
  }

  absl::Status WaitPush(int64_t ticket, PushResult* result, PushTiming* timing) override {
    auto it = pending_.find(ticket);
    if (it == pending_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no push with ticket ", ticket));
    }
    std::unique_ptr<Pending> p = std::move(it->second);
    pending_.erase(it);
    p->thread.join();
    if (timing != nullptr) *timing = p->timing;
    if (result != nullptr) AddPushResult(p->result, result);
    return p->status;
  }

  absl::Status Heartbeat(int64_t step) override {
    HeartbeatRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(step);
    for (int s = 0; s < static_cast<int>(shards_.size()); ++s) {
      RETURN_IF_ERROR(Annotate(s, shards_[s]->Heartbeat(request)).status());
    }
    return absl::OkStatus();
  }

  absl::Status Finish(int64_t steps) override {
    FinishRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(steps);
    for (int s = 0; s < static_cast<int>(shards_.size()); ++s) {
      RETURN_IF_ERROR(Annotate(s, shards_[s]->Finish(request)).status());
    }
    return absl::OkStatus();
  }

  const std::vector<int>& shard_of() const override { return plan_.placement.shard_of; }
  const std::vector<int64_t>& shard_bytes() const override { return plan_.placement.shard_bytes; }

 private:
  struct Pending {
    std::thread thread;
    absl::Status status;
    PushResult result;
    PushTiming timing;
  };

  template <typename T>
  absl::StatusOr<T> Annotate(int shard, absl::StatusOr<T> r) const {
    if (r.ok()) return r;
    return absl::Status(r.status().code(),
                        absl::StrCat("shard ", shard, ": ", r.status().message()));
  }

  absl::Status PullGroup(int shard, int64_t step, const std::vector<int>& tensors,
                         absl::Span<std::vector<float>> params, int64_t* min_version, bool* first) {
    PullRequest request;
    request.set_worker_id(options_.worker_id);
    request.set_step(step);
    for (int i : tensors) request.add_names(options_.model[i].name());
    absl::Notification done;
    absl::Status status;
    shards_[shard]->Pull(
        request, absl::Now() + options_.rpc_timeout,
        ParameterShard::SharedPullDone([&](absl::Status s, std::vector<PulledTensor> got) {
          status = std::move(s);
          for (size_t k = 0; status.ok() && k < got.size(); ++k) {
            const int i = tensors[k];
            params[i].assign(got[k].snapshot.values->begin(), got[k].snapshot.values->end());
            if (min_version != nullptr) {
              *min_version = *first ? got[k].snapshot.version
                                    : std::min(*min_version, got[k].snapshot.version);
              *first = false;
            }
          }
          done.Notify();
        }));
    done.WaitForNotification();
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("shard ", shard, ": ", status.message()));
  }

  absl::Status PushCallNow(const PushCall& call, int64_t step,
                           absl::Span<const std::vector<float>> grads, PushResult* result) {
    const int shard = call.shard;
    WirePush push;
    push.worker_id = options_.worker_id;
    push.step = step;
    push.batch_size = push_batch_size_;
    if (has_push_relay_) push.noise_relay = push_relay_;
    for (const PushPiece& piece : call.pieces) {
      WireTensor g;
      g.name = options_.model[piece.tensor].name();
      g.offset = piece.offset;
      g.data = ByteChunks(absl::string_view(
          reinterpret_cast<const char*>(grads[piece.tensor].data() + piece.offset),
          static_cast<size_t>(piece.elements) * sizeof(float)));
      push.gradients.push_back(std::move(g));
    }
    absl::Notification done;
    absl::StatusOr<PushResponse> response;
    shards_[shard]->Push(push, nullptr, [&](absl::StatusOr<PushResponse> r) {
      response = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    RETURN_IF_ERROR(Annotate(shard, response).status());
    if (result != nullptr) AddPushResponse(*response, result);
    return absl::OkStatus();
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
  const std::vector<ParameterShard*> shards_;
  const CallPlan plan_;
  const int64_t target_call_bytes_;
  std::vector<int64_t> part_elements_;  // Each shard's, from Register (0: whole tensors).
  std::map<int64_t, std::unique_ptr<Pending>> pending_;  // Used by the training thread only.
  int64_t next_ticket_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PsClient>> CreateInProcessPsClient(
    const PsClientOptions& options, std::vector<ParameterShard*> shards,
    int64_t target_call_bytes) {
  if (shards.empty()) return absl::InvalidArgumentError("no parameter shards given");
  ASSIGN_OR_RETURN(CallPlan plan, PlanCalls(options.model, static_cast<int>(shards.size()),
                                            options.max_message_bytes, target_call_bytes));
  return std::unique_ptr<PsClient>(
      new InProcessPsClient(options, std::move(shards), std::move(plan), target_call_bytes));
}

}  // namespace rubato
