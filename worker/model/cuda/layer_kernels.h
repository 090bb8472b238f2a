// The CUDA kernels of the CUDA ModelBackend (cuda_backend.cc), one launcher per kernel, compiled by
// nvcc (layer_kernels.cu). Plain C++ without Abseil, like cuda_kernels.h: each launcher enqueues
// its kernel on `stream` and returns cudaGetLastError() (cudaSuccess, or why the launch failed).
//
// Layouts match worker/model/layers.cc: activations are row-major (batch, h*w*c) with each example
// in NHWC order; the im2col matrix is (batch*out_h*out_w, kh*kw*cin), row (n, oh, ow), column (i,
// j, ci). All pointers are device pointers.
#ifndef RUBATO_WORKER_MODEL_CUDA_LAYER_KERNELS_H_
#define RUBATO_WORKER_MODEL_CUDA_LAYER_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rubato::cuda {

// The geometry of a stride-1 convolution over NHWC input.
struct ConvGeometry {
  int64_t batch = 0;
  int64_t in_h = 0, in_w = 0, in_c = 0;
  int64_t kernel_h = 0, kernel_w = 0;
  int64_t pad_top = 0, pad_left = 0;  // zero rows/columns before the input ("same": (k-1)/2)
  int64_t out_h = 0, out_w = 0;
};

// cols (batch*out_h*out_w, kh*kw*cin) <- the input patch under the kernel at each output pixel,
// zero where it overhangs the padding.
cudaError_t Im2Col(const ConvGeometry& g, const float* x, float* cols, cudaStream_t stream);

// The adjoint of Im2Col: dx (batch, in_h*in_w*in_c) <- for each input value, the sum of the dcols
// entries it was copied to. Overwrites dx (one thread per input value, no atomics: deterministic).
cudaError_t Col2Im(const ConvGeometry& g, const float* dcols, float* dx, cudaStream_t stream);

// y (rows, cols) += bias (cols), broadcast over the rows.
cudaError_t AddBias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);

// db (cols) <- the column sums of dy (rows, cols).
cudaError_t BiasGradient(const float* dy, float* db, int64_t rows, int64_t cols,
                         cudaStream_t stream);

// y <- a + b for n values (y may be a or b): a residual connection's sum, and its gradient's.
cudaError_t AddTensors(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream);

// y <- max(x, 0) for n values (y may be x).
cudaError_t ReluForward(const float* x, float* y, int64_t n, cudaStream_t stream);

// dx <- dy where y > 0, else 0 (zero where the output was zero, as layers.cc). dx may be dy.
cudaError_t ReluBackward(const float* y, const float* dy, float* dx, int64_t n,
                         cudaStream_t stream);

// 2x2 max pooling with stride 2 over (batch, h*w*c) NHWC input, dropping an odd last row/column:
// y (batch, (h/2)*(w/2)*c) and argmax (same shape), the offset within its example of the input
// value that won the window (the first maximum in the order (0,0), (0,1), (1,0), (1,1)).
cudaError_t MaxPoolForward(const float* x, float* y, int32_t* argmax, int64_t batch, int64_t h,
                           int64_t w, int64_t c, cudaStream_t stream);

// dx (batch, h*w*c) <- dy routed to each window's winner, zero elsewhere. Overwrites dx.
cudaError_t MaxPoolBackward(const float* dy, const int32_t* argmax, float* dx, int64_t batch,
                            int64_t h, int64_t w, int64_t c, cudaStream_t stream);

// Softmax cross-entropy of logits (batch, classes) with each row's maximum subtracted:
// loss[i] <- log(sum_j exp(z_ij - m_i)) - (z_i,label - m_i). If dlogits is not null it gets
// (softmax(z_i) - onehot(label_i)) * grad_scale (1/batch for the mean loss). If correct is not
// null, correct[i] <- 1 when the row's argmax (the first, on ties) is the label, else 0.
cudaError_t SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t batch,
                                int64_t classes, float grad_scale, float* loss, float* dlogits,
                                int32_t* correct, cudaStream_t stream);

// n values uniform in [-1, 1), a pure function of (seed, index): benchmark data.
cudaError_t FillUniform(float* x, int64_t n, uint64_t seed, cudaStream_t stream);

}  // namespace rubato::cuda

#endif  // RUBATO_WORKER_MODEL_CUDA_LAYER_KERNELS_H_
