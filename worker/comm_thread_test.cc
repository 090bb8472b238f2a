#include "worker/comm_thread.h"

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(CommThreadTest, RunsTasksInOrderOffTheCallersThread) {
  CommThread comm;
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  for (int i = 0; i < 50; ++i) {
    comm.Post("task", [&, i] {
      order.push_back(i);
      ran_on.push_back(std::this_thread::get_id());
    });
  }
  ASSERT_TRUE(comm.Drain(absl::Seconds(30)).ok());
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(order[i], i);
    EXPECT_NE(ran_on[i], std::this_thread::get_id());
    EXPECT_EQ(ran_on[i], ran_on[0]);
  }
  EXPECT_EQ(comm.tasks_run(), 50);
}

TEST(CommThreadTest, DrainTimesOutNamingTheTaskAndThoseBehindIt) {
  CommThread comm;
  absl::Notification release;
  comm.Post("push of step 7 (dense1)", [&] { release.WaitForNotification(); });
  comm.Post("push of step 7 (dense0)", [] {});
  const absl::Status s = comm.Drain(absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("push of step 7 (dense1) is running"), absl::string_view::npos)
      << s.message();
  EXPECT_NE(s.message().find("1 more wait"), absl::string_view::npos) << s.message();
  release.Notify();
  EXPECT_TRUE(comm.Drain(absl::Seconds(30)).ok());
  EXPECT_EQ(comm.tasks_run(), 2);
}

TEST(CommThreadTest, DrainWithNothingPostedReturnsAtOnce) {
  CommThread comm;
  EXPECT_TRUE(comm.Drain(absl::ZeroDuration()).ok());
}

TEST(CommThreadTest, DestructionRunsWhatIsQueued) {
  int ran = 0;
  {
    CommThread comm;
    for (int i = 0; i < 10; ++i) comm.Post("task", [&] { ++ran; });
  }
  EXPECT_EQ(ran, 10);
}

}  // namespace
}  // namespace rubato
