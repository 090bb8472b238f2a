// Tests for the CPU ModelBackend: agreement with SequentialModel<double>, Evaluate, argument
// checks, threads, gradient and weight callbacks and layer times.

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/model/backend_checks.h"
#include "worker/model/layers.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"

namespace rubato {
namespace {

template <typename T>
std::vector<absl::Span<const T>> ConstSpans(const std::vector<std::vector<T>>& t) {
  return std::vector<absl::Span<const T>>(t.begin(), t.end());
}

template <typename T>
std::vector<absl::Span<T>> MutableSpans(std::vector<std::vector<T>>& t) {
  return std::vector<absl::Span<T>>(t.begin(), t.end());
}

template <typename T>
std::vector<std::vector<T>> ZerosLike(const MlpSpec& spec) {
  std::vector<std::vector<T>> t;
  for (const ParamSpec& p : MlpParamSpecs(spec)) t.emplace_back(p.elements(), T(0));
  return t;
}

std::vector<std::vector<double>> ToDouble(const std::vector<std::vector<float>>& t) {
  std::vector<std::vector<double>> out;
  for (const auto& v : t) out.emplace_back(v.begin(), v.end());
  return out;
}

std::unique_ptr<ModelBackend> MustCreate(const MlpSpec& spec, int threads = 1) {
  absl::StatusOr<std::unique_ptr<ModelBackend>> backend =
      CreateCpuBackend(MlpModelSpec(spec), threads);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(*backend) : nullptr;
}

// A batch of inputs in [0, 1] (like pixels) and labels cycling over the classes.
struct Batch {
  std::vector<float> x;
  std::vector<int32_t> labels;
};

Batch RandomBatch(const MlpSpec& spec, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  Batch b;
  b.x.resize(n * spec.input_dim);
  for (float& v : b.x) v = uniform(rng);
  for (int64_t i = 0; i < n; ++i) {
    b.labels.push_back(static_cast<int32_t>((i * 7) % spec.num_classes));
  }
  return b;
}

// The build's instruction set in the name: " avx2+fma" in the AVX2 build (bazel/isa.bzl).
#if defined(__AVX2__) && defined(__FMA__)
constexpr char kIsa[] = " avx2+fma";
#else
constexpr char kIsa[] = "";
#endif

TEST(CpuBackendTest, Name) {
  EXPECT_EQ(MustCreate({4, {3}, 2})->name(), absl::StrCat("cpu-eigen", kIsa));
}

TEST(CpuBackendTest, InvalidSpecIsInvalidArgument) {
  ModelSpec spec;
  spec.input = {1, 1, 784};
  spec.layers.push_back(LayerSpec::Dense("w", "b", 100, 10, WeightInit::kHeUniform));
  const absl::Status status = CreateCpuBackend(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("layer 0 (dense w)"), std::string::npos) << status;
  EXPECT_EQ(CreateCpuBackend(MlpModelSpec({4, {3}, 2}), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendTest, FloatAgreesWithDoubleMath) {
  const MlpSpec spec{64, {48, 32}, 10};
  const std::vector<std::vector<float>> params = InitMlpParams(spec, 3);
  const Batch batch = RandomBatch(spec, 33, 4);
  std::unique_ptr<ModelBackend> backend = MustCreate(spec);
  auto grads = ZerosLike<float>(spec);
  absl::StatusOr<float> loss = backend->ForwardBackward(
      ConstSpans(params), batch.x.data(), batch.labels.data(), 33, MutableSpans(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();

  const auto params64 = ToDouble(params);
  const std::vector<double> x64(batch.x.begin(), batch.x.end());
  auto grads64 = ZerosLike<double>(spec);
  SequentialModel<double> reference(MlpModelSpec(spec));
  const double loss64 = reference.ForwardBackward(ConstSpans(params64), x64.data(),
                                                  batch.labels.data(), 33, MutableSpans(grads64));
  EXPECT_NEAR(*loss, loss64, 1e-4 * std::abs(loss64));

  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  for (size_t t = 0; t < grads.size(); ++t) {
    double scale = 0;
    for (double g : grads64[t]) scale = std::max(scale, std::abs(g));
    for (size_t k = 0; k < grads[t].size(); ++k) {
      EXPECT_NEAR(grads[t][k], grads64[t][k], 1e-4 * scale) << specs[t].name << "[" << k << "]";
    }
  }
}

TEST(CpuBackendTest, ZeroWeightsGiveLogOfClassCount) {
  const MlpSpec spec{784, {256}, 10};
  const auto params = ZerosLike<float>(spec);
  const Batch batch = RandomBatch(spec, 64, 1);
  auto grads = ZerosLike<float>(spec);
  absl::StatusOr<float> loss = MustCreate(spec)->ForwardBackward(
      ConstSpans(params), batch.x.data(), batch.labels.data(), 64, MutableSpans(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, std::log(10.0), 1e-6);
}

TEST(CpuBackendTest, GradientsOverwriteNotAccumulate) {
  const MlpSpec spec{8, {5}, 3};
  const auto params = InitMlpParams(spec, 1);
  const Batch batch = RandomBatch(spec, 6, 2);
  std::unique_ptr<ModelBackend> backend = MustCreate(spec);
  auto first = ZerosLike<float>(spec);
  ASSERT_TRUE(backend
                  ->ForwardBackward(ConstSpans(params), batch.x.data(), batch.labels.data(), 6,
                                    MutableSpans(first))
                  .ok());
  auto second = ZerosLike<float>(spec);
  for (auto& t : second) std::fill(t.begin(), t.end(), 123.0f);
  ASSERT_TRUE(backend
                  ->ForwardBackward(ConstSpans(params), batch.x.data(), batch.labels.data(), 6,
                                    MutableSpans(second))
                  .ok());
  EXPECT_EQ(first, second);
}

TEST(CpuBackendTest, EvaluateHandBuiltCase) {
  // Logistic regression 2 -> 3 with logits (x0, x1, 0.5).
  const MlpSpec spec{2, {}, 3};
  const std::vector<std::vector<float>> params = {{1, 0, 0, 0, 1, 0}, {0, 0, 0.5f}};
  const std::vector<float> x = {2, 0,   // logits (2, 0, .5): predicts 0, label 0
                                0, 2,   // (0, 2, .5): predicts 1, label 1
                                0, 0,   // (0, 0, .5): predicts 2, label 2
                                1, 0};  // (1, 0, .5): predicts 0, label 1: wrong
  const std::vector<int32_t> labels = {0, 1, 2, 1};
  absl::StatusOr<EvalResult> result =
      MustCreate(spec)->Evaluate(ConstSpans(params), x.data(), labels.data(), 4);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->examples, 4);
  EXPECT_DOUBLE_EQ(result->accuracy, 0.75);
  auto nll = [](double a, double b, double c, double label_logit) {
    return std::log(std::exp(a) + std::exp(b) + std::exp(c)) - label_logit;
  };
  const double expected =
      (nll(2, 0, .5, 2) + nll(0, 2, .5, 2) + nll(0, 0, .5, .5) + nll(1, 0, .5, 0)) / 4;
  EXPECT_NEAR(result->loss, expected, 1e-6);
}

TEST(CpuBackendTest, EvaluateInChunksMatchesOnePass) {
  // 2500 examples: several chunks, the last one partial.
  const MlpSpec spec{20, {16}, 4};
  const auto params = InitMlpParams(spec, 8);
  const Batch data = RandomBatch(spec, 2500, 9);
  absl::StatusOr<EvalResult> result =
      MustCreate(spec)->Evaluate(ConstSpans(params), data.x.data(), data.labels.data(), 2500);
  ASSERT_TRUE(result.ok()) << result.status();

  const auto params64 = ToDouble(params);
  const std::vector<double> x64(data.x.begin(), data.x.end());
  SequentialModel<double> reference(MlpModelSpec(spec));
  double loss_sum = 0;
  int64_t correct = 0;
  reference.AccumulateLossAndCorrect(ConstSpans(params64), x64.data(), data.labels.data(), 2500,
                                     &loss_sum, &correct);
  EXPECT_EQ(result->examples, 2500);
  EXPECT_NEAR(result->loss, loss_sum / 2500, 1e-5);
  EXPECT_NEAR(result->accuracy, correct / 2500.0, 2.0 / 2500);  // float may flip a near-tie
}

TEST(CpuBackendTest, WrongSpansAreInvalidArgumentNamingTheTensor) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<ModelBackend> backend = MustCreate(spec);
  const auto params = InitMlpParams(spec, 1);
  const Batch batch = RandomBatch(spec, 2, 1);
  auto grads = ZerosLike<float>(spec);

  auto short_params = ConstSpans(params);
  short_params[2] = short_params[2].subspan(1);  // fc1.weight one short
  absl::Status status = backend
                            ->ForwardBackward(short_params, batch.x.data(), batch.labels.data(), 2,
                                              MutableSpans(grads))
                            .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("fc1.weight"), std::string::npos) << status;

  status = backend->Evaluate(short_params, batch.x.data(), batch.labels.data(), 2).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("fc1.weight"), std::string::npos) << status;

  auto missing = ConstSpans(params);
  missing.pop_back();
  EXPECT_EQ(
      backend->ForwardBackward(missing, batch.x.data(), batch.labels.data(), 2, MutableSpans(grads))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);

  auto short_grads = MutableSpans(grads);
  short_grads[1] = short_grads[1].subspan(0, 2);  // fc0.bias
  status =
      backend
          ->ForwardBackward(ConstSpans(params), batch.x.data(), batch.labels.data(), 2, short_grads)
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("fc0.bias"), std::string::npos) << status;
}

TEST(CpuBackendTest, BadBatchAndLabelsAreInvalidArgument) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<ModelBackend> backend = MustCreate(spec);
  const auto params = InitMlpParams(spec, 1);
  const Batch batch = RandomBatch(spec, 2, 1);
  auto grads = ZerosLike<float>(spec);
  EXPECT_EQ(backend
                ->ForwardBackward(ConstSpans(params), batch.x.data(), batch.labels.data(), 0,
                                  MutableSpans(grads))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      backend->Evaluate(ConstSpans(params), batch.x.data(), batch.labels.data(), 0).status().code(),
      absl::StatusCode::kInvalidArgument);
  for (int32_t bad : {-1, 2}) {
    const std::vector<int32_t> labels = {0, bad};
    const absl::Status status = backend
                                    ->ForwardBackward(ConstSpans(params), batch.x.data(),
                                                      labels.data(), 2, MutableSpans(grads))
                                    .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("label"), std::string::npos) << status;
    EXPECT_EQ(
        backend->Evaluate(ConstSpans(params), batch.x.data(), labels.data(), 2).status().code(),
        absl::StatusCode::kInvalidArgument);
  }
}

