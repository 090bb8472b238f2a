// The simulator's results at scale (issue 34): jobs of 16 to 4,096 workers at the timing level,
// one row per (workers, mode, pattern, shards, NIC), as CSV.
//
//   bazel run -c opt //sim:scale_study -- --workers=16,256,4096 --modes=bsp,async,allreduce
//       --patterns=none,constant --model_mb=100 --step_ms=100 --steps=20 --out=/tmp/scale.csv
//
// Modes are the job's (--mode): bsp, backup:B, ssp:S, async and adaptive[:K] run Rubato's shards
// and clients (sim/timing_job.h); backup:auto is backup:B with B = workers / 16 (at least 1);
// reassign is async with work reassignment in units of 4 batches (--reassign); allreduce,
// allreduce:majority and allreduce:solo run the rings' schedules (sim/ring_job.h). The patterns
// (a 4x slowdown is the worker flag --slowdown=4):
//   none       no injected delay;
//   constant   worker 0 slowed 4x in every step;
//   transient  worker 0 slowed 4x in the first 2 steps of every 5;
//   rotating   one worker at a time slowed 4x, the next one every 2 steps (--rotate_slow);
//   heavy      every worker: with probability 0.1 a step gets a Pareto (alpha 2.5) delay whose
//              mean is the step time (--delay_probability, --delay_distribution=pareto).
// --shards is a list too (0: as many as tensors, at most the workers); every shard on a host of
// its own, every worker too, all NICs alike. Time per epoch (--epoch_examples, --batch examples
// a gradient; a gradient a backup step dropped, or a partial round never carried, does not
// count), two ways: epoch_s, as the job runs, every worker doing its --steps (its share of the
// data, as a real job's fixed shard: under async and ssp the slowest worker's share ends the
// epoch; the partial rings' rounds carry steps x workers gradients from whoever has them); and
// rate_epoch_s, at the rate the workers apply gradients while they all run (each worker's
// gradients over its own time, summed), which is what async's and ssp's fast workers achieve
// when their work is not fixed (work reassignment, docs/straggler.md).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cluster_spec.h"
#include "common/log.h"
#include "common/malloc_tuning.h"
#include "common/status_macros.h"
#include "sim/ring_job.h"
#include "sim/step_times.h"
#include "sim/timing_job.h"

ABSL_FLAG(std::string, workers, "16,64,256", "Worker counts, comma-separated.");
ABSL_FLAG(std::string, modes, "bsp,backup:auto,ssp:2,async,allreduce,allreduce:solo",
          "Modes, comma-separated (bsp, backup:B, backup:auto, ssp:S, async, reassign, adaptive, "
          "adaptive:K, allreduce, allreduce:majority, allreduce:solo).");
ABSL_FLAG(std::string, patterns, "none,constant,transient,rotating,heavy",
          "Straggler patterns, comma-separated (none, constant, transient, rotating, heavy).");
ABSL_FLAG(std::string, shards, "0", "Shard counts, comma-separated (0: min(tensors, workers)).");
ABSL_FLAG(std::string, nic_gbps, "100", "NIC rates in Gb/s, comma-separated.");
ABSL_FLAG(double, model_mb, 100, "Model size in MB (10^6 bytes of float32).");
ABSL_FLAG(int, tensors, 16, "Tensors the model is split into (equal sizes).");
ABSL_FLAG(int, steps, 20, "Steps per worker.");
ABSL_FLAG(double, latency_us, 10, "One-way latency, microseconds.");
ABSL_FLAG(double, step_ms, 100, "Compute time of one step.");
ABSL_FLAG(int, batch, 32, "Examples per gradient (for the time per epoch).");
ABSL_FLAG(double, epoch_examples, 1281167, "Examples in an epoch (default: ImageNet-1k's).");
ABSL_FLAG(int, real_elements, 64,
          "Elements each tensor is held at in the shards' jobs (the scale follows).");
ABSL_FLAG(std::string, out, "", "CSV file to write (default: standard output only).");
ABSL_FLAG(std::string, step_ms_samples, "",
          "A file of measured step times in ms, one a line (sim/step_times.h): each worker's "
          "step draws its compute from them instead of --step_ms.");

