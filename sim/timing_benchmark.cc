// Timing simulation benchmark: how long the simulator takes to run a job, and what it finds.
//
//   bazel run -c opt //sim:timing_benchmark [-- --workers=1024 --shards=16 --model_mb=64
//       --tensors=16 --steps=100 --mode=bsp --nic_gbps=100 --latency_us=10 --step_ms=100]
//
// It prints one line per worker count (--workers is a list): the simulated wall time and step
// time, the busiest shard NIC's busy fraction in and out (how near the job is to the network's
// bound: 1.0 is a saturated NIC), the workers' mean waiting fraction, and the cost of simulating:
// events, real seconds and events a second. The target is 1,024 workers x 100 steps of a
// 64 MB model within 60 s of real time on one core.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/malloc_tuning.h"
#include "sim/timing_job.h"

ABSL_FLAG(std::string, workers, "64,256,1024", "Worker counts, comma-separated.");
ABSL_FLAG(int, shards, 16, "Parameter-server shards.");
ABSL_FLAG(int, shards_per_host, 1, "Shards on each server host.");
ABSL_FLAG(double, model_mb, 64, "Model size in MB (10^6 bytes of float32).");
ABSL_FLAG(int, tensors, 16, "Tensors the model is split into (equal sizes).");
ABSL_FLAG(int, steps, 100, "Steps per worker.");
ABSL_FLAG(std::string, mode, "bsp", "bsp, backup:B, ssp:S or async.");
ABSL_FLAG(double, nic_gbps, 100, "Every host's NIC, Gb/s.");
ABSL_FLAG(double, latency_us, 10, "One-way latency, microseconds.");
ABSL_FLAG(double, step_ms, 100, "Compute time of one step.");
ABSL_FLAG(int, real_elements, 64,
          "Elements each tensor is held at (the scale follows); the network counts full sizes.");

namespace rubato {
namespace {

absl::Status SetMode(const std::string& mode, ClusterSpec* cluster) {
  std::vector<std::string> parts = absl::StrSplit(mode, ':');
  ConsistencyConfig* c = cluster->mutable_consistency();
  int n = 0;
  if (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &n)) {
    return absl::InvalidArgumentError("--mode: bad number in '" + mode + "'");
  }
  if (parts[0] == "bsp" && parts.size() == 1) {
    c->set_mode(BSP);
  } else if (parts[0] == "async" && parts.size() == 1) {
    c->set_mode(ASYNC);
  } else if (parts[0] == "backup" && parts.size() == 2) {
    c->set_mode(BACKUP);
    c->set_backup_workers(n);
  } else if (parts[0] == "ssp" && parts.size() == 2) {
    c->set_mode(SSP);
    c->set_staleness(n);
  } else {
    return absl::InvalidArgumentError("--mode must be bsp, backup:B, ssp:S or async, got '" + mode +
                                      "'");
  }
  return absl::OkStatus();
}

int Main() {
  std::vector<int> counts;
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < 1) {
      std::fprintf(stderr, "--workers: bad count '%s'\n", std::string(w).c_str());
      return 2;
    }
    counts.push_back(n);
  }
  const int tensors = absl::GetFlag(FLAGS_tensors);
  if (tensors < 1 || absl::GetFlag(FLAGS_real_elements) < 1 ||
      !(absl::GetFlag(FLAGS_model_mb) > 0)) {
    std::fprintf(stderr, "--tensors, --real_elements and --model_mb must be > 0\n");
    return 2;
  }
  const int64_t elements = static_cast<int64_t>(absl::GetFlag(FLAGS_model_mb) * 1e6 / 4 / tensors);
  std::printf(
      "model %.0f MB in %d tensors, %d shard(s), %s, %.0f Gb/s NICs, %.0f us, "
      "%.0f ms compute, %d steps\n",
      absl::GetFlag(FLAGS_model_mb), tensors, absl::GetFlag(FLAGS_shards),
      absl::GetFlag(FLAGS_mode).c_str(), absl::GetFlag(FLAGS_nic_gbps),
      absl::GetFlag(FLAGS_latency_us), absl::GetFlag(FLAGS_step_ms), absl::GetFlag(FLAGS_steps));
  std::printf("%8s %8s %12s %10s %10s %10s %10s %12s %10s %12s\n", "workers", "scale", "sim wall s",
              "step ms", "nic in", "nic out", "waiting", "events", "real s", "events/s");
  for (int workers : counts) {
    TimingJobOptions o;
    o.cluster.set_num_workers(workers);
    if (absl::Status s = SetMode(absl::GetFlag(FLAGS_mode), &o.cluster); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 2;
    }
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(0.1);
    o.cluster.set_wait_timeout_ms(600000);
    o.shards = absl::GetFlag(FLAGS_shards);
    o.shards_per_host = absl::GetFlag(FLAGS_shards_per_host);
    o.tensor_elements.assign(tensors, elements);
    // As small as asked, but bsp's parts must stay parts a client takes (MaxScale).
    o.scale =
        std::min(std::max<int64_t>(1, elements / absl::GetFlag(FLAGS_real_elements)), MaxScale(o));
    o.steps = absl::GetFlag(FLAGS_steps);
    o.step_time = absl::Milliseconds(absl::GetFlag(FLAGS_step_ms));
    for (HostSpec* h : {&o.worker_host, &o.server_host}) {
      h->nic_bytes_per_second = absl::GetFlag(FLAGS_nic_gbps) * 1e9 / 8;
      h->latency = absl::Microseconds(absl::GetFlag(FLAGS_latency_us));
    }
    absl::StatusOr<TimingJobResult> r = RunTimingJob(o);
    if (!r.ok()) {
      std::fprintf(stderr, "%d workers: %s\n", workers, r.status().ToString().c_str());
      return 1;
    }
    double waiting = 0;
    for (const TimingJobResult::Worker& w : r->workers) {
      waiting += absl::ToDoubleSeconds(w.waiting) / absl::ToDoubleSeconds(w.finished);
    }
    waiting /= r->workers.size();
    const double wall = absl::ToDoubleSeconds(r->wall);
    std::printf("%8d %8lld %12.3f %10.2f %10.3f %10.3f %10.3f %12lld %10.2f %12.0f\n", workers,
                static_cast<long long>(o.scale), wall, 1e3 * wall / o.steps, r->max_shard_nic_in,
                r->max_shard_nic_out, waiting, static_cast<long long>(r->events), r->real_seconds,
                r->events / std::max(r->real_seconds, 1e-9));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::KeepFreedMemory();
  rubato::SkipMutexDeadlockDetection();  // Its global graph of every lock: a third of the time.
  absl::ParseCommandLine(argc, argv);
  // Each shard logs every worker's registration and finish: thousands of lines.
  rubato::SetMinLogLevel(rubato::LogLevel::kWarning);
  return rubato::Main();
}
