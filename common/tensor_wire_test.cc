#include "common/tensor_wire.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "proto/parameter_server.pb.h"

namespace rubato {
namespace {

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// `whole` cut into pieces at the given offsets.
ByteChunks Cut(const std::string& whole, std::vector<size_t> cuts) {
  ByteChunks chunks;
  size_t at = 0;
  for (size_t c : cuts) {
    chunks.Append(absl::string_view(whole).substr(at, c - at));
    at = c;
  }
  chunks.Append(absl::string_view(whole).substr(at));
  return chunks;
}

TEST(TensorWireTest, FloatsAcrossEveryPieceBoundary) {
  const std::vector<float> values = {1.5f, -2.25f, 3e-38f, 7.0f, -0.0f, 1e30f};
  const std::string bytes = Bytes(values);
  // Every way of cutting the bytes once and twice, including inside a float.
  for (size_t a = 0; a <= bytes.size(); ++a) {
    for (size_t b = a; b <= bytes.size(); ++b) {
      const ByteChunks chunks = Cut(bytes, {a, b});
      ASSERT_EQ(chunks.size(), bytes.size());
      std::vector<float> out(values.size(), 0.0f);
      CopyFloats(chunks, out.data());
      EXPECT_EQ(Bytes(out), bytes) << a << "," << b;
      std::vector<float> acc = {1, 1, 1, 1, 1, 1};
      AddFloats(chunks, acc.data());
      for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(acc[i], 1.0f + values[i]);
      EXPECT_EQ(FirstNonFinite(chunks), -1);
    }
  }
}

TEST(TensorWireTest, CopyAndAddWithSquaresMatchTheirPlainFormsAndADoubleSum) {
  // Across blocks (1024 values), runs that are not multiples of 8, and cuts inside a float.
  std::vector<float> values(5000);
  double expected = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(std::sin(0.1 * i) * (1 + i % 7));
    expected += static_cast<double>(values[i]) * values[i];
  }
  const std::string bytes = Bytes(values);
  for (const std::vector<size_t>& cuts :
       std::vector<std::vector<size_t>>{{}, {4 * 1023 + 2}, {4 * 9 + 1, 4 * 2500}, {1, 19997}}) {
    const ByteChunks chunks = Cut(bytes, cuts);
    std::vector<float> plain(values.size()), fused(values.size());
    double squares = 10.0;  // Added to, not overwritten.
    CopyFloats(chunks, plain.data());
    CopyFloats(chunks, fused.data(), &squares);
    EXPECT_EQ(plain, fused);
    EXPECT_NEAR(squares - 10.0, expected, 1e-6 * expected);
    squares = 0;
    AddFloats(chunks, plain.data());
    AddFloats(chunks, fused.data(), &squares);
    EXPECT_EQ(plain, fused);
    EXPECT_NEAR(squares, expected, 1e-6 * expected);
  }
}

TEST(TensorWireTest, FirstNonFiniteFindsTheFirstNanOrInfWhereverItIs) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (size_t at : {0u, 1u, 1023u, 1024u, 3000u}) {
      std::vector<float> v(3001, 0.5f);
      v[at] = bad;
      if (at + 5 < v.size()) v[at + 5] = bad;  // a later one is not reported
      const std::string bytes = Bytes(v);
      EXPECT_EQ(FirstNonFinite(Cut(bytes, {4 * at + 2})), static_cast<int64_t>(at));
      EXPECT_EQ(FirstNonFinite(ByteChunks(bytes)), static_cast<int64_t>(at));
    }
  }
  // CheckFloatChunks names the value and its index, wherever the pieces are cut.
  std::vector<float> v(10, 1.0f);
  v[6] = -std::numeric_limits<float>::infinity();
  const std::string bytes = Bytes(v);
  absl::Status s = CheckFloatChunks("gradient 'w'", Cut(bytes, {25}), 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("gradient 'w' has a non-finite value (-inf) at element 6"),
            std::string::npos)
      << s;
  s = CheckFloatChunks("gradient 'w'", Cut(bytes, {3}), 11);
  EXPECT_NE(s.message().find("has 40 bytes, expected 44 (11 float32 values)"), std::string::npos)
      << s;
  // The largest finite float and denormals are finite.
  const std::vector<float> edge = {std::numeric_limits<float>::max(), 1e-45f, -1e-45f};
  EXPECT_EQ(FirstNonFinite(ByteChunks(Bytes(edge))), -1);
}

