// Server memory under large messages (issue 9): the resident size of a real rubato_server before,
// during (peak, sampled every 5 ms) and after bursts of concurrent maximum-size messages.
//
//   bazel run //experiments:server_memory [-- --limits_mb=64,256]
//
// For each message limit L (--max_message_mb of the server), it sends 4 concurrent pushes of
// L - 64 KiB of data (accepted by gRPC, then refused by the shard: nobody registered), then 4
// concurrent pushes of 4 L (refused by gRPC for their size). "after" is read 7 s later: the server
// returns freed memory every 5 s (common/malloc_tuning.h). It prints figures and asserts nothing.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_options.h"
#include "common/limits.h"
#include "grpcpp/create_channel.h"
#include "proto/parameter_server.grpc.pb.h"

ABSL_FLAG(std::string, limits_mb, "64,256", "Server message limits to try, in MiB.");
ABSL_FLAG(std::string, server, "server/rubato_server", "The server binary (runfiles path).");

namespace {

int64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    int64_t kb = 0;
    if (line.rfind("VmRSS:", 0) == 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &kb)) {
      return kb << 10;
    }
  }
  return -1;
}

double MiB(int64_t b) { return static_cast<double>(b) / (1 << 20); }

// Sends `count` concurrent pushes of `bytes` of gradient data; returns the first status seen.
std::string Burst(rubato::ParameterServer::Stub* stub, int count, int64_t bytes) {
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(count);
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      rubato::PushRequest push;
      push.set_worker_id(0);
      push.mutable_gradients()->Add()->set_data(std::string(bytes, '\0'));
      rubato::PushResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      statuses[i] = stub->Push(&context, push, &response);
    });
  }
  for (auto& t : threads) t.join();
  return absl::StrCat(statuses[0].error_code(), " ", statuses[0].error_message().substr(0, 60));
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::printf("%-10s %-26s %10s %10s %10s  %s\n", "limit", "burst", "before", "peak", "after",
              "server's answer");
  for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_limits_mb), ',')) {
    int64_t limit_mb = 0;
    if (!absl::SimpleAtoi(text, &limit_mb)) return 2;
    char dir_template[] = "/tmp/rubato-mem-XXXXXX";
    const std::string dir = mkdtemp(dir_template);
    const std::string port_file = dir + "/port";
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string server = absl::GetFlag(FLAGS_server);
      const std::string a1 = absl::StrCat("--max_message_mb=", limit_mb);
      const std::string a2 = absl::StrCat("--port_file=", port_file);
      execl(server.c_str(), server.c_str(), "--num_workers=1", "--listen=127.0.0.1:0",
            a1.c_str(), a2.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    std::string address;
    for (int i = 0; i < 200 && address.empty(); ++i) {
      absl::SleepFor(absl::Milliseconds(50));
      std::ifstream(port_file) >> address;
    }
    if (address.empty()) {
      std::fprintf(stderr, "the server did not start\n");
      kill(pid, SIGKILL);
      return 1;
    }
    auto stub = rubato::ParameterServer::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(),
        rubato::RubatoChannelArguments(rubato::kMaxMessageBytesLimit)));
    const int64_t limit = limit_mb << 20;
    for (const auto& [name, bytes] :
         {std::make_pair(std::string("4 x (limit - 64 KiB)"), limit - (64 << 10)),
          std::make_pair(std::string("4 x (4 x limit)"),
                         std::min<int64_t>(4 * limit, rubato::kMaxMessageBytesLimit - (1 << 20)))}) {
      absl::SleepFor(absl::Seconds(1));
      const int64_t before = RssBytes(pid);
      std::atomic<bool> done{false};
      std::atomic<int64_t> peak{before};
      std::thread sampler([&] {
        while (!done) {
          peak = std::max<int64_t>(peak, RssBytes(pid));
          absl::SleepFor(absl::Milliseconds(5));
        }
      });
      const std::string answer = Burst(stub.get(), 4, bytes);
      absl::SleepFor(absl::Milliseconds(200));
      done = true;
      sampler.join();
      absl::SleepFor(absl::Seconds(7));
      const int64_t after = RssBytes(pid);
      std::printf("%-10s %-26s %8.0f M %8.0f M %8.0f M  %s\n",
                  absl::StrCat(limit_mb, " MiB").c_str(), name.c_str(), MiB(before), MiB(peak),
                  MiB(after), answer.c_str());
      std::fflush(stdout);
    }
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
  }
  return 0;
}
