#include "server/parameter_shard.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/tensor_bytes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

constexpr double kLr = 0.5;

ShardOptions Options(int workers) {
  ShardOptions o;
  o.cluster.set_num_workers(workers);
  o.cluster.mutable_consistency()->set_mode(BSP);
  o.cluster.mutable_optimizer()->set_type("sgd");
  o.cluster.mutable_optimizer()->set_learning_rate(kLr);
  o.cluster.set_lease_ms(10000);
  o.cluster.set_wait_timeout_ms(10000);
  return o;
}

TensorValue Value(const std::string& name, const std::vector<float>& v) {
  TensorValue t;
  t.set_name(name);
  FloatsToBytes(v, t.mutable_data());
  return t;
}

std::vector<float> Floats(const TensorValue& t) {
  std::vector<float> v(t.data().size() / 4);
  BytesToFloats(t.data(), absl::MakeSpan(v));
  return v;
}

// Model: "w" of shape [2,2] and "b" of shape [3].
const std::vector<float> kW0 = {1.0f, -2.0f, 0.5f, 3.0f};
const std::vector<float> kB0 = {0.0f, 0.25f, -1.0f};

RegisterRequest Registration(int worker, int num_workers) {
  RegisterRequest r;
  r.set_worker_id(worker);
  r.set_num_workers(num_workers);
  r.mutable_consistency()->set_mode(BSP);
  r.set_batch_size(8);
  TensorSpec* w = r.add_model();
  w->set_name("w");
  w->add_shape(2);
  w->add_shape(2);
  TensorSpec* b = r.add_model();
  b->set_name("b");
  b->add_shape(3);
  *r.add_initial_values() = Value("w", kW0);
  *r.add_initial_values() = Value("b", kB0);
  return r;
}

// A shard every one of whose `workers` has registered.
std::unique_ptr<ParameterShard> StartedShard(int workers, int64_t lease_ms = 10000,
                                             Clock* clock = Clock::Real()) {
  ShardOptions options = Options(workers);
  options.cluster.set_lease_ms(lease_ms);
  options.clock = clock;
  auto shard = ParameterShard::Create(options);
  EXPECT_TRUE(shard.ok()) << shard.status();
  for (int w = 0; w < workers; ++w) {
    auto r = (*shard)->Register(Registration(w, workers));
    EXPECT_TRUE(r.ok()) << r.status();
  }
  return std::move(*shard);
}

PushRequest PushOf(int worker, int64_t step, std::vector<TensorValue> grads) {
  PushRequest p;
  p.set_worker_id(worker);
  p.set_step(step);
  for (TensorValue& g : grads) *p.add_gradients() = std::move(g);
  return p;
}

struct PullResult {
  absl::Notification done;
  absl::Status status;
  PullResponse response;
};

// Starts a pull; the result lands in the returned object when the shard answers.
std::unique_ptr<PullResult> StartPull(ParameterShard* shard, int worker, int64_t step,
                                      absl::Duration timeout = absl::Seconds(10),
                                      std::vector<std::string> names = {}) {
  auto result = std::make_unique<PullResult>();
  PullRequest req;
  req.set_worker_id(worker);
  req.set_step(step);
  for (auto& n : names) req.add_names(n);
  PullResult* r = result.get();
  shard->Pull(req, absl::Now() + timeout, [r](absl::Status s, PullResponse resp) {
    r->status = std::move(s);
    r->response = std::move(resp);
    r->done.Notify();
  });
  return result;
}

PullResponse PullNow(ParameterShard* shard, int worker, int64_t step) {
  auto r = StartPull(shard, worker, step);
  EXPECT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(r->status.ok()) << r->status;
  return r->response;
}

// Moves `clock` on by `step` at a time, calling `each` before every step, until `done` is
// notified or `limit` of simulated time has passed; returns the simulated time it took. After each
// step it waits for the shard's deadline thread to have done what fell due (and answered it).
absl::Duration AdvanceUntil(
    SimulatedClock* clock, absl::Notification* done, absl::Duration step, absl::Duration limit,
    const std::function<void()>& each = [] {}) {
  const absl::Time start = clock->Now();
  while (!done->HasBeenNotified() && clock->Now() - start < limit) {
    each();
    clock->Advance(step);
    EXPECT_TRUE(clock->AwaitWaitersAtNow(1, absl::Seconds(30)));
  }
  return clock->Now() - start;
}

// Reference: the mean summed in float in worker-id order and divided by the count in float, then
// one SGD step in float.
std::vector<float> ExpectedSgd(const std::vector<float>& w0,
                               const std::vector<std::vector<float>>& grads) {
  std::vector<float> w = w0;
  for (size_t i = 0; i < w.size(); ++i) {
    float sum = grads[0][i];
    for (size_t k = 1; k < grads.size(); ++k) sum += grads[k][i];
    const float mean = grads.size() > 1 ? sum / static_cast<float>(grads.size()) : sum;
    w[i] -= static_cast<float>(kLr) * mean;
  }
  return w;
}

TEST(ParameterShardTest, BspAveragesExactlyInEveryArrivalOrder) {
  // Magnitudes chosen so that float summation would depend on the order.
  const std::vector<std::vector<float>> grads = {
      {1e8f, 1.0f, -3.0f, 0.1f}, {-1e8f, 1e-8f, 7.0f, 0.2f}, {1.0f, 3.0f, 1e-3f, 0.3f}};
  const std::vector<float> expected = ExpectedSgd(kW0, grads);
  std::vector<int> order = {0, 1, 2};
  int permutations = 0;
  do {
    auto shard = StartedShard(3);
    auto waiting = StartPull(shard.get(), 0, 1, absl::Seconds(10), {"w"});
    for (size_t k = 0; k < order.size(); ++k) {
      EXPECT_FALSE(waiting->done.HasBeenNotified()) << "released before all pushes";
      auto r = shard->Push(PushOf(order[k], 0, {Value("w", grads[order[k]])}));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->accepted(), 1);
    }
    ASSERT_TRUE(waiting->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(waiting->status.ok()) << waiting->status;
    const GetStatsResponse stats = shard->Stats();
    EXPECT_EQ(stats.applied_updates(), 1);
    auto w_only = StartPull(shard.get(), 1, 1, absl::Seconds(5), {"w"});
    ASSERT_TRUE(w_only->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(w_only->status.ok());
    ASSERT_EQ(w_only->response.tensors_size(), 1);
    EXPECT_EQ(w_only->response.tensors(0).version(), 1);
    EXPECT_EQ(Floats(w_only->response.tensors(0)), expected);  // Bit-exact.
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 6);
}

TEST(ParameterShardTest, PullOfAllTensorsWaitsForEveryTensor) {
  auto shard = StartedShard(2);
  auto all = StartPull(shard.get(), 0, 1);
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(shard->Push(PushOf(w, 0, {Value("w", {1, 1, 1, 1})})).ok());
  }
  // "w" is done, "b" is not: the pull of everything keeps waiting.
  EXPECT_FALSE(all->done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(shard->Push(PushOf(w, 0, {Value("b", {2, 2, 2})})).ok());
  }
  ASSERT_TRUE(all->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(all->status.ok());
  ASSERT_EQ(all->response.tensors_size(), 2);
  EXPECT_EQ(Floats(all->response.tensors(1)), ExpectedSgd(kB0, {{2, 2, 2}, {2, 2, 2}}));
}

TEST(ParameterShardTest, EachStepIsAppliedOnceAndDuplicatesAreIgnored) {
  auto shard = StartedShard(2);
  const std::vector<float> g0 = {1, 2, 3, 4}, g1 = {-1, 0, 5, 2};
  ASSERT_TRUE(shard->Push(PushOf(0, 0, {Value("w", g0)})).ok());
  // A retry of the same (worker, step, tensor), even with other values, changes nothing.
  auto dup = shard->Push(PushOf(0, 0, {Value("w", {100, 100, 100, 100})}));
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->duplicates(), 1);
  EXPECT_EQ(dup->accepted(), 0);
  ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("w", g1)})).ok());
  // A retry after the update was applied is a duplicate too.
  auto late = shard->Push(PushOf(1, 0, {Value("w", g1)}));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->duplicates(), 1);
  const GetStatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.applied_updates(), 1);
  EXPECT_EQ(stats.duplicate_gradients(), 2);
  auto r = StartPull(shard.get(), 0, 1, absl::Seconds(5), {"w"});
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(Floats(r->response.tensors(0)), ExpectedSgd(kW0, {g0, g1}));
}

