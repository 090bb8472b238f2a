#include "common/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <utility>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"

namespace rubato {
namespace {

// Norms are summed per block of this many elements (see SumSquares), and the block sums are added
// in double in block order, so a norm does not depend on how the blocks are spread over threads.
// Every loop works on whole blocks too: each element then goes through the same code whatever the
// pool.
constexpr int64_t kBlock = 4096;
// Smallest share of a ParallelFor, in blocks (32K elements, 128 KiB per stream): below that,
// waking a thread costs more than the pass.
constexpr int64_t kGrainBlocks = 8;

enum class Type { kSgd, kAdam, kAdamW, kLars, kLarc, kLamb };

constexpr const char* kKnownTypes = "sgd, adam, adamw, lars, larc, lamb";

bool ParseType(absl::string_view name, Type* type) {
  static constexpr std::pair<const char*, Type> kTypes[] = {
      {"sgd", Type::kSgd},   {"adam", Type::kAdam}, {"adamw", Type::kAdamW},
      {"lars", Type::kLars}, {"larc", Type::kLarc}, {"lamb", Type::kLamb},
  };
  for (const auto& [n, t] : kTypes) {
    if (name == n) {
      *type = t;
      return true;
    }
  }
  return false;
}

bool IsLarsFamily(Type t) { return t == Type::kLars || t == Type::kLarc; }
bool UsesMomentum(Type t) { return t == Type::kSgd || IsLarsFamily(t); }
bool UsesBetas(Type t) { return t == Type::kAdam || t == Type::kAdamW || t == Type::kLamb; }
bool UsesEpsilon(Type t) { return t != Type::kSgd; }
bool UsesTrustRatio(Type t) { return IsLarsFamily(t) || t == Type::kLamb; }

// ---------------------------------------------------------------------------------------------
// Block kernels: straight loops over `count` (<= kBlock) elements that GCC vectorises. Scalars
// are float so that the loops stay in float; they are computed once per update in double.
//
// The heavy kernels are also compiled for AVX2 and AVX-512F and picked at run time (GCC function
// multiversioning), since the build itself targets baseline x86-64 (SSE2). Without FMA
// (-ffp-contract=off in the BUILD file): every operation is the same IEEE operation in the same
// order, so every version gives identical bits. AVX-512 doubles the width of the square roots and
// divisions that bound Adam and LAMB on one thread (LAMB at 1 MB: 0.47x memcpy's rate with AVX2,
// 0.73x with AVX-512, on this project's AMD EPYC build machine).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RUBATO_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RUBATO_MULTIVERSION
#endif

// Sum of x[i]^2 over one block (<= kBlock elements): kSumLanes float accumulators, lane j taking
// elements j, j + kSumLanes, ..., each in order, then the lanes added in double. A lane adds at
// most kBlock / kSumLanes = 128 squares, so its relative rounding error stays below 128 * 2^-24
// (about 8e-6, and near 1e-7 in practice), and the norm enters only the trust ratio, which scales
// the update rather than the weights. Float lanes keep the loop at full SIMD width; the order is
// fixed, so the result is the same with SSE2 or AVX2 and for any thread count.
constexpr int kSumLanes = 32;
static_assert(kBlock / kSumLanes == kOptimizerSquaresPerLane, "update_guard.cc bounds lane sums");
inline double SumSquares(const float* __restrict x, int64_t count) {
  float acc[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= count; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  for (int j = 0; i < count; ++i, ++j) acc[j] += x[i] * x[i];
  double total = 0;
  for (int j = 0; j < kSumLanes; ++j) total += acc[j];
  return total;
}

struct SquaredNorms {
  double a = 0;
  double b = 0;
};

// w <- w - lr*(g + wd*w)
RUBATO_MULTIVERSION void SgdPlainBlock(const float* __restrict g, float* __restrict w,
                                       int64_t count, float lr, float wd) {
  for (int64_t i = 0; i < count; ++i) w[i] = w[i] - lr * (g[i] + wd * w[i]);
}

// v <- mu*v + (g + wd*w); w <- w - lr*v, or w <- w - lr*(g + wd*w + mu*v) (Nesterov).
template <bool kNesterov>
inline void SgdMomentumBlock(const float* __restrict g, float* __restrict w, float* __restrict v,
                             int64_t count, float lr, float wd, float mu) {
  for (int64_t i = 0; i < count; ++i) {
    const float gp = g[i] + wd * w[i];
    const float vi = mu * v[i] + gp;
    v[i] = vi;
    w[i] = w[i] - lr * (kNesterov ? gp + mu * vi : vi);
  }
}

// Per-update constants of the Adam family. The element math follows torch.optim.Adam's order,
// denominator sqrt(v)/sqrt(1-b2^t) + eps and step lr/(1-b1^t): the same values as the formulas in
// optimizer.h, rounded like the implementation most users compare against. One difference: we
// multiply by 1/sqrt(1-b2^t) where torch divides (the last bit may differ; a division per element
// is a fifth of Adam's time on one thread).
struct AdamScalars {
  float b1, one_minus_b1, b2, one_minus_b2;
  float inv_bc2_sqrt;  // 1/sqrt(1 - b2^t)
  float eps;
};

// adam (kCoupled: g' = g + wd*w; w <- w - step*q) and adamw (g' = g; w <- w - (step*q + lr_wd*w)),
// with q = m/(sqrt(v_hat)+eps), step = lr/(1-b1^t), lr_wd = lr*wd.
template <bool kCoupled>
inline void AdamBlock(const AdamScalars& s, const float* __restrict g, float* __restrict w,
                      float* __restrict m, float* __restrict v, int64_t count, float step, float wd,
                      float lr_wd) {
  for (int64_t i = 0; i < count; ++i) {
    const float wi = w[i];
    const float gp = kCoupled ? g[i] + wd * wi : g[i];
    const float mi = s.b1 * m[i] + s.one_minus_b1 * gp;
    const float vi = s.b2 * v[i] + s.one_minus_b2 * gp * gp;
    m[i] = mi;
    v[i] = vi;
    // q = m_hat/(sqrt(v_hat)+eps) * (1-b1^t)
    const float q = mi / (std::sqrt(vi) * s.inv_bc2_sqrt + s.eps);
    w[i] = kCoupled ? wi - step * q : wi - (step * q + lr_wd * wi);
  }
}

// AdamBlock's two instances, multiversioned (the square root and division bound them).
RUBATO_MULTIVERSION void AdamCoupledBlock(const AdamScalars& s, const float* __restrict g,
                                          float* __restrict w, float* __restrict m,
                                          float* __restrict v, int64_t count, float step,
                                          float wd) {
  AdamBlock<true>(s, g, w, m, v, count, step, wd, 0.0f);
}
RUBATO_MULTIVERSION void AdamDecoupledBlock(const AdamScalars& s, const float* __restrict g,
                                            float* __restrict w, float* __restrict m,
                                            float* __restrict v, int64_t count, float step,
                                            float lr_wd) {
  AdamBlock<false>(s, g, w, m, v, count, step, 0.0f, lr_wd);
}

// LAMB's u = m_hat/(sqrt(v_hat)+eps) + wd*w from moments already updated this step.
inline float LambU(const AdamScalars& s, float m, float v, float w, float inv_bc1, float wd) {
  return m / (std::sqrt(v) * s.inv_bc2_sqrt + s.eps) * inv_bc1 + wd * w;
}

// LAMB pass 1: updates m and v, writes u to `u`, returns ||w||^2 (a) and ||u||^2 (b) of the
// block. The norms are a second loop over data still in L1, so that both loops vectorise.
RUBATO_MULTIVERSION SquaredNorms LambPass1Block(const AdamScalars& s, const float* __restrict g,
                                                const float* __restrict w, float* __restrict m,
                                                float* __restrict v, float* __restrict u,
                                                int64_t count, float inv_bc1, float wd) {
  for (int64_t i = 0; i < count; ++i) {
    const float mi = s.b1 * m[i] + s.one_minus_b1 * g[i];
    const float vi = s.b2 * v[i] + s.one_minus_b2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    u[i] = LambU(s, mi, vi, w[i], inv_bc1, wd);
  }
  return {SumSquares(w, count), SumSquares(u, count)};
}

// LAMB pass 2 from a stored u: w <- w - scale*u.
RUBATO_MULTIVERSION void LambApplyStoredBlock(const float* __restrict u, float* __restrict w,
                                              int64_t count, float scale) {
  for (int64_t i = 0; i < count; ++i) w[i] = w[i] - scale * u[i];
}

// LAMB pass 2 without a stored u: recomputed from the updated moments, bit-identical to pass 1's.
RUBATO_MULTIVERSION void LambApplyRecomputedBlock(const AdamScalars& s, float* __restrict w,
                                                  const float* __restrict m,
                                                  const float* __restrict v, int64_t count,
                                                  float inv_bc1, float wd, float scale) {
  for (int64_t i = 0; i < count; ++i) {
    w[i] = w[i] - scale * LambU(s, m[i], v[i], w[i], inv_bc1, wd);
  }
}

// LAMB with trust fixed at 1: moments and weights in one pass.
RUBATO_MULTIVERSION void LambFusedBlock(const AdamScalars& s, const float* __restrict g,
                                        float* __restrict w, float* __restrict m,
                                        float* __restrict v, int64_t count, float inv_bc1, float wd,
                                        float lr) {
  for (int64_t i = 0; i < count; ++i) {
    const float mi = s.b1 * m[i] + s.one_minus_b1 * g[i];
    const float vi = s.b2 * v[i] + s.one_minus_b2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    w[i] = w[i] - lr * LambU(s, mi, vi, w[i], inv_bc1, wd);
  }
}

// LARS pass 1: ||w||^2 (a) and ||g + wd*w||^2 (b).
RUBATO_MULTIVERSION SquaredNorms LarsNormsBlock(const float* __restrict g,
                                                const float* __restrict w, int64_t count,
                                                float wd) {
  alignas(64) float gp[kBlock];
  for (int64_t i = 0; i < count; ++i) gp[i] = g[i] + wd * w[i];
  return {SumSquares(w, count), SumSquares(gp, count)};
}

// LARS pass 2: v <- mu*v + scale*(g + wd*w); w <- w - v.
RUBATO_MULTIVERSION void LarsApplyBlock(const float* __restrict g, float* __restrict w,
                                        float* __restrict v, int64_t count, float wd, float mu,
                                        float scale) {
  for (int64_t i = 0; i < count; ++i) {
    const float vi = mu * v[i] + scale * (g[i] + wd * w[i]);
    v[i] = vi;
    w[i] = w[i] - vi;
  }
}

// ---------------------------------------------------------------------------------------------
// Drivers: run a block kernel over [0, n), on the pool when there is one.

// Denormal results flushed to zero and denormal operands read as zero (SSE's FTZ and DAZ bits)
// on this thread while in scope, restoring the previous mode after. Every element loop below runs
// under one. A moment that decays geometrically, such as Adam's m for a weight whose gradient is
// exactly 0 (a dead ReLU feature), falls below FLT_MIN (1.2e-38) after some 800 steps, and
// arithmetic on denormals takes a slow path: a BSP CNN job on an H200 machine fell from 150 to 55
// steps/s at step ~800 from this alone. The flush changes only values below 1.2e-38 in magnitude.
class ScopedFlushDenormals {
 public:
#if defined(__SSE__)
  ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~ScopedFlushDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000;  // MXCSR bit 15, flush to zero
  static constexpr unsigned kDaz = 0x0040;  // MXCSR bit 6, denormals are zero
  const unsigned saved_;
#endif
};

// fn(begin, count) for every block.
template <typename Fn>
void ForEachBlock(int64_t n, ThreadPool* pool, const Fn& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  auto run = [n, &fn](int64_t b0, int64_t b1) {
    ScopedFlushDenormals flush;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kBlock;
      fn(begin, std::min(kBlock, n - begin));
    }
  };
  if (pool == nullptr || blocks < 2 * kGrainBlocks) {
    run(0, blocks);
  } else {
    pool->ParallelFor(blocks, kGrainBlocks, run);
  }
}

// Sum of fn(begin, count) over the blocks, added in block order whatever the pool.
template <typename Fn>
SquaredNorms SumOverBlocks(int64_t n, ThreadPool* pool, const Fn& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  SquaredNorms total;
  auto add = [&total](const SquaredNorms& s) {
    total.a += s.a;
    total.b += s.b;
  };
  if (pool == nullptr || blocks < 2 * kGrainBlocks) {
    ScopedFlushDenormals flush;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock;
      add(fn(begin, std::min(kBlock, n - begin)));
    }
    return total;
  }
  std::vector<SquaredNorms> partial(blocks);
  pool->ParallelFor(blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    ScopedFlushDenormals flush;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kBlock;
      partial[b] = fn(begin, std::min(kBlock, n - begin));
    }
  });
  for (const SquaredNorms& s : partial) add(s);
  return total;
}

