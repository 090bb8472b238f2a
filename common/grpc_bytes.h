// Small protobuf messages as gRPC byte buffers, for the raw (ByteBuffer) calls both sides make:
// the server's Push and Pull answers and requests, and the worker's channels.
#ifndef RUBATO_COMMON_GRPC_BYTES_H_
#define RUBATO_COMMON_GRPC_BYTES_H_

#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"

namespace rubato {

// A small message as one slice.
grpc::ByteBuffer SerializedMessage(const google::protobuf::MessageLite& message);

// Parses `bytes` into *message; false if they cannot be read or are not one.
bool ParseSerializedMessage(const grpc::ByteBuffer& bytes, google::protobuf::MessageLite* message);

}  // namespace rubato

#endif  // RUBATO_COMMON_GRPC_BYTES_H_
