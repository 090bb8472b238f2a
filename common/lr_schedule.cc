#include "common/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr double kDefaultDecayFactor = 0.1;
constexpr double kDefaultPower = 1.0;

absl::Status Invalid(absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("lr_schedule.", field, ": ", message));
}

// The field a warmup came from, for messages.
absl::string_view WarmupField(const LearningRateSchedule& s) {
  return s.warmup_epochs() > 0 ? "warmup_epochs" : "warmup_steps";
}

// Checks the base rate and the job's figures, before any field of the schedule.
absl::Status ValidateBaseAndContext(double base_learning_rate, const ScheduleContext& context) {
  if (!(base_learning_rate > 0) || !std::isfinite(base_learning_rate)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.learning_rate: must be positive and finite, got ", base_learning_rate));
  }
  if (context.global_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch: must be >= 1 (the sum of the workers' batches), got ",
                     context.global_batch));
  }
  if (context.steps_per_epoch < 0 || context.total_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps per epoch and total steps must be >= 0, got ", context.steps_per_epoch,
                     " and ", context.total_steps));
  }
  return absl::OkStatus();
}

// The peak rate from the scaling rule (an empty scaling becomes "none" in `c`).
absl::StatusOr<double> ScaledPeak(double base_learning_rate, int64_t global_batch,
                                  LearningRateSchedule* c) {
  if (c->reference_batch() < 0) {
    return Invalid("reference_batch", absl::StrCat("must be >= 0 (0: the job's global batch), got ",
                                                   c->reference_batch()));
  }
  const double k =
      c->reference_batch() == 0 ? 1.0 : static_cast<double>(global_batch) / c->reference_batch();
  if (c->scaling().empty()) c->set_scaling("none");
  if (c->scaling() == "none") return base_learning_rate;
  if (c->scaling() == "linear") return base_learning_rate * k;
  if (c->scaling() == "sqrt") return base_learning_rate * std::sqrt(k);
  return Invalid("scaling", absl::StrCat("unknown '", c->scaling(), "' (none, linear, sqrt)"));
}

// The warmup in updates, from warmup_steps or warmup_epochs (at most one of them).
absl::StatusOr<int64_t> WarmupUpdates(const LearningRateSchedule& c,
                                      const ScheduleContext& context) {
  if (c.warmup_steps() < 0) {
    return Invalid("warmup_steps", absl::StrCat("must be >= 0, got ", c.warmup_steps()));
  }
  if (!(c.warmup_epochs() >= 0) || !std::isfinite(c.warmup_epochs())) {
    return Invalid("warmup_epochs",
                   absl::StrCat("must be finite and >= 0, got ", c.warmup_epochs()));
  }
  if (c.warmup_steps() > 0 && c.warmup_epochs() > 0) {
    return Invalid("warmup_epochs", "set warmup_steps or warmup_epochs, not both");
  }
  if (c.warmup_epochs() <= 0) return c.warmup_steps();
  if (context.steps_per_epoch <= 0) {
    return Invalid("warmup_epochs",
                   "needs the number of updates per epoch, which this job does not know; "
                   "use warmup_steps");
  }
  const double updates = c.warmup_epochs() * static_cast<double>(context.steps_per_epoch);
  if (updates > 1e15) {
    return Invalid("warmup_epochs", absl::StrCat(c.warmup_epochs(), " epochs is too long"));
  }
  return std::llround(updates);
}

