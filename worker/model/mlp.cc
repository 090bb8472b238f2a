// MlpSpec parsing and validation, parameter layout and initialisation.
#include "worker/model/mlp.h"

#include <cmath>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/random.h"

namespace rubato {
namespace {

// Layer i maps sizes[i] -> sizes[i + 1].
std::vector<int64_t> LayerSizes(const MlpSpec& spec) {
  std::vector<int64_t> sizes = {spec.input_dim};
  sizes.insert(sizes.end(), spec.hidden.begin(), spec.hidden.end());
  sizes.push_back(spec.num_classes);
  return sizes;
}

}  // namespace

absl::StatusOr<MlpSpec> ParseMlpLayers(absl::string_view s) {
  const std::vector<absl::string_view> tokens = absl::StrSplit(s, '-');
  if (tokens.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLP layers \"", s, "\" need at least an input and a class count, as in \"784-256-10\""));
  }
  std::vector<int64_t> sizes;
  for (absl::string_view token : tokens) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(token, &size) || size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("MLP layers \"", s, "\": token \"", token, "\" is not a positive integer"));
    }
    sizes.push_back(size);
  }
  MlpSpec spec;
  spec.input_dim = sizes.front();
  spec.hidden.assign(sizes.begin() + 1, sizes.end() - 1);
  spec.num_classes = sizes.back();
  return spec;
}

int64_t ParamSpec::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamSpec> MlpParamSpecs(const MlpSpec& spec) {
  const std::vector<int64_t> sizes = LayerSizes(spec);
  std::vector<ParamSpec> specs;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    specs.push_back({absl::StrCat("fc", i, ".weight"), {sizes[i], sizes[i + 1]}});
    specs.push_back({absl::StrCat("fc", i, ".bias"), {sizes[i + 1]}});
  }
  return specs;
}

std::vector<std::vector<float>> InitMlpParams(const MlpSpec& spec, uint64_t seed) {
  const std::vector<ParamSpec> specs = MlpParamSpecs(spec);
  const size_t num_layers = specs.size() / 2;
  std::vector<std::vector<float>> params;
  for (size_t t = 0; t < specs.size(); ++t) {
    std::vector<float> values(specs[t].elements(), 0.0f);
    if (t % 2 == 0) {  // a weight; biases stay zero
      const double fan_in = static_cast<double>(specs[t].shape[0]);
      const bool relu_follows = t / 2 + 1 < num_layers;
      const double bound = relu_follows ? std::sqrt(6.0 / fan_in) : 1.0 / std::sqrt(fan_in);
      // mt19937_64's output is fixed by the standard; map it to [0, 1) by hand, as the
      // standard distributions differ between libraries.
      std::mt19937_64 rng(Mix64(Mix64(seed) ^ t));
      for (float& v : values) {
        const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
        v = static_cast<float>((2.0 * u - 1.0) * bound);
      }
    }
    params.push_back(std::move(values));
  }
  return params;
}

absl::Status CheckLabels(const int32_t* labels, int64_t n, int64_t num_classes) {
  for (int64_t i = 0; i < n; ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat("label ", labels[i], " at index ", i, " is outside [0, ", num_classes, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace rubato
