// rubato_worker: one data-parallel worker. Loads its shard of Fashion-MNIST, registers with every
// parameter-server shard, and runs pull -> forward/backward -> push for the configured steps.
//
//   rubato_worker --worker_id=0 --servers=127.0.0.1:5000 --num_workers=2 --model=cnn
//
// Progress goes to stdout as JSON lines; logs and the one-line error on failure go to stderr.
// Exit status: 0 done; 1 runtime failure (unreachable server, timeout, model or job mismatch), with
// the status code in the message; 2 bad flag values or data; 3 the crash asked for by
// --crash_at_step. (Abseil's flag parser itself exits 1 for an unknown flag.)
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/cluster_flags.h"
#include "common/cluster_spec.h"
#include "common/grpc_options.h"
#include "common/health.h"
#include "common/isa_dispatch.h"
#include "common/log.h"
#include "common/malloc_tuning.h"
#include "common/parse_flags.h"
#include "common/placement.h"
#include "common/progress_writer.h"
#include "common/security.h"
#include "common/security_flags.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"
#include "worker/local_rank.h"
#include "worker/model/cuda/cuda_backend.h"
#include "worker/model/cuda/cuda_device.h"
#include "worker/model/mlp.h"
#include "worker/model/model_backend.h"
#include "worker/model/model_file.h"
#include "worker/model/model_spec.h"
#include "worker/model/sharpness.h"
#include "worker/ps/heartbeats.h"
#include "worker/ps/ps_client.h"
#include "worker/push_buckets.h"
#include "worker/ring/allreduce_client.h"
#include "worker/straggler_flags.h"
#include "worker/straggler_model.h"
#include "worker/training_loop.h"
#include "worker/work_feed.h"
#include "worker/worker_records.h"

ABSL_FLAG(int, worker_id, -1, "This worker's rank in [0, num_workers). Required.");
ABSL_FLAG(std::string, data_dir, rubato::kFashionMnistDefaultDir, "Fashion-MNIST IDX directory.");
ABSL_FLAG(std::string, model, "mlp:784-256-10",
          "The model: mlp:IN-HIDDEN...-CLASSES (dense layers with ReLU), cnn (two 5x5 "
          "convolutions with max-pooling, then two dense layers; 454,922 parameters), or "
          "resnet[:N] (a residual CNN, three stages of N blocks (default 3: ResNet-20-like, "
          "345,642 parameters), without batch normalisation).");
ABSL_FLAG(std::string, layers, "",
          "Old spelling of --model=mlp:LAYERS, e.g. 784-256-10; not together with --model.");
ABSL_FLAG(int, compute_threads, 1,
          "cpu backend: threads for the GEMMs (0: one per core). Mind other workers on the host.");
ABSL_FLAG(int, cuda_device, -1,
          "cuda backend: the device's index; -1 (default) takes the local rank (--local_rank) "
          "mod the number of devices, so that the workers on a host with several GPUs spread "
          "over them.");
ABSL_FLAG(int, local_rank, -1,
          "This worker's rank among the job's processes on its host (./rubato launch sets it); "
          "-1: the first set of LOCAL_RANK (./rubato launch, torchrun), SLURM_LOCALID (srun), "
          "OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH, Intel MPI); else the "
          "worker id. Picks the GPU with --cuda_device -1.");
ABSL_FLAG(bool, overlap, true,
          "Push each layer's gradients as soon as its backward pass is done, overlapping "
          "communication with the rest of backprop (false: one push after the whole step).");
ABSL_FLAG(bool, comm_thread, true,
          "With --overlap: start each push (and on a GPU wait for its gradients' copy to the "
          "host) on a communication thread, so the compute thread never encodes a push or waits "
          "on the network during the backward pass (false: from the compute thread).");
ABSL_FLAG(bool, layerwise_forward, true,
          "With --overlap: start the next step's forward pass before its weights have all "
          "arrived, each layer waiting for its own pull (false: wait for every pull first).");
ABSL_FLAG(int64_t, push_bucket_kb, rubato::kDefaultPushBucketKb,
          "With --overlap: gather consecutive layers' gradients into one push until it holds at "
          "least this many KiB, as DDP's buckets do (0: push every layer alone; a layer larger "
          "than this goes alone).");
ABSL_FLAG(int, batch_size, 64, "Examples per step on this worker.");
ABSL_FLAG(int, epochs, 3, "Passes over the training set (all workers together).");
ABSL_FLAG(int64_t, steps, 0, "Steps to run; overrides --epochs when > 0.");
ABSL_FLAG(int64_t, eval_every, 0, "Evaluate every this many steps (default: twice per epoch).");
ABSL_FLAG(int64_t, log_every, 20, "Emit a progress record every this many steps.");
ABSL_FLAG(int64_t, train_limit, 0, "Use only the first N training examples (0: all).");
ABSL_FLAG(int64_t, test_limit, 0, "Evaluate on the first N test examples (0: all).");
ABSL_FLAG(bool, eval_all_workers, false,
          "Under bsp every worker holds the same weights at every step, so only worker 0 evaluates "
          "the test set (its eval records, and test_loss and test_accuracy in its done record); "
          "true: every worker does. In the other modes every worker evaluates.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the weight initialisation and the data order.");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: cpu (Eigen), cuda (cuBLAS; refused with the reason where no CUDA "
          "device or cuBLAS is usable), or auto (cuda when usable, else cpu).");
