#include "worker/straggler_model.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rubato {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr int kDrawsPerStep = 3;

// Uniform in (0, 1] from the top 53 bits of one draw: never 0, so its log is finite.
double UniformOpenClosed(std::mt19937_64& rng) {
  return static_cast<double>((rng() >> 11) + 1) * 0x1.0p-53;
}

absl::Status Bad(absl::string_view flag, double value, absl::string_view requirement) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be ", requirement, ", got ", value));
}

}  // namespace

absl::StatusOr<DelayDistribution> ParseDelayDistribution(absl::string_view name) {
  if (name == "exponential") return DelayDistribution::kExponential;
  if (name == "lognormal") return DelayDistribution::kLognormal;
  if (name == "pareto") return DelayDistribution::kPareto;
  return absl::InvalidArgumentError(absl::StrCat("--delay_distribution: unknown distribution '",
                                                 name, "' (exponential, lognormal or pareto)"));
}

absl::string_view DelayDistributionName(DelayDistribution distribution) {
  switch (distribution) {
    case DelayDistribution::kExponential:
      return "exponential";
    case DelayDistribution::kLognormal:
      return "lognormal";
    case DelayDistribution::kPareto:
      return "pareto";
  }
  return "unknown";
}

absl::Status ValidateStragglerOptions(const StragglerOptions& o) {
  // Written as !(ok) so that NaN fails every check.
  if (!(o.slowdown >= 1 && std::isfinite(o.slowdown))) return Bad("slowdown", o.slowdown, ">= 1");
  if (!(o.delay_probability >= 0 && o.delay_probability <= 1)) {
    return Bad("delay_probability", o.delay_probability, "in [0, 1]");
  }
  if (!(o.delay_mean_ms >= 0 && std::isfinite(o.delay_mean_ms))) {
    return Bad("delay_mean_ms", o.delay_mean_ms, ">= 0");
  }
  if (!(o.delay_sigma >= 0 && std::isfinite(o.delay_sigma))) {
    return Bad("delay_sigma", o.delay_sigma, ">= 0");
  }
  if (!(o.delay_alpha > 1 && std::isfinite(o.delay_alpha))) {
    return Bad("delay_alpha", o.delay_alpha, "> 1 (the Pareto mean is infinite otherwise)");
  }
  if (o.pause_at_step.has_value() && *o.pause_at_step < 0) {
    return Bad("pause_at_step", *o.pause_at_step, ">= 0");
  }
  if (o.pause_ms < 0) return Bad("pause_ms", o.pause_ms, ">= 0");
  if (o.pause_at_step.has_value() != (o.pause_ms > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pause_at_step and --pause_ms > 0 go together; got ",
        o.pause_at_step.has_value() ? absl::StrCat("--pause_at_step=", *o.pause_at_step)
                                    : "no --pause_at_step",
        " and --pause_ms=", o.pause_ms));
  }
  if (o.crash_at_step.has_value() && *o.crash_at_step < 0) {
    return Bad("crash_at_step", *o.crash_at_step, ">= 0");
  }
  if (!(o.min_step_ms >= 0 && std::isfinite(o.min_step_ms))) {
    return Bad("min_step_ms", o.min_step_ms, ">= 0");
  }
  if (o.slow_from_step < 0) return Bad("slow_from_step", o.slow_from_step, ">= 0");
  if (o.slow_period_steps < 0) return Bad("slow_period_steps", o.slow_period_steps, ">= 0");
  if (o.slow_period_steps > 0 &&
      !(o.slow_for_steps >= 1 && o.slow_for_steps <= o.slow_period_steps)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--slow_for_steps must be in [1, --slow_period_steps=", o.slow_period_steps, "], got ",
        o.slow_for_steps));
  }
  if (o.slow_period_steps == 0 && o.slow_for_steps != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--slow_for_steps=", o.slow_for_steps,
                                                   " needs --slow_period_steps > 0"));
  }
  if (o.rotate_slow && (o.slow_period_steps == 0 || o.num_workers < 1)) {
    return absl::InvalidArgumentError(
        "--rotate_slow needs --slow_period_steps > 0 (each worker is slow for one period in "
        "turn) and the number of workers");
  }
  for (const auto& [step, ms] : o.trace_ms) {
    if (step < 0 || !(ms >= 0 && std::isfinite(ms))) {
      return absl::InvalidArgumentError(
          absl::StrCat("--delay_trace: step ", step, " delay ", ms, " ms is not a step >= 0 "
                       "with a finite delay >= 0"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<int64_t, double>> ParseDelayTrace(absl::string_view text,
                                                          absl::string_view path, int worker_id,
                                                          int num_workers) {
  std::map<int64_t, double> mine;
  std::set<std::pair<int64_t, int>> seen;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--delay_trace ", path, ":", number, ": ", why, " (rows are STEP WORKER "
                       "DELAY_MS)"));
    };
    int64_t step = 0;
    int worker = 0;
    double ms = 0;
    if (words.size() != 3 || !absl::SimpleAtoi(words[0], &step) ||
        !absl::SimpleAtoi(words[1], &worker) || !absl::SimpleAtod(words[2], &ms)) {
      return bad(absl::StrCat("cannot read '", absl::StripAsciiWhitespace(line), "'"));
    }
    if (step < 0) return bad(absl::StrCat("step ", step, " < 0"));
    if (worker < 0 || worker >= num_workers) {
      return bad(absl::StrCat("worker ", worker, " is not in [0, ", num_workers, ")"));
    }
    if (!(ms >= 0 && std::isfinite(ms))) {
      return bad(absl::StrCat("delay ", words[2], " ms is not a finite delay >= 0"));
    }
    if (!seen.insert({step, worker}).second) {
      return bad(absl::StrCat("step ", step, " of worker ", worker, " given twice"));
    }
    if (worker == worker_id) mine[step] = ms;
  }
  return mine;
}

absl::StatusOr<StragglerModel> StragglerModel::Create(const StragglerOptions& options,
                                                      int worker_id) {
  if (absl::Status s = ValidateStragglerOptions(options); !s.ok()) return s;
  if (worker_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("worker id must be >= 0, got ", worker_id));
  }
  return StragglerModel(options, worker_id);
}