// Checks the decay and the fields that belong to it, and fills in their defaults in `c` (an empty
// decay becomes "constant"; step decay's factor and polynomial decay's power when not set).
absl::Status ValidateDecay(LearningRateSchedule* c) {
  if (c->decay().empty()) c->set_decay("constant");
  const std::string& decay = c->decay();
  if (decay != "constant" && decay != "step" && decay != "cosine" && decay != "polynomial") {
    return Invalid("decay",
                   absl::StrCat("unknown '", decay, "' (constant, step, cosine, polynomial)"));
  }
  if (c->decay_steps() < 0) {
    return Invalid("decay_steps", absl::StrCat("must be >= 0, got ", c->decay_steps()));
  }
  // A field set for another decay is almost always a forgotten `decay`: refuse it.
  if (c->has_decay_factor() && decay != "step") {
    return Invalid("decay_factor", absl::StrCat("applies to step decay only, not '", decay, "'"));
  }
  if (c->has_power() && decay != "polynomial") {
    return Invalid("power", absl::StrCat("applies to polynomial decay only, not '", decay, "'"));
  }
  if (c->final_lr_fraction() != 0 && decay != "cosine" && decay != "polynomial") {
    return Invalid("final_lr_fraction",
                   absl::StrCat("applies to cosine and polynomial decay only, not '", decay, "'"));
  }
  if (c->decay_steps() != 0 && decay == "constant") {
    return Invalid("decay_steps", "does not apply to constant decay");
  }
  if (!(c->final_lr_fraction() >= 0 && c->final_lr_fraction() <= 1)) {
    return Invalid("final_lr_fraction",
                   absl::StrCat("must be in [0, 1], got ", c->final_lr_fraction()));
  }
  if (decay == "step") {
    if (c->decay_steps() < 1) {
      return Invalid("decay_steps", "step decay needs decay_steps >= 1 (updates between drops)");
    }
    if (!c->has_decay_factor()) c->set_decay_factor(kDefaultDecayFactor);
    if (!(c->decay_factor() > 0 && c->decay_factor() <= 1)) {
      return Invalid("decay_factor", absl::StrCat("must be in (0, 1], got ", c->decay_factor()));
    }
  }
  if (decay == "polynomial") {
    if (!c->has_power()) c->set_power(kDefaultPower);
    if (!(c->power() > 0) || !std::isfinite(c->power())) {
      return Invalid("power", absl::StrCat("must be positive and finite, got ", c->power()));
    }
  }
  return absl::OkStatus();
}

// The decay horizon in updates: where cosine and polynomial reach the floor; otherwise the job's
// length (0: unknown). Refuses a warmup longer than it.
absl::StatusOr<int64_t> DecayHorizon(const LearningRateSchedule& c, const ScheduleContext& context,
                                     int64_t warmup_steps) {
  const std::string& decay = c.decay();
  int64_t horizon = 0;
  if (decay == "cosine" || decay == "polynomial") {
    horizon = c.decay_steps() > 0 ? c.decay_steps() : context.total_steps;
    if (horizon == 0) {
      return Invalid("decay_steps",
                     absl::StrCat(decay,
                                  " decay needs a horizon: set decay_steps or the job's total "
                                  "steps"));
    }
  } else {
    horizon = context.total_steps;
  }
  if (horizon > 0 && warmup_steps > horizon) {
    const bool from_decay_steps = horizon != context.total_steps;
    return Invalid(WarmupField(c), absl::StrCat(warmup_steps, " warmup updates is longer than the ",
                                                from_decay_steps ? "decay horizon (decay_steps) of "
                                                                 : "job's total steps of ",
                                                horizon));
  }
  return horizon;
}

}  // namespace

absl::StatusOr<LearningRateScheduler> LearningRateScheduler::Create(
    double base_learning_rate, const LearningRateSchedule& schedule,
    const ScheduleContext& context) {
  RETURN_IF_ERROR(ValidateBaseAndContext(base_learning_rate, context));
  LearningRateScheduler s;
  s.base_ = base_learning_rate;
  s.context_ = context;
  LearningRateSchedule& c = s.schedule_;
  c = schedule;
  ASSIGN_OR_RETURN(s.peak_, ScaledPeak(base_learning_rate, context.global_batch, &c));
  ASSIGN_OR_RETURN(s.warmup_steps_, WarmupUpdates(c, context));
  RETURN_IF_ERROR(ValidateDecay(&c));
  ASSIGN_OR_RETURN(s.horizon_, DecayHorizon(c, context, s.warmup_steps_));
  return s;
}

