#include "worker/ps_client.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "grpcpp/create_channel.h"
#include "proto/parameter_server.grpc.pb.h"

namespace rubato {
namespace {

// One tensor must fit in one message, with room to spare for framing and the other fields.
constexpr int64_t kMaxTensorBytes = kMaxMessageBytes / 2;
// A shard's tensors are sent in calls of about this many bytes (a larger tensor goes alone). Calls
// to one shard run concurrently over its connection, and messages below glibc's largest mmap
// threshold (32 MiB) are built in reused heap memory instead of freshly faulted pages
// (common/malloc_tuning.h): with one call per shard, a 64 MB model ran at 0.12-0.2 GB/s per worker.
constexpr int64_t kTargetCallBytes = int64_t{8} << 20;

// One RPC's worth of tensors on one shard.
struct CallGroup {
  int shard = 0;
  std::vector<int> tensors;  // Indices into the model.
};

// Collects the first error among calls that finish on gRPC's threads.
class FirstError {
 public:
  void Add(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (status_.ok() && !s.ok()) status_ = std::move(s);
  }
  absl::Status Get() {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class GrpcPsClient final : public PsClient {
 public:
  GrpcPsClient(const PsClientOptions& options, Placement placement, std::vector<CallGroup> groups)
      : options_(options), placement_(std::move(placement)), groups_(std::move(groups)) {
    for (const std::string& address : options_.servers) {
      stubs_.push_back(ParameterServer::NewStub(grpc::CreateCustomChannel(
          address, grpc::InsecureChannelCredentials(), RubatoChannelArguments())));
    }
    for (const TensorSpec& spec : options_.model) elements_.push_back(ElementCount(spec.shape()));
    for (const CallGroup& g : groups_) group_shards_.push_back(g.shard);
  }

  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial, int32_t batch_size,
                                   int64_t resume_step) override {
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
      RegisterRequest& r = requests[placement_.shard_of[i]];
      *r.add_model() = options_.model[i];
      TensorValue* v = r.add_initial_values();
      v->set_name(options_.model[i].name());
      FloatsToBytes(initial[i], v->mutable_data());
    }
    RETURN_IF_ERROR(FanOut(
        call_shards, options_.connect_timeout, /*wait_for_ready=*/true,
        [&](ParameterServer::Stub::async_interface* async, int call, grpc::ClientContext* context,
            Done done) { async->Register(context, &requests[call], &responses[call], done); }));
    for (int s = 0; s < shards; ++s) {
      if (responses[s].num_shards() != shards || responses[s].shard_id() != s) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server at ", options_.servers[s], " is shard ", responses[s].shard_id(), " of ",
            responses[s].num_shards(), ", but this worker has it as shard ", s, " of ", shards));
      }
    }
    int64_t resume = responses[0].min_version();
    for (const RegisterResponse& r : responses) resume = std::min(resume, r.min_version());
    return resume;
  }

  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    if (params.size() != options_.model.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pull into ", params.size(), " tensors, model has ", options_.model.size()));
    }
    const size_t n = groups_.size();
    std::vector<PullRequest> requests(n);
    std::vector<PullResponse> responses(n);
    for (size_t g = 0; g < n; ++g) {
      requests[g].set_worker_id(options_.worker_id);
      requests[g].set_step(step);
      for (int i : groups_[g].tensors) requests[g].add_names(options_.model[i].name());
    }
    RETURN_IF_ERROR(FanOut(
        group_shards_, options_.rpc_timeout, /*wait_for_ready=*/false,
        [&](ParameterServer::Stub::async_interface* async, int call, grpc::ClientContext* context,
            Done done) { async->Pull(context, &requests[call], &responses[call], done); }));
    for (size_t g = 0; g < n; ++g) {
      const std::vector<int>& want = groups_[g].tensors;
      if (responses[g].tensors_size() != static_cast<int>(want.size())) {
        return absl::InternalError(absl::StrCat("shard ", groups_[g].shard, " returned ",
                                                responses[g].tensors_size(), " tensors for ",
                                                want.size(), " requested"));
      }
      for (size_t k = 0; k < want.size(); ++k) {
        const TensorValue& v = responses[g].tensors(static_cast<int>(k));
        const int i = want[k];
        if (v.name() != options_.model[i].name() ||
            static_cast<int64_t>(v.data().size()) != 4 * elements_[i]) {
          return absl::InternalError(absl::StrCat("shard ", groups_[g].shard,
                                                  " returned a malformed value for '",
                                                  options_.model[i].name(), "'"));
        }
        params[i].resize(elements_[i]);
        BytesToFloats(v.data(), absl::MakeSpan(params[i]));
        if (min_version != nullptr) {
          *min_version = (g == 0 && k == 0) ? v.version() : std::min(*min_version, v.version());
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    RETURN_IF_ERROR(CheckSizes(grads, "gradient"));
    const size_t n = groups_.size();
    std::vector<PushRequest> requests(n);
    std::vector<PushResponse> responses(n);
    for (size_t g = 0; g < n; ++g) {
      requests[g].set_worker_id(options_.worker_id);
      requests[g].set_step(step);
      for (int i : groups_[g].tensors) {
        TensorValue* v = requests[g].add_gradients();
        v->set_name(options_.model[i].name());
        FloatsToBytes(grads[i], v->mutable_data());
      }
    }
    RETURN_IF_ERROR(FanOut(
        group_shards_, options_.rpc_timeout, /*wait_for_ready=*/false,
        [&](ParameterServer::Stub::async_interface* async, int call, grpc::ClientContext* context,
            Done done) { async->Push(context, &requests[call], &responses[call], done); }));
    if (result != nullptr) {
      *result = PushResult();
      for (const PushResponse& r : responses) {
        result->dropped += r.dropped();
        result->max_staleness = std::max(result->max_staleness, r.max_staleness());
      }
    }
    return absl::OkStatus();
  }

  absl::Status Heartbeat(int64_t step) override {
    for (size_t s = 0; s < stubs_.size(); ++s) {
      HeartbeatRequest req;
      req.set_worker_id(options_.worker_id);
      req.set_step(step);
      HeartbeatResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      RETURN_IF_ERROR(Annotate(static_cast<int>(s), stubs_[s]->Heartbeat(&ctx, req, &resp)));
    }
    return absl::OkStatus();
  }

  const std::vector<int>& shard_of() const override { return placement_.shard_of; }
  const std::vector<int64_t>& shard_bytes() const override { return placement_.shard_bytes; }

 private:
  using Done = std::function<void(grpc::Status)>;

  // Starts one asynchronous call per entry of `call_shards` (the shard each call goes to) with
  // start(async stub, call index, context, done), all at once, and waits for every one. Returns the
  // first error, naming its shard. With wait_for_ready, calls wait for a server that is not up yet,
  // and running out of time means the server could not be reached.
  template <typename StartCall>
  absl::Status FanOut(const std::vector<int>& call_shards, absl::Duration timeout,
                      bool wait_for_ready, StartCall start) {
    const size_t n = call_shards.size();
    std::vector<grpc::ClientContext> contexts(n);
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    FirstError error;
    absl::BlockingCounter pending(static_cast<int>(n));
    for (size_t call = 0; call < n; ++call) {
      contexts[call].set_deadline(deadline);
      contexts[call].set_wait_for_ready(wait_for_ready);
      const int shard = call_shards[call];
      start(stubs_[shard]->async(), static_cast<int>(call), &contexts[call],
            [this, shard, timeout, wait_for_ready, &error, &pending](grpc::Status status) {
              if (wait_for_ready && status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
                error.Add(absl::UnavailableError(absl::StrCat(
                    "cannot reach parameter server shard ", shard, " at ", options_.servers[shard],
                    " within ", absl::FormatDuration(timeout))));
              } else {
                error.Add(Annotate(shard, status));
              }
              pending.DecrementCount();
            });
    }
    pending.Wait();
    return error.Get();
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
      if (static_cast<int64_t>(values[i].size()) != elements_[i]) {
        return absl::InvalidArgumentError(absl::StrCat(what, " of '", options_.model[i].name(),
                                                       "' has ", values[i].size(),
                                                       " elements, expected ", elements_[i]));
      }
    }
    return absl::OkStatus();
  }

  const PsClientOptions options_;
  const Placement placement_;
  const std::vector<CallGroup> groups_;
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs_;
  std::vector<int64_t> elements_;
  std::vector<int> group_shards_;  // Shard of each entry of groups_.
};

}  // namespace

