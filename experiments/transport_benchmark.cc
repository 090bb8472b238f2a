// Transport benchmark: push+pull throughput per worker against in-process gRPC parameter servers on
// 127.0.0.1, next to a loopback TCP stream measured in the same run.
//
//   bazel run //experiments:transport_benchmark [-- --seconds=2]
//
// For each model size (1, 16, 64 MB of float32, as 8 tensors so that two shards share it), shard
// count (1, 2) and worker count (1, 3), every worker thread registers and then loops pull(step) +
// push(step) for --seconds. The shards run in async mode, so that nothing waits at a barrier and
// the figure is transport plus the server's SGD pass; per worker it reports
// (bytes pushed + bytes pulled) / time. The TCP line is one socket pair over loopback, one thread
// writing 1 MiB blocks and one reading: the ceiling for a single connection on this machine.
//
// Last, the cost of security (issues 9 and 31): 1 and 16 MB, 1 shard, 1 and 3 workers, plaintext
// without tokens next to mutual TLS with per-worker tokens on the data plane, and over gRPC, in
// the same run (--security_only: that table alone). The TLS material is a throwaway CA and
// certificates made with the openssl command in a temporary directory.

#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_options.h"
#include "common/limits.h"
#include "common/malloc_tuning.h"
#include "common/security.h"
#include "experiments/crypto_rate.h"
#include "common/tensor_bytes.h"
#include "common/tensor_wire.h"
#include "experiments/cpu_meter.h"
#include "experiments/loopback_tcp.h"
#include "experiments/server_process.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/data_plane.h"
#include "server/parameter_service.h"
#include "server/parameter_shard.h"
#include "worker/ps/ps_client.h"
#include "worker/push_buckets.h"

ABSL_FLAG(double, seconds, 2.0, "Measuring time per configuration.");
ABSL_FLAG(std::string, ps_transport, "auto",
          "auto: Push and Pull over the shards' plain-TCP data plane (server/data_plane.h), as "
          "rubato_worker does by default; grpc: over gRPC.");
ABSL_FLAG(std::string, server, "server/rubato_server",
          "The server binary for the separate-process figures (runfiles path).");