ABSL_FLAG(std::string, listen, "",
          "allreduce: host:port this rank's ring server binds (default: its own --peers entry), "
          "e.g. 0.0.0.0:6000 when the others reach it by a Service name or through NAT.");
ABSL_FLAG(std::string, export_model, "",
          "At the end of the job, worker 0 writes the trained model here (worker/model/model_file.h: "
          "the --model spec and its named tensors), atomically.");
ABSL_FLAG(std::string, summary_file, "",
          "At the end of the job, worker 0 writes the job's summary here, atomically: one JSON "
          "object {\"start\": its start record, \"done\": its done record} (the model, mode, "
          "steps, batch, final test accuracy and loss, wall time; proto/progress.proto). Its "
          "directory is made if missing.");
ABSL_FLAG(std::string, records_file, "",
          "Also append every progress record (the JSON lines on stdout) to this file, so that "
          "they outlive the process's log (a Kubernetes pod's is deleted with it).");
ABSL_FLAG(std::string, eval_model, "",
          "Evaluate this exported model on the test set (--data_dir, --test_limit, --backend) and "
          "exit; no servers or other workers are needed.");
ABSL_FLAG(std::string, sharpness, "",
          "Compute the epsilon-sharpness (Keskar et al. 2017) of this exported model on the first "
          "--sharpness_examples training examples and exit (worker/model/sharpness.h).");
ABSL_FLAG(std::string, sharpness_epsilon, "1e-3,5e-4",
          "--sharpness: the box sizes, comma-separated (the paper reports 1e-3 and 5e-4).");
ABSL_FLAG(int, sharpness_steps, 10, "--sharpness: projected gradient-ascent steps.");
ABSL_FLAG(int64_t, sharpness_examples, 10000,
          "--sharpness: training examples the loss is taken over (the first ones).");
ABSL_FLAG(std::string, ps_transport, "auto",
          "How Push and Pull travel to the parameter servers. auto: over a shard's TCP data "
          "plane where it offers one (TLS with --tls_*, as gRPC), falling back to gRPC where its "
          "port cannot be reached; grpc: always over gRPC (for example behind a proxy in front of "
          "the gRPC "
          "port, which the data connection would bypass).");
ABSL_FLAG(std::string, ring_transport, "auto",
          "allreduce: how blocks travel between ranks. tcp: a plain TCP data connection set up "
          "through the authenticated gRPC service (fast; not encrypted); grpc: on a gRPC stream "
          "(TLS encrypts it); auto: tcp, or grpc when TLS is on. Every rank must use the same.");
ABSL_FLAG(int32_t, ring_data_port, 0,
          "allreduce with the tcp transport: the port of this rank's data listener, on the host of "
          "its --listen (or --peers) address; 0 picks a free one. Fix it where a firewall must "
          "let it through.");
ABSL_FLAG(int64_t, ring_spin_us, absl::ToInt64Microseconds(rubato::kDefaultRingReceiveSpin),
          "allreduce with the tcp transport: how long a rank waiting for a block polls its socket "
          "(yielding the core between polls) before it sleeps until the block comes, in "
          "microseconds; 0 sleeps at once. Spinning skips a wake-up per block (1 MB all-reduces "
          "ran faster with the default, 200); lower it where ranks share cores with other work.");
ABSL_FLAG(std::string, health_listen, "",
          "Serve the gRPC health service, and nothing else, in plaintext on this host:port (for "
          "Kubernetes probes). SERVING from start-up until the worker exits.");
ABSL_FLAG(int64_t, connect_timeout_ms, 30000,
          "How long to wait at start for unreachable servers (allreduce: for the ring's "
          "connections to both neighbouring ranks, with --ring_transport=tcp).");
ABSL_FLAG(int64_t, retry_timeout_ms, 30000,
          "How long a pull or push retries a shard that became unreachable (a network cut, a "
          "reset connection) before the worker fails naming it.");
ABSL_FLAG(std::string, reassign_replay, "",
          "With --reassign: take this worker's units from the unit records in this file (a "
          "run's worker progress lines) instead of from shard 0, replaying that assignment.");
ABSL_FLAG(int64_t, server_restart_timeout_s, -1,
          "How long to wait for a lost shard to be restarted (it then restores its checkpoint "
          "and the worker registers again) before failing: sets --retry_timeout_ms, and "
          "--connect_timeout_ms when larger. -1: those flags as given.");