// A part of a gradient: the offset is written (and read) as protobuf's TensorValue.offset, and a
// sub-range of cut pieces holds the same bytes as the flat data's.
TEST(TensorWireTest, APartsOffsetRoundTripsAndSubRangesFollowThePieces) {
  const std::vector<float> part = {7, 8};
  std::string message;
  EncodePushHeader(1, 5, &message);
  EncodeTensorHeader(3, "w", 0, 8, &message, 262144);
  message += Bytes(part);
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(message));
  ASSERT_EQ(parsed.gradients_size(), 1);
  EXPECT_EQ(parsed.gradients(0).offset(), 262144);
  EXPECT_EQ(parsed.gradients(0).data(), Bytes(part));
  WirePush ours;
  ASSERT_TRUE(ParsePushRequest(Cut(message, {2, 9}), 10, &ours).ok());
  ASSERT_EQ(ours.gradients.size(), 1u);
  EXPECT_EQ(ours.gradients[0].offset, 262144);

  const std::string flat = "abcdefghijklmnop";
  const ByteChunks pieces = Cut(flat, {3, 4, 10});
  for (size_t from = 0; from <= flat.size(); ++from) {
    for (size_t length = 0; from + length <= flat.size() + 2; ++length) {
      EXPECT_EQ(pieces.Sub(from, length).Flatten(), flat.substr(from, length))
          << from << "+" << length;
    }
  }
}

TEST(TensorWireTest, OurFramingIsProtobufsAndBothParsersAgree) {
  const std::vector<float> g0 = {1, 2, 3};
  const std::vector<float> g1 = {-4, 5e-3f};
  std::string message;
  EncodePushHeader(7, 123456789012, &message);
  EncodeTensorHeader(3, "layer/kernel", 0, 12, &message);
  message += Bytes(g0);
  EncodeTensorHeader(3, "b", 0, 8, &message);
  message += Bytes(g1);
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(message));
  EXPECT_EQ(parsed.worker_id(), 7);
  EXPECT_EQ(parsed.step(), 123456789012);
  ASSERT_EQ(parsed.gradients_size(), 2);
  EXPECT_EQ(parsed.gradients(0).name(), "layer/kernel");
  EXPECT_EQ(parsed.gradients(0).data(), Bytes(g0));
  EXPECT_EQ(parsed.gradients(1).data(), Bytes(g1));

  WirePush ours;
  ASSERT_TRUE(ParsePushRequest(Cut(message, {3, 20, 21}), 10, &ours).ok());
  EXPECT_EQ(ours.worker_id, 7);
  EXPECT_EQ(ours.step, 123456789012);
  ASSERT_EQ(ours.gradients.size(), 2u);
  EXPECT_EQ(ours.gradients[0].name, "layer/kernel");
  EXPECT_EQ(ours.gradients[0].data.Flatten(), Bytes(g0));
  EXPECT_EQ(ours.gradients[1].name, "b");
  EXPECT_EQ(ours.gradients[1].data.Flatten(), Bytes(g1));

  // A pull answer with versions, written by protobuf, read by us.
  PullResponse response;
  TensorValue* v = response.add_tensors();
  v->set_name("w");
  v->set_version(42);
  v->set_data(Bytes(g0));
  response.add_tensors()->set_name("empty");
  std::vector<WireTensor> tensors;
  const std::string serialized = response.SerializeAsString();  // the views point into it
  ASSERT_TRUE(ParsePullResponse(ByteChunks(serialized), 2, &tensors).ok());
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[0].name, "w");
  EXPECT_EQ(tensors[0].version, 42);
  EXPECT_EQ(tensors[0].data.Flatten(), Bytes(g0));
  EXPECT_EQ(tensors[1].name, "empty");
  EXPECT_TRUE(tensors[1].data.empty());
  // And our framing with a version, read by protobuf.
  std::string ours_pull;
  EncodeTensorHeader(1, "w", 42, 12, &ours_pull);
  ours_pull += Bytes(g0);
  PullResponse back;
  ASSERT_TRUE(back.ParseFromString(ours_pull));
  EXPECT_EQ(back.tensors(0).version(), 42);
  EXPECT_EQ(back.tensors(0).data(), Bytes(g0));
}