TEST(ParameterShardTest, SeveralStepsMatchTheReference) {
  auto shard = StartedShard(2);
  std::vector<float> w = kW0, b = kB0;
  for (int step = 0; step < 5; ++step) {
    std::vector<std::vector<float>> gw, gb;
    for (int worker = 0; worker < 2; ++worker) {
      gw.push_back({0.1f * step, -0.2f * worker, 0.3f, 0.05f * (step + worker)});
      gb.push_back({0.5f, -0.5f * step, 0.01f * worker});
    }
    // Worker 1 pushes first each step, and both push tensors separately.
    for (int worker : {1, 0}) {
      ASSERT_TRUE(shard->Push(PushOf(worker, step, {Value("b", gb[worker])})).ok());
      ASSERT_TRUE(shard->Push(PushOf(worker, step, {Value("w", gw[worker])})).ok());
    }
    w = ExpectedSgd(w, gw);
    b = ExpectedSgd(b, gb);
    const PullResponse r = PullNow(shard.get(), 0, step + 1);
    EXPECT_EQ(Floats(r.tensors(0)), w) << "step " << step;
    EXPECT_EQ(Floats(r.tensors(1)), b) << "step " << step;
  }
  EXPECT_EQ(shard->Stats().applied_updates(), 10);
}

// A push of more than 1 MiB is checked and applied on the update pool, from the caller's views
// held by its keepalive (as the gRPC service calls it): a non-finite value in its last gradient
// still refuses it whole, after the other gradients' checks passed, and answers once; nothing is
// applied, not even to the tensors checked first. A valid push then applies.
TEST(ParameterShardTest, ALargePushWithOneBadGradientIsRefusedWholeOnThePool) {
  for (ConsistencyMode mode : {BSP, ASYNC}) {
    SCOPED_TRACE(mode == BSP ? "bsp" : "async");
    ShardOptions options = Options(1);
    options.cluster.mutable_consistency()->set_mode(mode);
    auto created = ParameterShard::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    std::unique_ptr<ParameterShard> shard = std::move(*created);
    constexpr int kTensors = 4;
    constexpr int64_t kElements = 128 << 10;  // 512 KiB each: 2 MiB a push.
    RegisterRequest reg;
    reg.set_worker_id(0);
    reg.set_num_workers(1);
    reg.mutable_consistency()->set_mode(mode);
    reg.set_batch_size(8);
    for (int i = 0; i < kTensors; ++i) {
      TensorSpec* t = reg.add_model();
      t->set_name(absl::StrCat("t", i));
      t->add_shape(kElements);
      *reg.add_initial_values() = Value(t->name(), std::vector<float>(kElements, 1.0f));
    }
    ASSERT_TRUE(shard->Register(reg).ok());
    (void)PullNow(shard.get(), 0, 0);  // async: a push must follow a pull of its step
    // The gradients live in memory that the keepalive owns, as the service's receive buffers do.
    auto push_of = [&](float bad) {
      auto owned = std::make_shared<std::vector<std::string>>();
      auto wire = std::make_shared<WirePush>();
      wire->worker_id = 0;
      wire->step = 0;
      for (int i = 0; i < kTensors; ++i) {
        std::vector<float> g(kElements, 0.5f);
        if (i == kTensors - 1) g[kElements - 1] = bad;
        owned->emplace_back();
        FloatsToBytes(g, &owned->back());
      }
      for (int i = 0; i < kTensors; ++i) {
        WireTensor t;
        t.name = absl::StrCat("t", i);
        t.data = ByteChunks((*owned)[i]);
        wire->gradients.push_back(std::move(t));
      }
      return std::make_pair(wire, std::shared_ptr<const void>(owned));
    };
    auto push = [&](float bad) {
      auto [wire, owned] = push_of(bad);
      std::shared_ptr<const void> keepalive(
          std::make_shared<std::pair<std::shared_ptr<WirePush>, std::shared_ptr<const void>>>(
              wire, owned));
      absl::Mutex mu;
      int answers = 0;
      absl::Status status;
      absl::Notification answered;
      shard->Push(*wire, keepalive, [&](absl::StatusOr<PushResponse> r) {
        absl::MutexLock lock(&mu);
        status = r.status();
        if (++answers == 1) answered.Notify();
      });
      keepalive.reset();
      EXPECT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
      absl::SleepFor(absl::Milliseconds(20));  // Time for a second answer, if there were one.
      absl::MutexLock lock(&mu);
      EXPECT_EQ(answers, 1);
      return status;
    };
    const absl::Status refused = push(std::numeric_limits<float>::infinity());
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_NE(refused.message().find("gradient 't3'"), std::string::npos) << refused;
    EXPECT_NE(refused.message().find(absl::StrCat("at element ", kElements - 1)), std::string::npos)
        << refused;
    GetStatsResponse stats = shard->Stats();
    EXPECT_EQ(stats.applied_updates(), 0);
    EXPECT_EQ(stats.rejected_pushes(), 1);
    const PullResponse unchanged = PullNow(shard.get(), 0, 0);
    for (const TensorValue& t : unchanged.tensors()) {
      EXPECT_EQ(t.version(), 0) << t.name();
      EXPECT_EQ(Floats(t), std::vector<float>(kElements, 1.0f)) << t.name();
    }
    const absl::Status accepted = push(0.5f);
    EXPECT_TRUE(accepted.ok()) << accepted;
    EXPECT_EQ(shard->Stats().applied_updates(), kTensors);
    const float expected = 1.0f - static_cast<float>(kLr) * 0.5f;
    const PullResponse updated = PullNow(shard.get(), 0, 1);
    for (const TensorValue& t : updated.tensors()) {
      EXPECT_EQ(t.version(), 1) << t.name();
      EXPECT_EQ(Floats(t), std::vector<float>(kElements, expected)) << t.name();
    }
  }
}

// Under bsp with a push budget of 1 byte, parts are the 1 MiB floor (262144 elements): a tensor of
// 300000 has two, announced at registration. A part must start at a part's first element and be
// that part's size; a part and a whole gradient of other workers complete the step together.
// Under async every tensor is pushed whole.
TEST(ParameterShardTest, BspTakesGradientsInPartsAtPartBoundariesOnly) {
  constexpr int64_t kElements = 300000;
  constexpr int64_t kPart = 262144;
  auto start = [&](ConsistencyMode mode, int workers) {
    ShardOptions options = Options(workers);
    options.cluster.mutable_consistency()->set_mode(mode);
    options.push_budget_bytes = 1;
    auto shard = ParameterShard::Create(options);
    EXPECT_TRUE(shard.ok()) << shard.status();
    int64_t announced = -1;
    for (int w = 0; w < workers; ++w) {
      RegisterRequest r;
      r.set_worker_id(w);
      r.set_num_workers(workers);
      r.mutable_consistency()->set_mode(mode);
      r.set_batch_size(8);
      TensorSpec* t = r.add_model();
      t->set_name("big");
      t->add_shape(kElements);
      *r.add_initial_values() = Value("big", std::vector<float>(kElements, 0.0f));
      auto answer = (*shard)->Register(r);
      EXPECT_TRUE(answer.ok()) << answer.status();
      if (answer.ok()) announced = answer->part_elements();
    }
    return std::make_pair(std::move(*shard), announced);
  };
  auto part = [](int worker, int64_t offset, int64_t elements, float value) {
    PushRequest p = PushOf(worker, 0, {Value("big", std::vector<float>(elements, value))});
    p.mutable_gradients(0)->set_offset(offset);
    return p;
  };
  {
    // Not a structured binding: the lambda below captures the shard (C++17 does not let a lambda
    // capture a binding; clang refuses it).
    auto started = start(BSP, 2);
    std::unique_ptr<ParameterShard> shard = std::move(started.first);
    EXPECT_EQ(started.second, kPart);
    const auto expect_refused = [&](const PushRequest& p, const char* what) {
      auto r = shard->Push(p);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
          << what << ": " << r.status();
      return r.status();
    };
    const absl::Status off = expect_refused(part(0, 1000, kPart, 1), "not a part's start");
    EXPECT_NE(off.message().find("does not start a part"), std::string::npos) << off;
    const absl::Status long_part = expect_refused(part(0, kPart, kPart, 1), "too long");
    EXPECT_NE(long_part.message().find("(37856 float32 values)"), std::string::npos) << long_part;
    EXPECT_FALSE(expect_refused(part(0, 2 * kPart, 10, 1), "past the end").ok());
    EXPECT_FALSE(expect_refused(part(0, -kPart, kPart, 1), "negative").ok());
    EXPECT_EQ(shard->Stats().applied_updates(), 0);
    // Worker 0 in parts, the second part first; worker 1 whole. A push's response counts each
    // part it carries; the staleness histogram counts a gradient in parts once; a repeated part
    // is a duplicate.
    auto second = shard->Push(part(0, kPart, kElements - kPart, 2));
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->accepted(), 1);
    EXPECT_EQ(shard->Push(part(0, kPart, kElements - kPart, 2))->duplicates(), 1);
    auto first = shard->Push(part(0, 0, kPart, 2));
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->accepted(), 1);
    EXPECT_EQ(first->duplicates(), 0);
    EXPECT_EQ(shard->Stats().applied_updates(), 0);
    ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("big", std::vector<float>(kElements, 4))})).ok());
    const GetStatsResponse stats = shard->Stats();
    EXPECT_EQ(stats.applied_updates(), 1);
    EXPECT_EQ(stats.staleness_histogram(0), 2) << "one per worker's gradient, not per part";
    EXPECT_EQ(stats.duplicate_gradients(), 1);
    const PullResponse r = PullNow(shard.get(), 0, 1);
    EXPECT_EQ(Floats(r.tensors(0)), std::vector<float>(kElements, -static_cast<float>(kLr) * 3.0f));
  }
  {
    auto [shard, announced] = start(ASYNC, 1);
    EXPECT_EQ(announced, 0);
    (void)PullNow(shard.get(), 0, 0);
    auto r = shard->Push(part(0, kPart, kElements - kPart, 1));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("is pushed whole"), std::string::npos) << r.status();
  }
}