// Both rules fall back to a trust ratio of 1 when ||w|| or the norm of the step is 0: a fresh
// zero-initialised tensor must still move, and a zero step has no direction to scale.
bool HasTrustRatio(double w_norm, double step_norm) { return w_norm > 0 && step_norm > 0; }

// Sizes an empty slot; a slot of another size is a caller bug (a state from another tensor).
void EnsureSlot(std::vector<float>* slot, size_t n, const char* which) {
  if (slot->size() == n) return;
  if (slot->empty()) {
    slot->assign(n, 0.0f);
    return;
  }
  std::fprintf(stderr, "Optimizer::Update: state %s has %zu floats but the tensor has %zu\n", which,
               slot->size(), n);
  std::abort();
}

// ---------------------------------------------------------------------------------------------

class OptimizerImpl final : public Optimizer {
 public:
  OptimizerImpl(Type type, OptimizerConfig config, std::vector<std::regex> no_decay,
                std::vector<std::regex> no_adaptation)
      : type_(type),
        config_(std::move(config)),
        no_decay_(std::move(no_decay)),
        no_adaptation_(std::move(no_adaptation)) {}

  const OptimizerConfig& config() const override { return config_; }

  TensorRole RoleOf(absl::string_view name, absl::Span<const int64_t> shape) const override {
    TensorRole role;
    role.weight_decay = !Excluded(no_decay_, name, shape);
    role.layer_adaptation = !Excluded(no_adaptation_, name, shape);
    return role;
  }

