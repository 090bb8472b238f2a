#include "common/grpc_status.h"

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(GrpcStatusTest, RoundTripsCodeAndMessage) {
  const absl::Status cases[] = {
      absl::OkStatus(),
      absl::InvalidArgumentError("tensor 'w' has 3 elements, expected 4"),
      absl::FailedPreconditionError("step 9 is from the future"),
      absl::DeadlineExceededError("waited for workers 1, 2"),
      absl::UnavailableError("shard 0 unreachable"),
  };
  for (const absl::Status& s : cases) {
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), static_cast<int>(s.code()));
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

TEST(GrpcStatusTest, CodesMapByName) {
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "y")).code(),
            absl::StatusCode::kUnavailable);
}

TEST(GrpcStatusTest, ChannelStatesHaveTheirDocumentedNames) {
  EXPECT_EQ(ChannelStateName(GRPC_CHANNEL_IDLE), "IDLE");
  EXPECT_EQ(ChannelStateName(GRPC_CHANNEL_CONNECTING), "CONNECTING");
  EXPECT_EQ(ChannelStateName(GRPC_CHANNEL_READY), "READY");
  EXPECT_EQ(ChannelStateName(GRPC_CHANNEL_TRANSIENT_FAILURE), "TRANSIENT_FAILURE");
  EXPECT_EQ(ChannelStateName(GRPC_CHANNEL_SHUTDOWN), "SHUTDOWN");
}

}  // namespace
}  // namespace rubato