TEST(ParameterShardTest, MalformedPushesAreRejectedAndChangeNothing) {
  auto shard = StartedShard(2);
  ASSERT_TRUE(shard->Push(PushOf(0, 0, {Value("w", {1, 1, 1, 1})})).ok());
  const PullResponse before = PullNow(shard.get(), 0, 0);
  const GetStatsResponse stats_before = shard->Stats();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* what;
    PushRequest push;
    absl::StatusCode code;
  };
  std::vector<Case> cases = {
      {"unknown tensor", PushOf(1, 0, {Value("w", {1, 1, 1, 1}), Value("nope", {1})}),
       absl::StatusCode::kInvalidArgument},
      {"wrong size", PushOf(1, 0, {Value("w", {1, 1, 1})}), absl::StatusCode::kInvalidArgument},
      {"NaN", PushOf(1, 0, {Value("b", {1, 1, 1}), Value("w", {1, nan, 1, 1})}),
       absl::StatusCode::kInvalidArgument},
      {"Inf", PushOf(1, 0, {Value("w", {1, 1, 1, -inf})}), absl::StatusCode::kInvalidArgument},
      {"tensor twice", PushOf(1, 0, {Value("w", {1, 1, 1, 1}), Value("w", {1, 1, 1, 1})}),
       absl::StatusCode::kInvalidArgument},
      {"negative step", PushOf(1, -1, {Value("w", {1, 1, 1, 1})}),
       absl::StatusCode::kInvalidArgument},
      {"future step", PushOf(1, 3, {Value("w", {1, 1, 1, 1})}),
       absl::StatusCode::kFailedPrecondition},
      {"unknown worker", PushOf(7, 0, {Value("w", {1, 1, 1, 1})}),
       absl::StatusCode::kFailedPrecondition},
  };
  for (const Case& c : cases) {
    auto r = shard->Push(c.push);
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
  }
  // Bit-for-bit unchanged, and no half-accepted gradient: worker 1's valid "w" in the rejected
  // pushes above must not have counted, so nothing was applied.
  const PullResponse after = PullNow(shard.get(), 0, 0);
  ASSERT_EQ(after.tensors_size(), before.tensors_size());
  for (int i = 0; i < after.tensors_size(); ++i) {
    EXPECT_EQ(after.tensors(i).data(), before.tensors(i).data());
    EXPECT_EQ(after.tensors(i).version(), 0);
  }
  const GetStatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.applied_updates(), stats_before.applied_updates());
  EXPECT_EQ(stats.rejected_pushes(), static_cast<int64_t>(cases.size()));
  // The shard still works: worker 1's real push completes the step.
  auto ok = shard->Push(PushOf(1, 0, {Value("w", {3, 3, 3, 3})}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->accepted(), 1);
  EXPECT_EQ(shard->Stats().applied_updates(), 1);
}

TEST(ParameterShardTest, PushBeforeAllWorkersRegisteredIsRefused) {
  auto shard = ParameterShard::Create(Options(2));
  ASSERT_TRUE(shard.ok());
  ASSERT_TRUE((*shard)->Register(Registration(0, 2)).ok());
  auto r = (*shard)->Push(PushOf(0, 0, {Value("w", {1, 1, 1, 1})}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("1 of 2"), std::string::npos) << r.status();
}

TEST(ParameterShardTest, PullWaitsForRegistrationThenTimesOutNamingTheMissingWorker) {
  auto shard = ParameterShard::Create(Options(3));
  ASSERT_TRUE(shard.ok());
  ASSERT_TRUE((*shard)->Register(Registration(0, 3)).ok());
  ASSERT_TRUE((*shard)->Register(Registration(2, 3)).ok());
  auto r = StartPull(shard->get(), 0, 0, absl::Milliseconds(100));
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(r->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r->status.message().find("worker(s) 1 to register"), std::string::npos) << r->status;

  // Registration of the last worker releases a waiting step-0 pull.
  auto waiting = StartPull(shard->get(), 2, 0);
  ASSERT_TRUE((*shard)->Register(Registration(1, 3)).ok());
  ASSERT_TRUE(waiting->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(waiting->status.ok()) << waiting->status;
  EXPECT_EQ(Floats(waiting->response.tensors(0)), kW0);
}

TEST(ParameterShardTest, PullTimeoutNamesTheWorkersWhoseGradientsAreMissing) {
  auto shard = StartedShard(3);
  ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("w", {1, 1, 1, 1})})).ok());
  auto r = StartPull(shard.get(), 1, 1, absl::Milliseconds(100), {"w"});
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(r->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r->status.message().find("worker(s) 0, 2"), std::string::npos) << r->status;
  EXPECT_EQ(shard->Stats().pending_pulls(), 0);
}

TEST(ParameterShardTest, BadPullsFailAtOnce) {
  auto shard = StartedShard(1);
  auto unknown = StartPull(shard.get(), 0, 0, absl::Seconds(5), {"nope"});
  ASSERT_TRUE(unknown->done.HasBeenNotified());
  EXPECT_EQ(unknown->status.code(), absl::StatusCode::kInvalidArgument);
  auto stranger = StartPull(shard.get(), 5, 0);
  ASSERT_TRUE(stranger->done.HasBeenNotified());
  EXPECT_EQ(stranger->status.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ParameterShardTest, ModelMismatchIsRefusedNamingTheTensor) {
  auto shard = ParameterShard::Create(Options(2));
  ASSERT_TRUE(shard.ok());
  ASSERT_TRUE((*shard)->Register(Registration(0, 2)).ok());
  RegisterRequest other = Registration(1, 2);
  other.mutable_model(0)->set_shape(1, 3);
  other.clear_initial_values();  // Later registrants need not send initial values.
  auto r = (*shard)->Register(other);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("'w' is [2,2] on the server but [2,3]"), std::string::npos)
      << r.status();

  RegisterRequest extra = Registration(1, 2);
  extra.mutable_model(1)->set_name("c");
  extra.clear_initial_values();
  r = (*shard)->Register(extra);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("no tensor 'b'"), std::string::npos) << r.status();

  RegisterRequest bad_init = Registration(1, 2);
  bad_init.mutable_initial_values(0)->set_data("abc");
  EXPECT_EQ((*shard)->Register(bad_init).status().code(), absl::StatusCode::kInvalidArgument);

  RegisterRequest out_of_range = Registration(2, 2);
  EXPECT_EQ((*shard)->Register(out_of_range).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParameterShardTest, WorkerConfiguredForAnotherJobIsRefused) {
  auto shard = ParameterShard::Create(Options(2));
  ASSERT_TRUE(shard.ok());
  auto r = (*shard)->Register(Registration(1, 3));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(
      r.status().message().find("runs 2 workers in mode bsp, but worker 1 was started with 3"),
      std::string::npos)
      << r.status();
  RegisterRequest other_mode = Registration(1, 2);
  other_mode.mutable_consistency()->set_mode(SSP);
  other_mode.mutable_consistency()->set_staleness(2);
  r = (*shard)->Register(other_mode);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("mode ssp:2"), std::string::npos) << r.status();
  EXPECT_EQ((*shard)->Stats().workers_size(), 0);  // Nobody was registered.
}

