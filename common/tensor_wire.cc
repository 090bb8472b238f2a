#include "common/tensor_wire.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"

namespace rubato {

#if !defined(ABSL_IS_LITTLE_ENDIAN)
#error "Rubato's wire format is little-endian float32; add byte swapping for this platform."
#endif

std::string ByteChunks::Flatten() const {
  std::string s;
  s.reserve(size_);
  for (absl::string_view p : pieces_) s.append(p.data(), p.size());
  return s;
}

ByteChunks ByteChunks::Sub(size_t offset, size_t length) const {
  ByteChunks out;
  size_t at = 0;  // where the current piece starts
  for (absl::string_view p : pieces_) {
    if (length == 0) break;
    const size_t end = at + p.size();
    if (end > offset) {
      const size_t from = offset > at ? offset - at : 0;
      const size_t take = std::min(p.size() - from, length);
      out.Append(p.substr(from, take));
      length -= take;
      offset += take;
    }
    at = end;
  }
  return out;
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t more = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      more = 1;
      cp = c & 0x1f;
    } else if ((c >> 4) == 0xe) {
      more = 2;
      cp = c & 0x0f;
    } else if ((c >> 3) == 0x1e) {
      more = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + more >= s.size()) return false;
    for (size_t k = 1; k <= more; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    if ((more == 1 && cp < 0x80) || (more == 2 && cp < 0x800) || (more == 3 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += more + 1;
  }
  return true;
}

namespace {

// Calls run(first, p, count) for runs of whole float32 values: value `first` + k is at p + 4k
// (unaligned). A value cut by a piece boundary is put together in a small buffer and passed alone.
template <typename Run>
void ForEachFloatRun(const ByteChunks& bytes, Run run) {
  char carry[4];
  int carried = 0;
  int64_t index = 0;
  for (absl::string_view piece : bytes.pieces()) {
    const char* p = piece.data();
    size_t left = piece.size();
    if (carried > 0) {
      const size_t take = std::min<size_t>(4 - carried, left);
      std::memcpy(carry + carried, p, take);
      carried += static_cast<int>(take);
      p += take;
      left -= take;
      if (carried < 4) continue;
      run(index++, carry, int64_t{1});
      carried = 0;
    }
    const int64_t whole = static_cast<int64_t>(left / 4);
    if (whole > 0) run(index, p, whole);
    index += whole;
    p += 4 * whole;
    left -= 4 * whole;
    std::memcpy(carry, p, left);
    carried = static_cast<int>(left);
  }
}

inline float LoadFloat(const char* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint32_t LoadBits(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr uint32_t kExponentMask = 0x7f800000u;

// Reads the protobuf wire format from ByteChunks, never past `limit` bytes.
class WireReader {
 public:
  explicit WireReader(const ByteChunks& chunks) : pieces_(chunks.pieces()), left_(chunks.size()) {}

  bool AtEnd() const { return left_ == 0; }
  size_t offset() const { return consumed_; }

  bool ReadByte(uint8_t* b) {
    if (left_ == 0) return false;
    while (pos_ == pieces_[piece_].size()) {
      ++piece_;
      pos_ = 0;
    }
    *b = static_cast<uint8_t>(pieces_[piece_][pos_++]);
    --left_;
    ++consumed_;
    return true;
  }

  // At most `max_bytes` bytes (10 for a value, 5 for a tag or a length, as protobuf reads them): a
  // longer one is malformed. Bits beyond 64 are dropped, as protobuf drops them.
  bool ReadVarint(uint64_t* v, int max_bytes = 10) {
    uint64_t result = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      result |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;
  }

  // The next n bytes as views into the pieces (appended to *out if given).
  bool ReadBytes(uint64_t n, ByteChunks* out) {
    if (n > left_) return false;
    left_ -= n;
    consumed_ += n;
    while (n > 0) {
      while (pos_ == pieces_[piece_].size()) {
        ++piece_;
        pos_ = 0;
      }
      const size_t take = std::min<uint64_t>(n, pieces_[piece_].size() - pos_);
      if (out != nullptr) out->Append(pieces_[piece_].substr(pos_, take));
      pos_ += take;
      n -= take;
    }
    return true;
  }

 private:
  const std::vector<absl::string_view>& pieces_;
  size_t piece_ = 0;
  size_t pos_ = 0;
  uint64_t left_;
  uint64_t consumed_ = 0;
};

enum WireType {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5
};
// protobuf's default recursion limit, which also bounds nested unknown groups.
constexpr int kMaxGroupDepth = 100;

// One field's tag: number and wire type. Fails on a truncated or invalid tag (field 0, wire type 6
// or 7). Groups occur only as unknown fields, which are skipped.
struct Tag {
  uint32_t field = 0;
  int type = 0;
};

absl::Status Malformed(absl::string_view what, const WireReader& r, absl::string_view detail) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed ", what, " at byte ", r.offset(), ": ", detail));
}

absl::Status ReadTag(WireReader* r, absl::string_view what, Tag* tag) {
  uint64_t v = 0;
  // protobuf reads a tag as at most five bytes and keeps the low 32 bits.
  if (!r->ReadVarint(&v, 5)) return Malformed(what, *r, "truncated or overlong tag");
  const uint32_t t = static_cast<uint32_t>(v);
  tag->field = t >> 3;
  tag->type = static_cast<int>(t & 7);
  if (tag->field == 0) return Malformed(what, *r, "field number 0");
  if (tag->type > kFixed32) {
    return Malformed(what, *r, absl::StrCat("wire type ", tag->type, " of field ", tag->field));
  }
  return absl::OkStatus();
}

absl::Status ReadLength(WireReader* r, absl::string_view what, ByteChunks* out) {
  uint64_t n = 0;
  // protobuf reads a length as at most five bytes and refuses one that does not fit in int32.
  if (!r->ReadVarint(&n, 5)) return Malformed(what, *r, "truncated or overlong length");
  if (n > 0x7fffffffu || !r->ReadBytes(n, out)) {
    return Malformed(what, *r, "length past the end");
  }
  return absl::OkStatus();
}

// Skips the value of an unknown field whose tag has been read. An end-group tag here is one
// without its start, which protobuf refuses too.
absl::Status SkipValue(WireReader* r, absl::string_view what, const Tag& tag, int depth = 0) {
  uint64_t v = 0;
  switch (tag.type) {
    case kStartGroup:
      if (depth >= kMaxGroupDepth) return Malformed(what, *r, "groups nested too deeply");
      while (true) {
        Tag inner;
        absl::Status s = ReadTag(r, what, &inner);
        if (!s.ok()) return s;
        if (inner.type == kEndGroup) {
          if (inner.field != tag.field) return Malformed(what, *r, "mismatched end of group");
          return absl::OkStatus();
        }
        if (s = SkipValue(r, what, inner, depth + 1); !s.ok()) return s;
      }
    case kEndGroup:
      return Malformed(what, *r, "end of a group that was not started");
    case kVarint:
      if (!r->ReadVarint(&v)) return Malformed(what, *r, "truncated or overlong varint");
      return absl::OkStatus();
    case kFixed64:
      if (!r->ReadBytes(8, nullptr)) return Malformed(what, *r, "truncated fixed64");
      return absl::OkStatus();
    case kFixed32:
      if (!r->ReadBytes(4, nullptr)) return Malformed(what, *r, "truncated fixed32");
      return absl::OkStatus();
    default:
      return ReadLength(r, what, nullptr);
  }
}

absl::Status ParseTensorValue(const ByteChunks& bytes, WireTensor* out) {
  WireReader r(bytes);
  constexpr absl::string_view kWhat = "TensorValue";
  while (!r.AtEnd()) {
    Tag tag;
    absl::Status s = ReadTag(&r, kWhat, &tag);
    if (!s.ok()) return s;
    if (tag.field == 1 && tag.type == kLengthDelimited) {
      ByteChunks name;
      if (s = ReadLength(&r, kWhat, &name); !s.ok()) return s;
      out->name = name.Flatten();
      // proto3 strings must be UTF-8; protobuf checks every occurrence, so this does too.
      if (!IsValidUtf8(out->name)) return Malformed(kWhat, r, "a name that is not UTF-8");
    } else if (tag.field == 2 && tag.type == kLengthDelimited) {
      out->data = ByteChunks();
      if (s = ReadLength(&r, kWhat, &out->data); !s.ok()) return s;
    } else if (tag.field == 3 && tag.type == kVarint) {
      uint64_t v = 0;
      if (!r.ReadVarint(&v)) return Malformed(kWhat, r, "truncated or overlong varint");
      out->version = static_cast<int64_t>(v);
    } else if (tag.field == 4 && tag.type == kVarint) {
      uint64_t v = 0;
      if (!r.ReadVarint(&v)) return Malformed(kWhat, r, "truncated or overlong varint");
      out->offset = static_cast<int64_t>(v);
    } else if (s = SkipValue(&r, kWhat, tag); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// The repeated TensorValue field `field` of a message whose other known scalar fields are
// handled by `scalar(tag, reader)` (returns false to skip the field as unknown).
template <typename Scalar>
absl::Status ParseTensorList(const ByteChunks& message, absl::string_view what, uint32_t field,
                             int max_tensors, std::vector<WireTensor>* out, Scalar scalar) {
  WireReader r(message);
  while (!r.AtEnd()) {
    Tag tag;
    absl::Status s = ReadTag(&r, what, &tag);
    if (!s.ok()) return s;
    if (tag.field == field && tag.type == kLengthDelimited) {
      if (static_cast<int>(out->size()) >= max_tensors) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " carries more than ", max_tensors, " tensors"));
      }
      ByteChunks value;
      if (s = ReadLength(&r, what, &value); !s.ok()) return s;
      out->emplace_back();
      if (s = ParseTensorValue(value, &out->back()); !s.ok()) return s;
      continue;
    }
    bool handled = false;
    if (s = scalar(tag, &r, &handled); !s.ok()) return s;
    if (!handled && (s = SkipValue(&r, what, tag), !s.ok())) return s;
  }
  return absl::OkStatus();
}

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// SSE2 has no unsigned 32-bit max (the loop below runs at half speed without one); AVX2 does.
#define RUBATO_SCAN_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define RUBATO_SCAN_MULTIVERSION
#endif

// One run of floats: the index of its first NaN or Inf (-1 if none), and *top raised to the
// largest magnitude's bits (sign cleared: larger bits, larger magnitude).
RUBATO_SCAN_MULTIVERSION int64_t ScanRun(const char* p, int64_t count, uint32_t* top) {
  // A branch-free pass over blocks; the exact index only when a block has a non-finite value.
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t end = std::min(count, b + kBlock);
    uint32_t block_top = 0;
    for (int64_t i = b; i < end; ++i) {
      block_top = std::max(block_top, LoadBits(p + 4 * i) & 0x7fffffffu);
    }
    *top = std::max(*top, block_top);
    if (block_top < kExponentMask) continue;  // every magnitude finite
    for (int64_t i = b; i < end; ++i) {
      if ((LoadBits(p + 4 * i) & kExponentMask) == kExponentMask) return i;
    }
  }
  return -1;
}

}  // namespace

FloatScan ScanFloats(const ByteChunks& bytes) {
  FloatScan scan;
  uint32_t top = 0;
  ForEachFloatRun(bytes, [&scan, &top](int64_t first, const char* p, int64_t count) {
    if (scan.first_non_finite >= 0) return;
    const int64_t bad = ScanRun(p, count, &top);
    if (bad >= 0) scan.first_non_finite = first + bad;
  });
  if (scan.first_non_finite < 0) {
    float largest;
    std::memcpy(&largest, &top, sizeof(largest));
    scan.max_abs_bound = largest;
  }
  return scan;
}

int64_t FirstNonFinite(const ByteChunks& bytes) { return ScanFloats(bytes).first_non_finite; }

absl::Status CheckFloatChunks(absl::string_view what, const ByteChunks& bytes, int64_t elements,
                              double* max_abs_bound) {
  // Compare in elements, not bytes: elements * 4 can overflow for a hostile count, size() / 4
  // cannot.
  if (elements < 0 || bytes.size() % 4 != 0 ||
      static_cast<uint64_t>(bytes.size() / 4) != static_cast<uint64_t>(elements)) {
    const std::string expected =
        elements >= 0 && elements <= std::numeric_limits<int64_t>::max() / 4
            ? absl::StrCat(elements * 4, " (", elements, " float32 values)")
            : absl::StrCat(elements, " float32 values");
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", bytes.size(), " bytes, expected ", expected));
  }
  const FloatScan scan = ScanFloats(bytes);
  const int64_t bad = scan.first_non_finite;
  if (bad < 0) {
    if (max_abs_bound != nullptr) *max_abs_bound = scan.max_abs_bound;
    return absl::OkStatus();
  }
  float value = 0;
  ForEachFloatRun(bytes, [bad, &value](int64_t first, const char* p, int64_t count) {
    if (bad >= first && bad < first + count) value = LoadFloat(p + 4 * (bad - first));
  });
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has a non-finite value (", value, ") at element ", bad));
}

void CopyFloats(const ByteChunks& bytes, float* out) {
  ForEachFloatRun(bytes, [out](int64_t first, const char* p, int64_t count) {
    std::memcpy(out + first, p, 4 * count);
  });
}

void AddFloats(const ByteChunks& bytes, float* acc) {
  ForEachFloatRun(bytes, [acc](int64_t first, const char* p, int64_t count) {
    float* a = acc + first;
    for (int64_t i = 0; i < count; ++i) a[i] += LoadFloat(p + 4 * i);
  });
}

namespace {

// out[i] = value i (or += with kAdd), and the values' squares summed into *squares. Eight float
// lanes per block, so that the loop vectorises; each block's total is added in double.
template <bool kAdd>
void MoveFloatsWithSquares(const ByteChunks& bytes, float* out, double* squares) {
  double total = 0;
  ForEachFloatRun(bytes, [out, &total](int64_t first, const char* p, int64_t count) {
    float* d = out + first;
    for (int64_t b = 0; b < count; b += kSquaresBlock) {
      const int64_t end = std::min(count, b + kSquaresBlock);
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = b;
      for (; i + 8 <= end; i += 8) {
        for (int k = 0; k < 8; ++k) {
          const float x = LoadFloat(p + 4 * (i + k));
          if constexpr (kAdd) {
            d[i + k] += x;
          } else {
            d[i + k] = x;
          }
          lanes[k] += x * x;
        }
      }
      double block = 0;
      for (; i < end; ++i) {
        const float x = LoadFloat(p + 4 * i);
        if constexpr (kAdd) {
          d[i] += x;
        } else {
          d[i] = x;
        }
        block += static_cast<double>(x) * x;
      }
      for (float l : lanes) block += l;
      total += block;
    }
  });
  *squares += total;
}

}  // namespace

void CopyFloats(const ByteChunks& bytes, float* out, double* squares) {
  MoveFloatsWithSquares<false>(bytes, out, squares);
}

void AddFloats(const ByteChunks& bytes, float* acc, double* squares) {
  MoveFloatsWithSquares<true>(bytes, acc, squares);
}

absl::Status ParsePushRequest(const ByteChunks& message, int max_tensors, WirePush* out) {
  *out = WirePush();
  return ParseTensorList(
      message, "PushRequest", 3, max_tensors, &out->gradients,
      [out](const Tag& tag, WireReader* r, bool* handled) -> absl::Status {
        if ((tag.field == 5 || tag.field == 6) && tag.type == kLengthDelimited) {
          // noise_relay, consistency_relay: parsed by protobuf itself, merged as protobuf merges
          // a message field that occurs more than once. The message limit bounds their size.
          ByteChunks bytes;
          if (absl::Status s = ReadLength(r, "PushRequest", &bytes); !s.ok()) return s;
          bool parsed = false;
          if (tag.field == 5) {
            if (!out->noise_relay.has_value()) out->noise_relay.emplace();
            parsed = out->noise_relay->MergeFromString(bytes.Flatten());
          } else {
            if (!out->consistency_relay.has_value()) out->consistency_relay.emplace();
            parsed = out->consistency_relay->MergeFromString(bytes.Flatten());
          }
          if (!parsed) {
            return Malformed(
                "PushRequest", *r,
                tag.field == 5 ? "noise_relay does not parse" : "consistency_relay does not parse");
          }
          *handled = true;
          return absl::OkStatus();
        }
        if ((tag.field != 1 && tag.field != 2 && tag.field != 4) || tag.type != kVarint) {
          return absl::OkStatus();
        }
        uint64_t v = 0;
        if (!r->ReadVarint(&v)) {
          return Malformed("PushRequest", *r, "truncated or overlong varint");
        }
        // int32 keeps the low 32 bits, as protobuf does.
        if (tag.field == 1) {
          out->worker_id = static_cast<int32_t>(static_cast<uint32_t>(v));
        } else if (tag.field == 4) {
          out->batch_size = static_cast<int32_t>(static_cast<uint32_t>(v));
        } else {
          out->step = static_cast<int64_t>(v);
        }
        *handled = true;
        return absl::OkStatus();
      });
}

absl::Status ParsePullResponse(const ByteChunks& message, int max_tensors,
                               std::vector<WireTensor>* out) {
  out->clear();
  return ParseTensorList(message, "PullResponse", 1, max_tensors, out,
                         [](const Tag&, WireReader*, bool*) { return absl::OkStatus(); });
}

void EncodePushHeader(int32_t worker_id, int64_t step, std::string* out) {
  // proto3 omits zeros; a negative int32 is sign-extended to ten bytes.
  if (worker_id != 0) {
    out->push_back(0x08);
    AppendVarint(static_cast<uint64_t>(static_cast<int64_t>(worker_id)), out);
  }
  if (step != 0) {
    out->push_back(0x10);
    AppendVarint(static_cast<uint64_t>(step), out);
  }
}

void EncodePushExtras(int32_t batch_size, const NoiseScaleRelay* relay, std::string* out,
                      const ConsistencyRelay* consistency) {
  if (batch_size != 0) {
    out->push_back(0x20);  // batch_size = 4
    AppendVarint(static_cast<uint64_t>(static_cast<int64_t>(batch_size)), out);
  }
  if (relay != nullptr) {
    const std::string bytes = relay->SerializeAsString();
    out->push_back(0x2a);  // noise_relay = 5
    AppendVarint(bytes.size(), out);
    out->append(bytes);
  }
  if (consistency != nullptr) {
    const std::string bytes = consistency->SerializeAsString();
    out->push_back(0x32);  // consistency_relay = 6
    AppendVarint(bytes.size(), out);
    out->append(bytes);
  }
}

void EncodeTensorHeader(int field, absl::string_view name, int64_t version, size_t data_bytes,
                        std::string* out, int64_t offset) {
  size_t inner =
      1 + VarintSize(name.size()) + name.size() + 1 + VarintSize(data_bytes) + data_bytes;
  if (version != 0) inner += 1 + VarintSize(static_cast<uint64_t>(version));
  if (offset != 0) inner += 1 + VarintSize(static_cast<uint64_t>(offset));
  AppendVarint((static_cast<uint64_t>(field) << 3) | kLengthDelimited, out);
  AppendVarint(inner, out);
  out->push_back(0x0a);  // name = 1
  AppendVarint(name.size(), out);
  out->append(name.data(), name.size());
  if (version != 0) {
    out->push_back(0x18);  // version = 3
    AppendVarint(static_cast<uint64_t>(version), out);
  }
  if (offset != 0) {
    out->push_back(0x20);  // offset = 4
    AppendVarint(static_cast<uint64_t>(offset), out);
  }
  out->push_back(0x12);  // data = 2, last: the data bytes follow this header
  AppendVarint(data_bytes, out);
}

WirePush WirePushOf(const PushRequest& request) {
  WirePush wire;
  wire.worker_id = request.worker_id();
  wire.step = request.step();
  wire.batch_size = request.batch_size();
  if (request.has_noise_relay()) wire.noise_relay = request.noise_relay();
  if (request.has_consistency_relay()) wire.consistency_relay = request.consistency_relay();
  for (const TensorValue& g : request.gradients()) {
    WireTensor t;
    t.name = g.name();
    t.data = ByteChunks(g.data());
    t.offset = g.offset();
    wire.gradients.push_back(std::move(t));
  }
  return wire;
}

}  // namespace rubato