absl::StatusOr<std::unique_ptr<PsClient>> CreateGrpcPsClient(const PsClientOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no parameter servers given");
  if (options.model.empty()) return absl::InvalidArgumentError("the model has no tensors");
  std::vector<TensorSize> sizes;
  for (const TensorSpec& spec : options.model) {
    const int64_t elements = ElementCount(spec.shape());
    if (elements < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", spec.name(), "' has invalid shape ", ShapeString(spec.shape())));
    }
    if (4 * elements > kMaxTensorBytes) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name(), "' is ", 4 * elements,
                                                     " bytes; one message holds at most ",
                                                     kMaxTensorBytes));
    }
    sizes.push_back({spec.name(), 4 * elements});
  }
  ASSIGN_OR_RETURN(Placement placement,
                   PlaceTensors(sizes, static_cast<int>(options.servers.size())));
  // Group each shard's tensors, in model order, into calls of about kTargetCallBytes.
  std::vector<CallGroup> groups;
  for (int s = 0; s < static_cast<int>(options.servers.size()); ++s) {
    int64_t bytes = 0;
    bool open = false;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (placement.shard_of[i] != s) continue;
      if (!open || bytes + sizes[i].bytes > kTargetCallBytes) {
        groups.push_back({s, {}});
        bytes = 0;
        open = true;
      }
      groups.back().tensors.push_back(static_cast<int>(i));
      bytes += sizes[i].bytes;
    }
  }
  return std::unique_ptr<PsClient>(
      new GrpcPsClient(options, std::move(placement), std::move(groups)));
}

}  // namespace rubato