TEST(ParameterShardTest, BadOptionsAreRejected) {
  ShardOptions o = Options(0);
  EXPECT_EQ(ParameterShard::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(2);
  o.update_threads = 0;
  EXPECT_EQ(ParameterShard::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A started shard of `workers` workers in the given consistency mode.
std::unique_ptr<ParameterShard> StartedShardIn(int workers, ConsistencyConfig c) {
  ShardOptions o = Options(workers);
  *o.cluster.mutable_consistency() = c;
  auto shard = ParameterShard::Create(o);
  EXPECT_TRUE(shard.ok()) << shard.status();
  for (int w = 0; w < workers; ++w) {
    RegisterRequest r = Registration(w, workers);
    *r.mutable_consistency() = c;
    EXPECT_TRUE((*shard)->Register(r).ok());
  }
  return std::move(*shard);
}

ConsistencyConfig Mode(ConsistencyMode mode, int param = 0, bool staleness_aware = false) {
  ConsistencyConfig c;
  c.set_mode(mode);
  if (mode == BACKUP) c.set_backup_workers(param);
  if (mode == SSP) c.set_staleness(param);
  c.set_staleness_aware_lr(staleness_aware);
  return c;
}

TEST(ConsistencyTest, BackupAppliesTheFirstNMinusBAndDropsExactlyTheLateOnes) {
  auto shard = StartedShardIn(4, Mode(BACKUP, 1));
  const std::vector<std::vector<float>> g = {
      {1, 0, 0, 0}, {0, 2, 0, 0}, {0, 0, 3, 0}, {0, 0, 0, 4}};
  // Step 0: workers 2, 0, 3 arrive first; 1 is late.
  for (int w : {2, 0}) {
    auto r = shard->Push(PushOf(w, 0, {Value("w", g[w])}));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->accepted(), 1);
  }
  EXPECT_EQ(shard->Stats().tensors(0).version(), 0) << "applied with only 2 of the 3 needed";
  ASSERT_TRUE(shard->Push(PushOf(3, 0, {Value("w", g[3])})).ok());
  EXPECT_EQ(shard->Stats().tensors(0).version(), 1);
  auto late = shard->Push(PushOf(1, 0, {Value("w", g[1])}));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->dropped(), 1);
  EXPECT_EQ(late->accepted(), 0);
  // A retry of the dropped gradient is a duplicate, not a second drop.
  EXPECT_EQ(shard->Push(PushOf(1, 0, {Value("w", g[1])}))->duplicates(), 1);
  const GetStatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.dropped_gradients(), 1);
  EXPECT_EQ(stats.applied_updates(), 1);
  auto r = StartPull(shard.get(), 1, 1, absl::Seconds(5), {"w"});
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(Floats(r->response.tensors(0)), ExpectedSgd(kW0, {g[0], g[2], g[3]}));
  // Step 1: the late worker of step 0 can be among the first three of step 1.
  for (int w : {1, 3, 2}) ASSERT_TRUE(shard->Push(PushOf(w, 1, {Value("w", g[w])})).ok());
  EXPECT_EQ(shard->Stats().tensors(0).version(), 2);
  EXPECT_EQ(shard->Push(PushOf(0, 1, {Value("w", g[0])}))->dropped(), 1);
  EXPECT_EQ(shard->Stats().dropped_gradients(), 2);
}

TEST(ConsistencyTest, AsyncAppliesEveryPushOnArrivalAndMeasuresStaleness) {
  auto shard = StartedShardIn(2, Mode(ASYNC));
  // Both pull version 0, then push: the second gradient is one update stale. Worker 1 pulls for
  // step 10 (async pulls never wait), which lets it push steps 0..10 on those weights below.
  PullNow(shard.get(), 0, 0);
  PullNow(shard.get(), 1, 10);
  const std::vector<float> g0 = {1, 1, 1, 1}, g1 = {2, 2, 2, 2};
  auto a = shard->Push(PushOf(0, 0, {Value("w", g0)}));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->max_staleness(), 0);
  auto b = shard->Push(PushOf(1, 0, {Value("w", g1)}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->max_staleness(), 1);
  // Each gradient applied alone, with the full rate: w - lr*g0 - lr*g1.
  std::vector<float> expected = ExpectedSgd(ExpectedSgd(kW0, {g0}), {g1});
  auto pulled = StartPull(shard.get(), 0, 0, absl::Seconds(5), {"w"});
  ASSERT_TRUE(pulled->done.HasBeenNotified()) << "async pulls never wait";
  EXPECT_EQ(Floats(pulled->response.tensors(0)), expected);
  EXPECT_EQ(pulled->response.tensors(0).version(), 2);
  // Many pushes from one worker without pulling again: all applied, staleness growing.
  for (int step = 1; step <= 10; ++step) {
    ASSERT_TRUE(shard->Push(PushOf(1, step, {Value("w", g1)})).ok());
  }
  const GetStatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.applied_updates(), 12);
  EXPECT_EQ(stats.tensors(0).version(), 12);
  int64_t counted = 0;
  for (int64_t n : stats.staleness_histogram()) counted += n;
  EXPECT_EQ(counted, 12);
  EXPECT_EQ(stats.staleness_histogram(0), 1);
  EXPECT_EQ(stats.staleness_histogram(1), 1);
  EXPECT_GT(stats.staleness_histogram(5), 0);  // tau 8..15 by the end.
}

// Finite gradients near -FLT_MAX, pushed again and again, would carry the weights to +Inf (lr 0.5:
// each adds 1.7e38). The update that would is refused whole: its push is answered with the
// tensor's name, and the weights and the other tensors stay as they were. Under async the version
// stays too; under bsp the step is skipped for that tensor, so that pulls waiting for it go on.
TEST(ConsistencyTest, AnUpdateThatWouldMakeWeightsNonFiniteIsRefusedWhole) {
  for (const ConsistencyConfig& mode : {Mode(ASYNC), Mode(BSP)}) {
    SCOPED_TRACE(ConsistencyMode_Name(mode.mode()));
    auto shard = StartedShardIn(1, mode);
    const std::vector<float> huge(4, -3.4e38f);
    const std::vector<float> fine = {1, 1, 1};
    std::vector<float> before;
    int64_t step = 0;
    absl::StatusOr<PushResponse> pushed;
    for (; step < 10; ++step) {
      before = Floats(PullNow(shard.get(), 0, step).tensors(0));
      pushed = shard->Push(PushOf(0, step, {Value("w", huge), Value("b", fine)}));
      if (!pushed.ok()) break;
    }
    ASSERT_FALSE(pushed.ok()) << "weights reached " << before[0];
    EXPECT_EQ(step, 2);  // 1.7e38, 3.4e38 (FLT_MAX is 3.403e38), then 5.1e38: refused
    EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(pushed.status().message()),
                testing::HasSubstr("the update of tensor 'w' for step 2"));
    // Under bsp the version moved on (a skipped step); under async it did not.
    const PullResponse after = PullNow(shard.get(), 0, step + 1);
    EXPECT_EQ(Floats(after.tensors(0)), before);
    EXPECT_EQ(after.tensors(0).version(), mode.mode() == BSP ? step + 1 : step);
    EXPECT_EQ(after.tensors(1).version(), step + 1);  // 'b' took its update
    const GetStatsResponse stats = shard->Stats();
    EXPECT_EQ(stats.refused_updates(), 1);
    if (mode.mode() == ASYNC) {
      // The refused step is not taken for a duplicate: sent again, it is refused again.
      EXPECT_FALSE(shard->Push(PushOf(0, step, {Value("w", huge)})).ok());
    }
    // Training goes on: a sane gradient is applied.
    const auto next = shard->Push(PushOf(0, step + 1, {Value("w", {1, 1, 1, 1}), Value("b", fine)}));
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(Floats(PullNow(shard.get(), 0, step + 2).tensors(0))[0], before[0] - 0.5f);
    EXPECT_EQ(shard->Stats().refused_updates(), mode.mode() == ASYNC ? 2 : 1);
  }
}

TEST(ConsistencyTest, StalenessAwareAsyncDividesTheRateByTau) {
  auto shard = StartedShardIn(2, Mode(ASYNC, 0, /*staleness_aware=*/true));
  PullNow(shard.get(), 1, 0);
  PullNow(shard.get(), 0, 2);
  const std::vector<float> g = {1, 1, 1, 1};
  for (int step = 0; step < 3; ++step)
    ASSERT_TRUE(shard->Push(PushOf(0, step, {Value("w", g)})).ok());
  // Worker 1's gradient, computed on version 0, lands on version 3: tau 3, rate lr/3.
  ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("w", g)})).ok());
  EXPECT_DOUBLE_EQ(shard->Stats().learning_rate(), kLr / 3);
}

