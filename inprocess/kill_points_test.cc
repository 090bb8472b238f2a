// A shard killed at each step around its checkpoints, in one process (issue 31, item 8): two
// shards and two workers (the real TrainingLoop and PsClient over in-process channels), shard 1
// killed the moment the first push of step k reaches it, for k on both sides of every checkpoint.
// A supervisor (as the launcher, systemd or Kubernetes restarts rubato_server) starts it again from
// its newest checkpoint on disk, through the same CheckpointWriter and LoadNewestCheckpoint as
// rubato_server; under bsp the workers' registration then rolls shard 0 back to that step
// (ParameterShard::Rollback, which the supervisor carries out as rubato_server's exit 75 and
// restart would), and the job goes on. Kill points are steps, not times, so each case is the same
// every run.
//
// Under bsp the final weights must be bit-identical to those of the same job never killed; under
// ssp (which does not rewind) the job must run to its end on both workers, without waiting for
// the servers' wait timeout.
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "inprocess/in_process_shard_channel.h"
#include "inprocess/test_jobs.h"
#include "server/checkpoint.h"
#include "server/checkpoint_writer.h"
#include "server/parameter_service.h"
#include "server/parameter_shard.h"
#include "worker/data/dataset.h"
#include "worker/model/mlp.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"
#include "worker/training_loop.h"

namespace rubato {
namespace {

constexpr int kWorkers = 2;
constexpr int kShards = 2;
constexpr int64_t kSteps = 14;
constexpr int64_t kCheckpointEvery = 4;

// One shard as a supervisor keeps it: started (fresh, or from its newest checkpoint in `dir`),
// killed, started again; a roll-back it agrees to restarts it from that step's checkpoint, as
// rubato_server's exit 75 and restart do. Its channel forwards to whichever shard is up, and
// answers UNAVAILABLE (a refused connection, which PsClient retries) while none is.
class Supervised {
 public:
  Supervised(ShardOptions options, std::string dir) : options_(std::move(options)), dir_(dir) {
    options_.checkpoint_every_steps = kCheckpointEvery;
    options_.on_checkpoint = [this](std::shared_ptr<const CapturedCheckpoint> c) {
      absl::MutexLock lock(&writer_mu_);
      if (writer_ != nullptr) writer_->Submit(std::move(c));
    };
    // As rubato_server's: agreed only with a checkpoint of that step (else the newest before
    // it), and a second recovery while restarting for one is asked again later.
    options_.on_rollback = [this](int64_t step, uint64_t id) -> absl::StatusOr<int64_t> {
      // The capture of `step` may not be on disk yet (not under writer_mu_, which on_checkpoint
      // takes on the update path; the shard is up, so its writer is not being destroyed).
      CheckpointWriter* writer;
      {
        absl::MutexLock lock(&writer_mu_);
        writer = writer_.get();
      }
      if (writer != nullptr) writer->Idle(absl::Seconds(30));
      absl::MutexLock lock(&restart_mu_);
      if (rollback_.has_value()) {
        if (rollback_->recovery_id == id) return step;
        return absl::UnavailableError("restarting already, for another recovery");
      }
      absl::StatusOr<int64_t> newest = NewestCheckpointStepAtMost(dir_, options_.shard_id, step);
      if (!newest.ok()) return newest.status();
      if (*newest != step) {
        std::fprintf(stderr, "shard %d has no checkpoint of step %lld\n", options_.shard_id,
                     static_cast<long long>(step));
        return *newest;
      }
      rollback_ = RollbackMarker{step, id};
      // Its answer goes out first; then it restarts, as the process would exit and come back.
      restarts_.emplace_back([this] { Restart(absl::Milliseconds(50)); });
      return step;
    };
  }
  ~Supervised() {
    for (;;) {
      std::vector<std::thread> restarts;
      {
        absl::MutexLock lock(&restart_mu_);
        restarts = std::move(restarts_);
        restarts_.clear();
      }
      if (restarts.empty()) break;
      for (std::thread& t : restarts) t.join();
    }
    Bury(TakeDown());
  }

