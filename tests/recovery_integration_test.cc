// Checkpoints end to end: a bsp job whose every process is killed with SIGKILL mid-run is started
// again on the same --checkpoint_dir, resumes from the shards' newest common checkpoint, and ends
// with parameters bit-identical to a run that was never interrupted (the same updates in the same
// order, the same examples from the resumed step on). Redone work is counted from the logs.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/test_cluster.h"

namespace rubato {
namespace {

constexpr int kShards = 2;
constexpr int kWorkers = 2;
constexpr int kEvery = 20;
constexpr int kSteps = 160;

std::vector<std::string> WorkerFlags() {
  return {absl::StrCat("--data_dir=", kFashionMnistDir), "--train_limit=6000", "--test_limit=1000",
          absl::StrCat("--steps=", kSteps), "--log_every=1"};
}

// The highest step a step record names.
int64_t LastStep(const std::string& out) {
  int64_t last = -1;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(out, '\n'))) {
    if (line.find("\"event\":\"step\"") == std::string::npos) continue;
    int64_t step = -1;
    if (absl::SimpleAtoi(JsonField(line, "step"), &step)) last = std::max(last, step);
  }
  return last;
}

// The last `lines` lines of `text`.
std::string Tail(const std::string& text, int lines) {
  size_t at = text.size();
  while (lines-- > 0 && at > 0) {
    const size_t nl = text.rfind('\n', at - 1);
    if (nl == std::string::npos) return text;
    at = nl;
  }
  return text.substr(at);
}

