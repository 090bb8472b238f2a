#include "sim/timing_job.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/consistency_policy.h"
#include "server/parameter_shard.h"
#include "sim/cpu.h"
#include "sim/event_loop.h"
#include "sim/sim_shard_channel.h"
#include "worker/ps/call_plan.h"
#include "worker/ps/ps_client.h"
#include "worker/ps/recovery.h"
#include "worker/training_loop.h"

namespace rubato {
namespace {

// How often the shards' deadlines (pull timeouts, held gradients) are looked at: they are seconds
// long, so a second late at most.
constexpr absl::Duration kDeadlineTick = absl::Seconds(1);

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

// bsp's part size for the real tensors (0: a mode without parts).
int64_t RealParts(const TimingJobOptions& o) {
  return PushPartElements(o.cluster.consistency(), o.cluster.num_workers(),
                          ShardOptions().push_budget_bytes);
}

class Job {
 public:
  explicit Job(const TimingJobOptions& options) : o_(options), network_(&loop_) {}

  ~Job() {
    // Answers whatever still waits at a shard (after an error), and lets it reach its client,
    // before the clients go.
    for (auto& s : shards_) s->Shutdown();
    loop_.Run();
    workers_.clear();
  }

  absl::StatusOr<TimingJobResult> Run() {
    RETURN_IF_ERROR(Build());
    const absl::Time real_start = absl::Now();
    start_ = loop_.Now();
    running_ = static_cast<int>(workers_.size());
    for (auto& w : workers_) {
      if (reassign()) {
        NextUnit(w.get());
      } else {
        Pull(w.get());
      }
    }
    loop_.After(kDeadlineTick, [this] { Tick(); });
    const int64_t events = loop_.Run();
    RETURN_IF_ERROR(error_);
    if (running_ > 0) {
      return absl::InternalError(absl::StrCat("the simulation ran out of events with ", running_,
                                              " worker(s) still running"));
    }
    TimingJobResult r;
    r.events = events;
    r.real_seconds = absl::ToDoubleSeconds(absl::Now() - real_start);
    for (const auto& w : workers_) {
      r.workers.push_back(w->result);
      r.wall = std::max(r.wall, w->result.finished);
      r.dropped_gradients += w->dropped;
    }
    for (const auto& s : shards_) r.shard_stats.push_back(s->Stats());
    const double wall = absl::ToDoubleSeconds(r.wall);
    for (int h : server_hosts_) {
      const Network::HostStats s = network_.stats(h);
      if (wall > 0) {
        r.max_shard_nic_in = std::max(r.max_shard_nic_in, absl::ToDoubleSeconds(s.busy_in) / wall);
        r.max_shard_nic_out =
            std::max(r.max_shard_nic_out, absl::ToDoubleSeconds(s.busy_out) / wall);
      }
    }
    return r;
  }

 private:
  struct Worker {
    int id = 0;
    std::unique_ptr<PsClient> client;
    Cpu* cpu = nullptr;  // Its host's.
    std::optional<StragglerModel> straggler;
    std::vector<std::vector<float>> params;
    std::vector<std::vector<float>> grads;  // The training level's; the timing level's are grads_.
    int64_t step = 0;
    SimStep current;   // The step in progress.
    absl::Time since;  // The call in progress began.
    int64_t dropped = 0;
    double compute_ms_ema = 0;  // Adaptive consistency's.
    // Work reassignment: a channel to shard 0 for TakeWork, the requests so far, the answer in
    // flight and the batches left of the current unit.
    std::unique_ptr<SimShardChannel> work_channel;
    int64_t work_requests = 0;
    TakeWorkResponse work;
    int64_t unit_left = 0;
    TimingJobResult::Worker result;
  };

