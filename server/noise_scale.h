// The gradient noise scale, measured where the gradients meet: a bsp or backup shard sees every
// worker's gradient of a step and forms their mean, which are gradients of the same weights at two
// batch sizes, B_small (one worker's batch, B) and B_big (n workers' together, n*B).
//
// McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018
// (arXiv 1812.06162), Appendix A: with E|G_B|^2 = |G|^2 + tr(Sigma)/B, the two batch sizes give
// unbiased estimates
//   |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
//   tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
// and B_simple = tr(Sigma) / |G|^2, the batch size at which training is about half as fast per
// step as at an infinite batch, and twice as efficient per example as at a large one.
//
// Here |G_small|^2 is the mean of the n workers' |g_i|^2 (n estimates at B_small, averaged: the
// same expectation, less variance than one) and |G_big|^2 = |mean_i g_i|^2. With B_big = n B both
// estimates reduce to
//   |G|^2     = (n |G_big|^2 - |G_small|^2) / (n - 1)
//   tr(Sigma) = B n (|G_small|^2 - |G_big|^2) / (n - 1)
// Both are sums over parameters, so each tensor gives its own terms and a job's are the sums over
// its tensors and shards: a shard reports its partial sums (NoiseScaleStats) and whoever sees every
// shard (each worker, through its push responses; the launcher, through GetStats) adds them up.
//
// One step's estimates are noisy; either can be negative. For Gaussian gradient noise of variance
// s^2 / B per coordinate over d coordinates (tr(Sigma) = d s^2), mean and deviations are
// independent and, with B_simple = tr(Sigma) / |G|^2:
//   tr(Sigma) estimate: distributed as tr(Sigma) chi^2_k / k with k = d (n - 1), a relative
//     standard deviation of sqrt(2 / (d (n - 1)));
//   |G|^2 estimate: variance 4 |G|^2 s^2 / (n B) + 2 d s^4 / (n (n - 1) B^2), a relative standard
//     deviation of sqrt(4 B_simple / (n d B) + 2 (B_simple / B)^2 / (d n (n - 1))).
// So tr(Sigma) is measured well in one step of a large model, and |G|^2 is the hard part when the
// noise dominates (B_simple >> B): its error grows like B_simple / B. As the paper does, the two
// are smoothed separately by exponential moving averages (bias-corrected, as Adam's moments; decay
// a averages about (1 + a) / (1 - a) independent steps: 39 at the default 0.95) and only then
// divided. noise_scale_test checks these figures on synthetic gradients.
//
// backup:b: a step's mean is over the first n - b gradients to arrive, so n above is the number
// added. Which workers those are depends on speed, not on the gradients' values, so the estimates
// stay unbiased; with fewer gradients per step the trace's variance grows by (n - 1)/(n - b - 1).
// A step of a single gradient (n = 1) says nothing about the noise and is skipped. async and ssp
// apply each gradient alone at its own weights: there is no pair of batch sizes, and nothing is
// measured.
//
// Thread-safe.
#ifndef RUBATO_SERVER_NOISE_SCALE_H_
#define RUBATO_SERVER_NOISE_SCALE_H_

#include <cstdint>
#include <map>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/parameter_server.pb.h"

namespace rubato {

// One tensor's (or a sum of tensors') terms for one step: |G|^2 and tr(Sigma)/B.
struct NoiseTerms {
  double g2 = 0;
  double trace_over_batch = 0;
  int workers = 0;  // Gradients in the mean (the smallest over the summed tensors).
};

// The terms from n gradients: `small` = (1/n) sum_i |g_i|^2, `big` = |mean_i g_i|^2 (zero terms
// for n < 2, which measure nothing).
NoiseTerms EstimateNoiseTerms(int n, double small, double big);

// The two estimates, smoothed separately: m <- d m + (1 - d) x, reported as m / (1 - d^t) after t
// steps, as Adam corrects its moments, so that early values are not pulled towards 0.
class NoiseScaleEma {
 public:
  explicit NoiseScaleEma(double decay) : decay_(decay) {}
  void Add(double g2, double trace);
  double g2() const;
  double trace() const;
  int64_t steps() const { return steps_; }

 private:
  double decay_;
  double g2_ = 0, trace_ = 0, power_ = 1;
  int64_t steps_ = 0;
};

// Gathers a shard's tensors' terms step by step into the shard's partial sums.
class NoiseScaleMonitor {
 public:
  // `ema_decay` in [0, 1).
  NoiseScaleMonitor(int shard_id, double ema_decay);

  // How many tensors report each step (the shard's, once it has them).
  void SetTensors(int tensors);

  // A worker's batch size (each registrant's). If two differ the estimators' B is not defined and
  // nothing more is measured (stats say so by batch_small 0).
  void SetBatch(int batch);
  // An adaptive batch (common/batch_plan.h): every worker's batch is `batch` from `step` on.
  void SetBatchFrom(int64_t step, int batch);

  // One tensor's terms for `step` (its version before the update), for every step it applies.
  // When every tensor has given step s, s is measured, in step order, unless some tensor's mean
  // was of a single gradient; a step that some tensor never gives is passed over once
  // kMaxPending later steps wait.
  void Add(int64_t step, const NoiseTerms& terms);

  // The newest step measured and the moving averages then (step -1 before the first).
  NoiseScaleStats Stats() const;
  // The same as of step `step`, if it is one of the last kHistory measured.
  std::optional<NoiseScaleStats> StatsAt(int64_t step) const;
  static constexpr size_t kHistory = 64;

 private:
  void Measure(int64_t step, const NoiseTerms& sum) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int BatchAt(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  int tensors_ ABSL_GUARDED_BY(mu_) = 0;
  int batch_ ABSL_GUARDED_BY(mu_) = 0;
  bool unequal_batches_ ABSL_GUARDED_BY(mu_) = false;
  std::map<int64_t, int> batch_from_ ABSL_GUARDED_BY(mu_);  // SetBatchFrom's changes.
  struct Pending {
    int tensors = 0;
    NoiseTerms sum;
  };
  std::map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  int64_t next_ ABSL_GUARDED_BY(mu_) = -1;  // The next step to measure (-1: the first given).
  const int shard_id_;
  NoiseScaleEma ema_ ABSL_GUARDED_BY(mu_);
  // The figures as of each of the last kHistory steps measured; the newest is Stats().
  std::map<int64_t, NoiseScaleStats> history_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_SERVER_NOISE_SCALE_H_