// What every process of `cluster` last said: for a failure message.
std::string DescribeJob(TestCluster* cluster) {
  std::string out;
  for (int w = 0; w < kWorkers; ++w) {
    absl::StrAppend(&out, "\n--- worker ", w,
                    " stdout (tail):", Tail(cluster->worker(w)->ReadStdout(), 4), "\n--- worker ",
                    w, " stderr (tail):", Tail(cluster->worker(w)->ReadStderr(), 8));
  }
  for (int s = 0; s < kShards; ++s) {
    absl::StrAppend(&out, "\n--- shard ", s,
                    " stderr (tail):", Tail(cluster->server(s)->ReadStderr(), 12));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<TestCluster>> Start(const std::string& checkpoint_dir,
                                                   const std::string& export_model = "",
                                                   int64_t restore_step = -1,
                                                   const std::string& mode = "bsp",
                                                   int every = kEvery) {
  ASSIGN_OR_RETURN(std::unique_ptr<TestCluster> cluster, TestCluster::Create());
  TestServerOptions options;
  options.num_shards = kShards;
  options.num_workers = kWorkers;
  options.extra_flags = {"--learning_rate=0.05", "--optimizer=adam", "--mode=" + mode};
  if (!checkpoint_dir.empty()) {
    options.extra_flags.push_back("--checkpoint_dir=" + checkpoint_dir);
    options.extra_flags.push_back(absl::StrCat("--checkpoint_every_steps=", every));
  }
  if (restore_step >= 0) {
    options.extra_flags.push_back(absl::StrCat("--restore_step=", restore_step));
  }
  RETURN_IF_ERROR(cluster->StartServers(options));
  std::vector<std::string> flags = WorkerFlags();
  flags.push_back("--mode=" + mode);
  if (!export_model.empty()) flags.push_back("--export_model=" + export_model);
  for (int w = 0; w < kWorkers; ++w) RETURN_IF_ERROR(cluster->StartWorker(w, flags).status());
  return cluster;
}

// Waits for every worker to exit, as TestCluster::WaitForWorkers, meanwhile playing the shards'
// supervisor (./rubato launch --restart_servers, Kubernetes): a shard that exits with status 75
// stopped to roll back under bsp, and is started again at once. A shard that exits 0 has seen
// every worker finish (the workers' own exits may not be seen yet). Any other exit of a shard
// before the workers are done is an error naming it. *rollbacks counts the restarts.
absl::StatusOr<std::map<int, int>> SuperviseUntilWorkersEnd(TestCluster* cluster,
                                                            absl::Duration timeout,
                                                            int* rollbacks) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<bool> done(kShards, false);
  for (;;) {
    for (int s = 0; s < kShards; ++s) {
      if (done[s]) continue;
      absl::StatusOr<int> status = cluster->server(s)->Wait(absl::ZeroDuration());
      if (!status.ok()) continue;  // Running.
      if (*status == 0) {
        done[s] = true;
        continue;
      }
      if (*status != 75) {
        return absl::FailedPreconditionError(absl::StrCat(
            "shard ", s, " exited with status ", *status, ": ", cluster->server(s)->ReadStderr()));
      }
      RETURN_IF_ERROR(cluster->RestartServer(s));
      ++*rollbacks;
    }
    absl::StatusOr<std::map<int, int>> exits = cluster->WaitForWorkers(absl::Milliseconds(100));
    if (exits.ok() || absl::Now() >= deadline) return exits;
  }
}

TEST(RecoveryIntegrationTest, AKilledBspJobResumesFromItsCheckpointsBitIdentically) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  // The reference: never interrupted.
  std::string want;
  {
    absl::StatusOr<std::unique_ptr<TestCluster>> reference = Start("");
    ASSERT_TRUE(IsOk(reference));
    absl::StatusOr<std::map<int, int>> exits = (*reference)->WaitForWorkers(absl::Seconds(120));
    ASSERT_TRUE(IsOk(exits));
    want = ParamsFingerprint((*reference)->worker(0)->ReadStdout());
    ASSERT_EQ(want.size(), 16u) << (*reference)->worker(0)->ReadStdout();
    EXPECT_EQ(ParamsFingerprint((*reference)->worker(1)->ReadStdout()), want);
  }

  const std::string dir = ::testing::TempDir() + "/recovery_checkpoints";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  int64_t killed_at = -1;
  int64_t common = -1;  // The newest step both shards have a checkpoint of.
  bool differ = false;
  {
    absl::StatusOr<std::unique_ptr<TestCluster>> first = Start(dir);
    ASSERT_TRUE(IsOk(first));
    // Until both shards have a checkpoint of step 60 or later, then SIGKILL everything.
    const absl::Time deadline = absl::Now() + absl::Seconds(90);
    auto newest = [&](int shard) {
      absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, shard);
      return files.ok() && !files->empty() ? (*files)[0].step : int64_t{-1};
    };
    while ((newest(0) < 60 || newest(1) < 60) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_GE(std::min(newest(0), newest(1)), 60) << "no checkpoint of step 60 in 90 s";
    // Then at a random moment within about one checkpoint interval.
    const int64_t extra_ms = absl::ToUnixMicros(absl::Now()) % 300;
    std::printf("killing %lld ms after the checkpoint of step 60\n",
                static_cast<long long>(extra_ms));
    absl::SleepFor(absl::Milliseconds(extra_ms));
    for (int w = 0; w < kWorkers; ++w) ASSERT_TRUE(IsOk((*first)->worker(w)->Signal(SIGKILL)));
    for (int s = 0; s < kShards; ++s) ASSERT_TRUE(IsOk((*first)->server(s)->Signal(SIGKILL)));
    ASSERT_TRUE(IsOk((*first)->WaitForWorkers(absl::Seconds(10))));
    for (int w = 0; w < kWorkers; ++w) {
      killed_at = std::max(killed_at, LastStep((*first)->worker(w)->ReadStdout()));
    }
    ASSERT_LT(killed_at, kSteps - 1) << "the job ended before it was killed";
    common = std::min(newest(0), newest(1));
    differ = newest(0) != newest(1);
  }
  // Everything again, on the same directory. Each shard's writer works at its own pace, so the
  // shards' newest checkpoints may differ: then the workers roll the one ahead back to the other's
  // step (it restarts, supervised here), and the job goes on from the newest common step.
  absl::StatusOr<std::unique_ptr<TestCluster>> second = Start(dir);
  ASSERT_TRUE(IsOk(second));
  int rollbacks = 0;
  absl::StatusOr<std::map<int, int>> exits =
      SuperviseUntilWorkersEnd(second->get(), absl::Seconds(120), &rollbacks);
  if (differ) {
    std::printf("the shards' newest checkpoints differed: %d roll-back restart(s) to step %lld\n",
                rollbacks, static_cast<long long>(common));
    EXPECT_GE(rollbacks, 1);
  } else {
    EXPECT_EQ(rollbacks, 0) << "shards restored at one step need no roll-back";
  }
  ASSERT_TRUE(IsOk(exits));
  int64_t resumed_at = -1;
  for (int w = 0; w < kWorkers; ++w) {
    Subprocess* worker = (*second)->worker(w);
    ASSERT_EQ(exits->at(w), 0) << worker->ReadStderr();
    EXPECT_EQ(ParamsFingerprint(worker->ReadStdout()), want)
        << "worker " << w << "'s final parameters differ from the uninterrupted run's";
  }
  for (int s = 0; s < kShards; ++s) {
    const std::string err = (*second)->server(s)->ReadStderr();
    ASSERT_TRUE(HasLineContaining(err, "restored shard")) << err;
    const size_t at = err.find(": step ");
    ASSERT_NE(at, std::string::npos) << err;
    int64_t step = -1;
    ASSERT_TRUE(absl::SimpleAtoi(
        err.substr(at + 7, err.find_first_not_of("0123456789", at + 7) - (at + 7)), &step));
    resumed_at = resumed_at < 0 ? step : resumed_at;
    EXPECT_EQ(step, resumed_at) << "the shards resumed from different steps";
  }
  EXPECT_TRUE(IsOk((*second)->WaitForServers(absl::Seconds(15))));
  // Redone work: the steps computed before the kill that were computed again.
  const int64_t redone = killed_at + 1 - resumed_at;
  std::printf("killed after step %lld, resumed at step %lld: %lld steps redone (interval %d)\n",
              static_cast<long long>(killed_at), static_cast<long long>(resumed_at),
              static_cast<long long>(redone), kEvery);
  ::testing::Test::RecordProperty("redone_steps", static_cast<int>(redone));
  EXPECT_GE(resumed_at, 60);
  EXPECT_EQ(resumed_at, common) << "the job did not resume from the newest step every shard kept";
  // Back to the newest checkpoint step the job reached before the kill, or to the one before it
  // when a shard's writer had not yet written that one (on a loaded machine, one or both: killed
  // after step 101, both shards had kept step 80 only).
  const int64_t reached = killed_at / kEvery * kEvery;
  EXPECT_GE(resumed_at, reached - kEvery)
      << "more checkpoint intervals were redone than the shards' newest checkpoints explain";
  EXPECT_LE(redone, 2 * kEvery + 1);
}