namespace rubato {
namespace {

constexpr int kTensors = 8;

struct Server {
  std::unique_ptr<ParameterShard> shard;
  std::unique_ptr<ParameterService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<DataPlaneServer> data_plane;  // Destroyed first.
  std::string address;
};

// Credentials for both ends; the defaults are plaintext without tokens.
struct Security {
  ServerSecurity server;
  SecurityConfig client_config;  // ClientSecurity::Create(client_config, worker id).
};

// How a worker drives the client: kSerial pulls every tensor, then pushes every tensor (a worker
// with --overlap=false); kPipelined is the worker's default (--overlap): each tensor's push starts
// on its own, last tensor first as a backward pass produces them, and each is followed by the pull
// of that tensor for the next step (PsClient::StartPush with pull_into), so one tensor's pull and
// update overlap the next tensor's push. `bucket_bytes` gathers tensors into pushes of at least
// that many bytes, as rubato_worker --push_bucket_kb does (worker/push_buckets.h).
enum class Loop { kSerial, kPipelined };

// What every worker thread runs: its loop over a model of kTensors tensors, for `seconds`.
struct WorkerLoop {
  Loop loop = Loop::kSerial;
  int64_t model_bytes = 0;
  int64_t elements = 0;  // Per tensor.
  int64_t bucket_bytes = 0;
  double seconds = 0;
  ConsistencyMode mode = ASYNC;
};

// The benchmark's job: `workers` workers in `mode`, SGD with a tiny step, leases and waits of a
// minute.
ClusterSpec BenchmarkCluster(int workers, ConsistencyMode mode) {
  ClusterSpec cluster;
  cluster.set_num_workers(workers);
  cluster.mutable_consistency()->set_mode(mode);
  cluster.mutable_optimizer()->set_type("sgd");
  cluster.mutable_optimizer()->set_learning_rate(1e-6);
  cluster.set_lease_ms(60000);
  cluster.set_wait_timeout_ms(60000);
  return cluster;
}

// The shards as rubato_server processes (--server) of the same job, each added to `processes` and
// its address to `servers`; false (and a message) on error.
bool StartShardProcesses(int workers, ConsistencyMode mode, int64_t push_budget_mb,
                         std::vector<Server>* servers, std::vector<ServerProcess>* processes) {
  const int shards = static_cast<int>(servers->size());
  for (int s = 0; s < shards; ++s) {
    absl::StatusOr<ServerProcess> p = StartServerProcess(
        absl::GetFlag(FLAGS_server),
        {absl::StrCat("--shard_id=", s), absl::StrCat("--num_shards=", shards),
         absl::StrCat("--num_workers=", workers),
         mode == ASYNC ? std::string("--mode=async") : std::string("--mode=bsp"),
         absl::StrCat("--push_budget_mb=", push_budget_mb), "--optimizer=sgd",
         "--learning_rate=0.000001", "--lease_ms=60000", "--wait_timeout_ms=60000",
         absl::StrCat("--max_message_mb=", kMaxMessageBytesLimit >> 20)});
    if (!p.ok()) {
      std::fprintf(stderr, "server: %s\n", p.status().ToString().c_str());
      return false;
    }
    (*servers)[s].address = p->address;
    processes->push_back(*p);
  }
  return true;
}

// The shards in this process: each a ParameterShard behind gRPC on 127.0.0.1 and, with
// `use_data_plane`, its data plane; false (and a message) on error.
bool StartShardsInProcess(const ClusterSpec& cluster, int64_t push_budget_mb,
                          const Security& security, bool use_data_plane,
                          std::vector<Server>* servers) {
  const int shards = static_cast<int>(servers->size());
  for (int s = 0; s < shards; ++s) {
    Server& server = (*servers)[s];
    ShardOptions options;
    options.shard_id = s;
    options.num_shards = shards;
    options.cluster = cluster;
    options.push_budget_bytes = push_budget_mb << 20;
    auto shard = ParameterShard::Create(options);
    if (!shard.ok()) {
      std::fprintf(stderr, "shard: %s\n", shard.status().ToString().c_str());
      return false;
    }
    server.shard = std::move(*shard);
    server.service = std::make_unique<ParameterService>(server.shard.get(), security.server);
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder, kMaxMessageBytesLimit, kServerStreamWindowBytes);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", security.server.credentials(), &port);
    server.service->AddTo(&builder);
    server.server = builder.BuildAndStart();
    server.address = absl::StrCat("127.0.0.1:", port);
    if (!use_data_plane) continue;
    DataPlaneOptions data_options;
    data_options.host = "127.0.0.1";
    data_options.max_message_bytes = kMaxMessageBytesLimit;
    data_options.num_workers = cluster.num_workers();
    auto data = DataPlaneServer::Start(data_options, server.shard.get(), security.server);
    if (!data.ok()) {
      std::fprintf(stderr, "data plane: %s\n", data.status().ToString().c_str());
      return false;
    }
    server.data_plane = std::move(*data);
    server.service->set_data_port(server.data_plane->port());
  }
  return true;
}

// The client options every worker shares: the servers, the job, and the model's tensors t0...
PsClientOptions BaseClientOptions(const std::vector<Server>& servers, const ClusterSpec& cluster,
                                  int64_t elements, bool use_data_plane) {
  PsClientOptions base;
  base.use_data_plane = use_data_plane;
  for (const Server& s : servers) base.servers.push_back(s.address);
  base.num_workers = cluster.num_workers();
  base.consistency = cluster.consistency();
  for (int i = 0; i < kTensors; ++i) {
    TensorSpec spec;
    spec.set_name(absl::StrCat("t", i));
    spec.add_shape(elements);
    base.model.push_back(spec);
  }
  return base;
}

// Worker `w`'s client, registered with `values`, or null with *error set.
std::unique_ptr<PsClient> ConnectWorker(const PsClientOptions& base, const Security& security,
                                        int w, const std::vector<std::vector<float>>& values,
                                        std::string* error) {
  PsClientOptions options = base;
  options.worker_id = w;
  options.max_message_bytes = kMaxMessageBytesLimit;
  auto client_security = ClientSecurity::Create(security.client_config, w);
  if (!client_security.ok()) {
    *error = client_security.status().ToString();
    return nullptr;
  }
  options.security = *client_security;
  auto client = CreateGrpcPsClient(options);
  if (!client.ok()) {
    *error = client.status().ToString();
    return nullptr;
  }
  if (auto s = (*client)->Register(values, 1, 0); !s.ok()) {
    *error = s.status().ToString();
    return nullptr;
  }
  return *std::move(client);
}

// When the workers stop. Under bsp every worker does the same number of steps: a worker that
// stopped on its own clock while another began one more step would leave that one waiting at the
// barrier until the shard's wait timeout (a run that printed 0.000 GB/s). The first worker to see
// the time up at the top of a step sets the last step to the next one; a worker is at most one
// step behind it. (Without a barrier each worker stops on its own clock.)
class StopRule {
 public:
  StopRule(double seconds, ConsistencyMode mode) : seconds_(seconds), mode_(mode) {}