TEST(TensorWireTest, PushExtrasAreProtobufsBatchSizeAndNoiseRelay) {
  NoiseScaleRelay relay;
  relay.set_step(41);
  relay.set_g2_ema(0.25);
  relay.set_trace_ema(-3.5);
  std::string message;
  EncodePushHeader(2, 43, &message);
  EncodePushExtras(256, &relay, &message);
  EncodeTensorHeader(3, "b", 0, 4, &message);
  message += Bytes({1.5f});
  PushRequest reference;
  ASSERT_TRUE(reference.ParseFromString(message));
  EXPECT_EQ(reference.batch_size(), 256);
  EXPECT_EQ(reference.noise_relay().SerializeAsString(), relay.SerializeAsString());
  WirePush ours;
  ASSERT_TRUE(ParsePushRequest(Cut(message, {4, 9}), 10, &ours).ok());
  EXPECT_EQ(ours.batch_size, 256);
  ASSERT_TRUE(ours.noise_relay.has_value());
  EXPECT_EQ(ours.noise_relay->step(), 41);
  EXPECT_EQ(ours.noise_relay->g2_ema(), 0.25);
  EXPECT_EQ(ours.noise_relay->trace_ema(), -3.5);
  ASSERT_EQ(ours.gradients.size(), 1u);
  // None given: nothing written, nothing read.
  std::string plain;
  EncodePushExtras(0, nullptr, &plain);
  EXPECT_TRUE(plain.empty());
  // A relay given twice is merged, as protobuf merges it; one that does not parse is refused.
  NoiseScaleRelay second;
  second.set_trace_ema(7);
  std::string twice = message;
  EncodePushExtras(0, &second, &twice);
  ASSERT_TRUE(reference.ParseFromString(twice));
  ASSERT_TRUE(ParsePushRequest(ByteChunks(twice), 10, &ours).ok());
  EXPECT_EQ(ours.noise_relay->SerializeAsString(), reference.noise_relay().SerializeAsString());
  EXPECT_EQ(ours.noise_relay->step(), 41);
  EXPECT_EQ(ours.noise_relay->trace_ema(), 7);
  const std::string garbled = std::string("\x2a\x02\x08\xff", 4);  // A truncated varint inside.
  EXPECT_EQ(ParsePushRequest(ByteChunks(garbled), 10, &ours).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorWireTest, TheConsistencyRelayIsProtobufsAndAGarbledOneIsRefused) {
  ConsistencyRelay relay;
  relay.set_compute_ms(21.5);
  relay.mutable_change()->set_from_step(41);
  relay.mutable_change()->set_backup_workers(1);
  relay.mutable_change()->add_compute_ms(20);
  relay.mutable_change()->add_compute_ms(80);
  std::string message;
  EncodePushHeader(3, 45, &message);
  EncodePushExtras(0, nullptr, &message, &relay);
  EncodeTensorHeader(3, "w", 0, 4, &message);
  message += Bytes({2.5f});
  PushRequest reference;
  ASSERT_TRUE(reference.ParseFromString(message));
  EXPECT_EQ(reference.consistency_relay().SerializeAsString(), relay.SerializeAsString());
  WirePush ours;
  ASSERT_TRUE(ParsePushRequest(Cut(message, {3, 11}), 10, &ours).ok());
  ASSERT_TRUE(ours.consistency_relay.has_value());
  EXPECT_EQ(ours.consistency_relay->SerializeAsString(), relay.SerializeAsString());
  EXPECT_FALSE(ours.noise_relay.has_value());
  EXPECT_EQ(ours.step, 45);
  ASSERT_EQ(ours.gradients.size(), 1u);
  EXPECT_EQ(WirePushOf(reference).consistency_relay->SerializeAsString(),
            relay.SerializeAsString());
  const std::string garbled = std::string("\x32\x02\x08\xff", 4);
  const absl::Status s = ParsePushRequest(ByteChunks(garbled), 10, &ours);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("consistency_relay"), std::string::npos) << s;
}

