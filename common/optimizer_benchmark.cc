// optimizer_benchmark: Optimizer::Update as a memory-bound pass, in GB/s, beside memcpy, a STREAM
// triad and an in-place axpy over buffers of the same size, and a closing table of each rule's
// ratio to them.
//
//   bazel run //common:optimizer_benchmark   # everything: ~100 s on 2 cores
//   bazel run //common:optimizer_benchmark -- --benchmark_filter=/256M/ --benchmark_repetitions=3
// (with repetitions, the closing table keeps the best of them).
//
// Bytes are counted as the minimal traffic of one fused pass over the tensor, 4 bytes per float
// read or written (read w, g and each state slot; write w and each slot):
//   sgd           read w, g;        write w        12 B/element
//   sgd_momentum  read w, g, v;     write w, v     20 B/element
//   adam, adamw   read w, g, m, v;  write w, m, v  28 B/element
//   lars          as sgd_momentum                  20 B/element
//   lamb          as adam                          28 B/element
//   *_trust1      the rule with layer adaptation off (trust 1): no norms, one pass
//   memcpy        read src; write dst              2 x size
//   triad         read b, c; write a (a = b + s*c) 3 x size
//   axpy          read a, b; write a (a += s*b)    3 x size
// Write-allocate reads and the extra norm pass that lars and lamb need (their trust ratio depends
// on whole-tensor norms, so they cannot finish in one pass) are not counted. A rule that ran one
// pass at streaming speed would match the in-place axpy (ratio 1) at large sizes; well below 1
// means extra passes or element code that is compute-bound (look at the 4K row: it is in L1).
//
// The "GB/s" column is 1e9 bytes per second; google benchmark's bytes_per_second is in 2^30.
//
// "size" is the bytes of the weight tensor. threads 1 calls Update without a pool; threads n > 1
// gives Update a ThreadPool(n), which splits the tensor with ParallelFor. "256x64K" updates 256
// tensors of 64 KB each, distributing whole tensors over the pool's threads (the shard's case of
// many small tensors), each Update single-threaded.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/optimizer.h"
#include "common/thread_pool.h"

