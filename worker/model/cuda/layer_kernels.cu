// The kernels declared in layer_kernels.h. Every kernel is a grid-stride loop over 64-bit indices
// with one thread per output value, so none needs atomics and every result is deterministic.
#include <cuda_runtime.h>

#include "worker/model/cuda/layer_kernels.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks for n values at kThreads per block; the grid-stride loops cover the rest past the cap.
unsigned int BlocksFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
}

__device__ int64_t FirstIndex() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}

__device__ int64_t Stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void Im2ColKernel(ConvGeometry g, const float* x, float* cols, int64_t total) {
  const int64_t patch = g.kernel_h * g.kernel_w * g.in_c;
  for (int64_t idx = FirstIndex(); idx < total; idx += Stride()) {
    const int64_t row = idx / patch;
    const int64_t col = idx - row * patch;
    const int64_t ci = col % g.in_c;
    const int64_t ij = col / g.in_c;
    const int64_t j = ij % g.kernel_w;
    const int64_t i = ij / g.kernel_w;
    const int64_t ow = row % g.out_w;
    const int64_t t = row / g.out_w;
    const int64_t oh = t % g.out_h;
    const int64_t n = t / g.out_h;
    const int64_t ih = oh + i - g.pad_top;
    const int64_t iw = ow + j - g.pad_left;
    float v = 0.0f;
    if (ih >= 0 && ih < g.in_h && iw >= 0 && iw < g.in_w) {
      v = x[((n * g.in_h + ih) * g.in_w + iw) * g.in_c + ci];
    }
    cols[idx] = v;
  }
}

__global__ void Col2ImKernel(ConvGeometry g, const float* dcols, float* dx, int64_t total) {
  const int64_t patch = g.kernel_h * g.kernel_w * g.in_c;
  for (int64_t idx = FirstIndex(); idx < total; idx += Stride()) {
    const int64_t ci = idx % g.in_c;
    int64_t t = idx / g.in_c;
    const int64_t iw = t % g.in_w;
    t /= g.in_w;
    const int64_t ih = t % g.in_h;
    const int64_t n = t / g.in_h;
    float sum = 0.0f;
    for (int64_t i = 0; i < g.kernel_h; ++i) {
      const int64_t oh = ih + g.pad_top - i;
      if (oh < 0 || oh >= g.out_h) continue;
      for (int64_t j = 0; j < g.kernel_w; ++j) {
        const int64_t ow = iw + g.pad_left - j;
        if (ow < 0 || ow >= g.out_w) continue;
        const int64_t row = (n * g.out_h + oh) * g.out_w + ow;
        sum += dcols[row * patch + (i * g.kernel_w + j) * g.in_c + ci];
      }
    }
    dx[idx] = sum;
  }
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t cols, int64_t total) {
  for (int64_t idx = FirstIndex(); idx < total; idx += Stride()) y[idx] += bias[idx % cols];
}

// Block (32, 32): lane x owns column blockIdx.x*32 + x, the 32 rows of threads split the rows,
// then shared memory sums the 32 partial sums of each column.
__global__ void BiasGradientKernel(const float* dy, float* db, int64_t rows, int64_t cols) {
  __shared__ float partial[32][33];
  const int64_t col = blockIdx.x * static_cast<int64_t>(32) + threadIdx.x;
  float sum = 0.0f;
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += 32) sum += dy[r * cols + col];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
    for (int k = 0; k < 32; ++k) total += partial[k][threadIdx.x];
    db[col] = total;
  }
}

__global__ void AddTensorsKernel(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t idx = FirstIndex(); idx < n; idx += Stride()) y[idx] = a[idx] + b[idx];
}

__global__ void ReluForwardKernel(const float* x, float* y, int64_t n) {
  for (int64_t idx = FirstIndex(); idx < n; idx += Stride()) y[idx] = x[idx] > 0.0f ? x[idx] : 0.0f;
}

__global__ void ReluBackwardKernel(const float* y, const float* dy, float* dx, int64_t n) {
  for (int64_t idx = FirstIndex(); idx < n; idx += Stride()) {
    dx[idx] = y[idx] > 0.0f ? dy[idx] : 0.0f;
  }
}

__global__ void MaxPoolForwardKernel(const float* x, float* y, int32_t* argmax, int64_t h,
                                     int64_t w, int64_t c, int64_t total) {
  const int64_t out_h = h / 2, out_w = w / 2;
  const int64_t in_size = h * w * c, out_size = out_h * out_w * c;
  for (int64_t idx = FirstIndex(); idx < total; idx += Stride()) {
    const int64_t n = idx / out_size;
    const int64_t o = idx - n * out_size;  // (oh, ow, k) within the example
    const int64_t k = o % c;
    const int64_t ow = (o / c) % out_w;
    const int64_t oh = o / (c * out_w);
    const int64_t corner = ((2 * oh) * w + 2 * ow) * c + k;
    const int64_t offsets[4] = {corner, corner + c, corner + w * c, corner + (w + 1) * c};
    const float* ex = x + n * in_size;
    int64_t best = offsets[0];
    for (int q = 1; q < 4; ++q) {
      if (ex[offsets[q]] > ex[best]) best = offsets[q];  // the first maximum wins ties
    }
    y[idx] = ex[best];
    argmax[idx] = static_cast<int32_t>(best);
  }
}

