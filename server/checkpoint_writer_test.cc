// CheckpointWriter: writes in the background, keeps at most one capture waiting (a newer one
// replaces it), reports a failed write without stopping, and finishes what it holds when it goes.
#include "server/checkpoint_writer.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"

namespace rubato {
namespace {

std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/", name);
  EXPECT_EQ(std::system(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'").c_str()), 0);
  return dir;
}

std::shared_ptr<const CapturedCheckpoint> Capture(int64_t step) {
  auto c = std::make_shared<CapturedCheckpoint>();
  c->step = step;
  return c;
}

// What ParameterShard::CheckpointProto would make of a capture, minus the tensors.
ShardCheckpoint Proto(const CapturedCheckpoint& c) {
  ShardCheckpoint p;
  p.set_shard_id(3);
  p.set_step(c.step);
  return p;
}

std::vector<int64_t> Steps(const std::string& dir) {
  std::vector<int64_t> steps;
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, 3);
  EXPECT_TRUE(files.ok()) << files.status();
  if (files.ok()) {
    for (const CheckpointFile& f : *files) steps.push_back(f.step);
  }
  return steps;
}

TEST(CheckpointWriterTest, WritesInTheBackgroundAndKeepsTheNewest) {
  const std::string dir = FreshDir("writer_keeps");
  CheckpointWriter writer(dir, 2, Proto);
  for (int64_t step : {10, 20, 30}) {
    writer.Submit(Capture(step));
    ASSERT_TRUE(writer.Idle(absl::Seconds(10)));
  }
  const CheckpointWriter::Counts counts = writer.counts();
  EXPECT_EQ(counts.written, 3);
  EXPECT_EQ(counts.failed, 0);
  EXPECT_EQ(counts.skipped, 0);
  EXPECT_EQ(counts.last_step, 30);
  EXPECT_GT(counts.last_bytes, 0);
  EXPECT_EQ(Steps(dir), std::vector<int64_t>({30, 20}));
}

TEST(CheckpointWriterTest, ANewerCaptureReplacesTheOneWaitingWhileADiskIsSlow) {
  const std::string dir = FreshDir("writer_replaces");
  absl::Notification first_started, release;
  auto slow = [&](const CapturedCheckpoint& c) {
    if (c.step == 10) {
      first_started.Notify();
      release.WaitForNotification();  // The "disk" is busy with step 10.
    }
    return Proto(c);
  };
  {
    CheckpointWriter writer(dir, 5, slow);
    writer.Submit(Capture(10));
    first_started.WaitForNotification();
    writer.Submit(Capture(20));  // Waits...
    writer.Submit(Capture(30));  // ...and is replaced: memory stays at one waiting capture.
    EXPECT_FALSE(writer.Idle(absl::Milliseconds(50)));
    release.Notify();
    ASSERT_TRUE(writer.Idle(absl::Seconds(10)));
    EXPECT_EQ(writer.counts().skipped, 1);
    EXPECT_EQ(writer.counts().written, 2);
    writer.Submit(Capture(40));  // The destructor finishes it.
  }
  EXPECT_EQ(Steps(dir), std::vector<int64_t>({40, 30, 10}));
}

TEST(CheckpointWriterTest, AFailedWriteIsCountedAndNamedAndTheWriterGoesOn) {
  const std::string dir = FreshDir("writer_fails");
  const std::string missing = dir + "/not-a-directory";
  ASSERT_EQ(std::system(absl::StrCat("touch '", missing, "'").c_str()), 0);
  CheckpointWriter writer(missing, 2, Proto);
  writer.Submit(Capture(10));
  ASSERT_TRUE(writer.Idle(absl::Seconds(10)));
  CheckpointWriter::Counts counts = writer.counts();
  EXPECT_EQ(counts.written, 0);
  EXPECT_EQ(counts.failed, 1);
  EXPECT_FALSE(counts.last_error.ok());
  EXPECT_NE(counts.last_error.message().find(missing), std::string::npos) << counts.last_error;
  writer.Submit(Capture(20));
  ASSERT_TRUE(writer.Idle(absl::Seconds(10)));
  EXPECT_EQ(writer.counts().failed, 2);
}

}  // namespace
}  // namespace rubato