namespace rubato {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;
constexpr float kLearningRate = 1e-3f;

// Across-tensors case: many small tensors.
constexpr int kSmallTensors = 256;
constexpr int64_t kSmallTensorBytes = 64 * kKiB;

struct Rule {
  const char* name;
  int bytes_per_element;  // Minimal traffic, see the top comment.
  OptimizerConfig config;
  // False: trust ratio 1 (lars, lamb), one pass; the difference to the adaptive row is the price
  // of the norms. Such rules run single-threaded on single tensors only.
  bool layer_adaptation = true;
};

std::vector<Rule> Rules() {
  auto config = [](const char* type, double lr, double wd) {
    OptimizerConfig c;
    c.set_type(type);
    c.set_learning_rate(lr);
    c.set_weight_decay(wd);
    return c;
  };
  std::vector<Rule> rules = {
      {"sgd", 12, config("sgd", 0.01, 1e-4)},
      {"sgd_momentum", 20, config("sgd", 0.01, 1e-4)},
      {"adam", 28, config("adam", 1e-3, 1e-4)},
      {"adamw", 28, config("adamw", 1e-3, 0.01)},
      {"lars", 20, config("lars", 0.1, 1e-4)},
      {"lamb", 28, config("lamb", 1e-3, 0.01)},
      {"lars_trust1", 20, config("lars", 0.1, 1e-4), false},
      {"lamb_trust1", 28, config("lamb", 1e-3, 0.01), false},
  };
  rules[1].config.set_momentum(0.9);
  return rules;
}

std::string SizeLabel(int64_t bytes) {
  if (bytes >= kMiB && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + "M";
  if (bytes >= kKiB && bytes % kKiB == 0) return std::to_string(bytes / kKiB) + "K";
  return std::to_string(bytes);
}

// Deterministic values in [lo, hi): no denormals, no zeros in the norms.
void Fill(std::vector<float>* v, float lo, float hi, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (float& f : *v) {
    x = x * 1664525u + 1013904223u;
    f = lo + (hi - lo) * static_cast<float>(x >> 8) / static_cast<float>(1 << 24);
  }
}

std::unique_ptr<ThreadPool> MakePool(int threads) {
  return threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr;
}

// The optimizer and its buffers survive from one call of a benchmark function to the next (google
// benchmark calls it once per trial iteration count) and across thread counts, as a server keeps
// them for the whole job: allocating and faulting in 1 GB per call would dominate a 256 MB run, and
// an optimizer may keep scratch space between updates. Only one set is kept, keyed by what it was
// built for.
struct Workspace {
  std::string key;
  std::unique_ptr<Optimizer> optimizer;
  TensorRole role;
  std::vector<std::vector<float>> weights, grads;
  std::vector<TensorOptimizerState> states;

  // Updates tensors [begin, end), each on `pool` (nullptr: the calling thread).
  void Update(int64_t begin, int64_t end, ThreadPool* pool) {
    for (int64_t i = begin; i < end; ++i) {
      optimizer->Update(kLearningRate, grads[i], absl::MakeSpan(weights[i]), role, &states[i],
                        pool);
    }
  }
};

// `tensors` tensors of `bytes` each; nullptr (and an error on `state`) if the config is refused.
Workspace* PrepareWorkspace(benchmark::State& state, const Rule& rule, int tensors, int64_t bytes) {
  static Workspace* ws = new Workspace;
  const std::string key =
      std::string(rule.name) + "/" + std::to_string(tensors) + "x" + std::to_string(bytes);
  if (ws->key == key) return ws;
  *ws = Workspace();
  auto optimizer = Optimizer::Create(rule.config);
  if (!optimizer.ok()) {
    state.SkipWithError(std::string(optimizer.status().message()).c_str());
    return nullptr;
  }
  ws->optimizer = *std::move(optimizer);
  ws->role.layer_adaptation = rule.layer_adaptation;
  const size_t n = static_cast<size_t>(bytes / sizeof(float));
  ws->weights.resize(tensors);
  ws->grads.resize(tensors);
  ws->states.resize(tensors);
  for (int i = 0; i < tensors; ++i) {
    ws->weights[i].resize(n);
    ws->grads[i].resize(n);
    Fill(&ws->weights[i], -0.5f, 0.5f, 2 * i + 1);
    Fill(&ws->grads[i], -1.0f, 1.0f, 2 * i + 2);
  }
  ws->key = key;
  return ws;
}

void SetTraffic(benchmark::State& state, int64_t bytes_per_iteration) {
  const double total = static_cast<double>(state.iterations()) * bytes_per_iteration;
  state.SetBytesProcessed(static_cast<int64_t>(total));
  state.counters["GB/s"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsRate);
}

void BM_Update(benchmark::State& state, const Rule& rule, int64_t bytes, int threads) {
  Workspace* ws = PrepareWorkspace(state, rule, 1, bytes);
  if (ws == nullptr) return;
  std::unique_ptr<ThreadPool> pool = MakePool(threads);
  // Untimed: sizes the state slots and any scratch, faults their pages in, wakes the pool. Pages
  // can also be gone since the last call: the VM this was written on pages out idle memory.
  ws->Update(0, 1, pool.get());
  for (auto _ : state) {
    ws->Update(0, 1, pool.get());
    benchmark::ClobberMemory();
  }
  SetTraffic(state, bytes / static_cast<int64_t>(sizeof(float)) * rule.bytes_per_element);
}

void BM_UpdateManyTensors(benchmark::State& state, const Rule& rule, int threads) {
  Workspace* ws = PrepareWorkspace(state, rule, kSmallTensors, kSmallTensorBytes);
  if (ws == nullptr) return;
  std::unique_ptr<ThreadPool> pool = MakePool(threads);
  // Whole tensors per thread; each Update single-threaded.
  auto update = [ws](int64_t begin, int64_t end) { ws->Update(begin, end, nullptr); };
  update(0, kSmallTensors);  // Untimed, as in BM_Update.
  for (auto _ : state) {
    if (pool) {
      pool->ParallelFor(kSmallTensors, 1, update);
    } else {
      update(0, kSmallTensors);
    }
    benchmark::ClobberMemory();
  }
  SetTraffic(state, kSmallTensors * kSmallTensorBytes / static_cast<int64_t>(sizeof(float)) *
                        rule.bytes_per_element);
}

// Physical references. memcpy and triad write a buffer they do not read, which costs a
// write-allocate read of each line unless the stores bypass the cache; an optimizer updates in
// place and does not pay it. axpy (a += s*b, in place, 12 B/element) is the reference with the
// optimizers' access pattern. Chunks of at least 256 KB per thread, as a ParallelFor over a tensor
// would.
constexpr int64_t kReferenceGrainFloats = 64 * kKiB;

// Buffer `which` (0..2) of the references, `n` floats, kept across calls as the optimizers' are
// (see Workspace): the references of one size run one after another.
float* ReferenceBuffer(int which, int64_t n) {
  static auto* buffers = new std::vector<float>[3];
  std::vector<float>& b = buffers[which];
  if (static_cast<int64_t>(b.size()) != n) {
    b = std::vector<float>(n);
    Fill(&b, -1.0f, 1.0f, 7 + which);
  }
  return b.data();
}

void BM_Memcpy(benchmark::State& state, int64_t bytes, int threads) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  float* dst = ReferenceBuffer(0, n);
  const float* src = ReferenceBuffer(1, n);
  std::unique_ptr<ThreadPool> pool = MakePool(threads);
  auto copy = [&](int64_t begin, int64_t end) {
    std::memcpy(dst + begin, src + begin, (end - begin) * sizeof(float));
  };
  copy(0, n);  // Untimed, as in BM_Update.
  for (auto _ : state) {
    if (pool) {
      pool->ParallelFor(n, kReferenceGrainFloats, copy);
    } else {
      copy(0, n);
    }
    benchmark::DoNotOptimize(dst);
    benchmark::ClobberMemory();
  }
  SetTraffic(state, 2 * bytes);
}

// a[i] = b[i] + s * c[i] for i in [begin, end). GCC 12 at -O2 (bazel's -c opt) vectorises only
// loops with a fixed trip count, hence the blocks of 16.
void TriadKernel(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
                 int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    for (int j = 0; j < 16; ++j) a[i + j] = b[i + j] + s * c[i + j];
  }
  for (; i < end; ++i) a[i] = b[i] + s * c[i];
}

