// ModelSpec validation, parsing, parameter layout and initialisation.
#include "worker/model/model_spec.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace rubato {
namespace {

bool HasParams(const LayerSpec& layer) {
  return layer.kind == LayerKind::kDense || layer.kind == LayerKind::kConv2D;
}

const char* KindName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kDense:
      return "dense";
    case LayerKind::kConv2D:
      return "conv2d";
    case LayerKind::kReLU:
      return "relu";
    case LayerKind::kMaxPool2D:
      return "maxpool2d";
    case LayerKind::kFlatten:
      return "flatten";
    case LayerKind::kAdd:
      return "add";
  }
  return "?";
}

std::string LayerName(const LayerSpec& layer, size_t index) {
  std::string name = absl::StrCat("layer ", index, " (", KindName(layer.kind));
  if (HasParams(layer)) absl::StrAppend(&name, " ", layer.weight_name);
  return name + ")";
}

std::string ShapeString(const ActivationShape& s) { return absl::StrCat(s.h, "x", s.w, "x", s.c); }

// fan_in and fan_out of a weight, as in the papers: receptive field times channels.
std::pair<double, double> Fans(const LayerSpec& layer) {
  if (layer.kind == LayerKind::kDense) {
    return {static_cast<double>(layer.in), static_cast<double>(layer.out)};
  }
  const double field = static_cast<double>(layer.kernel_h * layer.kernel_w);
  return {field * static_cast<double>(layer.in_channels),
          field * static_cast<double>(layer.out_channels)};
}

double InitBound(const LayerSpec& layer) {
  const auto [fan_in, fan_out] = Fans(layer);
  switch (layer.init) {
    case WeightInit::kHeUniform:
      return std::sqrt(6.0 / fan_in);
    case WeightInit::kGlorotUniform:
      return std::sqrt(6.0 / (fan_in + fan_out));
    case WeightInit::kUniformInverseSqrtFanIn:
      return 1.0 / std::sqrt(fan_in);
    case WeightInit::kZero:
      return 0;
  }
  return 0;
}

}  // namespace

LayerSpec LayerSpec::Dense(std::string name_w, std::string name_b, int64_t in, int64_t out,
                           WeightInit init) {
  LayerSpec l;
  l.kind = LayerKind::kDense;
  l.weight_name = std::move(name_w);
  l.bias_name = std::move(name_b);
  l.in = in;
  l.out = out;
  l.init = init;
  return l;
}

LayerSpec LayerSpec::Conv2D(std::string name_w, std::string name_b, int64_t kernel_h,
                            int64_t kernel_w, int64_t in_channels, int64_t out_channels,
                            Padding padding, WeightInit init) {
  LayerSpec l;
  l.kind = LayerKind::kConv2D;
  l.weight_name = std::move(name_w);
  l.bias_name = std::move(name_b);
  l.kernel_h = kernel_h;
  l.kernel_w = kernel_w;
  l.in_channels = in_channels;
  l.out_channels = out_channels;
  l.padding = padding;
  l.init = init;
  return l;
}

LayerSpec LayerSpec::ReLU() {
  LayerSpec l;
  l.kind = LayerKind::kReLU;
  return l;
}

LayerSpec LayerSpec::MaxPool2D() {
  LayerSpec l;
  l.kind = LayerKind::kMaxPool2D;
  return l;
}

LayerSpec LayerSpec::Flatten() {
  LayerSpec l;
  l.kind = LayerKind::kFlatten;
  return l;
}

LayerSpec LayerSpec::Add(int64_t skip_from) {
  LayerSpec l;
  l.kind = LayerKind::kAdd;
  l.skip_from = skip_from;
  return l;
}