namespace {

constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

// Largest shard's bytes over the mean: 1 is a perfect balance.
double MaxOverMean(const std::vector<int64_t>& bytes) {
  rubato::Placement placement;
  placement.shard_bytes = bytes;
  return placement.imbalance();
}

// The --backend: cpu, cuda (a clear error where no device or cuBLAS is usable), or auto (cuda when
// a device is usable, else cpu, saying why in the log). The CUDA device is --cuda_device, or
// `local_rank` (FindLocalRank, worker/local_rank.h) mod the number of devices.
absl::StatusOr<std::unique_ptr<rubato::ModelBackend>> CreateBackend(const std::string& name,
                                                                    const rubato::ModelSpec& spec,
                                                                    int threads, int local_rank,
                                                                    int device) {
  if (name == "cuda" || name == "auto") {
    absl::StatusOr<std::unique_ptr<rubato::ModelBackend>> cuda =
        absl::UnavailableError("no usable CUDA device");
    if (absl::StatusOr<rubato::CudaDevices> gpus = rubato::ProbeCudaDevices(); !gpus.ok()) {
      cuda = gpus.status();
    } else {
      if (device < 0) device = local_rank % gpus->count;
      cuda = rubato::CreateCudaBackend(spec, device);
    }
    if (cuda.ok()) return cuda;
    if (absl::IsInvalidArgument(cuda.status())) {  // a bad --cuda_device: never a silent fallback
      return absl::InvalidArgumentError(absl::StrCat("--cuda_device: ", cuda.status().message()));
    }
    if (name == "cuda") {
      return absl::Status(
          cuda.status().code(),
          absl::StrCat("--backend=cuda: ", cuda.status().message(), " (",
                       rubato::CudaBuildDescription(), "); use --backend=cpu on this host"));
    }
    RUBATO_LOG(INFO) << "--backend=auto: using the CPU (" << cuda.status().message() << ")";
  }
  return rubato::CreateCpuBackend(spec, threads);
}

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "rubato_worker: error: %s\n", message.c_str());
  return code;
}

// An exported model, a split of the data it must fit, and a backend to run it (--eval_model,
// --sharpness). Every failure is a usage error naming what is wrong.
struct ModelOnData {
  rubato::LoadedModel model;
  rubato::Dataset data;
  std::unique_ptr<rubato::ModelBackend> backend;
};

absl::StatusOr<ModelOnData> LoadModelOnData(const std::string& path, rubato::Split split,
                                            int64_t limit) {
  ModelOnData m;
  ASSIGN_OR_RETURN(m.model, rubato::LoadModel(path));
  ASSIGN_OR_RETURN(m.data, rubato::LoadFashionMnist(absl::GetFlag(FLAGS_data_dir), split, limit));
  const rubato::ModelSpec& spec = m.model.spec;
  if (spec.input.size() != m.data.dim || rubato::ModelNumClasses(spec) != m.data.num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": model '", m.model.file.model(), "' takes ", spec.input.size(),
                     " inputs and ", rubato::ModelNumClasses(spec), " classes; the data has ",
                     m.data.dim, " and ", m.data.num_classes));
  }
  ASSIGN_OR_RETURN(m.backend, CreateBackend(absl::GetFlag(FLAGS_backend), spec,
                                            absl::GetFlag(FLAGS_compute_threads), 0,
                                            absl::GetFlag(FLAGS_cuda_device)));
  return m;
}

// --eval_model: the exported model's test loss and accuracy, as one JSON line.
int EvalModel(const std::string& path) {
  rubato::SetLogTag("eval");
  absl::StatusOr<ModelOnData> m =
      LoadModelOnData(path, rubato::Split::kTest, absl::GetFlag(FLAGS_test_limit));
  if (!m.ok()) return Fail(kExitUsage, std::string(m.status().message()));
  const rubato::LoadedModel* loaded = &m->model;
  const rubato::Dataset* test = &m->data;
  rubato::ModelBackend* backend = m->backend.get();
  std::vector<absl::Span<const float>> spans(loaded->params.begin(), loaded->params.end());
  absl::StatusOr<rubato::EvalResult> r =
      backend->Evaluate(spans, test->features.data(), test->labels.data(), test->size);
  if (!r.ok()) return Fail(kExitRuntime, r.status().ToString());
  rubato::WriteProgress(std::cout,
                        rubato::EvalModelProgress(path, loaded->file, backend->name(), *r));
  return 0;
}

// --sharpness: the exported model's epsilon-sharpness on training examples, one JSON line per
// epsilon.
int Sharpness(const std::string& path) {
  rubato::SetLogTag("sharpness");
  std::vector<double> epsilons;
  for (absl::string_view e : absl::StrSplit(absl::GetFlag(FLAGS_sharpness_epsilon), ',')) {
    double v = 0;
    if (!absl::SimpleAtod(e, &v) || !(v > 0) || !std::isfinite(v)) {
      return Fail(kExitUsage, absl::StrCat("--sharpness_epsilon: '", e,
                                           "' is not a positive number (give e.g. 1e-3,5e-4)"));
    }
    epsilons.push_back(v);
  }
  const int steps = absl::GetFlag(FLAGS_sharpness_steps);
  const int64_t examples = absl::GetFlag(FLAGS_sharpness_examples);
  if (steps < 1 || examples < 1) {
    return Fail(kExitUsage, "--sharpness_steps and --sharpness_examples must be >= 1");
  }
  absl::StatusOr<ModelOnData> m = LoadModelOnData(path, rubato::Split::kTrain, examples);
  if (!m.ok()) return Fail(kExitUsage, std::string(m.status().message()));
  const rubato::LoadedModel* loaded = &m->model;
  const rubato::Dataset* train = &m->data;
  rubato::ModelBackend* backend = m->backend.get();
  // The mean loss over the examples and its gradient, in chunks whose gradients are averaged by
  // their share of the examples.
  constexpr int64_t kChunk = 1000;
  std::vector<std::vector<float>> chunk_grads;
  for (const auto& p : loaded->params) chunk_grads.emplace_back(p.size());
  rubato::LossAndGradient loss =
      [&](absl::Span<const std::vector<float>> params,
          std::vector<std::vector<float>>* grads) -> absl::StatusOr<double> {
    std::vector<absl::Span<const float>> in(params.begin(), params.end());
    std::vector<absl::Span<float>> out(chunk_grads.begin(), chunk_grads.end());
    grads->assign(params.size(), {});
    for (size_t t = 0; t < params.size(); ++t) (*grads)[t].assign(params[t].size(), 0.0f);
    double total = 0;
    for (int64_t first = 0; first < train->size; first += kChunk) {
      const int64_t n = std::min(kChunk, train->size - first);
      absl::StatusOr<float> l = backend->ForwardBackward(
          in, train->features.data() + first * train->dim, train->labels.data() + first, n, out);
      if (!l.ok()) return l.status();
      const double share = static_cast<double>(n) / train->size;
      total += *l * share;
      for (size_t t = 0; t < params.size(); ++t) {
        float* g = (*grads)[t].data();
        const float* c = chunk_grads[t].data();
        for (size_t i = 0; i < chunk_grads[t].size(); ++i) g[i] += static_cast<float>(c[i] * share);
      }
    }
    return total;
  };
  for (double eps : epsilons) {
    absl::StatusOr<rubato::SharpnessResult> r =
        rubato::EpsilonSharpness(loaded->params, loss, {eps, steps});
    if (!r.ok()) return Fail(kExitRuntime, r.status().ToString());
    rubato::WriteProgress(
        std::cout, rubato::SharpnessProgress(path, loaded->file, eps, steps, train->size, *r));
  }
  return 0;
}

