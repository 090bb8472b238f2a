// The CUDA backend against the CPU: each layer kind through the loss against
// SequentialModel<double>, the CNN's whole step and Evaluate against the CPU backend, the `ready`
// order, profiling, and the argument checks. Every test skips, saying why, where CreateCudaBackend
// is UNAVAILABLE (no toolkit at build time, no driver or device, no cuBLAS).
#include "worker/model/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <future>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/model/backend_checks.h"
#include "worker/model/layers.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"

namespace rubato {
namespace {

// Declares `var`, a CUDA backend for `spec`, or skips the test when none can be made here.
#define CUDA_BACKEND_OR_SKIP(var, spec)                                                       \
  auto var##_or = CreateCudaBackend(spec);                                                    \
  if (!var##_or.ok()) {                                                                       \
    ASSERT_EQ(var##_or.status().code(), absl::StatusCode::kUnavailable) << var##_or.status(); \
    GTEST_SKIP() << "no CUDA backend here: " << var##_or.status().message();                  \
  }                                                                                           \
  std::unique_ptr<ModelBackend> var = std::move(*var##_or)

constexpr double kTolerance = 1e-4;

// ||a - b|| / max(||b||, tiny), with the largest elementwise difference for the message.
template <typename A, typename B>
double RelativeError(const std::vector<A>& a, const std::vector<B>& b, double* max_abs) {
  double diff = 0, norm = 0;
  *max_abs = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    diff += d * d;
    norm += static_cast<double>(b[i]) * static_cast<double>(b[i]);
    *max_abs = std::max(*max_abs, std::abs(d));
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

template <typename A, typename B>
void ExpectClose(const std::vector<A>& actual, const std::vector<B>& expected,
                 const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double max_abs = 0;
  const double rel = RelativeError(actual, expected, &max_abs);
  EXPECT_LE(rel, kTolerance) << what << ": relative error " << rel << ", max |diff| " << max_abs;
}

// Parameters, inputs and labels for one test, in float and double.
struct Problem {
  std::vector<std::vector<float>> params;
  std::vector<float> x;
  std::vector<int32_t> labels;
};

// Weights from InitModelParams, biases random (they start at zero there), inputs in [-1, 1).
Problem MakeProblem(const ModelSpec& spec, int64_t batch, uint64_t seed) {
  Problem p;
  p.params = InitModelParams(spec, seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  for (size_t t = 0; t < specs.size(); ++t) {
    if (specs[t].shape.size() == 1) {
      for (float& v : p.params[t]) v = 0.1f * uniform(rng);
    }
  }
  p.x.resize(static_cast<size_t>(batch * spec.input.size()));
  for (float& v : p.x) v = uniform(rng);
  std::uniform_int_distribution<int32_t> label(0, static_cast<int32_t>(ModelNumClasses(spec)) - 1);
  p.labels.resize(static_cast<size_t>(batch));
  for (int32_t& v : p.labels) v = label(rng);
  return p;
}

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& v) {
  return std::vector<absl::Span<const T>>(v.begin(), v.end());
}

template <typename T>
std::vector<absl::Span<T>> Spans(std::vector<std::vector<T>>& v) {
  std::vector<absl::Span<T>> s;
  for (auto& t : v) s.push_back(absl::MakeSpan(t));
  return s;
}

std::vector<std::vector<float>> ZerosLike(const ModelSpec& spec) {
  std::vector<std::vector<float>> g;
  for (const ParamSpec& p : ModelParamSpecs(spec)) g.emplace_back(p.elements(), 0.0f);
  return g;
}

// One step on the CUDA backend, compared with SequentialModel<double> on the same inputs.
void CompareStepWithDoubleReference(ModelBackend& cuda, const ModelSpec& spec, int64_t batch,
                                    uint64_t seed) {
  const Problem p = MakeProblem(spec, batch, seed);
  std::vector<std::vector<float>> grads = ZerosLike(spec);
  absl::StatusOr<float> loss =
      cuda.ForwardBackward(ConstSpans(p.params), p.x.data(), p.labels.data(), batch, Spans(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();

  std::vector<std::vector<double>> params64, grads64;
  for (const auto& t : p.params) params64.emplace_back(t.begin(), t.end());
  for (const auto& t : grads) grads64.emplace_back(t.size(), 0.0);
  const std::vector<double> x64(p.x.begin(), p.x.end());
  SequentialModel<double> reference(spec);
  const double expected_loss = reference.ForwardBackward(ConstSpans(params64), x64.data(),
                                                         p.labels.data(), batch, Spans(grads64));
  EXPECT_NEAR(*loss, expected_loss, kTolerance * std::max(1.0, std::abs(expected_loss)));
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  for (size_t t = 0; t < specs.size(); ++t) {
    ExpectClose(grads[t], grads64[t], specs[t].name + " (batch " + std::to_string(batch) + ")");
  }
}

struct NamedSpec {
  std::string name;
  ModelSpec spec;
};

std::vector<NamedSpec> LayerCases() {
  std::vector<NamedSpec> cases;
  auto conv = [](std::string name, int64_t kh, int64_t kw, int64_t cin, int64_t cout,
                 Padding padding) {
    return LayerSpec::Conv2D(name + "/kernel", name + "/bias", kh, kw, cin, cout, padding,
                             WeightInit::kHeUniform);
  };
  auto dense = [](std::string name, int64_t in, int64_t out) {
    return LayerSpec::Dense(name + "/kernel", name + "/bias", in, out, WeightInit::kHeUniform);
  };
  cases.push_back(
      {"ConvSame3x3", {{4, 4, 2}, {conv("c", 3, 3, 2, 3, Padding::kSame), LayerSpec::Flatten()}}});
  // An even kernel pads 1 before and 2 after: the asymmetric case.
  cases.push_back(
      {"ConvSame4x2", {{5, 6, 2}, {conv("c", 4, 2, 2, 2, Padding::kSame), LayerSpec::Flatten()}}});
  cases.push_back(
      {"ConvValid", {{5, 5, 2}, {conv("c", 3, 2, 2, 4, Padding::kValid), LayerSpec::Flatten()}}});
  // 7x7 pools to 3x3, dropping the odd row and column.
  cases.push_back({"ConvReluPool",
                   {{7, 7, 1},
                    {conv("c", 3, 3, 1, 4, Padding::kSame), LayerSpec::ReLU(),
                     LayerSpec::MaxPool2D(), LayerSpec::Flatten()}}});
  // A second convolution, so that one input gradient goes through col2im.
  cases.push_back({"ConvStack",
                   {{6, 7, 2},
                    {conv("c1", 3, 3, 2, 3, Padding::kSame), LayerSpec::ReLU(),
                     conv("c2", 2, 3, 3, 4, Padding::kValid), LayerSpec::MaxPool2D(),
                     LayerSpec::Flatten(), dense("d", 16, 5)}}});
  cases.push_back({"Dense", {{1, 1, 20}, {dense("d", 20, 7)}}});
  // The CNN's dense layers: a long GEMM reduction (K = 3136), which TF32 would not pass.
  cases.push_back(
      {"WideDense",
       {{1, 1, 3136}, {dense("d1", 3136, 128), LayerSpec::ReLU(), dense("d2", 128, 10)}}});
  cases.push_back(
      {"DenseReluDense", {{1, 1, 12}, {dense("d1", 12, 9), LayerSpec::ReLU(), dense("d2", 9, 4)}}});
  // Residual connections: an Add whose gradient meets the branch's at the block's input, and two
  // Adds in a row from neighbouring layers.
  cases.push_back({"Residual",
                   {{6, 6, 2},
                    {conv("c0", 3, 3, 2, 3, Padding::kSame), LayerSpec::ReLU(),
                     conv("r1a", 3, 3, 3, 3, Padding::kSame), LayerSpec::ReLU(),
                     conv("r1b", 3, 3, 3, 3, Padding::kSame), LayerSpec::Add(1), LayerSpec::ReLU(),
                     conv("r2a", 3, 3, 3, 3, Padding::kSame), LayerSpec::Add(6), LayerSpec::Add(5),
                     LayerSpec::MaxPool2D(), LayerSpec::Flatten(), dense("d", 27, 4)}}});
  cases.push_back({"PoolFlattenDense",
                   {{4, 5, 3}, {LayerSpec::MaxPool2D(), LayerSpec::Flatten(), dense("d", 12, 6)}}});
  return cases;
}

class CudaLayerTest : public testing::TestWithParam<NamedSpec> {};

TEST_P(CudaLayerTest, LossAndGradientsMatchTheDoubleReference) {
  const ModelSpec& spec = GetParam().spec;
  ASSERT_TRUE(ValidateModelSpec(spec).ok()) << ValidateModelSpec(spec);
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  // Growing, shrinking and growing the batch again reuses and reallocates the scratch.
  for (int64_t batch : {5, 2, 11}) CompareStepWithDoubleReference(*cuda, spec, batch, 100 + batch);
}

INSTANTIATE_TEST_SUITE_P(Layers, CudaLayerTest, testing::ValuesIn(LayerCases()),
                         [](const testing::TestParamInfo<NamedSpec>& info) {
                           return info.param.name;
                         });

TEST(CudaBackendTest, NameSaysCudaAndTheDevice) {
  CUDA_BACKEND_OR_SKIP(cuda, CnnModelSpec());
  EXPECT_EQ(cuda->name().rfind("cuda (", 0), 0u) << cuda->name();
  EXPECT_GT(cuda->name().size(), std::string("cuda ()").size());
}

TEST(CudaBackendTest, CnnStepMatchesTheCpuBackendAndReportsLayersLastFirst) {
  const ModelSpec spec = CnnModelSpec();
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  auto cpu = CreateCpuBackend(spec);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  constexpr int64_t kBatch = 32;
  Problem p = MakeProblem(spec, kBatch, 7);
  // The real initialisation (biases zero) and pixel-like inputs in [0, 1), rounded to a few bits
  // so that both convolutions are exact in float in any summation order. Otherwise a near-tie in
  // a pooling window, decided differently by one rounding on the two backends, routes one
  // gradient elsewhere and moves the convolutions' gradients by ~1e-3 (seen on an H200).
  p.params = InitModelParams(spec, 7);
  auto round_to = [](std::vector<float>& t, float scale) {
    for (float& v : t) v = std::round(v * scale) / scale;
  };
  round_to(p.params[0], 64);   // conv1/kernel
  round_to(p.params[2], 128);  // conv2/kernel
  for (float& v : p.x) v = 0.5f * (v + 1.0f);
  round_to(p.x, 8);

  std::vector<std::vector<float>> grads = ZerosLike(spec), expected = ZerosLike(spec);
  std::vector<std::pair<size_t, size_t>> calls;
  // grads as AwaitGradients left them, awaited on threads of their own as the training loop's
  // communication thread does, while the backward pass goes on.
  std::vector<std::vector<float>> seen = ZerosLike(spec);
  std::vector<std::future<absl::Status>> awaited;
  auto ready = [&](size_t first, size_t count) {
    calls.emplace_back(first, count);
    awaited.push_back(std::async(std::launch::async, [&, first, count] {
      absl::Status s = cuda->AwaitGradients(first, count);
      for (size_t t = first; t < first + count; ++t) seen[t] = grads[t];
      return s;
    }));
  };
  absl::StatusOr<float> loss = cuda->ForwardBackward(ConstSpans(p.params), p.x.data(),
                                                     p.labels.data(), kBatch, Spans(grads), ready);
  ASSERT_TRUE(loss.ok()) << loss.status();
  for (auto& a : awaited) EXPECT_TRUE(a.get().ok());
  absl::StatusOr<float> expected_loss = (*cpu)->ForwardBackward(
      ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(expected));
  ASSERT_TRUE(expected_loss.ok()) << expected_loss.status();

  EXPECT_NEAR(*loss, *expected_loss, kTolerance * std::abs(*expected_loss));
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  ASSERT_EQ(specs.size(), 8u);
  for (size_t t = 0; t < specs.size(); ++t) {
    ExpectClose(grads[t], expected[t], specs[t].name);
    EXPECT_EQ(seen[t], grads[t]) << specs[t].name << " changed after AwaitGradients";
  }
  const std::vector<std::pair<size_t, size_t>> want = {{6, 2}, {4, 2}, {2, 2}, {0, 2}};
  EXPECT_EQ(calls, want);
}

// With the caller's buffers page-locked, the weights go to the device and the gradients come back
// without staging: the same step, the same figures, bit for bit; other buffers still work.
TEST(CudaBackendTest, PageLockedHostBuffersGiveTheSameStep) {
  const ModelSpec spec = CnnModelSpec();
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  constexpr int64_t kBatch = 16;
  Problem p = MakeProblem(spec, kBatch, 21);
  std::vector<std::vector<float>> staged = ZerosLike(spec), direct = ZerosLike(spec);
  absl::StatusOr<float> staged_loss = cuda->ForwardBackward(ConstSpans(p.params), p.x.data(),
                                                            p.labels.data(), kBatch, Spans(staged));
  ASSERT_TRUE(staged_loss.ok()) << staged_loss.status();
  ASSERT_TRUE(cuda->UseHostBuffers(Spans(p.params), Spans(direct)).ok());
  for (bool with_ready : {false, true}) {
    std::vector<std::pair<size_t, size_t>> handed;
    GradientsReady ready = nullptr;
    if (with_ready) ready = [&](size_t first, size_t count) { handed.emplace_back(first, count); };
    absl::StatusOr<float> loss = cuda->ForwardBackward(
        ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(direct), ready);
    ASSERT_TRUE(loss.ok()) << loss.status();
    for (const auto& [first, count] : handed) {
      ASSERT_TRUE(cuda->AwaitGradients(first, count).ok());
    }
    EXPECT_EQ(*loss, *staged_loss);
    EXPECT_EQ(direct, staged) << "with_ready " << with_ready;
  }
  std::vector<std::vector<float>> other = ZerosLike(spec);
  ASSERT_TRUE(
      cuda->ForwardBackward(ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(other))
          .ok());
  EXPECT_EQ(other, staged);
  EXPECT_EQ(cuda->AwaitGradients(1, 2).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> short_grads = ZerosLike(spec);
  short_grads[0].pop_back();
  EXPECT_EQ(cuda->UseHostBuffers(Spans(p.params), Spans(short_grads)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda->UseHostBuffers({}, {}).ok());
}

// Each layer's weights go up only once the loop says they have arrived (staged, and straight
// from page-locked buffers), and a status returned there ends the pass with no copy left running.
TEST(CudaBackendTest, WeightsArriveLayerByLayer) {
  const ModelSpec spec = CnnModelSpec();
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  CheckWeightsArriveLayerByLayer(cuda.get(), spec, /*lock_host_buffers=*/false);
  CheckWeightsArriveLayerByLayer(cuda.get(), spec, /*lock_host_buffers=*/true);
}

TEST(CudaBackendTest, EvaluateMatchesTheCpuBackend) {
  const ModelSpec spec = CnnModelSpec();
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  auto cpu = CreateCpuBackend(spec);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  constexpr int64_t kN = 300;
  Problem p = MakeProblem(spec, kN, 11);
  auto result = cuda->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), kN);
  ASSERT_TRUE(result.ok()) << result.status();
  auto expected = (*cpu)->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), kN);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(result->examples, kN);
  EXPECT_NEAR(result->loss, expected->loss, kTolerance * expected->loss);
  // A near-tie between two logits may go either way in float.
  EXPECT_LE(std::abs(result->accuracy - expected->accuracy) * kN, 1.0 + 1e-9)
      << result->accuracy << " vs " << expected->accuracy;
}

TEST(CudaBackendTest, EvaluateInSeveralChunksMatchesTheCpuBackend) {
  const ModelSpec spec = MlpModelSpec(MlpSpec{16, {32}, 5});
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  auto cpu = CreateCpuBackend(spec);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  constexpr int64_t kN = 2500;  // more than two chunks, the last one partial
  const Problem p = MakeProblem(spec, kN, 13);
  auto result = cuda->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), kN);
  ASSERT_TRUE(result.ok()) << result.status();
  auto expected = (*cpu)->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), kN);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_NEAR(result->loss, expected->loss, kTolerance * expected->loss);
  EXPECT_LE(std::abs(result->accuracy - expected->accuracy) * kN, 1.0 + 1e-9);
}

TEST(CudaBackendTest, ProfilingFillsLayerTimes) {
  const ModelSpec spec = CnnModelSpec();
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  constexpr int64_t kBatch = 16;
  const Problem p = MakeProblem(spec, kBatch, 3);
  std::vector<std::vector<float>> grads = ZerosLike(spec);
  // A first step pays for module loading and cuBLAS's kernel choice; time the second.
  ASSERT_TRUE(
      cuda->ForwardBackward(ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(grads))
          .ok());
  cuda->set_profiling(true);
  ASSERT_TRUE(
      cuda->ForwardBackward(ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(grads))
          .ok());
  const std::vector<LayerTime> times = cuda->layer_times();
  const std::vector<std::string> names = LayerNames(spec);
  ASSERT_EQ(times.size(), spec.layers.size());
  for (size_t l = 0; l < times.size(); ++l) {
    EXPECT_EQ(times[l].name, names[l]);
    EXPECT_GE(times[l].forward_ms, 0.0) << names[l];
    EXPECT_GE(times[l].backward_ms, 0.0) << names[l];
    double forward = 0, backward = 0;
    LayerFlops(spec, l, kBatch, &forward, &backward);
    EXPECT_EQ(times[l].forward_flops, forward) << names[l];
    EXPECT_EQ(times[l].backward_flops, backward) << names[l];
    std::cout << names[l] << ": forward " << times[l].forward_ms << " ms, backward "
              << times[l].backward_ms << " ms\n";
  }
  EXPECT_GT(times[0].forward_ms, 0.0);
}

TEST(CudaBackendTest, BadInputsAreInvalidArgumentAndLeaveGradsAlone) {
  const ModelSpec spec = MlpModelSpec(MlpSpec{6, {4}, 3});
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  constexpr int64_t kBatch = 4;
  Problem p = MakeProblem(spec, kBatch, 5);
  std::vector<std::vector<float>> grads = ZerosLike(spec);
  for (auto& t : grads) std::fill(t.begin(), t.end(), 42.0f);
  const std::vector<std::vector<float>> untouched = grads;
  auto step = [&](const std::vector<std::vector<float>>& params, std::vector<std::vector<float>>& g,
                  int64_t batch) {
    return cuda->ForwardBackward(ConstSpans(params), p.x.data(), p.labels.data(), batch, Spans(g))
        .status();
  };

  p.labels[2] = 3;  // classes are 0..2
  EXPECT_EQ(step(p.params, grads, kBatch).code(), absl::StatusCode::kInvalidArgument);
  p.labels[2] = -1;
  EXPECT_EQ(step(p.params, grads, kBatch).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch).status().code(),
      absl::StatusCode::kInvalidArgument);
  p.labels[2] = 0;
  EXPECT_EQ(step(p.params, grads, 0).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> short_params = p.params;
  short_params[1].pop_back();
  EXPECT_EQ(step(short_params, grads, kBatch).code(), absl::StatusCode::kInvalidArgument);
  short_params = p.params;
  short_params.pop_back();
  EXPECT_EQ(step(short_params, grads, kBatch).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> short_grads = grads;
  short_grads[0].pop_back();
  EXPECT_EQ(step(p.params, short_grads, kBatch).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda->ForwardBackward(ConstSpans(p.params), nullptr, p.labels.data(), kBatch, Spans(grads))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda->Evaluate(ConstSpans(p.params), p.x.data(), p.labels.data(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(grads, untouched);

  // And the backend still works afterwards.
  EXPECT_TRUE(step(p.params, grads, kBatch).ok());
}

TEST(CudaBackendTest, DivergedParametersAreInvalidArgument) {
  const ModelSpec spec = MlpModelSpec(MlpSpec{6, {4}, 3});
  CUDA_BACKEND_OR_SKIP(cuda, spec);
  constexpr int64_t kBatch = 4;
  Problem p = MakeProblem(spec, kBatch, 9);
  for (auto& t : p.params) std::fill(t.begin(), t.end(), 1e30f);
  std::vector<std::vector<float>> grads = ZerosLike(spec);
  EXPECT_EQ(
      cuda->ForwardBackward(ConstSpans(p.params), p.x.data(), p.labels.data(), kBatch, Spans(grads))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(CudaBackendTest, CublasSgemmGflopsMeasuresSomething) {
  absl::StatusOr<double> gflops = CublasSgemmGflops(1024, 512, 768, 5);
  if (!gflops.ok()) {
    ASSERT_EQ(gflops.status().code(), absl::StatusCode::kUnavailable) << gflops.status();
    GTEST_SKIP() << "no CUDA here: " << gflops.status().message();
  }
  std::cout << "cuBLAS SGEMM 1024x512x768: " << *gflops << " GFLOP/s\n";
  EXPECT_GT(*gflops, 1.0);
  EXPECT_EQ(CublasSgemmGflops(0, 1, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaBackendTest, ADeviceIndexPastTheLastIsInvalidArgument) {
  CUDA_BACKEND_OR_SKIP(backend, CnnModelSpec());
  for (int device : {-1, 1000}) {
    auto made = CreateCudaBackend(CnnModelSpec(), device);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
    EXPECT_NE(made.status().message().find("does not exist"), std::string::npos) << made.status();
  }
}

TEST(CudaBackendTest, WithoutADeviceCreationIsUnavailableWithAReason) {
  auto cuda = CreateCudaBackend(CnnModelSpec());
  if (cuda.ok()) GTEST_SKIP() << "a CUDA device is present: " << (*cuda)->name();
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(cuda.status().message().empty());
}

}  // namespace
}  // namespace rubato
