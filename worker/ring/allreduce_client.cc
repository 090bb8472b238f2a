#include "worker/ring/allreduce_client.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec.h"
#include "common/grpc_options.h"
#include "common/health.h"
#include "common/log.h"
#include "common/lr_schedule.h"
#include "common/net_diagnose.h"
#include "common/optimizer.h"
#include "common/ring_allreduce.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "worker/ring/partial_allreduce.h"
#include "worker/ring/ring_peer.h"
#include "worker/ring/ring_tcp.h"

namespace rubato {
namespace {

class AllReduceClient final : public PsClient {
 public:
  AllReduceClient(const AllReduceOptions& options, std::unique_ptr<Optimizer> optimizer)
      : options_(options),
        size_(options.cluster.num_workers()),
        optimizer_(std::move(optimizer)),
        mailbox_((options.rank + size_ - 1) % size_) {
    for (const TensorSpec& t : options_.model) {
      elements_.push_back(ElementCount(t.shape()));
      roles_.push_back(optimizer_->RoleOf(t.name(), t.shape()));
      total_ += elements_.back();
    }
    states_.resize(options_.model.size());
    flat_.resize(total_);
  }

  ~AllReduceClient() override {
    if (partial_ != nullptr) partial_->Stop();  // Its thread uses link_.
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  absl::Status Start() {
    const std::string& address =
        options_.listen.empty() ? options_.cluster.workers(options_.rank) : options_.listen;
    RETURN_IF_ERROR(options_.server_security.CheckListenAddress(address));
    ASSIGN_OR_RETURN(
        const RingTransport transport,
        ResolveRingTransport(options_.transport, options_.server_security.encrypts() ||
                                                     options_.client_security.encrypts()));
    const std::string& next = options_.cluster.workers((options_.rank + 1) % size_);
    if (transport == RingTransport::kTcp) {
      std::string host, port;
      if (!SplitHostPort(address, &host, &port)) {
        return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
      }
      ASSIGN_OR_RETURN(data_,
                       TcpRingListener::Create(host, options_.data_port, mailbox_.from_rank()));
      auto link = std::make_unique<TcpRingLink>(options_.rank, size_, next, data_.get(),
                                                absl::Seconds(10), options_.client_security);
      link->SetReceiveSpin(options_.receive_spin);
      link_ = std::move(link);
    } else {
      link_ = std::make_unique<GrpcRingLink>(options_.rank, size_, next, &mailbox_,
                                             absl::Seconds(10), options_.client_security,
                                             MaxMessageBytes(options_.cluster));
    }
    service_ = std::make_unique<RingPeerService>(&mailbox_, options_.server_security, data_.get());
    RUBATO_LOG(INFO) << "ring rank " << options_.rank << ": blocks travel "
                     << (transport == RingTransport::kTcp
                             ? absl::StrCat("on a TCP data connection (listening on port ",
                                            data_->port(), ")")
                             : std::string("on a gRPC stream"));
    if (const std::string why = DiagnoseListen(address); !why.empty()) {
      return absl::UnavailableError(
          absl::StrCat("rank ", options_.rank, " cannot listen on ", address,
                       " (its own entry in --peers, or --listen): ", why));
    }
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder, MaxMessageBytes(options_.cluster));
    int port = 0;
    builder.AddListeningPort(address, options_.server_security.credentials(), &port);
    builder.RegisterService(service_.get());
    builder.RegisterService(&health_);  // Probes of the rank's port (unauthenticated, status only).
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("rank ", options_.rank, " cannot listen on ", address,
                       ": gRPC could not bind it (see its log)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Register(absl::Span<const std::vector<float>> initial, int32_t batch_size,
                                   int64_t /*resume_step*/) override {
    if (absl::Status s = link_->Connect(absl::Now() + options_.connect_timeout); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("ring rank ", options_.rank,
                                                 " (--connect_timeout_ms): ", s.message()));
    }
    {
      absl::MutexLock lock(&params_mu_);
      params_.assign(initial.begin(), initial.end());
    }
    batch_size_ = batch_size;
    ScheduleContext context;
    context.global_batch = int64_t{batch_size} * size_;
    context.steps_per_epoch = options_.steps_per_epoch;
    context.total_steps = options_.total_steps;
    ASSIGN_OR_RETURN(LearningRateScheduler schedule,
                     LearningRateScheduler::Create(options_.cluster.optimizer().learning_rate(),
                                                   options_.cluster.lr_schedule(), context));
    schedule_ = std::move(schedule);
    if (options_.cluster.consistency().allreduce_quorum() != QUORUM_ALL) StartPartial();
    return 0;
  }

