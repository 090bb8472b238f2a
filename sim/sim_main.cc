// rubato_sim: one Rubato job at the simulator's training level (sim/README.md). The real shards
// and clients run in simulated time across a simulated network, and every worker trains the real
// model on its real shard of Fashion-MNIST; each worker's progress records go to
// RUN_DIR/worker-N.jsonl and each shard's statistics to RUN_DIR/server-S.stats.json, as a local
// ./rubato launch writes them, with simulated seconds in every "t".
//
//   rubato_sim --run_dir=DIR --num_workers=4 --shards=1 --mode=bsp --layers=784-256-10
//       --epochs=3 --min_step_ms=20 --slow_workers=3:4 [--compute_ms=-1 --eval_ms=-1]
//
// It takes rubato_worker's and rubato_server's flags that shape a job (the cluster flags, the
// model, batch, epochs, evaluation, seed, data and straggler flags) and its own: the shards, the
// network and the costs of compute. A step's compute time and an evaluation's are measured here
// on the real model before the job starts (the median of several runs on this machine, one
// thread) unless given; the last line it prints is a JSON object of the calibration and the run's
// figures (experiments/simulate.py reads it).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cluster_flags.h"
#include "common/cluster_spec.h"
#include "common/isa_dispatch.h"
#include "common/log.h"
#include "common/malloc_tuning.h"
#include "common/parse_flags.h"
#include "common/progress_writer.h"
#include "common/status_macros.h"
#include "sim/ring_job.h"
#include "sim/timing_job.h"
#include "sim/training_workload.h"
#include "worker/data/dataset.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"
#include "worker/straggler_flags.h"

ABSL_FLAG(std::string, run_dir, "", "Where the workers' records and the shards' statistics go.");
ABSL_FLAG(int, shards, 1, "Parameter-server shards.");
ABSL_FLAG(std::string, model, "mlp:784-256-10", "As rubato_worker's --model.");
ABSL_FLAG(std::string, layers, "", "As rubato_worker's --layers (mlp:LAYERS).");
ABSL_FLAG(int, batch_size, 64, "Examples per step on each worker.");
ABSL_FLAG(int, epochs, 3, "Passes over the training set (all workers together).");
ABSL_FLAG(int64_t, steps, 0, "Steps to run; overrides --epochs when > 0.");
ABSL_FLAG(int64_t, eval_every, 0, "Evaluate every this many steps (default: twice per epoch).");
ABSL_FLAG(int64_t, log_every, 20, "A step record every this many steps.");
ABSL_FLAG(int64_t, train_limit, 0, "Use only the first N training examples (0: all).");
ABSL_FLAG(int64_t, test_limit, 0, "Evaluate on the first N test examples (0: all).");
ABSL_FLAG(bool, eval_all_workers, false, "Under bsp every worker evaluates, not only worker 0.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the weight initialisation and the data order.");
ABSL_FLAG(std::string, data_dir, rubato::kFashionMnistDefaultDir, "Fashion-MNIST IDX directory.");
ABSL_FLAG(double, compute_ms, -1,
          "One step's forward and backward pass in simulated time; < 0: measured here.");
ABSL_FLAG(double, eval_ms, -1, "One evaluation of the test set in simulated time; < 0: measured.");
ABSL_FLAG(std::string, hosts, "one",
          "one: every process on one host, talking through its loopback (a local launch); "
          "apart: each worker and each shard on a host of its own.");
ABSL_FLAG(double, loopback_gbps, 64, "The loopback's rate, Gb/s (--hosts=one).");
ABSL_FLAG(double, loopback_latency_us, 20, "The loopback's one-way latency, microseconds.");
ABSL_FLAG(double, nic_gbps, 25, "Every host's NIC, Gb/s (--hosts=apart).");
ABSL_FLAG(double, latency_us, 10, "One-way latency between hosts, microseconds.");
ABSL_FLAG(int, cores, -1,
          "Processors of each host, shared by its processes' compute and evaluations "
          "(sim/cpu.h); 0: as many as they need; -1: this machine's with --hosts=one, as many "
          "as needed with --hosts=apart.");

