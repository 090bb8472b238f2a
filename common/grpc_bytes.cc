#include "common/grpc_bytes.h"

namespace rubato {

grpc::ByteBuffer SerializedMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

bool ParseSerializedMessage(const grpc::ByteBuffer& bytes,
                            google::protobuf::MessageLite* message) {
  grpc::Slice whole;
  return bytes.DumpToSingleSlice(&whole).ok() &&
         message->ParseFromArray(whole.begin(), static_cast<int>(whole.size()));
}

}  // namespace rubato
