// rubato_server: one parameter-server shard.
//
//   rubato_server --shard_id=0 --num_shards=1 --listen=127.0.0.1:0 --port_file=/tmp/s0.port
//                 --num_workers=2 --mode=bsp --learning_rate=0.1
//
// With --listen port 0 the kernel picks a free port; the chosen host:port is written to --port_file
// (atomically, by rename) once the server accepts connections.
//
// Life cycle: the server ends by itself once the job is over (ParameterShard::JobFinished): every
// worker has finished, or the rest were dropped and did not come back within one lease. It then
// prints its final statistics as one JSON line on stdout ({"event":"stats",...}, a stats record of
// proto/progress.proto; also written to --stats_file if given) and exits 0. No worker live for
// --idle_timeout_ms and none finished: exit 1 naming the workers. SIGINT or SIGTERM before the job
// is over (an eviction, a drain, a pod deleted): the same orderly shutdown and final statistics,
// then exit 128 + the signal's number (130, 143), as a shell reports a process the signal killed,
// so that a supervisor (Kubernetes, the launcher) sees a shard that did not finish and starts it
// again from its checkpoints; a signal after the job is over changes nothing (exit 0). Every port serves the gRPC health service (SERVING until shutdown),
// and --health_listen adds a plaintext port that serves only that, for probes. A bsp or backup
// shard that agreed to roll back (ParameterShard::Rollback) exits 75 (kExitRollback) to be started
// again by its supervisor.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/cluster_flags.h"
#include "common/cluster_spec.h"
#include "common/grpc_options.h"
#include "common/health.h"
#include "common/log.h"
#include "common/malloc_tuning.h"
#include "common/parse_flags.h"
#include "common/net_diagnose.h"
#include "common/optimizer.h"
#include "common/progress_writer.h"
#include "common/security.h"
#include "common/security_flags.h"
#include "common/status_macros.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/progress.pb.h"
#include "server/checkpoint.h"
#include "server/checkpoint_writer.h"
#include "server/data_plane.h"
#include "server/parameter_service.h"
#include "server/parameter_shard.h"

ABSL_FLAG(int, shard_id, 0, "This server's shard index in [0, num_shards).");
ABSL_FLAG(int, num_shards, 0, "Number of shards (default: the number of --servers, else 1).");
ABSL_FLAG(std::string, listen, "",
          "host:port to listen on; port 0 picks a free one (default: servers[shard_id], "
          "else 127.0.0.1:0).");
ABSL_FLAG(std::string, port_file, "", "Write the bound host:port here once serving.");
ABSL_FLAG(std::string, stats_file, "",
          "At shutdown, write the shard's final GetStats as JSON here (for ./rubato launch).");
ABSL_FLAG(std::string, health_listen, "",
          "Also serve the gRPC health service, and nothing else, in plaintext on this host:port "
          "(for Kubernetes probes when the main port uses TLS).");
ABSL_FLAG(int64_t, idle_timeout_ms, 600000,
          "Exit with an error when no worker has been live (registered and heard from within its "
          "lease) for this long and none has finished: workers that never came, or all died.");
ABSL_FLAG(int, update_threads, 1, "Threads that share the optimizer update of a large tensor.");
ABSL_FLAG(
    int, apply_threads, 2,
    "Threads that apply pushed gradients, different tensors in parallel, off gRPC's threads.");
ABSL_FLAG(double, noise_ema_decay, 0.95,
          "bsp, backup: decay in [0, 1) of the gradient noise scale's moving averages (about "
          "(1 + d) / (1 - d) steps averaged; server/noise_scale.h).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Write checkpoints of this shard here (created if missing), and at start restore the "
          "newest one that reads back whole, passing over damaged ones (server/checkpoint.h).");
ABSL_FLAG(int64_t, checkpoint_every_steps, 100,
          "With --checkpoint_dir: checkpoint every this many job steps.");
ABSL_FLAG(int, checkpoint_keep, 3, "With --checkpoint_dir: keep this many newest checkpoints.");
ABSL_FLAG(int64_t, restore_step, -1,
          "With --checkpoint_dir: restore the checkpoint of exactly this step rather than the "
          "newest (to bring the shards of a bsp job to a common step).");