absl::StatusOr<ActivationShape> LayerOutputShape(const LayerSpec& layer, const ActivationShape& in,
                                                 size_t index) {
  const std::string name = LayerName(layer, index);
  switch (layer.kind) {
    case LayerKind::kDense:
      if (layer.in < 1 || layer.out < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": in and out must be >= 1, got ", layer.in, " and ", layer.out));
      }
      if (!in.flat()) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": needs a flat input, got ",
                                                       ShapeString(in), " (add a flatten layer)"));
      }
      if (in.c != layer.in) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": expects ", layer.in, " inputs, the previous layer gives ", in.c));
      }
      return ActivationShape{1, 1, layer.out};
    case LayerKind::kConv2D: {
      if (layer.kernel_h < 1 || layer.kernel_w < 1 || layer.in_channels < 1 ||
          layer.out_channels < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": kernel sizes and channel counts must be >= 1"));
      }
      if (in.c != layer.in_channels) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": expects ", layer.in_channels,
                                                       " input channels, got ", ShapeString(in)));
      }
      if (layer.padding == Padding::kSame) return ActivationShape{in.h, in.w, layer.out_channels};
      if (layer.kernel_h > in.h || layer.kernel_w > in.w) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": a ", layer.kernel_h, "x", layer.kernel_w,
                         " \"valid\" kernel does not fit input ", ShapeString(in)));
      }
      return ActivationShape{in.h - layer.kernel_h + 1, in.w - layer.kernel_w + 1,
                             layer.out_channels};
    }
    case LayerKind::kMaxPool2D:
      if (in.h < 2 || in.w < 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": 2x2 pooling needs an input of at least 2x2, got ", ShapeString(in)));
      }
      return ActivationShape{in.h / 2, in.w / 2, in.c};
    case LayerKind::kReLU:
      return in;
    case LayerKind::kFlatten:
      return ActivationShape{1, 1, in.size()};
    case LayerKind::kAdd:
      if (layer.skip_from < 0 || static_cast<size_t>(layer.skip_from) >= index) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": skip_from must name an earlier layer, got ", layer.skip_from));
      }
      return in;
  }
  return absl::InvalidArgumentError(absl::StrCat(name, ": unknown layer kind"));
}

absl::Status ValidateModelSpec(const ModelSpec& spec) {
  if (spec.input.h < 1 || spec.input.w < 1 || spec.input.c < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("input shape must be at least 1x1x1, got ", ShapeString(spec.input)));
  }
  if (spec.input.size() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input shape ", ShapeString(spec.input), " exceeds 2^31-1 values"));
  }
  if (spec.layers.empty()) return absl::InvalidArgumentError("a model needs at least one layer");
  ActivationShape shape = spec.input;
  std::vector<ActivationShape> outputs;  // of the layers so far
  std::set<std::string> names;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& layer = spec.layers[i];
    auto next = LayerOutputShape(layer, shape, i);
    if (!next.ok()) return next.status();
    if (layer.kind == LayerKind::kAdd && !(outputs[layer.skip_from] == shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          LayerName(layer, i), ": adds layer ", layer.skip_from, "'s output ",
          ShapeString(outputs[layer.skip_from]), " to an input of ", ShapeString(shape)));
    }
    shape = *next;
    outputs.push_back(shape);
    // MaxPool2D records its winners as int32 offsets within an example (here and for the input).
    if (shape.size() > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(LayerName(layer, i), ": output ",
                                                     ShapeString(shape), " exceeds 2^31-1 values"));
    }
    if (!HasParams(layer)) continue;
    for (const std::string* n : {&layer.weight_name, &layer.bias_name}) {
      if (n->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(LayerName(layer, i), ": parameter names must not be empty"));
      }
      if (!names.insert(*n).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(LayerName(layer, i), ": parameter name \"", *n, "\" is used twice"));
      }
    }
  }
  if (!shape.flat()) {
    return absl::InvalidArgumentError(absl::StrCat("the last layer must give flat logits, got ",
                                                   ShapeString(shape), " (add flatten, dense)"));
  }
  return absl::OkStatus();
}

std::vector<ActivationShape> ActivationShapes(const ModelSpec& spec) {
  std::vector<ActivationShape> shapes = {spec.input};
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    shapes.push_back(LayerOutputShape(spec.layers[i], shapes.back(), i).value());
  }
  return shapes;
}

