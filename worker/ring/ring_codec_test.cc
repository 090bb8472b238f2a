#include "worker/ring/ring_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "proto/ring.pb.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

std::string Flatten(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(message.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

// `bytes` as the transport may hand them over: cut every `piece` bytes. Slices of more than 23
// bytes are not inlined, so a ByteBuffer keeps them apart.
grpc::ByteBuffer Cut(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer Whole(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

TEST(RingCodecTest, EncodedBlocksAreRingBlocks) {
  const std::vector<float> data = {1.5f, -2.0f, 0.0f, 3e9f};
  for (int64_t tag : {int64_t{0}, int64_t{7}, int64_t{1} << 40, kRingSyncTag, kRingClosingTag}) {
    const std::vector<float> sent = tag < 0 ? std::vector<float>() : data;
    RingBlock block;
    ASSERT_TRUE(block.ParseFromString(Flatten(EncodeBlock(3, tag, sent))));
    EXPECT_EQ(block.from_rank(), 3);
    EXPECT_EQ(block.tag(), tag);
    EXPECT_EQ(block.data(), FloatBytes(sent));
  }
}

TEST(RingCodecTest, RoundTripOverSlicesCutAnywhere) {
  std::vector<float> data(61);
  for (size_t i = 0; i < data.size(); ++i) data[i] = 0.25f * static_cast<float>(i) - 3.0f;
  for (int from : {0, 1, 1000}) {
    for (int64_t tag : {int64_t{0}, int64_t{5}, int64_t{1} << 50}) {
      const std::string bytes = Flatten(EncodeBlock(from, tag, data));
      for (size_t piece : {size_t{1}, size_t{3}, size_t{5}, size_t{24}, size_t{29}, bytes.size()}) {
        const grpc::ByteBuffer message = Cut(bytes, piece);
        int got_from = -1;
        int64_t got_tag = -1;
        RingPayload payload;
        ASSERT_TRUE(ParseRingBlock(message, &got_from, &got_tag, &payload).ok()) << piece;
        EXPECT_EQ(got_from, from);
        EXPECT_EQ(got_tag, tag);
        ASSERT_EQ(payload.bytes, data.size() * sizeof(float));
        EXPECT_EQ(payload.offset + payload.bytes, bytes.size());

        std::vector<float> out(data.size(), -1.0f);
        EXPECT_TRUE(CombinePayload(payload, absl::MakeSpan(out), RingLink::Combine::kCopy));
        EXPECT_EQ(out, data) << "pieces of " << piece;
        EXPECT_TRUE(CombinePayload(payload, absl::MakeSpan(out), RingLink::Combine::kAdd));
        for (size_t i = 0; i < data.size(); ++i) {
          ASSERT_EQ(out[i], 2 * data[i]) << "pieces of " << piece << ", element " << i;
        }
      }
    }
  }
}

TEST(RingCodecTest, EmptyBlocksParse) {
  for (int64_t tag : {kRingSyncTag, kRingClosingTag, int64_t{0}}) {
    int from = -1;
    int64_t got = 0;
    RingPayload payload;
    ASSERT_TRUE(ParseRingBlock(EncodeBlock(2, tag, {}), &from, &got, &payload).ok());
    EXPECT_EQ(from, 2);
    EXPECT_EQ(got, tag);
    EXPECT_EQ(payload.bytes, 0u);
  }
  // proto3 leaves out zero fields: an empty message is RingBlock{0, 0, ""}.
  int from = -1;
  int64_t tag = -1;
  RingPayload payload;
  ASSERT_TRUE(ParseRingBlock(Whole(""), &from, &tag, &payload).ok());
  EXPECT_EQ(from, 0);
  EXPECT_EQ(tag, 0);
  EXPECT_EQ(payload.bytes, 0u);
}

TEST(RingCodecTest, NonFiniteValuesAreFlaggedButStillCombined) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    // In the first run of 16 floats, in the second, and in the tail; pieces of 7 bytes make some
    // straddle slices.
    for (size_t at : {size_t{5}, size_t{20}, size_t{33}}) {
      std::vector<float> data(40, 1.0f);
      data[at] = bad;
      const grpc::ByteBuffer message = Cut(Flatten(EncodeBlock(0, 1, data)), 7);
      int from;
      int64_t tag;
      RingPayload payload;
      ASSERT_TRUE(ParseRingBlock(message, &from, &tag, &payload).ok());
      std::vector<float> out(data.size(), 0.0f);
      EXPECT_FALSE(CombinePayload(payload, absl::MakeSpan(out), RingLink::Combine::kAdd)) << at;
      EXPECT_EQ(out[0], 1.0f);
      EXPECT_FALSE(std::isfinite(out[at])) << at;
    }
  }
  std::vector<float> big(40, std::numeric_limits<float>::max());
  int from;
  int64_t tag;
  RingPayload payload;
  ASSERT_TRUE(ParseRingBlock(EncodeBlock(0, 1, big), &from, &tag, &payload).ok());
  std::vector<float> out(big.size());
  EXPECT_TRUE(CombinePayload(payload, absl::MakeSpan(out), RingLink::Combine::kCopy));
}

absl::Status Parse(const std::string& bytes) {
  int from;
  int64_t tag;
  RingPayload payload;
  return ParseRingBlock(Cut(bytes, 2), &from, &tag, &payload);
}

TEST(RingCodecTest, TruncatedBlocksAreRefused) {
  const std::string bytes = Flatten(EncodeBlock(300, 70000, {1, 2, 3}));
  const size_t header = bytes.size() - 12;
  for (size_t k = 1; k < bytes.size(); ++k) {
    const std::string prefix = bytes.substr(0, k);
    const absl::Status s = Parse(prefix);
    // A prefix that ends between fields is an empty block, for protobuf as here; any other is not.
    EXPECT_EQ(s.ok(), RingBlock().ParseFromString(prefix)) << k << ": " << s;
    if (k >= header - 1) {  // Cut after data's key: in its length or its bytes.
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    }
  }
  EXPECT_TRUE(Parse(bytes).ok());
}

TEST(RingCodecTest, MalformedBlocksAreRefused) {
  const std::string data = FloatBytes({1, 2});
  const struct {
    std::string bytes;
    std::string error;
  } cases[] = {
      // from_rank as a length-delimited field, tag as a fixed64, data as a varint.
      {std::string("\x0a\x01x", 3), "unexpected or truncated field 1 (wire type 2)"},
      {std::string("\x11", 1) + std::string(8, '\0'),
       "unexpected or truncated field 2 (wire type 1)"},
      {std::string("\x18\x05", 2), "unexpected or truncated field 3 (wire type 0)"},
      // An unknown field, before or after data.
      {std::string("\x22\x01x", 3), "unexpected or truncated field 4"},
      {std::string("\x1a\x08", 2) + data + std::string("\x08\x01", 2), "data must be the last"},
      // A data length past the end, or short of it.
      {std::string("\x1a\x09", 2) + data, "data must be the last"},
      {std::string("\x1a\x07", 2) + data, "data must be the last"},
      // 2^48 in a 7-byte varint, and 0 in an overlong one: neither is a length protobuf reads.
      {std::string("\x08\x02\x1a\x80\x80\x80\x80\x80\x80\x40", 10), "data must be the last"},
      {std::string("\x1a\x80\x80\x80\x80\x80\x80\x00", 8), "data must be the last"},
      // A varint that never ends.
      {std::string("\x08") + std::string(12, '\xff'), "unexpected or truncated field 1"},
  };
  for (const auto& c : cases) {
    const absl::Status s = Parse(c.bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.error));
  }
}

TEST(RingCodecTest, AcknowledgementsRoundTrip) {
  for (int64_t blocks : {int64_t{0}, int64_t{1}, int64_t{1} << 40}) {
    int64_t got = -1;
    ASSERT_TRUE(ParseRingAck(EncodeAck(blocks), &got).ok());
    EXPECT_EQ(got, blocks);
    ASSERT_TRUE(ParseRingAck(Cut(Flatten(EncodeAck(blocks)), 1), &got).ok());
    EXPECT_EQ(got, blocks);
  }
  int64_t got = 0;
  EXPECT_FALSE(ParseRingAck(Whole(std::string("\x08\x80", 2)), &got).ok());
  EXPECT_FALSE(ParseRingAck(Whole(std::string("\xff", 1)), &got).ok());
}

}  // namespace
}  // namespace rubato
