#include "server/checkpoint.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/", name);
  std::string command = absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'");
  EXPECT_EQ(std::system(command.c_str()), 0);
  return dir;
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A checkpoint with awkward values: -0, denormals, the largest float, and random bits.
ShardCheckpoint Sample(int shard, int64_t step, int elements = 1000) {
  std::mt19937 rng(static_cast<uint32_t>(step));
  ShardCheckpoint c;
  c.set_shard_id(shard);
  c.set_num_shards(2);
  c.set_step(step);
  c.mutable_cluster()->set_num_workers(3);
  c.mutable_cluster()->mutable_optimizer()->set_type("lamb");
  for (int t = 0; t < 2; ++t) {
    TensorCheckpoint* tensor = c.add_tensors();
    tensor->set_name(absl::StrCat("t", t));
    tensor->add_shape(elements);
    std::vector<float> v(elements), m(elements), s(elements);
    for (int i = 0; i < elements; ++i) {
      v[i] = std::uniform_real_distribution<float>(-1, 1)(rng);
      m[i] = v[i] * 1e-3f;
      s[i] = v[i] * v[i];
    }
    v[0] = -0.0f;
    v[1] = std::numeric_limits<float>::denorm_min();
    v[2] = std::numeric_limits<float>::max();
    tensor->set_values(Floats(v));
    tensor->set_version(step);
    tensor->mutable_optimizer_state()->set_optimizer("lamb");
    tensor->mutable_optimizer_state()->set_step(step);
    tensor->mutable_optimizer_state()->set_slot1(Floats(m));
    tensor->mutable_optimizer_state()->set_slot2(Floats(s));
  }
  for (int w = 0; w < 3; ++w) {
    WorkerCheckpoint* worker = c.add_workers();
    worker->set_worker_id(w);
    worker->set_batch_size(64);
    worker->set_clock(step);
  }
  c.set_global_batch(192);
  c.set_steps_per_epoch(100);
  c.set_total_steps(1000);
  return c;
}

void Damage(const std::string& path, size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x01));
}

TEST(CheckpointTest, RoundTripsBitExactly) {
  const std::string dir = FreshDir("roundtrip");
  const ShardCheckpoint c = Sample(1, 40);
  ASSERT_TRUE(WriteCheckpoint(dir, c, 3).ok());
  absl::StatusOr<ShardCheckpoint> back = ReadCheckpoint(CheckpointPath(dir, 1, 40));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), c.SerializeAsString());
  absl::StatusOr<std::optional<LoadedCheckpoint>> newest = LoadNewestCheckpoint(dir, 1);
  ASSERT_TRUE(newest.ok()) << newest.status();
  ASSERT_TRUE(newest->has_value());
  EXPECT_EQ((*newest)->checkpoint.step(), 40);
  EXPECT_TRUE((*newest)->skipped.empty());
  // Another shard's files are not this shard's.
  absl::StatusOr<std::optional<LoadedCheckpoint>> other = LoadNewestCheckpoint(dir, 0);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->has_value());
}

TEST(CheckpointTest, KeepsTheNewestAndListsThemNewestFirst) {
  const std::string dir = FreshDir("keep");
  for (int64_t step : {10, 20, 30, 40}) ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, step), 2).ok());
  ASSERT_TRUE(WriteCheckpoint(dir, Sample(1, 10), 2).ok());  // Another shard's: untouched.
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 0);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[0].step, 40);
  EXPECT_EQ((*files)[1].step, 30);
  EXPECT_EQ(ListCheckpoints(dir, 1)->size(), 1u);
}

// What a roll-back to a step the writer skipped answers with: the newest step at or before it.
TEST(CheckpointTest, TheNewestCheckpointAtOrBeforeAStepIsFoundByName) {
  const std::string dir = FreshDir("at_most");
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir + "/none", 0, 100), -1) << "no directory";
  for (int64_t step : {0, 8, 16}) ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, step), 5).ok());
  ASSERT_TRUE(WriteCheckpoint(dir, Sample(1, 12), 5).ok());  // Another shard's.
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir, 0, 16), 16);
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir, 0, 12), 8);
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir, 0, 7), 0);
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir, 0, -1), -1);
  EXPECT_EQ(*NewestCheckpointStepAtMost(dir, 1, 11), -1);
}

TEST(CheckpointTest, ADamagedCheckpointIsSkippedForThePreviousOneNamingWhy) {
  struct Case {
    std::string what;
    std::function<void(const std::string&)> damage;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"a flipped payload byte", [](const std::string& p) { Damage(p, 5000); },
       "checksum mismatch"},
      {"a flipped magic byte", [](const std::string& p) { Damage(p, 0); }, "bad magic"},
      {"a truncated file", [](const std::string& p) { ASSERT_EQ(::truncate(p.c_str(), 3000), 0); },
       "truncated"},
      {"an empty file", [](const std::string& p) { ASSERT_EQ(::truncate(p.c_str(), 0), 0); },
       "truncated"},
      {"another step's contents",
       [](const std::string& p) {
         // The step-20 file copied over the step-30 one.
         const std::string step20 = p.substr(0, p.size() - 17) + "000000000020.ckpt";
         ASSERT_EQ(std::system(absl::StrCat("cp '", step20, "' '", p, "'").c_str()), 0);
       },
       "not what its name says"},
  };
  for (const Case& c : cases) {
    const std::string dir = FreshDir("damaged");
    ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, 20), 3).ok());
    ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, 30), 3).ok());
    c.damage(CheckpointPath(dir, 0, 30));
    absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = LoadNewestCheckpoint(dir, 0);
    ASSERT_TRUE(loaded.ok()) << c.what << ": " << loaded.status();
    ASSERT_TRUE(loaded->has_value()) << c.what;
    EXPECT_EQ((*loaded)->checkpoint.step(), 20) << c.what;
    ASSERT_EQ((*loaded)->skipped.size(), 1u) << c.what;
    EXPECT_THAT((*loaded)->skipped[0], HasSubstr(c.why)) << c.what;
    EXPECT_THAT((*loaded)->skipped[0], HasSubstr("step-000000000030")) << c.what;
  }
}

