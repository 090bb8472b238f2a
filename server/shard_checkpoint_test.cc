// A shard checkpointed mid-job, written, read back and restored into a new shard, then trained on,
// ends bit-identical to a shard that was never interrupted: weights, every optimizer's slots, and
// the learning-rate schedule's position (warmup and decay depend on it).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/tensor_bytes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "server/parameter_shard.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

constexpr int kWorkers = 2;
const std::vector<std::string> kNames = {"dense/kernel", "dense/bias"};
const std::vector<std::vector<int64_t>> kShapes = {{8, 4}, {4}};

ShardOptions Options(const OptimizerConfig& optimizer, ConsistencyMode mode) {
  ShardOptions o;
  o.cluster.set_num_workers(kWorkers);
  o.cluster.mutable_consistency()->set_mode(mode);
  *o.cluster.mutable_optimizer() = optimizer;
  o.cluster.set_lease_ms(60000);
  o.cluster.set_wait_timeout_ms(10000);
  LearningRateSchedule* s = o.cluster.mutable_lr_schedule();
  s->set_warmup_steps(mode == BSP ? 6 : 12);  // Past the checkpoint: its position matters.
  s->set_decay("cosine");
  return o;
}

std::vector<float> Values(int tensor, uint32_t seed) {
  const int64_t n = kShapes[tensor][0] * (kShapes[tensor].size() > 1 ? kShapes[tensor][1] : 1);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    v[i] = std::sin(0.37f * static_cast<float>(i + 1) * static_cast<float>(seed % 97 + 1)) *
           (tensor == 0 ? 1.0f : 0.1f);
  }
  return v;
}

RegisterRequest Registration(int worker, ConsistencyMode mode, bool with_values) {
  RegisterRequest r;
  r.set_worker_id(worker);
  r.set_num_workers(kWorkers);
  r.mutable_consistency()->set_mode(mode);
  r.set_batch_size(16);
  r.set_steps_per_epoch(10);
  r.set_total_steps(40);
  for (int t = 0; t < 2; ++t) {
    TensorSpec* spec = r.add_model();
    spec->set_name(kNames[t]);
    for (int64_t d : kShapes[t]) spec->add_shape(d);
    if (with_values) {
      TensorValue* v = r.add_initial_values();
      v->set_name(kNames[t]);
      FloatsToBytes(Values(t, 1000 + t), v->mutable_data());
    }
  }
  return r;
}

// Steps [from, to) of both workers, in worker order, each gradient a function of (step, worker).
void Train(ParameterShard* shard, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) {
    for (int w = 0; w < kWorkers; ++w) {
      // Pull first, as a worker does (async refuses a push beyond what the worker pulled).
      PullRequest pull;
      pull.set_worker_id(w);
      pull.set_step(step);
      absl::Notification pulled;
      shard->Pull(pull, absl::Now() + absl::Seconds(10), [&](absl::Status s, PullResponse) {
        EXPECT_TRUE(s.ok()) << "pull of step " << step << ": " << s;
        pulled.Notify();
      });
      ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
      PushRequest push;
      push.set_worker_id(w);
      push.set_step(step);
      for (int t = 0; t < 2; ++t) {
        TensorValue* g = push.add_gradients();
        g->set_name(kNames[t]);
        FloatsToBytes(Values(t, static_cast<uint32_t>(step * 7 + w * 3 + t)), g->mutable_data());
      }
      absl::StatusOr<PushResponse> r = shard->Push(push);
      ASSERT_TRUE(r.ok()) << "step " << step << " worker " << w << ": " << r.status();
    }
  }
}