  // Whether a worker whose loop began at `start` goes on with `step`. Thread-safe.
  bool KeepGoing(absl::Time start, int64_t step) {
    const bool over = absl::Now() - start >= absl::Seconds(seconds_);
    if (mode_ != BSP) return !over;
    if (over) {
      int64_t unset = -1;
      stop_step_.compare_exchange_strong(unset, step + 1);
    }
    const int64_t stop = stop_step_.load();
    return stop < 0 || step < stop;
  }

 private:
  const double seconds_;
  const ConsistencyMode mode_;
  std::atomic<int64_t> stop_step_{-1};
};

// Starts the pushes of one step's `ranges` of tensors, each followed by the pull of its tensors
// into `values`, adding their tickets to `tickets`; stops at the first error, setting *error.
void StartPushes(PsClient* client, int64_t step, const std::vector<PushBuckets::Range>& ranges,
                 const std::vector<std::vector<float>>& grads,
                 std::vector<std::vector<float>>* values, std::vector<int64_t>* tickets,
                 std::string* error) {
  for (const PushBuckets::Range& r : ranges) {
    std::vector<int> tensors;
    for (size_t k = 0; k < r.count; ++k) tensors.push_back(static_cast<int>(r.first + k));
    absl::StatusOr<int64_t> ticket = client->StartPush(step, tensors, grads, values);
    if (!ticket.ok()) {
      *error = ticket.status().ToString();
      return;
    }
    tickets->push_back(*ticket);
  }
}

// Loop::kPipelined until `stop` says so: bytes/s pushed and pulled, or -1 with *error set.
double PipelinedLoop(PsClient* client, const WorkerLoop& job, StopRule* stop,
                     std::vector<std::vector<float>>* values, std::string* error) {
  // The gradients are sent from `grads` while the pulls fill `values`, as in a worker.
  const std::vector<std::vector<float>> grads = *values;
  PushBuckets buckets(std::vector<int64_t>(kTensors, job.model_bytes / kTensors), job.bucket_bytes);
  int64_t step = 0;
  int64_t bytes = 0;
  const absl::Time start = absl::Now();
  if (absl::Status s = client->Pull(0, absl::MakeSpan(*values)); !s.ok()) {
    *error = s.ToString();
    return -1;
  }
  std::vector<int64_t> tickets;
  while (stop->KeepGoing(start, step)) {
    tickets.clear();
    for (int i = kTensors - 1; i >= 0 && error->empty(); --i) {
      StartPushes(client, step, buckets.Add(i, 1), grads, values, &tickets, error);
    }
    if (error->empty()) StartPushes(client, step, buckets.Flush(), grads, values, &tickets, error);
    for (int64_t t : tickets) {  // Every ticket is waited for, even after an error.
      if (absl::Status s = client->WaitPush(t, nullptr); !s.ok() && error->empty()) {
        *error = s.ToString();
      }
    }
    if (!error->empty()) return -1;
    bytes += 2 * job.model_bytes;
    ++step;
  }
  return bytes / absl::ToDoubleSeconds(absl::Now() - start);
}

// Loop::kSerial until `stop` says so: bytes/s pushed and pulled, or -1 with *error set.
double SerialLoop(PsClient* client, const WorkerLoop& job, StopRule* stop,
                  std::vector<std::vector<float>>* values, std::string* error) {
  int64_t step = 0;
  int64_t bytes = 0;
  const absl::Time start = absl::Now();
  while (stop->KeepGoing(start, step)) {
    // As a worker does: pull (which waits for the job to start), then push.
    if (absl::Status s = client->Pull(step, absl::MakeSpan(*values)); !s.ok()) {
      *error = s.ToString();
      return -1;
    }
    if (absl::Status s = client->Push(step, *values); !s.ok()) {
      *error = s.ToString();
      return -1;
    }
    bytes += 2 * job.model_bytes;
    ++step;
  }
  return bytes / absl::ToDoubleSeconds(absl::Now() - start);
}

// Runs `workers` worker threads: each registers, and once every one has, runs `job`'s loop.
// Returns each worker's bytes/s (-1 where it failed, with (*errors)[w] set). `cpu`, when given,
// receives what the loops cost: from when every worker has registered until the last one stops.
std::vector<double> RunWorkers(const PsClientOptions& base, const Security& security,
                               const WorkerLoop& job, int workers, CpuUse* cpu,
                               std::vector<std::string>* errors) {
  std::vector<double> rates(workers, -1);
  std::vector<std::thread> threads;
  absl::BlockingCounter registered(workers);
  absl::Notification go;
  StopRule stop(job.seconds, job.mode);
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      std::string* error = &(*errors)[w];
      std::vector<std::vector<float>> values(kTensors, std::vector<float>(job.elements, 0.5f));
      const std::unique_ptr<PsClient> client = ConnectWorker(base, security, w, values, error);
      registered.DecrementCount();  // Failed or not, so that the main thread never waits for it.
      if (client == nullptr) return;
      go.WaitForNotification();
      rates[w] = job.loop == Loop::kPipelined
                     ? PipelinedLoop(client.get(), job, &stop, &values, error)
                     : SerialLoop(client.get(), job, &stop, &values, error);
    });
  }
  registered.Wait();
  const CpuMeter meter;
  go.Notify();
  for (auto& t : threads) t.join();
  if (cpu != nullptr) *cpu = meter.Stop();
  return rates;
}

