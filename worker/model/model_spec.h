// ModelSpec: a sequential layer graph (Dense, Conv2D, ReLU, MaxPool2D, Flatten, and Add, which
// adds an earlier layer's output: a residual connection; then softmax cross-entropy), the
// `--model` strings that name one ("mlp:784-256-10", "cnn", "resnet"), its parameter
// tensors (names, shapes, order) and their deterministic initialisation. The arithmetic lives in
// layers.h; this file is what the server, the worker and every backend agree on.
//
// Activations are float32 NHWC, one example after another: an example of shape {h, w, c} is
// h*w*c values with the channel fastest. Fashion-MNIST's 28x28 images are already that layout
// with c = 1, and an MLP's flat input of n features is the shape {1, 1, n}.
//
// Initialisation (weights; biases are zero):
//   He et al. 2015, "Delving Deep into Rectifiers" (ICCV): layers followed by a ReLU, uniform in
//     +-sqrt(6 / fan_in), i.e. variance 2 / fan_in.
//   Glorot & Bengio 2010, "Understanding the difficulty of training deep feedforward neural
//     networks" (AISTATS): the CNN's output layer, uniform in +-sqrt(6 / (fan_in + fan_out)).
//   The MLP's output layer keeps its historical uniform +-1/sqrt(fan_in) (InitMlpParams), so that
//   "mlp:" models start from exactly the weights MlpSpec models always had.
//   Zero: the last convolution of each residual branch, so that every block starts as the
//     identity and the network trains without batch normalisation (Zhang, Dauphin & Ma 2019,
//     "Fixup Initialization: Residual Learning Without Normalization" (ICLR), whose rule this is;
//     Goyal et al. 2017 zero the branch's last batch-norm scale to the same end).
// fan_in = kh*kw*in_channels for a convolution, in for a dense layer; fan_out likewise.
#ifndef RUBATO_WORKER_MODEL_MODEL_SPEC_H_
#define RUBATO_WORKER_MODEL_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/model/mlp.h"

namespace rubato {

// The shape of one example's activations: height, width, channels (NHWC without the N).
struct ActivationShape {
  int64_t h = 1;
  int64_t w = 1;
  int64_t c = 1;
  int64_t size() const { return h * w * c; }
  bool flat() const { return h == 1 && w == 1; }
  bool operator==(const ActivationShape& o) const { return h == o.h && w == o.w && c == o.c; }
};

enum class LayerKind { kDense, kConv2D, kReLU, kMaxPool2D, kFlatten, kAdd };
enum class Padding { kSame, kValid };
enum class WeightInit { kHeUniform, kGlorotUniform, kUniformInverseSqrtFanIn, kZero };

// One layer. Only the fields of its kind are used.
struct LayerSpec {
  LayerKind kind = LayerKind::kReLU;
  // Dense and Conv2D: the parameter names, e.g. "conv1/kernel" and "conv1/bias".
  std::string weight_name;
  std::string bias_name;
  WeightInit init = WeightInit::kHeUniform;
  // Dense: weight {in, out}, bias {out}; the input must be flat with c == in.
  int64_t in = 0;
  int64_t out = 0;
  // Conv2D, stride 1: kernel {kernel_h, kernel_w, in_channels, out_channels} (HWIO), bias
  // {out_channels}. kSame pads (k-1)/2 before and k/2 after (TensorFlow's rule), keeping h and w;
  // kValid gives h - kernel_h + 1.
  int64_t kernel_h = 0;
  int64_t kernel_w = 0;
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  Padding padding = Padding::kSame;
  // MaxPool2D is always 2x2 with stride 2 (odd rows/columns at the end are dropped); ReLU and
  // Flatten have no fields.
  // Add: its input plus the output of layer `skip_from` (an earlier layer, whose output has the
  // same shape); the gradient flows back both ways.
  int64_t skip_from = -1;