std::vector<std::vector<float>> Weights(ParameterShard* shard) {
  PullRequest pull;
  pull.set_worker_id(0);
  pull.set_step(0);
  absl::Notification done;
  PullResponse answer;
  shard->Pull(pull, absl::Now() + absl::Seconds(10), [&](absl::Status s, PullResponse r) {
    EXPECT_TRUE(s.ok()) << s;
    answer = std::move(r);
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::vector<std::vector<float>> out;
  for (const TensorValue& v : answer.tensors()) {
    out.emplace_back(v.data().size() / 4);
    BytesToFloats(v.data(), absl::MakeSpan(out.back()));
  }
  return out;
}

std::unique_ptr<ParameterShard> NewShard(const ShardOptions& options) {
  absl::StatusOr<std::unique_ptr<ParameterShard>> shard = ParameterShard::Create(options);
  EXPECT_TRUE(shard.ok()) << shard.status();
  return std::move(*shard);
}

struct Case {
  std::string name;
  ConsistencyMode mode;
  OptimizerConfig optimizer;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& type, ConsistencyMode mode, double lr, double momentum) {
    Case c{absl::StrCat(type, mode == BSP ? "/bsp" : "/async"), mode, {}};
    c.optimizer.set_type(type);
    c.optimizer.set_learning_rate(lr);
    if (momentum > 0) c.optimizer.set_momentum(momentum);
    if (type != "sgd") c.optimizer.set_weight_decay(0.01);
    cases.push_back(c);
  };
  add("sgd", BSP, 0.1, 0.9);
  add("adam", BSP, 0.01, 0);
  add("lars", BSP, 0.5, 0.9);
  add("lamb", BSP, 0.01, 0);
  add("sgd", ASYNC, 0.1, 0.9);
  add("lamb", ASYNC, 0.01, 0);
  return cases;
}

TEST(ShardCheckpointTest, RestoredShardContinuesBitIdenticallyForEveryOptimizer) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    ShardOptions options = Options(c.optimizer, c.mode);
    // The reference: 20 steps, never interrupted.
    std::unique_ptr<ParameterShard> reference = NewShard(options);
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_TRUE(reference->Register(Registration(w, c.mode, true)).ok());
    }
    ASSERT_NO_FATAL_FAILURE(Train(reference.get(), 0, 20));

    // The same job checkpointing every 4 steps, stopped after 10: checkpoints of steps 0 (when
    // training started), 4 and 8.
    const std::string dir = absl::StrCat(::testing::TempDir(), "/shard_ckpt_", c.name);
    ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'; mkdir -p '", dir, "'").c_str()), 0);
    absl::Mutex mu;
    std::vector<std::shared_ptr<const CapturedCheckpoint>> captured;
    options.checkpoint_every_steps = 4;
    options.on_checkpoint = [&](std::shared_ptr<const CapturedCheckpoint> capture) {
      absl::MutexLock lock(&mu);
      captured.push_back(std::move(capture));
    };
    std::unique_ptr<ParameterShard> first = NewShard(options);
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_TRUE(first->Register(Registration(w, c.mode, true)).ok());
    }
    ASSERT_NO_FATAL_FAILURE(Train(first.get(), 0, 10));
    std::vector<std::shared_ptr<const CapturedCheckpoint>> taken;
    {
      absl::MutexLock lock(&mu);
      taken = captured;
    }
    // Not under `mu`: on_checkpoint takes it under a tensor's lock, and CheckpointProto takes
    // the shard's, which comes before a tensor's.
    ASSERT_EQ(taken.size(), 3u);
    EXPECT_EQ(taken[0]->step, 0);
    EXPECT_EQ(taken[1]->step, 4);
    EXPECT_EQ(taken[2]->step, 8);
    for (const auto& capture : taken) {
      ASSERT_TRUE(WriteCheckpoint(dir, first->CheckpointProto(*capture), 3).ok());
    }
    EXPECT_EQ(first->Stats().last_checkpoint_step(), 8);
    first.reset();

    // A new shard restored from the newest file, trained from step 8 on.
    absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = LoadNewestCheckpoint(dir, 0);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_TRUE(loaded->has_value());
    ASSERT_EQ((*loaded)->checkpoint.step(), 8);
    std::unique_ptr<ParameterShard> restored = NewShard(options);
    ASSERT_TRUE(restored->Restore((*loaded)->checkpoint).ok());
    for (int w = 0; w < kWorkers; ++w) {
      absl::StatusOr<RegisterResponse> r = restored->Register(Registration(w, c.mode, false));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->resume_step(), 8) << "worker " << w;
      EXPECT_FALSE(r->needs_initial_values());
    }
    EXPECT_EQ(restored->Stats().restored_step(), 8);
    ASSERT_NO_FATAL_FAILURE(Train(restored.get(), 8, 20));
    EXPECT_EQ(restored->Stats().applied_updates(),
              reference->Stats().applied_updates() - (c.mode == BSP ? 8 * 2 : 8 * 2 * kWorkers));
    const auto want = Weights(reference.get());
    const auto got = Weights(restored.get());
    ASSERT_EQ(got.size(), want.size());
    for (size_t t = 0; t < want.size(); ++t) {
      ASSERT_EQ(got[t].size(), want[t].size());
      for (size_t i = 0; i < want[t].size(); ++i) {
        ASSERT_EQ(got[t][i], want[t][i]) << "tensor " << t << " element " << i;
      }
    }
    EXPECT_EQ(restored->Stats().learning_rate(), reference->Stats().learning_rate());

    // From the checkpoint of step 0, taken before any update: a shard killed before its first
    // interval's checkpoint has it to restore, and trains to the same weights.
    absl::StatusOr<std::optional<LoadedCheckpoint>> start = LoadNewestCheckpoint(dir, 0, 0);
    ASSERT_TRUE(start.ok()) << start.status();
    ASSERT_TRUE(start->has_value());
    {
      absl::MutexLock lock(&mu);
      captured.clear();
    }
    std::unique_ptr<ParameterShard> from_zero = NewShard(options);
    ASSERT_TRUE(from_zero->Restore((*start)->checkpoint).ok());
    for (int w = 0; w < kWorkers; ++w) {
      absl::StatusOr<RegisterResponse> r = from_zero->Register(Registration(w, c.mode, false));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->resume_step(), 0) << "worker " << w;
    }
    EXPECT_EQ(from_zero->Stats().restored_step(), 0);
    ASSERT_NO_FATAL_FAILURE(Train(from_zero.get(), 0, 20));
    const auto again = Weights(from_zero.get());
    for (size_t t = 0; t < want.size(); ++t) {
      ASSERT_EQ(again[t], want[t]) << "tensor " << t;
    }
    {
      absl::MutexLock lock(&mu);
      ASSERT_FALSE(captured.empty());
      EXPECT_EQ(captured[0]->step, 4) << "a restored shard takes no second step-0 checkpoint";
    }
  }
}