void StragglerModel::ResetEngine() const {
  std::seed_seq seq{static_cast<uint32_t>(options_.seed),
                    static_cast<uint32_t>(options_.seed >> 32), static_cast<uint32_t>(worker_id_)};
  rng_.seed(seq);
  rng_step_ = 0;
}

StragglerModel::StragglerModel(const StragglerOptions& options, int worker_id)
    : options_(options), worker_id_(worker_id) {
  ResetEngine();
  const double m = options_.delay_mean_ms;
  const double sigma = options_.delay_sigma;
  const double alpha = options_.delay_alpha;
  lognormal_mu_ = m > 0 ? std::log(m) - 0.5 * sigma * sigma : 0;
  pareto_scale_ = m * (alpha - 1) / alpha;
}

absl::Duration StragglerModel::ComputeDelay(absl::Duration compute_time) const {
  return ComputeDelay(compute_time, options_.slowdown);
}

absl::Duration StragglerModel::ComputeDelay(absl::Duration compute_time, double slowdown) const {
  if (slowdown == 1 && options_.min_step_ms == 0) return absl::ZeroDuration();
  const absl::Duration floored = std::max(compute_time, absl::Milliseconds(options_.min_step_ms));
  return floored * slowdown - compute_time;
}

bool StragglerModel::SlowAt(int64_t step) const {
  const StragglerOptions& o = options_;
  if (step < o.slow_from_step) return false;
  if (o.slow_period_steps == 0) return true;
  const int64_t since = step - o.slow_from_step;
  if (since % o.slow_period_steps >= o.slow_for_steps) return false;
  return !o.rotate_slow || (since / o.slow_period_steps) % o.num_workers == worker_id_;
}

