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
#include <optional>
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
#include "common/isa_dispatch.h"
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

// A backend of --backends, with what its rows need.
struct BackendRun {
  std::string label;
  std::unique_ptr<ModelBackend> backend;
  int threads = 0;  // cpu only
  bool cuda = false;
};

// The backends --backends names, those that cannot start reported and left out; nullopt (and a
// message) for an entry that names no backend.
std::optional<std::vector<BackendRun>> BackendsFromFlag(const ModelSpec& spec) {
  std::vector<BackendRun> runs;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_backends), ',')) {
    BackendRun run;
    run.label = std::string(b);
    absl::StatusOr<std::unique_ptr<ModelBackend>> made;
    if (b == "cuda") {
      made = CreateCudaBackend(spec);
      run.cuda = true;
    } else if (b == "cpu" || absl::StartsWith(b, "cpu:")) {
      run.threads = 1;
      if (b != "cpu" && !absl::SimpleAtoi(b.substr(4), &run.threads)) {
        std::fprintf(stderr, "model_benchmark: error: --backends: bad thread count in '%s'\n",
                     run.label.c_str());
        return std::nullopt;
      }
      if (run.threads == 0) run.threads = std::max(1u, std::thread::hardware_concurrency());
      made = CreateCpuBackend(spec, run.threads);
    } else {
      std::fprintf(stderr, "model_benchmark: error: --backends: unknown backend '%s'\n",
                   run.label.c_str());
      return std::nullopt;
    }
    if (!made.ok()) {
      std::printf("backend %s: skipped: %s\n", run.label.c_str(),
                  std::string(made.status().message()).c_str());
      continue;
    }
    run.backend = std::move(*made);
    runs.push_back(std::move(run));
  }
  return runs;
}

// One step's arguments: inputs like pixels, labels over the classes, the model's initial weights,
// and the gradients' room. Not copied: the spans point into the vectors.
struct StepInputs {
  StepInputs(const ModelSpec& spec, int64_t batch_size);
  StepInputs(const StepInputs&) = delete;
  StepInputs& operator=(const StepInputs&) = delete;

  int64_t batch;
  std::vector<std::vector<float>> params;
  std::vector<absl::Span<const float>> param_spans;
  std::vector<std::vector<float>> grads;
  std::vector<absl::Span<float>> grad_spans;
  std::vector<float> x;         // (batch, input size)
  std::vector<int32_t> labels;  // (batch)
};