// The integration test's case in miniature: an ssp:2 shard is restored from its checkpoint of step
// 4 while the workers had gone on to step 9. They register again at step 9, where they go on (ssp
// does not rewind): their next pulls must be answered at once, not wait for clocks of 7 that no
// one will push (the steps they computed before the restart are lost to this shard, not redone).
TEST(ShardCheckpointTest, WorkersRejoinARestoredSspShardAtTheirOwnStep) {
  OptimizerConfig sgd;
  sgd.set_type("sgd");
  sgd.set_learning_rate(0.1);
  ShardOptions options = Options(sgd, SSP);
  options.cluster.mutable_consistency()->set_staleness(2);
  options.checkpoint_every_steps = 4;
  absl::Mutex mu;
  std::shared_ptr<const CapturedCheckpoint> last;
  options.on_checkpoint = [&](std::shared_ptr<const CapturedCheckpoint> c) {
    absl::MutexLock lock(&mu);
    if (last == nullptr && c->step == 4) last = std::move(c);
  };
  auto registration = [](int w, bool with_values) {
    RegisterRequest r = Registration(w, SSP, with_values);
    r.mutable_consistency()->set_staleness(2);
    return r;
  };
  std::unique_ptr<ParameterShard> first = NewShard(options);
  for (int w = 0; w < kWorkers; ++w) {
    absl::StatusOr<RegisterResponse> r = first->Register(registration(w, true));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  ASSERT_NO_FATAL_FAILURE(Train(first.get(), 0, 9));
  std::shared_ptr<const CapturedCheckpoint> capture;
  {
    absl::MutexLock lock(&mu);
    capture = last;
  }
  ASSERT_NE(capture, nullptr);
  ASSERT_EQ(capture->step, 4);
  const ShardCheckpoint checkpoint = first->CheckpointProto(*capture);
  first.reset();

  options.on_checkpoint = nullptr;
  std::unique_ptr<ParameterShard> restored = NewShard(options);
  ASSERT_TRUE(restored->Restore(checkpoint).ok());
  for (int w = 0; w < kWorkers; ++w) {
    RegisterRequest again = registration(w, false);
    again.set_resume_step(9);
    absl::StatusOr<RegisterResponse> r = restored->Register(again);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->resume_step(), 9) << "worker " << w;
  }
  for (int w = 0; w < kWorkers; ++w) {
    PullRequest pull;
    pull.set_worker_id(w);
    pull.set_step(9);
    absl::Notification pulled;
    absl::Status status = absl::UnknownError("no answer");
    restored->Pull(pull, absl::Now() + absl::Seconds(2), [&](absl::Status s, PullResponse) {
      status = s;
      pulled.Notify();
    });
    ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(status.ok()) << "worker " << w << "'s pull of step 9: " << status;
  }
  ASSERT_NO_FATAL_FAILURE(Train(restored.get(), 9, 12));
  EXPECT_EQ(restored->Stats().duplicate_gradients(), 0);
}