  absl::Status Pull(int64_t step, absl::Span<std::vector<float>> params,
                    int64_t* min_version) override {
    absl::MutexLock lock(&params_mu_);
    for (size_t i = 0; i < params_.size(); ++i) params[i] = params_[i];
    // The partial all-reduce's weights are those of every round done so far, which may be more
    // than `step` (this rank's gradients missed rounds): the loop skips to them.
    if (min_version != nullptr) *min_version = partial_ != nullptr ? partial_->rounds_done() : step;
    return absl::OkStatus();
  }

  std::optional<int64_t> FinalStep() const override {
    if (partial_ == nullptr || !partial_->finished()) return std::nullopt;
    return partial_->rounds_done();
  }

  absl::Status Push(int64_t step, absl::Span<const std::vector<float>> grads,
                    PushResult* result) override {
    if (!schedule_.has_value()) return absl::FailedPreconditionError("Register first");
    // One all-reduce over all tensors, laid end to end.
    int64_t offset = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      std::copy(grads[i].begin(), grads[i].end(), flat_.begin() + offset);
      offset += elements_[i];
    }
    if (result != nullptr) *result = PushResult();
    if (partial_ != nullptr) return PushPartial(step, result);
    RETURN_IF_ERROR(RingAllReduceMean(options_.rank, size_, step, link_.get(),
                                      absl::MakeSpan(flat_), options_.timeout));
    absl::MutexLock lock(&params_mu_);
    return Apply(step, flat_);
  }