StepInputs::StepInputs(const ModelSpec& spec, int64_t batch_size)
    : batch(batch_size),
      params(InitModelParams(spec, 1)),
      param_spans(params.begin(), params.end()) {
  for (const ParamSpec& p : ModelParamSpecs(spec)) grads.emplace_back(p.elements());
  grad_spans = std::vector<absl::Span<float>>(grads.begin(), grads.end());
  x.resize(batch * spec.input.size());
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> uniform(0, 1);
  for (float& v : x) v = uniform(rng);
  labels.resize(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = static_cast<int32_t>(i % ModelNumClasses(spec));
}

// The median time of a whole step, unprofiled, over `reps` steps after `warmup`; the backend's
// error if a step fails.
absl::StatusOr<double> MedianStepMs(ModelBackend* backend, const StepInputs& in, int warmup,
                                    int reps) {
  std::vector<double> ms;
  for (int r = 0; r < warmup + reps; ++r) {
    const auto t0 = Clock::now();
    absl::StatusOr<float> loss = backend->ForwardBackward(
        in.param_spans, in.x.data(), in.labels.data(), in.batch, in.grad_spans);
    if (!loss.ok()) return loss.status();
    if (r >= warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  return Median(ms);
}

// Each layer's forward and backward times over `reps` profiled steps, and the last step's figures.
struct LayerProfile {
  std::vector<std::vector<double>> fwd, bwd;  // (layer, rep) ms
  std::vector<LayerTime> last;
};

// Per layer, profiled (the backend synchronises after each layer); false if a step fails.
bool ProfileLayers(ModelBackend* backend, const StepInputs& in, int reps, size_t layers,
                   LayerProfile* profile) {
  backend->set_profiling(true);
  profile->fwd.assign(layers, {});
  profile->bwd.assign(layers, {});
  for (int r = 0; r < reps; ++r) {
    absl::StatusOr<float> loss = backend->ForwardBackward(
        in.param_spans, in.x.data(), in.labels.data(), in.batch, in.grad_spans);
    if (!loss.ok()) return false;
    profile->last = backend->layer_times();
    for (size_t l = 0; l < profile->last.size(); ++l) {
      profile->fwd[l].push_back(profile->last[l].forward_ms);
      profile->bwd[l].push_back(profile->last[l].backward_ms);
    }
  }
  backend->set_profiling(false);
  return true;
}

// The table of a backend's layers: medians of `profile`, and for each GEMM layer its GFLOP/s next
// to cuBLAS's on its shape and `cublas_peak` (cuda), or next to Eigen's (cpu).
void PrintLayers(const ModelSpec& spec, const BackendRun& run, const LayerProfile& profile,
                 int64_t batch, int reps, double cublas_peak) {
  if (run.cuda) {
    std::printf("  cuBLAS SGEMM peak (8192^3, FP32): %.0f GFLOP/s\n", cublas_peak);
    std::printf("  %-8s %9s %9s %10s %10s %13s %9s\n", "layer", "fwd ms", "bwd ms", "fwd GF/s",
                "bwd GF/s", "cuBLAS GF/s", "of peak");
  } else {
    std::printf("  %-8s %9s %9s %10s %10s %13s %9s\n", "layer", "fwd ms", "bwd ms", "fwd GF/s",
                "bwd GF/s", "Eigen GF/s", "fwd/Eigen");
  }
  const std::vector<LayerTime>& last = profile.last;
  for (size_t l = 0; l < last.size(); ++l) {
    const double f_ms = Median(profile.fwd[l]), b_ms = Median(profile.bwd[l]);
    int64_t m = 0, n = 0, k = 0;
    if (!ForwardGemmShape(spec, l, batch, &m, &n, &k)) {
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
                  static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
    }
  }
}

// One backend: its step time (into step_ms, by label), then its layers. *cublas_peak is measured
// on the first cuda backend. 0, or the exit status of a failed step.
int BenchmarkBackend(const ModelSpec& spec, const StepInputs& in, int warmup, int reps,
                     const BackendRun& run, double* cublas_peak,
                     std::map<std::string, double>* step_ms) {
  ModelBackend* backend = run.backend.get();
  absl::StatusOr<double> ms = MedianStepMs(backend, in, warmup, reps);
  if (!ms.ok()) {
    std::fprintf(stderr, "model_benchmark: error: %s: %s\n", run.label.c_str(),
                 std::string(ms.status().message()).c_str());
    return 1;
  }
  (*step_ms)[run.label] = *ms;
  LayerProfile profile;
  if (!ProfileLayers(backend, in, reps, spec.layers.size(), &profile)) return 1;
  if (run.cuda && *cublas_peak == 0) {
    absl::StatusOr<double> peak = CublasSgemmGflops(8192, 8192, 8192, 5);
    if (peak.ok()) *cublas_peak = *peak;
  }
  std::printf("\nbackend %s: step %.3f ms (%.0f examples/s)\n", backend->name().c_str(), *ms,
              1e3 * in.batch / *ms);
  PrintLayers(spec, run, profile, in.batch, reps, *cublas_peak);
  return 0;
}

// The model's header line, every backend's rows, and cuda's speed-up over one cpu thread. The exit
// status.
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
  std::optional<std::vector<BackendRun>> runs = BackendsFromFlag(*spec);
  if (!runs.has_value()) return 2;
  const StepInputs in(*spec, batch);
  std::printf("model %s, %lld parameters, batch %lld, median of %d steps after %d warm-up\n",
              absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(ModelParamCount(*spec)),
              static_cast<long long>(batch), reps, warmup);
  std::map<std::string, double> step_ms;
  double cublas_peak = 0;
  for (const BackendRun& run : *runs) {
    if (int status = BenchmarkBackend(*spec, in, warmup, reps, run, &cublas_peak, &step_ms)) {
      return status;
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
  rubato::ExecIsaVariant(argv);  // The AVX2 build, where it can run (common/isa_dispatch.h).
  absl::ParseCommandLine(argc, argv);
  return rubato::Run();
}