// A failure of main's, with the exit status it ends with.
struct Exit {
  int code;
  std::string message;
};

// The range checks of the flags that need nothing else; an error names them.
absl::Status CheckFlags() {
  if (const int b = absl::GetFlag(FLAGS_batch_size); b < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--batch_size must be >= 1, got ", b));
  }
  if (absl::GetFlag(FLAGS_epochs) < 1 && absl::GetFlag(FLAGS_steps) <= 0) {
    return absl::InvalidArgumentError("--epochs must be >= 1 (or give --steps)");
  }
  if (const int64_t kb = absl::GetFlag(FLAGS_push_bucket_kb); kb < 0 || kb > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--push_bucket_kb must be in [0, 2^30], got ", kb));
  }
  if (absl::GetFlag(FLAGS_steps) < 0 || absl::GetFlag(FLAGS_eval_every) < 0 ||
      absl::GetFlag(FLAGS_log_every) < 1 || absl::GetFlag(FLAGS_train_limit) < 0 ||
      absl::GetFlag(FLAGS_test_limit) < 0 || absl::GetFlag(FLAGS_connect_timeout_ms) < 1 ||
      absl::GetFlag(FLAGS_retry_timeout_ms) < 0 ||
      absl::GetFlag(FLAGS_server_restart_timeout_s) < -1 ||
      absl::GetFlag(FLAGS_server_restart_timeout_s) > 86400) {
    return absl::InvalidArgumentError(
        "--steps, --eval_every, --train_limit, --test_limit and --retry_timeout_ms must be "
        ">= 0, --log_every and --connect_timeout_ms >= 1, --server_restart_timeout_s -1 "
        "to 86400");
  }
  if (const std::string b = absl::GetFlag(FLAGS_backend);
      b != "cpu" && b != "cuda" && b != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend: unknown backend '", b, "' (available: auto, cpu, cuda)"));
  }
  if (absl::GetFlag(FLAGS_compute_threads) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compute_threads must be >= 0, got ", absl::GetFlag(FLAGS_compute_threads)));
  }
  return absl::OkStatus();
}

// The model --model (or its old spelling --layers) names, and how to name it in messages.
struct ModelChoice {
  rubato::ModelSpec spec;
  std::string flag;  // "--model mlp:784-256-10"
  std::string text;  // "mlp:784-256-10"
};

absl::StatusOr<ModelChoice> ModelFromFlags() {
  ModelChoice m;
  m.flag = "--model " + absl::GetFlag(FLAGS_model);
  m.text = absl::GetFlag(FLAGS_model);
  if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
    if (m.text != "mlp:784-256-10") {
      return absl::InvalidArgumentError("give --model or its old spelling --layers, not both");
    }
    m.flag = "--layers " + layers;
    m.text = "mlp:" + layers;
  }
  absl::StatusOr<rubato::ModelSpec> spec = rubato::ParseModelSpec(m.text);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(m.flag.substr(0, m.flag.find(' ')), ": ", spec.status().message()));
  }
  m.spec = *std::move(spec);
  return m;
}

// The job's length from --steps, or --epochs over `train_examples`.
rubato::JobLength LengthFromFlags(int batch_size, int num_workers, int64_t train_examples) {
  return rubato::JobLengthOf(batch_size, num_workers, train_examples, absl::GetFlag(FLAGS_steps),
                             absl::GetFlag(FLAGS_epochs));
}