int64_t ModelNumClasses(const ModelSpec& spec) { return ActivationShapes(spec).back().c; }

absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view s) {
  constexpr absl::string_view kExpected =
      "expected \"mlp:<input>-<hidden>...-<classes>\" (e.g. \"mlp:784-256-10\"), \"cnn\", "
      "\"resnet\" or \"resnet:<blocks per stage, 1-16>\"";
  if (absl::StartsWith(s, "mlp:")) {
    auto mlp = ParseMlpLayers(s.substr(4));
    if (!mlp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--model \"", s, "\": ", mlp.status().message()));
    }
    return MlpModelSpec(*mlp);
  }
  if (s == "cnn") return CnnModelSpec();
  if (s == "resnet") return ResNetModelSpec(3);
  if (absl::StartsWith(s, "resnet:")) {
    int blocks = 0;
    if (!absl::SimpleAtoi(s.substr(7), &blocks) || blocks < 1 || blocks > 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model \"", s, "\": the blocks per stage must be a whole number in [1, 16]"));
    }
    return ResNetModelSpec(blocks);
  }
  if (s == "mlp") {
    return absl::InvalidArgumentError(
        absl::StrCat("--model \"mlp\" needs layer sizes after a colon: ", kExpected));
  }
  if (absl::StartsWith(s, "cnn")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model \"", s, "\": \"cnn\" takes no arguments; ", kExpected));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown --model \"", s, "\": ", kExpected));
}

ModelSpec MlpModelSpec(const MlpSpec& mlp) {
  std::vector<int64_t> sizes = {mlp.input_dim};
  sizes.insert(sizes.end(), mlp.hidden.begin(), mlp.hidden.end());
  sizes.push_back(mlp.num_classes);
  ModelSpec spec;
  spec.input = {1, 1, mlp.input_dim};
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    const bool last = i + 2 == sizes.size();
    spec.layers.push_back(LayerSpec::Dense(
        absl::StrCat("fc", i, ".weight"), absl::StrCat("fc", i, ".bias"), sizes[i], sizes[i + 1],
        last ? WeightInit::kUniformInverseSqrtFanIn : WeightInit::kHeUniform));
    if (!last) spec.layers.push_back(LayerSpec::ReLU());
  }
  return spec;
}

ModelSpec CnnModelSpec() {
  ModelSpec spec;
  spec.input = {28, 28, 1};
  spec.layers = {
      LayerSpec::Conv2D("conv1/kernel", "conv1/bias", 5, 5, 1, 32, Padding::kSame,
                        WeightInit::kHeUniform),
      LayerSpec::ReLU(),
      LayerSpec::MaxPool2D(),
      LayerSpec::Conv2D("conv2/kernel", "conv2/bias", 5, 5, 32, 64, Padding::kSame,
                        WeightInit::kHeUniform),
      LayerSpec::ReLU(),
      LayerSpec::MaxPool2D(),
      LayerSpec::Flatten(),
      LayerSpec::Dense("dense1/kernel", "dense1/bias", 7 * 7 * 64, 128, WeightInit::kHeUniform),
      LayerSpec::ReLU(),
      LayerSpec::Dense("dense2/kernel", "dense2/bias", 128, 10, WeightInit::kGlorotUniform),
  };
  return spec;
}