void BM_Triad(benchmark::State& state, int64_t bytes, int threads) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  float* a = ReferenceBuffer(0, n);
  const float* b = ReferenceBuffer(1, n);
  const float* c = ReferenceBuffer(2, n);
  std::unique_ptr<ThreadPool> pool = MakePool(threads);
  auto triad = [&](int64_t begin, int64_t end) { TriadKernel(a, b, c, 0.5f, begin, end); };
  triad(0, n);  // Untimed, as in BM_Update.
  for (auto _ : state) {
    if (pool) {
      pool->ParallelFor(n, kReferenceGrainFloats, triad);
    } else {
      triad(0, n);
    }
    benchmark::DoNotOptimize(a);
    benchmark::ClobberMemory();
  }
  SetTraffic(state, 3 * bytes);
}

// a[i] += s * b[i] for i in [begin, end), in blocks of 16 as TriadKernel.
void AxpyKernel(float* __restrict a, const float* __restrict b, float s, int64_t begin,
                int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    for (int j = 0; j < 16; ++j) a[i + j] += s * b[i + j];
  }
  for (; i < end; ++i) a[i] += s * b[i];
}

void BM_Axpy(benchmark::State& state, int64_t bytes, int threads) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  float* a = ReferenceBuffer(0, n);
  const float* b = ReferenceBuffer(1, n);
  std::unique_ptr<ThreadPool> pool = MakePool(threads);
  // Alternating signs keep a bounded however many iterations run.
  float s = 1e-3f;
  auto axpy = [&](int64_t begin, int64_t end) { AxpyKernel(a, b, s, begin, end); };
  axpy(0, n);  // Untimed, as in BM_Update.
  for (auto _ : state) {
    if (pool) {
      pool->ParallelFor(n, kReferenceGrainFloats, axpy);
    } else {
      axpy(0, n);
    }
    s = -s;
    benchmark::DoNotOptimize(a);
    benchmark::ClobberMemory();
  }
  SetTraffic(state, 3 * bytes);
}

// What each registered benchmark measures, by registered name, for the closing table.
struct Case {
  std::string kind;         // A rule name, "memcpy", "triad" or "axpy".
  std::string size;         // Label of the size ("256x64K" for the across-tensors case).
  int64_t reference_bytes;  // Size of the memcpy, triad and axpy this case is compared to.
  int threads;
  int64_t bytes_per_iteration;

  std::string Name() const { return kind + "/" + size + "/t" + std::to_string(threads); }
};

std::vector<Case>& Cases() {
  static auto* cases = new std::vector<Case>;
  return *cases;
}

template <typename Fn>
void Register(const Case& c, Fn fn) {
  Cases().push_back(c);
  benchmark::RegisterBenchmark(c.Name().c_str(), fn)->UseRealTime()->Unit(benchmark::kMicrosecond);
}