// The mean of the workers' rates, or -1 (naming the first failed worker's error on stderr).
double MeanRate(const std::vector<double>& rates, const std::vector<std::string>& errors) {
  double sum = 0;
  for (size_t w = 0; w < rates.size(); ++w) {
    if (rates[w] < 0) {
      std::fprintf(stderr, "worker %d: %s\n", static_cast<int>(w), errors[w].c_str());
      return -1;
    }
    sum += rates[w];
  }
  return sum / rates.size();
}

// Push+pull bytes/s per worker (the mean over `workers`) against `shards` shards, in this process
// or, with `server_process`, rubato_server processes; a negative number on error. `cpu`, when
// given, receives what the measuring loops cost (RunWorkers).
double Measure(int64_t model_bytes, int shards, int workers, double seconds,
               const Security& security = Security(), CpuUse* cpu = nullptr,
               Loop loop = Loop::kSerial, int64_t bucket_bytes = 0, bool server_process = false,
               ConsistencyMode mode = ASYNC, int64_t push_budget_mb = 32) {
  const ClusterSpec cluster = BenchmarkCluster(workers, mode);
  std::vector<Server> servers(shards);
  std::vector<ServerProcess> processes;
  // Stops the server processes (if any) whatever the way out.
  struct Stop {
    std::vector<ServerProcess>* processes;
    ~Stop() {
      for (ServerProcess& p : *processes) StopServerProcess(&p);
    }
  } stop{&processes};
  const bool use_data_plane = absl::GetFlag(FLAGS_ps_transport) != "grpc";
  if (server_process
          ? !StartShardProcesses(workers, mode, push_budget_mb, &servers, &processes)
          : !StartShardsInProcess(cluster, push_budget_mb, security, use_data_plane, &servers)) {
    return -1;
  }
  WorkerLoop job;
  job.loop = loop;
  job.model_bytes = model_bytes;
  job.elements = model_bytes / 4 / kTensors;
  job.bucket_bytes = bucket_bytes;
  job.seconds = seconds;
  job.mode = mode;
  std::vector<std::string> errors(workers);
  const std::vector<double> rates =
      RunWorkers(BaseClientOptions(servers, cluster, job.elements, use_data_plane), security, job,
                 workers, cpu, &errors);
  for (Server& s : servers) {
    if (s.shard == nullptr) continue;  // a process, stopped on the way out
    s.shard->Shutdown();
    s.server->Shutdown();
  }
  return MeanRate(rates, errors);
}