  absl::Status Build() {
    RETURN_IF_ERROR(ValidateTimingJobOptions(o_));
    const int num_workers = o_.cluster.num_workers();
    ClusterSpec cluster = o_.cluster;
    // No failures are simulated and workers send no heartbeats: leases of a day (the longest
    // allowed) run out only in a run that long.
    cluster.set_lease_ms(int64_t{24} * 3600 * 1000);
    std::vector<TensorSpec> model;
    std::vector<std::vector<float>> initial;
    if (o_.workload != nullptr) {
      model = o_.workload->Model();
      initial = o_.workload->InitialParams();
      if (initial.size() != model.size()) {
        return absl::InvalidArgumentError(absl::StrCat("the workload's model has ", model.size(),
                                                       " tensors and its weights ",
                                                       initial.size()));
      }
    } else {
      for (size_t i = 0; i < o_.tensor_elements.size(); ++i) {
        TensorSpec t;
        t.set_name(absl::StrCat("tensor_", i));
        t.add_shape(Ceil(o_.tensor_elements[i], o_.scale));
        model.push_back(t);
        initial.emplace_back(t.shape(0), 0.0f);
      }
    }
    int local_host = -1;
    if (o_.colocated) {
      HostSpec spec = o_.worker_host;
      spec.name = "localhost";
      local_host = network_.AddHost(spec);
      server_hosts_.push_back(local_host);
    }
    for (int h = 0; !o_.colocated && h < Ceil(o_.shards, o_.shards_per_host); ++h) {
      HostSpec spec = o_.server_host;
      spec.name = absl::StrCat("server-host-", h);
      server_hosts_.push_back(network_.AddHost(spec));
    }
    ASSIGN_OR_RETURN(const int64_t part_elements, ScaledParts());
    for (int s = 0; s < o_.shards; ++s) {
      ShardOptions so;
      so.part_elements = part_elements;
      so.shard_id = s;
      so.num_shards = o_.shards;
      so.cluster = cluster;
      so.clock = loop_.clock();
      so.post = [this](std::function<void()> task) {
        loop_.After(absl::ZeroDuration(), std::move(task));
      };
      so.deadline_thread = false;
      ASSIGN_OR_RETURN(std::unique_ptr<ParameterShard> shard, ParameterShard::Create(so));
      shards_.push_back(std::move(shard));
      processors_.push_back(std::isinf(o_.apply_bytes_per_second)
                                ? nullptr
                                : std::make_unique<Queue>(o_.apply_bytes_per_second));
    }
    std::vector<int> worker_hosts;
    for (int h = 0; !o_.colocated && h < Ceil(num_workers, o_.workers_per_host); ++h) {
      HostSpec spec = o_.worker_host;
      spec.name = absl::StrCat("worker-host-", h);
      worker_hosts.push_back(network_.AddHost(spec));
    }
    for (int h = 0; h < network_.hosts(); ++h) {
      cpus_.push_back(std::make_unique<Cpu>(&loop_, network_.host(h).cores));
      // Where a host's cores are modelled, its loopback transfers take them too.
      if (network_.host(h).cores > 0) network_.UseCpu(h, cpus_.back().get());
    }
    if (o_.workload == nullptr) grads_ = initial;  // Zeros.
    for (int w = 0; w < num_workers; ++w) {
      auto worker = std::make_unique<Worker>();
      worker->id = w;
      worker->cpu = cpus_[o_.colocated ? local_host : worker_hosts[w / o_.workers_per_host]].get();
      std::vector<std::unique_ptr<ShardChannel>> channels;
      for (int s = 0; s < o_.shards; ++s) {
        SimRoute route;
        route.network = &network_;
        route.worker_host = o_.colocated ? local_host : worker_hosts[w / o_.workers_per_host];
        route.shard_host = o_.colocated ? local_host : server_hosts_[s / o_.shards_per_host];
        route.shard_processor = processors_[s].get();
        route.scale = o_.scale;
        channels.push_back(std::make_unique<SimShardChannel>(
            shards_[s].get(), absl::StrCat("simulated shard ", s), route));
      }
      PsClientOptions co;
      co.worker_id = w;
      co.num_workers = num_workers;
      co.consistency = cluster.consistency();
      co.steps_per_epoch = o_.steps_per_epoch > 0 ? o_.steps_per_epoch : o_.steps;
      co.total_steps = o_.steps;
      co.model = model;
      co.clock = loop_.clock();
      co.timer = &loop_;
      co.use_data_plane = false;
      // Cut into as many calls as the real client would cut the full-size tensors into.
      co.target_call_bytes = std::max<int64_t>(kTargetCallBytes / o_.scale, 1024);
      ASSIGN_OR_RETURN(worker->client, CreatePsClient(co, std::move(channels)));
      if (!o_.stragglers.empty()) {
        ASSIGN_OR_RETURN(StragglerModel m, StragglerModel::Create(o_.stragglers[w], w));
        worker->straggler.emplace(std::move(m));
      }
      if (reassign()) {
        SimRoute route;
        route.network = &network_;
        route.worker_host = o_.colocated ? local_host : worker_hosts[w / o_.workers_per_host];
        route.shard_host = o_.colocated ? local_host : server_hosts_[0];
        route.scale = o_.scale;
        worker->work_channel =
            std::make_unique<SimShardChannel>(shards_[0].get(), "simulated shard 0", route);
      }
      worker->params = initial;
      if (o_.workload != nullptr) worker->grads = initial;
      // Answered at once by every shard (SimShardChannel): the first worker's values are adopted.
      ASSIGN_OR_RETURN(worker->step, worker->client->Register(worker->params, o_.batch_size, 0));
      workers_.push_back(std::move(worker));
    }
    return absl::OkStatus();
  }

