// All-reduce benchmark: algorithm bandwidth (bytes / time) of Rubato's ring all-reduce over gRPC on
// 127.0.0.1, for 1, 16 and 64 MB of float32 with 2 and 4 ranks (one thread per rank, each with
// its own RingPeer server), next to the ring's bound 2(N-1)/N * S / B, with B a loopback TCP stream
// measured in the same run.
//
//   bazel run //experiments:allreduce_benchmark [-- --seconds=2 --ranks=2,4 --sizes=1MB,16MB,64MB
//                                                   --segment_kb=0]
//
// experiments/allreduce_peers.sh runs this next to OpenMPI and Gloo and prints one table.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_options.h"
#include "common/malloc_tuning.h"
#include "common/ring_allreduce.h"
#include "experiments/loopback_tcp.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "worker/ring_peer.h"

ABSL_FLAG(double, seconds, 2.0, "Measuring time per configuration.");
ABSL_FLAG(std::vector<std::string>, ranks, std::vector<std::string>({"2", "4"}),
          "Ring sizes to measure.");
ABSL_FLAG(std::vector<std::string>, sizes, std::vector<std::string>({"1MB", "16MB", "64MB"}),
          "Vector sizes (float32), each a number of KB or MB (binary units), e.g. 4KB,1MB.");
ABSL_FLAG(int64_t, segment_kb, 0,
          "Segment size in KiB (0: the default, DefaultRingSegmentElements).");

namespace rubato {
namespace {

// Seconds per all-reduce of `bytes` over `ranks` ranks (the slowest rank's mean), or < 0.
double SecondsPerAllReduce(int64_t bytes, int ranks, double seconds, int64_t segment_elements) {
  std::vector<std::unique_ptr<RingMailbox>> boxes;
  std::vector<std::unique_ptr<RingPeerService>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (int r = 0; r < ranks; ++r) {
    boxes.push_back(std::make_unique<RingMailbox>((r + ranks - 1) % ranks));
    services.push_back(std::make_unique<RingPeerService>(boxes.back().get()));
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(services.back().get());
    servers.push_back(builder.BuildAndStart());
    addresses.push_back(absl::StrCat("127.0.0.1:", port));
  }
  // Each rank keeps one link (one connection) for the whole measurement: 3 warm-up rounds, which
  // open the connections and touch every page, then as many rounds as the slowest rank's warm-up
  // says fit in `seconds` (at least 10), timed.
  std::vector<double> warm(ranks, -1), per_round(ranks, -1);
  absl::Barrier* warmed = new absl::Barrier(ranks);  // Deletes itself after the last Block().
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      GrpcRingLink link(r, ranks, addresses[(r + 1) % ranks], boxes[r].get());
      std::vector<float> data(bytes / 4, 1.0f + r);
      int64_t round = 0;
      auto rounds = [&](int count) {
        const absl::Time start = absl::Now();
        for (int k = 0; k < count; ++k, ++round) {
          const absl::Status status = RingAllReduceMean(
              r, ranks, round, &link, absl::MakeSpan(data), absl::Seconds(60), segment_elements);
          if (!status.ok()) {
            std::fprintf(stderr, "rank %d: %s\n", r, status.ToString().c_str());
            return -1.0;
          }
        }
        return absl::ToDoubleSeconds(absl::Now() - start) / count;
      };
      warm[r] = rounds(3);
      if (warmed->Block()) delete warmed;
      const double estimate = *std::max_element(warm.begin(), warm.end());
      if (*std::min_element(warm.begin(), warm.end()) < 0) return;
      per_round[r] = rounds(std::max(10, static_cast<int>(seconds / std::max(estimate, 1e-6))));
    });
  }
  for (auto& t : threads) t.join();
  for (auto& s : servers) s->Shutdown();
  if (*std::min_element(per_round.begin(), per_round.end()) < 0) return -1;
  return *std::max_element(per_round.begin(), per_round.end());
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  rubato::KeepFreedMemory();
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const double tcp = rubato::LoopbackTcpBytesPerSecond(seconds);
  std::printf("loopback TCP stream (1 connection): B = %.2f GB/s\n\n", tcp / 1e9);
  std::printf("%-6s %-6s %12s %14s %14s %10s\n", "size", "ranks", "time", "algbw GB/s",
              "bound GB/s", "x bound");
  const int64_t segment_elements = absl::GetFlag(FLAGS_segment_kb) * 1024 / 4;
  for (const std::string& ranks_text : absl::GetFlag(FLAGS_ranks)) {
    for (const std::string& size_text : absl::GetFlag(FLAGS_sizes)) {
      int ranks = 0;
      int64_t count = 0;
      const absl::string_view unit =
          size_text.size() > 2 ? absl::string_view(size_text).substr(size_text.size() - 2) : "";
      if (!absl::SimpleAtoi(ranks_text, &ranks) || ranks < 2 || (unit != "KB" && unit != "MB") ||
          !absl::SimpleAtoi(absl::string_view(size_text).substr(0, size_text.size() - 2), &count) ||
          count < 1) {
        std::fprintf(stderr,
                     "allreduce_benchmark: bad --ranks %s or --sizes %s (want e.g. 4KB or 16MB)\n",
                     ranks_text.c_str(), size_text.c_str());
        return 2;
      }
      const int64_t bytes = count << (unit == "KB" ? 10 : 20);
      const double t = rubato::SecondsPerAllReduce(bytes, ranks, seconds, segment_elements);
      // Ring bound on the time: 2(N-1)/N * S / B, so algbw <= B * N / (2(N-1)).
      const double bound = tcp * ranks / (2.0 * (ranks - 1));
      if (t < 0) {
        std::printf("%-6s %-6d %12s\n", size_text.c_str(), ranks, "error");
        continue;
      }
      std::printf("%-6s %-6d %9.3f ms %14.3f %14.3f %10.2f\n", size_text.c_str(), ranks, 1e3 * t,
                  bytes / t / 1e9, bound / 1e9, bytes / t / bound);
      std::fflush(stdout);
    }
  }
  return 0;
}