void RegisterAll() {
  const std::vector<int64_t> sizes = {4 * kKiB, 64 * kKiB, 1 * kMiB, 16 * kMiB, 256 * kMiB};
  // Splitting a tensor only pays off once it is large; the machine this was written on has 2
  // cores, so 4 threads shows the cost of oversubscription.
  auto thread_counts = [](int64_t bytes) {
    return bytes >= kMiB ? std::vector<int>{1, 2, 4} : std::vector<int>{1};
  };
  for (int64_t bytes : sizes) {
    for (int t : thread_counts(bytes)) {
      Register({"memcpy", SizeLabel(bytes), bytes, t, 2 * bytes},
               [bytes, t](benchmark::State& s) { BM_Memcpy(s, bytes, t); });
      Register({"triad", SizeLabel(bytes), bytes, t, 3 * bytes},
               [bytes, t](benchmark::State& s) { BM_Triad(s, bytes, t); });
      Register({"axpy", SizeLabel(bytes), bytes, t, 3 * bytes},
               [bytes, t](benchmark::State& s) { BM_Axpy(s, bytes, t); });
    }
  }
  // Rule-major, then size, then threads: the cached workspace is rebuilt once per rule and size.
  static const std::vector<Rule>* rules = new std::vector<Rule>(Rules());
  for (const Rule& rule : *rules) {
    const Rule* r = &rule;
    for (int64_t bytes : sizes) {
      for (int t : rule.layer_adaptation ? thread_counts(bytes) : std::vector<int>{1}) {
        Register({rule.name, SizeLabel(bytes), bytes, t, bytes / 4 * rule.bytes_per_element},
                 [r, bytes, t](benchmark::State& s) { BM_Update(s, *r, bytes, t); });
      }
    }
    if (!rule.layer_adaptation) continue;
    const int64_t total = kSmallTensors * kSmallTensorBytes;
    for (int t : {1, 2, 4}) {
      Register({rule.name, std::to_string(kSmallTensors) + "x" + SizeLabel(kSmallTensorBytes),
                total, t, total / 4 * rule.bytes_per_element},
               [r, t](benchmark::State& s) { BM_UpdateManyTensors(s, *r, t); });
    }
  }
}

// Prints runs as the console reporter does, remembers each one's GB/s, and ends with the table.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  explicit SummaryReporter(bool color) : ConsoleReporter(color ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& reports) override {
    ConsoleReporter::ReportRuns(reports);
    for (const Run& r : reports) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred || r.iterations == 0) continue;
      const double seconds_per_iteration = r.real_accumulated_time / r.iterations;
      auto [it, inserted] = best_seconds_.emplace(r.run_name.function_name, seconds_per_iteration);
      if (!inserted) it->second = std::min(it->second, seconds_per_iteration);
    }
  }

  void PrintSummary() const {
    // GB/s of each reference by (size, threads).
    const std::vector<std::string> references = {"memcpy", "triad", "axpy"};
    std::map<std::string, std::map<std::pair<int64_t, int>, double>> reference_gbs;
    for (const Case& c : Cases()) {
      const double gbs = GBs(c);
      if (gbs > 0) reference_gbs[c.kind][{c.reference_bytes, c.threads}] = gbs;
    }
    std::printf("\n%-13s %-8s %7s %8s", "optimizer", "size", "threads", "GB/s");
    for (const std::string& r : references) std::printf(" %9s", ("x " + r).c_str());
    std::printf("\n");
    for (const Case& c : Cases()) {
      const double gbs = GBs(c);
      if (gbs <= 0) continue;
      std::printf("%-13s %-8s %7d %8.2f", c.kind.c_str(), c.size.c_str(), c.threads, gbs);
      for (const std::string& r : references) {
        const auto& by_size = reference_gbs[r];
        auto it = by_size.find({c.reference_bytes, c.threads});
        if (it == by_size.end()) {
          std::printf(" %9s", "-");
        } else {
          std::printf(" %9.2f", gbs / it->second);
        }
      }
      std::printf("\n");
    }
  }

 private:
  // Best of the repetitions (--benchmark_repetitions), as STREAM reports: on a shared machine the
  // noise only ever slows a run down. 0 if the case did not run (filtered out or failed).
  double GBs(const Case& c) const {
    auto it = best_seconds_.find(c.Name());
    if (it == best_seconds_.end() || it->second <= 0) return 0;
    return c.bytes_per_iteration * 1e-9 / it->second;
  }

  // Fastest real time per iteration of each benchmark, by registered name.
  std::map<std::string, double> best_seconds_;
};

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  // A reporter passed to RunSpecifiedBenchmarks ignores --benchmark_color: decide here.
  bool color = isatty(STDOUT_FILENO);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--benchmark_color=", 0) == 0) {
      const std::string value = arg.substr(arg.find('=') + 1);
      color = value == "true" || value == "yes" || value == "1" || (value == "auto" && color);
    }
  }
  // A short default minimum time keeps the whole run under two minutes on 2 cores; a
  // --benchmark_min_time given on the command line comes later and wins.
  std::vector<char*> args(argv, argv + argc);
  static char default_min_time[] = "--benchmark_min_time=0.1";
  args.insert(args.begin() + 1, default_min_time);
  int args_count = static_cast<int>(args.size());
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) return 1;
  rubato::RegisterAll();
  rubato::SummaryReporter reporter(color);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintSummary();
  benchmark::Shutdown();
  return 0;
}