  void Update(float lr, absl::Span<const float> grad, absl::Span<float> weights,
              const TensorRole& role, TensorOptimizerState* state, ThreadPool* pool) const override;

 private:
  // An empty list excludes tensors of rank <= 1 (biases, norm scales), as the LARS and LAMB
  // reference implementations are used in practice.
  static bool Excluded(const std::vector<std::regex>& patterns, absl::string_view name,
                       absl::Span<const int64_t> shape) {
    if (patterns.empty()) return shape.size() <= 1;
    for (const std::regex& re : patterns) {
      if (std::regex_search(name.begin(), name.end(), re)) return true;
    }
    return false;
  }

  void UpdateSgd(float lr, float wd, const float* g, float* w, int64_t n,
                 TensorOptimizerState* state, ThreadPool* pool) const;
  void UpdateAdam(float lr, float wd, const float* g, float* w, int64_t n,
                  TensorOptimizerState* state, ThreadPool* pool) const;
  // Takes scratch_mu_ only when TryLock succeeds and releases it on the same condition, which
  // the thread-safety analysis cannot follow; scratch_ is touched only while it is held.
  void UpdateLamb(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                  TensorOptimizerState* state,
                  ThreadPool* pool) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void UpdateLars(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                  TensorOptimizerState* state, ThreadPool* pool) const;
  void UpdateLarc(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                  TensorOptimizerState* state, ThreadPool* pool) const;
  AdamScalars AdamScalarsAt(int64_t t) const;