TEST(CpuBackendTest, NonFiniteLossIsAStatus) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<ModelBackend> backend = MustCreate(spec);
  auto params = InitMlpParams(spec, 1);
  Batch batch = RandomBatch(spec, 2, 1);
  auto grads = ZerosLike<float>(spec);

  batch.x[1] = std::numeric_limits<float>::quiet_NaN();
  absl::Status status = backend
                            ->ForwardBackward(ConstSpans(params), batch.x.data(),
                                              batch.labels.data(), 2, MutableSpans(grads))
                            .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("non-finite"), std::string::npos) << status;
  status = backend->Evaluate(ConstSpans(params), batch.x.data(), batch.labels.data(), 2).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  // Diverged weights: logits overflow to infinity.
  batch = RandomBatch(spec, 2, 1);
  for (float& w : params[0]) w = 3e38f;
  for (float& w : params[2]) w = 3e38f;
  status = backend
               ->ForwardBackward(ConstSpans(params), batch.x.data(), batch.labels.data(), 2,
                                 MutableSpans(grads))
               .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

// Eigen's OpenMP GEMMs give the same gradients on 2 threads as on 1 (up to summation order).
TEST(CpuBackendTest, ThreadsGiveTheSameGradients) {
  const ModelSpec spec = CnnModelSpec();
  const std::vector<std::vector<float>> params = InitModelParams(spec, 5);
  std::mt19937_64 rng(6);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> x(16 * 784);
  for (float& v : x) v = uniform(rng);
  std::vector<int32_t> labels(16);
  for (int i = 0; i < 16; ++i) labels[i] = i % 10;
  std::vector<std::vector<float>> g1, g2;
  for (const ParamSpec& p : ModelParamSpecs(spec)) {
    g1.emplace_back(p.elements());
    g2.emplace_back(p.elements());
  }
  auto one = CreateCpuBackend(spec, 1);
  auto two = CreateCpuBackend(spec, 2);
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_EQ((*two)->name(), absl::StrCat("cpu-eigen", kIsa, " x2 threads"));
  auto l1 =
      (*one)->ForwardBackward(ConstSpans(params), x.data(), labels.data(), 16, MutableSpans(g1));
  auto l2 =
      (*two)->ForwardBackward(ConstSpans(params), x.data(), labels.data(), 16, MutableSpans(g2));
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_NEAR(*l1, *l2, 1e-5 * std::abs(*l1));
  for (size_t t = 0; t < g1.size(); ++t) {
    double diff = 0, norm = 0;
    for (size_t k = 0; k < g1[t].size(); ++k) {
      diff += (g1[t][k] - g2[t][k]) * (g1[t][k] - g2[t][k]);
      norm += g1[t][k] * g1[t][k];
    }
    EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm)) << "tensor " << t;
  }
}

