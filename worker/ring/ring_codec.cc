#include "worker/ring/ring_codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "proto/ring.pb.h"

namespace rubato {
namespace {

// GCC function multiversioning, as in common/optimizer.cc. Not under clang, whose sanitizer builds
// would run the ifunc resolver before the sanitizer's runtime is up (a crash at load time).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RUBATO_RING_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define RUBATO_RING_MULTIVERSION
#endif

// out (+)= the floats at `bytes` (out.size() of them, possibly unaligned), in one pass that also
// flags non-finite values (an all-ones exponent). Returns whether all were finite. Written in
// fixed blocks of 16 so that GCC vectorizes it at -O2 (and with AVX2 where the CPU has it).
RUBATO_RING_MULTIVERSION bool CombineFiniteFloatsImpl(
    const char* __restrict bytes, absl::Span<float> out, RingLink::Combine combine) {
  constexpr uint32_t kExponent = 0x7f800000u;
  constexpr size_t kBlock = 16;
  uint32_t exponents[kBlock] = {};  // Element-wise maxima, reduced once at the end.
  const size_t n = out.size();
  float* __restrict o = out.data();
  const bool add = combine == RingLink::Combine::kAdd;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const char* in = bytes + 4 * i;
    for (size_t j = 0; j < kBlock; ++j) {
      uint32_t u;
      std::memcpy(&u, in + 4 * j, 4);
      exponents[j] = std::max(exponents[j], u & kExponent);
    }
    if (add) {
      for (size_t j = 0; j < kBlock; ++j) {
        float v;
        std::memcpy(&v, in + 4 * j, 4);
        o[i + j] += v;
      }
    } else {
      std::memcpy(o + i, in, 4 * kBlock);
    }
  }
  uint32_t max_exponent = 0;
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, bytes + 4 * i, 4);
    float v;
    std::memcpy(&v, &u, 4);
    max_exponent = std::max(max_exponent, u & kExponent);
    o[i] = add ? o[i] + v : v;
  }
  for (uint32_t e : exponents) max_exponent = std::max(max_exponent, e);
  return max_exponent != kExponent;
}

}  // namespace

bool CombineFiniteFloats(const char* bytes, absl::Span<float> out, RingLink::Combine combine) {
  return CombineFiniteFloatsImpl(bytes, out, combine);
}

grpc::ByteBuffer EncodeBlock(int from_rank, int64_t tag, absl::Span<const float> data) {
  RingBlock header;
  header.set_from_rank(from_rank);
  header.set_tag(tag);
  const uint64_t payload = data.size() * sizeof(float);
  constexpr uint8_t kDataKey = (3 << 3) | 2;  // Field 3, length-delimited.
  uint8_t bytes[32];
  header.ByteSizeLong();  // Caches the sizes (at most 16 bytes: two varints and their keys).
  uint8_t* p = header.SerializeWithCachedSizesToArray(bytes);
  *p++ = kDataKey;
  p = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(payload, p);
  grpc::Slice slices[2] = {grpc::Slice(bytes, p - bytes), grpc::Slice()};
  if (payload == 0) return grpc::ByteBuffer(slices, 1);
  slices[1] = grpc::Slice(data.data(), payload, grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(slices, 2);
}

absl::Status ParseRingBlock(const grpc::ByteBuffer& message, int* from_rank, int64_t* tag,
                            RingPayload* payload) {
  *from_rank = 0;  // proto3 leaves out fields that are zero.
  *tag = 0;
  payload->slices.clear();
  grpc::Status dumped = message.Dump(&payload->slices);
  if (!dumped.ok()) return absl::InvalidArgumentError("ring block: unreadable message");
  const size_t total = message.Length();
  // The fields before data take at most 2 + 10 + 1 + 10 + 1 + 10 bytes; parse a copy of those.
  uint8_t head[40];
  size_t head_bytes = 0;
  for (const grpc::Slice& slice : payload->slices) {
    const size_t k = std::min(slice.size(), sizeof(head) - head_bytes);
    std::memcpy(head + head_bytes, slice.begin(), k);
    head_bytes += k;
    if (head_bytes == sizeof(head)) break;
  }
  google::protobuf::io::CodedInputStream in(head, static_cast<int>(head_bytes));
  payload->offset = total;
  payload->bytes = 0;
  while (static_cast<size_t>(in.CurrentPosition()) < head_bytes) {
    const uint32_t key = in.ReadTag();
    uint64_t value = 0;
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (field == 3 && wire == 2) {
      // 64 bits: ReadVarint32 would truncate a longer varint (2^48 read as 0, an "empty" block
      // that protobuf itself refuses; found by fuzz/ring_mailbox_fuzzer).
      // And at most 5 bytes, as protobuf reads a length (an overlong encoding such as
      // 80 80 80 80 80 80 00 for 0 is refused there; also found by the fuzzer).
      uint64_t length = 0;
      const int length_at = in.CurrentPosition();
      if (!in.ReadVarint64(&length) || in.CurrentPosition() - length_at > 5 || length > total ||
          static_cast<size_t>(in.CurrentPosition()) + length != total) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ring block: data must be the last field and fill the message (", total, " bytes)"));
      }
      payload->offset = in.CurrentPosition();
      payload->bytes = length;
      return absl::OkStatus();
    }
    if ((field != 1 && field != 2) || wire != 0 || !in.ReadVarint64(&value)) {
      return absl::InvalidArgumentError(absl::StrCat("ring block: unexpected or truncated field ",
                                                     field, " (wire type ", wire, ")"));
    }
    if (field == 1) *from_rank = static_cast<int32_t>(value);
    if (field == 2) *tag = static_cast<int64_t>(value);
  }
  if (head_bytes != total) {
    return absl::InvalidArgumentError("ring block: malformed header");
  }
  return absl::OkStatus();  // No data field: an empty block.
}

bool CombinePayload(const RingPayload& payload, absl::Span<float> out, RingLink::Combine combine) {
  bool finite = true;
  size_t skip = payload.offset, left = payload.bytes, next = 0;
  char carry[4];
  size_t carried = 0;
  for (const grpc::Slice& slice : payload.slices) {
    const char* p = reinterpret_cast<const char*>(slice.begin());
    size_t len = slice.size();
    if (skip >= len) {
      skip -= len;
      continue;
    }
    p += skip;
    len = std::min(len - skip, left);
    skip = 0;
    left -= len;
    if (carried > 0) {
      const size_t k = std::min(4 - carried, len);
      std::memcpy(carry + carried, p, k);
      carried += k;
      p += k;
      len -= k;
      if (carried < 4) continue;
      finite &= CombineFiniteFloats(carry, out.subspan(next++, 1), combine);
      carried = 0;
    }
    const size_t whole = len / 4;
    finite &= CombineFiniteFloats(p, out.subspan(next, whole), combine);
    next += whole;
    carried = len - 4 * whole;
    std::memcpy(carry, p + 4 * whole, carried);
    if (left == 0) break;
  }
  return finite;
}

grpc::ByteBuffer EncodeAck(int64_t blocks) {
  RingAck ack;
  ack.set_blocks(blocks);
  grpc::Slice slice(ack.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status ParseRingAck(const grpc::ByteBuffer& message, int64_t* blocks) {
  RingAck ack;
  grpc::Slice slice;
  const bool parsed = message.DumpToSingleSlice(&slice).ok() &&
                      ack.ParseFromArray(slice.begin(), static_cast<int>(slice.size()));
  *blocks = ack.blocks();
  if (!parsed) return absl::InvalidArgumentError("ring acknowledgement: not a RingAck");
  return absl::OkStatus();
}

}  // namespace rubato