  absl::Status Heartbeat(int64_t /*step*/) override { return absl::OkStatus(); }
  // No servers to tell: each rank ends by itself after its last all-reduce (the partial
  // all-reduce: once its communication thread has taken part in every round).
  absl::Status Finish(int64_t /*steps*/) override {
    if (partial_ == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(partial_->Wait(absl::Now() + options_.timeout));
    const PartialAllReduce::Counts c = partial_->counts();
    RUBATO_LOG(INFO) << "partial all-reduce rank " << options_.rank << ": " << c.contributed
                     << " gradients computed, " << c.sent << " applied, " << c.dropped
                     << " dropped (still pending after the last round); " << c.polls
                     << " activation polls";
    return absl::OkStatus();
  }
  const std::vector<int>& shard_of() const override { return no_shards_; }
  const std::vector<int64_t>& shard_bytes() const override { return no_bytes_; }

 private:
  // The optimizer step of update `step` with the mean gradient `mean` (all tensors end to end).
  absl::Status Apply(int64_t step, absl::Span<const float> mean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(params_mu_) {
    const float lr = static_cast<float>(schedule_->At(step));
    int64_t offset = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      optimizer_->Update(lr, mean.subspan(offset, elements_[i]), absl::MakeSpan(params_[i]),
                         roles_[i], &states_[i]);
      offset += elements_[i];
    }
    return absl::OkStatus();
  }

  void StartPartial() {
    PartialAllReduceOptions partial;
    partial.rank = options_.rank;
    partial.size = size_;
    // The quorum's one definition (PartialQuorum); the spec was validated, so it parses.
    partial.quorum = *PartialQuorum(
        size_, options_.cluster.consistency().allreduce_quorum() == QUORUM_SOLO ? "solo"
                                                                                : "majority");
    // As many rounds as carry the gradients of the synchronous job's steps (each carries >= 1).
    partial.gradients = options_.total_steps * size_;
    partial.rounds = partial.gradients;
    partial.elements = total_;
    partial.timeout = options_.timeout;
    RUBATO_LOG(INFO) << "ring rank " << options_.rank << ": partial all-reduce, a round goes on "
                     << "once " << partial.quorum << " of " << size_
                     << " ranks have a gradient ready, until the rounds have carried "
                     << partial.gradients << " gradients";
    partial_ = std::make_unique<PartialAllReduce>(
        partial, link_.get(),
        [this](int64_t round, absl::Span<const float> mean, int64_t gradients) {
          absl::MutexLock lock(&params_mu_);
          // The schedule's step: the synchronous steps whose gradients the job has applied.
          const int64_t progress = applied_gradients_ / size_;
          applied_gradients_ += gradients;
          return Apply(progress, mean);
        });
  }

  // Hands this rank's gradient (in flat_) to the partial all-reduce and waits until a round has
  // applied it (its staleness: the rounds between its weights and that round) or the rounds are
  // over (dropped).
  absl::Status PushPartial(int64_t step, PushResult* result) {
    ASSIGN_OR_RETURN(const PartialAllReduce::Outcome outcome,
                     partial_->Contribute(flat_, absl::Now() + options_.timeout));
    if (result != nullptr) {
      if (outcome.round < 0) result->dropped = 1;
      result->max_staleness = std::max<int64_t>(0, outcome.round - step);
      absl::MutexLock lock(&params_mu_);
      result->applied_examples = applied_gradients_ * batch_size_;
    }
    return absl::OkStatus();
  }

  const AllReduceOptions options_;
  const int size_;
  const std::unique_ptr<Optimizer> optimizer_;
  // (total_) the gradients, then their mean. Declared before link_, so destroyed after it: after a
  // failed all-reduce the link may still be sending blocks that point into it (Send does not copy),
  // until its destructor has closed or cancelled the stream and gRPC is done with it.
  std::vector<float> flat_;
  // allreduce:majority, allreduce:solo (its buffers, like flat_, outlive link_; the destructor
  // stops its thread first).
  std::unique_ptr<PartialAllReduce> partial_;
  RingMailbox mailbox_;                    // Before data_, service_ and link_, which use it.
  std::unique_ptr<TcpRingListener> data_;  // With the TCP transport.
  std::unique_ptr<RingPeerService> service_;
  std::unique_ptr<RingLink> link_;
  HealthService health_{{"rubato.RingPeer"}};
  std::unique_ptr<grpc::Server> server_;
  std::vector<int64_t> elements_;
  std::vector<TensorRole> roles_;
  int64_t total_ = 0;
  // The weights: written by Push (synchronous) or the partial all-reduce's thread, read by Pull.
  absl::Mutex params_mu_;
  std::vector<std::vector<float>> params_ ABSL_GUARDED_BY(params_mu_);
  int64_t applied_gradients_ ABSL_GUARDED_BY(params_mu_) = 0;  // The partial all-reduce's.
  int64_t batch_size_ = 0;
  std::vector<TensorOptimizerState> states_;
  std::optional<LearningRateScheduler> schedule_;
  const std::vector<int> no_shards_;
  const std::vector<int64_t> no_bytes_;
};

}  // namespace

absl::StatusOr<RingTransport> ParseRingTransport(absl::string_view text) {
  if (text == "auto") return RingTransport::kAuto;
  if (text == "tcp") return RingTransport::kTcp;
  if (text == "grpc") return RingTransport::kGrpc;
  return absl::InvalidArgumentError(
      absl::StrCat("--ring_transport must be auto, tcp or grpc, not '", text, "'"));
}

absl::StatusOr<RingTransport> ResolveRingTransport(RingTransport requested, bool tls) {
  if (requested == RingTransport::kAuto) return tls ? RingTransport::kGrpc : RingTransport::kTcp;
  if (requested == RingTransport::kTcp && tls) {
    return absl::InvalidArgumentError(
        "--ring_transport=tcp with TLS: the TCP data plane does not encrypt the gradients; use "
        "--ring_transport=grpc (or auto, which picks it under TLS)");
  }
  return requested;
}

absl::StatusOr<std::unique_ptr<PsClient>> CreateAllReduceClient(const AllReduceOptions& options) {
  const int size = options.cluster.num_workers();
  if (size < 1 || options.cluster.workers_size() != size || options.rank < 0 ||
      options.rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("allreduce: rank ", options.rank, " of ", size,
                                                   " with ", options.cluster.workers_size(),
                                                   " worker addresses"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                   Optimizer::Create(options.cluster.optimizer()));
  auto client = std::make_unique<AllReduceClient>(options, std::move(optimizer));
  RETURN_IF_ERROR(client->Start());
  return std::unique_ptr<PsClient>(std::move(client));
}

}  // namespace rubato
