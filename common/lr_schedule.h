// LearningRateSchedule: the learning rate of each update, from the base rate, the global batch and
// the update count.
//
//   peak = learning_rate * f(global_batch / reference_batch), f = 1 | linear k | sqrt k
//          (linear: Goyal et al. 2017, arXiv 1706.02677; sqrt: Krizhevsky 2014, Hoffer et al. 2017)
//   warmup (t < W): lr = peak * (t + 1) / W, t the 0-based update count
//   after warmup, with s = t - W:
//     constant     peak
//     step         peak * decay_factor^floor(s / decay_steps)
//     cosine       floor + (peak - floor) * (1 + cos(pi * min(s, D) / D)) / 2
//     polynomial   floor + (peak - floor) * (1 - min(s, D) / D)^power
//   where floor = final_lr_fraction * peak and D = decay_steps - W (the horizon counts the warmup).
#ifndef RUBATO_COMMON_LR_SCHEDULE_H_
#define RUBATO_COMMON_LR_SCHEDULE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "proto/cluster.pb.h"

namespace rubato {

// What the schedule needs to know about the job.
struct ScheduleContext {
  int64_t global_batch = 0;     // Sum of the workers' batches per step.
  int64_t steps_per_epoch = 0;  // Updates per pass over the training set (for warmup_epochs).
  int64_t total_steps = 0;      // Updates in the whole job (default decay horizon).
};

class LearningRateScheduler {
 public:
  // InvalidArgument naming the field: unknown scaling or decay, negative values, both warmup_steps
  // and warmup_epochs, warmup longer than the decay horizon, decay_steps < 1 for step decay, a
  // final_lr_fraction outside [0, 1], or a context with global_batch < 1.
  static absl::StatusOr<LearningRateScheduler> Create(double base_learning_rate,
                                                      const LearningRateSchedule& schedule,
                                                      const ScheduleContext& context);

  // Learning rate of update t (0-based: the update that takes version t to t + 1).
  double At(int64_t t) const;

  // The factor by which the scaling rule changes the rate when the global batch becomes
  // `global_batch` instead of the context's (an adaptive batch, common/batch_plan.h): 1 for none,
  // global_batch / context.global_batch for linear, its square root for sqrt.
  double BatchFactor(int64_t global_batch) const;

  // The context's global batch, the one the peak is scaled for.
  int64_t global_batch() const { return context_.global_batch; }
  double peak() const { return peak_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  int64_t decay_horizon() const { return horizon_; }

  // A few lines for the start-up log: base, scaling, peak, warmup, decay, and the rate at the
  // start, end of warmup, mid-way and end.
  std::string Describe() const;

 private:
  LearningRateScheduler() = default;

  double base_ = 0;
  double peak_ = 0;
  LearningRateSchedule schedule_;
  ScheduleContext context_;
  int64_t warmup_steps_ = 0;
  int64_t horizon_ = 0;  // Decay horizon in updates, warmup included.
};

}  // namespace rubato

#endif  // RUBATO_COMMON_LR_SCHEDULE_H_
