// All-reduce benchmark: algorithm bandwidth (bytes / time) of Rubato's ring all-reduce on
// 127.0.0.1, over its TCP data plane and over gRPC streams, for 1, 16 and 64 MB of float32 with 2
// and 4 ranks (one process per rank, each with its own RingPeer server, forked before this process
// touches gRPC), next to the ring's bound 2(N-1)/N * S / B, with B a loopback TCP stream measured
// in the same run.
//
//   bazel run //experiments:allreduce_benchmark [-- --seconds=2 --ranks=2,4 --sizes=1MB,16MB,64MB
//                                                   --segment_kb=0 --transports=tcp,grpc]
//
// experiments/allreduce_peers.sh runs this next to OpenMPI and Gloo and prints one table.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_options.h"
#include "common/malloc_tuning.h"
#include "common/ring_allreduce.h"
#include "experiments/loopback_tcp.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "worker/ring/ring_peer.h"

ABSL_FLAG(double, seconds, 2.0, "Measuring time per configuration.");
ABSL_FLAG(std::vector<std::string>, ranks, std::vector<std::string>({"2", "4"}),
          "Ring sizes to measure.");
ABSL_FLAG(std::vector<std::string>, sizes, std::vector<std::string>({"1MB", "16MB", "64MB"}),
          "Vector sizes (float32), each a number of KB or MB (binary units), e.g. 4KB,1MB.");
ABSL_FLAG(std::vector<std::string>, transports, std::vector<std::string>({"tcp", "grpc"}),
          "Ring transports to measure: tcp (the TCP data plane, worker/ring/ring_tcp.h, the default in "
          "jobs) and grpc (a gRPC stream, what TLS jobs use).");
ABSL_FLAG(int64_t, segment_kb, 0,
          "Segment size in KiB (0: the default, DefaultRingSegmentElements).");
ABSL_FLAG(int64_t, spin_us, -1,
          "tcp: how long a receive polls before it sleeps, in microseconds (TcpRingLink::"
          "SetReceiveSpin; 0: sleeps at once; -1: the link's default, as in jobs).");

namespace rubato {
namespace {

// Whole reads and writes on a pipe; false on EOF or error.
bool WriteAll(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= n;
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= n;
  }
  return true;
}

// One rank, in its own process: serve RingPeer on a free port and tell the parent (`up`), learn
// every rank's port (`down`), run 3 warm-up rounds (connections, first-touch pages) and report
// their mean, learn how many rounds to time, time them and report the mean. Messages are doubles.
int RunRank(int rank, int ranks, int64_t bytes, int64_t segment_elements, bool tcp, int up,
            int down) {
  RingMailbox mailbox((rank + ranks - 1) % ranks);
  std::unique_ptr<TcpRingListener> listener;
  if (tcp) {
    absl::StatusOr<std::unique_ptr<TcpRingListener>> l =
        TcpRingListener::Create("127.0.0.1", 0, mailbox.from_rank());
    if (!l.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, l.status().ToString().c_str());
      return 1;
    }
    listener = std::move(*l);
  }
  RingPeerService service(&mailbox, ServerSecurity(), listener.get());
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(&builder);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  double message = server == nullptr ? -1 : port;
  std::vector<double> ports(ranks);
  if (!WriteAll(up, &message, sizeof(message)) || server == nullptr ||
      !ReadAll(down, ports.data(), sizeof(double) * ranks)) {
    return 1;
  }
  int status = 0;
  {
    // Before the link: it may still send from `data` until its destructor returns.
    std::vector<float> data(bytes / 4, 1.0f + rank);
    const std::string next =
        absl::StrCat("127.0.0.1:", static_cast<int>(ports[(rank + 1) % ranks]));
    std::unique_ptr<RingLink> owned;
    if (tcp) {
      auto link = std::make_unique<TcpRingLink>(rank, ranks, next, listener.get());
      if (absl::GetFlag(FLAGS_spin_us) >= 0) {
        link->SetReceiveSpin(absl::Microseconds(absl::GetFlag(FLAGS_spin_us)));
      }
      owned = std::move(link);
    } else {
      owned = std::make_unique<GrpcRingLink>(rank, ranks, next, &mailbox);
    }
    RingLink& link = *owned;
    int64_t round = 0;
    auto time_rounds = [&](int count) {
      const absl::Time start = absl::Now();
      for (int k = 0; k < count; ++k, ++round) {
        const absl::Status s = RingAllReduceMean(rank, ranks, round, &link, absl::MakeSpan(data),
                                                 absl::Seconds(60), segment_elements);
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
          return -1.0;
        }
      }
      return absl::ToDoubleSeconds(absl::Now() - start) / count;
    };
    message = time_rounds(3);
    double rounds = 0;
    if (!WriteAll(up, &message, sizeof(message)) || !ReadAll(down, &rounds, sizeof(rounds)) ||
        rounds < 1) {
      status = 1;
    } else {
      message = time_rounds(static_cast<int>(rounds));
      if (!WriteAll(up, &message, sizeof(message))) status = 1;
    }
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  return status;
}

