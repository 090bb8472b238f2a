// What the layerwise forward pass (TrainingOptions.layerwise_forward) gains when a later layer's
// weights come last: one process runs a bsp job of 2 workers and 2 shards (the real TrainingLoop,
// PsClient and ParameterShards, over in-process channels), in which the shard holding the model's
// largest tensor (the CNN's dense1 kernel) is reached through a link of D ms one-way latency
// (DelayedChannel: each push or pull reaches the shard D ms after it is sent, and its answer the
// worker D ms after the shard gave it). Each delay runs with the forward pass waiting for every
// pull first and layer by layer, alternately, and prints the mean step time of each.
//
//   bazel run //inprocess:layerwise_benchmark -- [--model=cnn] [--batch=64] [--steps=60]
//       [--delays_ms=0,2,5,10,20] [--reps=2] [--data_dir=/usr/share/datasets/fashion-mnist]
//
// With no delay the first layer's weights come last (its gradient is the last computed), so
// waiting layer by layer gains nothing; behind the delay the largest layer's come last, and the
// layers before it compute meanwhile. A benchmark: compare the two within one run.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "inprocess/in_process_shard_channel.h"
#include "inprocess/test_jobs.h"
#include "server/parameter_shard.h"
#include "worker/data/dataset.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/training_loop.h"

ABSL_FLAG(std::string, model, "cnn", "The --model of rubato_worker.");
ABSL_FLAG(int, batch, 64, "Examples per step on each worker.");
ABSL_FLAG(int64_t, steps, 60, "Steps of each job.");
ABSL_FLAG(std::string, delays_ms, "0,2,5,10,20",
          "One-way latencies of the link to the shard holding the largest tensor, in ms.");
ABSL_FLAG(int, reps, 2, "Jobs of each delay and way.");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist", "Fashion-MNIST IDX files.");

namespace rubato {
namespace {

// Runs each function at its time, in time order, on a thread of its own.
class Delayer {
 public:
  Delayer() : thread_([this] { Loop(); }) {}
  ~Delayer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void At(absl::Time when, std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    queue_.emplace(std::make_pair(when, seq_++), std::move(fn));
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (true) {
      if (stop_ && queue_.empty()) return;
      if (!queue_.empty() && queue_.begin()->first.first <= absl::Now()) {
        std::function<void()> fn = std::move(queue_.begin()->second);
        queue_.erase(queue_.begin());
        mu_.Unlock();
        fn();
        mu_.Lock();
        continue;
      }
      // Until the first entry is due, or the queue changes (an earlier entry, the end).
      const uint64_t seen = seq_;
      const bool stopping = stop_;
      auto changed = [this, seen, stopping]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return seq_ != seen || stop_ != stopping;
      };
      mu_.AwaitWithDeadline(absl::Condition(&changed),
                            queue_.empty() ? absl::InfiniteFuture() : queue_.begin()->first.first);
    }
  }