  // ShardOptions.part_elements for every shard: bsp pushes large tensors in parts, as many parts
  // of the held tensors as of the real ones (-1: the policy's own, a mode without parts).
  absl::StatusOr<int64_t> ScaledParts() const {
    const int64_t parts = RealParts(o_);
    if (parts == 0 || o_.scale == 1) return -1;  // As a real shard: the policy's own.
    const int64_t max_scale = MaxScale(o_);
    if (max_scale == std::numeric_limits<int64_t>::max()) return 0;  // Whole, as at full size.
    if (o_.scale > max_scale) {
      return absl::InvalidArgumentError(
          absl::StrCat("bsp pushes this model's tensors in parts of ", parts,
                       " elements, and a client takes no part below ", kMinPartElements,
                       " elements: scale must be at most ", max_scale, ", got ", o_.scale));
    }
    return parts / o_.scale;
  }

  bool reassign() const { return o_.cluster.reassign().unit_batches() > 0; }
  int64_t StepsPerEpoch() const { return o_.steps_per_epoch > 0 ? o_.steps_per_epoch : o_.steps; }

  // Work reassignment: the next unit from shard 0's work queue (server/work_queue.h), as
  // ServerWorkFeed asks for it. Each worker's share of an epoch is steps_per_epoch batches in
  // units of unit_batches (the last one shorter); the job is steps / steps_per_epoch epochs. The
  // worker trains until the queue is done, however many steps that takes.
  void NextUnit(Worker* w) {
    const int64_t unit = o_.cluster.reassign().unit_batches();
    TakeWorkRequest request;
    request.set_worker_id(w->id);
    for (int i = 0; i < o_.cluster.num_workers(); ++i) {
      request.add_units_per_worker(Ceil(StepsPerEpoch(), unit));
    }
    request.set_epochs(Ceil(o_.steps, StepsPerEpoch()));
    request.set_request(++w->work_requests);
    w->since = loop_.Now();
    w->work_channel->TakeWork(
        request, &w->work, ShardChannel::CallOptions(), [this, w, unit](absl::Status status) {
          if (!Check(w, status, "take work")) return;
          w->result.waiting += loop_.Now() - w->since;
          if (w->work.done()) {
            End(w);
            return;
          }
          w->unit_left = std::min(unit, StepsPerEpoch() - w->work.unit().index() * unit);
          Pull(w);
        });
  }

  void Pull(Worker* w) {
    w->since = loop_.Now();
    w->client->StartPull(w->step, absl::MakeSpan(w->params),
                         [this, w](absl::Status status, int64_t min_version) {
                           Pulled(w, std::move(status), min_version);
                         });
  }

  void Pulled(Worker* w, absl::Status status, int64_t min_version) {
    if (!Check(w, status, "pull")) return;
    w->result.waiting += loop_.Now() - w->since;
    w->current = SimStep();
    w->current.worker = w->id;
    w->current.pull = loop_.Now() - w->since;
    const ConsistencyMode mode = o_.cluster.consistency().mode();
    if ((mode == BACKUP || mode == ADAPTIVE) && min_version > w->step) {
      // The job went on without this worker's step: compute the current one instead.
      w->current.skipped = std::min<int64_t>(min_version, o_.steps) - w->step;
      w->result.skipped_steps += w->current.skipped;
      w->step = min_version;
      if (w->step >= o_.steps) {
        End(w);
        return;
      }
    }
    w->current.step = w->step;
    absl::Duration work =
        o_.step_times != nullptr ? o_.step_times->At(w->id, w->step) : o_.step_time;
    if (o_.workload != nullptr) {
      absl::StatusOr<absl::Duration> c = o_.workload->Compute(w->id, w->step, w->params, &w->grads);
      if (!Check(w, c.status(), "compute")) return;
      work = *c;
    }
    // The compute shares its host's processors; the injected delay, as the worker's sleep, does
    // not, and follows from the compute time as measured (worker/straggler_model.h).
    const absl::Time began = loop_.Now();
    w->cpu->Run(work, [this, w, began] { Computed(w, loop_.Now() - began); });
  }