TEST(CheckpointTest, OnlyDamagedCheckpointsIsAnErrorNotAFreshStart) {
  const std::string dir = FreshDir("alldamaged");
  ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, 20), 3).ok());
  Damage(CheckpointPath(dir, 0, 20), 100);
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = LoadNewestCheckpoint(dir, 0);
  EXPECT_TRUE(absl::IsDataLoss(loaded.status())) << loaded.status();
  EXPECT_THAT(loaded.status().message(), HasSubstr("checksum mismatch"));
  // No directory at all: nothing to restore, not an error.
  absl::StatusOr<std::optional<LoadedCheckpoint>> none =
      LoadNewestCheckpoint(dir + "/does-not-exist", 0);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST(CheckpointTest, AFullDiskIsAClearErrorAndThePreviousCheckpointSurvives) {
  const std::string dir = FreshDir("full");
  ASSERT_TRUE(WriteCheckpoint(dir, Sample(0, 10), 3).ok());
  // A child whose files may not grow past 4 KiB: the next checkpoint (8 KB+) cannot be written,
  // as on a full disk.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const absl::Status s = WriteCheckpoint(dir, Sample(0, 20), 3);
    const std::string text = s.ToString();
    if (::write(pipe_fds[1], text.data(), text.size()) < 0) _exit(2);
    _exit(s.ok() ? 0 : 1);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buffer[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) message.append(buffer, n);
  ::close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_EQ(WEXITSTATUS(status), 1) << message;
  EXPECT_THAT(message, HasSubstr("checkpoint: cannot write"));
  EXPECT_THAT(message, HasSubstr("File too large"));
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 0);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 1u) << "a partial checkpoint was left behind";
  EXPECT_EQ((*files)[0].step, 10);
  EXPECT_TRUE(ReadCheckpoint((*files)[0].path).ok());
  EXPECT_EQ(std::system(absl::StrCat("ls '", dir, "' | grep -q tmp").c_str()) == 0, false)
      << "the temporary file was left behind";
}

TEST(CheckpointTest, ARollbackMarkerRoundTripsAndFinishingItDropsTheAbandonedSteps) {
  const std::string dir = FreshDir("rollback_marker");
  for (int64_t step : {20, 40, 60}) ASSERT_TRUE(WriteCheckpoint(dir, Sample(1, step, 10), 5).ok());
  absl::StatusOr<std::optional<RollbackMarker>> none = ReadRollbackMarker(dir, 1);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE(WriteRollbackMarker(dir, 1, RollbackMarker{40, 0xabcdef}).ok());
  absl::StatusOr<std::optional<RollbackMarker>> marker = ReadRollbackMarker(dir, 1);
  ASSERT_TRUE(marker.ok()) << marker.status();
  ASSERT_TRUE(marker->has_value());
  EXPECT_EQ((*marker)->step, 40);
  EXPECT_EQ((*marker)->recovery_id, 0xabcdefu);
  // The marker is not a checkpoint.
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 1);
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(files->size(), 3u);
  ASSERT_TRUE(FinishRollback(dir, 1, 40).ok());
  files = ListCheckpoints(dir, 1);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[0].step, 40) << "step 60 was abandoned by the roll-back";
  marker = ReadRollbackMarker(dir, 1);
  ASSERT_TRUE(marker.ok());
  EXPECT_FALSE(marker->has_value()) << "the marker outlived its roll-back";
  // A damaged marker is an error naming it, never silently ignored.
  std::ofstream(RollbackMarkerPath(dir, 1)) << "RBROLLB\n garbage";
  marker = ReadRollbackMarker(dir, 1);
  EXPECT_EQ(marker.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(marker.status().message().find(RollbackMarkerPath(dir, 1)), std::string::npos)
      << marker.status();
}

TEST(CheckpointTest, UnfinishedWritesOfTheShardAreRemovedAtStart) {
  const std::string dir = FreshDir("stale_temporaries");
  ASSERT_TRUE(WriteCheckpoint(dir, Sample(2, 20, 10), 3).ok());
  for (const std::string name : {"shard-2-step-000000000040.ckpt.tmp-123", "shard-2.rollback.tmp-9",
                                 "shard-1-step-000000000040.ckpt.tmp-5", "notes.txt"}) {
    std::ofstream(dir + "/" + name) << "x";
  }
  absl::StatusOr<int> removed = RemoveStaleTemporaries(dir, 2);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 2);
  EXPECT_EQ(::access((dir + "/shard-1-step-000000000040.ckpt.tmp-5").c_str(), F_OK), 0)
      << "another shard's file was removed";
  EXPECT_EQ(::access((dir + "/notes.txt").c_str(), F_OK), 0);
  EXPECT_EQ(::access(CheckpointPath(dir, 2, 20).c_str(), F_OK), 0);
  EXPECT_NE(::access((dir + "/shard-2.rollback.tmp-9").c_str(), F_OK), 0);
}

}  // namespace
}  // namespace rubato