// One shard of a bsp job is SIGKILLed at a random moment after its checkpoint of step 60 and
// started again on the same address. It restores its newest checkpoint and so stands behind the
// other shard; the workers, registering again, roll that one back to the same step (it exits 75
// and is restarted, as a supervisor would), rewind to that step, and the job completes with
// parameters bit-identical to a run that was never interrupted.
TEST(RecoveryIntegrationTest, AKilledBspShardRollsTheJobBackToItsCheckpointBitIdentically) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  std::string want;
  {
    absl::StatusOr<std::unique_ptr<TestCluster>> reference = Start("");
    ASSERT_TRUE(IsOk(reference));
    ASSERT_TRUE(IsOk((*reference)->WaitForWorkers(absl::Seconds(120))));
    want = ParamsFingerprint((*reference)->worker(0)->ReadStdout());
    ASSERT_EQ(want.size(), 16u) << (*reference)->worker(0)->ReadStdout();
  }
  const std::string dir = ::testing::TempDir() + "/bsp_shard_restart";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  absl::StatusOr<std::unique_ptr<TestCluster>> job = Start(dir);
  ASSERT_TRUE(IsOk(job));
  auto newest = [&](int shard) {
    absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, shard);
    return files.ok() && !files->empty() ? (*files)[0].step : int64_t{-1};
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (newest(1) < 60 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_GE(newest(1), 60);
  const int64_t extra_ms = absl::ToUnixMicros(absl::Now()) % 300;
  absl::SleepFor(absl::Milliseconds(extra_ms));
  ASSERT_TRUE(IsOk((*job)->server(1)->Signal(SIGKILL)));
  ASSERT_TRUE(IsOk((*job)->server(1)->Wait(absl::Seconds(10))));
  int64_t killed_at = -1;
  for (int w = 0; w < kWorkers; ++w) {
    killed_at = std::max(killed_at, LastStep((*job)->worker(w)->ReadStdout()));
  }
  ASSERT_LT(killed_at, kSteps - 1) << "the job ended before the shard was killed";
  // The killed shard's writer works behind the job: on a loaded machine the job may be past
  // step 80 before that checkpoint is on disk, and the shard then restores the one before.
  const int64_t restored = newest(1);
  const bool writer_behind = restored < killed_at / kEvery * kEvery;
  ASSERT_TRUE(IsOk((*job)->RestartServer(1)));
  int rollbacks = 0;
  absl::StatusOr<std::map<int, int>> exits =
      SuperviseUntilWorkersEnd(job->get(), absl::Seconds(120), &rollbacks);
  ASSERT_TRUE(IsOk(exits));
  EXPECT_GE(rollbacks, 1) << "shard 0, ahead, was never rolled back";
  int64_t redone = 0;
  for (int w = 0; w < kWorkers; ++w) {
    Subprocess* worker = (*job)->worker(w);
    ASSERT_EQ(exits->at(w), 0) << worker->ReadStderr();
    const std::string out = worker->ReadStdout();
    EXPECT_EQ(ParamsFingerprint(out), want)
        << "worker " << w << "'s final parameters differ from the uninterrupted run's";
    int64_t r = -1;
    std::string done;
    for (const std::string& line : std::vector<std::string>(absl::StrSplit(out, '\n'))) {
      if (line.find("\"event\":\"done\"") != std::string::npos) done = line;
    }
    ASSERT_TRUE(absl::SimpleAtoi(JsonField(done, "redone_steps"), &r)) << done;
    redone = std::max(redone, r);
  }
  EXPECT_TRUE(IsOk((*job)->WaitForServers(absl::Seconds(30))));
  std::printf(
      "bsp: shard 1 killed %lld ms after its checkpoint of step 60 (the job near step "
      "%lld, its newest checkpoint of step %lld); %d roll-back restart(s); at most %lld steps "
      "redone by a worker (interval %d)\n",
      static_cast<long long>(extra_ms), static_cast<long long>(killed_at),
      static_cast<long long>(restored), rollbacks, static_cast<long long>(redone), kEvery);
  ::testing::Test::RecordProperty("redone_steps", static_cast<int>(redone));
  EXPECT_GE(restored, 60);
  EXPECT_GE(redone, 0);
  // At most one interval beyond the newest checkpoint; two when the shard's writer had not yet
  // written the newest interval's checkpoint when it was killed.
  EXPECT_LE(redone, (writer_behind ? 2 : 1) * kEvery + 1)
      << "more checkpoint intervals were redone than the shard's newest checkpoint explains";
}

