// model_benchmark: the time of one training step of a --model on each backend, per layer and
// whole, with the speed of every GEMM layer set beside a bound measured in the same run:
//   cpu:  the layer's GFLOP/s (its whole forward or backward, im2col and col2im included) against
//         one plain Eigen GEMM of the layer's forward shape on the same threads;
//   cuda: the layer's GFLOP/s against cuBLAS's SGEMM on the same shape and against cuBLAS's peak
//         (an 8192^3 SGEMM), and the step time against the CPU backend's.
//
//   bazel run -c opt //worker/model:model_benchmark -- --model=cnn --batch=64 --backends=cpu,cuda
//
// Figures are medians over --reps steps after --warmup; the machine is shared, so compare rows of
// one run, not runs.
#include <Eigen/Dense>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "worker/model/cuda/cuda_backend.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"

ABSL_FLAG(std::string, model, "cnn", "The model, as the worker's --model.");
ABSL_FLAG(int, batch, 64, "Examples per step.");
ABSL_FLAG(int, warmup, 2, "Untimed steps first.");
ABSL_FLAG(int, reps, 10, "Timed steps; the median is reported.");
ABSL_FLAG(std::string, backends, "cpu,cuda",
          "Comma-separated: cpu (one thread), cpu:N (N threads, 0 for one per core), cuda. A "
          "backend that cannot start (no GPU) is reported and skipped.");