  absl::Mutex mu_;
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// A channel whose pushes and pulls cross a link of `delay` one-way latency; the other calls go
// straight through.
class DelayedChannel final : public ShardChannel {
 public:
  DelayedChannel(std::unique_ptr<ShardChannel> inner, absl::Duration delay, Delayer* delayer)
      : inner_(std::move(inner)), delay_(delay), delayer_(delayer) {}
  void Register(const RegisterRequest& request, RegisterResponse* response,
                const CallOptions& options, Done done) override {
    inner_->Register(request, response, options, std::move(done));
  }
  void Rollback(const RollbackRequest& request, RollbackResponse* response,
                const CallOptions& options, Done done) override {
    inner_->Rollback(request, response, options, std::move(done));
  }
  void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                 const CallOptions& options, Done done) override {
    inner_->Heartbeat(request, response, options, std::move(done));
  }
  void Finish(const FinishRequest& request, FinishResponse* response, const CallOptions& options,
              Done done) override {
    inner_->Finish(request, response, options, std::move(done));
  }
  void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, const CallOptions& options,
            Done done) override {
    Cross([=](Done back) { inner_->Push(request, response, options, std::move(back)); },
          std::move(done));
  }
  void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
            const CallOptions& options, Done done) override {
    Cross([=](Done back) { inner_->Pull(request, response, sink, options, std::move(back)); },
          std::move(done));
  }
  const std::string& address() const override { return inner_->address(); }
  std::string Diagnose() const override { return inner_->Diagnose(); }

 private:
  // The call reaches the shard after the delay, and its answer comes back after another.
  void Cross(std::function<void(Done)> call, Done done) {
    if (delay_ <= absl::ZeroDuration()) {
      call(std::move(done));
      return;
    }
    delayer_->At(absl::Now() + delay_, [this, call = std::move(call), done = std::move(done)] {
      call([this, done](absl::Status s) {
        delayer_->At(absl::Now() + delay_, [done, s] { done(s); });
      });
    });
  }

  const std::unique_ptr<ShardChannel> inner_;
  const absl::Duration delay_;
  Delayer* const delayer_;
};

struct Job {
  ModelSpec spec;
  Dataset train;
  int batch = 0;
  int64_t steps = 0;
  int slow_shard = 0;  // The one behind the delay.
};