namespace rubato {
namespace {

constexpr int kExitUsage = 2;
constexpr int kExitRuntime = 1;

// The median of `runs` timings of `fn`, which must succeed.
template <typename Fn>
absl::StatusOr<absl::Duration> Median(int runs, Fn fn) {
  std::vector<absl::Duration> d;
  for (int i = 0; i < runs; ++i) {
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(fn());
    d.push_back(absl::Now() - start);
  }
  std::sort(d.begin(), d.end());
  return d[d.size() / 2];
}

// A step's forward and backward pass and an evaluation of the test set, timed on this machine.
absl::Status Calibrate(const ModelSpec& spec, ModelBackend* backend, const Dataset& train,
                       const Dataset& test, int batch, absl::Duration* compute,
                       absl::Duration* eval) {
  std::vector<std::vector<float>> params = InitModelParams(spec, 1);
  std::vector<std::vector<float>> grads = params;
  std::vector<absl::Span<const float>> in(params.begin(), params.end());
  std::vector<absl::Span<float>> out(grads.begin(), grads.end());
  const int64_t n = std::min<int64_t>(batch, train.size);
  if (*compute < absl::ZeroDuration()) {
    ASSIGN_OR_RETURN(*compute, Median(21, [&]() -> absl::Status {
      return backend->ForwardBackward(in, train.features.data(), train.labels.data(), n, out)
          .status();
    }));
  }
  if (*eval < absl::ZeroDuration()) {
    if (test.size == 0) {
      *eval = absl::ZeroDuration();
    } else {
      ASSIGN_OR_RETURN(*eval, Median(3, [&]() -> absl::Status {
        return backend->Evaluate(in, test.features.data(), test.labels.data(), test.size).status();
      }));
    }
  }
  return absl::OkStatus();
}

absl::Duration FlagMs(double ms) {
  return ms < 0 ? absl::Milliseconds(-1) : absl::Microseconds(ms * 1e3);
}

absl::Status SetHosts(TimingJobOptions* o) {
  const std::string hosts = absl::GetFlag(FLAGS_hosts);
  HostSpec h;
  h.nic_bytes_per_second = absl::GetFlag(FLAGS_nic_gbps) * 1e9 / 8;
  h.latency = absl::Microseconds(absl::GetFlag(FLAGS_latency_us));
  h.loopback_bytes_per_second = absl::GetFlag(FLAGS_loopback_gbps) * 1e9 / 8;
  h.loopback_latency = absl::Microseconds(absl::GetFlag(FLAGS_loopback_latency_us));
  const int cores = absl::GetFlag(FLAGS_cores);
  if (cores < -1)
    return absl::InvalidArgumentError(absl::StrCat("--cores must be >= -1, got ", cores));
  h.cores = cores >= 0       ? cores
            : hosts == "one" ? static_cast<int>(std::thread::hardware_concurrency())
                             : 0;
  RETURN_IF_ERROR(ValidateHostSpec(h));
  o->worker_host = o->server_host = h;
  if (hosts == "apart") {
    o->workers_per_host = o->shards_per_host = 1;
    return absl::OkStatus();
  }
  if (hosts != "one") {
    return absl::InvalidArgumentError(
        absl::StrCat("--hosts must be one or apart, got '", hosts, "'"));
  }
  o->colocated = true;
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> ModelFromFlags(std::string* text) {
  *text = absl::GetFlag(FLAGS_model);
  if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
    if (*text != "mlp:784-256-10") {
      return absl::InvalidArgumentError("give --model or its old spelling --layers, not both");
    }
    *text = "mlp:" + layers;
  }
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(*text);
  if (!spec.ok())
    return absl::InvalidArgumentError(absl::StrCat("--model: ", spec.status().message()));
  return spec;
}

// The ring's job (sim/ring_job.h) for the same flags: one rank per host, its links the NICs
// (--hosts=apart) or the loopback (--hosts=one; the host's cores are not modelled for the ring).
absl::StatusOr<RingJobOptions> RingOptionsOf(const TimingJobOptions& o) {
  RingJobOptions r;
  r.workers = o.cluster.num_workers();
  RETURN_IF_ERROR(SetRingConsistency(o.cluster.consistency(), &r));
  r.steps = o.steps;
  r.steps_per_epoch = o.steps_per_epoch;
  r.stragglers = o.stragglers;
  r.host = o.worker_host;
  if (o.colocated) {
    r.host.nic_bytes_per_second = o.worker_host.loopback_bytes_per_second;
    r.host.latency = o.worker_host.loopback_latency;
  }
  r.host.cores = 0;
  r.workload = o.workload;
  r.cluster = o.cluster;
  r.batch_size = o.batch_size;
  RETURN_IF_ERROR(ValidateRingJobOptions(r));
  return r;
}

int Fail(int code, const absl::Status& status) {
  std::fprintf(stderr, "rubato_sim: error: %s\n", std::string(status.message()).c_str());
  return code;
}

int Main() {
  const std::string run_dir = absl::GetFlag(FLAGS_run_dir);
  if (run_dir.empty()) return Fail(kExitUsage, absl::InvalidArgumentError("--run_dir is required"));
  if (absl::GetFlag(FLAGS_batch_size) < 1 || absl::GetFlag(FLAGS_log_every) < 1 ||
      absl::GetFlag(FLAGS_eval_every) < 0 || absl::GetFlag(FLAGS_steps) < 0 ||
      (absl::GetFlag(FLAGS_epochs) < 1 && absl::GetFlag(FLAGS_steps) == 0) ||
      absl::GetFlag(FLAGS_train_limit) < 0 || absl::GetFlag(FLAGS_test_limit) < 0) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "--batch_size, --log_every and --epochs (or --steps) must be >= 1; "
                                "--eval_every, --steps, --train_limit and --test_limit >= 0"));
  }
  absl::StatusOr<ClusterSpec> cluster = ClusterSpecFromFlags(/*need_servers=*/false);
  if (!cluster.ok()) return Fail(kExitUsage, cluster.status());
  const int workers = cluster->num_workers();
  TimingJobOptions o;
  o.cluster = *cluster;
  o.shards = absl::GetFlag(FLAGS_shards);
  if (absl::Status s = SetHosts(&o); !s.ok()) return Fail(kExitUsage, s);
  for (int w = 0; w < workers; ++w) {
    absl::StatusOr<StragglerOptions> so = StragglerOptionsFromFlags(w, workers);
    if (!so.ok()) return Fail(kExitUsage, so.status());
    if (so->crash_at_step.has_value()) {
      return Fail(kExitUsage, absl::UnimplementedError(
                                  "--crash_at_step: the simulator does not simulate failures"));
    }
    o.stragglers.push_back(*so);
  }
  std::string model_text;
  absl::StatusOr<ModelSpec> spec = ModelFromFlags(&model_text);
  if (!spec.ok()) return Fail(kExitUsage, spec.status());
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  absl::StatusOr<Dataset> train =
      LoadFashionMnist(data_dir, Split::kTrain, absl::GetFlag(FLAGS_train_limit));
  if (!train.ok()) return Fail(kExitUsage, train.status());
  absl::StatusOr<Dataset> test =
      LoadFashionMnist(data_dir, Split::kTest, absl::GetFlag(FLAGS_test_limit));
  if (!test.ok()) return Fail(kExitUsage, test.status());
  absl::StatusOr<std::unique_ptr<ModelBackend>> backend = CreateCpuBackend(*spec, 1);
  if (!backend.ok()) return Fail(kExitUsage, backend.status());

  absl::Duration compute = FlagMs(absl::GetFlag(FLAGS_compute_ms));
  absl::Duration eval = FlagMs(absl::GetFlag(FLAGS_eval_ms));
  if (absl::Status s = Calibrate(*spec, backend->get(), *train, *test,
                                 absl::GetFlag(FLAGS_batch_size), &compute, &eval);
      !s.ok()) {
    return Fail(kExitRuntime, s);
  }

  TrainingWorkloadOptions t;
  t.spec = *spec;
  t.model_text = model_text;
  t.train = &*train;
  t.test = &*test;
  t.backend = backend->get();
  t.num_workers = workers;
  t.batch_size = absl::GetFlag(FLAGS_batch_size);
  t.seed = absl::GetFlag(FLAGS_seed);
  t.job = JobLengthOf(t.batch_size, workers, train->size, absl::GetFlag(FLAGS_steps),
                      absl::GetFlag(FLAGS_epochs));
  t.eval_every = absl::GetFlag(FLAGS_eval_every);
  if (t.eval_every == 0) t.eval_every = DefaultEvalEvery(t.job);
  t.log_every = absl::GetFlag(FLAGS_log_every);
  t.consistency = cluster->consistency().mode();
  t.eval_all_workers = absl::GetFlag(FLAGS_eval_all_workers);
  t.mode = FormatConsistency(cluster->consistency());
  t.compute_time = compute;
  t.eval_time = eval;
  std::vector<std::unique_ptr<std::ofstream>> files;
  for (int w = 0; w < workers; ++w) {
    const std::string path = absl::StrCat(run_dir, "/worker-", w, ".jsonl");
    if (absl::Status s = MakeParentDirectory(path); !s.ok()) return Fail(kExitUsage, s);
    files.push_back(std::make_unique<std::ofstream>(path, std::ios::trunc));
    if (!*files.back()) {
      return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrCat("cannot write ", path)));
    }
    t.progress.push_back(files.back().get());
  }
  absl::StatusOr<std::unique_ptr<TrainingWorkload>> workload = TrainingWorkload::Create(t);
  if (!workload.ok()) return Fail(kExitUsage, workload.status());
  (*workload)->Start();

  o.workload = workload->get();
  o.steps = t.job.steps;
  o.steps_per_epoch = t.job.steps_per_epoch;
  o.batch_size = t.batch_size;
  absl::StatusOr<TimingJobResult> r;
  if (cluster->consistency().mode() == ALLREDUCE) {
    absl::StatusOr<RingJobOptions> ring = RingOptionsOf(o);
    if (!ring.ok()) return Fail(kExitUsage, ring.status());
    r = RunRingJob(*ring);
  } else {
    if (absl::Status s = ValidateTimingJobOptions(o); !s.ok()) return Fail(kExitUsage, s);
    r = RunTimingJob(o);
  }
  for (auto& f : files) f->flush();
  if (!r.ok()) return Fail(kExitRuntime, r.status());
  for (size_t s = 0; s < r->shard_stats.size(); ++s) {
    ProgressRecord record;
    *record.mutable_stats() = r->shard_stats[s];
    const std::string path = absl::StrCat(run_dir, "/server-", s, ".stats.json");
    if (!(std::ofstream(path) << ProgressLine(record) << "\n")) {
      return Fail(kExitRuntime, absl::UnavailableError(absl::StrCat("cannot write ", path)));
    }
  }
  double waiting = 0;
  for (const TimingJobResult::Worker& w : r->workers) {
    waiting += absl::ToDoubleSeconds(w.waiting) / std::max(absl::ToDoubleSeconds(w.finished), 1e-9);
  }
  std::printf(
      "{\"event\":\"simulated\",\"wall_s\":%.6f,\"cores\":%d,\"compute_ms\":%.4f,\"eval_ms\":%.4f,"
      "\"waiting_fraction\":%.4f,\"dropped_gradients\":%lld,\"events\":%lld,\"real_s\":%.3f}\n",
      absl::ToDoubleSeconds(r->wall), o.worker_host.cores, absl::ToDoubleMilliseconds(compute),
      absl::ToDoubleMilliseconds(eval), waiting / std::max<size_t>(1, r->workers.size()),
      static_cast<long long>(r->dropped_gradients), static_cast<long long>(r->events),
      r->real_seconds);
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::ExecIsaVariant(argv);  // The AVX2 build, where it can run (common/isa_dispatch.h).
  absl::SetProgramUsageMessage(
      "One Rubato job in simulated time (sim/README.md). Its flags: --helpfull.");
  std::vector<char*> rest = rubato::ParseFlagsOrExit(argc, argv);
  if (rest.size() > 1) {
    return rubato::Fail(rubato::kExitUsage, absl::InvalidArgumentError(absl::StrCat(
                                                "unexpected argument '", rest[1], "'")));
  }
  rubato::KeepFreedMemory();
  rubato::SkipMutexDeadlockDetection();
  rubato::SetMinLogLevel(rubato::LogLevel::kWarning);  // Each shard logs every registration.
  return rubato::Main();
}