  const Type type_;
  const OptimizerConfig config_;  // Complete and valid.
  const std::vector<std::regex> no_decay_;
  const std::vector<std::regex> no_adaptation_;

  // LAMB's u between its two passes, sized to the largest tensor seen (see UpdateLamb).
  mutable absl::Mutex scratch_mu_;
  mutable std::vector<float> scratch_ ABSL_GUARDED_BY(scratch_mu_);
};

void OptimizerImpl::Update(float lr, absl::Span<const float> grad, absl::Span<float> weights,
                           const TensorRole& role, TensorOptimizerState* state,
                           ThreadPool* pool) const {
  if (grad.size() != weights.size()) {
    std::fprintf(stderr, "Optimizer::Update: gradient has %zu elements, weights %zu\n", grad.size(),
                 weights.size());
    std::abort();
  }
  const int64_t n = static_cast<int64_t>(weights.size());
  const float wd = role.weight_decay ? static_cast<float>(config_.weight_decay()) : 0.0f;
  ++state->step;
  switch (type_) {
    case Type::kSgd:
      UpdateSgd(lr, wd, grad.data(), weights.data(), n, state, pool);
      break;
    case Type::kAdam:
    case Type::kAdamW:
      UpdateAdam(lr, wd, grad.data(), weights.data(), n, state, pool);
      break;
    case Type::kLamb:
      UpdateLamb(lr, wd, role.layer_adaptation, grad.data(), weights.data(), n, state, pool);
      break;
    case Type::kLars:
      UpdateLars(lr, wd, role.layer_adaptation, grad.data(), weights.data(), n, state, pool);
      break;
    case Type::kLarc:
      UpdateLarc(lr, wd, role.layer_adaptation, grad.data(), weights.data(), n, state, pool);
      break;
  }
}

