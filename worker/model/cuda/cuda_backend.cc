// The CUDA ModelBackend. One step on the device, as streams:
//   copy stream:    x, labels H2D -> [inputs_ready] -> layer l's weights H2D -> [weights_ready[l]]
//                   for each l ...                      ... wait grad_done[l] -> grads D2H
//                                                                           -> [grad_copied[l]]
//   compute stream: wait inputs_ready -> forward, layer l after waiting weights_ready[l] -> loss
//                   -> backward L..0, [grad_done[l]] after each parameterised layer's gradients
// The host thread only enqueues, except where `needed` makes it wait for layer l's weights on the
// host before enqueuing their copy (the training loop waiting for that layer's pull), while the
// device computes the layers before. As soon as layer l's D2H copy is enqueued it calls `ready`,
// and whoever pushes the layer (the training loop's communication thread) waits for grad_copied[l]
// in AwaitGradients. The copies go straight to and from the caller's buffers where UseHostBuffers
// page-locked them, else through pinned staging buffers (and a memcpy on the host).
#include "worker/model/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/cuda/cublas_api.h"
#include "worker/model/cuda/cuda_device.h"
#include "worker/model/cuda/cuda_handles.h"
#include "worker/model/cuda/layer_kernels.h"
#include "worker/model/mlp.h"

namespace rubato {
namespace {

// Evaluate's chunk: bounds device scratch to (kEvalChunk, widest activation) floats per layer.
constexpr int64_t kEvalChunk = 256;

// One layer's shapes and where its tensors sit in the parameter and gradient buffers.
struct LayerPlan {
  LayerSpec spec;
  ActivationShape in, out;
  size_t first_param = 0;                      // index into ModelParamSpecs
  int num_params = 0;                          // 2 for Dense and Conv2D, else 0
  int64_t weight_offset = 0, bias_offset = 0;  // floats into params_dev_ / grads_dev_
  int64_t weight_size = 0, bias_size = 0;
  // Conv2D only.
  int64_t pad_top = 0, pad_left = 0;
  int64_t patch = 0;  // kh * kw * cin
};

cuda::ConvGeometry Geometry(const LayerPlan& p, int64_t batch) {
  cuda::ConvGeometry g;
  g.batch = batch;
  g.in_h = p.in.h;
  g.in_w = p.in.w;
  g.in_c = p.in.c;
  g.kernel_h = p.spec.kernel_h;
  g.kernel_w = p.spec.kernel_w;
  g.pad_top = p.pad_top;
  g.pad_left = p.pad_left;
  g.out_h = p.out.h;
  g.out_w = p.out.w;
  return g;
}

class CudaBackend : public ModelBackend {
 public:
  // Everything that does not depend on the batch size: the library, streams, handle, events and
  // the parameter and gradient buffers.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const ModelSpec& spec, int device,
                                                             std::string device_name) {
    std::unique_ptr<CudaBackend> b(new CudaBackend(spec, device, std::move(device_name)));
    ASSIGN_OR_RETURN(b->cublas_api_, CublasApi::Load());
    ASSIGN_OR_RETURN(b->compute_, CudaStream::Create());
    ASSIGN_OR_RETURN(b->copy_, CudaStream::Create());
    ASSIGN_OR_RETURN(b->cublas_, CublasHandle::Create(b->cublas_api_.get(), b->compute_.get()));
    ASSIGN_OR_RETURN(b->inputs_ready_, CudaEvent::Create(/*timing=*/false));
    const size_t total = static_cast<size_t>(b->total_params_);
    ASSIGN_OR_RETURN(b->params_dev_, DeviceArray<float>::Allocate(total, "cudaMalloc(params)"));
    ASSIGN_OR_RETURN(b->grads_dev_, DeviceArray<float>::Allocate(total, "cudaMalloc(grads)"));
    ASSIGN_OR_RETURN(b->params_host_,
                     PinnedArray<float>::Allocate(total, "cudaMallocHost(params)"));
    ASSIGN_OR_RETURN(b->grads_host_, PinnedArray<float>::Allocate(total, "cudaMallocHost(grads)"));
    const size_t layers = b->plan_.size();
    b->grad_done_.resize(layers);
    b->grad_copied_.resize(layers);
    b->weights_ready_.resize(layers);
    for (size_t l = 0; l < layers; ++l) {
      if (b->plan_[l].num_params == 0) continue;
      ASSIGN_OR_RETURN(b->weights_ready_[l], CudaEvent::Create(/*timing=*/false));
      ASSIGN_OR_RETURN(b->grad_done_[l], CudaEvent::Create(/*timing=*/false));
      ASSIGN_OR_RETURN(b->grad_copied_[l], CudaEvent::Create(/*timing=*/false));
    }
    for (auto* events :
         {&b->forward_start_, &b->forward_stop_, &b->backward_start_, &b->backward_stop_}) {
      events->resize(layers);
      for (size_t l = 0; l < layers; ++l) {
        ASSIGN_OR_RETURN((*events)[l], CudaEvent::Create(/*timing=*/true));
      }
    }
    return b;
  }

  ~CudaBackend() override {
    // Let enqueued work finish before its buffers go; errors no longer matter here.
    cudaSetDevice(device_);
    if (compute_.get() != nullptr) cudaStreamSynchronize(compute_.get());
    if (copy_.get() != nullptr) cudaStreamSynchronize(copy_.get());
    Unregister();
  }

