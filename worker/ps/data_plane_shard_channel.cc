#include "worker/ps/data_plane_shard_channel.h"

#include <utility>

#include "common/grpc_status.h"
#include "common/log.h"
#include "common/net_diagnose.h"

namespace rubato {

void DataPlaneShardChannel::Push(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                 const CallOptions& options, Done done) {
  Call(DataMethod::kPush, request, response, nullptr, options, std::move(done));
}

void DataPlaneShardChannel::Pull(const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                 PullSink* sink, const CallOptions& options, Done done) {
  Call(DataMethod::kPull, request, response, sink, options, std::move(done));
}

void DataPlaneShardChannel::Call(DataMethod method, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response, PullSink* sink,
                                 const CallOptions& options, Done done) {
  std::shared_ptr<PsDataChannel> data;
  {
    absl::MutexLock lock(&mu_);
    data = data_;
  }
  if (data == nullptr || data->broken()) {
    if (method == DataMethod::kPush) {
      control_->Push(request, response, options, std::move(done));
    } else {
      control_->Pull(request, response, sink, options, std::move(done));
    }
    return;
  }
  data->Call(
      static_cast<int>(method), request, options.deadline, response,
      [this, d = data.get(), done = std::move(done)](grpc::Status status) {
        absl::Status s = FromGrpcStatus(status);
        if (d->broken()) Drop(d, s);
        done(std::move(s));
      },
      sink);
}

void DataPlaneShardChannel::Registered(const RegisterResponse& response) {
  const int port = response.data_port();
  absl::MutexLock lock(&mu_);
  if (port <= 0 || port > 65535) {
    Retire();
    return;
  }
  if (data_ != nullptr && data_->port() == port && !data_->broken()) return;
  std::string host, ignored;
  if (!SplitHostPort(address(), &host, &ignored)) {
    Retire();
    return;
  }
  PsDataChannel::Options o;
  o.host = host;
  o.port = port;
  o.worker_id = options_.worker_id;
  o.answer_challenge = options_.answer_challenge;
  o.description = options_.description;
  o.max_message_bytes = options_.max_message_bytes;
  o.tls = options_.tls;
  Retire();
  data_ = std::make_shared<PsDataChannel>(std::move(o));
}

bool DataPlaneShardChannel::uses_data_plane() const {
  absl::MutexLock lock(&mu_);
  return data_ != nullptr && !data_->broken();
}

void DataPlaneShardChannel::Retire() {
  if (data_ == nullptr) return;
  data_->Drain();
  retired_.push_back(std::move(data_));
  data_ = nullptr;
}

void DataPlaneShardChannel::Drop(const PsDataChannel* data, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (data_.get() != data) return;
  RUBATO_LOG(WARNING) << why.message() << "; Push and Pull to " << options_.description
                      << " go over gRPC until this worker registers with it again";
  Retire();
}

}  // namespace rubato