ABSL_FLAG(int64_t, push_budget_mb, 32,
          "bsp: what all the workers together should have in flight to this shard; tensors "
          "larger than each worker's share / 2 are pushed in parts (1 to 8 MiB).");
ABSL_FLAG(int64_t, memory_budget_mb, 0,
          "Cap on the memory gRPC may use for connections and calls in flight, in MiB (a "
          "grpc::ResourceQuota). 0: 4 x --max_message_mb + 256.");
ABSL_FLAG(int32_t, data_port, 0,
          "The port of this shard's plain-TCP data plane for Push and Pull (server/data_plane.h), "
          "on the host of --listen; 0 picks a free one, -1 turns it off (workers then use gRPC). "
          "Workers authenticate on it with their job token; with --tls_cert it is TLS, with the "
          "same certificates as gRPC. Fix it where a firewall must let it through.");

namespace {

// The exit status of a shard that stops to roll back (EX_TEMPFAIL: start it again).
constexpr int kExitRollback = 75;

volatile std::sig_atomic_t g_signal = 0;
extern "C" void OnSignal(int sig) { g_signal = sig; }

int Fail(const std::string& message, int code = 2) {
  std::fprintf(stderr, "rubato_server: error: %s\n", message.c_str());
  return code;
}

// What the flags say, checked (every error names its flag).
struct ServerConfig {
  rubato::ClusterSpec spec;
  int shard_id = 0;
  int num_shards = 1;
  std::string listen;
  std::string health_listen;
  absl::Duration idle_timeout;
  int data_port = 0;
  int64_t memory_budget = 0;
  std::string checkpoint_dir;  // Empty: no checkpoints.
  int64_t checkpoint_every = 0;
  int checkpoint_keep = 0;
  int64_t restore_step = -1;
  rubato::ShardOptions options;  // Without the checkpoint hooks (Checkpoints::Install).
};

absl::Status CheckCheckpointFlags(const ServerConfig& c) {
  if (!c.checkpoint_dir.empty() && c.spec.adaptive_batch().max_global_batch() > 0) {
    // A checkpoint does not record the batch plan, so a restored job would draw other examples.
    return absl::InvalidArgumentError(
        "--checkpoint_dir cannot be used with --adaptive_batch (checkpoints do not keep "
        "the batch plan)");
  }
  if (c.checkpoint_dir.empty()) {
    if (c.restore_step >= 0) {
      return absl::InvalidArgumentError("--restore_step needs --checkpoint_dir");
    }
    return absl::OkStatus();
  }
  if (c.checkpoint_every < 1) {
    return absl::InvalidArgumentError("--checkpoint_every_steps must be >= 1");
  }
  if (c.checkpoint_keep < 1) return absl::InvalidArgumentError("--checkpoint_keep must be >= 1");
  std::error_code error;
  std::filesystem::create_directories(c.checkpoint_dir, error);
  if (error || access(c.checkpoint_dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--checkpoint_dir ", c.checkpoint_dir,
                                                   " cannot be created or is not writable",
                                                   error ? ": " + error.message() : ""));
  }
  return absl::OkStatus();
}