  std::string name() const override { return absl::StrCat("cuda (", device_name_, ")"); }

  absl::StatusOr<float> ForwardBackward(absl::Span<const absl::Span<const float>> params,
                                        const float* x, const int32_t* labels, int64_t batch,
                                        absl::Span<const absl::Span<float>> grads,
                                        const GradientsReady& ready,
                                        const WeightsNeeded& needed) override {
    RETURN_IF_ERROR(CheckBackendInputs(param_specs_, params, x, labels, batch, "batch", classes_));
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), grads, "grads"));
    RETURN_IF_ERROR(BeginCall(batch));
    skip_pending_.assign(plan_.size(), false);
    call_grads_.assign(grads.begin(), grads.end());
    grads_direct_ = Registered(pinned_grads_, grads);
    RETURN_IF_ERROR(UploadInputs(x, labels, batch));
    const bool profile = profiling_;

    RETURN_IF_ERROR(Forward(batch, profile, params, needed));

    // Loss, then the backward pass; the last layer's backward time includes the loss.
    const size_t last = plan_.size() - 1;
    if (profile) RETURN_IF_ERROR(Record(backward_start_[last], compute_, "cudaEventRecord"));
    float* dout = grad_a_.get();
    float* spare = grad_b_.get();
    RETURN_IF_ERROR(
        CudaCheck(cuda::SoftmaxCrossEntropy(LayerOutput(last), labels_dev_.get(), batch, classes_,
                                            1.0f / static_cast<float>(batch), loss_dev_.get(), dout,
                                            /*correct=*/nullptr, compute_.get()),
                  "SoftmaxCrossEntropy launch"));
    RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(loss_host_.get(), loss_dev_.get(),
                                              static_cast<size_t>(batch) * sizeof(float),
                                              cudaMemcpyDeviceToHost, compute_.get()),
                              "cudaMemcpyAsync(loss)"));
    for (size_t l = plan_.size(); l-- > 0;) {
      if (profile && l != last) {
        RETURN_IF_ERROR(Record(backward_start_[l], compute_, "cudaEventRecord"));
      }
      // The first layer's input gradient is never needed.
      float* din = l > 0 ? spare : nullptr;
      const float* result = nullptr;
      RETURN_IF_ERROR(Backward(l, batch, dout, din, &result));
      if (profile) RETURN_IF_ERROR(Record(backward_stop_[l], compute_, "cudaEventRecord"));
      if (result == spare) std::swap(dout, spare);  // Flatten and Add pass dout through
      // dout is now d(loss)/d(output of layer l - 1); add what Adds sent it past the layers
      // between.
      if (l > 0 && skip_pending_[l - 1]) {
        const int64_t n = batch * plan_[l - 1].out.size();
        RETURN_IF_ERROR(
            CudaCheck(cuda::AddTensors(dout, skip_grads_[l - 1].get(), dout, n, compute_.get()),
                      "AddTensors launch (skip gradient)"));
        skip_pending_[l - 1] = false;
      }
      // Its copy to the host is enqueued: hand the layer over without waiting for it.
      const LayerPlan& p = plan_[l];
      if (ready && p.num_params > 0) ready(p.first_param, static_cast<size_t>(p.num_params));
    }
    if (!ready) {
      for (size_t l = plan_.size(); l-- > 0;) {
        if (plan_[l].num_params > 0) RETURN_IF_ERROR(AwaitLayer(l));
      }
    }
    RETURN_IF_ERROR(
        CudaCheck(cudaStreamSynchronize(compute_.get()), "cudaStreamSynchronize(compute)"));
    if (profile) RETURN_IF_ERROR(RecordTimes(batch));

    double loss_sum = 0;  // in double, as layers.cc, so the mean does not drift with the batch
    for (int64_t i = 0; i < batch; ++i) loss_sum += static_cast<double>(loss_host_.get()[i]);
    const double loss = loss_sum / static_cast<double>(batch);
    if (!std::isfinite(loss)) return NonFiniteLoss(loss, batch);
    return static_cast<float>(loss);
  }

  absl::StatusOr<EvalResult> Evaluate(absl::Span<const absl::Span<const float>> params,
                                      const float* x, const int32_t* labels, int64_t n) override {
    RETURN_IF_ERROR(CheckBackendInputs(param_specs_, params, x, labels, n, "n", classes_));
    RETURN_IF_ERROR(BeginCall(std::min(n, kEvalChunk)));
    double loss_sum = 0;
    int64_t correct = 0;
    const int64_t input = spec_.input.size();
    for (int64_t start = 0; start < n; start += kEvalChunk) {
      const int64_t chunk = std::min(kEvalChunk, n - start);
      // The parameters go up with the first chunk only.
      RETURN_IF_ERROR(UploadInputs(x + start * input, labels + start, chunk));
      RETURN_IF_ERROR(Forward(chunk, /*profile=*/false,
                              start == 0 ? params : absl::Span<const absl::Span<const float>>()));
      RETURN_IF_ERROR(CudaCheck(
          cuda::SoftmaxCrossEntropy(LayerOutput(plan_.size() - 1), labels_dev_.get(), chunk,
                                    classes_, 0.0f, loss_dev_.get(), /*dlogits=*/nullptr,
                                    correct_dev_.get(), compute_.get()),
          "SoftmaxCrossEntropy launch"));
      RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(loss_host_.get(), loss_dev_.get(),
                                                static_cast<size_t>(chunk) * sizeof(float),
                                                cudaMemcpyDeviceToHost, compute_.get()),
                                "cudaMemcpyAsync(loss)"));
      RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(correct_host_.get(), correct_dev_.get(),
                                                static_cast<size_t>(chunk) * sizeof(int32_t),
                                                cudaMemcpyDeviceToHost, compute_.get()),
                                "cudaMemcpyAsync(correct)"));
      RETURN_IF_ERROR(
          CudaCheck(cudaStreamSynchronize(compute_.get()), "cudaStreamSynchronize(compute)"));
      for (int64_t i = 0; i < chunk; ++i) {
        loss_sum += static_cast<double>(loss_host_.get()[i]);
        correct += correct_host_.get()[i];
      }
    }
    if (!std::isfinite(loss_sum)) return NonFiniteLoss(loss_sum, n);
    return EvalResult{loss_sum / static_cast<double>(n),
                      static_cast<double>(correct) / static_cast<double>(n), n};
  }

  absl::Status AwaitGradients(size_t first, size_t count) override {
    for (size_t l = 0; l < plan_.size(); ++l) {
      const LayerPlan& p = plan_[l];
      if (p.num_params > 0 && p.first_param == first &&
          static_cast<size_t>(p.num_params) == count) {
        // Events belong to the device: select it on this thread too.
        RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
        return AwaitLayer(l);
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("AwaitGradients(", first, ", ", count, ") is not a layer's tensors"));
  }

  absl::Status UseHostBuffers(absl::Span<const absl::Span<float>> params,
                              absl::Span<const absl::Span<float>> grads) override {
    RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
    RETURN_IF_ERROR(CudaCheck(cudaStreamSynchronize(copy_.get()), "cudaStreamSynchronize(copy)"));
    Unregister();
    if (params.empty() && grads.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), params, "params"));
    RETURN_IF_ERROR(CheckTensorSpans(absl::MakeConstSpan(param_specs_), grads, "grads"));
    // The driver locks whole pages, and refuses a range that overlaps one already registered:
    // small tensors (biases) share pages with their neighbours, so register the pages the
    // tensors cover, overlapping and adjacent runs merged, once each.
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    std::vector<std::pair<uintptr_t, uintptr_t>> runs;  // [begin, end), page-aligned
    for (absl::Span<const absl::Span<float>> spans : {params, grads}) {
      for (const absl::Span<float>& t : spans) {
        if (t.empty()) continue;
        const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data());
        const uintptr_t end = begin + t.size() * sizeof(float);
        runs.emplace_back(begin / page * page, (end + page - 1) / page * page);
      }
    }
    std::sort(runs.begin(), runs.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (const auto& r : runs) {
      if (!merged.empty() && r.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, r.second);
      } else {
        merged.push_back(r);
      }
    }
    for (const auto& [begin, end] : merged) {
      void* p = reinterpret_cast<void*>(begin);
      const cudaError_t e = cudaHostRegister(p, end - begin, cudaHostRegisterDefault);
      if (e != cudaSuccess) {
        Unregister();
        return CudaCheck(e, "cudaHostRegister(host buffers)");
      }
      registered_.push_back(p);
    }
    pinned_params_.assign(params.begin(), params.end());
    pinned_grads_.assign(grads.begin(), grads.end());
    return absl::OkStatus();
  }

  void set_profiling(bool on) override { profiling_ = on; }

  std::vector<LayerTime> layer_times() const override { return times_; }

 private:
  CudaBackend(const ModelSpec& spec, int device, std::string device_name)
      : spec_(spec),
        param_specs_(ModelParamSpecs(spec)),
        classes_(ModelNumClasses(spec)),
        device_(device),
        device_name_(std::move(device_name)) {
    const std::vector<ActivationShape> shapes = ActivationShapes(spec);
    size_t param = 0;
    int64_t offset = 0;
    for (size_t l = 0; l < spec.layers.size(); ++l) {
      LayerPlan p;
      p.spec = spec.layers[l];
      p.in = shapes[l];
      p.out = shapes[l + 1];
      p.first_param = param;
      if (p.spec.kind == LayerKind::kDense || p.spec.kind == LayerKind::kConv2D) {
        p.num_params = 2;
        p.weight_size = param_specs_[param].elements();
        p.bias_size = param_specs_[param + 1].elements();
        p.weight_offset = offset;
        p.bias_offset = offset + p.weight_size;
        offset += p.weight_size + p.bias_size;
        param += 2;
      }
      if (p.spec.kind == LayerKind::kConv2D) {
        const bool same = p.spec.padding == Padding::kSame;
        p.pad_top = same ? (p.spec.kernel_h - 1) / 2 : 0;
        p.pad_left = same ? (p.spec.kernel_w - 1) / 2 : 0;
        p.patch = p.spec.kernel_h * p.spec.kernel_w * p.in.c;
      }
      plan_.push_back(p);
    }
    total_params_ = offset;
  }

  // Whether `spans` are the buffers UseHostBuffers page-locked as `pinned`.
  template <typename T>
  static bool Registered(const std::vector<absl::Span<float>>& pinned,
                         absl::Span<const absl::Span<T>> spans) {
    if (pinned.empty() || pinned.size() != spans.size()) return false;
    for (size_t t = 0; t < spans.size(); ++t) {
      if (pinned[t].data() != spans[t].data() || pinned[t].size() != spans[t].size()) return false;
    }
    return true;
  }

  void Unregister() {
    for (void* p : registered_) cudaHostUnregister(p);  // errors no longer matter here
    registered_.clear();
    pinned_params_.clear();
    pinned_grads_.clear();
  }

  // Waits for layer l's gradients to land on the host, and copies them from the staging buffer
  // into the call's spans unless they were copied there directly.
  absl::Status AwaitLayer(size_t l) {
    const LayerPlan& p = plan_[l];
    RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(grad_copied_[l].get()),
                              "cudaEventSynchronize(gradients copied)"));
    if (grads_direct_) return absl::OkStatus();
    std::memcpy(call_grads_[p.first_param].data(), grads_host_.get() + p.weight_offset,
                static_cast<size_t>(p.weight_size) * sizeof(float));
    std::memcpy(call_grads_[p.first_param + 1].data(), grads_host_.get() + p.bias_offset,
                static_cast<size_t>(p.bias_size) * sizeof(float));
    return absl::OkStatus();
  }

  static absl::Status Record(const CudaEvent& e, const CudaStream& s, const char* what) {
    return CudaCheck(cudaEventRecord(e.get(), s.get()), what);
  }

  // Selects the device, waits for anything a failed earlier call left in flight (so the pinned
  // buffers are free) and sizes the per-batch buffers.
  absl::Status BeginCall(int64_t batch) {
    RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device_), "cudaSetDevice"));
    RETURN_IF_ERROR(CudaCheck(cudaStreamSynchronize(copy_.get()), "cudaStreamSynchronize(copy)"));
    RETURN_IF_ERROR(
        CudaCheck(cudaStreamSynchronize(compute_.get()), "cudaStreamSynchronize(compute)"));
    return EnsureCapacity(batch);
  }

  // Allocates every per-batch buffer for `batch` examples unless the current ones are big enough.
  absl::Status EnsureCapacity(int64_t batch) {
    if (batch <= capacity_) return absl::OkStatus();
    capacity_ = 0;
    const size_t layers = plan_.size();
    // Free the old buffers first, so that peak memory is the new size, not the sum.
    acts_.clear();
    cols_.clear();
    argmax_.clear();
    skip_grads_.clear();
    acts_.resize(layers);
    cols_.resize(layers);
    argmax_.resize(layers);
    skip_grads_.resize(layers);
    for (DeviceArray<float>* a : {&grad_a_, &grad_b_, &dcols_, &x_dev_, &loss_dev_}) {
      *a = DeviceArray<float>();
    }
    labels_dev_ = DeviceArray<int32_t>();
    correct_dev_ = DeviceArray<int32_t>();
    x_host_ = PinnedArray<float>();
    loss_host_ = PinnedArray<float>();
    labels_host_ = PinnedArray<int32_t>();
    correct_host_ = PinnedArray<int32_t>();

    const size_t b = static_cast<size_t>(batch);
    int64_t widest = 0, widest_cols = 0;
    for (size_t l = 0; l < layers; ++l) {
      const LayerPlan& p = plan_[l];
      const size_t out = b * static_cast<size_t>(p.out.size());
      widest = std::max(widest, p.out.size());
      if (p.spec.kind == LayerKind::kFlatten) continue;  // its output is its input
      ASSIGN_OR_RETURN(acts_[l], DeviceArray<float>::Allocate(out, "cudaMalloc(activation)"));
      if (p.spec.kind == LayerKind::kConv2D) {
        const int64_t cols = p.out.h * p.out.w * p.patch;
        if (l > 0) widest_cols = std::max(widest_cols, cols);
        ASSIGN_OR_RETURN(cols_[l], DeviceArray<float>::Allocate(b * static_cast<size_t>(cols),
                                                                "cudaMalloc(im2col)"));
      } else if (p.spec.kind == LayerKind::kMaxPool2D) {
        ASSIGN_OR_RETURN(argmax_[l], DeviceArray<int32_t>::Allocate(out, "cudaMalloc(argmax)"));
      } else if (p.spec.kind == LayerKind::kAdd && skip_grads_[p.spec.skip_from].get() == nullptr) {
        const size_t from = static_cast<size_t>(p.spec.skip_from);
        ASSIGN_OR_RETURN(skip_grads_[from], DeviceArray<float>::Allocate(
                                                b * static_cast<size_t>(plan_[from].out.size()),
                                                "cudaMalloc(skip gradient)"));
      }
    }
    const size_t widest_in = b * static_cast<size_t>(widest);
    ASSIGN_OR_RETURN(grad_a_, DeviceArray<float>::Allocate(widest_in, "cudaMalloc(gradient)"));
    ASSIGN_OR_RETURN(grad_b_, DeviceArray<float>::Allocate(widest_in, "cudaMalloc(gradient)"));
    ASSIGN_OR_RETURN(dcols_, DeviceArray<float>::Allocate(b * static_cast<size_t>(widest_cols),
                                                          "cudaMalloc(im2col gradient)"));
    const size_t input = b * static_cast<size_t>(spec_.input.size());
    ASSIGN_OR_RETURN(x_dev_, DeviceArray<float>::Allocate(input, "cudaMalloc(x)"));
    ASSIGN_OR_RETURN(x_host_, PinnedArray<float>::Allocate(input, "cudaMallocHost(x)"));
    ASSIGN_OR_RETURN(labels_dev_, DeviceArray<int32_t>::Allocate(b, "cudaMalloc(labels)"));
    ASSIGN_OR_RETURN(labels_host_, PinnedArray<int32_t>::Allocate(b, "cudaMallocHost(labels)"));
    ASSIGN_OR_RETURN(loss_dev_, DeviceArray<float>::Allocate(b, "cudaMalloc(loss)"));
    ASSIGN_OR_RETURN(loss_host_, PinnedArray<float>::Allocate(b, "cudaMallocHost(loss)"));
    ASSIGN_OR_RETURN(correct_dev_, DeviceArray<int32_t>::Allocate(b, "cudaMalloc(correct)"));
    ASSIGN_OR_RETURN(correct_host_, PinnedArray<int32_t>::Allocate(b, "cudaMallocHost(correct)"));
    capacity_ = batch;
    return absl::OkStatus();
  }

  // Output of layer l on the device; Flatten's is its input.
  float* LayerOutput(size_t l) const {
    if (plan_[l].spec.kind == LayerKind::kFlatten) return LayerInput(l);
    return acts_[l].get();
  }

  // Input of layer l: x for l = 0, else the output of layer l - 1.
  float* LayerInput(size_t l) const { return l == 0 ? x_dev_.get() : LayerOutput(l - 1); }

  // Copies x and labels (staged in pinned memory) to the device on the copy stream, recording
  // inputs_ready_ after them, for the compute stream to wait for now.
  absl::Status UploadInputs(const float* x, const int32_t* labels, int64_t batch) {
    cudaStream_t copy = copy_.get();
    const size_t x_bytes = static_cast<size_t>(batch * spec_.input.size()) * sizeof(float);
    const size_t label_bytes = static_cast<size_t>(batch) * sizeof(int32_t);
    std::memcpy(x_host_.get(), x, x_bytes);
    std::memcpy(labels_host_.get(), labels, label_bytes);
    RETURN_IF_ERROR(CudaCheck(
        cudaMemcpyAsync(x_dev_.get(), x_host_.get(), x_bytes, cudaMemcpyHostToDevice, copy),
        "cudaMemcpyAsync(x)"));
    RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(labels_dev_.get(), labels_host_.get(), label_bytes,
                                              cudaMemcpyHostToDevice, copy),
                              "cudaMemcpyAsync(labels)"));
    RETURN_IF_ERROR(Record(inputs_ready_, copy_, "cudaEventRecord(inputs ready)"));
    return CudaCheck(cudaStreamWaitEvent(compute_.get(), inputs_ready_.get(), 0),
                     "cudaStreamWaitEvent(inputs ready)");
  }

  // Copies layer l's weights and bias from `params` (directly where UseHostBuffers locked them,
  // else staged) on the copy stream and records weights_ready_[l].
  absl::Status UploadLayer(size_t l, absl::Span<const absl::Span<const float>> params,
                           bool direct) {
    const LayerPlan& p = plan_[l];
    for (int k = 0; k < 2; ++k) {
      const absl::Span<const float> t = params[p.first_param + k];
      const int64_t offset = k == 0 ? p.weight_offset : p.bias_offset;
      const float* from = t.data();
      if (!direct) {
        // Staged: the pinned buffer's copy, so that the H2D copy runs asynchronously.
        std::memcpy(params_host_.get() + offset, t.data(), t.size() * sizeof(float));
        from = params_host_.get() + offset;
      }
      RETURN_IF_ERROR(
          CudaCheck(cudaMemcpyAsync(params_dev_.get() + offset, from, t.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, copy_.get()),
                    "cudaMemcpyAsync(params)"));
    }
    return Record(weights_ready_[l], copy_, "cudaEventRecord(weights ready)");
  }

  // The forward pass. Unless `params` is empty (the weights on the device are current), each
  // layer's weights go up just before it, once `needed` (if set) has returned for it, so the
  // first layers compute while the last ones copy. A stop there leaves no copy running from the
  // host buffers.
  absl::Status Forward(int64_t batch, bool profile,
                       absl::Span<const absl::Span<const float>> params,
                       const WeightsNeeded& needed = nullptr) {
    const bool direct = !params.empty() && Registered(pinned_params_, params);
    for (size_t l = 0; l < plan_.size(); ++l) {
      const LayerPlan& p = plan_[l];
      if (!params.empty() && p.num_params > 0) {
        if (needed) {
          if (absl::Status s = needed(p.first_param, static_cast<size_t>(p.num_params)); !s.ok()) {
            (void)cudaStreamSynchronize(copy_.get());
            (void)cudaStreamSynchronize(compute_.get());
            return s;
          }
        }
        RETURN_IF_ERROR(UploadLayer(l, params, direct));
        RETURN_IF_ERROR(CudaCheck(cudaStreamWaitEvent(compute_.get(), weights_ready_[l].get(), 0),
                                  "cudaStreamWaitEvent(weights ready)"));
      }
      if (profile) RETURN_IF_ERROR(Record(forward_start_[l], compute_, "cudaEventRecord"));
      RETURN_IF_ERROR(LayerForward(l, batch));
      if (profile) RETURN_IF_ERROR(Record(forward_stop_[l], compute_, "cudaEventRecord"));
    }
    return absl::OkStatus();
  }

  absl::Status LayerForward(size_t l, int64_t batch) {
    const LayerPlan& p = plan_[l];
    cudaStream_t s = compute_.get();
    const float* in = LayerInput(l);
    float* out = LayerOutput(l);
    const float* w = params_dev_.get() + p.weight_offset;
    const float* bias = params_dev_.get() + p.bias_offset;
    switch (p.spec.kind) {
      case LayerKind::kDense:
        // (B, in) x (in, out) + bias.
        RETURN_IF_ERROR(cublas_.RowMajorGemm(false, false, batch, p.spec.out, p.spec.in, in, w, out,
                                             "cublasSgemm(dense forward)"));
        return CudaCheck(cuda::AddBias(out, bias, batch, p.spec.out, s), "AddBias launch");
      case LayerKind::kConv2D: {
        // cols (B*Ho*Wo, patch) x kernel (patch, cout) + bias: the NHWC output directly.
        const int64_t pixels = batch * p.out.h * p.out.w;
        RETURN_IF_ERROR(
            CudaCheck(cuda::Im2Col(Geometry(p, batch), in, cols_[l].get(), s), "Im2Col launch"));
        RETURN_IF_ERROR(cublas_.RowMajorGemm(false, false, pixels, p.spec.out_channels, p.patch,
                                             cols_[l].get(), w, out, "cublasSgemm(conv forward)"));
        return CudaCheck(cuda::AddBias(out, bias, pixels, p.spec.out_channels, s),
                         "AddBias launch");
      }
      case LayerKind::kReLU:
        return CudaCheck(cuda::ReluForward(in, out, batch * p.in.size(), s), "ReluForward launch");
      case LayerKind::kMaxPool2D:
        return CudaCheck(
            cuda::MaxPoolForward(in, out, argmax_[l].get(), batch, p.in.h, p.in.w, p.in.c, s),
            "MaxPoolForward launch");
      case LayerKind::kFlatten:
        return absl::OkStatus();  // NHWC rows are already flat
      case LayerKind::kAdd:
        return CudaCheck(cuda::AddTensors(in, LayerOutput(static_cast<size_t>(p.spec.skip_from)),
                                          out, batch * p.in.size(), s),
                         "AddTensors launch");
    }
    return absl::OkStatus();
  }

  // Layer l's backward pass from dout: its weight and bias gradients into grads_dev_ (then their
  // copy to the host is enqueued on the copy stream), and, unless din is null, its input gradient
  // into din. *result is where the input gradient is: din, or dout for Flatten.
  absl::Status Backward(size_t l, int64_t batch, const float* dout, float* din,
                        const float** result) {
    const LayerPlan& p = plan_[l];
    cudaStream_t s = compute_.get();
    const float* in = LayerInput(l);
    const float* w = params_dev_.get() + p.weight_offset;
    float* dw = grads_dev_.get() + p.weight_offset;
    float* db = grads_dev_.get() + p.bias_offset;
    *result = din;
    switch (p.spec.kind) {
      case LayerKind::kDense:
        // dW (in, out) = x^T dy; db = column sums of dy; dx (B, in) = dy W^T.
        RETURN_IF_ERROR(cublas_.RowMajorGemm(true, false, p.spec.in, p.spec.out, batch, in, dout,
                                             dw, "cublasSgemm(dense weight gradient)"));
        RETURN_IF_ERROR(
            CudaCheck(cuda::BiasGradient(dout, db, batch, p.spec.out, s), "BiasGradient launch"));
        RETURN_IF_ERROR(CopyGradientsToHost(l));
        if (din == nullptr) return absl::OkStatus();
        return cublas_.RowMajorGemm(false, true, batch, p.spec.in, p.spec.out, dout, w, din,
                                    "cublasSgemm(dense input gradient)");
      case LayerKind::kConv2D: {
        // dK (patch, cout) = cols^T dy; db = column sums of dy; dcols = dy K^T, folded by col2im.
        const int64_t pixels = batch * p.out.h * p.out.w;
        const int64_t cout = p.spec.out_channels;
        RETURN_IF_ERROR(cublas_.RowMajorGemm(true, false, p.patch, cout, pixels, cols_[l].get(),
                                             dout, dw, "cublasSgemm(conv kernel gradient)"));
        RETURN_IF_ERROR(
            CudaCheck(cuda::BiasGradient(dout, db, pixels, cout, s), "BiasGradient launch"));
        RETURN_IF_ERROR(CopyGradientsToHost(l));
        if (din == nullptr) return absl::OkStatus();
        RETURN_IF_ERROR(cublas_.RowMajorGemm(false, true, pixels, p.patch, cout, dout, w,
                                             dcols_.get(), "cublasSgemm(conv input gradient)"));
        return CudaCheck(cuda::Col2Im(Geometry(p, batch), dcols_.get(), din, s), "Col2Im launch");
      }
      case LayerKind::kReLU:
        if (din == nullptr) return absl::OkStatus();
        return CudaCheck(cuda::ReluBackward(LayerOutput(l), dout, din, batch * p.in.size(), s),
                         "ReluBackward launch");
      case LayerKind::kMaxPool2D:
        if (din == nullptr) return absl::OkStatus();
        return CudaCheck(
            cuda::MaxPoolBackward(dout, argmax_[l].get(), din, batch, p.in.h, p.in.w, p.in.c, s),
            "MaxPoolBackward launch");
      case LayerKind::kFlatten:
        *result = dout;
        return absl::OkStatus();
      case LayerKind::kAdd: {
        // The identity's gradient passes through; a copy of it waits for the skipped-from layer.
        *result = dout;
        const size_t from = static_cast<size_t>(p.spec.skip_from);
        const int64_t n = batch * p.out.size();
        if (skip_pending_[from]) {
          return CudaCheck(
              cuda::AddTensors(skip_grads_[from].get(), dout, skip_grads_[from].get(), n, s),
              "AddTensors launch (skip gradient)");
        }
        skip_pending_[from] = true;
        return CudaCheck(
            cudaMemcpyAsync(skip_grads_[from].get(), dout, static_cast<size_t>(n) * sizeof(float),
                            cudaMemcpyDeviceToDevice, s),
            "cudaMemcpyAsync(skip gradient)");
      }
    }
    return absl::OkStatus();
  }

  // After layer l's gradients are enqueued on the compute stream: the copy stream waits for them
  // and copies the layer's weight and bias gradients into the call's page-locked spans, or
  // (adjacent) into the pinned staging buffer.
  absl::Status CopyGradientsToHost(size_t l) {
    const LayerPlan& p = plan_[l];
    RETURN_IF_ERROR(Record(grad_done_[l], compute_, "cudaEventRecord(gradients done)"));
    RETURN_IF_ERROR(CudaCheck(cudaStreamWaitEvent(copy_.get(), grad_done_[l].get(), 0),
                              "cudaStreamWaitEvent(gradients done)"));
    if (grads_direct_) {
      for (int k = 0; k < 2; ++k) {
        const int64_t offset = k == 0 ? p.weight_offset : p.bias_offset;
        const absl::Span<float> to = call_grads_[p.first_param + k];
        RETURN_IF_ERROR(CudaCheck(
            cudaMemcpyAsync(to.data(), grads_dev_.get() + offset, to.size() * sizeof(float),
                            cudaMemcpyDeviceToHost, copy_.get()),
            "cudaMemcpyAsync(gradients)"));
      }
      return Record(grad_copied_[l], copy_, "cudaEventRecord(gradients copied)");
    }
    RETURN_IF_ERROR(CudaCheck(
        cudaMemcpyAsync(grads_host_.get() + p.weight_offset, grads_dev_.get() + p.weight_offset,
                        static_cast<size_t>(p.weight_size + p.bias_size) * sizeof(float),
                        cudaMemcpyDeviceToHost, copy_.get()),
        "cudaMemcpyAsync(gradients)"));
    return Record(grad_copied_[l], copy_, "cudaEventRecord(gradients copied)");
  }

  // After the step's final synchronisation: per-layer times from the profiling events.
  absl::Status RecordTimes(int64_t batch) {
    const std::vector<std::string> names = LayerNames(spec_);
    std::vector<LayerTime> times(plan_.size());
    for (size_t l = 0; l < plan_.size(); ++l) {
      float forward = 0, backward = 0;
      RETURN_IF_ERROR(
          CudaCheck(cudaEventElapsedTime(&forward, forward_start_[l].get(), forward_stop_[l].get()),
                    "cudaEventElapsedTime"));
      RETURN_IF_ERROR(CudaCheck(
          cudaEventElapsedTime(&backward, backward_start_[l].get(), backward_stop_[l].get()),
          "cudaEventElapsedTime"));
      times[l].name = names[l];
      times[l].forward_ms = forward;
      times[l].backward_ms = backward;
      LayerFlops(spec_, l, batch, &times[l].forward_flops, &times[l].backward_flops);
    }
    times_ = std::move(times);
    return absl::OkStatus();
  }

  // Constant after construction.
  const ModelSpec spec_;
  const std::vector<ParamSpec> param_specs_;
  const int64_t classes_;
  const int device_;
  const std::string device_name_;
  std::vector<LayerPlan> plan_;
  int64_t total_params_ = 0;

  // Declared before what is made through them, so that they are destroyed last.
  std::unique_ptr<CublasApi> cublas_api_;
  CudaStream compute_;                    // kernels and GEMMs
  CudaStream copy_;                       // host <-> device copies
  CublasHandle cublas_;                   // bound to compute_
  CudaEvent inputs_ready_;                // x and labels are on the device
  std::vector<CudaEvent> weights_ready_;  // per parameterised layer: its weights are on the device
  std::vector<CudaEvent> grad_done_;      // per parameterised layer: gradients computed
  std::vector<CudaEvent> grad_copied_;    // ... and copied to grads_host_
  std::vector<CudaEvent> forward_start_, forward_stop_, backward_start_, backward_stop_;

  // (total_params_) each, laid out as ModelParamSpecs, weight then bias per layer.
  DeviceArray<float> params_dev_, grads_dev_;
  PinnedArray<float> params_host_, grads_host_;

  // Per-batch scratch for capacity_ examples (EnsureCapacity).
  int64_t capacity_ = 0;
  DeviceArray<float> x_dev_;                  // (B, input size)
  DeviceArray<int32_t> labels_dev_;           // (B)
  PinnedArray<float> x_host_;                 // (B, input size)
  PinnedArray<int32_t> labels_host_;          // (B)
  std::vector<DeviceArray<float>> acts_;      // acts_[l]: (B, out size of l); empty for Flatten
  std::vector<DeviceArray<float>> cols_;      // Conv2D: (B*Ho*Wo, patch), kept for the backward
  std::vector<DeviceArray<int32_t>> argmax_;  // MaxPool2D: (B, out size)
  // skip_grads_[l], for a layer an Add adds: (B, out size of l), the gradient the Adds send it
  // during the backward pass, pending until the backward pass reaches it (skip_pending_[l]).
  std::vector<DeviceArray<float>> skip_grads_;
  std::vector<bool> skip_pending_;
  DeviceArray<float> grad_a_, grad_b_;  // (B, widest activation): d(loss)/d(activation) ping-pong
  DeviceArray<float> dcols_;            // (B*Ho*Wo, patch) of the widest Conv2D after layer 0
  DeviceArray<float> loss_dev_;         // (B) per-example loss
  DeviceArray<int32_t> correct_dev_;    // (B) 1 where the argmax is the label
  PinnedArray<float> loss_host_;
  PinnedArray<int32_t> correct_host_;

  // UseHostBuffers: the page-locked buffers (empty: none) and their addresses to unregister.
  std::vector<absl::Span<float>> pinned_params_, pinned_grads_;
  std::vector<void*> registered_;
  // The current ForwardBackward's gradient spans, and whether they are pinned_grads_ (the copies
  // land there directly). Set before any layer is handed over, read by AwaitGradients.
  std::vector<absl::Span<float>> call_grads_;
  bool grads_direct_ = false;

  bool profiling_ = false;
  std::vector<LayerTime> times_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(const ModelSpec& spec, int device) {
  RETURN_IF_ERROR(ValidateModelSpec(spec));
  ASSIGN_OR_RETURN(const CudaDevices devices, ProbeCudaDevices());
  if (device < 0 || device >= devices.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist (", devices.count, " visible)"));
  }
  RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device), "cudaSetDevice"));
  cudaDeviceProp props;
  RETURN_IF_ERROR(CudaCheck(cudaGetDeviceProperties(&props, device), "cudaGetDeviceProperties"));
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend,
                   CudaBackend::Create(spec, device, props.name));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