TEST(TensorWireTest, NegativeWorkerIdsUnknownFieldsAndRepeatsFollowProtobuf) {
  PushRequest p;
  p.set_worker_id(-3);
  p.set_step(5);
  std::string message = p.SerializeAsString();
  // Unknown fields of every wire type, including a group, and field 2 repeated (the last wins).
  message += std::string("\x78\x01", 2);                        // field 15, varint
  message += std::string("\x81\x01", 2) + std::string(8, 'x');  // field 16, fixed64
  message += std::string("\x8d\x01", 2) + std::string(4, 'y');  // field 17, fixed32
  message += std::string("\x93\x01\x08\x01\x94\x01", 6);        // group 18 { field 1 }
  message += std::string("\x10\x09", 2);                        // step = 9
  PushRequest reference;
  ASSERT_TRUE(reference.ParseFromString(message));
  WirePush ours;
  ASSERT_TRUE(ParsePushRequest(ByteChunks(message), 10, &ours).ok());
  EXPECT_EQ(ours.worker_id, reference.worker_id());
  EXPECT_EQ(ours.worker_id, -3);
  EXPECT_EQ(ours.step, reference.step());
  EXPECT_EQ(ours.step, 9);
  // The same encoder as protobuf for a negative id.
  std::string header;
  EncodePushHeader(-3, 5, &header);
  EXPECT_EQ(header, p.SerializeAsString());
}

TEST(TensorWireTest, MalformedMessagesAreRefusedAsProtobufRefusesThem) {
  std::string good;
  EncodePushHeader(1, 2, &good);
  EncodeTensorHeader(3, "w", 0, 8, &good);
  good += std::string(8, '\0');
  const std::vector<std::string> bad = {
      good.substr(0, good.size() - 1),  // truncated data
      good.substr(0, 5),                // truncated inside a header
      std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),  // 11-byte varint
      std::string("\x00", 1),                                               // field 0
      std::string("\x0c", 1),                      // end of a group never started
      std::string("\x0b\x08\x01", 3),              // group never ended
      std::string("\x1a\x05\x0a\x09", 4),          // nested length past its end
      std::string("\x0e", 1),                      // wire type 6
      std::string("\x1a\x03\x0a\x01\xff", 5),      // a name that is not UTF-8
      std::string("\x1a\x04\x0a\x02\xc0\x80", 6),  // overlong UTF-8 (NUL in two bytes)
  };
  for (const std::string& m : bad) {
    PushRequest reference;
    EXPECT_FALSE(reference.ParseFromString(m)) << absl::CEscape(m);
    WirePush ours;
    EXPECT_FALSE(ParsePushRequest(ByteChunks(m), 10, &ours).ok()) << absl::CEscape(m);
  }
  // protobuf reads a tag as five bytes at most and keeps its low 32 bits, and a length as five
  // bytes at most: both parsers agree on those edges.
  const std::vector<std::string> edges = {
      std::string("\xe1\xe1\xe1\xe1\x72", 5) + std::string(8, 'z'),  // tag bits past 32
      std::string("\x88\x80\x80\x80\x80\x00\x01", 7),                // six-byte tag
      std::string("\x1a\x80\x80\x80\x80\x00", 6),                    // six-byte length
  };
  for (const std::string& m : edges) {
    PushRequest reference;
    WirePush ours;
    EXPECT_EQ(ParsePushRequest(ByteChunks(m), 10, &ours).ok(), reference.ParseFromString(m))
        << absl::CEscape(m);
  }
  // More tensors than allowed is refused before they are all parsed.
  std::string many;
  for (int i = 0; i < 5; ++i) EncodeTensorHeader(3, "t", 0, 0, &many);
  WirePush ours;
  EXPECT_TRUE(ParsePushRequest(ByteChunks(many), 5, &ours).ok());
  absl::Status s = ParsePushRequest(ByteChunks(many), 4, &ours);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("more than 4 tensors"), std::string::npos) << s;
}

}  // namespace
}  // namespace rubato
