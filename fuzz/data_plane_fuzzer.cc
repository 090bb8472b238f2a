// data_plane_fuzzer: a libFuzzer harness over the parameter servers' plain-TCP data plane
// (server/data_plane.h) as a hostile client on the network sees it.
//
// Each input is the whole byte stream a client sends on one connection after the server's
// challenge: a hello (or anything else), then request headers and bodies (or anything else). The harness sends it to a live
// DataPlaneServer on 127.0.0.1, in front of a real async shard of two registered workers, closes
// its side, and reads what comes back until the server closes. It checks what the wire format
// promises (server/data_plane.h) and that no client can hold the server:
//   - the server opens with its challenge; the hello's answer is a status code 0..16 with at most 1024 bytes of text, and after a
//     refusal the server closes;
//   - every response is a status code 0..16 with its reserved field 0, a body within the job's
//     message limit, and an error's text within 1024 bytes;
//   - the server answers or closes within 10 s of the client's end of input (it reads up to that
//     end, then sees it: no request may wait longer, since an async shard answers at once);
//   - once the client has gone, the server's connection ends within 10 s: no thread is left
//     behind for a connection that is gone.
// The shard's own state machine is fuzzed by shard_fuzzer, and the request bodies' parser by
// wire_fuzzer; this harness is about the framing, the hello, the limits and the hand-off.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/data_plane_wire.h"
#include "common/security.h"
#include "common/socket_io.h"
#include "fuzz/fuzz_check.h"
#include "proto/parameter_server.pb.h"
#include "server/data_plane.h"
#include "server/parameter_shard.h"

