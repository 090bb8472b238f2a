// Checkpoint benchmark: what checkpointing costs one parameter-server shard, for 1, 16 and 64 MB of
// parameters (8 tensors, Adam: a checkpoint holds weights and two moments, 3x the model).
//
//   bazel run //experiments:checkpoint_benchmark [-- --sizes_mb=1,16,64 --steps=60 --every=10
//                                                   --dir=/tmp/rubato-ckpt-bench]
//
// For each size, in one process: a shard of 2 workers is driven through --steps bsp steps with
// gradients pushed in process (the zero-copy API, no network), first without checkpoints, then
// with one every --every steps written by the server's background writer (server/
// checkpoint_writer.h) into --dir. It prints the step time both ways (the slowdown is what
// training pays: the capture's copy of the optimizer state and the weights' copy-on-write, plus
// whatever the writer's thread takes from the same cores), that cost per checkpoint written, how
// many were written (a capture that arrives while the previous one is still being written replaces
// the waiting one), and the last write's time and rate, next to the physical bound measured in the
// same run: writing and fsyncing a file of the same size with plain write() calls ("disk MB/s").
// The shard alone keeps both cores busy here; in a job, the step also waits for the network.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/tensor_wire.h"
#include "server/checkpoint_writer.h"
#include "server/parameter_shard.h"

ABSL_FLAG(std::vector<std::string>, sizes_mb, std::vector<std::string>({"1", "16", "64"}),
          "Model sizes in MiB.");
ABSL_FLAG(int, steps, 60, "Steps per measurement.");
ABSL_FLAG(int, every, 10, "Checkpoint every this many steps in the second measurement.");
ABSL_FLAG(std::string, dir, "/tmp/rubato-checkpoint-benchmark",
          "Where checkpoints are written (emptied first).");

