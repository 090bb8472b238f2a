// layers_train_check: trains a --model (default "cnn") on Fashion-MNIST in one process with the
// layer library and Adam, and prints the test accuracy after each epoch. A check of what a model
// reaches, not part of the worker; for example
//   bazel run //worker/model:layers_train_check -- --epochs=3
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/data/dataset.h"
#include "worker/model/layers.h"
#include "worker/model/model_spec.h"

ABSL_FLAG(std::string, model, "cnn", "model, as in the worker's --model");
ABSL_FLAG(std::string, data_dir, rubato::kFashionMnistDefaultDir, "Fashion-MNIST directory");
ABSL_FLAG(int, epochs, 3, "passes over the training set");
ABSL_FLAG(int, batch_size, 64, "examples per step");
ABSL_FLAG(double, lr, 1e-3, "Adam's learning rate");
ABSL_FLAG(uint64_t, seed, 1, "initialisation and shuffling seed");

namespace rubato {
namespace {

int Run() {
  auto spec = ParseModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) {
    std::fprintf(stderr, "layers_train_check: error: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  auto train = LoadFashionMnist(absl::GetFlag(FLAGS_data_dir), Split::kTrain);
  auto test = LoadFashionMnist(absl::GetFlag(FLAGS_data_dir), Split::kTest);
  if (!train.ok() || !test.ok()) {
    std::fprintf(stderr, "layers_train_check: error: %s\n",
                 (train.ok() ? test.status() : train.status()).ToString().c_str());
    return 1;
  }
  const int batch = absl::GetFlag(FLAGS_batch_size);
  auto batcher = ShardedBatcher::Create(&*train, 0, 1, batch, absl::GetFlag(FLAGS_seed));
  if (!batcher.ok()) {
    std::fprintf(stderr, "layers_train_check: error: %s\n", batcher.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", DescribeModel(*spec).c_str());

  std::vector<std::vector<float>> params = InitModelParams(*spec, absl::GetFlag(FLAGS_seed));
  std::vector<std::vector<float>> grads, m, v;
  for (const auto& p : params) {
    grads.emplace_back(p.size(), 0.0f);
    m.emplace_back(p.size(), 0.0f);
    v.emplace_back(p.size(), 0.0f);
  }
  std::vector<absl::Span<const float>> param_spans(params.begin(), params.end());
  std::vector<absl::Span<float>> grad_spans(grads.begin(), grads.end());
  SequentialModel<float> model(*spec);
  std::vector<float> x(static_cast<size_t>(batch) * train->dim);
  std::vector<int32_t> y(batch);

  // Adam (Kingma & Ba 2015) with the paper's defaults.
  const double lr = absl::GetFlag(FLAGS_lr), beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  int64_t step = 0;
  for (int epoch = 1; epoch <= absl::GetFlag(FLAGS_epochs); ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    for (int64_t s = 0; s < batcher->steps_per_epoch(); ++s) {
      batcher->Next(x.data(), y.data());
      loss_sum += model.ForwardBackward(param_spans, x.data(), y.data(), batch, grad_spans);
      ++step;
      const double c1 = 1 - std::pow(beta1, step), c2 = 1 - std::pow(beta2, step);
      for (size_t t = 0; t < params.size(); ++t) {
        for (size_t k = 0; k < params[t].size(); ++k) {
          const double g = grads[t][k];
          m[t][k] = static_cast<float>(beta1 * m[t][k] + (1 - beta1) * g);
          v[t][k] = static_cast<float>(beta2 * v[t][k] + (1 - beta2) * g * g);
          params[t][k] -= static_cast<float>(lr * (m[t][k] / c1) / (std::sqrt(v[t][k] / c2) + eps));
        }
      }
    }
    const double train_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double test_loss = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < test->size; i += 1000) {
      const int64_t n = std::min<int64_t>(1000, test->size - i);
      model.AccumulateLossAndCorrect(param_spans, test->features.data() + i * test->dim,
                                     test->labels.data() + i, n, &test_loss, &correct);
    }
    std::printf(
        "epoch %d: train loss %.4f, test loss %.4f, test accuracy %.4f, %.1f s (%.1f ms/step)\n",
        epoch, loss_sum / batcher->steps_per_epoch(), test_loss / test->size,
        static_cast<double>(correct) / test->size, train_s,
        1e3 * train_s / batcher->steps_per_epoch());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return rubato::Run();
}
