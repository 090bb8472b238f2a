#include "tests/subprocess.h"

#include <csignal>
#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

class SubprocessTest : public ::testing::Test {
 protected:
  std::unique_ptr<Subprocess> StartShell(const std::string& name, const std::string& script) {
    auto p = Subprocess::Start(name, {"/bin/sh", "-c", script}, Path(name + ".out"),
                               Path(name + ".err"));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  static std::string Path(const std::string& file) { return ::testing::TempDir() + file; }
};

TEST_F(SubprocessTest, ReturnsExitCodeAndCapturesOutput) {
  auto p = StartShell("exit3", "echo out; echo err >&2; exit 3");
  ASSERT_NE(p, nullptr);
  absl::StatusOr<int> status = p->Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, 3);
  EXPECT_EQ(p->ReadStdout(), "out\n");
  EXPECT_EQ(p->ReadStderr(), "err\n");
  // A reaped child keeps its status and can no longer be signalled.
  EXPECT_EQ(*p->Wait(absl::ZeroDuration()), 3);
  EXPECT_EQ(p->Signal(SIGTERM).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SubprocessTest, DeathBySignalIs128PlusSignal) {
  auto p = StartShell("self-term", "kill -TERM $$");
  ASSERT_NE(p, nullptr);
  absl::StatusOr<int> status = p->Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, 128 + SIGTERM);
}

TEST_F(SubprocessTest, WaitTimesOutNamingTheProcessThenKillEndsIt) {
  auto p = StartShell("sleeper", "exec sleep 30");
  ASSERT_NE(p, nullptr);
  absl::StatusOr<int> status = p->Wait(absl::Milliseconds(50));
  EXPECT_EQ(status.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.status().message().find("sleeper"), absl::string_view::npos) << status.status();
  p->Kill();
  status = p->Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, 128 + SIGKILL);
}

TEST_F(SubprocessTest, SignalReachesTheChild) {
  auto p = StartShell("trapper", "trap 'exit 7' USR1; echo ready; while :; do sleep 0.01; done");
  ASSERT_NE(p, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (p->ReadStdout() != "ready\n" && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(p->ReadStdout(), "ready\n");
  ASSERT_TRUE(p->Signal(SIGUSR1).ok());
  absl::StatusOr<int> status = p->Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, 7);
}

TEST_F(SubprocessTest, MissingBinaryIsNotFound) {
  auto p = Subprocess::Start("ghost", {"/nonexistent/ghost"}, Path("ghost.out"), Path("ghost.err"));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
  EXPECT_NE(p.status().message().find("/nonexistent/ghost"), absl::string_view::npos);
}

TEST_F(SubprocessTest, DestructorKillsARunningChild) {
  pid_t pid;
  {
    auto p = StartShell("orphan", "exec sleep 30");
    ASSERT_NE(p, nullptr);
    pid = p->pid();
  }
  // Reaped by the destructor: the pid no longer names a process (or a zombie) of ours.
  EXPECT_NE(kill(pid, 0), 0);
}

}  // namespace
}  // namespace rubato
