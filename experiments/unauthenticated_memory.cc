// Server memory under unauthenticated large messages (issue 31, item 3): the resident size of a
// real rubato_server that authenticates calls (--auth_secret_file) while clients without a token
// send it large Push and Pull bodies. Before, during (peak, sampled every 5 ms) and after each
// burst, with the answers' status codes and how long they took.
//
//   bazel run //experiments:unauthenticated_memory
//
// Bursts: one Push of 1 GiB (16 x the default 64 MiB message limit); 32 concurrent Pulls of
// 63 MiB each (under the limit: gRPC takes them); 32 concurrent Pushes of 63 MiB. The server's
// --memory_budget_mb is its default, 512. It prints figures and asserts nothing.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/grpc_options.h"
#include "experiments/server_process.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"

ABSL_FLAG(std::string, server, "server/rubato_server", "The server binary (runfiles path).");

namespace {

struct Burst {
  std::string name;
  std::string method;
  int calls;
  int64_t bytes;
  bool token = false;  // worker 0's valid token
};

// Sends `burst` without a token and returns the answers' codes, counted.
std::map<int, int> Send(const std::shared_ptr<grpc::Channel>& channel, const Burst& burst,
                        const std::string& body, const std::string& token) {
  grpc::GenericStub stub(channel);
  std::vector<grpc::ClientContext> contexts(burst.calls);
  std::vector<grpc::ByteBuffer> requests(burst.calls), responses(burst.calls);
  std::vector<grpc::Status> statuses(burst.calls);
  std::atomic<int> left{burst.calls};
  absl::Notification done;
  for (int i = 0; i < burst.calls; ++i) {
    contexts[i].set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (burst.token) contexts[i].AddMetadata(rubato::kAuthMetadataKey, token);
    grpc::Slice slice(body.data(), static_cast<size_t>(burst.bytes), grpc::Slice::STATIC_SLICE);
    requests[i] = grpc::ByteBuffer(&slice, 1);
    stub.UnaryCall(&contexts[i], burst.method, grpc::StubOptions(), &requests[i], &responses[i],
                   [&, i](grpc::Status s) {
                     statuses[i] = std::move(s);
                     if (--left == 0) done.Notify();
                   });
  }
  done.WaitForNotification();
  std::map<int, int> codes;
  for (const grpc::Status& s : statuses) ++codes[s.error_code()];
  return codes;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::StrCat("/tmp/rubato_unauth_", getpid());
  ::mkdir(dir.c_str(), 0700);
  const std::string secret = dir + "/secret";
  std::ofstream(secret) << "a job secret of forty bytes or so, for this experiment";
  ::chmod(secret.c_str(), 0600);
  absl::StatusOr<rubato::ServerProcess> server = rubato::StartServerProcess(
      absl::GetFlag(FLAGS_server),
      {"--num_workers=2", "--auth_secret_file=" + secret, "--job_id=unauth-experiment"});
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  grpc::ChannelArguments args = rubato::RubatoChannelArguments();
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(server->address, grpc::InsecureChannelCredentials(), args);
  const std::vector<Burst> bursts = {
      {"1 Push of 1 GiB", "/rubato.ParameterServer/Push", 1, int64_t{1} << 30},
      {"32 Pulls of 63 MiB", "/rubato.ParameterServer/Pull", 32, int64_t{63} << 20},
      {"32 Pushes of 63 MiB", "/rubato.ParameterServer/Push", 32, int64_t{63} << 20},
      // The same with a valid token: read, then refused as malformed. What gRPC buffers for a
      // token holder is bounded only by the soft ResourceQuota (--memory_budget_mb).
      {"32 Pulls, token", "/rubato.ParameterServer/Pull", 32, int64_t{63} << 20, true},
      {"32 Pushes, token", "/rubato.ParameterServer/Push", 32, int64_t{63} << 20, true},
  };
  const std::string token = rubato::JobAuth::FromFile(secret, "unauth-experiment")->WorkerToken(0);
  const std::string body(size_t{1} << 30, '\x7f');
  std::printf("%-22s %10s %10s %10s %9s  answers\n", "burst", "idle MiB", "peak MiB",
              "after MiB", "time s");
  for (const Burst& burst : bursts) {
    absl::SleepFor(absl::Seconds(1));
    const int64_t idle = rubato::ResidentBytes(server->pid);
    std::atomic<int64_t> peak{idle};
    std::atomic<bool> sampling{true};
    std::thread sampler([&] {
      while (sampling) {
        peak = std::max<int64_t>(peak, rubato::ResidentBytes(server->pid));
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
    const absl::Time start = absl::Now();
    const std::map<int, int> codes = Send(channel, burst, body, token);
    const double took = absl::ToDoubleSeconds(absl::Now() - start);
    absl::SleepFor(absl::Milliseconds(500));
    sampling = false;
    sampler.join();
    const int64_t after = rubato::ResidentBytes(server->pid);
    std::string answers;
    for (const auto& [code, n] : codes) absl::StrAppend(&answers, n, " x code ", code, " ");
    std::printf("%-22s %10.0f %10.0f %10.0f %9.2f  %s\n", burst.name.c_str(), idle / 1048576.0,
                peak / 1048576.0, after / 1048576.0, took, answers.c_str());
  }
  rubato::StopServerProcess(&*server);
  ::unlink(secret.c_str());
  ::rmdir(dir.c_str());
  return 0;
}