  // Starts the shard: fresh the first time, else from its newest checkpoint (or, rolling back,
  // from the roll-back's step, as that recovery).
  void Start() {
    absl::StatusOr<std::unique_ptr<ParameterShard>> made = ParameterShard::Create(options_);
    ASSERT_TRUE(made.ok()) << made.status();
    std::shared_ptr<ParameterShard> shard = *std::move(made);
    std::optional<RollbackMarker> rollback;
    {
      absl::MutexLock lock(&restart_mu_);
      rollback = rollback_;
      rollback_.reset();
    }
    absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = LoadNewestCheckpoint(
        dir_, options_.shard_id,
        rollback.has_value() ? std::optional<int64_t>(rollback->step) : std::nullopt);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    if (loaded->has_value()) {
      ASSERT_TRUE(shard->Restore((*loaded)->checkpoint).ok());
      shard->SetRecoveryId(rollback.has_value() ? rollback->recovery_id : NextRecoveryId());
      absl::MutexLock lock(&restart_mu_);
      restored_steps_.push_back((*loaded)->checkpoint.step());
    } else {
      std::string files;
      for (const auto& f : std::filesystem::directory_iterator(dir_)) {
        absl::StrAppend(&files, " ", f.path().filename().string());
      }
      ASSERT_FALSE(rollback.has_value())
          << "shard " << options_.shard_id << ": no checkpoint of step " << rollback->step
          << " in" << files;
    }
    ParameterShard* raw = shard.get();
    {
      absl::MutexLock lock(&writer_mu_);
      writer_ = std::make_unique<CheckpointWriter>(
          dir_, 8, [raw](const CapturedCheckpoint& c) { return raw->CheckpointProto(c); });
    }
    absl::MutexLock lock(&mu_);
    shard_ = std::move(shard);
  }

  // Kills it when the first push of `step` reaches it, and starts it again 200 ms later.
  void KillAtStep(int64_t step) { kill_at_.store(step); }
  // Whether a push of `step` is the kill point; if so the shard is down from now on.
  bool KillsAt(int64_t step) {
    int64_t at = kill_at_.load();
    if (at < 0 || step != at || !kill_at_.compare_exchange_strong(at, -1)) return false;
    std::shared_ptr<ParameterShard> dying = TakeDown();
    absl::MutexLock lock(&restart_mu_);
    restarts_.emplace_back([this, dying]() mutable {
      Bury(std::move(dying));
      absl::SleepFor(absl::Milliseconds(200));
      Start();
    });
    return true;
  }

  // The shard up now (null while down), for one call.
  std::shared_ptr<ParameterShard> Up() {
    absl::MutexLock lock(&mu_);
    return shard_;
  }
  int shard_id() const { return options_.shard_id; }
  std::vector<int64_t> restored_steps() {
    absl::MutexLock lock(&restart_mu_);
    return restored_steps_;
  }

 private:
  // The process dies: from now on its calls fail as a refused connection's.
  std::shared_ptr<ParameterShard> TakeDown() {
    absl::MutexLock lock(&mu_);
    return std::move(shard_);
  }
  // Ends it: calls in it fail as a reset connection's; the checkpoints it captured are written
  // (the writer finishes them, where a killed process might not); then it is gone, once no call
  // that began before TakeDown still holds it.
  void Bury(std::shared_ptr<ParameterShard> shard) {
    if (shard == nullptr) return;
    shard->Shutdown(absl::UnavailableError(
        absl::StrCat("in-process shard ", options_.shard_id, ": connection reset (killed)")));
    std::unique_ptr<CheckpointWriter> writer;
    {
      absl::MutexLock lock(&writer_mu_);
      writer = std::move(writer_);
    }
    writer.reset();
    while (shard.use_count() > 1) absl::SleepFor(absl::Milliseconds(1));
    shard.reset();
  }
  void Restart(absl::Duration down) {
    Bury(TakeDown());
    absl::SleepFor(down);
    Start();
  }
  uint64_t NextRecoveryId() { return ++recoveries_ * 0x9e3779b97f4a7c15ULL; }

