// The CPU ModelBackend: argument checks around SequentialModel<float>, whose GEMMs Eigen runs on
// `threads` OpenMP threads.
#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/model/layers.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"

namespace rubato {
namespace {

// Evaluate's chunk: at most kEvalChunk examples, and few enough that the forward pass's scratch
// (every layer's output and each convolution's im2col matrix, kept for a backward pass) stays
// within kEvalScratchBytes: 512 examples of the CNN take about 0.5 GB, of the ResNet 2.5 GB.
constexpr int64_t kEvalChunk = 512;
constexpr int64_t kEvalScratchBytes = int64_t{1} << 30;

int64_t EvalChunk(const ModelSpec& spec) {
  const std::vector<ActivationShape> shapes = ActivationShapes(spec);
  int64_t floats = 0;  // per example
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    const LayerSpec& layer = spec.layers[l];
    floats += shapes[l + 1].size();
    if (layer.kind == LayerKind::kConv2D) {
      floats +=
          shapes[l + 1].h * shapes[l + 1].w * layer.kernel_h * layer.kernel_w * layer.in_channels;
    }
  }
  const int64_t fit = kEvalScratchBytes / std::max<int64_t>(1, floats * int64_t{sizeof(float)});
  return std::clamp<int64_t>(fit, 1, kEvalChunk);
}

// Eigen's GEMM thread count is one process-wide variable that every GEMM reads. Written only when
// it changes, under a lock: backends of one count (the in-process workers of a test) then write it
// once and afterwards only read it, where each call writing it raced with the others' GEMMs.
// Backends of different counts in one process still share it.
void UseEigenThreads(int threads) {
  static absl::Mutex mu(absl::kConstInit);
  absl::MutexLock lock(&mu);
  if (Eigen::nbThreads() != threads) Eigen::setNbThreads(threads);
}

class CpuBackend : public ModelBackend {
 public:
  CpuBackend(const ModelSpec& spec, int threads)
      : spec_(spec),
        param_specs_(ModelParamSpecs(spec)),
        classes_(ModelNumClasses(spec)),
        threads_(threads),
        eval_chunk_(EvalChunk(spec)),
        model_(spec) {}

  // "cpu-eigen", with " avx2+fma" in the build for those (bazel/isa.bzl) and the threads if more
  // than one.
  std::string name() const override {
#if defined(__AVX2__) && defined(__FMA__)
    const char* isa = " avx2+fma";
#else
    const char* isa = "";
#endif
    return threads_ == 1 ? absl::StrCat("cpu-eigen", isa)
                         : absl::StrCat("cpu-eigen", isa, " x", threads_, " threads");
  }

  absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                        const float* x, const int32_t* labels, int64_t batch,
                                        absl::Span<const absl::Span<float>> grads,
                                        const GradientsReady& ready,
                                        const WeightsNeeded& needed) override {
    RETURN_IF_ERROR(CheckBackendInputs(param_specs_, params, x, labels, batch, "batch", classes_));
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), grads, "grads"));
    UseEigenThreads(threads_);
    absl::Status stopped;
    SequentialModel<float>::WeightsNeeded wait = nullptr;
    if (needed) {
      wait = [&needed, &stopped](size_t first, size_t count) {
        stopped = needed(first, count);
        return stopped.ok();
      };
    }
    const float loss = model_.ForwardBackward(params, x, labels, batch, grads, ready, wait);
    RETURN_IF_ERROR(stopped);
    if (!std::isfinite(loss)) return NonFiniteLoss(loss, batch);
    if (profiling_) RecordTimes(batch);
    return loss;
  }

  absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                      const float* x, const int32_t* labels, int64_t n) override {
    RETURN_IF_ERROR(CheckBackendInputs(param_specs_, params, x, labels, n, "n", classes_));
    UseEigenThreads(threads_);
    double loss_sum = 0;
    int64_t correct = 0;
    const int64_t input = spec_.input.size();
    for (int64_t start = 0; start < n; start += eval_chunk_) {
      const int64_t chunk = std::min(eval_chunk_, n - start);
      model_.AccumulateLossAndCorrect(params, x + start * input, labels + start, chunk, &loss_sum,
                                      &correct);
    }
    if (!std::isfinite(loss_sum)) return NonFiniteLoss(loss_sum, n);
    return EvalResult{loss_sum / n, static_cast<double>(correct) / n, n};
  }

  void set_profiling(bool on) override {
    profiling_ = on;
    model_.set_timing(on);
  }

  std::vector<LayerTime> layer_times() const override { return times_; }

 private:
  void RecordTimes(int64_t batch) {
    const std::vector<std::string> names = LayerNames(spec_);
    times_.assign(names.size(), LayerTime());
    for (size_t l = 0; l < names.size(); ++l) {
      times_[l].name = names[l];
      times_[l].forward_ms = model_.forward_ms()[l];
      times_[l].backward_ms = model_.backward_ms()[l];
      LayerFlops(spec_, l, batch, &times_[l].forward_flops, &times_[l].backward_flops);
    }
  }

  // Constant after construction.
  const ModelSpec spec_;
  const std::vector<ParamSpec> param_specs_;
  const int64_t classes_;
  const int threads_;
  const int64_t eval_chunk_;  // EvalChunk(spec_)

  SequentialModel<float> model_;  // scratch reused across calls
  bool profiling_ = false;
  std::vector<LayerTime> times_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCpuBackend(const ModelSpec& spec, int threads) {
  RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("threads must be >= 0, got ", threads));
  }
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return std::unique_ptr<ModelBackend>(new CpuBackend(spec, threads));
}

}  // namespace rubato