absl::Status ShardOptionsFromFlags(ServerConfig* c) {
  rubato::ShardOptions& options = c->options;
  options.shard_id = c->shard_id;
  options.num_shards = c->num_shards;
  options.cluster = c->spec;
  options.update_threads = absl::GetFlag(FLAGS_update_threads);
  options.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  const int64_t push_budget_mb = absl::GetFlag(FLAGS_push_budget_mb);
  if (push_budget_mb < 1 || push_budget_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--push_budget_mb must be in [1, 2^20], got ", push_budget_mb));
  }
  options.push_budget_bytes = push_budget_mb << 20;
  options.noise_ema_decay = absl::GetFlag(FLAGS_noise_ema_decay);
  if (!(options.noise_ema_decay >= 0 && options.noise_ema_decay < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--noise_ema_decay must be in [0, 1), got ", options.noise_ema_decay));
  }
  if (!c->checkpoint_dir.empty()) options.checkpoint_every_steps = c->checkpoint_every;
  return absl::OkStatus();
}

absl::StatusOr<ServerConfig> ConfigFromFlags(const rubato::ServerSecurity& security) {
  ServerConfig c;
  ASSIGN_OR_RETURN(c.spec, rubato::ClusterSpecFromFlags(/*need_servers=*/false));
  c.shard_id = absl::GetFlag(FLAGS_shard_id);
  c.num_shards = absl::GetFlag(FLAGS_num_shards);
  if (c.num_shards == 0) c.num_shards = c.spec.servers_size() > 0 ? c.spec.servers_size() : 1;
  c.listen = absl::GetFlag(FLAGS_listen);
  if (c.listen.empty()) {
    c.listen = c.shard_id >= 0 && c.shard_id < c.spec.servers_size() ? c.spec.servers(c.shard_id)
                                                                     : "127.0.0.1:0";
  }
  RETURN_IF_ERROR(rubato::ValidateHostPort(c.listen, "--listen"));
  RETURN_IF_ERROR(security.CheckListenAddress(c.listen));
  c.idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_idle_timeout_ms));
  if (c.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--idle_timeout_ms must be > 0");
  }
  c.health_listen = absl::GetFlag(FLAGS_health_listen);
  if (!c.health_listen.empty()) {
    RETURN_IF_ERROR(rubato::ValidateHostPort(c.health_listen, "--health_listen"));
  }
  c.data_port = absl::GetFlag(FLAGS_data_port);
  if (c.data_port < -1 || c.data_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_port=", c.data_port, " is not -1 (off), 0 (any) or a port"));
  }
  c.memory_budget = absl::GetFlag(FLAGS_memory_budget_mb) << 20;
  if (c.memory_budget < 0) return absl::InvalidArgumentError("--memory_budget_mb must be >= 0");
  if (c.memory_budget == 0) {
    c.memory_budget = 4 * rubato::MaxMessageBytes(c.spec) + (int64_t{256} << 20);
  }
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  c.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every_steps);
  c.checkpoint_keep = absl::GetFlag(FLAGS_checkpoint_keep);
  c.restore_step = absl::GetFlag(FLAGS_restore_step);
  RETURN_IF_ERROR(CheckCheckpointFlags(c));
  RETURN_IF_ERROR(ShardOptionsFromFlags(&c));
  return c;
}

// The shard's checkpoints (--checkpoint_dir): the writer that captures go to, the restore at
// start, and the roll-backs this shard agrees to (bsp, backup: ParameterShard::Rollback). A
// roll-back is recorded in the checkpoint directory; the main loop then ends and the server exits
// with kExitRollback, so that its supervisor starts it again, restoring that step as that
// recovery. Without --checkpoint_dir it does nothing.
class Checkpoints {
 public:
  explicit Checkpoints(const ServerConfig& config) : config_(config) {}

  // The shard's capture and roll-back hooks. The writer is created after the shard (it needs the
  // shard's CheckpointProto), so captures go through writer_, set before any worker can register
  // and cleared before the writer goes.
  void Install(rubato::ShardOptions* options) {
    if (config_.checkpoint_dir.empty()) return;
    options->on_checkpoint = [this](std::shared_ptr<const rubato::CapturedCheckpoint> c) {
      absl::MutexLock lock(&writer_mu_);
      if (writer_ != nullptr) writer_->Submit(std::move(c));
    };
    options->on_rollback = [this](int64_t step, uint64_t id) { return AgreeToRollback(step, id); };
  }

  // Restores the newest checkpoint (or the one a roll-back or --restore_step names) and starts
  // the writer.
  absl::Status RestoreAndStart(rubato::ParameterShard* shard) {
    if (config_.checkpoint_dir.empty()) return absl::OkStatus();
    const std::string& dir = config_.checkpoint_dir;
    ASSIGN_OR_RETURN(const int stale, rubato::RemoveStaleTemporaries(dir, config_.shard_id));
    if (stale > 0) {
      RUBATO_LOG(INFO) << "removed " << stale << " unfinished checkpoint write(s) of shard "
                       << config_.shard_id << " from " << dir;
    }
    absl::StatusOr<std::optional<rubato::RollbackMarker>> marker =
        rubato::ReadRollbackMarker(dir, config_.shard_id);
    if (!marker.ok()) {
      return absl::Status(marker.status().code(),
                          absl::StrCat(marker.status().message(),
                                       " (remove it to restore the newest checkpoint instead)"));
    }
    RETURN_IF_ERROR(Restore(shard, *marker));
    rubato::ParameterShard* raw = shard;
    auto writer = std::make_unique<rubato::CheckpointWriter>(
        dir, config_.checkpoint_keep,
        [raw](const rubato::CapturedCheckpoint& c) { return raw->CheckpointProto(c); });
    absl::MutexLock lock(&writer_mu_);
    writer_ = std::move(writer);
    RUBATO_LOG(INFO) << "checkpoints every " << config_.checkpoint_every << " steps into " << dir
                     << ", keeping " << config_.checkpoint_keep;
    return absl::OkStatus();
  }