absl::Duration StragglerModel::RandomDelay(int64_t step) const {
  if (options_.delay_probability == 0 || options_.delay_mean_ms == 0 || step < 0) {
    return absl::ZeroDuration();
  }
  // Move the engine to this step's draws: step s uses outputs 3s, 3s + 1 and 3s + 2.
  if (step < rng_step_) ResetEngine();
  rng_.discard(kDrawsPerStep * static_cast<unsigned long long>(step - rng_step_));
  rng_step_ = step + 1;
  // Always kDrawsPerStep draws: the Bernoulli trial and two uniforms for the delay.
  const double trial = UniformOpenClosed(rng_);
  const double u1 = UniformOpenClosed(rng_);
  const double u2 = UniformOpenClosed(rng_);
  // trial is in (0, 1], so p = 1 always delays and p = 0 never does.
  if (!(trial <= options_.delay_probability)) return absl::ZeroDuration();
  double ms = 0;
  switch (options_.delay_distribution) {
    case DelayDistribution::kExponential:
      ms = -options_.delay_mean_ms * std::log(u1);
      break;
    case DelayDistribution::kLognormal: {
      // Box-Muller: one standard normal from two uniforms.
      const double z = std::sqrt(-2 * std::log(u1)) * std::cos(2 * kPi * u2);
      ms = std::exp(lognormal_mu_ + options_.delay_sigma * z);
      break;
    }
    case DelayDistribution::kPareto:
      ms = pareto_scale_ * std::pow(u1, -1 / options_.delay_alpha);
      break;
  }
  return absl::Milliseconds(ms);
}

absl::Duration StragglerModel::DelayFor(int64_t step, absl::Duration compute_time) {
  absl::Duration delay =
      ComputeDelay(compute_time, SlowAt(step) ? options_.slowdown : 1) + RandomDelay(step);
  if (auto row = options_.trace_ms.find(step); row != options_.trace_ms.end()) {
    delay += absl::Milliseconds(row->second);
  }
  if (options_.pause_at_step.has_value() && step == *options_.pause_at_step && !paused_) {
    paused_ = true;
    delay += absl::Milliseconds(options_.pause_ms);
  }
  return delay;
}

bool StragglerModel::enabled() const {
  return options_.slowdown != 1 || options_.min_step_ms > 0 ||
         (options_.delay_probability > 0 && options_.delay_mean_ms > 0) ||
         options_.pause_at_step.has_value() || options_.crash_at_step.has_value() ||
         !options_.trace_ms.empty();
}

std::string StragglerModel::Describe() const {
  std::vector<std::string> parts;
  if (options_.min_step_ms > 0)
    parts.push_back(absl::StrCat("floor ", options_.min_step_ms, " ms"));
  if (options_.slowdown != 1) {
    std::string slow = absl::StrCat("slowdown ", options_.slowdown);
    if (options_.slow_from_step > 0) absl::StrAppend(&slow, " from step ", options_.slow_from_step);
    if (options_.slow_period_steps > 0) {
      absl::StrAppend(&slow, " for ", options_.slow_for_steps, " of every ",
                      options_.slow_period_steps, " steps");
      if (options_.rotate_slow) {
        absl::StrAppend(&slow, ", in turn with the other ", options_.num_workers - 1, " worker(s)");
      }
    }
    parts.push_back(std::move(slow));
  }
  if (options_.delay_probability > 0 && options_.delay_mean_ms > 0) {
    std::string random = absl::StrCat("p=", options_.delay_probability, " ",
                                      DelayDistributionName(options_.delay_distribution), " mean ",
                                      options_.delay_mean_ms, " ms");
    if (options_.delay_distribution == DelayDistribution::kLognormal) {
      absl::StrAppend(&random, " sigma ", options_.delay_sigma);
    } else if (options_.delay_distribution == DelayDistribution::kPareto) {
      absl::StrAppend(&random, " alpha ", options_.delay_alpha);
    }
    absl::StrAppend(&random, " seed ", options_.seed);
    parts.push_back(std::move(random));
  }
  if (options_.pause_at_step.has_value()) {
    parts.push_back(
        absl::StrCat("pause ", options_.pause_ms, " ms at step ", *options_.pause_at_step));
  }
  if (options_.crash_at_step.has_value()) {
    parts.push_back(absl::StrCat("crash at step ", *options_.crash_at_step));
  }
  if (!options_.trace_ms.empty()) {
    parts.push_back(absl::StrCat("delay trace: ", options_.trace_ms.size(), " step(s)"));
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

}  // namespace rubato