// Shard 1 killed once a worker has reached `at_step`, then restarted: it restores its newest
// checkpoint. Under bsp the workers roll the other shard back to the same step and the job ends
// bit-identical to an uninterrupted one; under ssp:2 they rejoin the restored shard at their own
// steps and the job completes.
//   - Before the first interval's checkpoint (every 100 steps, as by default), from step 0 (as
//     soon as that checkpoint is on disk) to a worker's step 20: the checkpoint of step 0, taken
//     when training started, is what it restores.
//   - Around a checkpoint (every 20 steps, kills at steps 38-43), where the shards' newest
//     checkpoints may differ (the roll-back that hung once, issue 31 item 8).
struct EarlyKill {
  std::string mode;
  int64_t at_step;
  int every = 100;
};

class EarlyKillTest : public ::testing::TestWithParam<EarlyKill> {};

TEST_P(EarlyKillTest, AKilledShardRecoversFromItsNewestCheckpoint) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  const EarlyKill kill = GetParam();
  const bool bsp = kill.mode == "bsp";
  std::string want;
  if (bsp) {
    absl::StatusOr<std::unique_ptr<TestCluster>> reference = Start("");
    ASSERT_TRUE(IsOk(reference));
    ASSERT_TRUE(IsOk((*reference)->WaitForWorkers(absl::Seconds(120))));
    want = ParamsFingerprint((*reference)->worker(0)->ReadStdout());
    ASSERT_EQ(want.size(), 16u) << (*reference)->worker(0)->ReadStdout();
  }
  const std::string dir = absl::StrCat(::testing::TempDir(), "/early_kill_", bsp ? "bsp" : "ssp",
                                       "_", kill.at_step, "_", kill.every);
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  absl::StatusOr<std::unique_ptr<TestCluster>> job = Start(dir, "", -1, kill.mode, kill.every);
  ASSERT_TRUE(IsOk(job));
  auto step0_written = [&]() {
    absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 1);
    return files.ok() && !files->empty() && files->back().step == 0;
  };
  auto reached = [&]() {
    int64_t last = -1;
    for (int w = 0; w < kWorkers; ++w) {
      last = std::max(last, LastStep((*job)->worker(w)->ReadStdout()));
    }
    return last;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while ((!step0_written() || reached() < kill.at_step) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(step0_written()) << "no checkpoint of step 0 from shard 1" << DescribeJob(job->get());
  ASSERT_TRUE(IsOk((*job)->server(1)->Signal(SIGKILL)));
  ASSERT_TRUE(IsOk((*job)->server(1)->Wait(absl::Seconds(10))));
  const int64_t killed_at = reached();
  ASSERT_LT(killed_at, kSteps - 1) << "the job ended before the shard was killed";
  if (kill.every == 100) {
    ASSERT_LT(killed_at, 100) << "past the first interval's checkpoint";
  }
  ASSERT_TRUE(IsOk((*job)->RestartServer(1)));
  int rollbacks = 0;
  absl::StatusOr<std::map<int, int>> exits =
      SuperviseUntilWorkersEnd(job->get(), absl::Seconds(120), &rollbacks);
  ASSERT_TRUE(IsOk(exits)) << DescribeJob(job->get());
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_EQ(exits->at(w), 0) << "worker " << w << DescribeJob(job->get());
  }
  const std::string err = (*job)->server(1)->ReadStderr();
  if (kill.every == 100) {
    EXPECT_TRUE(HasLineContaining(err, "step 0 (recovery ")) << err;
  }
  EXPECT_TRUE(HasLineContaining(err, " (recovery ")) << "shard 1 restored nothing: " << err;
  if (bsp) {
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_EQ(ParamsFingerprint((*job)->worker(w)->ReadStdout()), want)
          << "worker " << w << "'s final parameters differ from the uninterrupted run's";
    }
  } else {
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_TRUE(HasLineContaining((*job)->worker(w)->ReadStdout(), "\"event\":\"rejoin\""))
          << "worker " << w << " never registered with the restarted shard";
    }
  }
  EXPECT_TRUE(IsOk((*job)->WaitForServers(absl::Seconds(30))));
  std::printf("%s, checkpoints every %d steps: shard 1 killed near step %lld; %d roll-back "
              "restart(s) of the other shard\n",
              kill.mode.c_str(), kill.every, static_cast<long long>(killed_at), rollbacks);
}