namespace rubato {
namespace fuzz {
namespace {

constexpr int64_t kMessageLimit = 1 << 20;
constexpr absl::Duration kAnswerWithin = absl::Seconds(10);
constexpr int32_t kMaxStatusCode = 16;

struct Fixture {
  std::unique_ptr<ParameterShard> shard;
  std::unique_ptr<DataPlaneServer> server;
};

// One shard and its data plane for the whole run (never destroyed: libFuzzer exits without
// returning). Workers 0 and 1 are registered with a 2x2 weight and a bias of 2.
Fixture& Get() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    ShardOptions options;
    options.cluster.set_num_workers(2);
    options.cluster.mutable_consistency()->set_mode(ASYNC);
    options.cluster.mutable_optimizer()->set_type("sgd");
    options.cluster.mutable_optimizer()->set_learning_rate(0.1);
    options.cluster.set_lease_ms(3600 * 1000);
    options.cluster.set_wait_timeout_ms(1);  // A pull that would wait answers at once.
    absl::StatusOr<std::unique_ptr<ParameterShard>> shard = ParameterShard::Create(options);
    FUZZ_CHECK(shard.ok(), absl::StrCat("cannot create the shard: ", shard.status().ToString()));
    f->shard = std::move(*shard);
    for (int worker = 0; worker < 2; ++worker) {
      RegisterRequest r;
      r.set_worker_id(worker);
      r.set_num_workers(2);
      *r.mutable_consistency() = options.cluster.consistency();
      r.set_batch_size(8);
      r.set_steps_per_epoch(10);
      r.set_total_steps(1000000);
      for (const auto& [name, elements] : {std::pair<const char*, int>{"w", 4}, {"b", 2}}) {
        TensorSpec* t = r.add_model();
        t->set_name(name);
        t->add_shape(elements);
        TensorValue* v = r.add_initial_values();
        v->set_name(name);
        v->mutable_data()->assign(4 * elements, '\0');
      }
      const absl::StatusOr<RegisterResponse> registered = f->shard->Register(r);
      FUZZ_CHECK(registered.ok(), absl::StrCat("cannot register worker ", worker, ": ",
                                               registered.status().ToString()));
    }
    absl::StatusOr<ServerSecurity> security = ServerSecurity::Create(SecurityConfig());
    FUZZ_CHECK(security.ok(), absl::StrCat("no security: ", security.status().ToString()));
    DataPlaneOptions d;
    d.host = "127.0.0.1";
    d.max_message_bytes = kMessageLimit;
    d.memory_budget_bytes = int64_t{8} << 20;
    d.num_workers = 2;
    absl::StatusOr<std::unique_ptr<DataPlaneServer>> server =
        DataPlaneServer::Start(d, f->shard.get(), *security);
    FUZZ_CHECK(server.ok(),
               absl::StrCat("cannot start the data plane: ", server.status().ToString()));
    f->server = std::move(*server);
    return f;
  }();
  return *fixture;
}

// Reads exactly `n` bytes, or returns false at the server's close (or an error).
bool Read(int fd, char* data, size_t n, absl::Time deadline) {
  std::string why;
  const ReadEnd end = ReadWithin(fd, data, n, deadline, &why);
  FUZZ_CHECK(end != ReadEnd::kTimedOut,
             absl::StrCat("the data plane neither answered nor closed within ",
                          absl::FormatDuration(kAnswerWithin), " of the client's end of input"));
  return end == ReadEnd::kDone;
}

// Reads the server's side of the connection until it closes, checking each header.
void ReadAnswers(int fd) {
  const absl::Time deadline = absl::Now() + kAnswerWithin;
  // The server speaks first: its challenge.
  char challenge[sizeof(kDataChallengeMagic) + kDataChallengeBytes];
  if (!Read(fd, challenge, sizeof(challenge), deadline)) return;
  FUZZ_CHECK(std::memcmp(challenge, kDataChallengeMagic, sizeof(kDataChallengeMagic)) == 0,
             "a connection that does not open with the challenge");
  char hello[16];
  if (!Read(fd, hello, sizeof(hello), deadline)) return;
  const int32_t code = WireLoad<int32_t>(hello);
  const int32_t text = WireLoad<int32_t>(hello + 4);
  FUZZ_CHECK(code >= 0 && code <= kMaxStatusCode,
             absl::StrCat("a hello answer with status ", code));
  FUZZ_CHECK(text >= 0 && text <= kDataMaxTextBytes,
             absl::StrCat("a hello answer with ", text, " bytes of text"));
  FUZZ_CHECK(code != 0 || text == 0, absl::StrCat("an accepted hello with text"));
  std::string body(static_cast<size_t>(text), '\0');
  if (!Read(fd, body.data(), body.size(), deadline)) return;
  if (code != 0) {
    char more;
    FUZZ_CHECK(!Read(fd, &more, 1, deadline),
               absl::StrCat("the server went on after refusing the hello"));
    return;
  }
  for (;;) {
    char header[kDataResponseHeaderBytes];
    if (!Read(fd, header, sizeof(header), deadline)) return;
    const int32_t status = WireLoad<int32_t>(header);
    const int32_t reserved = WireLoad<int32_t>(header + 4);
    const int64_t bytes = WireLoad<int64_t>(header + 8);
    FUZZ_CHECK(status >= 0 && status <= kMaxStatusCode,
               absl::StrCat("a response with status ", status));
    FUZZ_CHECK(reserved == 0, absl::StrCat("a response with ", reserved, " in its reserved field"));
    FUZZ_CHECK(bytes >= 0 && bytes <= kMessageLimit,
               absl::StrCat("a response of ", bytes, " bytes"));
    FUZZ_CHECK(status == 0 || bytes <= kDataMaxTextBytes,
               absl::StrCat("an error with ", bytes, " bytes of text"));
    body.resize(static_cast<size_t>(bytes));
    if (!Read(fd, body.data(), body.size(), deadline)) return;
    if (status == static_cast<int32_t>(absl::StatusCode::kOk)) {
      // An answer is a PushResponse or a PullResponse; either parses.
      PullResponse pull;
      PushResponse push;
      FUZZ_CHECK(pull.ParseFromString(body) || push.ParseFromString(body),
                 absl::StrCat("an OK answer that is neither a PushResponse nor a PullResponse"));
    }
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace rubato

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rubato::fuzz::Fixture& f = rubato::fuzz::Get();
  absl::StatusOr<int> fd = rubato::ConnectTcp("127.0.0.1", f.server->port(), absl::Seconds(5));
  FUZZ_CHECK(fd.ok(), absl::StrCat("cannot connect: ", fd.status().ToString()));
  // The server may refuse and close before it has read everything: a failed write ends the
  // sending (what it did answer is still read).
  iovec iov{const_cast<uint8_t*>(data), size};
  rubato::WriteWithin(*fd, &iov, 1, absl::Now() + rubato::fuzz::kAnswerWithin);
  ::shutdown(*fd, SHUT_WR);
  rubato::fuzz::ReadAnswers(*fd);
  ::close(*fd);
  const absl::Time until = absl::Now() + rubato::fuzz::kAnswerWithin;
  while (f.server->connections() > 0) {
    FUZZ_CHECK(absl::Now() < until,
               absl::StrCat("a connection's thread outlived its client by ",
                            absl::FormatDuration(rubato::fuzz::kAnswerWithin)));
    absl::SleepFor(absl::Microseconds(50));
  }
  return 0;
}
