// shard_fuzzer: a libFuzzer harness over ParameterShard (server/parameter_shard.h), the state
// machine behind every parameter-server RPC.
//
// Each input is a serialized rubato.fuzz.ShardFuzzCase (fuzz/fuzz_case.proto); one that does not
// parse is skipped. The harness builds a shard for the case's job (1..4 workers, pulls that wait at
// most 1 ms, a 1 s lease or a very short one; under bsp, tensors kept in parts of 0 to 4 elements),
// optionally registers every worker with a small valid model first, then replays the actions
// (gradients pushed whole or part by part) through Register, Push, Pull, Heartbeat, Finish,
// TakeWork and Stats, exactly as ParameterService would hand them over from the network. After
// each action it checks what the contract promises and is cheap to check:
//   - Stats(): tensor versions never decrease; applied_updates is the sum of the versions; bytes
//   and
//     min_version agree with the tensors; pushes + rejected_pushes counts every Push call; the
//     duplicate and dropped counters add up to what the Push responses said, and the staleness
//     histogram holds one record per (worker, step, tensor) with an accepted gradient or part
//     (exactly, while every push was accepted whole or not at all; else at most one per accepted
//     value);
//   - Push: accepted + duplicates + dropped is the number of gradients sent;
//   - a push through the service's entry point (GradientPush.as_service): done is called exactly
//     once (checked after the shard is destroyed; a held gradient's push may answer late, with
//     DEADLINE_EXCEEDED, or with UNAVAILABLE at shutdown), and an OK answer accounts for every
//     gradient; the counters are then no longer compared with the answers;
//   - Pull: done is called exactly once (checked after the shard is destroyed), never with the
//     shard's lock held (it calls Stats() from inside), and an OK response has the tensors asked
//     for, each with 4 bytes per element and, under bsp and backup, a version >= the step;
//   - Register: an OK response describes the shard's job.
// The counters are compared with the answers only while no update has been refused (an update
// that would overflow the weights fails its push after the push's other gradients were taken).
// A broken invariant aborts with a message (a crash for libFuzzer).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/tensor_wire.h"
#include "fuzz/fuzz_case.pb.h"
#include "fuzz/fuzz_check.h"
#include "proto/cluster.pb.h"
#include "proto/parameter_server.pb.h"
#include "server/parameter_shard.h"

