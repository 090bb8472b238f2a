// The wire format of the ring all-reduce's stream (proto/ring.proto), written and read without
// copying the floats.
//
// A stream from one rank to the next carries RingBlock messages one way and RingAck messages the
// other. The sender (worker/ring/ring_link.h) encodes each block as a small header plus the caller's
// floats, which gRPC sends from where they are; the receiver (worker/ring/ring_service.h) parses a block
// in place, as the list of slices the transport filled, and worker/ring/ring_mailbox.h later adds those
// slices into the destination with CombinePayload. Nothing here does I/O or holds state, so all of
// it can be tested on byte strings alone.
#ifndef RUBATO_WORKER_RING_RING_CODEC_H_
#define RUBATO_WORKER_RING_RING_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/ring_allreduce.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace rubato {

// Empty blocks with special tags. Both ask the receiver to acknowledge everything read so far;
// other blocks are not acknowledged one by one.
constexpr int64_t kRingClosingTag = -1;  // The last block of a stream closed on purpose.
constexpr int64_t kRingSyncTag = -2;     // Sent by GrpcRingLink::Flush.

// A block's floats as they came off the wire: the message's slices, not copied, holding `bytes`
// bytes from byte `offset` on. Floats may straddle slices.
struct RingPayload {
  std::vector<grpc::Slice> slices;
  size_t offset = 0;
  size_t bytes = 0;
};

// Serializes RingBlock{from_rank, tag, data} as two slices: a copied header (the small fields
// through protobuf, then field 3's key and length by hand) and `data` itself, not copied. gRPC
// sees a static slice, so it never frees it; the caller keeps the memory unchanged until the
// receiver acknowledges the block (by then every byte has left this process), or until the call
// that sends it has ended.
grpc::ByteBuffer EncodeBlock(int from_rank, int64_t tag, absl::Span<const float> data);

// Parses a serialized RingBlock without copying its data: INVALID_ARGUMENT naming the problem if
// it is not one (data must be the last field, as protobuf writes it). Accepts exactly what
// protobuf itself parses as a RingBlock with data last (fuzz/ring_mailbox_fuzzer checks this).
absl::Status ParseRingBlock(const grpc::ByteBuffer& message, int* from_rank, int64_t* tag,
                            RingPayload* payload);

// Combines a payload that may be split across slices at any byte into `out` (out.size() floats,
// which must be payload.bytes / 4): adds it (kAdd) or copies it (kCopy), in the same pass checking
// that every value is finite. Returns whether all were; `out` is written either way.
bool CombinePayload(const RingPayload& payload, absl::Span<float> out, RingLink::Combine combine);

// The same for contiguous bytes (out.size() floats at `bytes`, any alignment).
bool CombineFiniteFloats(const char* bytes, absl::Span<float> out, RingLink::Combine combine);

// RingAck{blocks}: the receiver has read this many blocks of the stream.
grpc::ByteBuffer EncodeAck(int64_t blocks);
// INVALID_ARGUMENT if `message` is not a serialized RingAck.
absl::Status ParseRingAck(const grpc::ByteBuffer& message, int64_t* blocks);

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_RING_CODEC_H_
