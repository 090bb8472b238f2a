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
// prints its final statistics as one JSON line on stdout ({"event":"stats",...}, also written to
// --stats_file if given) and exits 0. No worker live for --idle_timeout_ms and none finished:
// exit 1 naming the workers. SIGINT or SIGTERM: the same final statistics, exit 0. Every port
// serves the gRPC health service (SERVING until shutdown), and --health_listen adds a plaintext
// port that serves only that, for probes. A bsp or backup shard that agreed to roll back
// (ParameterShard::Rollback) exits 75 (kExitRollback) to be started again by its supervisor.
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
#include "absl/flags/parse.h"
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
#include "common/net_diagnose.h"
#include "common/optimizer.h"
#include "common/security.h"
#include "common/security_flags.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
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
          "Workers authenticate on it with their job token; it is off with TLS, which it would "
          "bypass. Fix it where a firewall must let it through.");

namespace {

// The exit status of a shard that stops to roll back (EX_TEMPFAIL: start it again).
constexpr int kExitRollback = 75;

volatile std::sig_atomic_t g_signal = 0;
extern "C" void OnSignal(int sig) { g_signal = sig; }

int Fail(const std::string& message, int code = 2) {
  std::fprintf(stderr, "rubato_server: error: %s\n", message.c_str());
  return code;
}

// The shard's statistics as one line of JSON with "event":"stats" first.
std::string StatsJson(const rubato::GetStatsResponse& stats) {
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(stats, &json, print).ok() || json.size() < 2) {
    return "{\"event\":\"stats\"}";
  }
  return absl::StrCat("{\"event\":\"stats\",", json.substr(1));
}

}  // namespace

