// Transport benchmark: push+pull throughput per worker against in-process gRPC parameter servers on
// 127.0.0.1, next to a loopback TCP stream measured in the same run.
//
//   bazel run //experiments:transport_benchmark [-- --seconds=2]
//
// For each model size (1, 16, 64 MB of float32, as 8 tensors so that two shards share it), shard
// count (1, 2) and worker count (1, 3), every worker thread registers and then loops push(step) +
// pull(step) for --seconds. The shards run in async mode, so that nothing waits at a barrier and
// the figure is transport plus the server's SGD pass; per worker it reports
// (bytes pushed + bytes pulled) / time. The TCP line is one socket pair over loopback, one thread
// writing 1 MiB blocks and one reading: the ceiling for a single connection on this machine.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_options.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/parameter_service.h"
#include "server/parameter_shard.h"
#include "worker/ps_client.h"

ABSL_FLAG(double, seconds, 2.0, "Measuring time per configuration.");

namespace rubato {
namespace {

constexpr int kTensors = 8;

// One loopback TCP stream for `seconds`: bytes per second received.
double LoopbackTcpBytesPerSecond(double seconds) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("loopback listener");
    return 0;
  }
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return;
    std::vector<char> block(1 << 20, 1);
    while (!stop.load()) {
      if (write(fd, block.data(), block.size()) <= 0) break;
    }
    close(fd);
  });
  const int conn = accept(listener, nullptr, nullptr);
  std::vector<char> buffer(1 << 20);
  int64_t received = 0;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  while (absl::Now() < end) {
    const ssize_t n = read(conn, buffer.data(), buffer.size());
    if (n <= 0) break;
    received += n;
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  stop.store(true);
  close(conn);  // Unblocks the writer.
  writer.join();
  close(listener);
  return received / elapsed;
}

struct Server {
  std::unique_ptr<ParameterShard> shard;
  std::unique_ptr<ParameterService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

// Returns bytes/s per worker (mean over workers), or a negative number on error.
double Measure(int64_t model_bytes, int shards, int workers, double seconds) {
  ClusterSpec cluster;
  cluster.set_num_workers(workers);
  cluster.mutable_consistency()->set_mode(ASYNC);
  cluster.mutable_optimizer()->set_type("sgd");
  cluster.mutable_optimizer()->set_learning_rate(1e-6);
  cluster.set_lease_ms(60000);
  cluster.set_wait_timeout_ms(60000);
  std::vector<Server> servers(shards);
  for (int s = 0; s < shards; ++s) {
    ShardOptions options;
    options.shard_id = s;
    options.num_shards = shards;
    options.cluster = cluster;
    auto shard = ParameterShard::Create(options);
    if (!shard.ok()) {
      std::fprintf(stderr, "shard: %s\n", shard.status().ToString().c_str());
      return -1;
    }
    servers[s].shard = std::move(*shard);
    servers[s].service = std::make_unique<ParameterService>(servers[s].shard.get());
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(servers[s].service.get());
    servers[s].server = builder.BuildAndStart();
    servers[s].address = absl::StrCat("127.0.0.1:", port);
  }
  const int64_t elements = model_bytes / 4 / kTensors;
  PsClientOptions base;
  for (const Server& s : servers) base.servers.push_back(s.address);
  base.num_workers = workers;
  base.consistency = cluster.consistency();
  for (int i = 0; i < kTensors; ++i) {
    TensorSpec spec;
    spec.set_name(absl::StrCat("t", i));
    spec.add_shape(elements);
    base.model.push_back(spec);
  }
  std::vector<double> rates(workers, -1);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      PsClientOptions options = base;
      options.worker_id = w;
      auto client = CreateGrpcPsClient(options);
      if (!client.ok()) return;
      std::vector<std::vector<float>> values(kTensors, std::vector<float>(elements, 0.5f));
      if (!(*client)->Register(values, 1, 0).ok()) return;
      int64_t step = 0;
      int64_t bytes = 0;
      const absl::Time start = absl::Now();
      while (absl::Now() - start < absl::Seconds(seconds)) {
        if (!(*client)->Push(step, values).ok()) return;
        if (!(*client)->Pull(step, absl::MakeSpan(values)).ok()) return;
        bytes += 2 * model_bytes;
        ++step;
      }
      rates[w] = bytes / absl::ToDoubleSeconds(absl::Now() - start);
    });
  }
  for (auto& t : threads) t.join();
  for (Server& s : servers) {
    s.shard->Shutdown();
    s.server->Shutdown();
  }
  double sum = 0;
  for (double r : rates) {
    if (r < 0) return -1;
    sum += r;
  }
  return sum / workers;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const double tcp = rubato::LoopbackTcpBytesPerSecond(seconds);
  std::printf("loopback TCP stream (1 connection): %.2f GB/s\n\n", tcp / 1e9);
  std::printf("%-8s %-7s %-8s %14s %12s\n", "model", "shards", "workers", "GB/s/worker",
              "x TCP stream");
  for (int64_t mb : {1, 16, 64}) {
    for (int shards : {1, 2}) {
      for (int workers : {1, 3}) {
        const double rate = rubato::Measure(mb << 20, shards, workers, seconds);
        if (rate < 0) {
          std::printf("%-8s %-7d %-8d %14s\n", absl::StrCat(mb, " MB").c_str(), shards, workers,
                      "error");
          continue;
        }
        std::printf("%-8s %-7d %-8d %14.3f %12.2f\n", absl::StrCat(mb, " MB").c_str(), shards,
                    workers, rate / 1e9, rate / tcp);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