INSTANTIATE_TEST_SUITE_P(
    KillPoints, EarlyKillTest,
    ::testing::Values(EarlyKill{"bsp", 0}, EarlyKill{"bsp", 3}, EarlyKill{"bsp", 6},
                      EarlyKill{"bsp", 10}, EarlyKill{"bsp", 14}, EarlyKill{"bsp", 17},
                      EarlyKill{"bsp", 20}, EarlyKill{"ssp:2", 0}, EarlyKill{"ssp:2", 5},
                      EarlyKill{"ssp:2", 12}, EarlyKill{"ssp:2", 20}, EarlyKill{"bsp", 38, 20},
                      EarlyKill{"bsp", 39, 20}, EarlyKill{"bsp", 40, 20}, EarlyKill{"bsp", 41, 20},
                      EarlyKill{"bsp", 42, 20}, EarlyKill{"bsp", 43, 20},
                      EarlyKill{"ssp:2", 40, 20}),
    [](const ::testing::TestParamInfo<EarlyKill>& info) {
      return absl::StrCat(info.param.mode == "bsp" ? "Bsp" : "Ssp", "AtStep", info.param.at_step,
                          info.param.every == 100 ? "" : "Every20");
    });

// Without --checkpoint_dir a restarted shard has nothing to restore: the job cannot go on, and
// every worker must say why (issue 31: they said "worker N is not registered with shard 1", one a
// bare DEADLINE_EXCEEDED).
TEST(RecoveryIntegrationTest, AShardRestartedWithoutCheckpointsEndsTheJobSayingItLostItsState) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  absl::StatusOr<std::unique_ptr<TestCluster>> job = Start("");
  ASSERT_TRUE(IsOk(job));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (LastStep((*job)->worker(0)->ReadStdout()) < 10 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(IsOk((*job)->server(1)->Signal(SIGKILL)));
  ASSERT_TRUE(IsOk((*job)->server(1)->Wait(absl::Seconds(10))));
  ASSERT_TRUE(IsOk((*job)->RestartServer(1)));
  absl::StatusOr<std::map<int, int>> exits = (*job)->WaitForWorkers(absl::Seconds(90));
  ASSERT_TRUE(IsOk(exits)) << DescribeJob(job->get());
  for (int w = 0; w < kWorkers; ++w) {
    const std::string err = (*job)->worker(w)->ReadStderr();
    EXPECT_EQ(exits->at(w), 1) << "worker " << w << ": " << err;
    EXPECT_TRUE(HasLineContaining(err, "the shard started afresh after the worker registered"))
        << "worker " << w << ": " << err;
  }
}