namespace rubato {
namespace {

using Clock = std::chrono::steady_clock;
using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// GFLOP/s of one Eigen product (m, k) x (k, n) on `threads` threads: median of `reps`.
double EigenGemmGflops(int64_t m, int64_t n, int64_t k, int threads, int reps) {
  Eigen::setNbThreads(threads);
  RowMajor a = RowMajor::Random(m, k), b = RowMajor::Random(k, n), c(m, n);
  c.noalias() = a * b;  // warm-up
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    c.noalias() = a * b;
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 2.0 * m * n * k / Median(s) / 1e9;
}

// The forward GEMM of layer l: rows (m), output columns (n), inner dimension (k); false if none.
bool ForwardGemmShape(const ModelSpec& spec, size_t l, int64_t batch, int64_t* m, int64_t* n,
                      int64_t* k) {
  const LayerSpec& layer = spec.layers[l];
  if (layer.kind == LayerKind::kDense) {
    *m = batch;
    *n = layer.out;
    *k = layer.in;
    return true;
  }
  if (layer.kind == LayerKind::kConv2D) {
    const ActivationShape out = ActivationShapes(spec)[l + 1];
    *m = batch * out.h * out.w;
    *n = layer.out_channels;
    *k = layer.kernel_h * layer.kernel_w * layer.in_channels;
    return true;
  }
  return false;
}

struct BackendRun {
  std::string label;
  std::unique_ptr<ModelBackend> backend;
  int threads = 0;  // cpu only
  bool cuda = false;
};

int Run() {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) {
    std::fprintf(stderr, "model_benchmark: error: --model: %s\n",
                 std::string(spec.status().message()).c_str());
    return 2;
  }
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const int reps = absl::GetFlag(FLAGS_reps), warmup = absl::GetFlag(FLAGS_warmup);
  if (batch < 1 || reps < 1 || warmup < 0) {
    std::fprintf(stderr, "model_benchmark: error: --batch and --reps must be >= 1\n");
    return 2;
  }
  std::vector<BackendRun> runs;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_backends), ',')) {
    BackendRun run;
    run.label = std::string(b);
    absl::StatusOr<std::unique_ptr<ModelBackend>> made;
    if (b == "cuda") {
      made = CreateCudaBackend(*spec);
      run.cuda = true;
    } else if (b == "cpu" || absl::StartsWith(b, "cpu:")) {
      run.threads = 1;
      if (b != "cpu" && !absl::SimpleAtoi(b.substr(4), &run.threads)) {
        std::fprintf(stderr, "model_benchmark: error: --backends: bad thread count in '%s'\n",
                     run.label.c_str());
        return 2;
      }
      if (run.threads == 0) run.threads = std::max(1u, std::thread::hardware_concurrency());
      made = CreateCpuBackend(*spec, run.threads);
    } else {
      std::fprintf(stderr, "model_benchmark: error: --backends: unknown backend '%s'\n",
                   run.label.c_str());
      return 2;
    }
    if (!made.ok()) {
      std::printf("backend %s: skipped: %s\n", run.label.c_str(),
                  std::string(made.status().message()).c_str());
      continue;
    }
    run.backend = std::move(*made);
    runs.push_back(std::move(run));
  }

  // Inputs like pixels, labels over the classes, the model's initial weights.
  const std::vector<ParamSpec> specs = ModelParamSpecs(*spec);
  const std::vector<std::vector<float>> params = InitModelParams(*spec, 1);
  std::vector<absl::Span<const float>> param_spans(params.begin(), params.end());
  std::vector<std::vector<float>> grads;
  for (const ParamSpec& p : specs) grads.emplace_back(p.elements());
  std::vector<absl::Span<float>> grad_spans(grads.begin(), grads.end());
  std::vector<float> x(batch * spec->input.size());
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> uniform(0, 1);
  for (float& v : x) v = uniform(rng);
  std::vector<int32_t> labels(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = static_cast<int32_t>(i % ModelNumClasses(*spec));

  std::printf("model %s, %lld parameters, batch %lld, median of %d steps after %d warm-up\n",
              absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(ModelParamCount(*spec)),
              static_cast<long long>(batch), reps, warmup);
  std::map<std::string, double> step_ms;
  double cublas_peak = 0;
  for (BackendRun& run : runs) {
    ModelBackend* backend = run.backend.get();
    // Whole steps, unprofiled.
    std::vector<double> ms;
    for (int r = 0; r < warmup + reps; ++r) {
      const auto t0 = Clock::now();
      absl::StatusOr<float> loss =
          backend->ForwardBackward(param_spans, x.data(), labels.data(), batch, grad_spans);
      if (!loss.ok()) {
        std::fprintf(stderr, "model_benchmark: error: %s: %s\n", run.label.c_str(),
                     std::string(loss.status().message()).c_str());
        return 1;
      }
      if (r >= warmup) {
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    }
    step_ms[run.label] = Median(ms);
    // Per layer, profiled (the backend synchronises after each layer): medians per layer.
    backend->set_profiling(true);
    std::vector<std::vector<double>> fwd(spec->layers.size()), bwd(spec->layers.size());
    std::vector<LayerTime> last;
    for (int r = 0; r < reps; ++r) {
      if (!backend->ForwardBackward(param_spans, x.data(), labels.data(), batch, grad_spans).ok()) {
        return 1;
      }
      last = backend->layer_times();
      for (size_t l = 0; l < last.size(); ++l) {
        fwd[l].push_back(last[l].forward_ms);
        bwd[l].push_back(last[l].backward_ms);
      }
    }
    backend->set_profiling(false);
    if (run.cuda && cublas_peak == 0) {
      absl::StatusOr<double> peak = CublasSgemmGflops(8192, 8192, 8192, 5);
      if (peak.ok()) cublas_peak = *peak;
    }
    std::printf("\nbackend %s: step %.3f ms (%.0f examples/s)\n", backend->name().c_str(),
                step_ms[run.label], 1e3 * batch / step_ms[run.label]);
    if (run.cuda) {
      std::printf("  cuBLAS SGEMM peak (8192^3, FP32): %.0f GFLOP/s\n", cublas_peak);
      std::printf("  %-8s %9s %9s %10s %10s %13s %9s\n", "layer", "fwd ms", "bwd ms", "fwd GF/s",
                  "bwd GF/s", "cuBLAS GF/s", "of peak");
    } else {
      std::printf("  %-8s %9s %9s %10s %10s %13s %9s\n", "layer", "fwd ms", "bwd ms", "fwd GF/s",
                  "bwd GF/s", "Eigen GF/s", "fwd/Eigen");
    }
    for (size_t l = 0; l < last.size(); ++l) {
      const double f_ms = Median(fwd[l]), b_ms = Median(bwd[l]);
      int64_t m = 0, n = 0, k = 0;
      if (!ForwardGemmShape(*spec, l, batch, &m, &n, &k)) {
        std::printf("  %-8s %9.3f %9.3f\n", last[l].name.c_str(), f_ms, b_ms);
        continue;
      }
      const double f_gf = last[l].forward_flops / (f_ms * 1e6);
      const double b_gf = last[l].backward_flops / (b_ms * 1e6);
      double bound = 0;
      if (run.cuda) {
        absl::StatusOr<double> g = CublasSgemmGflops(m, n, k, reps);
        bound = g.ok() ? *g : 0;
        std::printf("  %-8s %9.3f %9.3f %10.1f %10.1f %13.1f %8.1f%%   GEMM %lldx%lldx%lld\n",
                    last[l].name.c_str(), f_ms, b_ms, f_gf, b_gf, bound,
                    cublas_peak > 0 ? 100 * f_gf / cublas_peak : 0.0, static_cast<long long>(m),
                    static_cast<long long>(n), static_cast<long long>(k));
      } else {
        bound = EigenGemmGflops(m, n, k, run.threads, reps);
        std::printf("  %-8s %9.3f %9.3f %10.1f %10.1f %13.1f %8.0f%%   GEMM %lldx%lldx%lld\n",
                    last[l].name.c_str(), f_ms, b_ms, f_gf, b_gf, bound, 100 * f_gf / bound,
                    static_cast<long long>(m), static_cast<long long>(n),
                    static_cast<long long>(k));
      }
    }
  }
  if (step_ms.count("cuda") && step_ms.count("cpu")) {
    std::printf("\ncuda step is %.1fx faster than cpu (one thread)\n",
                step_ms["cpu"] / step_ms["cuda"]);
  }
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return rubato::Run();
}