// The same push+pull loop for one worker against one ParameterShard called directly: the wire
// format's copies, the checks and the SGD pass, without gRPC or sockets. The gap between this and
// the gRPC figure is the transport's.
double MeasureInProcess(int64_t model_bytes, double seconds) {
  ShardOptions options;
  options.cluster.set_num_workers(1);
  options.cluster.mutable_consistency()->set_mode(ASYNC);
  options.cluster.mutable_optimizer()->set_type("sgd");
  options.cluster.mutable_optimizer()->set_learning_rate(1e-6);
  options.cluster.set_lease_ms(60000);
  options.cluster.set_wait_timeout_ms(60000);
  auto shard = ParameterShard::Create(options);
  if (!shard.ok()) return -1;
  const int64_t elements = model_bytes / 4 / kTensors;
  std::vector<std::vector<float>> values(kTensors, std::vector<float>(elements, 0.5f));
  RegisterRequest reg;
  reg.set_worker_id(0);
  reg.set_batch_size(1);
  reg.set_num_workers(1);
  *reg.mutable_consistency() = options.cluster.consistency();
  for (int i = 0; i < kTensors; ++i) {
    TensorSpec* spec = reg.add_model();
    spec->set_name(absl::StrCat("t", i));
    spec->add_shape(elements);
    TensorValue* v = reg.add_initial_values();
    v->set_name(spec->name());
    FloatsToBytes(values[i], v->mutable_data());
  }
  if (!(*shard)->Register(reg).ok()) return -1;
  // The shard's own work on the zero-copy path, as ParameterService drives it: the push's
  // gradients are views of the worker's memory, and the pull's answer shares the weights, which are
  // copied into the worker's parameters (as the client copies them out of the receive buffers).
  int64_t bytes = 0;
  const absl::Time start = absl::Now();
  for (int64_t step = 0; absl::Now() - start < absl::Seconds(seconds); ++step) {
    PullRequest pull;
    pull.set_worker_id(0);
    pull.set_step(step);
    bool ok = false;
    (*shard)->Pull(
        pull, absl::InfiniteFuture(),
        ParameterShard::SharedPullDone([&](absl::Status s, std::vector<PulledTensor> tensors) {
          ok = s.ok();
          for (size_t i = 0; ok && i < tensors.size(); ++i) {
            std::memcpy(values[i].data(), tensors[i].snapshot.values->data(),
                        values[i].size() * sizeof(float));
          }
        }));
    if (!ok) return -1;
    WirePush push;
    push.worker_id = 0;
    push.step = step;
    for (int i = 0; i < kTensors; ++i) {
      WireTensor g;
      g.name = absl::StrCat("t", i);
      g.data = ByteChunks(absl::string_view(reinterpret_cast<const char*>(values[i].data()),
                                            values[i].size() * sizeof(float)));
      push.gradients.push_back(std::move(g));
    }
    absl::Notification pushed;
    (*shard)->Push(push, nullptr, [&](absl::StatusOr<PushResponse> r) {
      ok = r.ok();
      pushed.Notify();
    });
    pushed.WaitForNotification();
    if (!ok) return -1;
    bytes += 2 * model_bytes;
  }
  return bytes / absl::ToDoubleSeconds(absl::Now() - start);
}

// Machine-wide core-seconds per GB for a window that moved `bytes_per_second` (0 when it moved
// nothing).
double CoreSecondsPerGb(const CpuUse& cpu, double bytes_per_second) {
  return bytes_per_second > 0 ? cpu.machine_cores / (bytes_per_second / 1e9) : 0;
}

// "cores busy X of N (this process Y), Z core-s per GB" for a window that moved `bytes_per_second`.
std::string CpuText(const CpuUse& cpu, double bytes_per_second) {
  return absl::StrFormat("cores busy %.2f of %d (this process %.2f), %.3f core-s per GB",
                         cpu.machine_cores, cpu.machine_core_count, cpu.process_cores,
                         CoreSecondsPerGb(cpu, bytes_per_second));
}