rubato::PsClientOptions ClientOptionsFromFlags(const rubato::ClusterSpec& cluster, int worker_id,
                                               const rubato::JobLength& job,
                                               const rubato::ModelSpec& spec,
                                               const rubato::ClientSecurity& security) {
  rubato::PsClientOptions o;
  o.servers.assign(cluster.servers().begin(), cluster.servers().end());
  o.worker_id = worker_id;
  o.num_workers = cluster.num_workers();
  o.consistency = cluster.consistency();
  o.steps_per_epoch = job.steps_per_epoch;
  o.total_steps = job.steps;
  for (const rubato::ParamSpec& p : rubato::ModelParamSpecs(spec)) {
    rubato::TensorSpec t;
    t.set_name(p.name);
    for (int64_t d : p.shape) t.add_shape(d);
    o.model.push_back(std::move(t));
  }
  o.connect_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_connect_timeout_ms));
  // Past the servers' own wait timeout, so that their error (naming whom they waited for) arrives.
  o.rpc_timeout = absl::Milliseconds(cluster.wait_timeout_ms()) + absl::Seconds(10);
  o.retry_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_retry_timeout_ms));
  if (const int64_t restart = absl::GetFlag(FLAGS_server_restart_timeout_s); restart >= 0) {
    o.retry_timeout = absl::Seconds(restart);
    o.connect_timeout = std::max(o.connect_timeout, absl::Seconds(restart));
  }
  o.heartbeat_timeout = absl::Milliseconds(std::clamp<int64_t>(cluster.lease_ms() / 4, 100, 5000));
  o.security = security;
  o.max_message_bytes = rubato::MaxMessageBytes(cluster);
  o.use_data_plane = absl::GetFlag(FLAGS_ps_transport) != "grpc";
  return o;
}

// allreduce: no servers, a ring all-reduce among the workers; wait_timeout_ms bounds each one.
absl::StatusOr<std::unique_ptr<rubato::PsClient>> CreateRingClient(
    const rubato::ClusterSpec& cluster, int worker_id, const rubato::PsClientOptions& client,
    const rubato::SecurityConfig& security, Exit* failure) {
  rubato::AllReduceOptions ring;
  ring.rank = worker_id;
  ring.cluster = cluster;
  ring.listen = absl::GetFlag(FLAGS_listen);
  ASSIGN_OR_RETURN(ring.transport, rubato::ParseRingTransport(absl::GetFlag(FLAGS_ring_transport)));
  ring.data_port = absl::GetFlag(FLAGS_ring_data_port);
  if (ring.data_port < 0 || ring.data_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_data_port must be 0..65535, not ", ring.data_port));
  }
  const int64_t spin_us = absl::GetFlag(FLAGS_ring_spin_us);
  if (spin_us < 0 || spin_us > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_spin_us must be 0..100000, not ", spin_us));
  }
  ring.receive_spin = absl::Microseconds(spin_us);
  if (!ring.listen.empty()) RETURN_IF_ERROR(rubato::ValidateHostPort(ring.listen, "--listen"));
  ring.model = client.model;
  ring.steps_per_epoch = client.steps_per_epoch;
  ring.total_steps = client.total_steps;
  ring.timeout = absl::Milliseconds(cluster.wait_timeout_ms());
  ring.connect_timeout = client.connect_timeout;
  ASSIGN_OR_RETURN(ring.server_security, rubato::ServerSecurity::Create(security));
  ring.client_security = client.security;
  RUBATO_LOG(INFO) << "ring peer " << cluster.workers(worker_id)
                   << (ring.listen.empty() ? "" : absl::StrCat(" (listening on ", ring.listen, ")"))
                   << ": " << ring.server_security.Describe();
  absl::StatusOr<std::unique_ptr<rubato::PsClient>> created = rubato::CreateAllReduceClient(ring);
  if (!created.ok()) *failure = {kExitRuntime, created.status().ToString()};
  return created;
}

// --export_model (worker 0): the trained model and what it scored.
absl::Status ExportIfAsked(int worker_id, const rubato::ClusterSpec& cluster,
                           const rubato::JobLength& job, const ModelChoice& model,
                           const rubato::TrainingResult& result,
                           const std::vector<std::vector<float>>& params) {
  const std::string path = absl::GetFlag(FLAGS_export_model);
  if (path.empty() || worker_id != 0) return absl::OkStatus();
  rubato::ModelFile about;
  about.set_steps(result.steps);
  about.set_mode(rubato::FormatConsistency(cluster.consistency()));
  about.set_num_workers(cluster.num_workers());
  // The last step's (an adaptive batch changes it).
  about.set_global_batch(result.final_batch > 0
                             ? int64_t{result.final_batch} * cluster.num_workers()
                             : job.global_batch);
  about.set_optimizer(cluster.optimizer().type());
  about.set_test_accuracy(result.test.accuracy);
  about.set_test_loss(result.test.loss);
  about.set_test_examples(result.test.examples);
  RETURN_IF_ERROR(rubato::MakeParentDirectory(path));
  RETURN_IF_ERROR(rubato::ExportModel(path, model.text, model.spec, params, about));
  RUBATO_LOG(INFO) << "model exported to " << path;
  return absl::OkStatus();
}

// --summary_file: worker 0's start and done records as one JSON object, written atomically.
absl::Status WriteSummaryIfAsked(int worker_id, const rubato::ProgressRecord& start,
                                 const rubato::ProgressRecord& done) {
  const std::string path = absl::GetFlag(FLAGS_summary_file);
  if (path.empty() || worker_id != 0) return absl::OkStatus();
  RETURN_IF_ERROR(rubato::MakeParentDirectory(path));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"start\":" << rubato::ProgressLine(start)
        << ",\"done\":" << rubato::ProgressLine(done) << "}\n";
    if (!out.flush()) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to --summary_file ", path,
                                               ": ", std::strerror(errno)));
  }
  RUBATO_LOG(INFO) << "summary written to " << path;
  return absl::OkStatus();
}