void OptimizerImpl::UpdateSgd(float lr, float wd, const float* g, float* w, int64_t n,
                              TensorOptimizerState* state, ThreadPool* pool) const {
  const float mu = static_cast<float>(config_.momentum());
  if (mu == 0.0f) {
    ForEachBlock(n, pool,
                 [&](int64_t b, int64_t count) { SgdPlainBlock(g + b, w + b, count, lr, wd); });
    return;
  }
  EnsureSlot(&state->slot1, n, "slot1");
  float* v = state->slot1.data();
  // torch starts the buffer at g' rather than mu*0 + g': the same value.
  if (config_.nesterov()) {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      SgdMomentumBlock<true>(g + b, w + b, v + b, count, lr, wd, mu);
    });
  } else {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      SgdMomentumBlock<false>(g + b, w + b, v + b, count, lr, wd, mu);
    });
  }
}

AdamScalars OptimizerImpl::AdamScalarsAt(int64_t t) const {
  const double b1 = config_.beta1();
  const double b2 = config_.beta2();
  AdamScalars s;
  s.b1 = static_cast<float>(b1);
  s.one_minus_b1 = static_cast<float>(1 - b1);
  s.b2 = static_cast<float>(b2);
  s.one_minus_b2 = static_cast<float>(1 - b2);
  s.inv_bc2_sqrt = static_cast<float>(1 / std::sqrt(1 - std::pow(b2, static_cast<double>(t))));
  s.eps = static_cast<float>(config_.epsilon());
  return s;
}

void OptimizerImpl::UpdateAdam(float lr, float wd, const float* g, float* w, int64_t n,
                               TensorOptimizerState* state, ThreadPool* pool) const {
  EnsureSlot(&state->slot1, n, "slot1");
  EnsureSlot(&state->slot2, n, "slot2");
  float* m = state->slot1.data();
  float* v = state->slot2.data();
  const AdamScalars s = AdamScalarsAt(state->step);
  const double bc1 = 1 - std::pow(config_.beta1(), static_cast<double>(state->step));
  const float step = static_cast<float>(lr / bc1);
  if (type_ == Type::kAdam) {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      AdamCoupledBlock(s, g + b, w + b, m + b, v + b, count, step, wd);
    });
  } else {
    // AdamW. torch.optim.AdamW first scales w by (1 - lr*wd) and then takes the Adam step;
    // optimizer.h writes w - lr*(r + wd*w). Both decay the pre-update w, so they are the same
    // number: w*(1 - lr*wd) - lr*r = w - lr*wd*w - lr*r. In float they are not equally good:
    // 1 - lr*wd (e.g. 0.9999) rounds to float with a relative error up to 3e-8 that is applied to
    // every weight at every step, the same sign each time, so torch's grouping drifts by up to
    // 3e-8 * steps (3e-6 after 100 steps); lr*wd*w carries its rounding only on the small
    // decrement. We use the header's grouping.
    const float lr_wd = static_cast<float>(static_cast<double>(lr) * wd);
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      AdamDecoupledBlock(s, g + b, w + b, m + b, v + b, count, step, lr_wd);
    });
  }
}