// Mutual TLS and a job secret, made in a fresh temporary directory; nullopt (and a message) if the
// openssl command is missing or fails.
std::optional<Security> MakeTlsAndTokens() {
  char dir_template[] = "/tmp/rubato-bench-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) return std::nullopt;
  const std::string script = absl::StrCat(
      "set -e; cd ", dir,
      "; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 "
      "-subj /CN=bench-ca -keyout ca.key -out ca.pem 2>/dev/null; "
      "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; "
      "for n in server client; do openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 "
      "-nodes -subj /CN=$n -keyout $n.key -out $n.csr 2>/dev/null; openssl x509 -req -in "
      "$n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile san.ext -out $n.pem "
      "2>/dev/null; done; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > job.secret; "
      "chmod 600 job.secret");
  if (std::system(script.c_str()) != 0) {
    std::fprintf(stderr, "could not make TLS material with openssl in %s\n", dir);
    return std::nullopt;
  }
  const std::string d(dir);
  SecurityConfig server;
  server.auth_secret_file = d + "/job.secret";
  server.job_id = "transport-benchmark";
  server.tls = {d + "/server.pem", d + "/server.key", d + "/ca.pem"};
  Security security;
  auto s = ServerSecurity::Create(server);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
    return std::nullopt;
  }
  security.server = *std::move(s);
  security.client_config = server;
  security.client_config.tls = {d + "/client.pem", d + "/client.key", d + "/ca.pem"};
  return security;
}

}  // namespace
}  // namespace rubato

ABSL_FLAG(bool, keep_freed_memory, true,
          "Tune malloc as rubato_server and rubato_worker do (common/malloc_tuning.h).");

ABSL_FLAG(bool, security_only, false,
          "Measure only the cost of security: plaintext vs mutual TLS + tokens, on the data plane "
          "and over gRPC (the last table).");

ABSL_FLAG(std::string, only, "",
          "MB,shards,workers: measure only this configuration (for perf record), nothing else.");

ABSL_FLAG(std::string, mode, "async",
          "With --only: async (every push applied on arrival) or bsp (a barrier a step; "
          "gradients larger than a worker's share of --push_budget_mb go in parts).");
ABSL_FLAG(int64_t, push_budget_mb, 32, "With --only and --mode=bsp: the shards' --push_budget_mb.");

ABSL_FLAG(bool, server_process, false,
          "With --only: the shards are rubato_server processes, not in this process.");

ABSL_FLAG(int64_t, bucket_kb, rubato::kDefaultPushBucketKb,
          "With --only and --loop=pipelined: gather tensors into pushes of at least this many "
          "KiB (rubato_worker --push_bucket_kb, whose default this is; 0: one push per tensor).");

ABSL_FLAG(std::string, loop, "pipelined",
          "With --only: serial (pull every tensor, then push every tensor) or pipelined (each "
          "tensor's push followed by its pull, as a worker with --overlap does).");

