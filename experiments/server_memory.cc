// Server memory under large messages (issue 9): the resident size of a real rubato_server before,
// during (peak, sampled every 5 ms) and after bursts of concurrent maximum-size messages.
//
//   bazel run //experiments:server_memory [-- --limits_mb=64,256]
//
// For each message limit L (--max_message_mb of the server), it sends 4 concurrent pushes of
// L - 64 KiB of data (accepted by gRPC, then refused by the shard: nobody registered), then 4
// concurrent pushes of 4 L (refused by gRPC for their size). "after" is read 7 s later: the server
// returns freed memory every 5 s (common/malloc_tuning.h).
//
// Then training (issue 12): for 1, 3 and 8 workers (threads of this process, each a PsClient) it
// starts a bsp server for a 64 MB model (8 tensors) with sgd (no optimizer slot) and adam (two),
// and runs --steps steps of pull + push; the server's resident size is sampled every 5 ms. It
// prints, in units of the model's bytes, the growth from the idle server to the peak (registration
// included: the initial values arrive whole), and the growth during training alone (from the
// size once every worker has pulled step 0), next to the design bound of the shard's own state:
// weights + one accumulator + the optimizer's slots, (2 + slots) x bytes. Beyond it come what gRPC
// holds of the calls in flight (bounded by --budget_mb, the server's --memory_budget_mb) and
// gradients held for their turn (bsp sums in worker-id order). It prints figures and asserts
// nothing.
#include <unistd.h>

#include <atomic>
#include <cstdio>
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
#include "experiments/server_process.h"
#include "grpcpp/create_channel.h"
#include "proto/parameter_server.grpc.pb.h"
#include "worker/ps/ps_client.h"

ABSL_FLAG(std::string, limits_mb, "64,256", "Server message limits to try, in MiB.");
ABSL_FLAG(std::string, workers, "1,3,8", "Worker counts for the training part (empty: skip it).");
ABSL_FLAG(int, model_mb, 64, "Model size for the training part, in MiB.");
ABSL_FLAG(int, steps, 6, "Steps of the training part.");
ABSL_FLAG(int, budget_mb, 0, "The server's --memory_budget_mb in the training part (0: its default).");
ABSL_FLAG(std::string, server, "server/rubato_server", "The server binary (runfiles path).");