TEST(ConsistencyTest, SspBlocksOnlyBeyondTheBound) {
  auto shard = StartedShardIn(2, Mode(SSP, 2));
  const std::vector<float> g = {1, 1, 1, 1};
  auto push = [&](int w, int step) {
    ASSERT_TRUE(shard->Push(PushOf(w, step, {Value("w", g), Value("b", {1, 1, 1})})).ok());
  };
  // Worker 0 runs ahead; worker 1 has pushed nothing (clock 0).
  for (int c = 0; c <= 2; ++c) {
    auto r = StartPull(shard.get(), 0, c);
    EXPECT_TRUE(r->done.HasBeenNotified()) << "step " << c << " is within s=2 of clock 0";
    push(0, c);
  }
  auto blocked = StartPull(shard.get(), 0, 3, absl::Seconds(5));
  EXPECT_FALSE(blocked->done.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "step 3 needs worker 1 at clock >= 1";
  PullNow(shard.get(), 1, 0);
  push(1, 0);
  ASSERT_TRUE(blocked->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(blocked->status.ok());
  // Pushes are applied on arrival: 4 updates so far.
  EXPECT_EQ(shard->Stats().tensors(0).version(), 4);
  auto timeout = StartPull(shard.get(), 0, 5, absl::Milliseconds(100));  // Needs clocks >= 3.
  ASSERT_TRUE(timeout->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(timeout->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(timeout->status.message().find("worker(s) 1 (clock 1)"), std::string::npos)
      << timeout->status;
}

// A worker that another shard has dropped or restarted asks, with its heartbeat, that its pulls
// waiting here end (HeartbeatRequest.end_pulls): they are answered ABORTED at once, so that its
// loop registers again instead of waiting for a worker that waits for it. Another worker's waiting
// pull stays, and a plain heartbeat ends nothing.
TEST(ConsistencyTest, AHeartbeatWithEndPullsEndsThatWorkersWaitingPullsOnly) {
  auto shard = StartedShardIn(3, Mode(SSP, 0));
  const std::vector<float> g = {1, 1, 1, 1};
  PullNow(shard.get(), 0, 0);
  ASSERT_TRUE(shard->Push(PushOf(0, 0, {Value("w", g), Value("b", {1, 1, 1})})).ok());
  PullNow(shard.get(), 1, 0);
  ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("w", g), Value("b", {1, 1, 1})})).ok());
  // Both wait for worker 2's clock (0) under s=0.
  auto mine = StartPull(shard.get(), 0, 1, absl::Seconds(30));
  auto theirs = StartPull(shard.get(), 1, 1, absl::Seconds(30));
  HeartbeatRequest beat;
  beat.set_worker_id(0);
  beat.set_step(1);
  ASSERT_TRUE(shard->Heartbeat(beat).ok());
  EXPECT_FALSE(mine->done.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "a plain heartbeat ends no pull";
  beat.set_end_pulls(true);
  ASSERT_TRUE(shard->Heartbeat(beat).ok());
  ASSERT_TRUE(mine->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsAborted(mine->status)) << mine->status;
  EXPECT_THAT(std::string(mine->status.message()),
              testing::HasSubstr("pull for step 1 by worker 0 ended on shard 0 at the worker's request"));
  EXPECT_THAT(std::string(mine->status.message()), testing::HasSubstr("register again"));
  EXPECT_FALSE(theirs->done.HasBeenNotified()) << "worker 1's pull is not worker 0's to end";
  EXPECT_EQ(shard->Stats().pending_pulls(), 1);
  // Worker 2 catches up: worker 1's pull is answered as ever.
  PullNow(shard.get(), 2, 0);
  ASSERT_TRUE(shard->Push(PushOf(2, 0, {Value("w", g), Value("b", {1, 1, 1})})).ok());
  ASSERT_TRUE(theirs->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(theirs->status.ok()) << theirs->status;
  // And worker 0 pulls again (as it would after registering) and is answered.
  PullNow(shard.get(), 0, 1);
}

TEST(ConsistencyTest, SspDoesNotWaitForADroppedWorker) {
  SimulatedClock clock;
  ShardOptions o = Options(2);
  *o.cluster.mutable_consistency() = Mode(SSP, 1);
  o.cluster.set_lease_ms(200);
  o.clock = &clock;
  auto created = ParameterShard::Create(o);
  ASSERT_TRUE(created.ok());
  ParameterShard* shard = created->get();
  for (int w = 0; w < 2; ++w) {
    RegisterRequest r = Registration(w, 2);
    *r.mutable_consistency() = Mode(SSP, 1);
    ASSERT_TRUE(shard->Register(r).ok());
  }
  // Worker 0 pushes steps 0 and 1; worker 1 (clock 0) goes silent, so step 2 is blocked at first.
  PullNow(shard, 0, 1);
  for (int c = 0; c < 2; ++c) {
    ASSERT_TRUE(shard->Push(PushOf(0, c, {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})})).ok());
  }
  auto r = StartPull(shard, 0, 2, absl::Seconds(10));
  const absl::Duration waited =
      AdvanceUntil(&clock, &r->done, absl::Milliseconds(50), absl::Seconds(5), [&] {
        HeartbeatRequest hb;
        hb.set_worker_id(0);
        ASSERT_TRUE(shard->Heartbeat(hb).ok());
      });
  ASSERT_TRUE(r->done.HasBeenNotified()) << "SSP waited on a dead worker";
  EXPECT_TRUE(r->status.ok()) << r->status;
  // Worker 1 is dropped once its 200 ms lease has run out, not before.
  EXPECT_GT(waited, absl::Milliseconds(200));
  EXPECT_LE(waited, absl::Milliseconds(250));
  EXPECT_EQ(shard->Stats().dropped_workers(), 1);
}

// Property: under random delays, no worker ever starts step c while another live worker has
// pushed fewer than c - s steps. Simulated with real threads and random sleeps, many seeds.
TEST(ConsistencyTest, SspNeverLetsAWorkerRunMoreThanSAhead) {
  for (int seed = 0; seed < 12; ++seed) {
    const int workers = 3, steps = 15, s = seed % 3;
    auto shard = StartedShardIn(workers, Mode(SSP, s));
    absl::Mutex mu;
    std::vector<int64_t> pushed(workers, 0);  // Steps each worker has pushed.
    int64_t violations = 0;
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        std::mt19937 rng(seed * 31 + w);
        std::exponential_distribution<double> delay(1.0 / 0.3);  // Mean 0.3 ms.
        for (int c = 0; c < steps; ++c) {
          auto r = StartPull(shard.get(), w, c, absl::Seconds(20));
          ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
          ASSERT_TRUE(r->status.ok()) << r->status;
          {
            absl::MutexLock lock(&mu);
            for (int other = 0; other < workers; ++other) {
              if (pushed[other] < c - s) ++violations;
            }
          }
          absl::SleepFor(absl::Microseconds(static_cast<int64_t>(1000 * delay(rng) * (1 + w))));
          {
            // Count the push before the server sees it, so the check above cannot miss it.
            absl::MutexLock lock(&mu);
            ++pushed[w];
          }
          ASSERT_TRUE(
              shard->Push(PushOf(w, c, {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})})).ok());
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(violations, 0) << "seed " << seed << ", s = " << s;
    EXPECT_EQ(shard->Stats().tensors(0).version(), workers * steps);
  }
}

TEST(ParameterShardTest, ShutdownFailsWaitingPulls) {
  auto shard = StartedShard(2);
  auto r = StartPull(shard.get(), 0, 1);
  shard->Shutdown();
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r->status.message(), "parameter server shard 0 is shutting down");
}