  static LayerSpec Dense(std::string name_w, std::string name_b, int64_t in, int64_t out,
                         WeightInit init);
  static LayerSpec Conv2D(std::string name_w, std::string name_b, int64_t kernel_h,
                          int64_t kernel_w, int64_t in_channels, int64_t out_channels,
                          Padding padding, WeightInit init);
  static LayerSpec ReLU();
  static LayerSpec MaxPool2D();
  static LayerSpec Flatten();
  static LayerSpec Add(int64_t skip_from);
};

// input -> layers[0] -> ... -> layers.back() -> logits, then the mean softmax cross-entropy.
struct ModelSpec {
  ActivationShape input;
  std::vector<LayerSpec> layers;
};

// The output shape of `layer` applied to `in`, or InvalidArgument naming the layer (by index and
// parameter name) and what does not fit: a Dense layer on a non-flat input or of the wrong width,
// a convolution whose in_channels differ from the input's or whose "valid" kernel is larger than
// the input, a pooling of an input below 2x2, a dimension below 1. (An Add's skip is checked by
// ValidateModelSpec, which knows the other layers.)
absl::StatusOr<ActivationShape> LayerOutputShape(const LayerSpec& layer, const ActivationShape& in,
                                                 size_t index);

// OK if the input dimensions are >= 1, every layer fits its input (LayerOutputShape) and gives at
// most 2^31-1 values per example, parameter names are non-empty and unique, every Add's skip_from
// is an earlier layer with the Add's input shape, and the output is flat (the logits); otherwise
// InvalidArgument naming the first problem.
absl::Status ValidateModelSpec(const ModelSpec& spec);

// Shapes of the activations: [0] is spec.input, [i + 1] the output of layer i. `spec` must be
// valid.
std::vector<ActivationShape> ActivationShapes(const ModelSpec& spec);

// The number of classes (logits per example). `spec` must be valid.
int64_t ModelNumClasses(const ModelSpec& spec);

// "mlp:784-256-10" is MlpModelSpec(ParseMlpLayers("784-256-10")); "cnn" is CnnModelSpec();
// "resnet" is ResNetModelSpec(3) and "resnet:N" ResNetModelSpec(N) for N in [1, 16].
// InvalidArgument naming the problem for anything else (an unknown model, "mlp" without sizes, a
// bad size token, "cnn" with arguments, a bad block count).
absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view s);

// Today's MLP as layers: Dense (fc{i}.weight, fc{i}.bias) then ReLU for each hidden layer, then
// the output Dense. Its ModelParamSpecs equal MlpParamSpecs(mlp) and its InitModelParams equal
// InitMlpParams(mlp, seed). `mlp` must be valid.
ModelSpec MlpModelSpec(const MlpSpec& mlp);

// The CNN for 28x28x1 images and 10 classes:
//   conv1 5x5x1->32 same, ReLU, maxpool -> 14x14x32
//   conv2 5x5x32->64 same, ReLU, maxpool -> 7x7x64
//   flatten -> 3136, dense1 3136->128, ReLU, dense2 128->10.
// 454,922 parameters: conv1/kernel {5,5,1,32}, conv1/bias {32}, conv2/kernel {5,5,32,64},
// conv2/bias {64}, dense1/kernel {3136,128}, dense1/bias {128}, dense2/kernel {128,10},
// dense2/bias {10}.
ModelSpec CnnModelSpec();

// A residual CNN for 28x28x1 images and 10 classes, after He et al. 2016, "Deep Residual Learning
// for Image Recognition" (CVPR), section 4.2's CIFAR networks (6n+2 layers: three stages of n
// blocks at 16, 32 and 64 channels), without batch normalisation (zero-initialised branches, see
// the file comment), and widened between stages by a max pool and a 3x3 convolution instead of a
// strided convolution and a projection:
//   stem 3x3 1->16, ReLU                                             -> 28x28x16
//   n blocks: x -> conv 3x3, ReLU, conv 3x3 (zero init), Add(x), ReLU
//   maxpool, widen2 3x3 16->32, ReLU, n blocks                       -> 14x14x32
//   maxpool, widen3 3x3 32->64, ReLU, n blocks                       -> 7x7x64
//   flatten, fc 3136->10.
// n = 3 is "ResNet-20-like": 6n + 4 = 22 weight layers, 345,642 parameters. `blocks` >= 1.
ModelSpec ResNetModelSpec(int blocks);

// Every parameter tensor in the fixed order the worker, servers and backends use: for each layer
// with parameters, in layer order, its weight then its bias. `spec` must be valid.
std::vector<ParamSpec> ModelParamSpecs(const ModelSpec& spec);

// Total number of scalar parameters. `spec` must be valid.
int64_t ModelParamCount(const ModelSpec& spec);

// Initial values, one vector per ModelParamSpecs entry, a pure function of (spec, seed) on every
// platform (see the file comment for the distributions; tensor t draws from mt19937_64 seeded
// with Mix64(Mix64(seed) ^ t), as InitMlpParams does). `spec` must be valid.
std::vector<std::vector<float>> InitModelParams(const ModelSpec& spec, uint64_t seed);

// One line per layer with its output shape and parameters, for logs and reports.
std::string DescribeModel(const ModelSpec& spec);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_MODEL_SPEC_H_