// Seconds per all-reduce of `bytes` over `ranks` ranks, each a process of its own as in a real
// job (and as the MPI and Gloo peers run): the slowest rank's mean over as many rounds as the
// slowest warm-up says fit in `seconds` (at least 10). < 0 on failure.
double SecondsPerAllReduce(int64_t bytes, int ranks, double seconds, int64_t segment_elements,
                           bool tcp) {
  std::vector<int> up(ranks), down(ranks);
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    int to_parent[2], to_child[2];
    if (pipe(to_parent) != 0 || pipe(to_child) != 0) return -1;
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
      close(to_parent[0]);
      close(to_child[1]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      _exit(RunRank(r, ranks, bytes, segment_elements, tcp, to_parent[1], to_child[0]));
    }
    close(to_parent[1]);
    close(to_child[0]);
    up[r] = to_parent[0];
    down[r] = to_child[1];
    children.push_back(pid);
  }
  // Each exchange: one double from every rank, then an answer to every rank.
  auto gather = [&](std::vector<double>* values) {
    values->resize(ranks);
    for (int r = 0; r < ranks; ++r) {
      if (!ReadAll(up[r], &(*values)[r], sizeof(double)) || (*values)[r] < 0) return false;
    }
    return true;
  };
  auto send = [&](const void* data, size_t size) {
    for (int r = 0; r < ranks; ++r) {
      if (!WriteAll(down[r], data, size)) return false;
    }
    return true;
  };
  double result = -1;
  std::vector<double> ports, warm, timed;
  if (gather(&ports) && send(ports.data(), sizeof(double) * ranks) && gather(&warm)) {
    const double estimate = *std::max_element(warm.begin(), warm.end());
    const double rounds = std::max(10.0, std::floor(seconds / std::max(estimate, 1e-6)));
    if (send(&rounds, sizeof(rounds)) && gather(&timed)) {
      result = *std::max_element(timed.begin(), timed.end());
    }
  }
  for (int r = 0; r < ranks; ++r) {
    close(up[r]);
    close(down[r]);
  }
  for (pid_t pid : children) {
    int status = 0;
    // A rank that failed has closed its pipe; the others end at their all-reduce deadline.
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      result = -1;
    }
  }
  return result;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::UseGrpcExperiments();  // Before anything of gRPC's runs.
  absl::ParseCommandLine(argc, argv);
  rubato::KeepFreedMemory();
  rubato::SkipMutexDeadlockDetection();
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const double tcp = rubato::LoopbackTcpBytesPerSecond(seconds);
  std::printf("loopback TCP stream (1 connection): B = %.2f GB/s\n\n", tcp / 1e9);
  std::printf("%-6s %-6s %12s %14s %14s %10s %s\n", "size", "ranks", "time", "algbw GB/s",
              "bound GB/s", "x bound", "transport");
  const int64_t segment_elements = absl::GetFlag(FLAGS_segment_kb) * 1024 / 4;
  for (const std::string& transport : absl::GetFlag(FLAGS_transports)) {
    if (transport != "tcp" && transport != "grpc") {
      std::fprintf(stderr, "allreduce_benchmark: --transports takes tcp and grpc, not %s\n",
                   transport.c_str());
      return 2;
    }
    for (const std::string& ranks_text : absl::GetFlag(FLAGS_ranks)) {
      for (const std::string& size_text : absl::GetFlag(FLAGS_sizes)) {
        int ranks = 0;
        int64_t count = 0;
        const absl::string_view unit =
            size_text.size() > 2 ? absl::string_view(size_text).substr(size_text.size() - 2) : "";
        if (!absl::SimpleAtoi(ranks_text, &ranks) || ranks < 2 || (unit != "KB" && unit != "MB") ||
            !absl::SimpleAtoi(absl::string_view(size_text).substr(0, size_text.size() - 2),
                              &count) ||
            count < 1) {
          std::fprintf(
              stderr, "allreduce_benchmark: bad --ranks %s or --sizes %s (want e.g. 4KB or 16MB)\n",
              ranks_text.c_str(), size_text.c_str());
          return 2;
        }
        const int64_t bytes = count << (unit == "KB" ? 10 : 20);
        const double t = rubato::SecondsPerAllReduce(bytes, ranks, seconds, segment_elements,
                                                     transport == "tcp");
        // Ring bound on the time: 2(N-1)/N * S / B, so algbw <= B * N / (2(N-1)).
        const double bound = tcp * ranks / (2.0 * (ranks - 1));
        if (t < 0) {
          std::printf("%-6s %-6d %12s %s\n", size_text.c_str(), ranks, "error", transport.c_str());
          continue;
        }
        std::printf("%-6s %-6d %9.3f ms %14.3f %14.3f %10.2f %s\n", size_text.c_str(), ranks,
                    1e3 * t, bytes / t / 1e9, bound / 1e9, bytes / t / bound, transport.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