void OptimizerImpl::UpdateLamb(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                               TensorOptimizerState* state, ThreadPool* pool) const {
  EnsureSlot(&state->slot1, n, "slot1");
  EnsureSlot(&state->slot2, n, "slot2");
  float* m = state->slot1.data();
  float* v = state->slot2.data();
  const AdamScalars s = AdamScalarsAt(state->step);
  const float inv_bc1 =
      static_cast<float>(1 / (1 - std::pow(config_.beta1(), static_cast<double>(state->step))));
  if (!adapt) {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      LambFusedBlock(s, g + b, w + b, m + b, v + b, count, inv_bc1, wd, lr);
    });
    return;
  }
  // Pass 2 needs u once the norms are known. Storing it costs the same memory traffic as
  // recomputing it from m and v (one stream written and read vs. two read), but saves a sqrt and
  // a division per element, which bound a single thread at SSE2 width: 16M elements took ~20 ms
  // instead of ~28 ms. The buffer is the optimizer's; an update that finds it in use by another
  // thread (or a tensor of one block, where it buys nothing) recomputes, with the same bits.
  const bool stored = n > kBlock && scratch_mu_.TryLock();
  float* u = nullptr;
  if (stored) {
    if (scratch_.size() < static_cast<size_t>(n)) scratch_.resize(n);
    u = scratch_.data();
  }
  const SquaredNorms norms = SumOverBlocks(n, pool, [&](int64_t b, int64_t count) {
    alignas(64) float block_u[kBlock];
    return LambPass1Block(s, g + b, w + b, m + b, v + b, stored ? u + b : block_u, count, inv_bc1,
                          wd);
  });
  const double w_norm = std::sqrt(norms.a);
  const double u_norm = std::sqrt(norms.b);
  const double trust = HasTrustRatio(w_norm, u_norm) ? w_norm / u_norm : 1.0;
  const float scale = static_cast<float>(lr * trust);
  if (stored) {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      LambApplyStoredBlock(u + b, w + b, count, scale);
    });
    scratch_mu_.Unlock();
  } else {
    ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
      LambApplyRecomputedBlock(s, w + b, m + b, v + b, count, inv_bc1, wd, scale);
    });
  }
}

void OptimizerImpl::UpdateLars(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                               TensorOptimizerState* state, ThreadPool* pool) const {
  EnsureSlot(&state->slot1, n, "slot1");
  float* v = state->slot1.data();
  double trust = 1;
  if (adapt) {
    const SquaredNorms norms = SumOverBlocks(
        n, pool, [&](int64_t b, int64_t count) { return LarsNormsBlock(g + b, w + b, count, wd); });
    const double w_norm = std::sqrt(norms.a);
    const double g_norm = std::sqrt(norms.b);
    // epsilon (default 0) guards the denominator as in tf.contrib's LARSOptimizer.
    if (HasTrustRatio(w_norm, g_norm)) {
      trust = config_.trust_coefficient() * w_norm / (g_norm + config_.epsilon());
    }
  }
  const float mu = static_cast<float>(config_.momentum());
  const float scale = static_cast<float>(lr * trust);
  ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
    LarsApplyBlock(g + b, w + b, v + b, count, wd, mu, scale);
  });
}

void OptimizerImpl::UpdateLarc(float lr, float wd, bool adapt, const float* g, float* w, int64_t n,
                               TensorOptimizerState* state, ThreadPool* pool) const {
  EnsureSlot(&state->slot1, n, "slot1");
  float* v = state->slot1.data();
  // The rate this tensor's step gets: min(local, lr), i.e. lr * min(local / lr, 1).
  double rate = lr;
  if (adapt) {
    // ||w||^2 and ||g||^2: LarsNormsBlock with no decay folded into the gradient.
    const SquaredNorms norms = SumOverBlocks(
        n, pool, [&](int64_t b, int64_t count) { return LarsNormsBlock(g + b, w + b, count, 0); });
    const double w_norm = std::sqrt(norms.a);
    const double g_norm = std::sqrt(norms.b);
    if (HasTrustRatio(w_norm, g_norm)) {
      const double local =
          config_.trust_coefficient() * w_norm / (g_norm + wd * w_norm + config_.epsilon());
      rate = std::min(local, static_cast<double>(lr));
    }
  }
  const float mu = static_cast<float>(config_.momentum());
  const float scale = static_cast<float>(rate);
  ForEachBlock(n, pool, [&](int64_t b, int64_t count) {
    LarsApplyBlock(g + b, w + b, v + b, count, wd, mu, scale);
  });
}

// ---------------------------------------------------------------------------------------------
// Config.

absl::Status NotApplicable(absl::string_view field, absl::string_view type) {
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer.", field, " does not apply to optimizer type '", type, "'"));
}

