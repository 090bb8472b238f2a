// Tests for the CPU MlpBackend: agreement with MlpMath<double>, Evaluate, and argument checks.
#include "worker/cpu_mlp_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/mlp.h"
#include "worker/mlp_math.h"

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

std::unique_ptr<MlpBackend> MustCreate(const MlpSpec& spec) {
  absl::StatusOr<std::unique_ptr<MlpBackend>> backend = CreateCpuMlpBackend(spec);
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

TEST(CpuMlpBackendTest, Name) { EXPECT_EQ(MustCreate({4, {3}, 2})->name(), "cpu-eigen"); }

TEST(CpuMlpBackendTest, InvalidSpecIsInvalidArgument) {
  const absl::Status status = CreateCpuMlpBackend({784, {0}, 10}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("hidden[0]"), std::string::npos) << status;
}

TEST(CpuMlpBackendTest, FloatAgreesWithDoubleMath) {
  const MlpSpec spec{64, {48, 32}, 10};
  const std::vector<std::vector<float>> params = InitMlpParams(spec, 3);
  const Batch batch = RandomBatch(spec, 33, 4);
  std::unique_ptr<MlpBackend> backend = MustCreate(spec);
  auto grads = ZerosLike<float>(spec);
  absl::StatusOr<float> loss = backend->ForwardBackward(
      ConstSpans(params), batch.x.data(), batch.labels.data(), 33, MutableSpans(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();

  const auto params64 = ToDouble(params);
  const std::vector<double> x64(batch.x.begin(), batch.x.end());
  auto grads64 = ZerosLike<double>(spec);
  MlpMath<double> reference(spec);
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

TEST(CpuMlpBackendTest, ZeroWeightsGiveLogOfClassCount) {
  const MlpSpec spec{784, {256}, 10};
  const auto params = ZerosLike<float>(spec);
  const Batch batch = RandomBatch(spec, 64, 1);
  auto grads = ZerosLike<float>(spec);
  absl::StatusOr<float> loss = MustCreate(spec)->ForwardBackward(
      ConstSpans(params), batch.x.data(), batch.labels.data(), 64, MutableSpans(grads));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, std::log(10.0), 1e-6);
}

TEST(CpuMlpBackendTest, GradientsOverwriteNotAccumulate) {
  const MlpSpec spec{8, {5}, 3};
  const auto params = InitMlpParams(spec, 1);
  const Batch batch = RandomBatch(spec, 6, 2);
  std::unique_ptr<MlpBackend> backend = MustCreate(spec);
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

TEST(CpuMlpBackendTest, EvaluateHandBuiltCase) {
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

TEST(CpuMlpBackendTest, EvaluateInChunksMatchesOnePass) {
  // 2500 examples: several chunks, the last one partial.
  const MlpSpec spec{20, {16}, 4};
  const auto params = InitMlpParams(spec, 8);
  const Batch data = RandomBatch(spec, 2500, 9);
  absl::StatusOr<EvalResult> result =
      MustCreate(spec)->Evaluate(ConstSpans(params), data.x.data(), data.labels.data(), 2500);
  ASSERT_TRUE(result.ok()) << result.status();

  const auto params64 = ToDouble(params);
  const std::vector<double> x64(data.x.begin(), data.x.end());
  MlpMath<double> reference(spec);
  double loss_sum = 0;
  int64_t correct = 0;
  reference.AccumulateLossAndCorrect(ConstSpans(params64), x64.data(), data.labels.data(), 2500,
                                     &loss_sum, &correct);
  EXPECT_EQ(result->examples, 2500);
  EXPECT_NEAR(result->loss, loss_sum / 2500, 1e-5);
  EXPECT_NEAR(result->accuracy, correct / 2500.0, 2.0 / 2500);  // float may flip a near-tie
}

TEST(CpuMlpBackendTest, WrongSpansAreInvalidArgumentNamingTheTensor) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<MlpBackend> backend = MustCreate(spec);
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

TEST(CpuMlpBackendTest, BadBatchAndLabelsAreInvalidArgument) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<MlpBackend> backend = MustCreate(spec);
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

TEST(CpuMlpBackendTest, NonFiniteLossIsAStatus) {
  const MlpSpec spec{4, {3}, 2};
  std::unique_ptr<MlpBackend> backend = MustCreate(spec);
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

}  // namespace
}  // namespace rubato