double LearningRateScheduler::At(int64_t t) const {
  t = std::max<int64_t>(t, 0);
  const int64_t w = warmup_steps_;
  if (t < w) return peak_ * static_cast<double>(t + 1) / static_cast<double>(w);
  const int64_t s = t - w;
  const std::string& decay = schedule_.decay();
  if (decay == "step") {
    return peak_ *
           std::pow(schedule_.decay_factor(), static_cast<double>(s / schedule_.decay_steps()));
  }
  if (decay == "cosine" || decay == "polynomial") {
    const double floor = schedule_.final_lr_fraction() * peak_;
    const int64_t d = horizon_ - w;
    // d == 0 (warmup fills the horizon): the floor straight after warmup.
    if (s >= d) return floor;
    const double x = static_cast<double>(s) / static_cast<double>(d);
    if (decay == "cosine") return floor + (peak_ - floor) * (1 + std::cos(kPi * x)) / 2;
    return floor + (peak_ - floor) * std::pow(1 - x, schedule_.power());
  }
  return peak_;
}

double LearningRateScheduler::BatchFactor(int64_t global_batch) const {
  if (global_batch == context_.global_batch || context_.global_batch < 1) return 1.0;
  const double k = static_cast<double>(global_batch) / static_cast<double>(context_.global_batch);
  if (schedule_.scaling() == "linear") return k;
  if (schedule_.scaling() == "sqrt") return std::sqrt(k);
  return 1.0;
}

std::string LearningRateScheduler::Describe() const {
  const LearningRateSchedule& c = schedule_;
  std::string out = absl::StrCat("learning rate: base ", base_, " at reference batch ");
  if (c.reference_batch() == 0) {
    absl::StrAppend(&out, "0 (= global)");
  } else {
    absl::StrAppend(&out, c.reference_batch());
  }
  const double k = c.reference_batch() == 0
                       ? 1.0
                       : static_cast<double>(context_.global_batch) / c.reference_batch();
  absl::StrAppend(&out, ", update batch ", context_.global_batch, " (k = ", k, "), scaling ",
                  c.scaling(), " -> peak ", peak_, "\n");

  absl::StrAppend(&out, "  warmup: ");
  if (warmup_steps_ == 0) {
    absl::StrAppend(&out, "none\n");
  } else {
    absl::StrAppend(&out, warmup_steps_, " updates");
    if (c.warmup_epochs() > 0) {
      absl::StrAppend(&out, " (", c.warmup_epochs(), " epochs x ", context_.steps_per_epoch,
                      " updates)");
    }
    absl::StrAppend(&out, ", linear from peak/", warmup_steps_, "\n");
  }

  absl::StrAppend(&out, "  decay: ", c.decay());
  if (c.decay() == "step") {
    absl::StrAppend(&out, ", x", c.decay_factor(), " every ", c.decay_steps(), " updates");
  } else if (c.decay() == "cosine" || c.decay() == "polynomial") {
    if (c.decay() == "polynomial") absl::StrAppend(&out, " (power ", c.power(), ")");
    absl::StrAppend(&out, " to ", c.final_lr_fraction(), " x peak at update ", horizon_);
  }
  absl::StrAppend(&out, "\n  lr: t=0 ", At(0));
  if (warmup_steps_ > 0) {
    absl::StrAppend(&out, ", end of warmup (t=", warmup_steps_ - 1, ") ", At(warmup_steps_ - 1));
  }
  if (horizon_ > 0) {
    const int64_t mid = warmup_steps_ + (horizon_ - warmup_steps_) / 2;
    absl::StrAppend(&out, ", half-way (t=", mid, ") ", At(mid));
  }
  const int64_t last = (context_.total_steps > 0 ? context_.total_steps : horizon_) - 1;
  if (last >= 0) absl::StrAppend(&out, ", last (t=", last, ") ", At(last));
  return out;
}

}  // namespace rubato