  ShardOptions options_;
  const std::string dir_;
  absl::Mutex mu_;
  std::shared_ptr<ParameterShard> shard_ ABSL_GUARDED_BY(mu_);
  absl::Mutex restart_mu_;
  std::optional<RollbackMarker> rollback_ ABSL_GUARDED_BY(restart_mu_);
  std::vector<std::thread> restarts_ ABSL_GUARDED_BY(restart_mu_);
  std::vector<int64_t> restored_steps_ ABSL_GUARDED_BY(restart_mu_);
  absl::Mutex writer_mu_;
  std::unique_ptr<CheckpointWriter> writer_ ABSL_GUARDED_BY(writer_mu_);
  std::atomic<int64_t> kill_at_{-1};
  std::atomic<uint64_t> recoveries_{0};
};

// Shard `shard`'s calls, to whichever of its lives is up; UNAVAILABLE (a refused connection,
// which PsClient retries) while none is.
class SupervisedChannel final : public ShardChannel {
 public:
  explicit SupervisedChannel(Supervised* shard)
      : shard_(shard), address_(absl::StrCat("in-process shard ", shard->shard_id())) {}

  void Register(const RegisterRequest& request, RegisterResponse* response,
                const CallOptions& options, Done done) override {
    With(&done, [&](ShardChannel* c) { c->Register(request, response, options, done); });
  }
  void Rollback(const RollbackRequest& request, RollbackResponse* response,
                const CallOptions& options, Done done) override {
    With(&done, [&](ShardChannel* c) { c->Rollback(request, response, options, done); });
  }
  void Heartbeat(const HeartbeatRequest& request, HeartbeatResponse* response,
                 const CallOptions& options, Done done) override {
    With(&done, [&](ShardChannel* c) { c->Heartbeat(request, response, options, done); });
  }
  void Finish(const FinishRequest& request, FinishResponse* response, const CallOptions& options,
              Done done) override {
    With(&done, [&](ShardChannel* c) { c->Finish(request, response, options, done); });
  }
  void Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
            const CallOptions& options, Done done) override {
    absl::StatusOr<std::shared_ptr<ReceivedPush>> received = ReceivePush(*request);
    if (received.ok() && shard_->KillsAt((*received)->push.step)) {
      done(absl::UnavailableError(absl::StrCat(address_, ": connection reset (killed)")));
      return;
    }
    With(&done, [&](ShardChannel* c) { c->Push(request, response, options, done); });
  }
  void Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response, PullSink* sink,
            const CallOptions& options, Done done) override {
    With(&done, [&](ShardChannel* c) { c->Pull(request, response, sink, options, done); });
  }
  const std::string& address() const override { return address_; }
  std::string Diagnose() const override { return "a supervised shard in this process"; }

 private:
  template <typename Call>
  void With(Done* done, Call call) {
    const std::shared_ptr<ParameterShard> shard = shard_->Up();
    if (shard == nullptr) {
      (*done)(absl::UnavailableError(absl::StrCat(address_, ": connection refused (down)")));
      return;
    }
    InProcessShardChannel channel(shard.get(), address_);
    call(&channel);
  }

  Supervised* const shard_;
  const std::string address_;
};

struct Outcome {
  std::vector<std::vector<std::vector<float>>> params;  // By worker.
  std::vector<TrainingResult> results;
  std::vector<int64_t> restored_steps;  // Of shard 1, then shard 0.
};