namespace rubato {
namespace fuzz {
namespace {

constexpr int64_t kMaxFilledElements = 1 << 16;  // fill_initial_values: larger models are left.
constexpr int64_t kMaxGradientElements = 1 << 16;
constexpr uint32_t kMaxSleepUs = 2000;
constexpr uint32_t kMaxTotalSleepUs = 5000;

// The small model of start_ready and use_ready_model: a 3x2 layer, its bias and a scalar.
struct ReadyTensor {
  const char* name;
  std::vector<int64_t> shape;
};
const std::vector<ReadyTensor>& ReadyModel() {
  static const auto* model =
      new std::vector<ReadyTensor>{{"dense.weight", {3, 2}}, {"dense.bias", {2}}, {"scale", {}}};
  return *model;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Floats(int64_t n, const google::protobuf::RepeatedField<float>& values, float base) {
  std::string bytes(static_cast<size_t>(n) * sizeof(float), '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float v = values.empty() ? base + 0.01f * static_cast<float>(i)
                                   : values[static_cast<int>(i % values.size())];
    std::memcpy(&bytes[static_cast<size_t>(i) * sizeof(float)], &v, sizeof(float));
  }
  return bytes;
}

void UseReadyModel(RegisterRequest* request) {
  request->clear_model();
  request->clear_initial_values();
  const google::protobuf::RepeatedField<float> none;
  for (const ReadyTensor& t : ReadyModel()) {
    TensorSpec* spec = request->add_model();
    spec->set_name(t.name);
    for (int64_t d : t.shape) spec->add_shape(d);
    TensorValue* value = request->add_initial_values();
    value->set_name(t.name);
    *value->mutable_data() = Floats(Elements(t.shape), none, 0.5f);
  }
}

// Right-sized initial values for `request`'s model, if it is small and well-formed.
void FillInitialValues(RegisterRequest* request) {
  int64_t total = 0;
  for (const TensorSpec& spec : request->model()) {
    int64_t n = 1;
    for (int64_t d : spec.shape()) {
      if (d < 1 || d > kMaxFilledElements || n * d > kMaxFilledElements) return;
      n *= d;
    }
    total += n;
    if (total > kMaxFilledElements) return;
  }
  request->clear_initial_values();
  const google::protobuf::RepeatedField<float> none;
  for (const TensorSpec& spec : request->model()) {
    TensorValue* value = request->add_initial_values();
    value->set_name(spec.name());
    *value->mutable_data() =
        Floats(Elements(std::vector<int64_t>(spec.shape().begin(), spec.shape().end())), none, 1);
  }
}

// What the harness knows of the shard between actions: from Stats() and the calls' answers.
struct Expected {
  std::map<std::string, int64_t> versions;  // Highest version seen per tensor.
  int64_t push_calls = 0;
  int64_t accepted = 0;
  int64_t duplicates = 0;
  int64_t dropped = 0;
  // Pushes through the service's entry point answer later (or when the shard shuts down), so once
  // there has been one, the counters are no longer compared with the answers seen so far.
  bool answers_pending = false;
  // (worker, step, tensor) of every gradient or part accepted, from the pushes all of whose values
  // were; once a push's were accepted only in part, which ones is unknown (records_exact false).
  std::set<std::tuple<int, int64_t, std::string>> accepted_gradients;
  bool records_exact = true;
};

// Records the answers of pushes made through the service's entry point.
struct PushLog {
  absl::Mutex mu;
  std::vector<int> calls ABSL_GUARDED_BY(mu);  // Per push: times done was called.
};

// Records every Pull's completions; shared with the done callbacks, which may outlive the replay
// loop (they run until the shard is destroyed).
struct PullLog {
  absl::Mutex mu;
  std::vector<int> calls ABSL_GUARDED_BY(mu);  // Per pull: times done was called.
};

void CheckStats(const GetStatsResponse& s, const ClusterSpec& cluster, int shard_id,
                Expected* expected) {
  FUZZ_CHECK(s.shard_id() == shard_id, absl::StrCat(s.shard_id()));
  FUZZ_CHECK(s.num_workers() == cluster.num_workers(), absl::StrCat(s.num_workers()));
  FUZZ_CHECK(s.reassigned_units() >= 0 && s.reassigned_units() <= s.work_units(),
             absl::StrCat(s.reassigned_units(), " of ", s.work_units()));
  int64_t sum_versions = 0, bytes = 0;
  int64_t min_version = s.tensors().empty() ? 0 : s.tensors(0).version();
  for (const TensorStats& t : s.tensors()) {
    FUZZ_CHECK(t.elements() >= 1, t.name());
    FUZZ_CHECK(t.version() >= 0, t.name());
    auto [it, inserted] = expected->versions.emplace(t.name(), t.version());
    FUZZ_CHECK(inserted || t.version() >= it->second,
               absl::StrCat("tensor '", t.name(), "' went from version ", it->second, " to ",
                            t.version()));
    it->second = t.version();
    sum_versions += t.version();
    bytes += 4 * t.elements();
    min_version = std::min(min_version, t.version());
  }
  FUZZ_CHECK(expected->versions.size() == static_cast<size_t>(s.tensors_size()),
             "the set of tensors changed");
  FUZZ_CHECK(s.applied_updates() == sum_versions,
             absl::StrCat(s.applied_updates(), " updates applied, versions sum to ", sum_versions));
  FUZZ_CHECK(s.bytes() == bytes, absl::StrCat(s.bytes(), " vs ", bytes));
  FUZZ_CHECK(s.min_version() == min_version, absl::StrCat(s.min_version(), " vs ", min_version));
  FUZZ_CHECK(s.pushes() + s.rejected_pushes() == expected->push_calls,
             absl::StrCat(s.pushes(), " + ", s.rejected_pushes(), " vs ", expected->push_calls));
  FUZZ_CHECK(s.staleness_histogram_size() == 8, absl::StrCat(s.staleness_histogram_size()));
  int64_t recorded = 0;
  for (int64_t n : s.staleness_histogram()) {
    FUZZ_CHECK(n >= 0, absl::StrCat(n));
    recorded += n;
  }
  // A push some of whose updates were refused (values that would overflow the weights) is
  // answered with an error after its other gradients were taken: the counters then run ahead of
  // what the answers said.
  FUZZ_CHECK(s.refused_updates() >= 0, absl::StrCat(s.refused_updates()));
  if (!expected->answers_pending && s.refused_updates() == 0) {
    FUZZ_CHECK(s.duplicate_gradients() == expected->duplicates,
               absl::StrCat(s.duplicate_gradients(), " vs ", expected->duplicates));
    FUZZ_CHECK(s.dropped_gradients() == expected->dropped,
               absl::StrCat(s.dropped_gradients(), " vs ", expected->dropped));
    // Every accepted gradient records its staleness once, a gradient in parts once.
    if (expected->records_exact) {
      FUZZ_CHECK(recorded == static_cast<int64_t>(expected->accepted_gradients.size()),
                 absl::StrCat(recorded, " staleness records vs ",
                              expected->accepted_gradients.size(), " gradients accepted"));
    } else {
      FUZZ_CHECK(recorded <= expected->accepted,
                 absl::StrCat(recorded, " staleness records vs ", expected->accepted,
                              " gradients or parts accepted"));
    }
  }
  FUZZ_CHECK(s.pending_pulls() >= 0, absl::StrCat(s.pending_pulls()));
  for (const WorkerStats& w : s.workers()) {
    FUZZ_CHECK(w.worker_id() >= 0 && w.worker_id() < cluster.num_workers(),
               absl::StrCat(w.worker_id()));
  }
}

void Trace(const char* what, int worker, const absl::Status& status,
           const std::string& detail = "") {
  if (!Verbose()) return;
  std::fprintf(stderr, "shard_fuzzer: %s by worker %d: %s %s\n", what, worker,
               status.ToString().c_str(), detail.c_str());
}

// The shard's tensor names and element counts, in GetStats order.
std::vector<std::pair<std::string, int64_t>> TensorList(const GetStatsResponse& s) {
  std::vector<std::pair<std::string, int64_t>> list;
  for (const TensorStats& t : s.tensors()) list.emplace_back(t.name(), t.elements());
  return list;
}

ClusterSpec JobOf(const ShardFuzzCase& c) {
  ClusterSpec cluster = c.cluster();
  cluster.clear_servers();
  cluster.clear_workers();
  cluster.set_num_workers(std::clamp(cluster.num_workers(), 1, 4));
  FillClusterSpecDefaults(&cluster);
  cluster.set_wait_timeout_ms(1);
  cluster.set_lease_ms(c.short_lease_ms() >= 1 && c.short_lease_ms() <= 5 ? c.short_lease_ms()
                                                                          : 1000);
  return cluster;
}

void RunCase(const ShardFuzzCase& c) {
  ShardOptions options;
  options.cluster = JobOf(c);
  options.num_shards = std::clamp(c.num_shards(), 1, 4);
  options.shard_id = static_cast<int>(static_cast<uint32_t>(c.shard_id()) %
                                      static_cast<uint32_t>(options.num_shards));
  options.update_threads = std::clamp(c.update_threads(), 1, 2);
  options.part_elements = c.part_elements() % 5;
  const int64_t part_elements = options.part_elements;
  absl::StatusOr<std::unique_ptr<ParameterShard>> created = ParameterShard::Create(options);
  if (!created.ok()) {
    if (Verbose()) std::fprintf(stderr, "shard_fuzzer: %s\n", created.status().ToString().c_str());
    return;
  }
  std::unique_ptr<ParameterShard> shard = std::move(*created);
  const ClusterSpec& cluster = options.cluster;
  const ConsistencyMode mode = cluster.consistency().mode();
  const bool barrier = mode == BSP || mode == BACKUP;

  Expected expected;
  auto pulls = std::make_shared<PullLog>();
  auto pushes = std::make_shared<PushLog>();
  uint32_t slept_us = 0;

  auto check_register = [&](const absl::StatusOr<RegisterResponse>& r) {
    if (!r.ok()) return;
    FUZZ_CHECK(r->num_workers() == cluster.num_workers(), absl::StrCat(r->num_workers()));
    FUZZ_CHECK(r->shard_id() == options.shard_id, absl::StrCat(r->shard_id()));
    FUZZ_CHECK(r->num_shards() == options.num_shards, absl::StrCat(r->num_shards()));
    FUZZ_CHECK(r->lease_ms() == cluster.lease_ms(), absl::StrCat(r->lease_ms()));
    FUZZ_CHECK(r->min_version() >= 0, absl::StrCat(r->min_version()));
  };
  auto job_request = [&](RegisterRequest* request) {
    request->set_num_workers(cluster.num_workers());
    *request->mutable_consistency() = cluster.consistency();
  };

  if (c.start_ready()) {
    for (int w = 0; w < cluster.num_workers(); ++w) {
      RegisterRequest request;
      request.set_worker_id(w);
      job_request(&request);
      request.set_batch_size(8);
      request.set_steps_per_epoch(10);
      request.set_total_steps(1000);
      UseReadyModel(&request);
      const absl::StatusOr<RegisterResponse> r = shard->Register(request);
      Trace("start_ready: register", w, r.status());
      check_register(r);
    }
  }

  for (const ShardAction& action : c.actions()) {
    switch (action.action_case()) {
      case ShardAction::kRegisterWorker: {
        const RegisterAction& a = action.register_worker();
        RegisterRequest request = a.request();
        if (a.use_shard_job()) job_request(&request);
        if (a.use_ready_model()) {
          UseReadyModel(&request);
        } else if (a.fill_initial_values()) {
          FillInitialValues(&request);
        }
        const absl::StatusOr<RegisterResponse> r = shard->Register(request);
        Trace("register", request.worker_id(), r.status());
        check_register(r);
        break;
      }
      case ShardAction::kPush:
      case ShardAction::kGradientPush: {
        PushRequest request;
        if (action.has_push()) {
          request = action.push();
        } else {
          const GradientPush& g = action.gradient_push();
          request.set_worker_id(g.worker_id());
          request.set_step(g.step());
          request.set_batch_size(g.batch_size());
          if (g.has_noise_relay()) *request.mutable_noise_relay() = g.noise_relay();
          const auto tensors = TensorList(shard->Stats());
          for (int k = 0; k < g.tensors_size(); ++k) {
            if (tensors.empty()) break;
            const auto& [name, elements] = tensors[g.tensors(k) % tensors.size()];
            if (elements > kMaxGradientElements) continue;
            TensorValue* gradient = request.add_gradients();
            gradient->set_name(name);
            int64_t offset = 0, count = elements;
            if (k < g.parts_size() && g.parts(k) >= 0 && part_elements > 0) {
              const int64_t parts = (elements + part_elements - 1) / part_elements;
              offset = (g.parts(k) % parts) * part_elements;
              count = std::min(part_elements, elements - offset);
            }
            gradient->set_offset(offset);
            *gradient->mutable_data() = Floats(count, g.values(), 0);
          }
        }
        ++expected.push_calls;
        if (action.has_gradient_push() && action.gradient_push().as_service()) {
          // As ParameterService hands it over: views into a message kept alive by the shard.
          auto message = std::make_shared<PushRequest>(request);
          auto wire = std::make_shared<WirePush>();
          wire->worker_id = message->worker_id();
          wire->step = message->step();
          wire->batch_size = message->batch_size();
          if (message->has_noise_relay()) wire->noise_relay = message->noise_relay();
          for (const TensorValue& g : message->gradients()) {
            WireTensor t;
            t.name = g.name();
            t.data = ByteChunks(g.data());
            t.offset = g.offset();
            wire->gradients.push_back(std::move(t));
          }
          std::shared_ptr<const void> keepalive =
              std::make_shared<std::pair<std::shared_ptr<PushRequest>, std::shared_ptr<WirePush>>>(
                  message, wire);
          size_t index;
          {
            absl::MutexLock lock(&pushes->mu);
            index = pushes->calls.size();
            pushes->calls.push_back(0);
          }
          expected.answers_pending = true;
          const int gradients = request.gradients_size();
          const int worker = request.worker_id();
          shard->Push(*wire, std::move(keepalive),
                      [pushes, index, gradients, worker](absl::StatusOr<PushResponse> r) {
                        {
                          absl::MutexLock lock(&pushes->mu);
                          ++pushes->calls[index];
                        }
                        Trace("push (service) done", worker, r.status(),
                              r.ok() ? r->ShortDebugString() : std::string());
                        if (!r.ok()) return;
                        FUZZ_CHECK(
                            r->accepted() + r->duplicates() + r->dropped() == gradients,
                            absl::StrCat(r->DebugString(), " for ", gradients, " gradients"));
                      });
          break;
        }
        absl::StatusOr<PushResponse> r = shard->Push(request);
        Trace("push", request.worker_id(), r.status(),
              r.ok() ? r->ShortDebugString() : std::string());
        if (r.ok()) {
          FUZZ_CHECK(r->accepted() >= 0 && r->duplicates() >= 0 && r->dropped() >= 0,
                     r->DebugString());
          FUZZ_CHECK(
              r->accepted() + r->duplicates() + r->dropped() == request.gradients_size(),
              absl::StrCat(r->DebugString(), " for ", request.gradients_size(), " gradients"));
          FUZZ_CHECK(r->max_staleness() >= 0, r->DebugString());
          expected.accepted += r->accepted();
          if (r->accepted() == request.gradients_size()) {
            for (const TensorValue& g : request.gradients()) {
              expected.accepted_gradients.emplace(request.worker_id(), request.step(), g.name());
            }
          } else if (r->accepted() > 0) {
            expected.records_exact = false;
          }
          expected.duplicates += r->duplicates();
          expected.dropped += r->dropped();
        }
        break;
      }
      case ShardAction::kPull: {
        const PullAction& a = action.pull();
        PullRequest request = a.request();
        const auto tensors = TensorList(shard->Stats());
        for (uint32_t i : a.tensors()) {
          if (!tensors.empty()) request.add_names(tensors[i % tensors.size()].first);
        }
        std::map<std::string, int64_t> elements(tensors.begin(), tensors.end());
        size_t index;
        {
          absl::MutexLock lock(&pulls->mu);
          index = pulls->calls.size();
          pulls->calls.push_back(0);
        }
        ParameterShard* raw = shard.get();
        shard->Pull(request, absl::Now(),
                    [pulls, index, request, elements = std::move(elements), barrier, raw](
                        absl::Status status, PullResponse response) {
                      {
                        absl::MutexLock lock(&pulls->mu);
                        ++pulls->calls[index];
                      }
                      Trace("pull done", request.worker_id(), status,
                            absl::StrCat("step ", request.step(), ", ", response.tensors_size(),
                                         " tensors"));
                      // Deadlocks (a hang, reported as a timeout) if the shard's lock is held.
                      raw->Stats();
                      if (!status.ok()) return;
                      if (request.names().empty()) {
                        FUZZ_CHECK(response.tensors_size() == static_cast<int>(elements.size()),
                                   absl::StrCat(response.tensors_size(), " tensors"));
                      } else {
                        FUZZ_CHECK(response.tensors_size() == request.names_size(),
                                   absl::StrCat(response.tensors_size(), " tensors for ",
                                                request.names_size(), " names"));
                      }
                      for (int i = 0; i < response.tensors_size(); ++i) {
                        const TensorValue& t = response.tensors(i);
                        if (!request.names().empty()) {
                          FUZZ_CHECK(t.name() == request.names(i), t.name());
                        }
                        auto it = elements.find(t.name());
                        FUZZ_CHECK(it != elements.end(), t.name());
                        FUZZ_CHECK(static_cast<int64_t>(t.data().size()) == 4 * it->second,
                                   absl::StrCat(t.name(), ": ", t.data().size(), " bytes"));
                        if (barrier) {
                          FUZZ_CHECK(t.version() >= request.step(),
                                     absl::StrCat(t.name(), " at version ", t.version(),
                                                  " answered a pull for step ", request.step()));
                        }
                      }
                    });
        break;
      }
      case ShardAction::kHeartbeat: {
        absl::StatusOr<HeartbeatResponse> r = shard->Heartbeat(action.heartbeat());
        Trace("heartbeat", action.heartbeat().worker_id(), r.status());
        if (r.ok()) FUZZ_CHECK(r->min_version() >= 0, absl::StrCat(r->min_version()));
        break;
      }
      case ShardAction::kFinish: {
        absl::StatusOr<FinishResponse> r = shard->Finish(action.finish());
        Trace("finish", action.finish().worker_id(), r.status());
        if (r.ok()) {
          FUZZ_CHECK(r->finished_workers() >= 1 && r->finished_workers() <= cluster.num_workers(),
                     absl::StrCat(r->finished_workers()));
        }
        absl::StatusOr<bool> over = shard->JobFinished(absl::Hours(1));
        FUZZ_CHECK(over.ok(), over.status().ToString());
        break;
      }
      case ShardAction::kTakeWork: {
        const TakeWorkRequest& request = action.take_work();
        absl::StatusOr<TakeWorkResponse> r = shard->TakeWork(request);
        Trace("take_work", request.worker_id(), r.status());
        if (r.ok() && !r->done()) {
          // A unit that exists in the layout the job fixed, which the request repeated.
          const WorkUnit& u = r->unit();
          FUZZ_CHECK(u.owner() >= 0 && u.owner() < request.units_per_worker_size(),
                     absl::StrCat(u.owner()));
          FUZZ_CHECK(u.index() >= 0 && u.index() < request.units_per_worker(u.owner()),
                     absl::StrCat(u.index()));
          FUZZ_CHECK(u.epoch() >= 0 && u.epoch() < request.epochs(), absl::StrCat(u.epoch()));
          FUZZ_CHECK(u.seq() >= 0, absl::StrCat(u.seq()));
        }
        break;
      }
      case ShardAction::kStats:
        break;  // Checked below, as after every action.
      case ShardAction::kSleepUs: {
        const uint32_t us = std::min({action.sleep_us(), kMaxSleepUs, kMaxTotalSleepUs - slept_us});
        slept_us += us;
        if (us > 0) absl::SleepFor(absl::Microseconds(us));
        break;
      }
      case ShardAction::ACTION_NOT_SET:
        break;
    }
    CheckStats(shard->Stats(), cluster, options.shard_id, &expected);
  }

  shard->Shutdown();
  CheckStats(shard->Stats(), cluster, options.shard_id, &expected);
  shard.reset();  // Joins the deadline thread: every done has run by now.
  {
    absl::MutexLock lock(&pulls->mu);
    for (size_t i = 0; i < pulls->calls.size(); ++i) {
      FUZZ_CHECK(pulls->calls[i] == 1,
                 absl::StrCat("pull ", i, "'s done was called ", pulls->calls[i], " times"));
    }
  }
  absl::MutexLock lock(&pushes->mu);
  for (size_t i = 0; i < pushes->calls.size(); ++i) {
    FUZZ_CHECK(pushes->calls[i] == 1,
               absl::StrCat("push ", i, "'s done was called ", pushes->calls[i], " times"));
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace rubato

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rubato::fuzz::ShardFuzzCase c;
  if (size > static_cast<size_t>(INT32_MAX) || !c.ParseFromArray(data, static_cast<int>(size))) {
    return 0;
  }
  rubato::fuzz::RunCase(c);
  return 0;
}
