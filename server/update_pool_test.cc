#include "server/update_pool.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(UpdatePoolTest, OneThreadRunsTasksInOrderAndTheDestructorRunsWhatIsQueued) {
  absl::Mutex mu;
  std::vector<int> order;
  {
    UpdatePool pool(1);
    for (int i = 0; i < 100; ++i) {
      pool.Post([&, i] {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      });
    }
  }
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(UpdatePoolTest, SeveralThreadsRunEveryTaskOnce) {
  absl::Mutex mu;
  std::vector<int> runs(1000, 0);
  {
    UpdatePool pool(4);
    for (int i = 0; i < 1000; ++i) {
      pool.Post([&, i] {
        absl::MutexLock lock(&mu);
        ++runs[i];
      });
    }
  }
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(runs[i], 1) << i;
}

}  // namespace
}  // namespace rubato