  bool RollingBack() {
    absl::MutexLock lock(&rollback_mu_);
    return rollback_.has_value();
  }

  // Waits up to 30 s for the last checkpoint to be written, then stops the writer.
  void Finish() {
    rubato::CheckpointWriter* writer;
    {
      absl::MutexLock lock(&writer_mu_);
      writer = writer_.get();
    }
    if (writer != nullptr && !writer->Idle(absl::Seconds(30))) {
      RUBATO_LOG(ERROR) << "the last checkpoint was still being written after 30 s";
    }
  }
  void StopWriter() {
    std::unique_ptr<rubato::CheckpointWriter> writer;
    {
      absl::MutexLock lock(&writer_mu_);
      writer = std::move(writer_);
    }
    writer.reset();
  }

 private:
  absl::Status Restore(rubato::ParameterShard* shard,
                       const std::optional<rubato::RollbackMarker>& marker) {
    const std::string& dir = config_.checkpoint_dir;
    const int shard_id = config_.shard_id;
    std::optional<int64_t> step;
    if (marker.has_value()) {
      step = marker->step;
      if (config_.restore_step >= 0 && config_.restore_step != *step) {
        RUBATO_LOG(WARNING) << "--restore_step=" << config_.restore_step << " ignored: this shard "
                            << "is rolling back to step " << *step << " ("
                            << rubato::RollbackMarkerPath(dir, shard_id) << ")";
      }
    } else if (config_.restore_step >= 0) {
      step = config_.restore_step;
    }
    ASSIGN_OR_RETURN(std::optional<rubato::LoadedCheckpoint> loaded,
                     rubato::LoadNewestCheckpoint(dir, shard_id, step));
    if (!loaded.has_value()) {
      if (step.has_value()) {
        return absl::NotFoundError(
            absl::StrCat(marker.has_value() ? "roll-back to step " : "--restore_step=", *step,
                         ": no checkpoint of shard ", shard_id, " at that step in ", dir));
      }
      RUBATO_LOG(INFO) << "no checkpoint of shard " << shard_id << " in " << dir
                       << ": starting afresh";
      return absl::OkStatus();
    }
    for (const std::string& why : loaded->skipped) {
      RUBATO_LOG(WARNING) << "checkpoint passed over: " << why;
    }
    if (absl::Status s = shard->Restore(loaded->checkpoint); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("cannot restore ", loaded->path, ": ", s.message()));
    }
    // Every restore starts a recovery of its own, unless it is the roll-back of one.
    uint64_t recovery = marker.has_value() ? marker->recovery_id : 0;
    std::random_device random;
    while (recovery == 0) recovery = (uint64_t{random()} << 32) | random();
    shard->SetRecoveryId(recovery);
    if (marker.has_value()) RETURN_IF_ERROR(rubato::FinishRollback(dir, shard_id, *step));
    RUBATO_LOG(INFO) << "restored shard " << shard_id << " from " << loaded->path << ": step "
                     << loaded->checkpoint.step() << " (recovery "
                     << absl::StrCat(absl::Hex(recovery))
                     << (marker.has_value() ? ", a roll-back" : "")
                     << "); workers go on from there";
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> AgreeToRollback(int64_t step, uint64_t id) {
    const int shard_id = config_.shard_id;
    absl::MutexLock lock(&rollback_mu_);
    if (rollback_.has_value()) {
      if (rollback_->recovery_id == id) return step;
      // Its restarted self will answer this one (a worker found a shard without that step's
      // checkpoint and moved the recovery further back): retried, as a restart is.
      return absl::UnavailableError(
          absl::StrCat("shard ", shard_id, " is restarting already, to roll back to step ",
                       rollback_->step, " for another recovery; ask again once it is back"));
    }
    // The capture of `step` may be taken but not on disk yet: the writer runs at nice 10 and lags
    // under load (a stress run saw "no checkpoint of step 60" on a shard at step 62). Wait for it,
    // as Finish does, without writer_mu_ (on_checkpoint takes it on the update path).
    rubato::CheckpointWriter* writer;
    {
      absl::MutexLock writer_lock(&writer_mu_);
      writer = writer_.get();
    }
    if (writer != nullptr && !writer->Idle(absl::Seconds(30))) {
      RUBATO_LOG(WARNING) << "roll-back to step " << step
                          << ": a checkpoint was still being written after 30 s";
    }
    absl::StatusOr<std::optional<rubato::LoadedCheckpoint>> loaded =
        rubato::LoadNewestCheckpoint(config_.checkpoint_dir, shard_id, step);
    if (!loaded.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("shard ", shard_id,
                                                        " cannot roll back to step ", step, ": ",
                                                        loaded.status().message()));
    }
    if (!loaded->has_value()) {
      // Skipped by the writer (or pruned): the newest before it, for the worker to pick a step
      // every shard has.
      ASSIGN_OR_RETURN(
          const int64_t before,
          rubato::NewestCheckpointStepAtMost(config_.checkpoint_dir, shard_id, step - 1));
      RUBATO_LOG(WARNING) << "asked to roll back to step " << step << ": no checkpoint of it in "
                          << config_.checkpoint_dir << "; the newest before it is "
                          << (before < 0 ? std::string("none") : absl::StrCat("of step ", before));
      return before;
    }
    RETURN_IF_ERROR(rubato::WriteRollbackMarker(config_.checkpoint_dir, shard_id,
                                                rubato::RollbackMarker{step, id}));
    rollback_ = rubato::RollbackMarker{step, id};
    RUBATO_LOG(WARNING) << "rolling back to step " << step << " (recovery "
                        << absl::StrCat(absl::Hex(id))
                        << "): another shard was restored from that checkpoint; exiting with "
                        << kExitRollback << " so that this shard is started again from it";
    return step;
  }

  const ServerConfig& config_;
  absl::Mutex writer_mu_;
  std::unique_ptr<rubato::CheckpointWriter> writer_ ABSL_GUARDED_BY(writer_mu_);
  absl::Mutex rollback_mu_;
  std::optional<rubato::RollbackMarker> rollback_ ABSL_GUARDED_BY(rollback_mu_);
};