// A worker that dies without a word to the servers: no error status, no "done" record.
void InjectedCrash(int64_t step) {
  std::cout.flush();
  std::fflush(nullptr);
  std::fprintf(stderr, "rubato_worker: injected crash at step %lld\n",
               static_cast<long long>(step));
  std::_Exit(3);
}

// Everything a training run needs, set up from the flags in place (the batcher points into the
// training set, the backend at the model: not copied or moved once set up).
struct Setup {
  rubato::ClusterSpec cluster;
  int worker_id = 0;
  int batch_size = 0;
  ModelChoice model;
  std::optional<rubato::StragglerModel> straggler;
  std::optional<rubato::Dataset> train;
  rubato::Dataset test;  // Empty when this worker does not evaluate.
  bool evaluates = false;
  std::optional<rubato::ShardedBatcher> batcher;
  // --reassign: the job's data in units, handed out to this worker by the feed.
  std::optional<rubato::UnitBatcher> units;
  std::unique_ptr<rubato::WorkFeed> feed;
  rubato::JobLength job;
  std::unique_ptr<rubato::ModelBackend> backend;
  std::unique_ptr<rubato::PsClient> client;
};

// The data: this worker's shard of the training set, and the test set where it evaluates (under
// bsp only worker 0, unless --eval_all_workers).
absl::Status LoadData(Setup* s) {
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  ASSIGN_OR_RETURN(s->train, rubato::LoadFashionMnist(data_dir, rubato::Split::kTrain,
                                                      absl::GetFlag(FLAGS_train_limit)));
  s->evaluates = rubato::WorkerEvaluates(s->worker_id, s->cluster.consistency().mode(),
                                         absl::GetFlag(FLAGS_eval_all_workers));
  if (s->evaluates) {
    ASSIGN_OR_RETURN(s->test, rubato::LoadFashionMnist(data_dir, rubato::Split::kTest,
                                                       absl::GetFlag(FLAGS_test_limit)));
  }
  const rubato::ModelSpec& spec = s->model.spec;
  if (spec.input.size() != s->train->dim ||
      rubato::ModelNumClasses(spec) != s->train->num_classes) {
    return absl::InvalidArgumentError(absl::StrCat(
        s->model.flag, " needs ", spec.input.size(), " inputs and ", rubato::ModelNumClasses(spec),
        " classes; the data has ", s->train->dim, " and ", s->train->num_classes));
  }
  ASSIGN_OR_RETURN(
      s->batcher, rubato::ShardedBatcher::Create(&*s->train, s->worker_id, s->cluster.num_workers(),
                                                 s->batch_size, absl::GetFlag(FLAGS_seed)));
  s->job = LengthFromFlags(s->batch_size, s->cluster.num_workers(), s->train->size);
  // A pause or crash past the end would silently not happen.
  const rubato::StragglerOptions& o = s->straggler->options();
  for (const auto& [flag, at] : {std::make_pair("pause_at_step", o.pause_at_step),
                                 std::make_pair("crash_at_step", o.crash_at_step)}) {
    if (at.has_value() && *at >= s->job.steps) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be < the job's ", s->job.steps, " steps, got ", *at));
    }
  }
  return absl::OkStatus();
}

// --reassign: the job's data in units, handed out by shard 0 or replayed from --reassign_replay.
absl::Status SetUpReassign(Setup* s) {
  const int unit_batches = s->cluster.reassign().unit_batches();
  if (unit_batches == 0) {
    if (!absl::GetFlag(FLAGS_reassign_replay).empty()) {
      return absl::InvalidArgumentError("--reassign_replay needs --reassign");
    }
    return absl::OkStatus();
  }
  if (absl::GetFlag(FLAGS_steps) > 0) {
    return absl::InvalidArgumentError(
        "--reassign hands out whole epochs: give --epochs, not --steps");
  }
  ASSIGN_OR_RETURN(s->units,
                   rubato::UnitBatcher::Create(&*s->train, s->cluster.num_workers(), s->batch_size,
                                               unit_batches, absl::GetFlag(FLAGS_seed)));
  const std::string replay = absl::GetFlag(FLAGS_reassign_replay);
  if (replay.empty()) {
    s->feed = rubato::ServerWorkFeed(s->client.get(), &*s->units, s->worker_id,
                                     absl::GetFlag(FLAGS_epochs));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(s->feed, rubato::ReplayWorkFeed(replay, &*s->units, s->worker_id));
  return absl::OkStatus();
}

// Reads and checks the flags, loads the data, creates the backend and the client. A usage error
// exits kExitUsage, a ring that cannot be set up kExitRuntime.
absl::Status SetUp(Setup* setup, Exit* failure) {
  Setup& s = *setup;
  RETURN_IF_ERROR(CheckFlags());
  ASSIGN_OR_RETURN(s.cluster, rubato::ClusterSpecFromFlags(/*need_servers=*/true));
  s.worker_id = absl::GetFlag(FLAGS_worker_id);
  if (s.worker_id < 0 || s.worker_id >= s.cluster.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker_id must be in [0, num_workers=", s.cluster.num_workers(), "), got ",
                     s.worker_id));
  }
  rubato::SetLogTag(absl::StrCat("worker-", s.worker_id));
  s.batch_size = absl::GetFlag(FLAGS_batch_size);
  const rubato::SecurityConfig security = rubato::SecurityConfigFromFlags();
  ASSIGN_OR_RETURN(const rubato::ClientSecurity client_security,
                   rubato::ClientSecurity::Create(security, s.worker_id));
  ASSIGN_OR_RETURN(const rubato::StragglerOptions straggler,
                   rubato::StragglerOptionsFromFlags(s.worker_id, s.cluster.num_workers()));
  ASSIGN_OR_RETURN(s.straggler, rubato::StragglerModel::Create(straggler, s.worker_id));
  ASSIGN_OR_RETURN(s.model, ModelFromFlags());
  RETURN_IF_ERROR(LoadData(&s));
  ASSIGN_OR_RETURN(const rubato::LocalRank local,
                   rubato::FindLocalRank(absl::GetFlag(FLAGS_local_rank), s.worker_id,
                                         [](const char* name) { return std::getenv(name); }));
  const int local_rank = local.rank;
  RUBATO_LOG(INFO) << "local rank " << local_rank << " (from " << local.source << "); "
                   << rubato::IsaNote();
  ASSIGN_OR_RETURN(s.backend, CreateBackend(absl::GetFlag(FLAGS_backend), s.model.spec,
                                            absl::GetFlag(FLAGS_compute_threads), local_rank,
                                            absl::GetFlag(FLAGS_cuda_device)));
  const rubato::PsClientOptions client =
      ClientOptionsFromFlags(s.cluster, s.worker_id, s.job, s.model.spec, client_security);
  if (s.cluster.consistency().mode() == rubato::ALLREDUCE) {
    ASSIGN_OR_RETURN(s.client, CreateRingClient(s.cluster, s.worker_id, client, security, failure));
  } else {
    ASSIGN_OR_RETURN(s.client, rubato::CreateGrpcPsClient(client));
  }
  return SetUpReassign(&s);
}