absl::StatusOr<double> CublasSgemmGflops(int64_t m, int64_t n, int64_t k, int reps) {
  if (m < 1 || n < 1 || k < 1 || reps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CublasSgemmGflops needs m, n, k, reps >= 1, got ", m, ", ", n, ", ", k, ", ", reps));
  }
  RETURN_IF_ERROR(ProbeCudaDevices().status());
  RETURN_IF_ERROR(CudaCheck(cudaSetDevice(0), "cudaSetDevice"));
  ASSIGN_OR_RETURN(std::unique_ptr<CublasApi> api, CublasApi::Load());
  ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  ASSIGN_OR_RETURN(CublasHandle handle, CublasHandle::Create(api.get(), stream.get()));
  const size_t mk = static_cast<size_t>(m * k), kn = static_cast<size_t>(k * n);
  ASSIGN_OR_RETURN(DeviceArray<float> a, DeviceArray<float>::Allocate(mk, "cudaMalloc(A)"));
  ASSIGN_OR_RETURN(DeviceArray<float> b, DeviceArray<float>::Allocate(kn, "cudaMalloc(B)"));
  ASSIGN_OR_RETURN(DeviceArray<float> c,
                   DeviceArray<float>::Allocate(static_cast<size_t>(m * n), "cudaMalloc(C)"));
  RETURN_IF_ERROR(CudaCheck(cuda::FillUniform(a.get(), m * k, 1, stream.get()), "FillUniform"));
  RETURN_IF_ERROR(CudaCheck(cuda::FillUniform(b.get(), k * n, 2, stream.get()), "FillUniform"));
  ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(/*timing=*/true));
  ASSIGN_OR_RETURN(CudaEvent stop, CudaEvent::Create(/*timing=*/true));
  // Warm-up: the first call pays for cuBLAS's kernel selection and module loading.
  RETURN_IF_ERROR(
      handle.RowMajorGemm(false, false, m, n, k, a.get(), b.get(), c.get(), "cublasSgemm"));
  RETURN_IF_ERROR(CudaCheck(cudaEventRecord(start.get(), stream.get()), "cudaEventRecord"));
  for (int r = 0; r < reps; ++r) {
    RETURN_IF_ERROR(
        handle.RowMajorGemm(false, false, m, n, k, a.get(), b.get(), c.get(), "cublasSgemm"));
  }
  RETURN_IF_ERROR(CudaCheck(cudaEventRecord(stop.get(), stream.get()), "cudaEventRecord"));
  RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(stop.get()), "cudaEventSynchronize"));
  float ms = 0;
  RETURN_IF_ERROR(
      CudaCheck(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime"));
  if (ms <= 0) return absl::InternalError("CublasSgemmGflops: the timed products took no time");
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * reps;
  return flops / (static_cast<double>(ms) * 1e-3) / 1e9;
}

}  // namespace rubato