  void Computed(Worker* w, absl::Duration compute) {
    w->current.compute = compute;
    if (w->straggler.has_value()) w->current.delay = w->straggler->DelayFor(w->step, compute);
    w->result.compute += compute + w->current.delay;
    if (w->current.delay == absl::ZeroDuration()) {
      Push(w);  // Already an event of its own (the compute's end): no need for another.
      return;
    }
    loop_.After(w->current.delay, [this, w] { Push(w); });
  }

  void Push(Worker* w) {
    w->since = loop_.Now();
    w->client->StartPushAll(w->step, o_.workload != nullptr ? w->grads : grads_,
                            [this, w](absl::Status status, PsClient::PushResult result) {
                              Pushed(w, std::move(status), std::move(result));
                            });
  }

  void Pushed(Worker* w, absl::Status status, PsClient::PushResult result) {
    if (!Check(w, status, "push")) return;
    w->result.waiting += loop_.Now() - w->since;
    w->dropped += result.dropped;
    if (result.dropped > 0) ++w->result.dropped_pushes;
    if (o_.cluster.consistency().mode() == ADAPTIVE) {
      // As TrainingLoop::AdoptConsistency: the step's compute and delay, their moving mean, and
      // the shards' decisions, which the next pushes relay.
      const double ms = 1e3 * absl::ToDoubleSeconds(w->current.compute + w->current.delay);
      w->compute_ms_ema = NextComputeMsMean(w->compute_ms_ema, ms);
      w->client->SetComputeMs(w->compute_ms_ema, w->step, ms);
      if (!Check(w, w->client->AdoptConsistency(result.consistency_changes, nullptr),
                 "adopt the shards' consistency")) {
        return;
      }
    }
    ++w->result.computed_steps;
    ++w->step;
    absl::Duration next = absl::ZeroDuration();
    if (o_.workload != nullptr) {
      w->current.push = loop_.Now() - w->since;
      w->current.at = loop_.Now() - start_;
      w->current.pushed = std::move(result);
      absl::StatusOr<absl::Duration> extra = o_.workload->StepDone(w->current, w->params);
      if (!Check(w, extra.status(), "step")) return;
      next = *extra;
    }
    if (reassign()) {
      if (--w->unit_left <= 0) {
        w->cpu->Run(next, [this, w] { NextUnit(w); });
      } else {
        w->cpu->Run(next, [this, w] { Pull(w); });
      }
      return;
    }
    // An evaluation that falls due is work on the worker's host.
    if (w->step >= o_.steps) {
      w->cpu->Run(next, [this, w] { End(w); });
      return;
    }
    w->cpu->Run(next, [this, w] { Pull(w); });
  }

  // The last step is done: at the training level the worker pulls the final weights (everything
  // every worker pushed, applied) and the workload sees them before the worker finishes.
  void End(Worker* w) {
    if (o_.workload == nullptr) {
      Done(w);
      return;
    }
    w->since = loop_.Now();
    w->client->StartPull(
        o_.steps, absl::MakeSpan(w->params), [this, w](absl::Status status, int64_t) {
          if (!Check(w, status, "final pull")) return;
          w->result.waiting += loop_.Now() - w->since;
          absl::StatusOr<absl::Duration> extra =
              o_.workload->Finished(w->id, o_.steps, w->result.computed_steps,
                                    w->result.skipped_steps, loop_.Now() - start_, w->params);
          if (!Check(w, extra.status(), "final evaluation")) return;
          w->cpu->Run(*extra, [this, w] { Done(w); });
        });
  }

  void Done(Worker* w) {
    w->result.finished = loop_.Now() - start_;
    (void)w->client->Finish(w->step);  // Answered at once.
    --running_;
  }