// The job, with shard 1 killed at the first push of `kill_step` (none if < 0).
Outcome RunJob(ConsistencyMode mode, int64_t kill_step, const std::string& name) {
  const Dataset train = SyntheticDataset(512, 1);
  const Dataset test = SyntheticDataset(128, 2);
  const ModelSpec spec = MlpModelSpec(*ParseMlpLayers("8-16-3"));
  ClusterSpec cluster;
  cluster.set_num_workers(kWorkers);
  cluster.mutable_consistency()->set_mode(mode);
  if (mode == SSP) cluster.mutable_consistency()->set_staleness(1);
  cluster.mutable_optimizer()->set_type("sgd");
  cluster.mutable_optimizer()->set_learning_rate(0.1);
  cluster.mutable_optimizer()->set_momentum(0.9);
  cluster.set_lease_ms(60000);
  cluster.set_wait_timeout_ms(60000);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/kill_points_", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<Supervised>> shards;
  for (int s = 0; s < kShards; ++s) {
    ShardOptions o;
    o.shard_id = s;
    o.num_shards = kShards;
    o.cluster = cluster;
    shards.push_back(std::make_unique<Supervised>(o, dir));
    shards.back()->Start();
    if (::testing::Test::HasFatalFailure()) return {};
  }
  if (kill_step >= 0) shards[1]->KillAtStep(kill_step);

  Outcome out;
  out.params.resize(kWorkers);
  out.results.resize(kWorkers);
  std::vector<std::string> errors(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      PsClientOptions options = InProcessClientOptions(spec, cluster, w, kSteps);
      options.retry_timeout = absl::Seconds(30);
      options.connect_timeout = absl::Seconds(30);
      options.rpc_timeout = absl::Seconds(90);
      std::vector<std::unique_ptr<ShardChannel>> channels;
      for (auto& s : shards) channels.push_back(std::make_unique<SupervisedChannel>(s.get()));
      TrainingOptions t;
      t.steps = kSteps;
      t.log_every = 1000;
      t.rewind_on_rejoin = mode == BSP;
      absl::StatusOr<WorkerRun> run =
          RunInProcessWorker(options, std::move(channels), spec, train, test, t);
      if (!run.ok()) {
        errors[w] = run.status().ToString();
        return;
      }
      out.results[w] = run->result;
      out.params[w] = std::move(run->params);
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) EXPECT_EQ(errors[w], "") << name << ": worker " << w;
  out.restored_steps = shards[1]->restored_steps();
  for (int64_t s : shards[0]->restored_steps()) out.restored_steps.push_back(s);
  return out;
}

TEST(KillPointsTest, BspRecoversBitIdenticallyFromAKillAtEveryStepAroundItsCheckpoints) {
  const Outcome reference = RunJob(BSP, -1, "bsp_reference");
  ASSERT_EQ(reference.params[0].size(), 4u);
  EXPECT_TRUE(reference.restored_steps.empty());
  for (int64_t kill : {0, 1, 3, 4, 5, 7, 8, 9, 12}) {
    SCOPED_TRACE(absl::StrCat("killed at step ", kill));
    const Outcome killed = RunJob(BSP, kill, absl::StrCat("bsp_", kill));
    // Shard 1 came back from its newest checkpoint at or before the kill, and shard 0 rolled back
    // to the same step.
    // (Further back, and more restarts, where a checkpoint writer skipped the step to keep up.)
    ASSERT_GE(killed.restored_steps.size(), 2u);
    for (int64_t restored : killed.restored_steps) {
      EXPECT_EQ(restored % kCheckpointEvery, 0);
      EXPECT_LE(restored, kill);
    }
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_GE(killed.results[w].rejoins, 1) << "worker " << w;
      ASSERT_EQ(killed.params[w].size(), reference.params[w].size());
      for (size_t t = 0; t < reference.params[w].size(); ++t) {
        EXPECT_EQ(killed.params[w][t], reference.params[w][t]) << "worker " << w << " tensor " << t;
      }
    }
  }
}

TEST(KillPointsTest, SspRunsToItsEndAfterAKillAtEveryStepAroundItsCheckpoints) {
  for (int64_t kill : {1, 3, 4, 5, 8}) {
    SCOPED_TRACE(absl::StrCat("killed at step ", kill));
    const Outcome killed = RunJob(SSP, kill, absl::StrCat("ssp_", kill));
    ASSERT_EQ(killed.restored_steps.size(), 1u) << "ssp rolls no other shard back";
    // Its newest checkpoint on disk: of a multiple of 4 that every worker's pushes had reached (a
    // worker may be a step ahead of the other, and a writer behind may have skipped one).
    const int64_t checkpoint = killed.restored_steps[0];
    EXPECT_EQ(checkpoint % kCheckpointEvery, 0);
    EXPECT_LE(checkpoint, kill);
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_EQ(killed.results[w].steps, kSteps) << "worker " << w;
      EXPECT_GE(killed.results[w].rejoins, 1) << "worker " << w;
    }
  }
}

}  // namespace
}  // namespace rubato
