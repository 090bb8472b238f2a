// PsDataChannel against a scripted shard on 127.0.0.1: a pull's answer laid out as the shard
// writes it (common/tensor_wire.h, EncodeTensorHeader: name, version, then the bytes) is read
// straight into the model; any other layout (protobuf's own field order, another name or size,
// fields after the tensors) is handed back whole, byte for byte, for PsClient's parser to judge.
#include "worker/ps/ps_data_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/data_plane_wire.h"
#include "common/socket_io.h"
#include "common/tensor_wire.h"
#include "gtest/gtest.h"
#include "proto/parameter_server.pb.h"

namespace rubato {
namespace {

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// The shard's own layout of a PullResponse.
std::string ShardLayout(const std::vector<std::pair<std::string, std::vector<float>>>& tensors,
                        int64_t version) {
  std::string out;
  for (const auto& [name, values] : tensors) {
    EncodeTensorHeader(1, name, version, values.size() * sizeof(float), &out);
    out += Floats(values);
  }
  return out;
}

// Accepts one connection, sends a challenge, accepts the hello, reads one request and answers it
// with `body`.
class ScriptedShard {
 public:
  explicit ScriptedShard(std::string body) : body_(std::move(body)) {
    absl::StatusOr<Listening> l = ListenTcp("127.0.0.1", 0, 4);
    EXPECT_TRUE(l.ok()) << l.status();
    listen_ = *l;
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptedShard() {
    thread_.join();
    ::close(listen_.fd);
  }
  int port() const { return listen_.port; }

 private:
  void Serve() {
    pollfd p{listen_.fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
    const int fd = ::accept4(listen_.fd, nullptr, nullptr, SOCK_NONBLOCK);
    if (fd < 0) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    std::string why;
    char challenge[sizeof(kDataChallengeMagic) + kDataChallengeBytes] = {};
    std::memcpy(challenge, kDataChallengeMagic, sizeof(kDataChallengeMagic));
    iovec opening{challenge, sizeof(challenge)};
    WriteWithin(fd, &opening, 1, deadline);
    char hello[16];
    char header[kDataRequestHeaderBytes];
    if (ReadWithin(fd, hello, sizeof(hello), deadline, &why) == ReadEnd::kDone) {
      char ok[16] = {};
      iovec a{ok, sizeof(ok)};
      WriteWithin(fd, &a, 1, deadline);
      if (ReadWithin(fd, header, sizeof(header), deadline, &why) == ReadEnd::kDone) {
        std::string request(static_cast<size_t>(WireLoad<int64_t>(header + 16)), '\0');
        ReadWithin(fd, request.data(), request.size(), deadline, &why);
        char response[kDataResponseHeaderBytes] = {};
        WireStore<int64_t>(response + 8, static_cast<int64_t>(body_.size()));
        iovec iov[2] = {{response, sizeof(response)}, {body_.data(), body_.size()}};
        WriteWithin(fd, iov, 2, deadline);
      }
    }
    char c;
    ReadWithin(fd, &c, 1, deadline, &why);  // Until the channel closes.
    ::close(fd);
  }

  std::string body_;
  Listening listen_;
  std::thread thread_;
};

struct Pulled {
  grpc::Status status;
  PsDataChannel::PullSink sink;
  grpc::ByteBuffer response;
  std::vector<float> a = std::vector<float>(3, -1.0f);
  std::vector<float> b = std::vector<float>(2, -1.0f);
};

// A pull of "a" (3 floats) and "b" (2 floats) answered with `body`.
void Pull(const std::string& body, Pulled* out) {
  ScriptedShard shard(body);
  PsDataChannel::Options o;
  o.host = "127.0.0.1";
  o.port = shard.port();
  o.description = "the scripted shard";
  static const std::string kA = "a", kB = "b";
  out->sink.tensors = {{&kA, out->a.data(), 3}, {&kB, out->b.data(), 2}};
  PsDataChannel channel(o);
  PullRequest pull;
  pull.add_names("a");
  pull.add_names("b");
  const std::string bytes = pull.SerializeAsString();
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer req(&slice, 1);
  absl::Notification done;
  channel.Call(
      2, &req, absl::Now() + absl::Seconds(5), &out->response,
      [&](grpc::Status status) {
        out->status = std::move(status);
        done.Notify();
      },
      &out->sink);
  done.WaitForNotification();
}

std::string Dump(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Valid() || !buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

const std::vector<float> kA = {1.5f, -2.0f, 3.25f};
const std::vector<float> kB = {0.5f, 7.0f};

TEST(PsDataChannelPullTest, TheShardsLayoutIsReadStraightIntoTheModel) {
  for (int64_t version : {int64_t{0}, int64_t{1234567}}) {
    Pulled p;
    Pull(ShardLayout({{"a", kA}, {"b", kB}}, version), &p);
    ASSERT_TRUE(p.status.ok()) << p.status.error_message();
    EXPECT_TRUE(p.sink.stored);
    EXPECT_EQ(p.a, kA);
    EXPECT_EQ(p.b, kB);
    EXPECT_EQ(p.sink.tensors[0].version, version);
    EXPECT_EQ(p.sink.tensors[1].version, version);
  }
}

TEST(PsDataChannelPullTest, AnyOtherLayoutIsHandedBackWholeByteForByte) {
  // protobuf's own order (data before version), names swapped, a wrong size, and a field after
  // the tensors.
  PullResponse proto_order;
  for (const auto& [name, values] : {std::pair{"a", kA}, std::pair{"b", kB}}) {
    TensorValue* t = proto_order.add_tensors();
    t->set_name(name);
    t->set_data(Floats(values));
    t->set_version(9);
  }
  std::vector<float> longer = kB;
  longer.push_back(1.0f);
  const std::string trailing = ShardLayout({{"a", kA}, {"b", kB}}, 3) + std::string("\x10\x01", 2);
  for (const std::string& body :
       {proto_order.SerializeAsString(), ShardLayout({{"b", kB}, {"a", kA}}, 3),
        ShardLayout({{"a", kA}, {"b", longer}}, 3), trailing, std::string("\xff\xff\xff", 3),
        std::string()}) {
    Pulled p;
    Pull(body, &p);
    ASSERT_TRUE(p.status.ok()) << p.status.error_message();
    EXPECT_FALSE(p.sink.stored);
    EXPECT_EQ(Dump(p.response), body);
  }
}

}  // namespace
}  // namespace rubato