// The callback sees each layer once, last first, and profiling names and times every layer.
TEST(CpuBackendTest, CallbacksAndLayerTimes) {
  const ModelSpec spec = CnnModelSpec();
  const std::vector<std::vector<float>> params = InitModelParams(spec, 5);
  std::vector<float> x(4 * 784, 0.5f);
  std::vector<int32_t> labels = {0, 1, 2, 3};
  std::vector<std::vector<float>> grads;
  for (const ParamSpec& p : ModelParamSpecs(spec)) grads.emplace_back(p.elements());
  auto backend = CreateCpuBackend(spec, 1);
  ASSERT_TRUE(backend.ok());
  (*backend)->set_profiling(true);
  std::vector<size_t> firsts;
  auto loss = (*backend)->ForwardBackward(ConstSpans(params), x.data(), labels.data(), 4,
                                          MutableSpans(grads), [&](size_t first, size_t count) {
                                            EXPECT_EQ(count, 2u);
                                            firsts.push_back(first);
                                          });
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(firsts, (std::vector<size_t>{6, 4, 2, 0}));
  const std::vector<LayerTime> times = (*backend)->layer_times();
  ASSERT_EQ(times.size(), spec.layers.size());
  EXPECT_EQ(times[0].name, "conv1");
  EXPECT_EQ(times[1].name, "relu1");
  EXPECT_EQ(times[2].name, "pool1");
  EXPECT_EQ(times.back().name, "dense2");
  // conv1: 4 examples x 28x28 outputs x 5x5x1x32 multiply-adds, twice.
  EXPECT_DOUBLE_EQ(times[0].forward_flops, 2.0 * 4 * 28 * 28 * 25 * 32);
  EXPECT_DOUBLE_EQ(times[0].backward_flops, times[0].forward_flops);  // no input gradient
  EXPECT_DOUBLE_EQ(times.back().backward_flops, 2 * times.back().forward_flops);
  for (const LayerTime& t : times) {
    EXPECT_GE(t.forward_ms, 0) << t.name;
    EXPECT_GE(t.backward_ms, 0) << t.name;
  }
  EXPECT_GT(times[0].forward_ms, 0);
}

// The forward pass waits for each layer's weights (the CNN: four layers with weights), and a
// status returned there ends the pass.
TEST(CpuBackendTest, WeightsArriveLayerByLayer) {
  const ModelSpec spec = CnnModelSpec();
  auto backend = CreateCpuBackend(spec, 1);
  ASSERT_TRUE(backend.ok());
  CheckWeightsArriveLayerByLayer(backend->get(), spec, /*lock_host_buffers=*/false);
}

}  // namespace
}  // namespace rubato