absl::Status CheckUnitInterval(absl::string_view field, double value) {
  if (!(value >= 0 && value < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.", field, " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::regex>> CompilePatterns(
    absl::string_view field, const google::protobuf::RepeatedPtrField<std::string>& patterns) {
  std::vector<std::regex> out;
  for (int i = 0; i < patterns.size(); ++i) {
    try {
      out.emplace_back(patterns.Get(i), std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer.", field, "[", i, "]: '",
                                                     patterns.Get(i),
                                                     "' is not a regular expression: ", e.what()));
    }
  }
  return out;
}

// Validates a config whose type is known and whose defaults are filled in.
absl::Status ValidateComplete(const OptimizerConfig& c, Type type) {
  if (!std::isfinite(c.learning_rate()) || c.learning_rate() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.learning_rate must be a positive finite number, got ", c.learning_rate()));
  }
  if (!std::isfinite(c.weight_decay()) || c.weight_decay() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.weight_decay must be a finite number >= 0, got ", c.weight_decay()));
  }
  if (!std::isfinite(c.clip_global_norm()) || c.clip_global_norm() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.clip_global_norm must be a finite number >= 0 (0: off), got ",
                     c.clip_global_norm()));
  }
  if (UsesMomentum(type)) {
    RETURN_IF_ERROR(CheckUnitInterval("momentum", c.momentum()));
  } else if (c.has_momentum()) {
    return NotApplicable("momentum", c.type());
  }
  if (c.nesterov()) {
    if (type != Type::kSgd) return NotApplicable("nesterov", c.type());
    if (c.momentum() == 0) {
      return absl::InvalidArgumentError("optimizer.nesterov needs optimizer.momentum > 0");
    }
  }
  if (UsesBetas(type)) {
    RETURN_IF_ERROR(CheckUnitInterval("beta1", c.beta1()));
    RETURN_IF_ERROR(CheckUnitInterval("beta2", c.beta2()));
  } else if (c.has_beta1()) {
    return NotApplicable("beta1", c.type());
  } else if (c.has_beta2()) {
    return NotApplicable("beta2", c.type());
  }
  if (UsesEpsilon(type)) {
    if (!std::isfinite(c.epsilon()) || c.epsilon() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.epsilon must be a finite number >= 0, got ", c.epsilon()));
    }
    // With eps = 0 an element whose gradient has always been 0 gives m/sqrt(v) = 0/0.
    if (UsesBetas(type) && c.epsilon() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.epsilon must be > 0 for ", c.type(), ", got 0"));
    }
  } else if (c.has_epsilon()) {
    return NotApplicable("epsilon", c.type());
  }
  if (IsLarsFamily(type)) {
    if (!std::isfinite(c.trust_coefficient()) || c.trust_coefficient() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.trust_coefficient must be a positive finite number, got ",
                       c.trust_coefficient()));
    }
  } else if (c.has_trust_coefficient()) {
    return NotApplicable("trust_coefficient", c.type());
  }
  if (!UsesTrustRatio(type) && !c.exclude_from_layer_adaptation().empty()) {
    return NotApplicable("exclude_from_layer_adaptation", c.type());
  }
  RETURN_IF_ERROR(
      CompilePatterns("exclude_from_weight_decay", c.exclude_from_weight_decay()).status());
  RETURN_IF_ERROR(
      CompilePatterns("exclude_from_layer_adaptation", c.exclude_from_layer_adaptation()).status());
  return absl::OkStatus();
}

absl::StatusOr<Type> TypeOf(const OptimizerConfig& config) {
  Type type;
  if (!ParseType(config.type(), &type)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.type: unknown optimizer '",
                                                   config.type(), "' (known: ", kKnownTypes, ")"));
  }
  return type;
}

}  // namespace

absl::StatusOr<OptimizerConfig> CompleteOptimizerConfig(const OptimizerConfig& config) {
  ASSIGN_OR_RETURN(const Type type, TypeOf(config));
  OptimizerConfig c = config;
  if (UsesMomentum(type) && !c.has_momentum()) c.set_momentum(IsLarsFamily(type) ? 0.9 : 0.0);
  if (UsesBetas(type)) {
    if (!c.has_beta1()) c.set_beta1(0.9);
    if (!c.has_beta2()) c.set_beta2(0.999);
  }
  if (UsesEpsilon(type) && !c.has_epsilon()) {
    c.set_epsilon(type == Type::kLamb ? 1e-6 : type == Type::kLars ? 0.0 : 1e-8);
  }
  if (type == Type::kLars && !c.has_trust_coefficient()) c.set_trust_coefficient(0.001);
  if (type == Type::kLarc && !c.has_trust_coefficient()) c.set_trust_coefficient(0.02);
  RETURN_IF_ERROR(ValidateComplete(c, type));
  return c;
}