__global__ void MaxPoolBackwardKernel(const float* dy, const int32_t* argmax, float* dx, int64_t h,
                                      int64_t w, int64_t c, int64_t total) {
  const int64_t out_h = h / 2, out_w = w / 2;
  const int64_t in_size = h * w * c, out_size = out_h * out_w * c;
  for (int64_t idx = FirstIndex(); idx < total; idx += Stride()) {
    const int64_t n = idx / in_size;
    const int64_t offset = idx - n * in_size;  // (ih, iw, k) within the example
    const int64_t k = offset % c;
    const int64_t iw = (offset / c) % w;
    const int64_t ih = offset / (c * w);
    const int64_t oh = ih / 2, ow = iw / 2;
    float v = 0.0f;
    if (oh < out_h && ow < out_w) {
      const int64_t o = n * out_size + (oh * out_w + ow) * c + k;
      if (argmax[o] == offset) v = dy[o];
    }
    dx[idx] = v;
  }
}

// One thread per row: the class counts here are small (10 for Fashion-MNIST).
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const int32_t* labels, int64_t batch,
                                          int64_t classes, float grad_scale, float* loss,
                                          float* dlogits, int32_t* correct) {
  for (int64_t i = FirstIndex(); i < batch; i += Stride()) {
    const float* z = logits + i * classes;
    float m = z[0];
    int64_t predicted = 0;
    for (int64_t j = 1; j < classes; ++j) {
      if (z[j] > m) {
        m = z[j];
        predicted = j;
      }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < classes; ++j) sum += expf(z[j] - m);
    const int32_t label = labels[i];
    loss[i] = logf(sum) - (z[label] - m);
    if (dlogits != nullptr) {
      float* d = dlogits + i * classes;
      for (int64_t j = 0; j < classes; ++j) {
        float p = expf(z[j] - m) / sum;
        if (j == label) p -= 1.0f;
        d[j] = p * grad_scale;
      }
    }
    if (correct != nullptr) correct[i] = predicted == label ? 1 : 0;
  }
}

__global__ void FillUniformKernel(float* x, int64_t n, uint64_t seed) {
  for (int64_t idx = FirstIndex(); idx < n; idx += Stride()) {
    // splitmix64 of (seed, index), top 24 bits as a fraction.
    uint64_t z = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(idx + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    x[idx] = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
}

}  // namespace

cudaError_t Im2Col(const ConvGeometry& g, const float* x, float* cols, cudaStream_t stream) {
  const int64_t total = g.batch * g.out_h * g.out_w * g.kernel_h * g.kernel_w * g.in_c;
  if (total == 0) return cudaSuccess;
  Im2ColKernel<<<BlocksFor(total), kThreads, 0, stream>>>(g, x, cols, total);
  return cudaGetLastError();
}

cudaError_t Col2Im(const ConvGeometry& g, const float* dcols, float* dx, cudaStream_t stream) {
  const int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  if (total == 0) return cudaSuccess;
  Col2ImKernel<<<BlocksFor(total), kThreads, 0, stream>>>(g, dcols, dx, total);
  return cudaGetLastError();
}

cudaError_t AddBias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total == 0) return cudaSuccess;
  AddBiasKernel<<<BlocksFor(total), kThreads, 0, stream>>>(y, bias, cols, total);
  return cudaGetLastError();
}

cudaError_t BiasGradient(const float* dy, float* db, int64_t rows, int64_t cols,
                         cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const unsigned int blocks = static_cast<unsigned int>((cols + 31) / 32);
  BiasGradientKernel<<<blocks, dim3(32, 32), 0, stream>>>(dy, db, rows, cols);
  return cudaGetLastError();
}

cudaError_t AddTensors(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddTensorsKernel<<<BlocksFor(n), kThreads, 0, stream>>>(a, b, y, n);
  return cudaGetLastError();
}

cudaError_t ReluForward(const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ReluForwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t ReluBackward(const float* y, const float* dy, float* dx, int64_t n,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ReluBackwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(y, dy, dx, n);
  return cudaGetLastError();
}

cudaError_t MaxPoolForward(const float* x, float* y, int32_t* argmax, int64_t batch, int64_t h,
                           int64_t w, int64_t c, cudaStream_t stream) {
  const int64_t total = batch * (h / 2) * (w / 2) * c;
  if (total == 0) return cudaSuccess;
  MaxPoolForwardKernel<<<BlocksFor(total), kThreads, 0, stream>>>(x, y, argmax, h, w, c, total);
  return cudaGetLastError();
}

cudaError_t MaxPoolBackward(const float* dy, const int32_t* argmax, float* dx, int64_t batch,
                            int64_t h, int64_t w, int64_t c, cudaStream_t stream) {
  const int64_t total = batch * h * w * c;
  if (total == 0) return cudaSuccess;
  MaxPoolBackwardKernel<<<BlocksFor(total), kThreads, 0, stream>>>(dy, argmax, dx, h, w, c, total);
  return cudaGetLastError();
}

cudaError_t SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t batch,
                                int64_t classes, float grad_scale, float* loss, float* dlogits,
                                int32_t* correct, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  SoftmaxCrossEntropyKernel<<<BlocksFor(batch), kThreads, 0, stream>>>(
      logits, labels, batch, classes, grad_scale, loss, dlogits, correct);
  return cudaGetLastError();
}

cudaError_t FillUniform(float* x, int64_t n, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillUniformKernel<<<BlocksFor(n), kThreads, 0, stream>>>(x, n, seed);
  return cudaGetLastError();
}

}  // namespace rubato::cuda