ModelSpec ResNetModelSpec(int blocks) {
  ModelSpec spec;
  spec.input = {28, 28, 1};
  auto conv = [&](const std::string& name, int64_t cin, int64_t cout, WeightInit init) {
    spec.layers.push_back(
        LayerSpec::Conv2D(name + "/kernel", name + "/bias", 3, 3, cin, cout, Padding::kSame, init));
  };
  conv("stem", 1, 16, WeightInit::kHeUniform);
  spec.layers.push_back(LayerSpec::ReLU());
  int64_t channels = 16;
  for (int stage = 1; stage <= 3; ++stage) {
    if (stage > 1) {
      spec.layers.push_back(LayerSpec::MaxPool2D());
      conv(absl::StrCat("widen", stage), channels, 2 * channels, WeightInit::kHeUniform);
      spec.layers.push_back(LayerSpec::ReLU());
      channels *= 2;
    }
    for (int b = 1; b <= blocks; ++b) {
      const int64_t x = static_cast<int64_t>(spec.layers.size()) - 1;  // the block's input
      const std::string name = absl::StrCat("res", stage, "_", b);
      conv(name + "a", channels, channels, WeightInit::kHeUniform);
      spec.layers.push_back(LayerSpec::ReLU());
      conv(name + "b", channels, channels, WeightInit::kZero);
      spec.layers.push_back(LayerSpec::Add(x));
      spec.layers.push_back(LayerSpec::ReLU());
    }
  }
  spec.layers.push_back(LayerSpec::Flatten());
  spec.layers.push_back(
      LayerSpec::Dense("fc/kernel", "fc/bias", 7 * 7 * channels, 10, WeightInit::kGlorotUniform));
  return spec;
}

std::vector<ParamSpec> ModelParamSpecs(const ModelSpec& spec) {
  std::vector<ParamSpec> specs;
  for (const LayerSpec& layer : spec.layers) {
    if (layer.kind == LayerKind::kDense) {
      specs.push_back({layer.weight_name, {layer.in, layer.out}});
      specs.push_back({layer.bias_name, {layer.out}});
    } else if (layer.kind == LayerKind::kConv2D) {
      specs.push_back({layer.weight_name,
                       {layer.kernel_h, layer.kernel_w, layer.in_channels, layer.out_channels}});
      specs.push_back({layer.bias_name, {layer.out_channels}});
    }
  }
  return specs;
}

int64_t ModelParamCount(const ModelSpec& spec) {
  int64_t n = 0;
  for (const ParamSpec& p : ModelParamSpecs(spec)) n += p.elements();
  return n;
}

std::vector<std::vector<float>> InitModelParams(const ModelSpec& spec, uint64_t seed) {
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  std::vector<std::vector<float>> params;
  uint64_t t = 0;  // tensor index into specs
  for (const LayerSpec& layer : spec.layers) {
    if (!HasParams(layer)) continue;
    const double bound = InitBound(layer);
    std::vector<float> weight(specs[t].elements());
    // mt19937_64's output is fixed by the standard; map it to [0, 1) by hand, as the standard
    // distributions differ between libraries (the same draw as InitMlpParams).
    std::mt19937_64 rng(Mix64(Mix64(seed) ^ t));
    for (float& v : weight) {
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
      v = static_cast<float>((2.0 * u - 1.0) * bound);
    }
    params.push_back(std::move(weight));
    params.emplace_back(specs[t + 1].elements(), 0.0f);
    t += 2;
  }
  return params;
}

std::string DescribeModel(const ModelSpec& spec) {
  std::string text = absl::StrCat("input ", ShapeString(spec.input), "\n");
  ActivationShape shape = spec.input;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& layer = spec.layers[i];
    shape = LayerOutputShape(layer, shape, i).value();
    absl::StrAppend(&text, KindName(layer.kind));
    if (layer.kind == LayerKind::kConv2D) {
      absl::StrAppend(&text, " ", layer.kernel_h, "x", layer.kernel_w, " ", layer.in_channels, "->",
                      layer.out_channels, layer.padding == Padding::kSame ? " same" : " valid");
    } else if (layer.kind == LayerKind::kDense) {
      absl::StrAppend(&text, " ", layer.in, "->", layer.out);
    } else if (layer.kind == LayerKind::kAdd) {
      absl::StrAppend(&text, " layer ", layer.skip_from);
    }
    absl::StrAppend(&text, " -> ", ShapeString(shape));
    if (HasParams(layer)) {
      absl::StrAppend(&text, "  [", layer.weight_name, ", ", layer.bias_name, "]");
    }
    absl::StrAppend(&text, "\n");
  }
  absl::StrAppend(&text, "parameters: ", ModelParamCount(spec), "\n");
  return text;
}

}  // namespace rubato