RollbackRequest RollbackTo(int64_t step, uint64_t id, int worker = 0) {
  RollbackRequest r;
  r.set_worker_id(worker);
  r.set_step(step);
  r.set_recovery_id(id);
  return r;
}

TEST(ShardCheckpointTest, RollbackRules) {
  OptimizerConfig sgd;
  sgd.set_type("sgd");
  sgd.set_learning_rate(0.1);
  // A live bsp shard at step 6 with a roll-back hook that records what it was asked.
  ShardOptions options = Options(sgd, BSP);
  std::vector<std::pair<int64_t, uint64_t>> asked;
  absl::Status hook_answer;
  options.on_rollback = [&](int64_t step, uint64_t id) -> absl::StatusOr<int64_t> {
    asked.emplace_back(step, id);
    if (!hook_answer.ok()) return hook_answer;
    return step;
  };
  std::unique_ptr<ParameterShard> shard = NewShard(options);
  for (int w = 0; w < kWorkers; ++w) {
    absl::StatusOr<RegisterResponse> r = shard->Register(Registration(w, BSP, true));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->recovery_id(), 0u) << "a fresh shard belongs to no recovery";
  }
  ASSERT_NO_FATAL_FAILURE(Train(shard.get(), 0, 6));

  EXPECT_EQ(shard->Rollback(RollbackTo(4, 7, kWorkers)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard->Rollback(RollbackTo(-1, 7)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard->Rollback(RollbackTo(4, 0)).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<RollbackResponse> forward = shard->Rollback(RollbackTo(9, 7));
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(forward.status().message(), HasSubstr("cannot go forward"));
  EXPECT_FALSE(forward.ok() && forward->behind()) << "a shard never restored is not behind";
  EXPECT_TRUE(asked.empty()) << "a refused roll-back reached the hook";

  // The hook's refusal is the answer.
  hook_answer = absl::FailedPreconditionError("the checkpoint directory cannot be read");
  EXPECT_EQ(shard->Rollback(RollbackTo(4, 7)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // No checkpoint of that step (the writer skipped it): nothing agreed, and the answer names the
  // newest before it.
  hook_answer = absl::OkStatus();
  {
    auto lacking = [&](int64_t, uint64_t) -> absl::StatusOr<int64_t> { return 0; };
    ShardOptions o = options;
    o.on_rollback = lacking;
    std::unique_ptr<ParameterShard> skipped = NewShard(o);
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_TRUE(skipped->Register(Registration(w, BSP, true)).ok());
    }
    ASSERT_NO_FATAL_FAILURE(Train(skipped.get(), 0, 6));
    absl::StatusOr<RollbackResponse> missing = skipped->Rollback(RollbackTo(4, 7));
    ASSERT_TRUE(missing.ok()) << missing.status();
    EXPECT_FALSE(missing->restarting());
    EXPECT_TRUE(missing->lacks_checkpoint());
    EXPECT_EQ(missing->newest_checkpoint_before(), 0);
    EXPECT_EQ(skipped->recovery_id(), 0u) << "it joined a recovery it cannot restore";
  }
  absl::StatusOr<RollbackResponse> ok = shard->Rollback(RollbackTo(4, 7));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->restarting());
  EXPECT_FALSE(ok->lacks_checkpoint());
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[1], std::make_pair(int64_t{4}, uint64_t{7}));

  // A shard of that recovery already answers at once, without the hook.
  shard->SetRecoveryId(7);
  ok = shard->Rollback(RollbackTo(4, 7, 1));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->restarting());
  EXPECT_EQ(asked.size(), 2u);

  // Without checkpoints there is nothing to roll back to: the error says what to do instead.
  ShardOptions bare = Options(sgd, BSP);
  std::unique_ptr<ParameterShard> no_checkpoints = NewShard(bare);
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(no_checkpoints->Register(Registration(w, BSP, true)).ok());
  }
  absl::StatusOr<RollbackResponse> none = no_checkpoints->Rollback(RollbackTo(0, 7));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("--restore_step=0"));

  // async and ssp never roll back.
  std::unique_ptr<ParameterShard> async = NewShard(Options(sgd, ASYNC));
  EXPECT_EQ(async->Rollback(RollbackTo(0, 7)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShardCheckpointTest, AShardRestoredAtTheStepAndUntouchedJoinsTheRecoveryInPlace) {
  OptimizerConfig sgd;
  sgd.set_type("sgd");
  sgd.set_learning_rate(0.1);
  ShardOptions options = Options(sgd, BSP);
  options.checkpoint_every_steps = 4;
  absl::Mutex mu;
  std::shared_ptr<const CapturedCheckpoint> last;
  options.on_checkpoint = [&](std::shared_ptr<const CapturedCheckpoint> c) {
    absl::MutexLock lock(&mu);
    last = std::move(c);
  };
  int hook_calls = 0;
  options.on_rollback = [&](int64_t step, uint64_t) -> absl::StatusOr<int64_t> {
    ++hook_calls;
    return step;
  };
  std::unique_ptr<ParameterShard> first = NewShard(options);
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(first->Register(Registration(w, BSP, true)).ok());
  }
  ASSERT_NO_FATAL_FAILURE(Train(first.get(), 0, 5));
  std::shared_ptr<const CapturedCheckpoint> capture;
  {
    absl::MutexLock lock(&mu);
    capture = last;
  }
  ASSERT_NE(capture, nullptr);
  ASSERT_EQ(capture->step, 4);
  const ShardCheckpoint checkpoint = first->CheckpointProto(*capture);
  std::unique_ptr<ParameterShard> restored = NewShard(options);
  ASSERT_TRUE(restored->Restore(checkpoint).ok());
  restored->SetRecoveryId(11);
  absl::StatusOr<RollbackResponse> r = restored->Rollback(RollbackTo(4, 22));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->restarting()) << "restoring step 4 again would change nothing";
  EXPECT_EQ(restored->recovery_id(), 22u);
  EXPECT_EQ(hook_calls, 0);
  // Once it has trained past the step, rolling back needs the restart.
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(restored->Register(Registration(w, BSP, false)).ok());
  }
  ASSERT_NO_FATAL_FAILURE(Train(restored.get(), 4, 6));
  // Asked to roll back to a step after its restore but ahead of where it stands (another worker's
  // roll-back brought it back meanwhile), it answers behind, agrees to nothing, and stays.
  r = restored->Rollback(RollbackTo(8, 44));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->behind());
  EXPECT_FALSE(r->restarting());
  EXPECT_EQ(hook_calls, 0);
  EXPECT_EQ(restored->recovery_id(), 22u);
  r = restored->Rollback(RollbackTo(4, 33));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->restarting());
  EXPECT_FALSE(r->behind());
  EXPECT_EQ(hook_calls, 1);
}

