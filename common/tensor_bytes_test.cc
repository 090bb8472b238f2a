#include "common/tensor_bytes.h"

#include <cstdint>
#include <limits>
#include <string>

#include "common/limits.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(CheckFloatBytesTest, AcceptsExactFiniteFloats) {
  const float values[3] = {1.0f, -2.5f, 0.0f};
  const std::string bytes(reinterpret_cast<const char*>(values), sizeof(values));
  EXPECT_TRUE(CheckFloatBytes("t", bytes, 3).ok());
  EXPECT_TRUE(CheckFloatBytes("t", "", 0).ok());
}

TEST(CheckFloatBytesTest, RefusesWrongSizes) {
  const std::string bytes(12, '\0');
  for (int64_t elements : {int64_t{2}, int64_t{4}, int64_t{-1}}) {
    absl::Status s = CheckFloatBytes("gradient 'w'", bytes, elements);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << elements;
    EXPECT_NE(s.message().find("gradient 'w' has 12 bytes"), std::string::npos) << s;
  }
  EXPECT_EQ(CheckFloatBytes("t", std::string(13, '\0'), 3).code(),
            absl::StatusCode::kInvalidArgument);
}

// Issue 9, finding 1: elements * 4 overflowed to the byte count of the (empty or short) buffer, the
// check passed and the finiteness loop read past it.
TEST(CheckFloatBytesTest, HugeElementCountsDoNotWrapAround) {
  const int64_t wraps_to_zero = int64_t{1} << 62;  // * 4 = 2^64 = 0 mod 2^64.
  EXPECT_EQ(CheckFloatBytes("t", "", wraps_to_zero).code(), absl::StatusCode::kInvalidArgument);
  const int64_t wraps_to_four = (int64_t{1} << 62) + 1;  // * 4 = 4 mod 2^64.
  EXPECT_EQ(CheckFloatBytes("t", std::string(4, '\0'), wraps_to_four).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckFloatBytes("t", "", std::numeric_limits<int64_t>::max()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CheckFloatBytesTest, NamesTheFirstNonFiniteElement) {
  const float values[3] = {1.0f, std::numeric_limits<float>::infinity(), 0.0f};
  const std::string bytes(reinterpret_cast<const char*>(values), sizeof(values));
  absl::Status s = CheckFloatBytes("t", bytes, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("at element 1"), std::string::npos) << s;
}

TEST(CheckedElementCountTest, AcceptsBoundedShapes) {
  EXPECT_EQ(*CheckedElementCount({}), 1);
  EXPECT_EQ(*CheckedElementCount({784, 256}), 784 * 256);
  EXPECT_EQ(*CheckedElementCount({kMaxTensorElements}), kMaxTensorElements);
}

TEST(CheckedElementCountTest, RefusesOverflowingAndHostileShapes) {
  const int64_t two31 = int64_t{1} << 31;
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{two31, two31},
                                         {int64_t{1} << 62},
                                         {(int64_t{1} << 62) + 1},
                                         {kMaxTensorElements + 1},
                                         {kMaxTensorElements, 2},
                                         {0},
                                         {-1},
                                         {std::numeric_limits<int64_t>::max()},
                                         {2, std::numeric_limits<int64_t>::min()},
                                         {1, 1, 1, 1, 1, 1, 1, 1, 1}}) {
    EXPECT_EQ(CheckedElementCount(shape).status().code(), absl::StatusCode::kInvalidArgument)
        << ShapeString(shape);
  }
}

}  // namespace
}  // namespace rubato