  bool Check(Worker* w, const absl::Status& status, const char* what) {
    if (!error_.ok()) return false;
    if (status.ok()) return true;
    error_ = absl::Status(status.code(), absl::StrCat("worker ", w->id, "'s ", what, " of step ",
                                                      w->step, ": ", status.message()));
    return false;
  }

  void Tick() {
    if (!error_.ok() || running_ == 0) return;
    for (auto& s : shards_) s->ExpireDeadlines();
    loop_.After(kDeadlineTick, [this] { Tick(); });
  }

  const TimingJobOptions o_;
  EventLoop loop_;
  Network network_;
  std::vector<int> server_hosts_;
  // Before the workers: their clients' channels reach the shards.
  std::vector<std::unique_ptr<ParameterShard>> shards_;
  std::vector<std::unique_ptr<Queue>> processors_;
  std::vector<std::unique_ptr<Cpu>> cpus_;  // One per network host, by its index.
  std::vector<std::vector<float>> grads_;   // Every worker pushes these (zeros, never changed).
  std::vector<std::unique_ptr<Worker>> workers_;
  absl::Time start_;
  int running_ = 0;
  absl::Status error_;
};

}  // namespace

absl::Status ValidateTimingJobOptions(const TimingJobOptions& o) {
  const int workers = o.cluster.num_workers();
  if (workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_workers must be >= 1, got ", workers));
  }
  switch (o.cluster.consistency().mode()) {
    case BSP:
    case BACKUP:
    case SSP:
    case ASYNC:
    case ADAPTIVE:
      break;
    default:
      return absl::UnimplementedError(
          absl::StrCat("the simulator does not run consistency mode ",
                       ConsistencyMode_Name(o.cluster.consistency().mode()),
                       " (it runs bsp, backup, ssp, async and adaptive)"));
  }
  if (o.workload != nullptr) {
    if (o.scale != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("a workload trains the model at its size: scale must be 1, got ", o.scale));
    }
  } else if (o.tensor_elements.empty()) {
    return absl::InvalidArgumentError("the model has no tensors");
  }
  if (o.cluster.reassign().unit_batches() > 0) {
    if (o.workload != nullptr) {
      return absl::UnimplementedError(
          "the simulator runs work reassignment at the timing level only (a workload draws each "
          "worker's own shard of the data)");
    }
    if (o.cluster.consistency().mode() != ASYNC) {
      return absl::InvalidArgumentError("work reassignment needs async");
    }
  }
  if (o.shards < 1)
    return absl::InvalidArgumentError(absl::StrCat("shards must be >= 1, got ", o.shards));
  for (int64_t e : o.tensor_elements) {
    if (e < 1) return absl::InvalidArgumentError(absl::StrCat("a tensor of ", e, " elements"));
  }
  if (o.scale < 1)
    return absl::InvalidArgumentError(absl::StrCat("scale must be >= 1, got ", o.scale));
  if (o.steps < 1)
    return absl::InvalidArgumentError(absl::StrCat("steps must be >= 1, got ", o.steps));
  if (o.batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", o.batch_size));
  }
  if (o.step_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("step_time must be >= 0");
  }
  if (!o.stragglers.empty() && static_cast<int>(o.stragglers.size()) != workers) {
    return absl::InvalidArgumentError(absl::StrCat("straggler options for ", o.stragglers.size(),
                                                   " workers, the job has ", workers));
  }
  if (o.workers_per_host < 1 || o.shards_per_host < 1) {
    return absl::InvalidArgumentError("workers_per_host and shards_per_host must be >= 1");
  }
  if (!(o.apply_bytes_per_second > 0)) {
    return absl::InvalidArgumentError("apply_bytes_per_second must be > 0");
  }
  RETURN_IF_ERROR(ValidateHostSpec(o.worker_host));
  return ValidateHostSpec(o.server_host);
}

int64_t MaxScale(const TimingJobOptions& o) {
  const int64_t parts = RealParts(o);
  if (parts == 0 || o.tensor_elements.empty() ||
      *std::max_element(o.tensor_elements.begin(), o.tensor_elements.end()) <= parts) {
    return std::numeric_limits<int64_t>::max();
  }
  return std::max<int64_t>(1, parts / kMinPartElements);
}

absl::StatusOr<TimingJobResult> RunTimingJob(const TimingJobOptions& options) {
  Job job(options);
  return job.Run();
}

}  // namespace rubato