// The shard's network front: its gRPC service, the plain-TCP data plane beside it, and the
// health service (on every port, and alone on --health_listen).
class Front {
 public:
  Front(rubato::ParameterShard* shard, const rubato::ServerSecurity& security)
      : service_(shard, security), health_service_({"rubato.ParameterServer"}) {}

  absl::Status Start(const ServerConfig& c, rubato::ParameterShard* shard,
                     const rubato::ServerSecurity& security) {
    // Why it cannot listen, told apart before gRPC tries (and logs its own dump).
    if (const std::string why = rubato::DiagnoseListen(c.listen); !why.empty()) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", c.listen, " (--listen): ",
                                                 why));
    }
    grpc::ServerBuilder builder;
    rubato::ConfigureServerBuilder(&builder, rubato::MaxMessageBytes(c.spec),
                                   rubato::kServerStreamWindowBytes);
    rubato::SetServerMemoryBudget(&builder, c.memory_budget);
    int port = 0;
    builder.AddListeningPort(c.listen, security.credentials(), &port);
    service_.LimitReads(c.memory_budget, rubato::MaxMessageBytes(c.spec));
    service_.AddTo(&builder);
    builder.RegisterService(&health_service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", c.listen, " (--listen): gRPC could not bind it (see its log)"));
    }
    bound_ = absl::StrCat(c.listen.substr(0, c.listen.rfind(':')), ":", port);
    if (c.data_port >= 0) RETURN_IF_ERROR(StartDataPlane(c, shard, security));
    if (!c.health_listen.empty()) {
      ASSIGN_OR_RETURN(health_, rubato::StartHealthServer(c.health_listen, &health_service_));
      RUBATO_LOG(INFO) << "health service (plaintext, health only) on " << c.health_listen;
    }
    return absl::OkStatus();
  }

  const std::string& bound() const { return bound_; }

  // Stops serving: health first, then (once the shard has answered its parked pulls) the data
  // plane, whose connections' threads end with them, and the gRPC server within 5 s.
  void StopServingHealth() { health_service_.SetServing(false); }
  void Stop() {
    data_plane_.reset();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }
    if (health_ != nullptr) health_->Shutdown(std::chrono::system_clock::now());
  }

 private:
  absl::Status StartDataPlane(const ServerConfig& c, rubato::ParameterShard* shard,
                              const rubato::ServerSecurity& security) {
    rubato::DataPlaneOptions options;
    std::string host, ignored;
    rubato::SplitHostPort(c.listen, &host, &ignored);
    options.host = host;
    options.port = c.data_port;
    options.max_message_bytes = rubato::MaxMessageBytes(c.spec);
    options.memory_budget_bytes = c.memory_budget;
    options.num_workers = c.spec.num_workers();
    ASSIGN_OR_RETURN(data_plane_, rubato::DataPlaneServer::Start(options, shard, security));
    service_.set_data_port(data_plane_->port());
    RUBATO_LOG(INFO) << "Push and Pull data plane ("
                     << (security.encrypts() ? security.Describe()
                                             : std::string("plain TCP, workers authenticated "
                                                           "as on gRPC"))
                     << ") on " << (host.empty() ? std::string("*") : host) << ":"
                     << data_plane_->port();
    return absl::OkStatus();
  }

  rubato::ParameterService service_;
  rubato::HealthService health_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<rubato::DataPlaneServer> data_plane_;
  std::unique_ptr<grpc::Server> health_;
  std::string bound_;
};