// A shard that stops to be started again (a roll-back) answers what workers retry, not "shutting
// down" (which ends them): the waiting pull, a later pull and a later registration all get it.
TEST(ParameterShardTest, AShutdownToRestartAnswersItsOwnRetryableStatus) {
  auto shard = StartedShard(2);
  auto r = StartPull(shard.get(), 0, 1);
  const absl::Status restarting =
      absl::UnavailableError("parameter server shard 0 is restarting to roll back");
  shard->Shutdown(restarting);
  shard->Shutdown();  // The first call decides.
  ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(r->status, restarting);
  auto later = StartPull(shard.get(), 1, 1);
  ASSERT_TRUE(later->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(later->status, restarting);
  EXPECT_EQ(shard->Register(Registration(0, 2)).status(), restarting);
}

TEST(ParameterShardTest, SilentWorkerIsDroppedAndTheStepCompletesWithoutIt) {
  SimulatedClock clock;
  ShardOptions o = Options(3);
  o.cluster.set_lease_ms(200);
  o.clock = &clock;
  auto created = ParameterShard::Create(o);
  ASSERT_TRUE(created.ok());
  ParameterShard* shard = created->get();
  for (int w = 0; w < 3; ++w) ASSERT_TRUE(shard->Register(Registration(w, 3)).ok());
  const std::vector<float> g0 = {1, 2, 3, 4}, g1 = {3, 2, 1, 0};
  ASSERT_TRUE(shard->Push(PushOf(0, 0, {Value("w", g0)})).ok());
  ASSERT_TRUE(shard->Push(PushOf(1, 0, {Value("w", g1)})).ok());
  // Worker 2 goes silent; 0 and 1 keep heartbeating while they wait for step 1.
  auto r = StartPull(shard, 0, 1, absl::Seconds(10), {"w"});
  const absl::Duration waited =
      AdvanceUntil(&clock, &r->done, absl::Milliseconds(50), absl::Seconds(5), [&] {
        for (int w : {0, 1}) {
          HeartbeatRequest hb;
          hb.set_worker_id(w);
          ASSERT_TRUE(shard->Heartbeat(hb).ok());
        }
      });
  ASSERT_TRUE(r->done.HasBeenNotified()) << "the silent worker was never dropped";
  ASSERT_TRUE(r->status.ok()) << r->status;
  EXPECT_GT(waited, absl::Milliseconds(200));
  EXPECT_LE(waited, absl::Milliseconds(250));
  EXPECT_EQ(Floats(r->response.tensors(0)), ExpectedSgd(kW0, {g0, g1}));  // The mean of two.
  EXPECT_EQ(shard->Stats().dropped_workers(), 1);

  // The dropped worker is told so, registers again, and counts in the next barrier.
  auto late = shard->Push(PushOf(2, 0, {Value("w", g0)}));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  EXPECT_NE(late.status().message().find("register again"), std::string::npos);
  auto back = shard->Register(Registration(2, 3));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->min_version(), 0);  // "b" has not been updated yet.
  ASSERT_TRUE(shard->Push(PushOf(0, 1, {Value("w", g0)})).ok());
  ASSERT_TRUE(shard->Push(PushOf(1, 1, {Value("w", g0)})).ok());
  // A pull's deadline is read on the shard's clock too.
  auto next = StartPull(shard, 0, 2, absl::Seconds(10), {"w"});
  const absl::Duration timed_out =
      AdvanceUntil(&clock, &next->done, absl::Milliseconds(100), absl::Seconds(30), [&] {
        for (int w : {0, 1, 2}) {
          HeartbeatRequest hb;
          hb.set_worker_id(w);
          ASSERT_TRUE(shard->Heartbeat(hb).ok());
        }
      });
  EXPECT_EQ(timed_out, absl::Seconds(10));  // wait_timeout_ms caps the deadline given.
  ASSERT_TRUE(next->done.HasBeenNotified());
  EXPECT_EQ(next->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(next->status.message().find("worker(s) 2"), std::string::npos) << next->status;
  ASSERT_TRUE(shard->Push(PushOf(2, 1, {Value("w", g0)})).ok());
  EXPECT_EQ(shard->Stats().tensors(0).version(), 2);
}

TEST(ParameterShardTest, LearningRateFollowsTheUpdateCount) {
  ShardOptions o = Options(1);
  o.cluster.mutable_optimizer()->set_learning_rate(1.0);
  o.cluster.mutable_lr_schedule()->set_warmup_steps(4);
  auto shard = ParameterShard::Create(o);
  ASSERT_TRUE(shard.ok()) << shard.status();
  ASSERT_TRUE((*shard)->Register(Registration(0, 1)).ok());
  float w = kB0[1];
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE((*shard)->Push(PushOf(0, step, {Value("b", {1, 1, 1})})).ok());
    // Warmup: update t uses (t + 1) / 4 of the peak, then the peak (constant decay).
    const float lr = step < 4 ? (step + 1) / 4.0f : 1.0f;
    w -= lr * 1.0f;
    EXPECT_DOUBLE_EQ((*shard)->Stats().learning_rate(), lr) << "update " << step;
    auto r = StartPull(shard->get(), 0, step + 1, absl::Seconds(5), {"b"});
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    EXPECT_EQ(Floats(r->response.tensors(0))[1], w) << "after update " << step;
  }
  EXPECT_NE((*shard)->Stats().lr_schedule().find("warmup"), std::string::npos)
      << (*shard)->Stats().lr_schedule();
}

TEST(ParameterShardTest, AdaptiveBatchDecidesFromTheLowestWorkersRelayAndRefusesOtherBatches) {
  // Two workers of 8; decisions every 2 steps within [16, 256]; linear LR scaling from the job's
  // starting global batch of 16.
  ShardOptions o = Options(2);
  o.cluster.mutable_adaptive_batch()->set_min_global_batch(16);
  o.cluster.mutable_adaptive_batch()->set_max_global_batch(256);
  o.cluster.mutable_adaptive_batch()->set_every_steps(2);
  o.cluster.mutable_lr_schedule()->set_scaling("linear");
  auto created = ParameterShard::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  ParameterShard* shard = created->get();
  for (int w = 0; w < 2; ++w) ASSERT_TRUE(shard->Register(Registration(w, 2)).ok());
  auto push = [&](int worker, int64_t step, int batch, double trace = -1) {
    PushRequest p = PushOf(worker, step, {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})});
    p.set_batch_size(batch);
    if (trace >= 0) {
      p.mutable_noise_relay()->set_step(step - 2);
      p.mutable_noise_relay()->set_g2_ema(1.0);
      p.mutable_noise_relay()->set_trace_ema(trace);
    }
    return shard->Push(p);
  };
  for (int64_t step = 0; step < 2; ++step) {
    for (int w = 0; w < 2; ++w) {
      absl::StatusOr<PushResponse> r = push(w, step, 8);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->has_batch_change());
    }
  }
  // Decision step 2: worker 1's relay arrives first, but worker 0's (B_simple 64) is the one taken,
  // as every shard takes it.
  ASSERT_TRUE(push(1, 2, 8, /*trace=*/200).ok());
  ASSERT_TRUE(push(0, 2, 8, /*trace=*/64).ok());
  // The first push of step 3 decides step 2: 64 examples a step, 32 per worker, from step 4.
  absl::StatusOr<PushResponse> r = push(0, 3, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->has_batch_change());
  EXPECT_EQ(r->batch_change().from_step(), 4);
  EXPECT_EQ(r->batch_change().batch_size(), 32);
  EXPECT_EQ(r->batch_change().global_batch(), 64);
  EXPECT_DOUBLE_EQ(r->batch_change().b_simple(), 64);
  EXPECT_DOUBLE_EQ(r->batch_change().learning_rate(), kLr * 4);  // Linear: 64 / 16.
  // Step 3 is still at 8 a worker: a push of 32 is refused, and changes nothing.
  absl::StatusOr<PushResponse> early = push(1, 3, 32);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_NE(early.status().message().find("adaptive batch at that step is 8"), std::string::npos)
      << early.status();
  ASSERT_TRUE(push(1, 3, 8).ok());
  EXPECT_DOUBLE_EQ(shard->Stats().learning_rate(), kLr);
  // From step 4, 32: the old batch is refused; the update's rate is scaled.
  absl::StatusOr<PushResponse> stale = push(0, 4, 8);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  ASSERT_TRUE(push(0, 4, 32).ok());
  ASSERT_TRUE(push(1, 4, 32).ok());
  EXPECT_DOUBLE_EQ(shard->Stats().learning_rate(), kLr * 4);
  ASSERT_EQ(shard->Stats().batch_plan_size(), 1);
  EXPECT_EQ(shard->Stats().noise_scale().batch_small(), 32);  // Step 4 measured at its batch.
  // A push without its batch, a relay that is not finite, and a registrant of another batch.
  EXPECT_EQ(push(0, 5, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  PushRequest nan = PushOf(0, 5, {Value("b", {1, 1, 1})});
  nan.set_batch_size(32);
  nan.mutable_noise_relay()->set_g2_ema(std::nan(""));
  EXPECT_EQ(shard->Push(nan).status().code(), absl::StatusCode::kInvalidArgument);
  RegisterRequest other = Registration(1, 2);
  other.set_batch_size(32);
  absl::StatusOr<RegisterResponse> refused = shard->Register(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  // A worker registering again (a restart) gets the plan so far.
  absl::StatusOr<RegisterResponse> again = shard->Register(Registration(1, 2));
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->batch_plan_size(), 1);
  EXPECT_EQ(again->batch_plan(0).batch_size(), 32);
}

TEST(ParameterShardTest, ScheduleThatDoesNotFitTheJobRefusesTheLastRegistration) {
  ShardOptions o = Options(2);
  o.cluster.mutable_lr_schedule()->set_decay("cosine");  // Needs a horizon: the job's length.
  auto shard = ParameterShard::Create(o);
  ASSERT_TRUE(shard.ok());
  ASSERT_TRUE((*shard)->Register(Registration(0, 2)).ok());
  auto r = (*shard)->Register(Registration(1, 2));  // total_steps 0: no horizon.
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot start training"), std::string::npos) << r.status();
  // The refused worker is not counted: pushes still wait for the job to start.
  EXPECT_EQ((*shard)->Push(PushOf(0, 0, {Value("b", {1, 1, 1})})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  RegisterRequest fixed = Registration(1, 2);
  fixed.set_total_steps(100);
  RegisterRequest first = Registration(0, 2);
  first.set_total_steps(100);
  ASSERT_TRUE((*shard)->Register(first).ok());  // Re-registration updates worker 0's job length.
  EXPECT_TRUE((*shard)->Register(fixed).ok());
}

TEST(ParameterShardTest, WorkersWithDifferentJobLengthsAreRefused) {
  auto shard = ParameterShard::Create(Options(2));
  ASSERT_TRUE(shard.ok());
  RegisterRequest a = Registration(0, 2);
  a.set_steps_per_epoch(10);
  a.set_total_steps(30);
  ASSERT_TRUE((*shard)->Register(a).ok());
  RegisterRequest b = Registration(1, 2);
  b.set_steps_per_epoch(10);
  b.set_total_steps(20);
  auto r = (*shard)->Register(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("job mismatch"), std::string::npos) << r.status();
}

// Issue 9: what a hostile or broken client sent to main before these checks. Each test failed
// there (a crash, an amplified answer, a poisoned clock, a worker that skipped its steps).

// Finding 1: shape [2^31, 2^31] or [2^62] with an empty value passed the byte check (elements * 4
// wrapped to 0) and the finiteness loop walked off the buffer; [2^62+1] with 4 bytes read the heap.
TEST(HostileInputTest, OverflowingShapesAreRefusedNotRead) {
  auto shard = ParameterShard::Create(Options(1));
  ASSERT_TRUE(shard.ok());
  const int64_t two31 = int64_t{1} << 31, two62 = int64_t{1} << 62;
  for (const auto& [shape, bytes] : std::vector<std::pair<std::vector<int64_t>, int>>{
           {{two31, two31}, 0}, {{two62}, 0}, {{two62 + 1}, 4}, {{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4}}) {
    RegisterRequest r = Registration(0, 1);
    r.mutable_model(0)->clear_shape();
    for (int64_t d : shape) r.mutable_model(0)->add_shape(d);
    r.mutable_initial_values(0)->set_data(std::string(bytes, '\0'));
    absl::StatusOr<RegisterResponse> response = (*shard)->Register(r);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument)
        << ShapeString(shape) << ": " << response.status();
  }
  EXPECT_EQ((*shard)->Stats().tensors_size(), 0) << "nothing adopted";
}

TEST(HostileInputTest, RegisterFieldsOutOfRange) {
  auto shard = ParameterShard::Create(Options(2));
  ASSERT_TRUE(shard.ok());
  std::vector<RegisterRequest> bad;
  for (int64_t v : {int64_t{-1}, std::numeric_limits<int64_t>::min(), int64_t{1} << 48,
                    std::numeric_limits<int64_t>::max()}) {
    bad.push_back(Registration(0, 2));
    bad.back().set_resume_step(v);
    bad.push_back(Registration(0, 2));
    bad.back().set_total_steps(v);
    bad.push_back(Registration(0, 2));
    bad.back().set_steps_per_epoch(v);
  }
  bad.push_back(Registration(0, 2));
  bad.back().set_batch_size(std::numeric_limits<int32_t>::max());
  bad.push_back(Registration(0, 2));
  bad.back().mutable_model(0)->set_name(std::string(257, 'n'));
  bad.back().mutable_initial_values(0)->set_name(std::string(257, 'n'));
  bad.push_back(Registration(0, 2));
  bad.back().mutable_model(0)->set_name("");
  bad.back().mutable_initial_values(0)->set_name("");
  for (const RegisterRequest& r : bad) {
    EXPECT_EQ((*shard)->Register(r).status().code(), absl::StatusCode::kInvalidArgument)
        << r.ShortDebugString().substr(0, 200);
  }
  EXPECT_EQ((*shard)->Stats().tensors_size(), 0);
  EXPECT_EQ((*shard)->Stats().workers_size(), 0);
}

// Finding 2: one tensor named 1,100 times made a 1.1 GB answer out of a 1 MiB tensor.
TEST(HostileInputTest, PullWithRepeatedNamesIsRefused) {
  auto shard = StartedShard(1);
  PullRequest req;
  req.set_worker_id(0);
  req.set_step(0);
  req.add_names("w");
  req.add_names("w");
  absl::Notification done;
  absl::Status status;
  shard->Pull(req, absl::Now() + absl::Seconds(1), [&](absl::Status s, PullResponse r) {
    status = s;
    EXPECT_EQ(r.tensors_size(), 0);
    done.Notify();
  });
  ASSERT_TRUE(done.HasBeenNotified());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("appears twice"), std::string::npos) << status;
}

// Finding 2, parked: a worker's new pull replaces its parked pulls of the same tensors, so the
// pulls one worker can park (and the snapshots they cost when a step completes) are bounded.
TEST(HostileInputTest, ParkedPullsOfOneWorkerAreSupersededNotAccumulated) {
  auto shard = StartedShard(2);
  std::vector<std::unique_ptr<PullResult>> pulls;
  for (int i = 0; i < 50; ++i) pulls.push_back(StartPull(shard.get(), 0, 1, absl::Seconds(10)));
  EXPECT_EQ(shard->Stats().pending_pulls(), 1);
  for (int i = 0; i + 1 < 50; ++i) {
    ASSERT_TRUE(pulls[i]->done.HasBeenNotified());
    EXPECT_EQ(pulls[i]->status.code(), absl::StatusCode::kAborted) << pulls[i]->status;
  }
  // Disjoint pulls of one worker coexist (a client's call groups); another worker's are its own.
  auto w_only = StartPull(shard.get(), 1, 1, absl::Seconds(10), {"w"});
  auto b_only = StartPull(shard.get(), 1, 1, absl::Seconds(10), {"b"});
  EXPECT_EQ(shard->Stats().pending_pulls(), 3);
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(shard->Push(PushOf(w, 0, {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})})).ok());
  }
  for (PullResult* r : {pulls.back().get(), w_only.get(), b_only.get()}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    EXPECT_TRUE(r->status.ok()) << r->status;
  }
}