int main(int argc, char** argv) {
  rubato::UseGrpcExperiments();  // Before anything of gRPC's runs.
  absl::SetProgramUsageMessage(
      "One Rubato parameter-server shard. Its flags: docs/flags.md (or --helpfull).");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  rubato::KeepFreedMemory();  // Tensor-sized buffers every step: reuse them, do not re-fault them.
  rubato::SkipMutexDeadlockDetection();
  if (rest.size() > 1) return Fail(absl::StrCat("unexpected argument '", rest[1], "'"));

  auto spec = rubato::ClusterSpecFromFlags(/*need_servers=*/false);
  if (!spec.ok()) return Fail(std::string(spec.status().message()));
  const int shard_id = absl::GetFlag(FLAGS_shard_id);
  int num_shards = absl::GetFlag(FLAGS_num_shards);
  if (num_shards == 0) num_shards = spec->servers_size() > 0 ? spec->servers_size() : 1;
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) {
    listen =
        shard_id >= 0 && shard_id < spec->servers_size() ? spec->servers(shard_id) : "127.0.0.1:0";
  }
  if (auto s = rubato::ValidateHostPort(listen, "--listen"); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  rubato::SetLogTag(absl::StrCat("server-", shard_id));
  auto security = rubato::ServerSecurity::Create(rubato::SecurityConfigFromFlags());
  if (!security.ok()) return Fail(std::string(security.status().message()));
  if (auto s = security->CheckListenAddress(listen); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  const absl::Duration idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_idle_timeout_ms));
  if (idle_timeout <= absl::ZeroDuration()) return Fail("--idle_timeout_ms must be > 0");
  const std::string health_listen = absl::GetFlag(FLAGS_health_listen);
  if (!health_listen.empty()) {
    if (auto s = rubato::ValidateHostPort(health_listen, "--health_listen"); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  }
  const int data_port = absl::GetFlag(FLAGS_data_port);
  if (data_port < -1 || data_port > 65535) {
    return Fail(absl::StrCat("--data_port=", data_port, " is not -1 (off), 0 (any) or a port"));
  }
  int64_t memory_budget = absl::GetFlag(FLAGS_memory_budget_mb) << 20;
  if (memory_budget < 0) return Fail("--memory_budget_mb must be >= 0");
  if (memory_budget == 0) memory_budget = 4 * rubato::MaxMessageBytes(*spec) + (int64_t{256} << 20);

  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  const int64_t checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every_steps);
  const int checkpoint_keep = absl::GetFlag(FLAGS_checkpoint_keep);
  const int64_t restore_step = absl::GetFlag(FLAGS_restore_step);
  if (!checkpoint_dir.empty() && spec->adaptive_batch().max_global_batch() > 0) {
    // A checkpoint does not record the batch plan, so a restored job would draw other examples.
    return Fail(
        "--checkpoint_dir cannot be used with --adaptive_batch (checkpoints do not keep "
        "the batch plan)");
  }
  if (!checkpoint_dir.empty()) {
    if (checkpoint_every < 1) return Fail("--checkpoint_every_steps must be >= 1");
    if (checkpoint_keep < 1) return Fail("--checkpoint_keep must be >= 1");
    std::error_code error;
    std::filesystem::create_directories(checkpoint_dir, error);
    if (error || access(checkpoint_dir.c_str(), W_OK) != 0) {
      return Fail(absl::StrCat("--checkpoint_dir ", checkpoint_dir,
                               " cannot be created or is not writable",
                               error ? ": " + error.message() : ""));
    }
  } else if (restore_step >= 0) {
    return Fail("--restore_step needs --checkpoint_dir");
  }

  rubato::ShardOptions options;
  options.shard_id = shard_id;
  options.num_shards = num_shards;
  options.cluster = *spec;
  options.update_threads = absl::GetFlag(FLAGS_update_threads);
  options.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  const int64_t push_budget_mb = absl::GetFlag(FLAGS_push_budget_mb);
  if (push_budget_mb < 1 || push_budget_mb > (int64_t{1} << 20)) {
    return Fail(absl::StrCat("--push_budget_mb must be in [1, 2^20], got ", push_budget_mb));
  }
  options.push_budget_bytes = push_budget_mb << 20;
  options.noise_ema_decay = absl::GetFlag(FLAGS_noise_ema_decay);
  if (!(options.noise_ema_decay >= 0 && options.noise_ema_decay < 1)) {
    return Fail(absl::StrCat("--noise_ema_decay must be in [0, 1), got ", options.noise_ema_decay));
  }
  // The writer is created after the shard (it needs the shard's CheckpointProto), so captures go
  // through this pointer, set before any worker can register and cleared before the writer goes.
  absl::Mutex writer_mu;
  rubato::CheckpointWriter* writer_ptr = nullptr;
  if (!checkpoint_dir.empty()) {
    options.checkpoint_every_steps = checkpoint_every;
    options.on_checkpoint = [&](std::shared_ptr<const rubato::CapturedCheckpoint> c) {
      absl::MutexLock lock(&writer_mu);
      if (writer_ptr != nullptr) writer_ptr->Submit(std::move(c));
    };
  }
  // A roll-back this shard agreed to (bsp, backup: ParameterShard::Rollback). It is recorded in
  // the checkpoint directory, the main loop then ends and the server exits with kExitRollback, so
  // that its supervisor starts it again, restoring that step as that recovery.
  absl::Mutex rollback_mu;
  std::optional<rubato::RollbackMarker> rollback;
  if (!checkpoint_dir.empty()) {
    options.on_rollback = [&](int64_t step, uint64_t id) -> absl::Status {
      absl::MutexLock lock(&rollback_mu);
      if (rollback.has_value()) {
        if (rollback->recovery_id == id) return absl::OkStatus();
        return absl::FailedPreconditionError(
            absl::StrCat("shard ", shard_id, " is restarting already, to roll back to step ",
                         rollback->step, " for another recovery"));
      }
      absl::StatusOr<std::optional<rubato::LoadedCheckpoint>> loaded =
          rubato::LoadNewestCheckpoint(checkpoint_dir, shard_id, step);
      if (!loaded.ok() || !loaded->has_value()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "shard ", shard_id, " cannot roll back to step ", step, ": ",
            !loaded.ok() ? loaded.status().message()
                         : absl::StrCat("it has no checkpoint of that step in ", checkpoint_dir,
                                        " (it keeps its newest --checkpoint_keep)")));
      }
      if (absl::Status w = rubato::WriteRollbackMarker(checkpoint_dir, shard_id,
                                                       rubato::RollbackMarker{step, id});
          !w.ok()) {
        return w;
      }
      rollback = rubato::RollbackMarker{step, id};
      RUBATO_LOG(WARNING) << "rolling back to step " << step << " (recovery "
                          << absl::StrCat(absl::Hex(id))
                          << "): another shard was restored from that checkpoint; exiting with "
                          << kExitRollback << " so that this shard is started again from it";
      return absl::OkStatus();
    };
  }
  auto shard = rubato::ParameterShard::Create(options);
  if (!shard.ok()) return Fail(std::string(shard.status().message()));
  std::unique_ptr<rubato::CheckpointWriter> writer;
  if (!checkpoint_dir.empty()) {
    absl::StatusOr<int> stale = rubato::RemoveStaleTemporaries(checkpoint_dir, shard_id);
    if (!stale.ok()) return Fail(std::string(stale.status().message()));
    if (*stale > 0) {
      RUBATO_LOG(INFO) << "removed " << *stale << " unfinished checkpoint write(s) of shard "
                       << shard_id << " from " << checkpoint_dir;
    }
    absl::StatusOr<std::optional<rubato::RollbackMarker>> marker =
        rubato::ReadRollbackMarker(checkpoint_dir, shard_id);
    if (!marker.ok()) {
      return Fail(absl::StrCat(marker.status().message(),
                               " (remove it to restore the newest checkpoint instead)"));
    }
    std::optional<int64_t> step;
    if (marker->has_value()) {
      step = (*marker)->step;
      if (restore_step >= 0 && restore_step != *step) {
        RUBATO_LOG(WARNING) << "--restore_step=" << restore_step << " ignored: this shard is "
                            << "rolling back to step " << *step << " ("
                            << rubato::RollbackMarkerPath(checkpoint_dir, shard_id) << ")";
      }
    } else if (restore_step >= 0) {
      step = restore_step;
    }
    absl::StatusOr<std::optional<rubato::LoadedCheckpoint>> loaded =
        rubato::LoadNewestCheckpoint(checkpoint_dir, shard_id, step);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    if (loaded->has_value()) {
      for (const std::string& why : (*loaded)->skipped) {
        RUBATO_LOG(WARNING) << "checkpoint passed over: " << why;
      }
      if (absl::Status s = (*shard)->Restore((*loaded)->checkpoint); !s.ok()) {
        return Fail(absl::StrCat("cannot restore ", (*loaded)->path, ": ", s.message()));
      }
      // Every restore starts a recovery of its own, unless it is the roll-back of one.
      uint64_t recovery = marker->has_value() ? (*marker)->recovery_id : 0;
      std::random_device random;
      while (recovery == 0) recovery = (uint64_t{random()} << 32) | random();
      (*shard)->SetRecoveryId(recovery);
      if (marker->has_value()) {
        if (absl::Status s = rubato::FinishRollback(checkpoint_dir, shard_id, *step); !s.ok()) {
          return Fail(std::string(s.message()));
        }
      }
      RUBATO_LOG(INFO) << "restored shard " << shard_id << " from " << (*loaded)->path << ": step "
                       << (*loaded)->checkpoint.step() << " (recovery "
                       << absl::StrCat(absl::Hex(recovery))
                       << (marker->has_value() ? ", a roll-back" : "")
                       << "); workers go on from there";
    } else if (step.has_value()) {
      return Fail(
          absl::StrCat(marker->has_value() ? "roll-back to step " : "--restore_step=", *step,
                       ": no checkpoint of shard ", shard_id, " at that step in ", checkpoint_dir));
    } else {
      RUBATO_LOG(INFO) << "no checkpoint of shard " << shard_id << " in " << checkpoint_dir
                       << ": starting afresh";
    }
    rubato::ParameterShard* raw = shard->get();
    writer = std::make_unique<rubato::CheckpointWriter>(
        checkpoint_dir, checkpoint_keep,
        [raw](const rubato::CapturedCheckpoint& c) { return raw->CheckpointProto(c); });
    absl::MutexLock lock(&writer_mu);
    writer_ptr = writer.get();
    RUBATO_LOG(INFO) << "checkpoints every " << checkpoint_every << " steps into " << checkpoint_dir
                     << ", keeping " << checkpoint_keep;
  }

  rubato::ParameterService service(shard->get(), *security);
  rubato::HealthService health_service({"rubato.ParameterServer"});
  grpc::ServerBuilder builder;
  rubato::ConfigureServerBuilder(&builder, rubato::MaxMessageBytes(*spec));
  rubato::SetServerMemoryBudget(&builder, memory_budget);
  int port = 0;
  builder.AddListeningPort(listen, security->credentials(), &port);
  builder.RegisterService(&service);
  builder.RegisterService(&health_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("cannot listen on ", listen,
                             ": the address is in use or not an address of this host"));
  }
  const std::string bound = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  std::unique_ptr<rubato::DataPlaneServer> data_plane;
  if (data_port >= 0 && !security->encrypts()) {
    rubato::DataPlaneOptions data_options;
    std::string host, ignored;
    rubato::SplitHostPort(listen, &host, &ignored);
    data_options.host = host;
    data_options.port = data_port;
    data_options.max_message_bytes = rubato::MaxMessageBytes(*spec);
    data_options.memory_budget_bytes = memory_budget;
    auto started = rubato::DataPlaneServer::Start(data_options, shard->get(), *security);
    if (!started.ok()) {
      server->Shutdown();
      return Fail(std::string(started.status().message()));
    }
    data_plane = std::move(*started);
    service.set_data_port(data_plane->port());
    RUBATO_LOG(INFO) << "Push and Pull data plane (plain TCP, workers authenticated as on gRPC) on "
                     << (host.empty() ? std::string("*") : host) << ":" << data_plane->port();
  } else if (data_port >= 0) {
    RUBATO_LOG(INFO) << "no plain-TCP data plane with TLS: Push and Pull stay on gRPC";
  }
  std::unique_ptr<grpc::Server> health;
  if (!health_listen.empty()) {
    auto started = rubato::StartHealthServer(health_listen, &health_service);
    if (!started.ok()) {
      server->Shutdown();
      return Fail(std::string(started.status().message()));
    }
    health = std::move(*started);
    RUBATO_LOG(INFO) << "health service (plaintext, health only) on " << health_listen;
  }
  RUBATO_LOG(INFO) << "shard " << shard_id << "/" << num_shards << " serving on " << bound << ": "
                   << spec->num_workers() << " workers, mode "
                   << rubato::FormatConsistency(spec->consistency()) << ", wait timeout "
                   << spec->wait_timeout_ms() << " ms; " << security->Describe()
                   << "; messages up to " << (rubato::MaxMessageBytes(*spec) >> 20)
                   << " MiB, gRPC memory budget " << (memory_budget >> 20) << " MiB";
  if (auto config = rubato::CompleteOptimizerConfig(spec->optimizer()); config.ok()) {
    RUBATO_LOG(INFO) << "optimizer { " << config->ShortDebugString() << " }; lr_schedule { "
                     << spec->lr_schedule().ShortDebugString()
                     << " } (the effective schedule is logged once every worker has registered)";
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      server->Shutdown();
      return Fail(absl::StrCat("cannot write --port_file ", port_file));
    }
  }

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Freed memory is kept for reuse (KeepFreedMemory); give it back now and then, so that a burst
  // of large messages does not leave the server's resident size at its peak.
  absl::Time next_trim = absl::Now();
  absl::Status ended;  // Why the job ended without finishing (idle timeout).
  while (g_signal == 0) {
    absl::SleepFor(absl::Milliseconds(50));
    absl::StatusOr<bool> finished = (*shard)->JobFinished(idle_timeout);
    if (!finished.ok()) {
      ended = finished.status();
      break;
    }
    if (*finished) break;
    {
      absl::MutexLock lock(&rollback_mu);
      if (rollback.has_value()) break;
    }
    if (absl::Now() >= next_trim) {
      rubato::ReturnFreedMemory();
      next_trim = absl::Now() + absl::Seconds(5);
    }
  }

  bool rolling_back;
  {
    absl::MutexLock lock(&rollback_mu);
    rolling_back = rollback.has_value();
  }
  if (rolling_back) {
    RUBATO_LOG(INFO) << "shutting down to roll back (exit status " << kExitRollback << ")";
  } else if (g_signal != 0) {
    RUBATO_LOG(INFO) << "signal " << g_signal << ": shutting down";
  } else if (ended.ok()) {
    RUBATO_LOG(INFO) << "job over: every worker has finished or was dropped; shutting down";
  }
  health_service.SetServing(false);
  if (writer != nullptr && !writer->Idle(absl::Seconds(30))) {
    RUBATO_LOG(ERROR) << "the last checkpoint was still being written after 30 s";
  }
  const rubato::GetStatsResponse stats = (*shard)->Stats();
  (*shard)->Shutdown();  // Answers parked pulls first, so that the server can drain.
  data_plane.reset();    // Its connections' threads end once their parked pulls are answered.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (health != nullptr) health->Shutdown(std::chrono::system_clock::now());
  {
    absl::MutexLock lock(&writer_mu);
    writer_ptr = nullptr;
  }
  writer.reset();
  const std::string json = StatsJson(stats);
  std::cout << json << std::endl;
  if (const std::string path = absl::GetFlag(FLAGS_stats_file); !path.empty()) {
    if (!(std::ofstream(path) << json << "\n")) {
      RUBATO_LOG(ERROR) << "cannot write --stats_file " << path;
    }
  }
  RUBATO_LOG(INFO) << "done: " << stats.applied_updates() << " tensor updates, " << stats.pushes()
                   << " pushes, " << stats.rejected_pushes() << " rejected, min version "
                   << stats.min_version() << ", " << stats.finished_workers() << " of "
                   << stats.num_workers() << " workers finished";
  if (rolling_back) return kExitRollback;
  if (!ended.ok()) return Fail(std::string(ended.message()), 1);
  return 0;
}