void LogServing(const ServerConfig& c, const std::string& bound,
                const rubato::ServerSecurity& security) {
  RUBATO_LOG(INFO) << "shard " << c.shard_id << "/" << c.num_shards << " serving on " << bound
                   << ": " << c.spec.num_workers() << " workers, mode "
                   << rubato::FormatConsistency(c.spec.consistency()) << ", wait timeout "
                   << c.spec.wait_timeout_ms() << " ms; " << security.Describe()
                   << "; messages up to " << (rubato::MaxMessageBytes(c.spec) >> 20)
                   << " MiB, gRPC memory budget " << (c.memory_budget >> 20) << " MiB";
  if (auto config = rubato::CompleteOptimizerConfig(c.spec.optimizer()); config.ok()) {
    RUBATO_LOG(INFO) << "optimizer { " << config->ShortDebugString() << " }; lr_schedule { "
                     << c.spec.lr_schedule().ShortDebugString()
                     << " } (the effective schedule is logged once every worker has registered)";
  }
}

absl::Status WritePortFile(const std::string& bound) {
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (port_file.empty()) return absl::OkStatus();
  const std::string tmp = port_file + ".tmp";
  std::ofstream(tmp) << bound << "\n";
  if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write --port_file ", port_file));
  }
  return absl::OkStatus();
}

// Serves until the job is over, a signal arrives or the shard agreed to roll back; returns why
// the job ended without finishing (an idle timeout), OK otherwise, and sets *job_over when every
// worker has finished or was dropped.
absl::Status ServeUntilTheEnd(rubato::ParameterShard* shard, absl::Duration idle_timeout,
                              Checkpoints* checkpoints, bool* job_over) {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Freed memory is kept for reuse (KeepFreedMemory); give it back now and then, so that a burst
  // of large messages does not leave the server's resident size at its peak.
  absl::Time next_trim = absl::Now();
  while (g_signal == 0) {
    absl::SleepFor(absl::Milliseconds(50));
    absl::StatusOr<bool> finished = shard->JobFinished(idle_timeout);
    if (!finished.ok()) return finished.status();
    *job_over = *finished;
    if (*finished || checkpoints->RollingBack()) break;
    if (absl::Now() >= next_trim) {
      rubato::ReturnFreedMemory();
      next_trim = absl::Now() + absl::Seconds(5);
    }
  }
  return absl::OkStatus();
}