// Finding 4: in ssp and async a push for step 10^12 was accepted, and every later honest push of
// that worker was dropped as a duplicate; step 2^63-1 overflowed the SSP clock.
TEST(HostileInputTest, PushesFromTheFutureAreRefusedInEveryMode) {
  for (const ConsistencyConfig& mode : {Mode(BSP), Mode(BACKUP, 1), Mode(ASYNC), Mode(SSP, 2)}) {
    SCOPED_TRACE(mode.ShortDebugString());
    auto shard = StartedShardIn(2, mode);
    PullNow(shard.get(), 0, 0);
    for (int64_t step : {int64_t{1000000000000}, std::numeric_limits<int64_t>::max(),
                         int64_t{1} << 48, int64_t{5}}) {
      auto r = shard->Push(PushOf(0, step, {Value("w", {1, 1, 1, 1})}));
      EXPECT_FALSE(r.ok()) << step;
      EXPECT_TRUE(absl::IsFailedPrecondition(r.status()) || absl::IsInvalidArgument(r.status()))
          << r.status();
    }
    // The honest push of step 0 is still taken.
    auto honest = shard->Push(PushOf(0, 0, {Value("w", {1, 1, 1, 1})}));
    ASSERT_TRUE(honest.ok()) << honest.status();
    EXPECT_EQ(honest->accepted(), 1);
    EXPECT_EQ(honest->duplicates(), 0);
  }
}

TEST(HostileInputTest, HugeStepsInPullsAndHeartbeatsAreRefused) {
  auto shard = StartedShardIn(2, Mode(SSP, 2));
  for (int64_t step : {int64_t{-1}, int64_t{1} << 48, std::numeric_limits<int64_t>::max(),
                       std::numeric_limits<int64_t>::min()}) {
    auto r = StartPull(shard.get(), 0, step, absl::Seconds(1));
    ASSERT_TRUE(r->done.HasBeenNotified()) << step;
    EXPECT_EQ(r->status.code(), absl::StatusCode::kInvalidArgument) << step;
    HeartbeatRequest hb;
    hb.set_worker_id(0);
    hb.set_step(step);
    EXPECT_EQ(shard->Heartbeat(hb).status().code(), absl::StatusCode::kInvalidArgument) << step;
  }
  // Pulls still work, and the clocks were not touched.
  EXPECT_EQ(PullNow(shard.get(), 1, 2).tensors_size(), 2);
}

// Finding 5: a worker that rejoined in ssp or async was told to resume at the tensor version,
// which counts every worker's pushes: in async it skipped most of its steps, in ssp it waited for
// a clock no one would reach. It now resumes at its own clock.
TEST(HostileInputTest, RejoinResumesAtTheWorkersOwnClockInAsyncAndSsp) {
  for (const ConsistencyConfig& mode : {Mode(ASYNC), Mode(SSP, 2)}) {
    SCOPED_TRACE(mode.ShortDebugString());
    auto shard = StartedShardIn(3, mode);
    const std::vector<TensorValue> g = {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})};
    // Each worker pushes steps 0..3: versions reach 12, every clock is 4.
    for (int step = 0; step < 4; ++step) {
      for (int w = 0; w < 3; ++w) {
        PullNow(shard.get(), w, step);
        ASSERT_TRUE(shard->Push(PushOf(w, step, g)).ok());
      }
    }
    ASSERT_EQ(shard->Stats().tensors(0).version(), 12);
    RegisterRequest again = Registration(1, 3);
    *again.mutable_consistency() = mode;
    again.set_resume_step(4);
    auto r = shard->Register(again);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->resume_step(), 4) << "its own clock, not the version";
    EXPECT_EQ(r->min_version(), 12);
  }
  // bsp keeps the job's step.
  auto bsp = StartedShard(2);
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(bsp->Push(PushOf(w, 0, {Value("w", {1, 1, 1, 1}), Value("b", {1, 1, 1})})).ok());
  }
  auto r = bsp->Register(Registration(0, 2));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->resume_step(), 1);
}

// --- Job life cycle: Finish and JobFinished ----------------------------------------------------

FinishRequest FinishOf(int worker, int64_t steps) {
  FinishRequest f;
  f.set_worker_id(worker);
  f.set_step(steps);
  return f;
}

