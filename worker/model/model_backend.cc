// The backend-independent checks and layer bookkeeping of model_backend.h.
#include "worker/model/model_backend.h"

#include <cmath>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/mlp.h"

namespace rubato {

absl::Status CheckBackendInputs(absl::Span<const ParamSpec> specs,
                                absl::Span<const absl::Span<const float>> params, const float* x,
                                const int32_t* labels, int64_t n, const char* n_name,
                                int64_t classes) {
  RETURN_IF_ERROR(CheckTensorSpans(specs, params, "params"));
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat(n_name, " must be >= 1, got ", n));
  if (x == nullptr) return absl::InvalidArgumentError("x must not be null");
  if (labels == nullptr) return absl::InvalidArgumentError("labels must not be null");
  return CheckLabels(labels, n, classes);
}

absl::Status NonFiniteLoss(double loss, int64_t n) {
  return absl::InvalidArgumentError(absl::StrCat("non-finite loss ", loss, " over ", n,
                                                 " examples: the parameters have diverged"));
}

std::vector<std::string> LayerNames(const ModelSpec& spec) {
  auto kind_name = [](LayerKind k) -> std::string {
    switch (k) {
      case LayerKind::kReLU:
        return "relu";
      case LayerKind::kMaxPool2D:
        return "pool";
      case LayerKind::kFlatten:
        return "flatten";
      case LayerKind::kDense:
        return "dense";
      case LayerKind::kConv2D:
        return "conv";
      case LayerKind::kAdd:
        return "add";
    }
    return "layer";
  };
  std::map<std::string, int> repeats;
  for (const LayerSpec& l : spec.layers) {
    if (l.weight_name.empty()) ++repeats[kind_name(l.kind)];
  }
  std::map<std::string, int> seen;
  std::vector<std::string> names;
  for (const LayerSpec& l : spec.layers) {
    if (!l.weight_name.empty()) {
      const size_t cut = l.weight_name.find_first_of("/.");
      names.push_back(l.weight_name.substr(0, cut));
      continue;
    }
    const std::string k = kind_name(l.kind);
    names.push_back(repeats[k] > 1 ? absl::StrCat(k, ++seen[k]) : k);
  }
  return names;
}

void LayerFlops(const ModelSpec& spec, size_t layer, int64_t batch, double* forward,
                double* backward) {
  const std::vector<ActivationShape> shapes = ActivationShapes(spec);
  const LayerSpec& l = spec.layers[layer];
  double macs = 0;  // multiply-adds of the forward GEMM
  if (l.kind == LayerKind::kDense) {
    macs = static_cast<double>(batch) * l.in * l.out;
  } else if (l.kind == LayerKind::kConv2D) {
    const ActivationShape& out = shapes[layer + 1];
    macs = static_cast<double>(batch) * out.h * out.w * l.kernel_h * l.kernel_w * l.in_channels *
           l.out_channels;
  }
  *forward = 2 * macs;
  // The weight gradient is one GEMM of the same size; the input gradient another, except for the
  // first layer, whose input gradient is never computed.
  *backward = 2 * macs * (layer == 0 ? 1 : 2);
}

}  // namespace rubato
