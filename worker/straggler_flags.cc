#include "worker/straggler_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

// Straggler injection (worker/straggler_model.h). The defaults inject nothing.
ABSL_FLAG(double, slowdown, 1, "Multiply this worker's compute time by this factor (>= 1).");
ABSL_FLAG(std::string, slow_workers, "",
          "ID:FACTOR,...: the worker whose id is listed takes FACTOR as its --slowdown (one "
          "command line for every worker, as in a Kubernetes Indexed Job).");
ABSL_FLAG(double, min_step_ms, 0,
          "Pad each step's compute time up to this many ms (before --slowdown applies).");
ABSL_FLAG(double, delay_probability, 0, "Chance in [0, 1] that a step gets a random delay.");
ABSL_FLAG(std::string, delay_distribution, "exponential",
          "Random delay distribution: exponential, lognormal or pareto.");
ABSL_FLAG(double, delay_mean_ms, 0, "Mean of the random delay, in ms.");
ABSL_FLAG(double, delay_sigma, 1.0, "lognormal: standard deviation of the log of the delay.");
ABSL_FLAG(double, delay_alpha, 2.5, "pareto: shape (> 1); the scale follows from the mean.");
ABSL_FLAG(uint64_t, straggler_seed, 1,
          "Seed of the random delays; mixed with --worker_id, so workers differ.");
ABSL_FLAG(std::optional<int64_t>, pause_at_step, std::nullopt,
          "Stall once for --pause_ms at this step.");
ABSL_FLAG(int64_t, pause_ms, 0, "Length of the --pause_at_step stall, in ms.");
ABSL_FLAG(std::optional<int64_t>, crash_at_step, std::nullopt,
          "Exit abruptly (status 3) at the start of this step, to simulate a dead worker.");
// The straggler pattern: when --slowdown (or this worker's --slow_workers factor) applies.
ABSL_FLAG(int64_t, slow_from_step, 0,
          "The slowdown applies from this step on (a straggler that appears mid-run).");
ABSL_FLAG(int64_t, slow_period_steps, 0,
          "With --slow_for_steps: the slowdown applies in the first --slow_for_steps steps of "
          "every period of this many steps (a transient straggler); 0: always.");
ABSL_FLAG(int64_t, slow_for_steps, 0, "See --slow_period_steps.");
ABSL_FLAG(bool, rotate_slow, false,
          "With --slow_period_steps: worker k mod num_workers is the slow one in period k (a "
          "different worker slow each period); give every worker the same --slowdown.");
ABSL_FLAG(std::string, delay_trace, "",
          "Replay a per-step delay trace: a file of rows STEP WORKER DELAY_MS (# comments); this "
          "worker sleeps its rows' delays at those steps, on top of any other injection.");

namespace rubato {
namespace {

// The factor that --slow_workers ("1:4,3:2") gives worker `id`, if any.
absl::StatusOr<std::optional<double>> SlowdownFor(const std::string& spec, int id,
                                                  int num_workers) {
  std::optional<double> mine;
  std::vector<int> seen;
  if (spec.empty()) return mine;
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, ':');
    int worker = -1;
    double factor = 0;
    if (!absl::SimpleAtoi(kv.first, &worker) || !absl::SimpleAtod(kv.second, &factor)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--slow_workers: expected ID:FACTOR,... such as 1:4,3:2, got '", item, "'"));
    }
    if (worker < 0 || worker >= num_workers ||
        std::find(seen.begin(), seen.end(), worker) != seen.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--slow_workers: worker id ", kv.first,
                                                     " repeated or not in [0, ", num_workers, ")"));
    }
    if (!(factor >= 1) || std::isinf(factor)) {
      return absl::InvalidArgumentError(absl::StrCat("--slow_workers: worker ", worker,
                                                     ": factor must be >= 1, got ", kv.second));
    }
    seen.push_back(worker);
    if (worker == id) mine = factor;
  }
  return mine;
}

}  // namespace

absl::StatusOr<StragglerOptions> StragglerOptionsFromFlags(int worker_id, int num_workers) {
  StragglerOptions o;
  o.slowdown = absl::GetFlag(FLAGS_slowdown);
  ASSIGN_OR_RETURN(const std::optional<double> slow,
                   SlowdownFor(absl::GetFlag(FLAGS_slow_workers), worker_id, num_workers));
  if (slow.has_value()) o.slowdown = *slow;
  o.min_step_ms = absl::GetFlag(FLAGS_min_step_ms);
  o.delay_probability = absl::GetFlag(FLAGS_delay_probability);
  ASSIGN_OR_RETURN(o.delay_distribution,
                   ParseDelayDistribution(absl::GetFlag(FLAGS_delay_distribution)));
  o.delay_mean_ms = absl::GetFlag(FLAGS_delay_mean_ms);
  o.delay_sigma = absl::GetFlag(FLAGS_delay_sigma);
  o.delay_alpha = absl::GetFlag(FLAGS_delay_alpha);
  o.seed = absl::GetFlag(FLAGS_straggler_seed);
  o.pause_at_step = absl::GetFlag(FLAGS_pause_at_step);
  o.pause_ms = absl::GetFlag(FLAGS_pause_ms);
  o.crash_at_step = absl::GetFlag(FLAGS_crash_at_step);
  o.slow_from_step = absl::GetFlag(FLAGS_slow_from_step);
  o.slow_period_steps = absl::GetFlag(FLAGS_slow_period_steps);
  o.slow_for_steps = absl::GetFlag(FLAGS_slow_for_steps);
  o.rotate_slow = absl::GetFlag(FLAGS_rotate_slow);
  o.num_workers = num_workers;
  if (const std::string path = absl::GetFlag(FLAGS_delay_trace); !path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--delay_trace: cannot read ", path));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSIGN_OR_RETURN(o.trace_ms, ParseDelayTrace(text, path, worker_id, num_workers));
  }
  return o;
}

}  // namespace rubato