namespace rubato {
namespace {

constexpr int kWorkers = 2;
constexpr int kTensors = 8;

// What Run measured.
struct Measured {
  double step_ms = 0;
  CheckpointWriter::Counts counts;
};

// A shard of kWorkers workers in bsp with Adam, leases and waits of ten minutes, and no
// checkpoints.
ShardOptions BenchmarkShardOptions() {
  ShardOptions options;
  options.cluster.set_num_workers(kWorkers);
  options.cluster.mutable_consistency()->set_mode(BSP);
  options.cluster.mutable_optimizer()->set_type("adam");
  options.cluster.mutable_optimizer()->set_learning_rate(1e-3);
  options.cluster.set_lease_ms(600000);
  options.cluster.set_wait_timeout_ms(600000);
  return options;
}

// The bytes of one tensor of `per_tensor` floats: the initial values, and every step's gradient.
std::string TensorBytes(int64_t per_tensor) {
  std::string values(per_tensor * 4, '\0');
  for (int64_t i = 0; i < per_tensor; ++i) {
    const float v = 0.001f * static_cast<float>(i % 1000);
    std::memcpy(values.data() + 4 * i, &v, 4);
  }
  return values;
}

// Registers every worker with the model's kTensors tensors, worker 0 with their initial `values`.
void RegisterWorkers(ParameterShard* shard, int64_t per_tensor, const std::string& values) {
  for (int w = 0; w < kWorkers; ++w) {
    RegisterRequest r;
    r.set_worker_id(w);
    r.set_num_workers(kWorkers);
    r.mutable_consistency()->set_mode(BSP);
    r.set_batch_size(64);
    for (int t = 0; t < kTensors; ++t) {
      TensorSpec* spec = r.add_model();
      spec->set_name(absl::StrCat("t", t));
      spec->add_shape(per_tensor);
      if (w == 0) {
        TensorValue* v = r.add_initial_values();
        v->set_name(spec->name());
        v->set_data(values);
      }
    }
    if (!shard->Register(r).ok()) std::abort();
  }
}

// Step `s`: every worker pushes `gradient` for every tensor, one worker after the other.
void PushStep(ParameterShard* shard, int64_t s, const ByteChunks& gradient) {
  for (int w = 0; w < kWorkers; ++w) {
    WirePush push;
    push.worker_id = w;
    push.step = s;
    for (int t = 0; t < kTensors; ++t) {
      WireTensor g;
      g.name = absl::StrCat("t", t);
      g.data = gradient;
      push.gradients.push_back(std::move(g));
    }
    absl::Notification done;
    shard->Push(push, nullptr, [&](absl::StatusOr<PushResponse> r) {
      if (!r.ok()) {
        std::fprintf(stderr, "push failed: %s\n", r.status().ToString().c_str());
        std::abort();
      }
      done.Notify();
    });
    done.WaitForNotification();
  }
}

// `steps` steps of a model of `mb` MiB after a warm-up step, with a checkpoint every `every` steps
// written into `dir` (0: none): the mean step time, and the writer's counts.
Measured Run(int64_t mb, int steps, int every, const std::string& dir) {
  const int64_t per_tensor = (mb << 20) / 4 / kTensors;
  ShardOptions options = BenchmarkShardOptions();
  std::unique_ptr<CheckpointWriter> writer;
  CheckpointWriter* writer_ptr = nullptr;
  if (every > 0) {
    options.checkpoint_every_steps = every;
    options.on_checkpoint = [&writer_ptr](std::shared_ptr<const CapturedCheckpoint> c) {
      writer_ptr->Submit(std::move(c));
    };
  }
  std::unique_ptr<ParameterShard> shard = *ParameterShard::Create(options);
  if (every > 0) {
    ParameterShard* raw = shard.get();
    writer = std::make_unique<CheckpointWriter>(
        dir, 2, [raw](const CapturedCheckpoint& c) { return raw->CheckpointProto(c); });
    writer_ptr = writer.get();
  }
  const std::string values = TensorBytes(per_tensor);
  RegisterWorkers(shard.get(), per_tensor, values);
  // The same gradient bytes every step, pushed as views.
  const ByteChunks gradient{absl::string_view(values)};
  PushStep(shard.get(), 0, gradient);  // Warm-up: first touches.
  const absl::Time start = absl::Now();
  for (int64_t s = 1; s <= steps; ++s) PushStep(shard.get(), s, gradient);
  Measured m;
  m.step_ms = absl::ToDoubleMilliseconds(absl::Now() - start) / steps;
  if (writer != nullptr) {
    writer->Idle(absl::Minutes(5));
    m.counts = writer->counts();
  }
  writer_ptr = nullptr;
  shard.reset();
  return m;
}

// Seconds to write and fsync `bytes` with plain write() calls: the disk's bound.
double PlainWriteSeconds(const std::string& dir, int64_t bytes) {
  const std::string path = dir + "/plain-write.bin";
  std::string buffer(std::min<int64_t>(bytes, 8 << 20), 'x');
  const absl::Time start = absl::Now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  for (int64_t left = bytes; left > 0;) {
    const ssize_t n = ::write(fd, buffer.data(), std::min<int64_t>(left, buffer.size()));
    if (n <= 0) break;
    left -= n;
  }
  ::fsync(fd);
  ::close(fd);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  ::unlink(path.c_str());
  return seconds;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_every);
  std::printf("%-6s %11s %11s %9s %11s %10s %10s %11s %9s %15s\n", "model", "step ms off",
              "step ms on", "slowdown", "ckpt MB", "write ms", "write MB/s", "disk MB/s", "written",
              "ms/checkpoint");
  for (const std::string& text : absl::GetFlag(FLAGS_sizes_mb)) {
    int64_t mb = 0;
    if (!absl::SimpleAtoi(text, &mb) || mb < 1) {
      std::fprintf(stderr, "checkpoint_benchmark: bad --sizes_mb entry '%s'\n", text.c_str());
      return 2;
    }
    const rubato::Measured off = rubato::Run(mb, steps, 0, dir);
    const rubato::Measured on = rubato::Run(mb, steps, every, dir);
    const double plain = rubato::PlainWriteSeconds(dir, on.counts.last_bytes);
    const double extra_ms = (on.step_ms - off.step_ms) * steps;
    std::printf("%-6s %11.2f %11.2f %8.1f%% %11.1f %10.0f %10.0f %11.0f %4lld of %-3d %15.0f\n",
                absl::StrCat(mb, "MB").c_str(), off.step_ms, on.step_ms,
                100.0 * (on.step_ms / off.step_ms - 1), on.counts.last_bytes / 1e6,
                on.counts.last_seconds * 1e3, on.counts.last_bytes / on.counts.last_seconds / 1e6,
                on.counts.last_bytes / plain / 1e6, static_cast<long long>(on.counts.written),
                steps / every, on.counts.written > 0 ? extra_ms / on.counts.written : 0.0);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
