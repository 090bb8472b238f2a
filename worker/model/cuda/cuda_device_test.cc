// Runs the CUDA path against a CPU reference where a GPU is present, and otherwise skips visibly,
// saying why (no toolkit at build time, or no driver/device at run time).
#include "worker/model/cuda/cuda_device.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(CudaDeviceTest, ProbeReportsAClearReasonOrADevice) {
  auto devices = ProbeCudaDevices();
  if (!devices.ok()) {
    EXPECT_EQ(devices.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(devices.status().message().empty());
    GTEST_SKIP() << "no GPU here (" << CudaBuildDescription() << "): " << devices.status();
  }
  EXPECT_GE(devices->count, 1);
  EXPECT_FALSE(devices->device0.empty());
}

TEST(CudaDeviceTest, AxpyMatchesTheCpuReference) {
  auto devices = ProbeCudaDevices();
  if (!devices.ok()) GTEST_SKIP() << "no GPU here: " << devices.status();
  const int64_t n = (1 << 20) + 3;  // Not a multiple of the block size.
  std::vector<float> x(n), y(n), expected(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = 0.5f * static_cast<float>(i % 97);
    y[i] = -1.0f + static_cast<float>(i % 13);
    expected[i] = 2.0f * x[i] + y[i];
  }
  ASSERT_TRUE(CudaAxpy(2.0f, x.data(), y.data(), n).ok());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], expected[i]) << "at " << i;
}

TEST(CudaDeviceTest, WithoutCudaEverythingIsUnavailable) {
  if (BuiltWithCuda()) GTEST_SKIP() << "built with " << CudaBuildDescription();
  float y = 1;
  EXPECT_EQ(CudaAxpy(1, &y, &y, 1).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ProbeCudaDevices().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rubato
