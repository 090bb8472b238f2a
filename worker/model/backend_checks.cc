#include "worker/model/backend_checks.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& v) {
  return std::vector<absl::Span<float>>(v.begin(), v.end());
}

std::vector<absl::Span<const float>> ConstSpans(const std::vector<std::vector<float>>& v) {
  return std::vector<absl::Span<const float>>(v.begin(), v.end());
}

// The same step computed twice: equal but for rounding (an AVX2 build's GEMMs round by the
// buffers' alignment; a weight read before it arrived would make them NaN).
void ExpectSameStep(float loss, const std::vector<std::vector<float>>& grads, float want_loss,
                    const std::vector<std::vector<float>>& want, const char* what) {
  constexpr float kTolerance = 1e-5f;
  EXPECT_NEAR(loss, want_loss, kTolerance * std::abs(want_loss)) << what;
  ASSERT_EQ(grads.size(), want.size()) << what;
  for (size_t t = 0; t < want.size(); ++t) {
    ASSERT_EQ(grads[t].size(), want[t].size()) << what << ", tensor " << t;
    for (size_t i = 0; i < want[t].size(); ++i) {
      ASSERT_NEAR(grads[t][i], want[t][i], kTolerance * (1 + std::abs(want[t][i])))
          << what << ", tensor " << t << " [" << i << "]";
    }
  }
}

}  // namespace

void CheckWeightsArriveLayerByLayer(ModelBackend* backend, const ModelSpec& spec,
                                    bool lock_host_buffers) {
  constexpr int64_t kBatch = 8;
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  const std::vector<std::vector<float>> weights = InitModelParams(spec, 11);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kBatch * spec.input.size()));
  for (float& v : x) v = uniform(rng);
  std::vector<int32_t> labels(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) {
    labels[i] = static_cast<int32_t>(i % ModelNumClasses(spec));
  }
  auto zeros = [&] {
    std::vector<std::vector<float>> g;
    for (const ParamSpec& p : specs) g.emplace_back(p.elements(), 0.0f);
    return g;
  };

  std::vector<std::vector<float>> want = zeros();
  const absl::StatusOr<float> want_loss =
      backend->ForwardBackward(ConstSpans(weights), x.data(), labels.data(), kBatch, Spans(want));
  ASSERT_TRUE(want_loss.ok()) << want_loss.status();

  std::vector<std::vector<float>> host = weights, grads = zeros();
  if (lock_host_buffers) {
    ASSERT_TRUE(backend->UseHostBuffers(Spans(host), Spans(grads)).ok());
  }
  for (const size_t stop_at : {specs.size(), size_t{2}}) {
    for (std::vector<float>& t : host) t.assign(t.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<size_t> announced;
    int handed = 0;
    const WeightsNeeded needed = [&](size_t first, size_t count) -> absl::Status {
      announced.push_back(first);
      if (first >= stop_at) return absl::UnavailableError("the pull of tensor 2 failed");
      for (size_t t = first; t < first + count; ++t) host[t] = weights[t];
      return absl::OkStatus();
    };
    const absl::StatusOr<float> loss = backend->ForwardBackward(
        ConstSpans(host), x.data(), labels.data(), kBatch, Spans(grads),
        [&](size_t, size_t) { ++handed; }, needed);
    // Layer by layer, each once: every tensor's first index, in order, up to the stop.
    std::vector<size_t> want_announced;
    for (size_t t = 0; t < specs.size() && t <= stop_at; t += 2) want_announced.push_back(t);
    EXPECT_EQ(announced, want_announced) << "stop at " << stop_at;
    if (stop_at < specs.size()) {
      EXPECT_EQ(loss.status(), absl::UnavailableError("the pull of tensor 2 failed"));
      EXPECT_EQ(handed, 0);
      continue;
    }
    ASSERT_TRUE(loss.ok()) << loss.status();
    for (size_t t = 0; t < specs.size(); t += 2) (void)backend->AwaitGradients(t, 2);
    ExpectSameStep(*loss, grads, *want_loss, want, "weights arriving layer by layer");
    EXPECT_EQ(handed, static_cast<int>(specs.size() / 2));
  }
  // A stopped pass leaves nothing behind: the next step is the same as ever.
  std::vector<std::vector<float>> again = zeros();
  const absl::StatusOr<float> after =
      backend->ForwardBackward(ConstSpans(weights), x.data(), labels.data(), kBatch, Spans(again));
  ASSERT_TRUE(after.ok()) << after.status();
  ExpectSameStep(*after, again, *want_loss, want, "the step after a stopped one");
  if (lock_host_buffers) {
    EXPECT_TRUE(backend->UseHostBuffers({}, {}).ok());
  }
}

}  // namespace rubato
