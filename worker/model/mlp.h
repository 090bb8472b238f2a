// The multilayer perceptron's shape: MlpSpec (layer sizes), its parameter tensors (names, shapes,
// order) and their deterministic initialisation. "mlp:" models (model_spec.h) are built from it;
// the arithmetic lives in layers.h and the backends.
#ifndef RUBATO_WORKER_MODEL_MLP_H_
#define RUBATO_WORKER_MODEL_MLP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rubato {

// input_dim -> hidden[0] -> ... -> hidden[k-1] -> num_classes, ReLU after every hidden layer,
// softmax cross-entropy on the output. No hidden layers gives multinomial logistic regression.
struct MlpSpec {
  int64_t input_dim = 0;
  std::vector<int64_t> hidden;
  int64_t num_classes = 0;
};

// Parses "784-256-10": the first number is input_dim, the last num_classes, those between the
// hidden sizes. InvalidArgument, naming the bad token, for fewer than two numbers, a token that is
// not a positive integer, or an empty token ("784--10").
absl::StatusOr<MlpSpec> ParseMlpLayers(absl::string_view s);

// One parameter tensor, stored densely in row-major order.
struct ParamSpec {
  std::string name;            // "fc0.weight"
  std::vector<int64_t> shape;  // {in, out} for weights, {out} for biases
  int64_t elements() const;    // product of shape
};

// The tensors of layer i (0-based, i = 0 .. hidden.size()), in this order: fc{i}.weight of shape
// {in_i, out_i}, so that activations (B, in_i) x weight (in_i, out_i) -> (B, out_i); then
// fc{i}.bias of shape {out_i}. `spec` must be valid.
std::vector<ParamSpec> MlpParamSpecs(const MlpSpec& spec);

// Initial values, one vector per MlpParamSpecs entry, a pure function of (spec, seed) on every
// platform: weights of ReLU layers uniform in +-sqrt(6 / fan_in) (He/Kaiming), weights of the
// output layer uniform in +-1/sqrt(fan_in), biases zero. `spec` must be valid.
std::vector<std::vector<float>> InitMlpParams(const MlpSpec& spec, uint64_t seed);

// OK if `tensors` holds one span per entry of `specs` with that entry's element count; otherwise
// InvalidArgument naming `role` ("params", "grads") and the offending tensor. For backends.
template <typename SpanT>
absl::Status CheckTensorSpans(absl::Span<const ParamSpec> specs, absl::Span<const SpanT> tensors,
                              absl::string_view role) {
  if (tensors.size() != specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(role, ": expected ", specs.size(), " tensors, got ", tensors.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(tensors[i].size()) != specs[i].elements()) {
      return absl::InvalidArgumentError(absl::StrCat(role, " tensor ", specs[i].name, ": expected ",
                                                     specs[i].elements(), " elements, got ",
                                                     tensors[i].size()));
    }
  }
  return absl::OkStatus();
}

// OK if each of labels[0..n) lies in [0, num_classes); otherwise InvalidArgument naming the first
// bad label and its index.
absl::Status CheckLabels(const int32_t* labels, int64_t n, int64_t num_classes);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_MLP_H_