// Prints the final statistics line (a stats record, proto/progress.proto), and writes it to
// --stats_file.
void ReportStats(const rubato::GetStatsResponse& stats) {
  rubato::ProgressRecord record;
  *record.mutable_stats() = stats;
  const std::string json = rubato::ProgressLine(record);
  std::cout << json << std::endl;
  if (const std::string path = absl::GetFlag(FLAGS_stats_file); !path.empty()) {
    if (absl::Status made = rubato::MakeParentDirectory(path); !made.ok()) {
      RUBATO_LOG(ERROR) << "--stats_file: " << made;
    } else if (!(std::ofstream(path) << json << "\n")) {
      RUBATO_LOG(ERROR) << "cannot write --stats_file " << path;
    }
  }
  RUBATO_LOG(INFO) << "done: " << stats.applied_updates() << " tensor updates, " << stats.pushes()
                   << " pushes, " << stats.rejected_pushes() << " rejected, min version "
                   << stats.min_version() << ", " << stats.finished_workers() << " of "
                   << stats.num_workers() << " workers finished";
}

}  // namespace

int main(int argc, char** argv) {
  rubato::UseGrpcExperiments();  // Before anything of gRPC's runs.
  absl::SetProgramUsageMessage(
      "One Rubato parameter-server shard. Its flags: docs/flags.md (or --helpfull).");
  std::vector<char*> rest = rubato::ParseFlagsOrExit(argc, argv);
  rubato::KeepFreedMemory();  // Tensor-sized buffers every step: reuse them, do not re-fault them.
  rubato::SkipMutexDeadlockDetection();
  if (rest.size() > 1) return Fail(absl::StrCat("unexpected argument '", rest[1], "'"));
  rubato::SetLogTag(absl::StrCat("server-", absl::GetFlag(FLAGS_shard_id)));
  auto security = rubato::ServerSecurity::Create(rubato::SecurityConfigFromFlags());
  if (!security.ok()) return Fail(std::string(security.status().message()));
  absl::StatusOr<ServerConfig> config = ConfigFromFlags(*security);
  if (!config.ok()) return Fail(std::string(config.status().message()));

  Checkpoints checkpoints(*config);
  checkpoints.Install(&config->options);
  auto shard = rubato::ParameterShard::Create(config->options);
  if (!shard.ok()) return Fail(std::string(shard.status().message()));
  if (absl::Status s = checkpoints.RestoreAndStart(shard->get()); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  Front front(shard->get(), *security);
  absl::Status started = front.Start(*config, shard->get(), *security);
  if (started.ok()) {
    LogServing(*config, front.bound(), *security);
    started = WritePortFile(front.bound());
  }
  if (!started.ok()) {
    front.Stop();
    return Fail(std::string(started.message()));
  }

  bool job_over = false;
  const absl::Status ended =
      ServeUntilTheEnd(shard->get(), config->idle_timeout, &checkpoints, &job_over);
  const bool rolling_back = checkpoints.RollingBack();
  const int signalled = job_over ? 0 : g_signal;
  if (rolling_back) {
    RUBATO_LOG(INFO) << "shutting down to roll back (exit status " << kExitRollback << ")";
  } else if (signalled != 0) {
    RUBATO_LOG(WARNING) << "signal " << signalled << " before the job is over: shutting down "
                        << "(exit status " << 128 + signalled << ": this shard did not finish)";
  } else if (ended.ok()) {
    RUBATO_LOG(INFO) << "job over: every worker has finished or was dropped; shutting down";
  }
  front.StopServingHealth();
  checkpoints.Finish();
  const rubato::GetStatsResponse stats = (*shard)->Stats();
  // Answers parked pulls first, so that the server can drain. Rolling back, the shard comes back
  // at once; signalled before the job is over (an eviction, a drain), its supervisor starts it
  // again: either answer is one that workers retry (up to --retry_timeout_ms, which
  // --server_restart_timeout_s raises) until its restarted self answers. The job over: "shutting
  // down", which no worker retries.
  absl::Status why = absl::OkStatus();
  if (rolling_back) {
    why = absl::UnavailableError(absl::StrCat("parameter server shard ", config->shard_id,
                                              " is restarting to roll back"));
  } else if (signalled != 0) {
    why = absl::UnavailableError(absl::StrCat("parameter server shard ", config->shard_id,
                                              " was stopped by signal ", signalled,
                                              " before the job was over"));
  }
  (*shard)->Shutdown(why);
  front.Stop();
  checkpoints.StopWriter();
  ReportStats(stats);
  if (rolling_back) return kExitRollback;
  if (!ended.ok()) return Fail(std::string(ended.message()), 1);
  return signalled != 0 ? 128 + signalled : 0;
}