// One shard of an async or ssp:2 job is SIGKILLed after its checkpoint of step 60 and started
// again on the same address: it restores that checkpoint, the workers (which retried it while it
// was down) register again when it answers ABORTED, and the job completes. The updates that shard
// lost are those since its checkpoint. The final accuracy must be at most 1 point below the worse
// of two uninterrupted runs: async and ssp runs differ from each other by about a point here, so
// one run is no yardstick.
// Returns the recovered run's accuracy and the range of the uninterrupted ones.
void KillAndRestartAShard(const std::string& mode, double* accuracy, double* low, double* high) {
  // Plain SGD: async with Adam at this rate swung by 10 points from run to run. Cosine decay to
  // 0 over the job, so that the final weights settle: at a constant rate the last iterate's
  // accuracy wandered by more than a point from run to run (a recovered async run scored 1.8
  // points below two uninterrupted ones on CI), which a 1-point check cannot tell from a fault.
  const std::vector<std::string> server_flags = {"--learning_rate=0.1", "--optimizer=sgd",
                                                 "--lr_decay=cosine", "--mode=" + mode};
  std::vector<std::string> worker_flags = WorkerFlags();
  worker_flags.push_back("--steps=600");
  worker_flags.push_back("--test_limit=10000");  // The whole test set: less evaluation noise.
  worker_flags.push_back("--mode=" + mode);
  auto run = [&](const std::string& dir) -> absl::StatusOr<std::unique_ptr<TestCluster>> {
    ASSIGN_OR_RETURN(std::unique_ptr<TestCluster> cluster, TestCluster::Create());
    TestServerOptions options;
    options.num_shards = kShards;
    options.num_workers = kWorkers;
    options.extra_flags = server_flags;
    if (!dir.empty()) {
      options.extra_flags.push_back("--checkpoint_dir=" + dir);
      options.extra_flags.push_back(absl::StrCat("--checkpoint_every_steps=", kEvery));
    }
    RETURN_IF_ERROR(cluster->StartServers(options));
    for (int w = 0; w < kWorkers; ++w) {
      RETURN_IF_ERROR(cluster->StartWorker(w, worker_flags).status());
    }
    return cluster;
  };
  *low = 1;
  *high = 0;
  for (int repeat = 0; repeat < 2; ++repeat) {
    absl::StatusOr<std::unique_ptr<TestCluster>> plain = run("");
    ASSERT_TRUE(IsOk(plain));
    ASSERT_TRUE(IsOk((*plain)->WaitForWorkers(absl::Seconds(120))));
    absl::StatusOr<double> a = FinalTestAccuracy((*plain)->worker(0)->ReadStdout());
    ASSERT_TRUE(IsOk(a));
    *low = std::min(*low, *a);
    *high = std::max(*high, *a);
  }
  const std::string dir = ::testing::TempDir() + "/restart_" + mode;
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  absl::StatusOr<std::unique_ptr<TestCluster>> job = run(dir);
  ASSERT_TRUE(IsOk(job));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto newest = [&]() {
    absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 1);
    return files.ok() && !files->empty() ? (*files)[0].step : int64_t{-1};
  };
  while (newest() < 60 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_GE(newest(), 60);
  ASSERT_TRUE(IsOk((*job)->server(1)->Signal(SIGKILL)));
  ASSERT_TRUE(IsOk((*job)->server(1)->Wait(absl::Seconds(10))));
  int64_t killed_at = -1;
  for (int w = 0; w < kWorkers; ++w) {
    killed_at = std::max(killed_at, LastStep((*job)->worker(w)->ReadStdout()));
  }
  const int64_t checkpoint = newest();
  ASSERT_TRUE(IsOk((*job)->RestartServer(1)));
  absl::StatusOr<std::map<int, int>> exits = (*job)->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(exits)) << DescribeJob(job->get());
  for (int w = 0; w < kWorkers; ++w) {
    Subprocess* worker = (*job)->worker(w);
    ASSERT_EQ(exits->at(w), 0) << worker->ReadStderr();
    EXPECT_TRUE(HasLineContaining(worker->ReadStdout(), "\"event\":\"rejoin\""))
        << "worker " << w << " never registered with the restarted shard";
  }
  const std::string err = (*job)->server(1)->ReadStderr();
  EXPECT_TRUE(HasLineContaining(err, absl::StrCat("step ", checkpoint, " (recovery "))) << err;
  EXPECT_TRUE(IsOk((*job)->WaitForServers(absl::Seconds(30))));
  absl::StatusOr<double> a = FinalTestAccuracy((*job)->worker(0)->ReadStdout());
  ASSERT_TRUE(IsOk(a));
  *accuracy = *a;
  std::printf(
      "%s: killed near step %lld, shard 1 restored step %lld (%lld steps of its updates "
      "lost); accuracy %.4f against %.4f-%.4f uninterrupted\n",
      mode.c_str(), static_cast<long long>(killed_at), static_cast<long long>(checkpoint),
      static_cast<long long>(killed_at + 1 - checkpoint), *accuracy, *low, *high);
  EXPECT_LE(killed_at + 1 - checkpoint, 2 * kEvery) << "more than two intervals were lost";
}