namespace rubato {
namespace {

// --only: one configuration with the loop, mode and shards the flags say, as one line; the exit
// status (2 for a bad flag, 1 when the measurement failed).
int MeasureOnly(const std::string& only, double seconds) {
  int mb = 0, shards = 0, workers = 0;
  if (std::sscanf(only.c_str(), "%d,%d,%d", &mb, &shards, &workers) != 3 || mb < 1 || shards < 1 ||
      workers < 1) {
    std::fprintf(stderr, "--only wants MB,shards,workers (e.g. 64,1,1), got '%s'\n", only.c_str());
    return 2;
  }
  const std::string loop_name = absl::GetFlag(FLAGS_loop);
  if (loop_name != "serial" && loop_name != "pipelined") {
    std::fprintf(stderr, "--loop wants serial or pipelined, got '%s'\n", loop_name.c_str());
    return 2;
  }
  const Loop loop = loop_name == "serial" ? Loop::kSerial : Loop::kPipelined;
  const std::string mode_name = absl::GetFlag(FLAGS_mode);
  if (mode_name != "async" && mode_name != "bsp") {
    std::fprintf(stderr, "--mode wants async or bsp, got '%s'\n", mode_name.c_str());
    return 2;
  }
  CpuUse cpu;
  const double rate =
      Measure(int64_t{mb} << 20, shards, workers, seconds, Security(), &cpu, loop,
              absl::GetFlag(FLAGS_bucket_kb) << 10, absl::GetFlag(FLAGS_server_process),
              mode_name == "bsp" ? BSP : ASYNC, absl::GetFlag(FLAGS_push_budget_mb));
  std::printf("%d MB, %d shard(s), %d worker(s), %s, %s%s: %.3f GB/s per worker; %s\n", mb, shards,
              workers, mode_name.c_str(), loop_name.c_str(),
              absl::GetFlag(FLAGS_server_process) ? ", server process" : "", rate / 1e9,
              CpuText(cpu, rate * workers).c_str());
  return rate < 0 ? 1 : 0;
}

// The shard alone at each model size, then the bound on push+pull those figures and the TCP
// stream's (`tcp` bytes/s costing `stream_cpu`) set with every core busy.
void PrintShardAloneAndBounds(double seconds, double tcp, const CpuUse& stream_cpu) {
  std::vector<std::string> bounds;
  for (int64_t mb : {1, 16, 64}) {
    CpuMeter meter;
    const double direct = MeasureInProcess(mb << 20, seconds);
    const CpuUse cpu = meter.Stop();
    std::printf(
        "shard alone (in process, zero-copy API), %2lld MB, 1 worker: %.3f GB/s (%.2f x "
        "TCP stream); %s\n",
        static_cast<long long>(mb), direct / 1e9, direct / tcp, CpuText(cpu, direct).c_str());
    // A byte pushed or pulled costs at least the stream's two kernel copies and the shard's (and
    // the client's) own passes: with every core busy, no transport does better than this.
    const double per_gb = CoreSecondsPerGb(stream_cpu, tcp) + CoreSecondsPerGb(cpu, direct);
    if (per_gb > 0) {
      const double bound = stream_cpu.machine_core_count / per_gb * 1e9;
      bounds.push_back(absl::StrFormat(
          "%2lld MB: %.3f + %.3f core-s per GB on %d cores: at most %.3f GB/s (%.2f x TCP stream)",
          static_cast<long long>(mb), CoreSecondsPerGb(stream_cpu, tcp),
          CoreSecondsPerGb(cpu, direct), stream_cpu.machine_core_count, bound / 1e9, bound / tcp));
    }
  }
  std::printf(
      "\nBound for push+pull (all workers together), from the CPU cost per GB of the stream's "
      "kernel copies\nand of the shard alone, with every core of the machine busy:\n");
  for (const std::string& b : bounds) std::printf("  %s\n", b.c_str());
}

// One row of the transport tables: the serial and the pipelined loop of one configuration.
void PrintLoopsRow(int64_t mb, int shards, int workers, bool server_process, double seconds,
                   double tcp) {
  std::string out = absl::StrFormat("%-8s %-7d %-8d", absl::StrCat(mb, " MB"), shards, workers);
  for (Loop loop : {Loop::kSerial, Loop::kPipelined}) {
    CpuUse cpu;
    const double rate = Measure(mb << 20, shards, workers, seconds, Security(), &cpu, loop,
                                kDefaultPushBucketKb << 10, server_process);
    if (rate < 0) {
      absl::StrAppend(&out, absl::StrFormat(" | %11s %9s %6s %9s", "error", "", "", ""));
      continue;
    }
    absl::StrAppend(&out,
                    absl::StrFormat(" | %11.3f %9.2f %6.2f %9.3f", rate / 1e9, rate * workers / tcp,
                                    cpu.machine_cores, CoreSecondsPerGb(cpu, rate * workers)));
  }
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
}

// Push+pull per worker with the shards in this process, then with rubato_server processes.
void PrintTransportTables(double seconds, double tcp) {
  std::printf(
      "\nPush+pull GB/s per worker, serial and pipelined loops (see Measure); 'x stream' is the\n"
      "workers' aggregate over the TCP stream; cores busy machine-wide, and core-seconds per GB\n"
      "moved (all workers)\n%-8s %-7s %-8s | %11s %9s %6s %9s | %11s %9s %6s %9s\n",
      "model", "shards", "workers", "serial", "x stream", "cores", "core-s/GB", "pipelined",
      "x stream", "cores", "core-s/GB");
  for (int64_t mb : {1, 16, 64}) {
    for (int shards : {1, 2}) {
      for (int workers : {1, 3}) {
        PrintLoopsRow(mb, shards, workers, /*server_process=*/false, seconds, tcp);
      }
    }
  }
  std::printf(
      "\nThe same with each shard a rubato_server process (the workers are this process's "
      "threads)\n%-8s %-7s %-8s | %11s %9s %6s %9s | %11s %9s %6s %9s\n",
      "model", "shards", "workers", "serial", "x stream", "cores", "core-s/GB", "pipelined",
      "x stream", "cores", "core-s/GB");
  for (int64_t mb : {1, 16, 64}) {
    for (int workers : {1, 3}) PrintLoopsRow(mb, 1, workers, /*server_process=*/true, seconds, tcp);
  }
}

// The cost of security, 1 shard: plaintext without tokens next to mutual TLS with per-worker
// tokens on the data plane (common/tls_stream.h), and next to the same over gRPC (what a TLS job
// used before the data plane had TLS), each row's three measured one after another. The exit
// status: 1 if no TLS material could be made.
int PrintSecurityCost(double seconds) {
  std::optional<Security> secure = MakeTlsAndTokens();
  if (!secure.has_value()) return 1;
  const double aes = AesGcmBytesPerSecond(seconds);
  std::printf(
      "\nsecurity cost, 1 shard: plaintext without tokens vs mutual TLS + per-worker tokens, on "
      "the data plane and over gRPC.\nAES-128-GCM on one core: %.2f GB/s. serial: the TLS ratio "
      "if every byte's encryption and decryption ran in series with the plaintext step, "
      "1 / (1 + 2 x plain / AES)\n%-8s %-8s %12s %12s %7s %7s %12s %7s\n",
      aes / 1e9, "model", "workers", "plain GB/s", "TLS GB/s", "ratio", "serial", "TLS gRPC",
      "ratio");
  const std::string transport = absl::GetFlag(FLAGS_ps_transport);
  for (int64_t mb : {1, 16}) {
    for (int workers : {1, 3}) {
      absl::SetFlag(&FLAGS_ps_transport, "auto");
      const double plain = Measure(mb << 20, 1, workers, seconds);
      const double tls = Measure(mb << 20, 1, workers, seconds, *secure);
      absl::SetFlag(&FLAGS_ps_transport, "grpc");
      const double tls_grpc = Measure(mb << 20, 1, workers, seconds, *secure);
      std::printf("%-8s %-8d %12.3f %12.3f %7.2f %7.2f %12.3f %7.2f\n",
                  absl::StrCat(mb, " MB").c_str(), workers, plain / 1e9, tls / 1e9, tls / plain,
                  1 / (1 + 2 * plain / aes), tls_grpc / 1e9, tls_grpc / plain);
      std::fflush(stdout);
    }
  }
  absl::SetFlag(&FLAGS_ps_transport, transport);
  return 0;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::UseGrpcExperiments();  // Before anything of gRPC's runs.
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_keep_freed_memory)) rubato::KeepFreedMemory();
  rubato::SkipMutexDeadlockDetection();
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (const std::string only = absl::GetFlag(FLAGS_only); !only.empty()) {
    return rubato::MeasureOnly(only, seconds);
  }
  if (absl::GetFlag(FLAGS_security_only)) return rubato::PrintSecurityCost(seconds);
  rubato::CpuMeter stream_meter;
  const double tcp = rubato::LoopbackTcpBytesPerSecond(seconds);
  const rubato::CpuUse stream_cpu = stream_meter.Stop();
  std::printf("loopback TCP stream (1 connection): %.2f GB/s; %s\n\n", tcp / 1e9,
              rubato::CpuText(stream_cpu, tcp).c_str());
  rubato::PrintShardAloneAndBounds(seconds, tcp, stream_cpu);
  rubato::PrintTransportTables(seconds, tcp);
  return rubato::PrintSecurityCost(seconds);
}