// One job; returns the mean step time over both workers, in ms (wall time over steps).
absl::StatusOr<double> RunJob(const Job& job, absl::Duration delay, bool layerwise,
                              int64_t* layerwise_steps) {
  constexpr int kWorkers = 2, kShards = 2;
  ClusterSpec cluster;
  cluster.set_num_workers(kWorkers);
  cluster.mutable_consistency()->set_mode(BSP);
  cluster.mutable_optimizer()->set_type("adam");
  cluster.mutable_optimizer()->set_learning_rate(0.001);
  cluster.set_lease_ms(60000);
  cluster.set_wait_timeout_ms(60000);
  std::vector<std::unique_ptr<ParameterShard>> shards;
  std::vector<ParameterShard*> shard_ptrs;
  for (int s = 0; s < kShards; ++s) {
    ShardOptions o;
    o.shard_id = s;
    o.num_shards = kShards;
    o.cluster = cluster;
    ASSIGN_OR_RETURN(std::unique_ptr<ParameterShard> shard, ParameterShard::Create(o));
    shard_ptrs.push_back(shard.get());
    shards.push_back(std::move(shard));
  }
  Delayer delayer;
  std::vector<absl::Status> errors(kWorkers);
  std::vector<double> step_ms(kWorkers, 0);
  std::vector<int64_t> layered(kWorkers, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      errors[w] = [&]() -> absl::Status {
        std::vector<std::unique_ptr<ShardChannel>> channels = InProcessChannels(shard_ptrs);
        channels[job.slow_shard] =
            std::make_unique<DelayedChannel>(std::move(channels[job.slow_shard]), delay, &delayer);
        PsClientOptions options = InProcessClientOptions(job.spec, cluster, w, job.steps);
        ASSIGN_OR_RETURN(std::unique_ptr<PsClient> client,
                         CreatePsClient(options, std::move(channels)));
        ASSIGN_OR_RETURN(std::unique_ptr<ModelBackend> backend, CreateCpuBackend(job.spec, 1));
        ASSIGN_OR_RETURN(ShardedBatcher batcher,
                         ShardedBatcher::Create(&job.train, w, kWorkers, job.batch, 7));
        std::vector<std::vector<float>> params = InitModelParams(job.spec, 5);
        TrainingOptions t;
        t.worker_id = w;
        t.num_workers = kWorkers;
        t.steps = job.steps;
        t.log_every = job.steps;
        t.layerwise_forward = layerwise;
        ASSIGN_OR_RETURN(t.start_step, client->Register(params, job.batch, 0));
        std::ostringstream progress;
        ASSIGN_OR_RETURN(const TrainingResult r,
                         RunTraining(t, job.spec, client.get(), backend.get(), &batcher, Dataset(),
                                     &params, &progress));
        RETURN_IF_ERROR(client->Finish(r.steps));
        step_ms[w] = 1e3 * r.wall_seconds / static_cast<double>(r.steps);
        layered[w] = r.layerwise_steps;
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) {
    if (!errors[w].ok())
      return absl::Status(errors[w].code(), absl::StrCat("worker ", w, ": ", errors[w].message()));
  }
  *layerwise_steps = layered[0] + layered[1];
  return (step_ms[0] + step_ms[1]) / kWorkers;
}

absl::Status Main() {
  Job job;
  ASSIGN_OR_RETURN(job.spec, ParseModelSpec(absl::GetFlag(FLAGS_model)));
  job.batch = absl::GetFlag(FLAGS_batch);
  job.steps = absl::GetFlag(FLAGS_steps);
  if (job.batch < 1 || job.steps < 2) {
    return absl::InvalidArgumentError("--batch must be >= 1 and --steps >= 2");
  }
  ASSIGN_OR_RETURN(job.train, LoadFashionMnist(absl::GetFlag(FLAGS_data_dir), Split::kTrain,
                                               int64_t{2} * job.batch * job.steps));
  std::vector<int64_t> delays;
  for (absl::string_view d : absl::StrSplit(absl::GetFlag(FLAGS_delays_ms), ',')) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(d, &ms) || ms < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--delays_ms: '", d, "' is not a whole number of ms >= 0"));
    }
    delays.push_back(ms);
  }
  // The shard of the largest tensor, by the placement every worker and shard computes.
  const std::vector<ParamSpec> specs = ModelParamSpecs(job.spec);
  std::vector<TensorSize> sizes;
  for (const ParamSpec& p : specs) {
    sizes.push_back({p.name, p.elements() * static_cast<int64_t>(sizeof(float))});
  }
  ASSIGN_OR_RETURN(const Placement placement, PlaceTensors(sizes, 2));
  const size_t largest = static_cast<size_t>(
      std::max_element(sizes.begin(), sizes.end(),
                       [](const TensorSize& a, const TensorSize& b) { return a.bytes < b.bytes; }) -
      sizes.begin());
  job.slow_shard = placement.shard_of[largest];
  std::string behind;
  for (size_t t = 0; t < specs.size(); ++t) {
    if (placement.shard_of[t] == job.slow_shard) absl::StrAppend(&behind, " ", specs[t].name);
  }
  std::cout << "model " << absl::GetFlag(FLAGS_model) << ", batch " << job.batch
            << " per worker, 2 workers, 2 shards, bsp, " << job.steps
            << " steps a job; behind the delay: shard " << job.slow_shard << " (" << behind
            << " )\n";
  std::cout << absl::StrFormat("%9s %16s %16s %9s\n", "delay ms", "whole pull ms", "layerwise ms",
                               "gain");
  for (const int64_t ms : delays) {
    double sums[2] = {0, 0};
    int64_t layered = 0;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      for (const bool layerwise : {false, true}) {
        int64_t steps = 0;
        ASSIGN_OR_RETURN(const double step_ms,
                         RunJob(job, absl::Milliseconds(ms), layerwise, &steps));
        sums[layerwise ? 1 : 0] += step_ms;
        if (layerwise) layered += steps;
      }
    }
    const double reps = absl::GetFlag(FLAGS_reps);
    const double whole = sums[0] / reps, layerwise = sums[1] / reps;
    std::cout << absl::StrFormat("%9d %16.2f %16.2f %8.1f%%\n", ms, whole, layerwise,
                                 100.0 * (whole - layerwise) / whole);
    if (layered == 0) return absl::InternalError("no step waited layer by layer");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = rubato::Main();
  if (!s.ok()) {
    std::cerr << "layerwise_benchmark: " << s << "\n";
    return 1;
  }
  return 0;
}