TEST(RecoveryIntegrationTest, AKilledAsyncShardRestartsFromItsCheckpoint) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  double accuracy = -1, low = -1, high = -1;
  ASSERT_NO_FATAL_FAILURE(KillAndRestartAShard("async", &accuracy, &low, &high));
  // The fault may cost at most 1 point. There is no upper bound: async accuracy depends on
  // timing, which the restart changes; higher is no failure of recovery. Measured with the cosine
  // decay (two runs of each, both tests at once on 2 cores): uninterrupted 0.8264-0.8272,
  // recovered 0.8260 and 0.8270; ssp:2 0.8265-0.8270 against 0.8265 and 0.8277.
  EXPECT_GE(accuracy, low - 0.01 - 1e-9);
}

TEST(RecoveryIntegrationTest, AKilledSspShardRestartsFromItsCheckpoint) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  double accuracy = -1, low = -1, high = -1;
  ASSERT_NO_FATAL_FAILURE(KillAndRestartAShard("ssp:2", &accuracy, &low, &high));
  EXPECT_GE(accuracy, low - 0.01 - 1e-9);  // See the async case.
}

TEST(RecoveryIntegrationTest, AnExportedModelEvaluatesToTheJobsLastAccuracy) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST at " << kFashionMnistDir;
  const std::string path = ::testing::TempDir() + "/exported.rbm";
  absl::StatusOr<std::unique_ptr<TestCluster>> job = Start("", path);
  ASSERT_TRUE(IsOk(job));
  absl::StatusOr<std::map<int, int>> exits = (*job)->WaitForWorkers(absl::Seconds(120));
  ASSERT_TRUE(IsOk(exits));
  ASSERT_EQ(exits->at(0), 0) << (*job)->worker(0)->ReadStderr();
  absl::StatusOr<double> job_accuracy = FinalTestAccuracy((*job)->worker(0)->ReadStdout());
  ASSERT_TRUE(IsOk(job_accuracy));
  absl::StatusOr<std::string> binary = TestCluster::WorkerBinary();
  ASSERT_TRUE(IsOk(binary));
  absl::StatusOr<ProcessResult> eval = (*job)->Run(
      "eval", *binary,
      {"--eval_model=" + path, absl::StrCat("--data_dir=", kFashionMnistDir), "--test_limit=1000"},
      absl::Seconds(60));
  ASSERT_TRUE(IsOk(eval));
  ASSERT_EQ(eval->exit_status, 0) << eval->stderr_text;
  ASSERT_TRUE(HasLineContaining(eval->stdout_text, "\"event\":\"eval_model\""))
      << eval->stdout_text;
  double accuracy = -1;
  ASSERT_TRUE(absl::SimpleAtod(JsonField(eval->stdout_text, "test_accuracy"), &accuracy))
      << eval->stdout_text;
  EXPECT_EQ(accuracy, *job_accuracy) << "the exported weights are not the ones the job evaluated";
  EXPECT_EQ(JsonField(eval->stdout_text, "steps"), absl::StrCat(kSteps));
  EXPECT_EQ(JsonField(eval->stdout_text, "mode"), "bsp");
  // Its epsilon-sharpness (worker/model/sharpness.h): a rise of the training loss within the box, larger
  // for the larger box, on the loss the model was trained on.
  absl::StatusOr<ProcessResult> sharp = (*job)->Run(
      "sharpness", *binary,
      {"--sharpness=" + path, absl::StrCat("--data_dir=", kFashionMnistDir),
       "--sharpness_examples=2000", "--sharpness_steps=3", "--sharpness_epsilon=1e-2,1e-3"},
      absl::Seconds(60));
  ASSERT_TRUE(IsOk(sharp));
  ASSERT_EQ(sharp->exit_status, 0) << sharp->stderr_text;
  std::vector<double> phi;
  for (absl::string_view line : absl::StrSplit(sharp->stdout_text, '\n')) {
    if (!absl::StrContains(line, "\"event\":\"sharpness\"")) continue;
    double v = -1, loss = -1, max_loss = -1;
    ASSERT_TRUE(absl::SimpleAtod(JsonField(std::string(line), "sharpness"), &v)) << line;
    ASSERT_TRUE(absl::SimpleAtod(JsonField(std::string(line), "loss"), &loss)) << line;
    ASSERT_TRUE(absl::SimpleAtod(JsonField(std::string(line), "max_loss"), &max_loss)) << line;
    EXPECT_GT(loss, 0.1) << line;  // A real training loss, not a placeholder.
    EXPECT_GT(max_loss, loss) << line;
    EXPECT_NEAR(v, 100 * (max_loss - loss) / (1 + loss), 1e-3 * v + 1e-4) << line;
    phi.push_back(v);
  }
  ASSERT_EQ(phi.size(), 2u) << sharp->stdout_text;
  EXPECT_GT(phi[0], phi[1]) << "a 10x larger box found a smaller rise";
  absl::StatusOr<ProcessResult> bad_eps =
      (*job)->Run("sharpness-bad", *binary,
                  {"--sharpness=" + path, "--sharpness_epsilon=1e-3,zero"}, absl::Seconds(60));
  ASSERT_TRUE(IsOk(bad_eps));
  EXPECT_EQ(bad_eps->exit_status, 2);
  EXPECT_TRUE(HasLineContaining(bad_eps->stderr_text, "'zero' is not a positive number"))
      << bad_eps->stderr_text;
  // A damaged file is refused, naming it.
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  absl::StatusOr<ProcessResult> bad = (*job)->Run(
      "eval-bad", *binary, {"--eval_model=" + path, absl::StrCat("--data_dir=", kFashionMnistDir)},
      absl::Seconds(60));
  ASSERT_TRUE(IsOk(bad));
  EXPECT_EQ(bad->exit_status, 2);
  EXPECT_TRUE(HasLineContaining(bad->stderr_text, "truncated")) << bad->stderr_text;
}

}  // namespace
}  // namespace rubato
