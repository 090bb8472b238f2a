// StragglerModel: how much extra time one worker spends on each step, for experiments on how
// training copes with slow, paused and dead workers. Pure arithmetic over a seeded random stream:
// the training loop asks for each step's delay and sleeps it.
//
// Per step s, with c the measured compute time and T the floor (--min_step_ms):
//
//   emulated compute  = max(c, T) * (slow(s) ? slowdown : 1)
//   delay             = (emulated compute - c)                   floor, then slowdown
//                     + [u <= p] * X, X ~ exponential | lognormal | pareto with mean M
//                     + pause_ms      at pause_at_step only, once
//                     + trace(s)      this worker's row for step s of --delay_trace, if any
//
// slow(s), the straggler pattern (SlowAt): always, by default (a constant straggler); from step
// slow_from_step on (one that appears mid-run); with slow_period_steps P > 0, only in the first
// slow_for_steps steps of every period of P steps counted from slow_from_step (a transient one);
// with rotate_slow, only in the periods k whose k mod num_workers is this worker (each worker slow
// in turn). Steps, not seconds: a pattern is the same on every machine and in every rerun.
//
// Random draws come from one std::mt19937_64 seeded by (seed, worker id), three outputs per step
// whether or not the delay is taken: step s uses outputs 3s, 3s + 1 and 3s + 2. So a step's delay
// is a function of (seed, worker id, s) alone, whatever the timing, and a step repeated or skipped
// around a rejoin draws what it would have drawn in order.
#ifndef RUBATO_WORKER_STRAGGLER_MODEL_H_
#define RUBATO_WORKER_STRAGGLER_MODEL_H_

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rubato {

enum class DelayDistribution {
  kExponential,  // rate 1 / M
  kLognormal,    // exp(N(mu, sigma^2)), mu = ln M - sigma^2 / 2
  kPareto,       // scale x_m = M (alpha - 1) / alpha, shape alpha > 1
};

// "exponential", "lognormal" or "pareto"; InvalidArgument naming --delay_distribution otherwise.
absl::StatusOr<DelayDistribution> ParseDelayDistribution(absl::string_view name);
absl::string_view DelayDistributionName(DelayDistribution distribution);

// One worker's injected faults. Each field is the worker flag of the same name; the defaults inject
// nothing.
struct StragglerOptions {
  double slowdown = 1;           // >= 1: compute time is multiplied by this.
  double delay_probability = 0;  // In [0, 1]: chance that a step gets a random delay.
  DelayDistribution delay_distribution = DelayDistribution::kExponential;
  double delay_mean_ms = 0;  // >= 0: mean M of the random delay.
  double delay_sigma = 1.0;  // >= 0: lognormal: standard deviation of the log.
  double delay_alpha = 2.5;  // > 1: pareto: shape (the mean is infinite at alpha <= 1).
  uint64_t seed = 1;         // --straggler_seed; mixed with the worker id.
  // Sleep pause_ms once at this step (>= 0); unset: never. Both or neither must be given.
  std::optional<int64_t> pause_at_step;
  int64_t pause_ms = 0;
  // Exit abruptly at the start of this step (>= 0); unset: never.
  std::optional<int64_t> crash_at_step;
  double min_step_ms = 0;  // >= 0: compute time is padded up to this.
  // The straggler pattern: when the slowdown applies (see the top of this file).
  int64_t slow_from_step = 0;     // >= 0.
  int64_t slow_period_steps = 0;  // >= 0; 0: no period, slow from slow_from_step on.
  int64_t slow_for_steps = 0;     // In [1, slow_period_steps] when there is a period.
  bool rotate_slow = false;       // Needs a period and num_workers.
  int num_workers = 0;            // For rotate_slow.
  // Extra delay (ms) at given steps, this worker's rows of a --delay_trace file.
  std::map<int64_t, double> trace_ms;
};

// This worker's rows of a delay trace (--delay_trace): one row per line, "STEP WORKER DELAY_MS"
// (whitespace between; `#` starts a comment; blank lines skipped), e.g. a per-step trace recorded on
// a real cluster. InvalidArgument naming `path` and the line: a row that does not parse, a step
// < 0, a worker outside [0, num_workers), a delay that is negative or not finite, a (step, worker)
// given twice.
absl::StatusOr<std::map<int64_t, double>> ParseDelayTrace(absl::string_view text,
                                                          absl::string_view path, int worker_id,
                                                          int num_workers);

// OK, or InvalidArgument naming the first bad flag and its value. NaN and infinities are bad.
absl::Status ValidateStragglerOptions(const StragglerOptions& options);

class StragglerModel {
 public:
  // InvalidArgument as ValidateStragglerOptions; worker_id must be >= 0.
  static absl::StatusOr<StragglerModel> Create(const StragglerOptions& options, int worker_id);

  // The total delay to add to `step` (slowdown + floor + random + pause), given the compute time
  // measured for it. Marks the pause as taken when `step` is pause_at_step, so that a repeat of
  // that step (after a rejoin) is not paused again.
  absl::Duration DelayFor(int64_t step, absl::Duration compute_time);

  // The parts of DelayFor, without side effects on the results. (RandomDelay moves the engine to
  // `step`: cheap in step order, a reseed and a discard of 3 * step outputs otherwise.)
  absl::Duration ComputeDelay(absl::Duration compute_time) const;  // Floor and slowdown.
  absl::Duration ComputeDelay(absl::Duration compute_time, double slowdown) const;
  absl::Duration RandomDelay(int64_t step) const;  // Zero if the step's Bernoulli draw fails.

  // Whether the slowdown applies at `step` (the pattern at the top of this file).
  bool SlowAt(int64_t step) const;

  // Whether the worker should die at the start of `step`.
  bool CrashAt(int64_t step) const {
    return options_.crash_at_step.has_value() && step == *options_.crash_at_step;
  }

  // Whether any fault is configured (if not, DelayFor is always zero and CrashAt always false).
  bool enabled() const;

  // One line for the start-up log, e.g. "slowdown 3, floor 5 ms, p=0.1 exponential mean 20 ms".
  std::string Describe() const;

  const StragglerOptions& options() const { return options_; }

 private:
  StragglerModel(const StragglerOptions& options, int worker_id);
  void ResetEngine() const;  // To step 0.

  // Constant after construction.
  StragglerOptions options_;
  int worker_id_ = 0;
  double lognormal_mu_ = 0;  // ln M - sigma^2 / 2: the log-mean that gives mean M.
  double pareto_scale_ = 0;  // x_m = M (alpha - 1) / alpha, in ms.

  // Not thread-safe: one model per worker, used by its training loop.
  mutable std::mt19937_64 rng_;
  mutable int64_t rng_step_ = 0;  // The step whose draws rng_ yields next.
  bool paused_ = false;           // The pause has been taken.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_STRAGGLER_MODEL_H_