namespace {

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

constexpr int kTensors = 8;  // The training part's model: 8 tensors of equal size.

// One job of the training part: its server and what every worker does.
struct TrainingJob {
  std::string address;
  int workers = 0;
  int steps = 0;
  int64_t elements = 0;  // Per tensor.
  int max_message_mb = 0;
  bool pipelined = false;
};

// What the threads of a job share: the server's resident sizes and the workers' start line.
struct TrainingRun {
  TrainingRun(pid_t server_pid, int64_t idle) : pid(server_pid), peak(idle) {}
  const pid_t pid;
  std::atomic<bool> done{false};          // Every worker has ended.
  std::atomic<int64_t> peak;              // Since the server was idle.
  std::atomic<int> started{0};            // Workers that have registered and pulled step 0.
  std::atomic<bool> go{false};            // The workers may train: `registered` is read.
  std::atomic<int64_t> registered{-1};    // Once every worker has started.
  std::atomic<int64_t> training_peak{0};  // Since then.
};

// Samples run->peak every 5 ms until run->done.
void SamplePeak(TrainingRun* run) {
  while (!run->done) {
    run->peak = std::max<int64_t>(run->peak, rubato::ResidentBytes(run->pid));
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Resident size once every worker has registered and pulled step 0 (the model is in place), and
// the peak from then on: training alone, without registration's transient.
// Workers wait after their first pull until every one has made it, and the size is read then.
void SampleTraining(int workers, TrainingRun* run) {
  while (!run->done && run->started < workers) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(200));
  run->registered = rubato::ResidentBytes(run->pid);
  run->training_peak = run->registered.load();
  run->go = true;
  while (!run->done) {
    run->training_peak = std::max<int64_t>(run->training_peak, rubato::ResidentBytes(run->pid));
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Worker `w`'s client options: the job's one server, bsp, the model's tensors t0...
rubato::PsClientOptions TrainingClientOptions(const TrainingJob& job, int w) {
  rubato::PsClientOptions options;
  options.servers = {job.address};
  options.worker_id = w;
  options.num_workers = job.workers;
  options.consistency.set_mode(rubato::BSP);
  options.steps_per_epoch = job.steps;
  options.total_steps = job.steps;
  options.max_message_bytes = int64_t{job.max_message_mb} << 20;
  for (int i = 0; i < kTensors; ++i) {
    rubato::TensorSpec spec;
    spec.set_name(absl::StrCat("t", i));
    spec.add_shape(job.elements);
    options.model.push_back(spec);
  }
  return options;
}

// One pipelined step: each tensor's push, last first, followed by its pull into `values`; every
// push started is waited for. The first error.
absl::Status PipelinedStep(rubato::PsClient* client, int step,
                           const std::vector<std::vector<float>>& grads,
                           std::vector<std::vector<float>>* values) {
  absl::Status s;
  std::vector<int64_t> tickets;
  for (int i = kTensors - 1; i >= 0 && s.ok(); --i) {
    const int tensor[] = {i};
    absl::StatusOr<int64_t> ticket = client->StartPush(step, tensor, grads, values);
    if (ticket.ok()) {
      tickets.push_back(*ticket);
    } else {
      s = ticket.status();
    }
  }
  for (int64_t t : tickets) {  // Every ticket is waited for, even after an error.
    if (absl::Status e = client->WaitPush(t, nullptr); s.ok()) s = e;
  }
  return s;
}

// Worker `w` of the job: registers, pulls step 0, waits at the start line, trains and finishes.
// Its error, or "".
std::string TrainingWorker(const TrainingJob& job, int w, TrainingRun* run) {
  auto client = rubato::CreateGrpcPsClient(TrainingClientOptions(job, w));
  if (!client.ok()) return client.status().ToString();
  std::vector<std::vector<float>> values(kTensors, std::vector<float>(job.elements, 0.5f));
  std::vector<std::vector<float>> grads(kTensors, std::vector<float>(job.elements, 0.25f));
  if (auto s = (*client)->Register(values, 1, 0); !s.ok()) return s.status().ToString();
  absl::Status s = (*client)->Pull(0, absl::MakeSpan(values));
  ++run->started;
  while (!run->go) absl::SleepFor(absl::Milliseconds(1));
  for (int step = 0; step < job.steps && s.ok(); ++step) {
    if (job.pipelined) {
      s = PipelinedStep(client->get(), step, grads, &values);
      continue;
    }
    if (step > 0) s = (*client)->Pull(step, absl::MakeSpan(values));
    if (s.ok()) s = (*client)->Push(step, grads);
  }
  if (!s.ok()) return s.ToString();
  (void)(*client)->Finish(job.steps);
  return "";
}

// One bsp job of `workers` threads on a fresh server; prints one row. `pipelined`: each worker
// pushes tensor by tensor, last first, each push followed by its pull (a worker's --overlap, the
// default), instead of one Pull and one Push per step.
void Training(int workers, const std::string& optimizer, int slots, bool pipelined) {
  const int64_t model_bytes = int64_t{absl::GetFlag(FLAGS_model_mb)} << 20;
  TrainingJob job;
  job.workers = workers;
  job.steps = absl::GetFlag(FLAGS_steps);
  job.elements = model_bytes / 4 / kTensors;
  job.max_message_mb = static_cast<int>((model_bytes >> 20) + 16);
  job.pipelined = pipelined;
  absl::StatusOr<rubato::ServerProcess> server = rubato::StartServerProcess(
      absl::GetFlag(FLAGS_server),
      {absl::StrCat("--num_workers=", workers), "--mode=bsp", "--optimizer=" + optimizer,
       "--learning_rate=0.000001", absl::StrCat("--max_message_mb=", job.max_message_mb),
       absl::StrCat("--memory_budget_mb=", absl::GetFlag(FLAGS_budget_mb))});
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return;
  }
  job.address = server->address;
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t idle = rubato::ResidentBytes(server->pid);
  TrainingRun run(server->pid, idle);
  std::thread sampler(SamplePeak, &run);
  std::thread training_sampler(SampleTraining, workers, &run);
  std::vector<std::string> errors(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] { errors[w] = TrainingWorker(job, w, &run); });
  }
  for (auto& t : threads) t.join();
  run.done = true;
  sampler.join();
  training_sampler.join();
  rubato::StopServerProcess(&*server);
  for (int w = 0; w < workers; ++w) {
    if (!errors[w].empty()) std::fprintf(stderr, "worker %d: %s\n", w, errors[w].c_str());
  }
  const int64_t peak = run.peak, registered = run.registered, training_peak = run.training_peak;
  std::printf("%-8d %-10s %-10s %8.0f M %8.0f M %8.0f M %10.2f x %10.2f x %8d x\n", workers,
              optimizer.c_str(), pipelined ? "pipelined" : "serial", MiB(idle), MiB(registered),
              MiB(peak), static_cast<double>(peak - idle) / model_bytes,
              static_cast<double>(training_peak - registered) / model_bytes, 2 + slots);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const std::string list = absl::GetFlag(FLAGS_workers); !list.empty()) {
    std::printf("bsp training, %d MB model (8 tensors), %d steps: server resident size\n",
                absl::GetFlag(FLAGS_model_mb), absl::GetFlag(FLAGS_steps));
    std::printf("%-8s %-10s %-10s %10s %10s %10s %12s %12s %10s\n", "workers", "optimizer", "loop",
                "idle", "registered", "peak", "peak-idle", "training", "bound");
    for (absl::string_view text : absl::StrSplit(list, ',')) {
      int workers = 0;
      if (!absl::SimpleAtoi(text, &workers) || workers < 1) return 2;
      for (bool pipelined : {false, true}) {
        Training(workers, "sgd", 0, pipelined);
        Training(workers, "adam", 2, pipelined);
      }
    }
    std::printf("\n");
  }
  std::printf("%-10s %-26s %10s %10s %10s  %s\n", "limit", "burst", "before", "peak", "after",
              "server's answer");
  for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_limits_mb), ',')) {
    int64_t limit_mb = 0;
    if (!absl::SimpleAtoi(text, &limit_mb)) return 2;
    absl::StatusOr<rubato::ServerProcess> server = rubato::StartServerProcess(
        absl::GetFlag(FLAGS_server),
        {"--num_workers=1", absl::StrCat("--max_message_mb=", limit_mb)});
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      return 1;
    }
    const pid_t pid = server->pid;
    const std::string address = server->address;
    auto stub = rubato::ParameterServer::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(),
        rubato::RubatoChannelArguments(rubato::kMaxMessageBytesLimit)));
    const int64_t limit = limit_mb << 20;
    for (const auto& [name, bytes] :
         {std::make_pair(std::string("4 x (limit - 64 KiB)"), limit - (64 << 10)),
          std::make_pair(std::string("4 x (4 x limit)"),
                         std::min<int64_t>(4 * limit, rubato::kMaxMessageBytesLimit - (1 << 20)))}) {
      absl::SleepFor(absl::Seconds(1));
      const int64_t before = rubato::ResidentBytes(pid);
      std::atomic<bool> done{false};
      std::atomic<int64_t> peak{before};
      std::thread sampler([&] {
        while (!done) {
          peak = std::max<int64_t>(peak, rubato::ResidentBytes(pid));
          absl::SleepFor(absl::Milliseconds(5));
        }
      });
      const std::string answer = Burst(stub.get(), 4, bytes);
      absl::SleepFor(absl::Milliseconds(200));
      done = true;
      sampler.join();
      absl::SleepFor(absl::Seconds(7));
      const int64_t after = rubato::ResidentBytes(pid);
      std::printf("%-10s %-26s %8.0f M %8.0f M %8.0f M  %s\n",
                  absl::StrCat(limit_mb, " MiB").c_str(), name.c_str(), MiB(before), MiB(peak),
                  MiB(after), answer.c_str());
      std::fflush(stdout);
    }
    rubato::StopServerProcess(&*server);
  }
  return 0;
}