TEST(JobLifecycleTest, TheJobEndsWhenEveryWorkerHasFinished) {
  auto shard = StartedShard(2);
  EXPECT_FALSE(*shard->JobFinished(absl::Seconds(60)));
  auto first = shard->Finish(FinishOf(0, 10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->finished_workers(), 1);
  EXPECT_FALSE(*shard->JobFinished(absl::Seconds(60))) << "worker 1 is still training";
  ASSERT_TRUE(shard->Finish(FinishOf(0, 10)).ok()) << "a repeated Finish is harmless";
  auto second = shard->Finish(FinishOf(1, 10));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->finished_workers(), 2);
  EXPECT_TRUE(*shard->JobFinished(absl::Seconds(60)));
  EXPECT_EQ(shard->Stats().finished_workers(), 2);
}

TEST(JobLifecycleTest, FinishIsValidated) {
  auto created = ParameterShard::Create(Options(2));
  ASSERT_TRUE(created.ok());
  ParameterShard* shard = created->get();
  ASSERT_TRUE(shard->Register(Registration(0, 2)).ok());
  for (int bad : {-1, 1, 2, 1 << 30}) {  // Unknown, or never registered.
    EXPECT_EQ(shard->Finish(FinishOf(bad, 1)).status().code(),
              absl::StatusCode::kFailedPrecondition)
        << bad;
  }
  for (int64_t steps : {int64_t{-1}, int64_t{1} << 48, std::numeric_limits<int64_t>::max()}) {
    EXPECT_EQ(shard->Finish(FinishOf(0, steps)).status().code(), absl::StatusCode::kInvalidArgument)
        << steps;
  }
  EXPECT_EQ(shard->Stats().finished_workers(), 0);
}

TEST(JobLifecycleTest, AFinishedWorkerIsNotDroppedForItsSilence) {
  SimulatedClock clock;
  auto started = StartedShard(2, /*lease_ms=*/100, &clock);
  ParameterShard* shard = started.get();
  ASSERT_TRUE(shard->Finish(FinishOf(0, 0)).ok());
  // Worker 1 keeps heartbeating for several leases; worker 0 is silent but finished.
  absl::Notification never;
  AdvanceUntil(&clock, &never, absl::Milliseconds(50), absl::Milliseconds(400), [&] {
    HeartbeatRequest hb;
    hb.set_worker_id(1);
    ASSERT_TRUE(shard->Heartbeat(hb).ok());
    EXPECT_FALSE(*shard->JobFinished(absl::Seconds(60)));
  });
  EXPECT_EQ(shard->Stats().dropped_workers(), 0);
}

TEST(JobLifecycleTest, DroppedWorkersGetOneLeaseToComeBackAfterTheOthersFinish) {
  SimulatedClock clock;
  auto started = StartedShard(3, /*lease_ms=*/200, &clock);
  ParameterShard* shard = started.get();
  // Worker 2 dies; 0 and 1 finish while it is silent.
  ASSERT_TRUE(shard->Finish(FinishOf(0, 5)).ok());
  ASSERT_TRUE(shard->Finish(FinishOf(1, 5)).ok());
  const absl::Time start = clock.Now();
  bool finished = false;
  while (!finished && clock.Now() - start < absl::Seconds(5)) {
    absl::StatusOr<bool> f = shard->JobFinished(absl::Seconds(60));
    ASSERT_TRUE(f.ok()) << f.status();
    finished = *f;
    if (!finished) clock.Advance(absl::Milliseconds(10));
  }
  ASSERT_TRUE(finished);
  // Its lease ran out (200 ms), then one more lease for it to come back.
  EXPECT_EQ(clock.Now() - start, absl::Milliseconds(400));

  // One that does come back in time keeps the job going until it finishes too.
  auto again = StartedShard(3, /*lease_ms=*/200, &clock);
  ASSERT_TRUE(again->Finish(FinishOf(0, 5)).ok());
  ASSERT_TRUE(again->Finish(FinishOf(1, 5)).ok());
  clock.Advance(absl::Milliseconds(300));                 // Worker 2 silent past its lease...
  ASSERT_TRUE(again->Register(Registration(2, 3)).ok());  // ...and back.
  for (int i = 0; i < 10; ++i) {
    HeartbeatRequest hb;
    hb.set_worker_id(2);
    ASSERT_TRUE(again->Heartbeat(hb).ok());
    EXPECT_FALSE(*again->JobFinished(absl::Seconds(60)));
    clock.Advance(absl::Milliseconds(50));
  }
  ASSERT_TRUE(again->Finish(FinishOf(2, 5)).ok());
  EXPECT_TRUE(*again->JobFinished(absl::Seconds(60)));
}

TEST(JobLifecycleTest, NoLiveWorkerForTheIdleTimeoutIsAnErrorNamingThem) {
  SimulatedClock clock;
  ShardOptions o = Options(3);
  o.cluster.set_lease_ms(100);
  o.clock = &clock;
  auto created = ParameterShard::Create(o);
  ASSERT_TRUE(created.ok());
  ParameterShard* shard = created->get();
  ASSERT_TRUE(shard->Register(Registration(1, 3)).ok());  // 0 and 2 never come; 1 goes silent.
  const absl::Time start = clock.Now();
  absl::StatusOr<bool> f = false;
  while (f.ok() && !*f && clock.Now() - start < absl::Seconds(5)) {
    f = shard->JobFinished(absl::Milliseconds(300));
    if (f.ok()) clock.Advance(absl::Milliseconds(10));
  }
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(f.status().message().find("never registered: 0,2"), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("registered, then silent: 1"), std::string::npos)
      << f.status();
  // Live for its lease (100 ms), then idle for 300 ms.
  EXPECT_EQ(clock.Now() - start, absl::Milliseconds(400));
}

// Set up as a simulator sets it up (sim/README.md): no thread of the shard's own. Tasks go where
// ShardOptions.post says, and a pull's deadline passes only when the owner calls ExpireDeadlines
// once the clock has reached it.
TEST(ParameterShardTest, WithoutThreadsTheOwnerRunsTheTasksAndExpiresTheDeadlines) {
  SimulatedClock clock;
  const absl::Time start = clock.Now();
  std::vector<std::function<void()>> tasks;
  ShardOptions options = Options(2);
  options.clock = &clock;
  options.deadline_thread = false;
  options.post = [&](std::function<void()> t) { tasks.push_back(std::move(t)); };
  auto shard = ParameterShard::Create(options);
  ASSERT_TRUE(shard.ok()) << shard.status();
  // A tensor of more than 1 MiB: its push is checked and applied on posted tasks.
  const std::vector<float> zeros(300000, 0.0f);
  for (int w = 0; w < 2; ++w) {
    RegisterRequest r;
    r.set_worker_id(w);
    r.set_num_workers(2);
    r.mutable_consistency()->set_mode(BSP);
    r.set_batch_size(8);
    TensorSpec* big = r.add_model();
    big->set_name("big");
    big->add_shape(300000);
    *r.add_initial_values() = Value("big", zeros);
    auto registered = (*shard)->Register(r);
    ASSERT_TRUE(registered.ok()) << registered.status();
  }
  std::optional<absl::Status> pushed;
  // The request outlives the push (no keepalive: its bytes must stay valid until it is done).
  const PushRequest request = PushOf(0, 0, {Value("big", std::vector<float>(300000, 1.0f))});
  (*shard)->Push(WirePushOf(request), nullptr,
                 [&](absl::StatusOr<PushResponse> r) { pushed = r.status(); });
  EXPECT_FALSE(pushed.has_value());
  ASSERT_FALSE(tasks.empty());
  while (!tasks.empty()) {
    std::function<void()> t = std::move(tasks.front());
    tasks.erase(tasks.begin());
    t();
  }
  ASSERT_TRUE(pushed.has_value());
  EXPECT_TRUE(pushed->ok()) << *pushed;

  // Worker 0's pull of step 1 waits for worker 1's gradient, for at most 2 s.
  std::optional<absl::Status> pulled;
  PullRequest pull;
  pull.set_worker_id(0);
  pull.set_step(1);
  (*shard)->Pull(
      pull, start + absl::Seconds(2),
      ParameterShard::PullDone([&](absl::Status s, PullResponse) { pulled = std::move(s); }));
  clock.Advance(absl::Seconds(1));
  EXPECT_LE((*shard)->ExpireDeadlines(), start + absl::Seconds(2));
  EXPECT_FALSE(pulled.has_value());
  clock.Advance(absl::Seconds(2));
  EXPECT_FALSE(pulled.has_value()) << "no thread of the shard's own expires it";
  (*shard)->ExpireDeadlines();
  ASSERT_TRUE(pulled.has_value());
  EXPECT_EQ(pulled->code(), absl::StatusCode::kDeadlineExceeded) << *pulled;
  EXPECT_THAT(std::string(pulled->message()), ::testing::HasSubstr("1")) << *pulled;
}

}  // namespace
}  // namespace rubato