namespace rubato {
namespace {

template <typename T>
absl::StatusOr<std::vector<T>> List(const std::string& flag, const std::string& text) {
  std::vector<T> out;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    T v{};
    bool ok = false;
    if constexpr (std::is_same_v<T, int>) {
      ok = absl::SimpleAtoi(item, &v) && v >= 0;
    } else if constexpr (std::is_same_v<T, double>) {
      ok = absl::SimpleAtod(item, &v) && v > 0;
    } else {
      v = std::string(item);
      ok = !v.empty();
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": bad item '", item, "'"));
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<StragglerOptions>> Pattern(const std::string& name, int workers,
                                                      double step_ms) {
  std::vector<StragglerOptions> s(workers);
  if (name == "none") return s;
  if (name == "constant" || name == "transient") {
    s[0].slowdown = 4;
    if (name == "transient") {
      s[0].slow_period_steps = 5;
      s[0].slow_for_steps = 2;
    }
    return s;
  }
  for (StragglerOptions& o : s) {
    if (name == "rotating") {
      o.slowdown = 4;
      o.rotate_slow = true;
      o.slow_period_steps = 2;
      o.slow_for_steps = 2;
      o.num_workers = workers;
    } else if (name == "heavy") {
      o.delay_probability = 0.1;
      o.delay_distribution = DelayDistribution::kPareto;
      o.delay_mean_ms = step_ms;
      o.delay_alpha = 2.5;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--patterns: unknown pattern '", name, "' (none, constant, transient, rotating, heavy)"));
    }
  }
  return s;
}

struct Cell {
  int workers;
  std::string mode;
  std::string pattern;
  int shards;
  double nic_gbps;
};

const StepTimes* step_times = nullptr;  // --step_ms_samples, if given.

absl::StatusOr<TimingJobResult> RunCell(const Cell& c, ConsistencyConfig consistency, bool reassign,
                                        std::vector<StragglerOptions> stragglers,
                                        int64_t* gradients, double* rate) {
  const int tensors = absl::GetFlag(FLAGS_tensors);
  const int64_t elements = static_cast<int64_t>(absl::GetFlag(FLAGS_model_mb) * 1e6 / 4 / tensors);
  HostSpec host;
  host.nic_bytes_per_second = c.nic_gbps * 1e9 / 8;
  host.latency = absl::Microseconds(absl::GetFlag(FLAGS_latency_us));
  const absl::Duration step_time = absl::Milliseconds(absl::GetFlag(FLAGS_step_ms));
  absl::StatusOr<TimingJobResult> r;
  if (consistency.mode() == ALLREDUCE) {
    RingJobOptions o;
    o.workers = c.workers;
    o.elements = elements * tensors;
    RETURN_IF_ERROR(SetRingConsistency(consistency, &o));
    o.steps = absl::GetFlag(FLAGS_steps);
    o.step_time = step_time;
    o.step_times = step_times;
    o.stragglers = std::move(stragglers);
    o.host = host;
    r = RunRingJob(o);
  } else {
    TimingJobOptions o;
    o.cluster.set_num_workers(c.workers);
    *o.cluster.mutable_consistency() = consistency;
    // The launcher's --reassign: units of 4 batches.
    if (reassign) o.cluster.mutable_reassign()->set_unit_batches(4);
    o.cluster.mutable_optimizer()->set_type("sgd");
    o.cluster.mutable_optimizer()->set_learning_rate(0.1);
    o.cluster.set_wait_timeout_ms(3600 * 1000);
    o.shards = c.shards;
    o.tensor_elements.assign(tensors, elements);
    o.scale =
        std::min(std::max<int64_t>(1, elements / absl::GetFlag(FLAGS_real_elements)), MaxScale(o));
    o.steps = absl::GetFlag(FLAGS_steps);
    o.step_time = step_time;
    o.step_times = step_times;
    o.stragglers = std::move(stragglers);
    o.worker_host = host;
    o.server_host = host;
    r = RunTimingJob(o);
  }
  if (!r.ok()) return r;
  // A partial ring's workers count only the gradients a round carried; a shard's workers count
  // the pushes of which a shard dropped a part (backup) apart.
  *gradients = 0;
  *rate = 0;
  for (const TimingJobResult::Worker& w : r->workers) {
    *gradients += w.computed_steps - w.dropped_pushes;
    *rate += (w.computed_steps - w.dropped_pushes) / absl::ToDoubleSeconds(w.finished);
  }
  return r;
}

int Main() {
  absl::StatusOr<std::vector<int>> workers = List<int>("workers", absl::GetFlag(FLAGS_workers));
  absl::StatusOr<std::vector<std::string>> modes =
      List<std::string>("modes", absl::GetFlag(FLAGS_modes));
  absl::StatusOr<std::vector<std::string>> patterns =
      List<std::string>("patterns", absl::GetFlag(FLAGS_patterns));
  absl::StatusOr<std::vector<int>> shards = List<int>("shards", absl::GetFlag(FLAGS_shards));
  absl::StatusOr<std::vector<double>> nics =
      List<double>("nic_gbps", absl::GetFlag(FLAGS_nic_gbps));
  for (const absl::Status& s :
       {workers.status(), modes.status(), patterns.status(), shards.status(), nics.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_tensors) < 1 || absl::GetFlag(FLAGS_steps) < 1 ||
      !(absl::GetFlag(FLAGS_model_mb) > 0) || absl::GetFlag(FLAGS_batch) < 1 ||
      !(absl::GetFlag(FLAGS_epoch_examples) > 0) || absl::GetFlag(FLAGS_step_ms) < 0) {
    std::fprintf(stderr,
                 "--tensors, --steps, --model_mb, --batch and --epoch_examples must be > 0, "
                 "--step_ms >= 0\n");
    return 2;
  }
  std::optional<StepTimes> samples;
  if (const std::string path = absl::GetFlag(FLAGS_step_ms_samples); !path.empty()) {
    absl::StatusOr<StepTimes> read = StepTimes::FromFile(path);
    if (!read.ok()) {
      std::fprintf(stderr, "--step_ms_samples: %s\n", std::string(read.status().message()).c_str());
      return 2;
    }
    samples.emplace(std::move(*read));
    step_times = &*samples;
  }
  FILE* out = nullptr;
  if (!absl::GetFlag(FLAGS_out).empty()) {
    out = std::fopen(absl::GetFlag(FLAGS_out).c_str(), "w");
    if (out == nullptr) {
      std::fprintf(stderr, "--out: cannot write %s\n", absl::GetFlag(FLAGS_out).c_str());
      return 2;
    }
  }
  const std::string header =
      "workers,mode,pattern,shards,nic_gbps,model_mb,step_ms,steps,wall_s,step_s,gradients,"
      "epoch_s,rate_epoch_s,waiting,max_shard_nic_in,max_shard_nic_out,events,real_s\n";
  std::fputs(header.c_str(), stdout);
  if (out != nullptr) std::fputs(header.c_str(), out);
  for (double nic : *nics) {
    for (int n : *workers) {
      if (n < 1) {
        std::fprintf(stderr, "--workers: counts must be >= 1\n");
        return 2;
      }
      for (const std::string& pattern : *patterns) {
        for (const std::string& mode : *modes) {
          std::string m = mode;
          if (mode == "backup:auto") m = absl::StrCat("backup:", std::max(1, n / 16));
          const bool reassign = mode == "reassign";
          absl::StatusOr<ConsistencyConfig> consistency = ParseConsistency(reassign ? "async" : m);
          if (!consistency.ok()) {
            std::fprintf(stderr, "--modes: %s\n",
                         std::string(consistency.status().message()).c_str());
            return 2;
          }
          const bool ring = consistency->mode() == ALLREDUCE;
          for (int s : *shards) {
            if (ring && s != shards->front()) continue;  // No shards: one row.
            const int k = ring ? 0 : (s > 0 ? s : std::min(absl::GetFlag(FLAGS_tensors), n));
            absl::StatusOr<std::vector<StragglerOptions>> stragglers =
                Pattern(pattern, n, absl::GetFlag(FLAGS_step_ms));
            if (!stragglers.ok()) {
              std::fprintf(stderr, "%s\n", std::string(stragglers.status().message()).c_str());
              return 2;
            }
            const Cell cell{n, m, pattern, k, nic};
            int64_t gradients = 0;
            double rate = 0;  // Gradients a second.
            absl::StatusOr<TimingJobResult> r =
                RunCell(cell, *consistency, reassign, std::move(*stragglers), &gradients, &rate);
            if (!r.ok()) {
              std::fprintf(stderr, "%d workers, %s, %s: %s\n", n, m.c_str(), pattern.c_str(),
                           r.status().ToString().c_str());
              return 1;
            }
            double waiting = 0;
            for (const TimingJobResult::Worker& w : r->workers) {
              waiting += absl::ToDoubleSeconds(w.waiting) / absl::ToDoubleSeconds(w.finished);
            }
            waiting /= n;
            const double wall = absl::ToDoubleSeconds(r->wall);
            const double epoch =
                absl::GetFlag(FLAGS_epoch_examples) /
                (static_cast<double>(gradients) * absl::GetFlag(FLAGS_batch) / wall);
            const double rate_epoch =
                absl::GetFlag(FLAGS_epoch_examples) / (rate * absl::GetFlag(FLAGS_batch));
            const std::string row = absl::StrCat(
                n, ",", m, ",", pattern, ",", k, ",", nic, ",", absl::GetFlag(FLAGS_model_mb), ",",
                absl::GetFlag(FLAGS_step_ms), ",", absl::GetFlag(FLAGS_steps), ",", wall, ",",
                wall / absl::GetFlag(FLAGS_steps), ",", gradients, ",", epoch, ",", rate_epoch, ",",
                waiting, ",", r->max_shard_nic_in, ",", r->max_shard_nic_out, ",", r->events, ",",
                r->real_seconds, "\n");
            std::fputs(row.c_str(), stdout);
            std::fflush(stdout);
            if (out != nullptr) std::fputs(row.c_str(), out);
          }
        }
      }
    }
  }
  if (out != nullptr && std::fclose(out) != 0) {
    std::fprintf(stderr, "--out: writing %s failed\n", absl::GetFlag(FLAGS_out).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::KeepFreedMemory();
  rubato::SkipMutexDeadlockDetection();
  absl::ParseCommandLine(argc, argv);
  rubato::SetMinLogLevel(rubato::LogLevel::kWarning);
  return rubato::Main();
}