// The loop's options for this setup, starting at `start_step`.
rubato::TrainingOptions LoopOptions(Setup* s, int64_t start_step) {
  const rubato::ConsistencyMode mode = s->cluster.consistency().mode();
  rubato::TrainingOptions options;
  options.worker_id = s->worker_id;
  options.steps = s->job.steps;
  options.eval_every = absl::GetFlag(FLAGS_eval_every);
  if (options.eval_every == 0) options.eval_every = rubato::DefaultEvalEvery(s->job);
  options.log_every = absl::GetFlag(FLAGS_log_every);
  options.clip_global_norm = s->cluster.optimizer().clip_global_norm();
  options.start_step = start_step;
  // backup:b, and the partial all-reduce: steps applied without this worker are skipped. The
  // partial all-reduce's rounds (steps) go on until they carry the gradients of job.steps
  // synchronous steps, at most one round per gradient; the client says when they end.
  const bool partial = mode == rubato::ALLREDUCE &&
                       s->cluster.consistency().allreduce_quorum() != rubato::QUORUM_ALL;
  const bool adaptive = mode == rubato::ADAPTIVE;  // bsp or backup:b, step by step
  options.skip_to_current_version = mode == rubato::BACKUP || adaptive || partial;
  if (partial) options.steps = s->job.steps * s->cluster.num_workers();
  options.rewind_on_rejoin = mode == rubato::BSP || mode == rubato::BACKUP || adaptive;
  if (s->straggler->enabled()) options.straggler = &*s->straggler;
  options.on_injected_crash = InjectedCrash;
  options.overlap = absl::GetFlag(FLAGS_overlap);
  options.comm_thread = absl::GetFlag(FLAGS_comm_thread);
  options.layerwise_forward = absl::GetFlag(FLAGS_layerwise_forward);
  options.push_bucket_bytes = absl::GetFlag(FLAGS_push_bucket_kb) << 10;
  options.adaptive_batch = s->cluster.adaptive_batch().max_global_batch() > 0;
  options.num_workers = s->cluster.num_workers();
  options.train_examples = s->train->size;
  if (s->feed != nullptr) {
    // At most every batch of every unit of every epoch, should this worker draw them all.
    const std::vector<int64_t>& units = s->units->units_per_worker();
    options.work = s->feed.get();
    options.steps = std::accumulate(units.begin(), units.end(), int64_t{0}) *
                    s->cluster.reassign().unit_batches() * absl::GetFlag(FLAGS_epochs);
  }
  return options;
}