TEST(ShardCheckpointTest, AnotherJobsCheckpointIsRefusedNamingTheDifference) {
  OptimizerConfig adam;
  adam.set_type("adam");
  adam.set_learning_rate(0.01);
  ShardOptions options = Options(adam, BSP);
  std::shared_ptr<const CapturedCheckpoint> capture;
  options.checkpoint_every_steps = 2;
  options.on_checkpoint = [&](std::shared_ptr<const CapturedCheckpoint> c) { capture = c; };
  std::unique_ptr<ParameterShard> shard = NewShard(options);
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(shard->Register(Registration(w, BSP, true)).ok());
  }
  ASSERT_NO_FATAL_FAILURE(Train(shard.get(), 0, 2));
  ASSERT_NE(capture, nullptr);
  const ShardCheckpoint good = shard->CheckpointProto(*capture);

  OptimizerConfig lamb = adam;
  lamb.set_type("lamb");
  EXPECT_THAT(NewShard(Options(lamb, BSP))->Restore(good).message(), HasSubstr("optimizer"));
  EXPECT_THAT(NewShard(Options(adam, ASYNC))->Restore(good).message(), HasSubstr("mode"));
  ShardCheckpoint torn = good;
  torn.mutable_tensors(1)->set_version(1);  // Not a consistent cut.
  EXPECT_TRUE(absl::IsDataLoss(NewShard(options)->Restore(torn)));
  ShardCheckpoint short_values = good;
  short_values.mutable_tensors(0)->mutable_values()->resize(12);
  EXPECT_TRUE(absl::IsDataLoss(NewShard(options)->Restore(short_values)));
  ShardCheckpoint bad_slots = good;
  bad_slots.mutable_tensors(0)->mutable_optimizer_state()->mutable_slot2()->resize(8);
  EXPECT_TRUE(absl::IsDataLoss(NewShard(options)->Restore(bad_slots)));
  // After training started, a restore is refused.
  EXPECT_TRUE(absl::IsFailedPrecondition(shard->Restore(good)));
}

}  // namespace
}  // namespace rubato