absl::Status ValidateOptimizerConfig(const OptimizerConfig& config) {
  return CompleteOptimizerConfig(config).status();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config) {
  ASSIGN_OR_RETURN(OptimizerConfig complete, CompleteOptimizerConfig(config));
  ASSIGN_OR_RETURN(const Type type, TypeOf(complete));
  ASSIGN_OR_RETURN(
      std::vector<std::regex> no_decay,
      CompilePatterns("exclude_from_weight_decay", complete.exclude_from_weight_decay()));
  ASSIGN_OR_RETURN(
      std::vector<std::regex> no_adaptation,
      CompilePatterns("exclude_from_layer_adaptation", complete.exclude_from_layer_adaptation()));
  return std::unique_ptr<Optimizer>(
      new OptimizerImpl(type, std::move(complete), std::move(no_decay), std::move(no_adaptation)));
}

TensorOptimizerStateProto SaveOptimizerState(absl::string_view optimizer,
                                             const TensorOptimizerState& state) {
  TensorOptimizerStateProto proto;
  proto.set_optimizer(std::string(optimizer));
  proto.set_step(state.step);
  // Empty slots stay empty (and FloatsToBytes would memcpy from a null pointer).
  if (!state.slot1.empty()) FloatsToBytes(state.slot1, proto.mutable_slot1());
  if (!state.slot2.empty()) FloatsToBytes(state.slot2, proto.mutable_slot2());
  return proto;
}

absl::StatusOr<TensorOptimizerState> LoadOptimizerState(const TensorOptimizerStateProto& proto,
                                                        absl::string_view optimizer,
                                                        int64_t elements) {
  if (proto.optimizer() != optimizer) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state is from optimizer '",
                                                   proto.optimizer(), "', not '", optimizer, "'"));
  }
  if (proto.step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state step must be >= 0, got ", proto.step()));
  }
  TensorOptimizerState state;
  state.step = proto.step();
  auto load = [elements](absl::string_view what, const std::string& bytes,
                         std::vector<float>* slot) -> absl::Status {
    if (bytes.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckFloatBytes(absl::StrCat("optimizer state ", what), bytes, elements));
    slot->resize(elements);
    BytesToFloats(bytes, absl::MakeSpan(*slot));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(load("slot1", proto.slot1(), &state.slot1));
  RETURN_IF_ERROR(load("slot2", proto.slot2(), &state.slot2));
  Type type;
  if (ParseType(optimizer, &type)) {
    // Moments are created by the first update, so a state past step 0 without them is not one
    // this optimizer wrote. (sgd's buffer may be absent: momentum may have been 0.)
    const bool needs_slot1 = type != Type::kSgd;
    const bool needs_slot2 = UsesBetas(type);
    if (state.step > 0 &&
        ((needs_slot1 && state.slot1.empty()) || (needs_slot2 && state.slot2.empty()))) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state for ", optimizer, " at step ",
                                                     state.step, " lacks its moment buffers"));
    }
    if (!needs_slot2 && !state.slot2.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state for ", optimizer, " has a slot2, which it does not use"));
    }
  }
  return state;
}

double ClipByGlobalNorm(absl::Span<const absl::Span<float>> grads, double max_norm) {
  double sum = 0;
  for (absl::Span<float> g : grads) {
    for (size_t b = 0; b < g.size(); b += kBlock) {
      sum += SumSquares(g.data() + b, std::min<int64_t>(kBlock, g.size() - b));
    }
  }
  const double norm = std::sqrt(sum);
  // Under the bound nothing is touched, so small gradients stay bit-identical.
  if (max_norm > 0 && norm > max_norm) {
    const float scale = static_cast<float>(max_norm / norm);
    for (absl::Span<float> g : grads) {
      for (float& x : g) x *= scale;
    }
  }
  return norm;
}

}  // namespace rubato