// Registers, trains, tells the servers it finished, and writes the done record; returns the
// exit status.
int Train(Setup* s) {
  rubato::PsClient* client = s->client.get();
  std::vector<std::vector<float>> params =
      rubato::InitModelParams(s->model.spec, absl::GetFlag(FLAGS_seed));
  absl::StatusOr<int64_t> start_step = client->Register(params, s->batch_size, /*resume_step=*/0);
  if (!start_step.ok()) return Fail(kExitRuntime, start_step.status().ToString());
  RUBATO_LOG(INFO) << "registered with " << s->cluster.servers_size() << " shard(s) ["
                   << absl::StrJoin(client->shard_bytes(), ",") << "] bytes (max/mean "
                   << MaxOverMean(client->shard_bytes()) << "); model " << s->model.text << " ("
                   << rubato::ModelParamCount(s->model.spec) << " parameters), backend "
                   << s->backend->name() << ", shard of " << s->batcher->shard_size()
                   << " examples, " << s->job.steps << " steps";
  if (s->straggler->enabled()) {
    RUBATO_LOG(INFO) << "straggler injection: " << s->straggler->Describe();
  }
  rubato::TrainingOptions options = LoopOptions(s, *start_step);
  std::string no_overlap_reason;
  const bool overlap = rubato::OverlapEnabled(options, *client, &no_overlap_reason);
  if (!overlap) {
    RUBATO_LOG(INFO) << "pushes not overlapped with backprop: " << no_overlap_reason;
  } else {
    RUBATO_LOG(INFO) << "pushes overlapped with backprop, started from "
                     << (options.comm_thread ? "a communication thread" : "the compute thread")
                     << (options.layerwise_forward ? ", forward pass waiting layer by layer" : "");
  }
  const rubato::ProgressRecord start_record = rubato::StartProgress(
      s->worker_id, s->job, s->batch_size, s->model.text, rubato::ModelParamCount(s->model.spec),
      s->backend->name(), overlap, rubato::FormatConsistency(s->cluster.consistency()),
      s->batcher->shard_size());
  rubato::WriteProgress(std::cout, start_record);
  std::atomic<int64_t> current_step{*start_step};
  options.current_step = &current_step;
  absl::StatusOr<rubato::TrainingResult> result;
  {
    rubato::Heartbeats heartbeats(client, s->cluster.lease_ms(), &current_step);
    result = rubato::RunTraining(options, s->model.spec, client, s->backend.get(), &*s->batcher,
                                 s->test, &params, &std::cout);
  }
  if (!result.ok()) return Fail(kExitRuntime, result.status().ToString());
  // The servers stop expecting this worker and end once every worker has finished. Training is
  // done either way: a shard that does not hear it drops this worker after its lease instead.
  if (absl::Status st = client->Finish(result->steps); !st.ok()) {
    RUBATO_LOG(WARNING) << "could not tell every shard that this worker finished: " << st;
  }
  const rubato::ProgressRecord done_record =
      rubato::DoneProgress(s->worker_id, *result, params, s->evaluates);
  rubato::WriteProgress(std::cout, done_record);
  if (absl::Status st = ExportIfAsked(s->worker_id, s->cluster, s->job, s->model, *result, params);
      !st.ok()) {
    return Fail(kExitRuntime, std::string(st.message()));
  }
  if (absl::Status st = WriteSummaryIfAsked(s->worker_id, start_record, done_record); !st.ok()) {
    return Fail(kExitRuntime, std::string(st.message()));
  }
  RUBATO_LOG(INFO) << "done: " << result->computed_steps << " of " << result->steps
                   << " steps computed here (" << result->skipped_steps << " skipped) in "
                   << result->wall_seconds << " s"
                   << (s->evaluates ? absl::StrCat(", test accuracy ", result->test.accuracy)
                                    : std::string(" (worker 0 evaluates)"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  rubato::ExecIsaVariant(argv);  // The AVX2 build, where it can run (common/isa_dispatch.h).
  rubato::UseGrpcExperiments();  // Before anything of gRPC's runs.
  absl::SetProgramUsageMessage("One Rubato worker. Its flags: docs/flags.md (or --helpfull).");
  std::vector<char*> rest = rubato::ParseFlagsOrExit(argc, argv);
  rubato::KeepFreedMemory();  // Tensor-sized buffers every step: reuse them, do not re-fault them.
  rubato::SkipMutexDeadlockDetection();
  if (rest.size() > 1) return Fail(kExitUsage, absl::StrCat("unexpected argument '", rest[1], "'"));
  if (const std::string t = absl::GetFlag(FLAGS_ps_transport); t != "auto" && t != "grpc") {
    return Fail(kExitUsage, absl::StrCat("--ps_transport=", t, " is not auto or grpc"));
  }
  std::unique_ptr<rubato::CopyStreamTo> records_copy;
  if (const std::string path = absl::GetFlag(FLAGS_records_file); !path.empty()) {
    auto copy = rubato::CopyStreamTo::Open(&std::cout, path);
    if (!copy.ok()) return Fail(kExitUsage, absl::StrCat("--records_file: ", copy.status().message()));
    records_copy = std::move(*copy);
  }
  if (const std::string path = absl::GetFlag(FLAGS_eval_model); !path.empty()) {
    return EvalModel(path);
  }
  if (const std::string path = absl::GetFlag(FLAGS_sharpness); !path.empty()) {
    return Sharpness(path);
  }
  // Probes see this worker from the start: SERVING while it runs.
  rubato::HealthService health_service;
  std::unique_ptr<grpc::Server> health;
  if (const std::string address = absl::GetFlag(FLAGS_health_listen); !address.empty()) {
    if (auto st = rubato::ValidateHostPort(address, "--health_listen"); !st.ok()) {
      return Fail(kExitUsage, std::string(st.message()));
    }
    auto started = rubato::StartHealthServer(address, &health_service);
    if (!started.ok()) return Fail(kExitUsage, std::string(started.status().message()));
    health = std::move(*started);
  }
  Exit failure{kExitUsage, ""};
  Setup setup;
  if (absl::Status st = SetUp(&setup, &failure); !st.ok()) {
    return Fail(failure.code,
                failure.message.empty() ? std::string(st.message()) : failure.message);
  }
  return Train(&setup);
}
